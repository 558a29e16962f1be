"""Ranks end cleanly, with the exit code their program chose, after a peer failed.

Gloo objects of a failed group, destructed during interpreter teardown, block on a stopped
peer or abort the process (SIGABRT) on a dead one; the library's exit guard must prevent
both, and keep the exit code the program chose (``sys.exit(n)``, ``raise SystemExit(n)``,
an uncaught exception, a normal end), after Python joined the non-daemon threads. The same
holds for ``rd.spawn`` children, with or without a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _exit_workers

ROOT = Path(__file__).resolve().parent.parent


def _start(
    module: str, entry: str, env: dict[str, str], *, session: bool = False
) -> subprocess.Popen[str]:
    """Run ``module.entry()`` in a new Python process from the project's root, its output
    (both streams) captured as text; ``session``: in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-c", f"from {module} import {entry} as m; m()"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=session,
    )


@pytest.mark.parametrize(
    ("fault", "end", "code"),
    [("kill", "destroy", 0), ("kill", "return", 0), ("stop", "destroy", 0), ("stop", "exit3", 3)],
)
def test_survivors_exit_with_their_own_code(fault: str, end: str, code: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(3):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "RD_TEST_FAULT": fault,
            "RD_TEST_END": end,
        }
        procs.append(_start("tests._workers", "standalone_main", env))
    try:
        outs = {}
        deadline = time.monotonic() + 40
        for r in (0, 1):
            outs[r] = procs[r].communicate(timeout=max(1, deadline - time.monotonic()))[0]
        for r in (0, 1):
            assert f"rank {r} caught RankFailureError naming [2]" in outs[r] or (
                f"rank {r} caught CollectiveTimeoutError naming [2]" in outs[r]
            ), outs[r]
            assert procs[r].returncode == code, (r, procs[r].returncode, outs[r][-2000:])
            assert "terminate called" not in outs[r]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()


# -- exit codes never lie (issue 15, defect 7) ----------------------------------------------
# Ranks 0-4 survive and end in these ways (tests/_exit_workers.py); rank 5 is the culprit.
SURVIVOR_ENDS = ["raise3", "exit4", "quit5", "raise", "return"]
CULPRIT = len(SURVIVOR_ENDS)
WORLD = CULPRIT + 1
# Every case ends within this (pytest-timeout is 120 s); what is still running is killed.
DEADLINE_S = 90.0


def _report(outs: dict[int, str], codes: dict[int, int | None]) -> str:
    return "\n".join(
        f"--- rank {r} (exit code {codes.get(r)}):\n{outs.get(r, '')[-3000:]}" for r in sorted(outs)
    )


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_exit_code_is_the_programs_after_a_failure(fault: str, tmp_path: Path) -> None:
    """srun-style ranks (plain processes, the store hosted by the test): after a peer's
    failure armed the exit guard, ``raise SystemExit(3)`` exits 3, ``sys.exit(4)`` 4,
    ``exit(5)`` 5, an uncaught exception 1, a normal end 0, and each rank's non-daemon
    thread still finishes its write before the process ends."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: dict[int, subprocess.Popen[str]] = {}
    outs: dict[int, str] = {}
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "OMP_NUM_THREADS": "1",
                "RD_EXIT_FAULT": fault,
                "RD_EXIT_CULPRIT": str(CULPRIT),
                "RD_EXIT_ENDS": ",".join([*SURVIVOR_ENDS, "return"]),
                "RD_EXIT_OUT": str(tmp_path),
            }
            # Its group holds whatever it starts: killed below.
            procs[rank] = _start("tests._exit_workers", "standalone_main", env, session=True)
        for rank in range(CULPRIT):
            try:
                outs[rank] = procs[rank].communicate(timeout=max(1, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                outs[rank] = "(still running at the deadline; killed)"
            codes[rank] = procs[rank].returncode
        problems = []
        for rank, end in enumerate(SURVIVOR_ENDS):
            out = outs[rank]
            if "exit guard armed: True" not in out:
                problems.append(f"rank {rank}: the failure did not arm the exit guard")
            if codes[rank] != _exit_workers.CODES[end]:
                problems.append(
                    f"rank {rank} ({end}): exit code {codes[rank]}, "
                    f"expected {_exit_workers.CODES[end]}"
                )
            if not (tmp_path / f"thread{rank}").exists():
                problems.append(f"rank {rank} ({end}): its non-daemon thread was cut off")
            for bad in ("terminate called", "Fatal Python error", "Aborted"):
                if bad in out:
                    problems.append(f"rank {rank}: {bad!r} in its output")
        assert not problems, "\n".join(problems) + "\n" + _report(outs, codes)
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()


def test_rd_spawn_child_ends_with_its_code_and_threads_after_a_failure(tmp_path: Path) -> None:
    """The same ends in ``rd.spawn`` children: the exit codes the launcher sees are the
    program's, and every non-daemon thread finished its write."""
    ends = [*SURVIVOR_ENDS, "return"]
    outcomes = run_ranks(
        _exit_workers.run,
        WORLD,
        args=("kill", CULPRIT, ends, str(tmp_path)),
        timeout=timedelta(seconds=DEADLINE_S),
        grace=timedelta(seconds=DEADLINE_S),
    )
    report = format_outcomes(outcomes)
    for rank, end in enumerate(SURVIVOR_ENDS):
        assert outcomes[rank].exitcode == _exit_workers.CODES[end], (rank, end, report)
        assert (tmp_path / f"thread{rank}").exists(), (rank, end, report)
    assert outcomes[SURVIVOR_ENDS.index("return")].value is True, ("guard not armed", report)
    assert outcomes[CULPRIT].exitcode == -signal.SIGKILL, report


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_rd_spawn_child_joins_non_daemon_threads(start_method: str, tmp_path: Path) -> None:
    """Without any failure, an ``rd.spawn`` child ends as a plain Python process: its
    non-daemon thread finishes (it writes 0.5 s after the function returned), exit code 0."""
    outcomes = run_ranks(
        _exit_workers.run,
        2,
        args=("kill", -1, ["return", "return"], str(tmp_path)),
        timeout=timedelta(seconds=DEADLINE_S),
        start_method=start_method,
    )
    report = format_outcomes(outcomes)
    assert [o.exitcode for o in outcomes] == [0, 0], report
    assert [o.value for o in outcomes] == [False, False], ("guard armed", report)
    assert all((tmp_path / f"thread{r}").exists() for r in range(2)), report


