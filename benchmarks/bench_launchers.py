"""Launchers where rank 0 hosts the store: what each survivor learns, and how soon.

Three gloo ranks on CPU run the same small training script (``rd.init_process_group()``
with no argument, i.e. env://; ``rd.ResilientDDP(nn.Linear(16, 4))``, SGD, 8 steps),
configured only through the environment as an operator would (``RESILIENT_DDP_OP_TIMEOUT=3s``,
``OMP_NUM_THREADS=1``), under two launchers in which rank 0 hosts the TCPStore:

* ``mp_spawn``: ``torch.multiprocessing.spawn``, set up as in PyTorch's DDP tutorial (the
  rank sets MASTER_ADDR and MASTER_PORT, and here RANK and WORLD_SIZE, before
  ``rd.init_process_group()``), waited on as ``join=True`` does (``ProcessContext.join``
  in a loop: after the first failed process it SIGTERMs the others);
* ``popen``: three plain ``subprocess.Popen`` processes with RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT in their environment, as ``srun`` starts them; nothing
  reacts to a death.

At step 3 rank 1 (the culprit) fails, before its forward pass: ``kill`` (SIGKILL itself),
``raise`` (a ``ValueError`` in user code), ``hang`` (``time.sleep(60)`` outside any
collective), or ``none`` (a healthy run). Per run and survivor (ranks 0 and 2): the time
from the fault (the culprit's wall clock just before it faults) to the survivor's error
(its own wall clock, in the ``except`` clause; one host, one clock), the error's type, and
whether ``err.ranks == (1,)``. For ``hang``, also how the hung rank ended: it raised our
error naming itself, exited with the library's code 75 (unresponsive), or was killed. For
``none``: each rank's ``rd.destroy_process_group()`` duration (rank 0, the store host,
waits there for its peers before it exits) and the job's wall time (launch to the
launcher's return: the last process exited, or ``join`` returned).

Ports: rank 0 must bind a port that the parent names beforehand; the parent takes one from
``TCPStore(port=0)`` and frees it, which leaves a window in which another process may take
it. Rank 0's init then fails with "already in use" (before any fault): that attempt is
discarded and the run starts again on a new port (at most ``PORT_ATTEMPTS`` times).

Clean-up: every process of a run carries a marker in its environment. A timer kills
every marked process and the launcher's own processes at the run's hard deadline
(``DEADLINE_S``); at the end of every run, whatever happened, every marked process still
alive is killed (and counted as left behind), and each rank also exits by itself after
``RANK_LIMIT_S`` (``faulthandler.dump_traceback_later(..., exit=True)``).

Usage::

    python benchmarks/bench_launchers.py             # 2 launchers x 4 faults x 5 runs, ~4.5 min
    python benchmarks/bench_launchers.py --quick     # 1 run each (smoke test)
    python benchmarks/bench_launchers.py --runs 20 --launchers popen --faults kill,raise

The full run writes ``benchmarks/results/launchers.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn

import resilient_ddp as rd

NAME = "launchers"
TITLE = "Launchers where rank 0 hosts the store: mp.spawn and plain processes"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

LAUNCHERS = ("mp_spawn", "popen")
FAULTS = ("kill", "raise", "hang", "none")
WORLD = 3
CULPRIT = 1
SURVIVORS = tuple(r for r in range(WORLD) if r != CULPRIT)
FAULT_STEP = 3
STEPS = 8
RUNS = 5
OP_TIMEOUT_S = 3.0
# What an operator exports before starting the job; nothing is configured in code.
OPERATOR_ENV = {"RESILIENT_DDP_OP_TIMEOUT": f"{OP_TIMEOUT_S:g}s", "OMP_NUM_THREADS": "1"}
# Variables of an enclosing job that must not reach the ranks.
FOREIGN_ENV_PREFIXES = ("RESILIENT_DDP_", "TORCHELASTIC_", "MASTER_", "SLURM_")
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
HANG_S = 60.0
# One run's hard deadline, port attempts included: every process still alive then is
# killed. mp.spawn's join waits up to 30 s after its SIGTERM before it SIGKILLs.
DEADLINE_S = 60.0
RANK_LIMIT_S = 50.0  # a rank still running this long after its start exits by itself
PORT_ATTEMPTS = 3
MARKER = "RD_BENCH_LAUNCHERS_RUN"
UNRESPONSIVE_EXIT_CODE = 75  # resilient_ddp's exit code for a rank that stopped responding
EXPECTED = {
    "kill": "RankFailureError",
    "raise": "RankFailureError",
    "hang": "CollectiveTimeoutError",
}


# -- one rank (the user's script) -------------------------------------------------------------
def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # a reader never sees half a record


def _error_record(rank: int, stage: str, e: BaseException) -> dict[str, Any]:
    return {
        "rank": rank,
        "stage": stage,
        "t_error": time.time(),
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "ranks": [int(r) for r in getattr(e, "ranks", ())],
        "message": str(e)[:4000],
        "traceback": traceback.format_exc()[-4000:],
    }


def _inject(fault: str, out: Path, step: int) -> None:
    _write_json(out / "fault.json", {"kind": fault, "step": step, "t_fault": time.time()})
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise":
        raise ValueError(f"injected failure at step {step} on rank {CULPRIT}")
    if fault == "hang":
        time.sleep(HANG_S)  # stuck in user code, outside any collective


def train(out_dir: str, fault: str) -> None:
    """The user's training script; re-raises whatever ended it, after recording it."""
    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(RANK_LIMIT_S, exit=True)
    _write_json(out / f"start{rank}.json", {"rank": rank, "pid": os.getpid(), "t": time.time()})
    stage = "init"
    try:
        rd.init_process_group()
        torch.manual_seed(0)
        model = rd.ResilientDDP(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        stage = "train"
        for step in range(STEPS):
            if rank == CULPRIT and step == FAULT_STEP and fault != "none":
                _inject(fault, out, step)
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except BaseException as e:
        _write_json(out / f"result{rank}.json", _error_record(rank, stage, e))
        raise
    t0 = time.perf_counter()
    rd.destroy_process_group()
    destroy_s = time.perf_counter() - t0
    _write_json(
        out / f"result{rank}.json",
        {"rank": rank, "stage": "done", "type": None, "destroy_s": destroy_s, "t": time.time()},
    )


def _redirect_output(out_dir: str, rank: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(out_dir, f"log{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def mp_spawn_main(rank: int, world_size: int, port: int, out_dir: str, fault: str) -> None:
    """Under ``torch.multiprocessing.spawn``, as PyTorch's DDP tutorial's ``setup()`` sets
    it up (plus RANK and WORLD_SIZE, so that ``rd.init_process_group()`` needs no
    argument)."""
    _redirect_output(out_dir, rank)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    train(out_dir, fault)


def popen_main(out_dir: str, fault: str) -> None:
    """``python benchmarks/bench_launchers.py --rank OUT_DIR FAULT``: a plain process, its
    rank and rendezvous in the environment."""
    train(out_dir, fault)


# -- the parent: one run ----------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended); never reaps it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _marked(marker: str) -> list[int]:
    """The live processes whose environment carries this run's marker."""
    return [pid for pid in _pids() if _has_marker(pid, marker) and _alive(pid)]


def _pids() -> list[int]:
    me = os.getpid()
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != me]


def _has_marker(pid: int, marker: str) -> bool:
    try:
        return f"{MARKER}={marker}".encode() + b"\0" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _kill_marked(marker: str) -> None:
    """SIGKILL every process of this run, through a pidfd checked after it was opened
    (so that a pid reused meanwhile by another process is never signalled)."""
    for pid in _marked(marker):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            if _has_marker(pid, marker):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)


def _free_port() -> int:
    """A port that was free a moment ago (see the module docstring for the window)."""
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(probe.port)
    del probe  # the last reference: the server closes and rank 0 may bind the port
    return port


def _port_taken(out: Path) -> bool:
    res = _read(out / "result0.json")
    return bool(res and res.get("stage") == "init" and "already in use" in res["message"])


class _Attempt:
    """One launch: its folder, its processes, when each of them ended."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.marker = uuid.uuid4().hex
        self.handles: list[Any] = []  # Popen objects or multiprocessing processes
        self.t_exit: dict[int, float] = {}  # rank -> wall time it was seen ended
        self.codes: dict[int, int | None] = {}
        self.launcher = ""
        self.deadline_hit = False
        self.left_behind = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()  # the deadline's timer kills from another thread
        self._pidfds: list[int] = []

    def watch(self) -> None:
        """Open a pidfd per rank process, right after the launch: it signals that process
        only, and becomes readable when the process exits, whoever reaps it (the launcher
        does). A thread notes when each rank's process ends."""
        with self._lock:
            self._pidfds = [os.pidfd_open(h.pid) for h in self.handles]
        fds = {os.dup(fd): r for r, fd in enumerate(self._pidfds)}

        def run() -> None:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            while fds:
                ready = poller.poll(50)
                now = time.time()
                for fd, _ in ready:
                    self.t_exit[fds.pop(fd)] = now
                    poller.unregister(fd)
                    os.close(fd)
                if self._stop.is_set() and not ready:
                    break
            for fd in fds:
                os.close(fd)

        self._watcher = threading.Thread(target=run, name="bench-launchers-exits", daemon=True)
        self._watcher.start()

    def kill(self) -> None:
        """SIGKILL the launcher's processes and every process of this attempt."""
        with self._lock:
            for fd in self._pidfds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            _kill_marked(self.marker)

    def finish(self) -> None:
        """Whatever happened: count and kill what is left, reap, stop watching."""
        self.left_behind = len(_marked(self.marker))
        self.kill()
        for h in self.handles:
            if isinstance(h, subprocess.Popen):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(10)
            else:
                h.join(10)
        end = time.monotonic() + 10
        while _marked(self.marker) and time.monotonic() < end:
            time.sleep(0.05)
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            for fd in self._pidfds:
                os.close(fd)
            self._pidfds = []


def _launch_mp_spawn(att: _Attempt, fault: str, port: int, deadline: float) -> None:
    os.environ[MARKER] = att.marker  # the spawned interpreters inherit it
    try:
        ctx = torch_mp.spawn(
            mp_spawn_main, args=(WORLD, port, str(att.out), fault), nprocs=WORLD, join=False
        )
    finally:
        del os.environ[MARKER]
    att.handles.extend(ctx.processes)
    att.watch()
    att.launcher = "mp.spawn returned"
    try:
        # As join=True does, with a deadline: after a failed process join() SIGTERMs the
        # others, waits up to 30 s, then SIGKILLs.
        while not ctx.join(timeout=0.2):
            if time.monotonic() >= deadline:
                att.launcher = "deadline: mp.spawn had not returned"
                break
    except (torch_mp.ProcessExitedException, torch_mp.ProcessRaisedException) as e:
        lines = str(e).strip().splitlines()
        att.launcher = f"{type(e).__name__}: " + (lines[0] if lines else "")
        if len(lines) > 1:
            att.launcher += " ... " + lines[-1]
    for r, p in enumerate(ctx.processes):
        p.join(0.1)
        att.codes[r] = p.exitcode


def _launch_popen(att: _Attempt, fault: str, port: int, deadline: float) -> None:
    for rank in range(WORLD):
        env = {
            **os.environ,
            MARKER: att.marker,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with (att.out / f"log{rank}.txt").open("ab") as log:
            att.handles.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), "--rank", str(att.out), fault],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            )
    att.watch()
    while any(p.poll() is None for p in att.handles):
        if time.monotonic() >= deadline:
            break
        if _port_taken(att.out):
            break
        time.sleep(0.02)
    for r, p in enumerate(att.handles):
        att.codes[r] = p.poll()
    att.launcher = "return codes " + str([att.codes[r] for r in range(WORLD)])


