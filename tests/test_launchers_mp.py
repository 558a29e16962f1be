"""The launcher matrix of issue 13: the same training script under four launchers, with
three faults on rank 1 of 3.

Launchers, by who hosts the store (the control plane):

- ``rd_spawn``: ``resilient_ddp.launch.launch`` (through ``rd.testing.run_ranks``, so
  started as conftest's ``--rank-start`` says); the test process (the parent) hosts it.
- ``torchrun``: ``python -m torch.distributed.run --standalone``; the agent hosts it.
- ``mp_spawn``: ``torch.multiprocessing.spawn`` set up as in PyTorch's DDP tutorial
  (MASTER_ADDR/MASTER_PORT set in the rank); rank 0 hosts it.
- ``popen``: three plain ``subprocess.Popen`` processes with RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT in their environment, as ``srun`` starts them; rank 0 hosts
  it.

Faults, at step :data:`~tests._launcher_workers.FAULT_STEP` of a small ``rd.ResilientDDP``
loop (tests/_launcher_workers.py, the same user code for every launcher): ``kill``
(SIGKILL itself), ``raise`` (ValueError in user code), ``hang`` (``time.sleep`` outside
any collective). The library is configured from the environment only, as an operator
would: ``RESILIENT_DDP_OP_TIMEOUT=3s``.

The promise checked, per case: each survivor (ranks 0 and 2) raises ``RankFailureError``
(``CollectiveTimeoutError`` for a hang) naming ``[1]``, within 3 s of the fault (kill,
raise) or the op timeout + 4 s (hang); the hung rank raises our error naming itself or
exits with the library's distinct code (which one is printed); every process ends; every
exit code a launcher reports is non-zero. All problems of a case are reported together,
with every rank's record and output.

Ports: torchrun's agent and ``rd.spawn``'s parent bind port 0 themselves (no race). When
rank 0 hosts the store, the test must name a port before rank 0 binds it: it takes one from
``TCPStore(port=0)`` and frees it, which leaves a window in which another process on the
machine may take it. Rank 0 then fails its init with "MASTER_PORT ... already in use"
(PreflightError, before any fault): that attempt is discarded and the case starts again on
a new port (at most :data:`PORT_ATTEMPTS` times, within the same deadline).

Repeat mode: ``RD_LAUNCHER_REPEAT=20`` runs the rank-0-hosted kill and raise cases
(``mp_spawn``, ``popen``) 20 times each (default 1), e.g.
``RD_LAUNCHER_REPEAT=20 pytest tests/test_launchers_mp.py -k "mp_spawn or popen"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from resilient_ddp import _runtime
from resilient_ddp.testing import run_ranks

from . import _launcher_workers as w
from ._procs import kill_named, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "_launcher_script.py"

LAUNCHERS = ("rd_spawn", "torchrun", "mp_spawn", "popen")
RANK0_HOSTED = ("mp_spawn", "popen")
SURVIVORS = [r for r in range(w.WORLD) if r != w.CULPRIT]

OP_TIMEOUT_S = 3.0
# What an operator exports before starting the job; nothing is configured in code.
OPERATOR_ENV = {"RESILIENT_DDP_OP_TIMEOUT": f"{OP_TIMEOUT_S:g}s", "OMP_NUM_THREADS": "1"}
# Variables of an enclosing job that must not reach the ranks.
FOREIGN_ENV_PREFIXES = ("RESILIENT_DDP_", "TORCHELASTIC_", "MASTER_", "SLURM_")
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# Fault to error on each survivor.
KILL_RAISE_BOUND_S = 3.0
HANG_BOUND_S = OP_TIMEOUT_S + 4.0

# Hard deadline of one case, every port attempt included; pytest-timeout is 120 s. A
# failed mp.spawn job may take up to 30 s more: after SIGTERM, ProcessContext.join waits
# that long before SIGKILL.
DEADLINE_S = 60.0
assert w.DUMP_AFTER_S < DEADLINE_S  # a stuck rank dumps its stacks before it is killed
# A rank still running this long after the fault is stuck (every bound is shorter, the
# hung rank's 3 s grace to raise included): it is made to write every thread's stack to
# its log (SIGUSR1, faulthandler), for the report.
STACKS_AFTER_S = 15.0
# rd.spawn: how long the others may take to end after the first failure.
RD_SPAWN_GRACE_S = 20.0
# How long the ranks' processes may outlive the launcher's return.
ENDED_WITHIN_S = 5.0
PORT_ATTEMPTS = 3

UNRESPONSIVE_EXIT_CODE: int = getattr(_runtime, "UNRESPONSIVE_EXIT_CODE", 75)

REPEAT = int(os.environ.get("RD_LAUNCHER_REPEAT", "1"))


def _cases() -> list[Any]:
    cases = []
    for launcher in LAUNCHERS:
        for fault in w.FAULTS:
            n = REPEAT if launcher in RANK0_HOSTED and fault in ("kill", "raise") else 1
            marks = [pytest.mark.torchrun] if launcher == "torchrun" else []
            for i in range(n):
                name = f"{launcher}-{fault}" + (f"-{i}" if n > 1 else "")
                cases.append(pytest.param(launcher, fault, id=name, marks=marks))
    return cases


@dataclasses.dataclass
class Run:
    """What one launch left: its folder, how each rank ended, what the launcher said."""

    out: Path
    # Exit code per rank where the launcher reports it (None: still running when killed).
    codes: dict[int, int | None] = dataclasses.field(default_factory=dict)
    # The launcher's own verdict: torchrun's exit code, mp.spawn's exception, ...
    launcher: str = ""
    launcher_ok: bool = True  # whether the launcher reported the failure as one
    deadline_hit: bool = False
    attempts: int = 1
    # Processes to kill if the case fails (Popen handles, mp processes).
    handles: list[Any] = dataclasses.field(default_factory=list)
    t_launch: float = 0.0  # time.time() when the launcher was called
    t_returned: float | None = None


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test process's environment as an operator's shell would have it: the
    resilient_ddp settings exported, nothing of an enclosing job. Launchers started in
    this process (rd.spawn, mp.spawn) pass it on to the ranks; the returned mapping is the
    full environment for launchers started as commands."""
    for key in list(os.environ):
        if key.startswith(FOREIGN_ENV_PREFIXES) or key in FOREIGN_ENV:
            monkeypatch.delenv(key)
    for key, value in OPERATOR_ENV.items():
        monkeypatch.setenv(key, value)
    return dict(os.environ)


