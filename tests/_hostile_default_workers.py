"""Attackers of issue 29 ("safe by default"), and the ranks of the jobs they attack with a
secret (tests/test_hostile_default.py).

An attacker is a separate process that reaches the job's store as anyone who reaches its
port could: it knows the address (``127.0.0.1:<port>``), never a secret. Each writes what
it did and what it got to ``OUT/attacker*.json``; each records the moments it was done
with a phase as files in ``OUT`` that the ranks wait for (``gate``, ``armed``,
``replayed``, ``attacked``), so that every attack lands where the test says, with no
sleeping and hoping.

- :func:`attack_default` (torchrun and env://, no secret: items 1, 2 and 6 of the issue):
  garbage over the heartbeats during start-up; once the job runs, a forged failure event
  naming the healthy rank 1 appended to the generation's event log, the detection
  counters deleted, then garbage in the event counter and 64 MiB of junk appended to the
  event log; then the library's own joiner code, and if it is admitted, the job's loop
  and an object collective whose ``__reduce__`` would run code on every rank.
- :func:`plant_preflight` (item 5): a preflight verdict with the attacker's text and
  garbage facts planted before any rank starts.
- :func:`attack_secret` (with a secret, items 4 and 6): an attacker that sees the job's
  keys and values (as one who reads the store's traffic) but not the secret: garbage in
  the event counter before start-up, over the heartbeats during it, 64 MiB of junk in the
  event log; after a real admission it writes back the old ``members`` record and ``gen``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import resilient_ddp as rd
from resilient_ddp.control import _control as ctl

ROOT = Path(__file__).resolve().parent.parent
WORLD = 3
ATTACKER_TEXT = "ATTACKER-CHOSEN TEXT"
JUNK_MIB = 64
WAIT_S = 60.0  # every wait of an attacker for the job: the test's deadline is shorter
# What the attacker writes where the job's heartbeats, counters and decisions go.
GARBAGE = b"\xff\xfe garbage, not this job's {{{"
# Where rd.init_process_group() names the job under torchrun and env:// (attempt 0).
_CURRENT = f"{ctl.attempt_prefix(0)}/{ctl.CURRENT_JOB_KEY}"


class Payload:
    """An object whose unpickling makes a directory ``pwned-<pid>`` in ``out``: code of
    the attacker's choice, run by whoever receives it through an object collective."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        code = f"import os; os.mkdir(os.path.join({self.out!r}, 'pwned-%d' % os.getpid()))"
        return (exec, (code,))


def forged_event(rank: int) -> dict[str, Any]:
    """A failure event in the library's format naming ``rank``, with a host, pid and
    exception text of the attacker's."""
    culprit = {
        "rank": rank,
        "host": "attacker-host",
        "pid": 4242,
        "what": f"raised ValueError: {ATTACKER_TEXT}",
        "op": "all_reduce",
        "seq": 1,
        "step": 1,
        "phase": "",
        "section": "",
        "exc_type": "ValueError",
        "exc_message": ATTACKER_TEXT,
        "traceback": ATTACKER_TEXT,
    }
    return {
        "kind": "exception",
        "rank": rank,
        "secondary": False,
        "culprit": culprit,
        "reporter": rank,
        "gen": 0,
        "t": time.time(),
    }


def _wait_file(path: Path, seconds: float = WAIT_S, *, unless: Path | None = None) -> None:
    """Wait for ``path`` to exist, at most ``seconds``; give up at once when ``unless``
    exists (the job ended: what it was waited for will never come)."""
    end = time.monotonic() + seconds
    while not path.exists():
        if unless is not None and unless.exists():
            raise RuntimeError(f"{unless} appeared before {path}: the job ended")
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def _touch(path: Path) -> None:
    path.touch()


def _connect(port: int) -> dist.TCPStore:
    """A client of the store at 127.0.0.1:``port``, retried until it listens."""
    end = time.monotonic() + WAIT_S
    while True:
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        except (RuntimeError, OSError):
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _junk(root: dist.Store, key: str) -> None:
    """Append ``JUNK_MIB`` MiB to ``key``, 1 MiB a call (each below any per-record cap)."""
    line = (b"j" * ((1 << 20) - 1)) + b"\n"
    for _ in range(JUNK_MIB):
        root.append(key, line)