_LAUNCH = {"mp_spawn": _launch_mp_spawn, "popen": _launch_popen}


def run_once(launcher: str, fault: str) -> dict[str, Any]:
    """One run (with a new port on a port clash); every process is gone on return."""
    deadline = time.monotonic() + DEADLINE_S
    for attempt in range(1, PORT_ATTEMPTS + 1):
        att = _Attempt(Path(tempfile.mkdtemp(prefix="rd-bench-launchers-")))
        port = _free_port()

        def at_deadline(att: _Attempt = att) -> None:
            att.deadline_hit = True
            att.kill()

        timer = threading.Timer(max(0.0, deadline - time.monotonic()), at_deadline)
        timer.daemon = True
        t_launch = time.time()
        timer.start()
        try:
            _LAUNCH[launcher](att, fault, port, deadline)
            t_returned = time.time()
        finally:
            timer.cancel()
            att.finish()
        taken = _port_taken(att.out)
        if taken and attempt < PORT_ATTEMPTS:
            shutil.rmtree(att.out, ignore_errors=True)
            continue
        run = _summarize_run(launcher, fault, att, t_launch, t_returned)
        run["attempts"] = attempt
        shutil.rmtree(att.out, ignore_errors=True)
        return run
    raise AssertionError("not reached")  # pragma: no cover


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _culprit_end(  # noqa: PLR0911 - one return per verdict
    fault: str, res: dict[str, Any] | None, code: int | None, log: str, att: _Attempt
) -> str:
    """How the culprit ended (for a hang: the point of that row)."""
    if fault == "kill":
        return "killed itself"
    if fault == "raise":
        return f"raised {res['type']}" if res and res.get("type") else "?"
    if res is not None and "RankFailureError" in res.get("mro", []) and res["ranks"] == [CULPRIT]:
        return f"raised {res['type']} naming itself"
    if code == UNRESPONSIVE_EXIT_CODE:
        return f"exit code {UNRESPONSIVE_EXIT_CODE}"
    if att.deadline_hit:
        return "killed at the run's deadline"
    if "Timeout (0:" in log:
        return f"exited at its own {RANK_LIMIT_S:g} s limit"
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    got = f", recorded {res['type']} naming {res['ranks']}" if res and res.get("type") else ""
    return f"exit code {code}{got}"