@pytest.mark.parametrize(("launcher", "fault"), _cases())
def test_every_survivor_names_the_culprit(
    launcher: str, fault: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    deadline = time.monotonic() + DEADLINE_S
    run: Run | None = None
    try:
        t_launch = time.time()
        with _stacks_of_stuck_ranks(tmp_path):
            run = _LAUNCH[launcher](tmp_path, fault, operator_env, deadline)
        run.t_launch, run.t_returned = t_launch, time.time()
        problems, summary = _check(launcher, fault, run)
        print(json.dumps(summary))  # shown with -rP: which way the hung rank ended, timings
        assert not problems, (
            f"{launcher}/{fault}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems)
            + "\n"
            + _report(run)
        )
    finally:
        _kill_everything(tmp_path, run)


# -- launchers -------------------------------------------------------------------------------
def _attempt_dir(tmp_path: Path, attempt: int) -> Path:
    out = tmp_path / f"attempt{attempt}"
    out.mkdir()
    return out


def _free_port() -> int:
    """A port that was free a moment ago (see the module docstring for the window)."""
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(probe.port)
    del probe  # the last reference: the server closes and rank 0 may bind the port
    return port


def _port_taken(out: Path) -> bool:
    """Whether rank 0 of this attempt could not host the store: its port was taken."""
    res = _read(out / "result0.json")
    return bool(res and res.get("stage") == "init" and "already in use" in res["message"])


def _launch_rd_spawn(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    out = _attempt_dir(tmp_path, 0)
    # resilient_ddp.launch.launch, starting the ranks as the session chose (conftest's
    # --rank-start: forks of a server that imported torch, or spawn for a cold start).
    outcomes = run_ranks(
        w.rd_spawn_main,
        w.WORLD,
        (str(out), fault),
        timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        grace=timedelta(seconds=RD_SPAWN_GRACE_S),
    )
    run = Run(out)
    for o in outcomes:
        run.codes[o.rank] = o.exitcode
    run.launcher = "; ".join(
        f"rank {o.rank}: exitcode={o.exitcode} exc={o.exc_type}: {o.exc_message}" for o in outcomes
    )
    run.launcher_ok = any(not o.ok for o in outcomes)
    run.deadline_hit = time.monotonic() >= deadline
    return run


def _launch_torchrun(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    out = _attempt_dir(tmp_path, 0)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(w.WORLD), "--monitor-interval", "0.2",
        str(SCRIPT), str(out), fault,
    ]  # fmt: skip
    run = Run(out)
    with (out / "torchrun.txt").open("wb") as log:  # the agent keeps its own copy
        agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)
    run.handles.append(agent)
    try:
        rc: int | None = agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc, run.deadline_hit = None, True
    run.launcher = f"torchrun exit code {rc}"
    run.launcher_ok = rc is not None and rc != 0
    return run


def _launch_mp_spawn(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    for attempt in range(PORT_ATTEMPTS):
        out = _attempt_dir(tmp_path, attempt)
        run = Run(out, attempts=attempt + 1)
        ctx = torch_mp.spawn(
            w.mp_spawn_main,
            args=(w.WORLD, _free_port(), str(out), fault),
            nprocs=w.WORLD,
            join=False,
        )
        run.handles.extend(ctx.processes)
        run.launcher = "mp.spawn returned"
        run.launcher_ok = False
        try:
            # As join=True does, but with a deadline. After a failure, join() sends SIGTERM
            # to the others and waits for them (up to 30 s) before it raises.
            while not ctx.join(timeout=0.5):
                if time.monotonic() >= deadline:
                    run.deadline_hit = True
                    run.launcher = "deadline: mp.spawn had not returned"
                    break
        except (torch_mp.ProcessExitedException, torch_mp.ProcessRaisedException) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            tail = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            run.launcher = (
                f"{type(e).__name__} (error_index={e.error_index}): {first_line} ... {tail}"
            )
            run.launcher_ok = True
        for p in ctx.processes:
            p.join(0.1)
            run.codes[ctx.processes.index(p)] = p.exitcode
        if not _port_taken(out) or attempt == PORT_ATTEMPTS - 1:
            return run
        _kill_handles(run.handles)
    raise AssertionError("not reached")  # pragma: no cover


def _launch_popen(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    for attempt in range(PORT_ATTEMPTS):
        out = _attempt_dir(tmp_path, attempt)
        run = Run(out, attempts=attempt + 1)
        port = _free_port()
        for rank in range(w.WORLD):
            rank_env = {
                **env,
                "RANK": str(rank),
                "WORLD_SIZE": str(w.WORLD),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            # The rank's own log (it appends there itself once started); the child keeps
            # its own copy of the descriptor.
            with (out / f"log{rank}.txt").open("ab") as log:
                run.handles.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), str(out), fault],
                        cwd=ROOT,
                        env=rank_env,
                        stdout=log,
                        stderr=log,
                    )
                )
        taken = False
        while any(p.poll() is None for p in run.handles):
            if time.monotonic() >= deadline:
                run.deadline_hit = True
                break
            taken = _port_taken(out)
            if taken:
                break
            time.sleep(0.1)
        taken = taken or _port_taken(out)
        if taken and attempt < PORT_ATTEMPTS - 1:
            _kill_handles(run.handles)
            continue
        for rank, p in enumerate(run.handles):
            run.codes[rank] = p.poll()
        run.launcher = "return codes " + str([p.poll() for p in run.handles])
        return run
    raise AssertionError("not reached")  # pragma: no cover


