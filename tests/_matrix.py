"""What the fault matrices share (tests/test_launchers_mp.py, tests/test_frameworks_mp.py):
the operator's environment, a launcher started as one command, and the checks of the
promise.

A case runs a training script built on tests/_launcher_workers.py: every rank writes a
start record (pid, process start time) and a result record (the error it got, with the
wall time), the culprit (rank :data:`~tests._launcher_workers.CULPRIT`) a fault record.
:func:`check` lists every problem of the case: each survivor raised ``RankFailureError``
(``CollectiveTimeoutError`` for a hang) naming the culprit, within 3 s of the fault (kill,
raise) or the op timeout + 4 s (hang); the hung rank raised our error naming itself or
exited with the library's distinct code; every process ended; no exit code the launcher
reports is 0.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from resilient_ddp.runtime import _runtime

from . import _launcher_workers as w
from ._procs import kill_named, wait_for

ROOT = Path(__file__).resolve().parent.parent

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
# How long the ranks' processes may outlive the launcher's return.
ENDED_WITHIN_S = 5.0

UNRESPONSIVE_EXIT_CODE: int = getattr(_runtime, "UNRESPONSIVE_EXIT_CODE", 75)


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
    # The launcher SIGKILLs every rank once one fails (Lightning's child observer polls every
    # 5 s): a hung rank may be ended that way before it learns it was named.
    kills_siblings: bool = False


def operator_environment(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Make the test process's environment as an operator's shell would have it: the
    resilient_ddp settings exported, nothing of an enclosing job. Launchers started in
    this process (rd.spawn, mp.spawn) pass it on to the ranks; the returned mapping is the
    full environment for launchers started as commands."""
    for key in list(os.environ):
        if key.startswith(FOREIGN_ENV_PREFIXES) or key in FOREIGN_ENV:
            monkeypatch.delenv(key)
    for key, value in OPERATOR_ENV.items():
        monkeypatch.setenv(key, value)
    return dict(os.environ)


def run_for_json(args: Sequence[str], env: dict[str, str], cwd: Path) -> Any:
    """Run ``python *args`` to its end (at most :data:`DEADLINE_S`); it must exit 0. The
    JSON its last line of output printed."""
    proc = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def attempt_dir(tmp_path: Path, attempt: int) -> Path:
    """The folder of one launch attempt of a case."""
    out = tmp_path / f"attempt{attempt}"
    out.mkdir()
    return out


def launch_command(
    cmd: Sequence[str], out: Path, env: dict[str, str], deadline: float, name: str
) -> Run:
    """Run a launcher started as one command (torchrun's agent, or rank 0 of a framework
    that starts the other ranks itself) until it returns or ``deadline`` (monotonic)
    passes; its output goes to ``out/launcher.txt``."""
    run = Run(out)
    with (out / "launcher.txt").open("wb") as log:  # the launcher keeps its own copy
        launcher = subprocess.Popen(list(cmd), env=env, cwd=ROOT, stdout=log, stderr=log)
    run.handles.append(launcher)
    try:
        rc: int | None = launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc, run.deadline_hit = None, True
    run.launcher = f"{name} exit code {rc}"
    run.launcher_ok = rc is not None and rc != 0
    return run