def _report(out: Path, name: str, report: dict[str, Any]) -> None:
    tmp = out / f"{name}.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(out / f"{name}.json")


# -- default deployments (no secret) ----------------------------------------------------------
def attack_default(out_dir: str) -> None:
    """Attack the job of tests/_torchrun_scripts/hostile_train.py (see the module
    docstring); ends once the job no longer needs it."""
    out = Path(out_dir)
    report: dict[str, Any] = {"pid": os.getpid()}
    joiner = None
    try:
        _wait_file(out / "port")
        port = int((out / "port").read_text())
        joiner = subprocess.Popen(
            [sys.executable, "-c", _JOIN_CODE, str(out), str(port)], env=os.environ.copy()
        )
        store = _connect(port)
        store.wait([_CURRENT], timedelta(seconds=WAIT_S))
        job = store.get(_CURRENT).decode()
        report["job"] = job
        root = dist.PrefixStore(f"{ctl.attempt_prefix(0)}/{ctl.job_prefix(job)}", store)
        # Start-up: garbage over every heartbeat until the job trains.
        writes = 0
        end = time.monotonic() + WAIT_S
        ended = out / "final0.json"
        while not (out / "ready").exists() and time.monotonic() < end and not ended.exists():
            for r in range(WORLD):
                root.set(f"g0/state/{r}", GARBAGE)
            writes += 1
            time.sleep(0.02)
        report["heartbeat_garbage_writes"] = writes
        # Item 1: the library's own joiner code, in a process of its own (started at once,
        # it asks to join once the job trains; if admitted, it trains with the job); the
        # store attacks follow once it knows whether it was admitted.
        _wait_file(out / "joined.json", unless=ended)
        # Item 2: a forged failure of the healthy rank 1, then the detection counters gone,
        # in the first generations (an admission makes a new one).
        gens = [f"g{n}" for n in range(3)]
        for g in gens:
            root.append(f"{g}/ev/log", "\n" + json.dumps(forged_event(1)) + "\n")
            root.add(f"{g}/ev/n", 1)
        deleted = [k for g in gens for k in (f"{g}/ev/n", f"{g}/diag") if root.delete_key(k)]
        report["deleted"] = deleted + (["join/n"] if root.delete_key("join/n") else [])
        # Item 6: garbage in the event counters, 64 MiB of junk in the event log.
        for g in gens:
            root.set(f"{g}/ev/n", GARBAGE)
        _junk(root, f"g{_generation(root)}/ev/log")
        report["junk_mib"] = JUNK_MIB
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    finally:
        _touch(out / "attacked")
        report["joiner_exit"] = _stop(joiner)
        report.update(_read_json(out / "joined.json"))
        _report(out, "attacker", report)


def _generation(root: dist.Store) -> int:
    """The job's current generation as its ``gen`` record says where the attacker can
    read it (unsealed, or after a MAC), else 0."""
    try:
        if not root.check(["gen"]):  # a get would wait for it
            return 0
        text = root.get("gen").decode()
        return int(json.loads(text.rpartition(" ")[2] or text)["gen"])
    except (RuntimeError, ValueError, KeyError, TypeError):
        return 0