@pytest.mark.parametrize(
    ("end", "env", "expected"),
    [
        ("return", {}, 0),
        ("raise3", {}, 3),
        ("message", {}, 1),
        ("interrupt", {}, -signal.SIGINT),
        ("raise3", {"RD_EXIT_FORK_FAILS": "1"}, 3),
        ("return", {"RD_EXIT_FORK_FAILS": "1"}, 0),
        ("quit5", {"RD_EXIT_SIGCHLD_IGNORED": "1"}, 5),
    ],
)
def test_armed_guard_keeps_the_interpreters_code(
    end: str, env: dict[str, str], expected: int, tmp_path: Path
) -> None:
    """The guard alone (armed directly, no process group): the process ends as Python
    would have ended it (``sys.exit("message")`` prints it and exits 1, Ctrl-C ends it by
    SIGINT), also when ``fork`` fails or SIGCHLD is ignored; its non-daemon thread ends."""
    # The guard's copy of the process is in its group too.
    proc = _start(
        "tests._exit_workers",
        "guard_only_main",
        {**os.environ, "RD_EXIT_END": end, "RD_EXIT_OUT": str(tmp_path), **env},
        session=True,
    )
    try:
        try:
            out = proc.communicate(timeout=DEADLINE_S)[0]
        except subprocess.TimeoutExpired:
            out = "(still running at the deadline; killed)"
        assert proc.returncode == expected, out
        assert "exit guard armed: True" in out, out
        assert (tmp_path / "thread0").exists(), out
        if end == "message":
            assert "a message instead of a code" in out, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_exit_waits_until_no_gloo_worker_is_runnable(monkeypatch: pytest.MonkeyPatch) -> None:
    """At exit the library waits, with the GIL released, until gloo's workers have been seen
    idle twice in a row: a worker preempted right after completing an op still has to free
    the op's tensors under the GIL, and during finalization that aborts the process."""
    from resilient_ddp.group import process_group as pg

    seen = iter([1, 1, 0, 1, 0, 0, 1])
    calls: list[int] = []

    def fake() -> int:
        calls.append(1)
        return next(seen)

    monkeypatch.setattr(pg, "_runnable_backend_threads", fake)
    assert pg._let_backend_threads_settle(5.0) is True
    assert len(calls) == 6  # not before two quiet samples in a row

    monkeypatch.setattr(pg, "_runnable_backend_threads", lambda: 1)
    t0 = time.monotonic()
    assert pg._let_backend_threads_settle(0.2) is False  # a bound, not a hang
    assert 0.2 <= time.monotonic() - t0 < 2.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_busy_thread_named_as_gloos_worker_is_counted_runnable() -> None:
    """The count reads each thread's name and state from /proc: a thread named as gloo's
    worker that computes without the GIL is seen runnable, and no longer once it ended."""
    import ctypes
    import hashlib
    import threading

    from resilient_ddp.group import process_group as pg

    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()

    def busy() -> None:
        libc.prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
        data = bytes(1 << 20)
        while not stop.is_set():
            hashlib.sha256(data).digest()  # hashes without the GIL

    assert pg._runnable_backend_threads() == 0
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while pg._runnable_backend_threads() == 0:
            assert time.monotonic() < deadline, "the busy worker was never seen runnable"
            time.sleep(0.001)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    deadline = time.monotonic() + 10  # the OS thread ends a moment after join returns
    while pg._runnable_backend_threads() != 0:
        assert time.monotonic() < deadline, "an ended thread is still counted"
        time.sleep(0.001)


_LIGHT_EXIT = """
import atexit, gc, sys
# Registered before the library's handler: runs after it. Compared with the count after the
# imports: nox's start-up hook (tests/_startup/_suite_gc.py) froze torch's import already.
imported = []
atexit.register(lambda: print("frozen", gc.get_freeze_count() > imported[0], flush=True))
import resilient_ddp as rd
imported.append(gc.get_freeze_count())


class Cycle:
    def __init__(self, path):
        self.me, self.path = self, path

    def __del__(self):
        with open(self.path, "w") as f:
            f.write("finalized")


if sys.argv[1] == "rank":
    rd.init_process_group("gloo")
    rd.destroy_process_group()
Cycle(sys.argv[2])  # garbage in a cycle, left at exit
"""


@pytest.mark.parametrize("role", ["rank", "import_only"])
def test_a_rank_exits_without_the_last_collections_and_still_finalizes_its_garbage(
    role: str, tmp_path: Path
) -> None:
    """A process that was a rank of the library skips the interpreter's last garbage
    collections at a healthy exit (gc.freeze: 0.6 s of CPU less a rank), after collecting
    the garbage that exists, whose finalizers still run; a process that only imports the
    library exits as Python does."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    marker = tmp_path / "finalized.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _LIGHT_EXIT, role, str(marker)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"frozen {role == 'rank'}" in out, out
    assert marker.read_text() == "finalized", out
