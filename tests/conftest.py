"""Autouse fixtures that keep each test hermetic, after Lightning's ``tests_fabric/conftest.py``.

Each test must leave behind no environment variables, no process group, no threads and
no child processes. Otherwise the next test would inherit them, and a failure would show
up far from its cause. The fixtures are set up in the order written here and torn down in
reverse: the process group is destroyed first, then child processes are killed, then the
threads are checked, and the environment is checked last.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

# Variables that may differ after a test without failing it. Every entry needs a reason.
_ENV_ALLOWLIST = frozenset(
    {
        # pytest rewrites it for each phase (setup/call/teardown) of every test.
        "PYTEST_CURRENT_TEST",
        # torch's in-process launchers (`torch.distributed.run.main`, `elastic_launch`) set
        # these in the *launching* process. They are still restored after the test.
        "OMP_NUM_THREADS",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
        # The first import of torch._dynamo sets this as a side effect
        # (torch/_dynamo/package.py -> cache_dir()). Constructing DDP triggers that import,
        # so whichever test builds the first DDP model would fail, depending on test order.
        "TORCHINDUCTOR_CACHE_DIR",
        # Set by inductor when it launches a Triton kernel (CUDA + torch.compile only).
        "TRITON_CACHE_DIR",
    }
)
# Owned by pytest: never restored by us (pytest removes it itself after teardown).
_ENV_PYTEST_OWNED = frozenset({"PYTEST_CURRENT_TEST"})

# How long the thread police waits for new threads that are already finishing.
_THREAD_JOIN_GRACE_S = 2.0
# Name prefixes of threads that some tool starts and owns, so a test cannot stop them.
# Empty for now: no tool thread outlived a test when this was checked with
# pytest-timeout's signal method (the Linux default), hypothesis, mp.spawn + gloo, DDP
# with a comm hook, and torchrun. Add a prefix only together with the tool that needs it.
_THREAD_NAME_ALLOWLIST: tuple[str, ...] = ()

_CHILD_TERMINATE_GRACE_S = 2.0
# How long a process orphaned by a test may take to notice and end (torch's DataLoader
# workers check their parent every 5 s).
_ORPHAN_GRACE_S = 6.0


# Where faulthandler writes (a copy of the real stderr), and whether this conftest enabled it.
_FAULTHANDLER_FD = pytest.StashKey[int]()
_FAULTHANDLER_ENABLED_HERE = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Turn on faulthandler, so that a crash or a hang leaves a stack of every thread.

    pytest's faulthandler plugin normally has it on already; this covers a run with
    ``-p no:faulthandler``. It also makes ``kill -USR1 <pytest pid>`` dump every thread's
    stack and keep running, for looking inside a stuck test. Both write to the real
    stderr. pytest's fd capture is suspended while the descriptor is copied, because
    otherwise a dump during a passing test would go into its discarded captured output.
    """
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    try:
        fd = os.dup(sys.__stderr__.fileno() if sys.__stderr__ is not None else 2)
    finally:
        if capman is not None:
            capman.resume_global_capture()
    config.stash[_FAULTHANDLER_FD] = fd
    config.stash[_FAULTHANDLER_ENABLED_HERE] = not faulthandler.is_enabled()
    if config.stash[_FAULTHANDLER_ENABLED_HERE]:
        faulthandler.enable(file=fd, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Undo :func:`pytest_configure` before its descriptor is closed."""
    if _FAULTHANDLER_FD not in config.stash:
        return
    if hasattr(signal, "SIGUSR1"):
        faulthandler.unregister(signal.SIGUSR1)
    if config.stash[_FAULTHANDLER_ENABLED_HERE]:
        faulthandler.disable()
    os.close(config.stash[_FAULTHANDLER_FD])


@pytest.fixture(autouse=True)
def restore_env_variables() -> Iterator[None]:
    """Fail a test that adds, changes or removes environment variables, then restore them.

    Set variables with ``monkeypatch.setenv``. monkeypatch is undone before this check runs.
    """
    before = dict(os.environ)
    yield
    after = dict(os.environ)

    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])

    # Restore first, so that a failure here does not spread to the next test.
    for key in added:
        if key not in _ENV_PYTEST_OWNED:
            del os.environ[key]
    for key in removed + changed:
        if key not in _ENV_PYTEST_OWNED:
            os.environ[key] = before[key]

    problems = [
        f"{kind} {key}={after.get(key, before.get(key))!r}"
        for kind, keys in (("added", added), ("removed", removed), ("changed", changed))
        for key in keys
        if key not in _ENV_ALLOWLIST
    ]
    if problems:
        pytest.fail("test leaked environment variable(s): " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def thread_police() -> Iterator[None]:
    """Fail a test that leaves any new thread running, daemon or not.

    Threads that are already finishing get up to 2 s in total to exit. Some threads are
    skipped: ``threading._DummyThread`` entries, which stand for threads started outside
    Python (gloo/c10d C++ threads that ran a Python callback), cannot be joined and never
    leave ``threading.enumerate()`` on 3.11. Threads whose names are in
    ``_THREAD_NAME_ALLOWLIST`` are skipped too.
    """
    before = set(threading.enumerate())
    yield
    candidates = [
        t
        for t in threading.enumerate()
        if t not in before
        and not isinstance(t, threading._DummyThread)
        and not t.name.startswith(_THREAD_NAME_ALLOWLIST)
    ]
    deadline = time.monotonic() + _THREAD_JOIN_GRACE_S
    for thread in candidates:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [t for t in candidates if t.is_alive()]
    if alive:
        described = ", ".join(f"{t.name!r} (daemon={t.daemon}, ident={t.ident})" for t in alive)
        pytest.fail(f"test left thread(s) running: {described}", pytrace=False)


def _session_orphans() -> dict[int, str]:
    """Processes of this session that lost their parent (now init's children), by pid:
    what a killed rank leaves behind when its own children (DataLoader workers, a fork
    server) do not end with it. ``multiprocessing.active_children()`` cannot see them."""
    sid = os.getsid(0)
    found: dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid, session = fields[0], int(fields[1]), int(fields[3])
        if ppid == 1 and session == sid and state != "Z":
            found[int(entry)] = cmd[:160]
    return found


def _fail_on_new_orphans(before: dict[int, str]) -> None:
    """Fail the test if processes it orphaned are still alive after a grace (a worker
    that notices its parent's end polls every 5 s in torch), after killing them."""
    deadline = time.monotonic() + _ORPHAN_GRACE_S
    while True:
        new = {p: c for p, c in _session_orphans().items() if p not in before}
        if not new or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not new:
        return
    for pid in new:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    described = "; ".join(f"pid {p}: {c}" for p, c in new.items())
    pytest.fail(
        f"test left orphaned process(es) running {_ORPHAN_GRACE_S:.0f} s after it ended "
        f"(their parent died without ending them): {described}",
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail a test that leaves ``multiprocessing`` children alive, after killing them.

    Only children started during the test count, so a session-scoped fixture may keep a
    helper process. Children are sent SIGTERM, then SIGKILL if they ignore it, so they
    never outlive the test. ``subprocess.Popen`` children are not visible here. A test
    that starts one must wait for it itself. Processes of this session that the test
    orphaned (a killed rank's DataLoader workers) fail it too, after a grace.
    """
    before = set(multiprocessing.active_children())
    orphans_before = _session_orphans()
    yield
    leftover = [p for p in multiprocessing.active_children() if p not in before]
    try:
        if not leftover:
            return
        described = ", ".join(f"{p.name} (pid={p.pid})" for p in leftover)
        for proc in leftover:
            proc.terminate()
        deadline = time.monotonic() + _CHILD_TERMINATE_GRACE_S
        for proc in leftover:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=_CHILD_TERMINATE_GRACE_S)
        pytest.fail(f"test left child process(es) running: {described}", pytrace=False)
    finally:
        # Also after killing leftover children: their own children become orphans.
        _fail_on_new_orphans(orphans_before)


@pytest.fixture(autouse=True)
def teardown_process_group() -> Iterator[None]:
    """Destroy the default process group if the test left one initialized."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-slow",
        action="store_true",
        default=False,
        help="skip the tests marked slow (the elastic fault matrix, the hang and churn "
        "cases: minutes in all); CI runs them",
    )
    parser.addoption(
        "--rank-start",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="how run_ranks starts ranks: forks of a server that imported torch once "
        "(forkserver, the default: tens of milliseconds a rank), or a new interpreter each "
        "(spawn: 2-3 s a rank, as cold as a real launch)",
    )


@pytest.fixture
def rank_start(request: pytest.FixtureRequest) -> str:
    """How this session starts ranks (``--rank-start``), for a test that calls
    :func:`resilient_ddp.tools.launch.launch` itself: ``run_ranks`` follows it already."""
    return str(request.config.getoption("--rank-start"))


# What every rank of the multi-process tests imports: the fork server imports it once.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # DDP's constructor imports it (1-3 s on 2 cores)
    "resilient_ddp",
    "tests._workers",
    "tests._ddp_workers",
    "tests._elastic_workers",
    "tests._inference_workers",
)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Start ranks from a fork server with torch imported (see ``--rank-start``).

    A rank that is a fork of that server starts in tens of milliseconds instead of the
    2-3 s that a fresh ``import torch`` costs on 2 cores; it still starts clean (one
    thread, no store connection, default signal handlers: checked by
    ``test_harness.py``). Tests that exercise a real cold start (torchrun, the demo,
    ``doctor``, ``mp.spawn``) start their processes themselves and keep it.
    """
    from resilient_ddp.testing import set_start_method

    method = session.config.getoption("--rank-start")
    set_start_method(method, preload=_PRELOAD if method == "forkserver" else ())


# The longest test files (8 s to a few minutes each on 2 cores). `nox -s tests` hands whole
# files to its workers in collection order (--dist loadfile --no-loadscope-reorder), and
# the suite is CPU-bound: the wall time is shortest when a file that keeps both cores busy
# (cold starts of interpreters: the frameworks, the docs' samples, the launchers) runs beside
# one that mostly waits (timeouts, stuck windows: the elastic fault matrices, busy ranks,
# collectives), and when no long file starts last. This order was chosen for two workers by
# simulating them on each file's measured wall and CPU time alone (sum of CPU / wall: 1.4
# for the frameworks, 0.3-0.6 for the waiting files): 575 s simulated against 616 s for
# longest first. With three workers (nox's setting now) the cores are idle for 35-50 CPU-s
# of a run, and the order matters less. Only the wall time depends on it; a file not listed
# runs after these, in the usual order (tests/test_harness.py checks that every name here
# is a test file).
LONGEST_FILES = (
    "test_frameworks_mp.py",
    "test_busy_mp.py",
    "test_multihost_netns.py",
    "test_inference_pool_mp.py",
    "test_elastic_mp.py",
    "test_control_plane_field.py",
    "test_torchrun_mp.py",
    "test_torch_ddp_suite.py",
    "test_hostile_default.py",
    "test_ddp_mp.py",
    "test_elastic_workers_mp.py",
    "test_inference_mp.py",
    "test_preflight_mp.py",
    "test_generation_leaks.py",
    "test_collectives_mp.py",
    "test_doctor.py",
    "test_docs.py",
    "test_field_mp.py",
    "test_dropin_ddp.py",
    "test_safe_waits_mp.py",
    "test_demo.py",
    "test_store_lag.py",
    "test_launchers_mp.py",
    "test_exit.py",
    "test_dropin_start.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: the tests of a file, and the files not listed, keep their order.
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    if not config.getoption("--skip-slow"):
        return
    skip = pytest.mark.skip(reason="slow: skipped with --skip-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