def attack_counter(out_dir: str) -> None:
    """Item 6 against the job of hostile_train.py started with ``kill``: once it trains,
    garbage in the event counters of its first generations; then the job's rank 2 kills
    itself (at the first step after ``OUT/attacked``)."""
    out = Path(out_dir)
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        _wait_file(out / "port")
        store = _connect(int((out / "port").read_text()))
        store.wait([_CURRENT], timedelta(seconds=WAIT_S))
        job = store.get(_CURRENT).decode()
        root = dist.PrefixStore(f"{ctl.attempt_prefix(0)}/{ctl.job_prefix(job)}", store)
        _wait_file(out / "ready", unless=out / "final0.json")
        for n in range(3):
            root.set(f"g{n}/ev/n", GARBAGE)
        report["counter_garbage"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    finally:
        _touch(out / "attacked")
        _report(out, "attacker", report)


_JOIN_CODE = (
    "import sys; from tests._hostile_default_workers import join_outsider; "
    "join_outsider(sys.argv[1], int(sys.argv[2]))"
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def join_outsider(out_dir: str, port: int) -> None:
    """Run the library's joiner (``RESILIENT_DDP_JOINER=1``) against the job's store, as
    a replacement would; if admitted, train with the job, then pass a :class:`Payload`
    to ``rd.all_gather_object``. Writes what it got to ``OUT/joined.json`` (once it knows
    whether it was admitted, and again at the end)."""
    from tests._torchrun_scripts import hostile_train

    out = Path(out_dir)
    got: dict[str, Any] = {}
    import torch._dynamo  # noqa: F401 - as the joiner itself does, before the job trains

    try:
        _wait_file(out / "ready", unless=out / "final0.json")
    except RuntimeError as e:
        _report(out, "joined", {"admitted": False, "join_error": f"never tried: {e}"})
        return
    os.environ["RESILIENT_DDP_JOINER"] = "1"
    # The store torch would hand the joiner under torchrun: the job's attempt namespace.
    attempt = dist.PrefixStore(ctl.attempt_prefix(0), _connect(port))
    dist.distributed_c10d._get_default_store = lambda: attempt
    cfg = hostile_train.config().model_copy(update={"init_timeout": timedelta(seconds=8)})
    try:
        rd.init_process_group("gloo", config=cfg)
    except Exception as e:  # noqa: BLE001 - refused: what the issue asks for
        got = {"admitted": False, "join_error": f"{type(e).__name__}: {e}"}
        _report(out, "joined", got)
        return
    got = {"admitted": True, "rank": dist.get_rank()}
    _report(out, "joined", got)
    try:
        model, opt = hostile_train.new_model()  # a joiner receives the job's state here
        got["state_received"] = {k: v.tolist() for k, v in model.module.state_dict().items()}
        got["optimizer_state_received"] = len(opt.state_dict()["state"])
        hostile_train.train(out, dist.get_rank(), model, opt, joined=True)
        rd.all_gather_object(Payload(str(out)))
        got["payload_sent"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        got["member_error"] = f"{type(e).__name__}: {e}"
    _report(out, "joined", got)


# -- start-up records (item 5) ----------------------------------------------------------------
def plant_preflight(out_dir: str, port: str) -> None:
    """Before any rank starts (they wait for ``OUT/gate``): a verdict with the attacker's
    text, garbage facts of ranks 1 and 2 and an inflated arrival count, under the keys
    preflight uses for attempt 0 in the store at 127.0.0.1:``port``."""
    out = Path(out_dir)
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        store = _connect(int(port))
        verdict = {"rank": 1, "problems": [ATTACKER_TEXT], "table": ATTACKER_TEXT}
        packed = zlib.compress(json.dumps(verdict).encode())
        keys = ctl.PreflightKeys(0)
        store.set(keys.verdict(), packed)
        for r in (1, 2):
            store.set(keys.facts(r), b"{not json " + ATTACKER_TEXT.encode())
        store.add(keys.arrived, 2)
        report["planted"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    finally:
        _report(out, "attacker_preflight", report)
        _touch(out / "gate")


# -- with a secret (rd.spawn) -----------------------------------------------------------------
def attack_secret(out_dir: str, port: str, prefix: str, mode: str) -> None:
    """Against the job of :func:`secret_job`, in the job's namespace ``prefix`` (known to
    this attacker; the secret is not): garbage over the heartbeats during start-up, then
    with ``mode`` "counter" garbage in the event counter (item 6; rank 2 is killed
    then), with "replay" 64 MiB of junk in the event log (item 6; rank 2 is killed then)
    and, after the admission of its replacement, the old ``members`` and ``gen`` records
    written back (item 4)."""
    out = Path(out_dir)
    report: dict[str, Any] = {"pid": os.getpid(), "mode": mode}
    try:
        store = _connect(int(port))
        root = dist.PrefixStore(prefix, store)
        _touch(out / "gate")
        writes = 0
        end = time.monotonic() + WAIT_S
        while not (out / "started").exists() and time.monotonic() < end:
            for r in range(WORLD):
                root.set(f"g0/state/{r}", GARBAGE)
            writes += 1
            time.sleep(0.02)
        report["heartbeat_garbage_writes"] = writes
        if mode == "counter":
            root.set("g0/ev/n", GARBAGE)
            report["counter_garbage"] = True
            return
        _junk(root, "g0/ev/log")
        report["junk_mib"] = JUNK_MIB
        _touch(out / "armed")  # rank 2 is killed now
        # The record of the shrink, then that of the admission that follows it.
        store.wait([f"{prefix}/members"], timedelta(seconds=WAIT_S))
        old_members = root.get("members")
        old_gen = root.get("gen") if root.check(["gen"]) else None
        end = time.monotonic() + WAIT_S
        while root.get("members") == old_members:
            if time.monotonic() > end:
                raise TimeoutError("no admission followed the shrink")
            time.sleep(0.02)
        report["members_after_admission"] = root.get("members").decode(errors="replace")
        # Item 4: the old records written back, once the job trained a while with the
        # joiner (the launcher read the new record meanwhile).
        _wait_file(out / "replay_now")
        root.set("members", old_members)
        if old_gen is not None:
            root.set("gen", old_gen)
        report["replayed"] = {
            "members": old_members.decode(errors="replace"),
            "gen": None if old_gen is None else old_gen.decode(errors="replace"),
            "job_running": not root.check(["ended"]),
        }
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    finally:
        _report(out, "attacker", report)
        for name in ("gate", "armed", "replayed"):  # never leave the ranks waiting
            _touch(out / name)


def _start_attacker(call: str, *args: str) -> subprocess.Popen[bytes]:
    """``call(*args)`` of this module in a new interpreter, without the job's secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_DDP")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    code = f"import sys; from tests._hostile_default_workers import {call}; {call}(*sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT)


def _stop(proc: subprocess.Popen[bytes] | None) -> int | None:
    if proc is None:
        return None
    try:
        return proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _cfg() -> rd.ResilienceConfig:
    """The torchrun/env:// jobs' config (hostile_train.config), for the rd.spawn jobs."""
    from tests._torchrun_scripts import hostile_train

    return hostile_train.config()


def _model() -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = rd.ResilientDDP(nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def _batch(step: int, uid: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + uid)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _hash(model: Any, opt: torch.optim.Optimizer) -> str:
    from tests._elastic_workers import state_hash

    return state_hash(model.module, opt)


STARTED_STEP = 10  # steps trained before the junk: the step time to compare with
KILL_AFTER = 10  # steps rank 2 trains after the attacker armed the job, then SIGKILL
REPLAY_AFTER = 20  # steps trained with the joiner before the replay (the launcher sees it)
SECRET_TAIL = 10  # steps after the replay
# rd.spawn's launcher kills a process the member record no longer lists after 1 s; held
# longer after the replay (one step then shows whether the joiner is gone).
EVICT_HOLD_S = 2.0
COUNTER_TAIL = 5  # steps after the shrink
SECRET_MAX_STEPS = 3000


def secret_job(rank: int, out_dir: str, mode: str) -> dict[str, Any]:
    """A rank of a job under ``rd.spawn`` (secret set; ``restarts=1`` for ``mode``
    "replay") beside :func:`attack_secret` (see :func:`_secret_loop`). A survivor that
    raises ``RankFailureError`` returns the ranks it names."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(80, exit=True)
    out = Path(out_dir)
    joiner = "RESILIENT_DDP_JOINER" in os.environ
    proc = None
    if rank == 0 and not joiner:
        job, secret = os.environ[ctl.JOB_ENV], os.environ[ctl.SECRET_ENV]
        jr = ctl.root_prefix(dist.HashStore(), job, secret)
        prefix = getattr(jr, "prefix", ctl.job_prefix(job))
        port = os.environ["MASTER_PORT"]
        proc = _start_attacker("attack_secret", out_dir, port, prefix, mode)
    try:
        if not joiner:
            _wait_file(out / "gate")
        rd.init_process_group("gloo", config=_cfg())
        model, opt = _model()
        uid = int(os.environ.get("RESILIENT_DDP_UID", rank))
        try:
            result = _secret_loop(out, uid, model, opt, mode)
        except rd.RankFailureError as e:
            result = {"uid": uid, "raised": type(e).__name__, "ranks": list(e.ranks)}
        rd.destroy_process_group()
    except BaseException:
        if proc is not None:  # the job failed: the attacker would wait for it in vain
            proc.kill()
        raise
    finally:
        code = _stop(proc)
        if proc is not None:
            (out / "attacker_exit").write_text(str(code))
    return result


def _secret_loop(
    out: Path, uid: int, model: Any, opt: torch.optim.Optimizer, mode: str
) -> dict[str, Any]:
    """Train from the job's current step. The first :data:`STARTED_STEP` steps run with
    the attacker's garbage over the heartbeats, before its junk (their step time is the
    baseline). The process of member id 2 is SIGKILLed :data:`KILL_AFTER` steps after the
    attacks of item 6 landed (``OUT/armed``). With ``mode`` "counter" the survivors train
    :data:`COUNTER_TAIL` steps after the shrink. With "replay" its replacement joins;
    once a member sees that admission in the world-size history (which travels with the
    state) trains :data:`REPLAY_AFTER` steps with it, then waits for the attacker's replay
    of item 4 (:func:`_await_replay`) and trains :data:`SECRET_TAIL` steps more."""
    from resilient_ddp.testing import kill_self

    step = int(model.resilience_stats["step"])
    armed_at: int | None = None
    end_step: int | None = None
    replay_step: int | None = None
    times: list[tuple[bool, float]] = []
    while end_step is None or step < end_step:
        if step >= SECRET_MAX_STEPS:
            raise RuntimeError(f"no admission within {SECRET_MAX_STEPS} steps")
        if uid == 0 and step == STARTED_STEP:
            _touch(out / "started")  # the attacker's heartbeat garbage stops, its junk comes
        if armed_at is None and (out / "armed").exists():
            armed_at = step
        if uid == 2 and armed_at is not None and step >= armed_at + KILL_AFTER:
            kill_self()
        history = model.resilience_stats["world_size_history"]
        if end_step is None and mode == "counter" and len(history) >= 2:  # the shrink
            end_step = int(history[1][0]) + COUNTER_TAIL
        if end_step is None and mode == "replay" and len(history) >= 3:  # the admission
            replay_step = int(history[2][0]) + REPLAY_AFTER  # the same on every member
            end_step = replay_step + SECRET_TAIL
        if step == replay_step:
            _await_replay(out, uid)
        t0 = time.perf_counter()
        x, y = _batch(step, uid)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append((armed_at is not None, time.perf_counter() - t0))
        step = int(model.resilience_stats["step"])
        time.sleep(0.005)
    stats = model.resilience_stats
    return {
        "uid": uid,
        "rank": dist.get_rank(),
        "world_size": stats["world_size"],
        "events": stats["events"],
        "history": stats["world_size_history"],
        "steps": step,
        "hash": _hash(model, opt),
        "step_s_before": _median([t for armed, t in times[1:] if not armed]),
        "step_s_after": _median([t for armed, t in times if armed]),
    }


def _await_replay(out: Path, uid: int) -> None:
    """Ask the attacker for its replay (``OUT/replay_now``), wait for it, then keep the
    job running (busy, so that no peer is judged stuck) for :data:`EVICT_HOLD_S`: the
    launcher acts on a member record within its eviction grace, so the joiner would be
    killed by now if the launcher believed the old record."""
    if uid == 0:
        _touch(out / "replay_now")
    _wait_file(out / "replayed")
    end = time.monotonic() + EVICT_HOLD_S
    while time.monotonic() < end:
        rd.progress()
        time.sleep(0.02)


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


PREFLIGHT_STEPS = 5


def preflight_secret_job(rank: int, out_dir: str) -> dict[str, Any]:
    """A rank of a job under ``rd.spawn`` (secret set) whose preflight records were
    planted by :func:`plant_preflight` before it started: trains a few steps."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(80, exit=True)
    out = Path(out_dir)
    proc = None
    if rank == 0:
        proc = _start_attacker("plant_preflight", out_dir, os.environ["MASTER_PORT"])
    try:
        _wait_file(out / "gate")
        rd.init_process_group("gloo", config=_cfg())
        model, opt = _model()
        for step in range(PREFLIGHT_STEPS):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        result = {"world_size": dist.get_world_size(), "hash": _hash(model, opt)}
        rd.destroy_process_group()
    finally:
        _stop(proc)
    return result