def _rank_info(att: _Attempt, r: int, t_launch: float, t_fault: float | None) -> dict[str, Any]:
    """What rank ``r`` recorded and when its process ended."""
    res = _read(att.out / f"result{r}.json")
    info: dict[str, Any] = {"exit_code": att.codes.get(r)}
    if r in att.t_exit:
        info["exit_after_launch_s"] = round(att.t_exit[r] - t_launch, 3)
        if t_fault is not None:
            info["exit_after_fault_s"] = round(att.t_exit[r] - t_fault, 3)
    if res is None:
        info["result"] = "none recorded"
    elif res.get("type") is None:
        info.update(
            result="done",
            destroy_s=round(res["destroy_s"], 4),
            done_after_launch_s=round(res["t"] - t_launch, 3),
        )
    else:
        info.update(
            result="raised",
            type=res["type"],
            mro=res["mro"],
            stage=res["stage"],
            ranks=res["ranks"],
            message=res["message"],
        )
        if t_fault is not None:
            info["after_fault_s"] = round(res["t_error"] - t_fault, 4)
    return info


def _log(att: _Attempt, r: int) -> str:
    path = att.out / f"log{r}.txt"
    return path.read_text(errors="replace") if path.exists() else ""


def _summarize_run(
    launcher: str, fault: str, att: _Attempt, t_launch: float, t_returned: float
) -> dict[str, Any]:
    fault_rec = _read(att.out / "fault.json")
    t_fault = fault_rec["t_fault"] if fault_rec else None
    ranks = {str(r): _rank_info(att, r, t_launch, t_fault) for r in range(WORLD)}
    run: dict[str, Any] = {
        "launcher": launcher,
        "fault": fault,
        "wall_s": round(t_returned - t_launch, 3),
        "fault_after_launch_s": round(t_fault - t_launch, 3) if t_fault else None,
        "codes": {str(r): c for r, c in att.codes.items()},
        "launcher_said": att.launcher[:500],
        "deadline_hit": att.deadline_hit,
        "left_behind": att.left_behind,
        "ranks": ranks,
    }
    problems = []
    if att.deadline_hit:
        problems.append(f"the run hit its {DEADLINE_S:g} s deadline")
    if att.left_behind:
        problems.append(f"{att.left_behind} process(es) still alive after the launcher returned")
    if fault == "none":
        run["completed"] = all(
            ranks[str(r)]["result"] == "done" and att.codes.get(r) == 0 for r in range(WORLD)
        )
        if run["completed"]:
            # From the last rank's return from destroy_process_group to its process's end
            # (the interpreter's teardown: atexit, modules, torch).
            done = max(i["done_after_launch_s"] for i in ranks.values())
            ends = [i["exit_after_launch_s"] for i in ranks.values() if "exit_after_launch_s" in i]
            if len(ends) == WORLD:
                run["teardown_s"] = round(max(ends) - done, 3)
        else:
            problems.append("a rank did not finish cleanly: " + json.dumps(ranks)[:800])
        run["problems"] = problems
        return run
    if t_fault is None:
        problems.append(f"rank {CULPRIT} never reached its fault")
    for r in SURVIVORS:
        info = ranks[str(r)]
        info["names_culprit"] = info["result"] == "raised" and info["ranks"] == [CULPRIT]
        if info["result"] != "raised":
            problems.append(f"rank {r}: {info['result']} (exit code {info['exit_code']})")
            info["log_tail"] = _log(att, r)[-2000:]
    run["every_survivor_named"] = all(ranks[str(r)]["names_culprit"] for r in SURVIVORS)
    culprit = ranks[str(CULPRIT)]
    run["culprit_end"] = _culprit_end(
        fault,
        _read(att.out / f"result{CULPRIT}.json"),
        att.codes.get(CULPRIT),
        _log(att, CULPRIT),
        att,
    )
    if fault == "hang":
        run["culprit_end_s"] = culprit.get("after_fault_s", culprit.get("exit_after_fault_s"))
    run["problems"] = problems
    return run