# -- checks ----------------------------------------------------------------------------------
def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def alive(start: dict[str, Any]) -> bool:
    """Whether the process of a start record still runs (a zombie counts as ended)."""
    try:
        stat = Path(f"/proc/{start['pid']}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == start["start_time"]


def check(
    launcher: str, fault: str, run: Run, world: int = w.WORLD
) -> tuple[list[str], dict[str, Any]]:
    """Every problem of the case of ``world`` ranks (empty: the promise held), and a
    summary of how it went."""
    out, problems = run.out, []
    starts = {r: read_record(out / f"start{r}.json") for r in range(world)}
    results = {r: read_record(out / f"result{r}.json") for r in range(world)}
    fault_rec = read_record(out / "fault.json")
    summary: dict[str, Any] = {"case": f"{launcher}/{fault}", "attempts": run.attempts}
    if run.deadline_hit:
        problems.append(f"the launcher had not returned after the {DEADLINE_S:g} s deadline")
    if fault_rec is None:
        problems.append(f"rank {w.CULPRIT} never reached its fault at step {w.FAULT_STEP}")
    t_fault = fault_rec["t_fault"] if fault_rec else None
    for r in (r for r in range(world) if r != w.CULPRIT):
        summary[f"rank{r}"] = check_survivor(r, fault, results[r], t_fault, run, problems)
    summary["culprit"] = check_culprit(fault, results[w.CULPRIT], t_fault, run, problems)
    check_ended(starts, run, problems)
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


def first_line(res: dict[str, Any]) -> str:
    lines = str(res["message"]).strip().splitlines()
    return lines[0][:400] if lines else ""


def check_survivor(
    r: int,
    fault: str,
    res: dict[str, Any] | None,
    t_fault: float | None,
    run: Run,
    problems: list[str],
) -> Any:
    """A survivor raised our type, naming the culprit, within the bound."""
    if res is None and observer_killed(run):
        # Lightning's child observer polls every 5 s and SIGKILLs every rank once one
        # exited non-zero: a poll soon after the culprit's death ends the survivors before
        # they name it (its log line is the evidence; without it, no record is a failure).
        return "killed by its launcher's observer before it raised"
    if res is None or res.get("type") is None:
        said = "finished training without an error" if res else "recorded no result"
        problems.append(f"rank {r} {said} (exit code {run.codes.get(r, '?')})")
        return said
    elapsed = res["t_error"] - t_fault if t_fault is not None else float("nan")
    msg = first_line(res)
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


def observer_killed(run: Run) -> bool:
    """Whether a sibling-killing launcher (Lightning's child observer) says it killed the
    ranks: its log line is in a rank's log."""
    if not run.kills_siblings:
        return False
    return any(
        "Forcefully terminating all other processes" in p.read_text(errors="replace")
        for p in run.out.glob("log*.txt")
    )


def check_culprit(
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
        return f"raised {res['type']} naming itself{after} (exit code {code}): {first_line(res)}"
    if code == UNRESPONSIVE_EXIT_CODE:
        return f"exited with code {UNRESPONSIVE_EXIT_CODE} (unresponsive)"
    if res is None and observer_killed(run):
        # Its end is checked by check_ended; the survivors named it (check_survivor). The
        # launcher's poll lands anywhere in 5 s after a survivor exits, the hung rank's own
        # error about 0.5 s after the survivors' (fabric/hang, 1 run in about 10 killed first).
        return "ended by its launcher, which kills every rank once one fails, before it raised"
    got = f"{res['type']} naming {res['ranks']}: {first_line(res)!r}" if res else "nothing"
    problems.append(
        f"hung rank {w.CULPRIT} neither raised our error naming itself nor exited with code "
        f"{UNRESPONSIVE_EXIT_CODE} (exit code {code}; recorded {got})"
    )
    return f"neither (exit code {code}; recorded {got})"


def check_ended(starts: dict[int, dict[str, Any] | None], run: Run, problems: list[str]) -> None:
    """Every process ended, on its own or by its launcher, with a non-zero exit code where
    the launcher reports it, and the launcher reported the failure."""
    if not wait_for(lambda: not any(s and alive(s) for s in starts.values()), ENDED_WITHIN_S):
        left = [r for r, s in starts.items() if s and alive(s)]
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


def report(run: Run) -> str:
    """Every rank's records and output, and the launcher's, for a failure message."""
    parts = [f"launcher: {run.launcher}", f"exit codes: {run.codes}", f"attempts: {run.attempts}"]
    for path in sorted(p for p in run.out.iterdir() if p.is_file()):
        text = path.read_text(errors="replace")
        if path.suffix == ".json":
            rec = read_record(path) or {}
            tb = rec.pop("traceback", "")
            parts.append(f"--- {path.name}: {json.dumps(rec)}" + (f"\n{tb.rstrip()}" if tb else ""))
        elif path.suffix == ".txt":
            parts.append(f"--- {path.name} (last 4000 characters):\n{text[-4000:].rstrip()}")
    return "\n".join(parts)


@contextlib.contextmanager
def stacks_of_stuck_ranks(tmp_path: Path) -> Iterator[None]:
    """While the launcher runs, make every rank still alive :data:`STACKS_AFTER_S` after
    the fault dump its threads' stacks into its log, once (where it was stuck, for the
    report: mp.spawn, say, SIGKILLs a rank that ignored SIGTERM for 30 s, leaving nothing)."""
    stop = threading.Event()

    def watch() -> None:
        dumped: set[int] = set()
        while not stop.wait(0.2):
            for fault_file in tmp_path.glob("attempt*/fault.json"):
                rec = read_record(fault_file)
                if rec is None or time.time() - rec["t_fault"] < STACKS_AFTER_S:
                    continue
                for start_file in fault_file.parent.glob("start*.json"):
                    start = read_record(start_file)
                    if start and start["pid"] not in dumped and alive(start):
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
def kill_handles(handles: list[Any]) -> None:
    for h in handles:
        if isinstance(h, subprocess.Popen):
            if h.poll() is None:
                h.kill()
            h.wait(10)
        else:  # a multiprocessing process (mp.spawn)
            if h.is_alive():
                h.kill()
            h.join(10)


def kill_everything(tmp_path: Path, run: Run | None) -> None:
    """Leave nothing behind, whatever happened: the launcher's processes, torchrun's
    workers (sessions of their own), and every rank whose start record is still alive."""
    if run is not None:
        kill_handles(run.handles)
    kill_named(tmp_path)
    for start_file in tmp_path.glob("attempt*/start*.json"):
        start = read_record(start_file)
        if start and alive(start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(start["pid"], signal.SIGKILL)