_LAUNCH = {
    "rd_spawn": _launch_rd_spawn,
    "torchrun": _launch_torchrun,
    "mp_spawn": _launch_mp_spawn,
    "popen": _launch_popen,
}


# -- checks ----------------------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _alive(start: dict[str, Any]) -> bool:
    """Whether the process of a start record still runs (a zombie counts as ended)."""
    try:
        stat = Path(f"/proc/{start['pid']}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == start["start_time"]


def _check(launcher: str, fault: str, run: Run) -> tuple[list[str], dict[str, Any]]:
    """Every problem of the case (empty: the promise held), and a summary of how it went."""
    out, problems = run.out, []
    starts = {r: _read(out / f"start{r}.json") for r in range(w.WORLD)}
    results = {r: _read(out / f"result{r}.json") for r in range(w.WORLD)}
    fault_rec = _read(out / "fault.json")
    summary: dict[str, Any] = {"case": f"{launcher}/{fault}", "attempts": run.attempts}
    if run.deadline_hit:
        problems.append(f"the launcher had not returned after the {DEADLINE_S:g} s deadline")
    if fault_rec is None:
        problems.append(f"rank {w.CULPRIT} never reached its fault at step {w.FAULT_STEP}")
    t_fault = fault_rec["t_fault"] if fault_rec else None
    for r in SURVIVORS:
        summary[f"rank{r}"] = _check_survivor(r, fault, results[r], t_fault, run, problems)
    summary["culprit"] = _check_culprit(fault, results[w.CULPRIT], t_fault, run, problems)
    _check_ended(starts, run, problems)
    summary["codes"] = run.codes
    summary["launcher"] = run.launcher[:300]
    # Seconds from the launch: first rank started, fault, launcher returned.
    first = min((s["t"] for s in starts.values() if s), default=None)
    summary["timeline_s"] = {
        k: round(v - run.t_launch, 2)
        for k, v in (("first_start", first), ("fault", t_fault), ("returned", run.t_returned))
        if v is not None
    }
    return problems, summary


def _first_line(res: dict[str, Any]) -> str:
    lines = str(res["message"]).strip().splitlines()
    return lines[0][:400] if lines else ""


def _check_survivor(
    r: int,
    fault: str,
    res: dict[str, Any] | None,
    t_fault: float | None,
    run: Run,
    problems: list[str],
) -> Any:
    """A survivor raised our type, naming the culprit, within the bound."""
    if res is None or res.get("type") is None:
        said = "finished training without an error" if res else "recorded no result"
        problems.append(f"rank {r} {said} (exit code {run.codes.get(r, '?')})")
        return said
    elapsed = res["t_error"] - t_fault if t_fault is not None else float("nan")
    msg = _first_line(res)
    want = "CollectiveTimeoutError" if fault == "hang" else "RankFailureError"
    if want not in res["mro"] or res["stage"] != "train":
        problems.append(f"rank {r} raised {res['type']} in {res['stage']}: {msg!r}")
    elif res["ranks"] != [w.CULPRIT]:
        problems.append(f"rank {r}'s {res['type']} names ranks {res['ranks']}: {msg!r}")
    bound = HANG_BOUND_S if fault == "hang" else KILL_RAISE_BOUND_S
    if not elapsed < bound:
        problems.append(
            f"rank {r} raised {elapsed:.2f} s after the fault (bound {bound:g} s): {msg!r}"
        )
    return {
        "type": res["type"],
        "ranks": res["ranks"],
        "after_fault_s": round(elapsed, 2),
        "message": res["message"][:300],
    }


def _check_culprit(
    fault: str,
    res: dict[str, Any] | None,
    t_fault: float | None,
    run: Run,
    problems: list[str],
) -> str:
    """The culprit raised its own error (raise), or the hung rank ended as promised: it
    raised our error naming itself, or exited with the library's distinct code."""
    code = run.codes.get(w.CULPRIT, "?")
    if fault == "kill":
        return f"killed (exit code {code})"
    if fault == "raise":
        if res is None or res["type"] != "ValueError":
            problems.append(f"rank {w.CULPRIT} should have raised its ValueError: {res}")
        return f"raised {res and res['type']} (exit code {code})"
    if res is not None and "RankFailureError" in res["mro"] and res["ranks"] == [w.CULPRIT]:
        after = f" {res['t_error'] - t_fault:.2f} s after the fault" if t_fault else ""
        return f"raised {res['type']} naming itself{after} (exit code {code}): {_first_line(res)}"
    if code == UNRESPONSIVE_EXIT_CODE:
        return f"exited with code {UNRESPONSIVE_EXIT_CODE} (unresponsive)"
    got = f"{res['type']} naming {res['ranks']}: {_first_line(res)!r}" if res else "nothing"
    problems.append(
        f"hung rank {w.CULPRIT} neither raised our error naming itself nor exited with code "
        f"{UNRESPONSIVE_EXIT_CODE} (exit code {code}; recorded {got})"
    )
    return f"neither (exit code {code}; recorded {got})"


def _check_ended(starts: dict[int, dict[str, Any] | None], run: Run, problems: list[str]) -> None:
    """Every process ended, on its own or by its launcher, with a non-zero exit code where
    the launcher reports it, and the launcher reported the failure."""
    if not wait_for(lambda: not any(s and _alive(s) for s in starts.values()), ENDED_WITHIN_S):
        left = [r for r, s in starts.items() if s and _alive(s)]
        problems.append(f"rank(s) {left} still running after the launcher returned")
    missing = [r for r, s in starts.items() if s is None]
    if missing:
        problems.append(f"rank(s) {missing} never started (no start record)")
    for r, c in run.codes.items():
        if c is None:
            problems.append(f"rank {r} had not exited when its launcher gave up (killed)")
        elif c == 0:
            problems.append(f"rank {r} exited with code 0")
    if not run.launcher_ok:
        problems.append(f"the launcher did not report a failure: {run.launcher}")


def _report(run: Run) -> str:
    """Every rank's records and output, and the launcher's, for a failure message."""
    parts = [f"launcher: {run.launcher}", f"exit codes: {run.codes}", f"attempts: {run.attempts}"]
    for path in sorted(run.out.iterdir()):
        text = path.read_text(errors="replace")
        if path.suffix == ".json":
            rec = _read(path) or {}
            tb = rec.pop("traceback", "")
            parts.append(f"--- {path.name}: {json.dumps(rec)}" + (f"\n{tb.rstrip()}" if tb else ""))
        elif path.suffix == ".txt":
            parts.append(f"--- {path.name} (last 4000 characters):\n{text[-4000:].rstrip()}")
    return "\n".join(parts)


@contextlib.contextmanager
def _stacks_of_stuck_ranks(tmp_path: Path) -> Iterator[None]:
    """While the launcher runs, make every rank still alive :data:`STACKS_AFTER_S` after
    the fault dump its threads' stacks into its log, once (where it was stuck, for the
    report: mp.spawn, say, SIGKILLs a rank that ignored SIGTERM for 30 s, leaving nothing)."""
    stop = threading.Event()

    def watch() -> None:
        dumped: set[int] = set()
        while not stop.wait(0.2):
            for fault_file in tmp_path.glob("attempt*/fault.json"):
                rec = _read(fault_file)
                if rec is None or time.time() - rec["t_fault"] < STACKS_AFTER_S:
                    continue
                for start_file in fault_file.parent.glob("start*.json"):
                    start = _read(start_file)
                    if start and start["pid"] not in dumped and _alive(start):
                        dumped.add(start["pid"])
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(start["pid"], signal.SIGUSR1)

    watcher = threading.Thread(target=watch, name="launcher-matrix-stacks", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


# -- clean-up --------------------------------------------------------------------------------
def _kill_handles(handles: list[Any]) -> None:
    for h in handles:
        if isinstance(h, subprocess.Popen):
            if h.poll() is None:
                h.kill()
            h.wait(10)
        else:  # a multiprocessing process (mp.spawn)
            if h.is_alive():
                h.kill()
            h.join(10)


def _kill_everything(tmp_path: Path, run: Run | None) -> None:
    """Leave nothing behind, whatever happened: the launcher's processes, torchrun's
    workers (sessions of their own), and every rank whose start record is still alive."""
    if run is not None:
        _kill_handles(run.handles)
    kill_named(tmp_path)
    for start_file in tmp_path.glob("attempt*/start*.json"):
        start = _read(start_file)
        if start and _alive(start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(start["pid"], signal.SIGKILL)