# -- summary ------------------------------------------------------------------------------------
def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _max(values: list[float]) -> float | None:
    return round(max(values), 4) if values else None


def _healthy_row(mine: list[dict[str, Any]]) -> dict[str, Any]:
    destroy: dict[str, list[float]] = {str(k): [] for k in range(WORLD)}
    for r in mine:
        for k, info in r["ranks"].items():
            if "destroy_s" in info:
                destroy[k].append(info["destroy_s"])
    teardown = [r["teardown_s"] for r in mine if r.get("teardown_s") is not None]
    return {
        "completed": sum(r["completed"] for r in mine),
        "destroy_s": {
            k: {"median": _med(v), "max": _max(v), "n": len(v)} for k, v in destroy.items()
        },
        "median_teardown_s": _med(teardown),
        "max_teardown_s": _max(teardown),
    }


def _fault_row(fault: str, mine: list[dict[str, Any]]) -> dict[str, Any]:
    after: list[float] = []
    types: Counter[str] = Counter()
    not_named: list[dict[str, Any]] = []
    sigterm = 0  # survivors whose error came from the launcher's SIGTERM (mp.spawn's join)
    for i, r in enumerate(mine):
        for k in map(str, SURVIVORS):
            info = r["ranks"][k]
            if info["result"] != "raised":
                types[info["result"]] += 1
                not_named.append({"run": i, "rank": int(k), "what": info["result"]})
                continue
            types[info["type"]] += 1
            sigterm += "SIGTERM from its launcher" in info["message"]
            if "after_fault_s" in info:
                after.append(info["after_fault_s"])
            if not info["names_culprit"]:
                not_named.append(
                    {
                        "run": i,
                        "rank": int(k),
                        "type": info["type"],
                        "ranks": info["ranks"],
                        "message": _first_line(info["message"])[:400],
                    }
                )
    row = {
        "named_runs": sum(r["every_survivor_named"] for r in mine),
        "survivor_errors": len(after),
        "median_s": _med(after),
        "max_s": _max(after),
        "error_types": dict(types),
        "by_launcher_sigterm": sigterm,
        "expected_type": EXPECTED[fault],
        "not_named": not_named,
        "culprit_end": dict(Counter(r["culprit_end"] for r in mine)),
    }
    if fault == "hang":
        ends = [r["culprit_end_s"] for r in mine if r.get("culprit_end_s") is not None]
        row.update(median_culprit_end_s=_med(ends), max_culprit_end_s=_max(ends))
    return row


def summarize(runs: list[dict[str, Any]], launchers: list[str], faults: list[str]) -> list[dict]:
    rows = []
    for launcher in launchers:
        for fault in faults:
            mine = [r for r in runs if r["launcher"] == launcher and r["fault"] == fault]
            if not mine:
                continue
            walls = [r["wall_s"] for r in mine]
            row: dict[str, Any] = {
                "launcher": launcher,
                "fault": fault,
                "runs": len(mine),
                "port_retries": sum(r["attempts"] - 1 for r in mine),
                "deadline_hits": sum(r["deadline_hit"] for r in mine),
                "left_behind": sum(r["left_behind"] for r in mine),
                "median_wall_s": _med(walls),
                "max_wall_s": _max(walls),
            }
            row.update(_healthy_row(mine) if fault == "none" else _fault_row(fault, mine))
            rows.append(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["launcher", "fault", "runs", "named", "median s", "worst s", "errors", "wall s"]
    body = []
    for r in rows:
        if r["fault"] == "none":
            d = r["destroy_s"]
            errors = "destroy " + ", ".join(
                f"r{k} {_fmt(v['median'])}/{_fmt(v['max'])}" for k, v in d.items()
            )
            named, med, worst = f"{r['completed']}/{r['runs']} ok", "-", "-"
        else:
            errors = ", ".join(f"{k} x{v}" for k, v in r["error_types"].items())
            if r["fault"] == "hang":
                errors += "; rank 1: " + ", ".join(f"{k} x{v}" for k, v in r["culprit_end"].items())
            named, med, worst = (
                f"{r['named_runs']}/{r['runs']}",
                _fmt(r["median_s"]),
                _fmt(r["max_s"]),
            )
        body.append(
            [
                r["launcher"],
                r["fault"],
                str(r["runs"]),
                named,
                med,
                worst,
                errors,
                _fmt(r["median_wall_s"]),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in body]
    head = "  ".join(x.ljust(w) for x, w in zip(header, widths, strict=True))
    return "\n".join([head, "-" * len(head), *lines])


def _operator_env() -> None:
    """This process's environment as an operator's shell would have it: the resilient_ddp
    settings exported, nothing of an enclosing job (mp.spawn's ranks inherit it; the
    plain processes get a copy)."""
    for key in list(os.environ):
        if key.startswith(FOREIGN_ENV_PREFIXES) or key in FOREIGN_ENV:
            del os.environ[key]
    os.environ.update(OPERATOR_ENV)


def _describe(run: dict[str, Any]) -> str:
    """One line per run for the console."""
    head = f"{run['launcher']:<8} {run['fault']:<5} wall {run['wall_s']:.2f} s: "
    if run["fault"] == "none":
        what = "destroy_process_group " + ", ".join(
            f"rank {k} {info.get('destroy_s', float('nan')):.3f} s"
            for k, info in run["ranks"].items()
        )
    else:
        what = "; ".join(
            f"rank {k} {info.get('type', info['result'])} names {info.get('ranks')} after "
            f"{_fmt(info.get('after_fault_s'))} s"
            for k, info in run["ranks"].items()
            if int(k) in SURVIVORS
        )
        if run["fault"] == "hang":
            what += f"; rank {CULPRIT} {run['culprit_end']}"
    return head + what + "".join(f"\n      PROBLEM: {p}" for p in run["problems"])


def _command(args: argparse.Namespace) -> str:
    cmd = ["python", "benchmarks/bench_launchers.py"]
    if args.quick:
        cmd.append("--quick")
    for flag, value in (
        ("--runs", args.runs),
        ("--launchers", args.launchers),
        ("--faults", args.faults),
    ):
        if value:
            cmd += [flag, str(value)]
    return " ".join(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run per case (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument("--runs", type=int, help=f"runs per launcher and fault ({RUNS})")
    parser.add_argument("--launchers", help="comma-separated subset of " + ",".join(LAUNCHERS))
    parser.add_argument("--faults", help="comma-separated subset of " + ",".join(FAULTS))
    parser.add_argument("--rank", nargs=2, metavar=("OUT_DIR", "FAULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        popen_main(*args.rank)
        return 0

    from bench_collectives import _display, _loadavg, machine_info, result_header

    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    runs_each = args.runs or (1 if args.quick else RUNS)
    launchers = args.launchers.split(",") if args.launchers else list(LAUNCHERS)
    faults = args.faults.split(",") if args.faults else list(FAULTS)
    for given, known in ((launchers, LAUNCHERS), (faults, FAULTS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown: {', '.join(unknown)}")

    _operator_env()
    # Started before any run's marker is set, so that no run's clean-up ever kills it.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    print(
        f"{TITLE}\n{WORLD} gloo ranks on CPU, rank {CULPRIT} fails at step {FAULT_STEP} of "
        f"{STEPS}, RESILIENT_DDP_OP_TIMEOUT={OPERATOR_ENV['RESILIENT_DDP_OP_TIMEOUT']}, "
        f"{runs_each} run(s) per case",
        flush=True,
    )
    load_before = _loadavg()
    t_start = time.perf_counter()
    runs = []
    for i in range(runs_each):
        for launcher in launchers:
            for fault in faults:
                run = run_once(launcher, fault)
                run["repeat"] = i
                runs.append(run)
                print(f"  [{i + 1}/{runs_each}] {_describe(run)}", flush=True)
    elapsed = time.perf_counter() - t_start
    rows = summarize(runs, launchers, faults)
    print(format_table(rows))
    print(f"total {elapsed:.1f} s")

    cmd = _command(args)
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": _loadavg()}
    data = {
        **result_header(NAME, TITLE, cmd, quick=args.quick, seconds=elapsed, machine=machine),
        "setup": {
            "world_size": WORLD,
            "culprit": CULPRIT,
            "fault_step": FAULT_STEP,
            "steps": STEPS,
            "runs": runs_each,
            "op_timeout_s": OP_TIMEOUT_S,
            "env": OPERATOR_ENV,
            "hang_s": HANG_S,
            "deadline_s": DEADLINE_S,
            "model": "rd.ResilientDDP(nn.Linear(16, 4)), batch 8, SGD",
            "init": "rd.init_process_group() (env://, no argument)",
            "launchers": {
                "mp_spawn": (
                    "torch.multiprocessing.spawn(fn, nprocs=3), MASTER_ADDR=localhost and "
                    "MASTER_PORT set in the rank as in PyTorch's DDP tutorial; waited on as "
                    "join=True does"
                ),
                "popen": (
                    "3 x subprocess.Popen with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                    "MASTER_PORT in the environment, as srun starts them"
                ),
            },
            "faults": {
                "kill": "SIGKILL itself",
                "raise": "ValueError in user code",
                "hang": f"time.sleep({HANG_S:g}) outside any collective",
                "none": "healthy run",
            },
        },
        "rows": rows,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {_display(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
