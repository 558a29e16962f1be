"""Failure detection latency: resilient_ddp against plain torch with the same timeout.

Three gloo ranks on CPU train a small MLP (``rd.ResilientDDP`` against torch's
``DistributedDataParallel``), or all-reduce in a loop for the divergence case. At step
``FAULT_STEP`` rank 1 (the culprit) fails in one of four ways:

* ``kill``: SIGKILL after its forward pass (the OOM killer);
* ``raise``: an exception after its forward pass, uncaught, so that the process exits as a
  script would (``sys.excepthook``, ``atexit``, interpreter teardown);
* ``hang``: ``time.sleep`` after its forward pass, for longer than the run (a stuck data
  loader or a deadlock: the process is alive, its threads run);
* ``divergence``: an all-reduce of 5 elements where the others reduce 4
  (``rd.all_reduce(t, validate=True)`` against ``torch.distributed.all_reduce(t)``).

Both sides get the same timeout ``T`` (10 s): plain torch as the process group's timeout,
``dist.init_process_group("gloo", timeout=T)``; resilient_ddp as its op timeout,
``ResilienceConfig(op_timeout=T)``, with every other setting at its default (heartbeat
every 0.5 s; ``rd.init_process_group`` then gives the backend op_timeout +
heartbeat_timeout + 30 s). What is measured is the time from the fault (the culprit's
clock just before it kills itself, raises, sleeps or diverges) to the moment the *last*
surviving rank raised (each rank's own clock, in the ``except`` clause); the same host, so
the same clock. The survivors are the ranks other than the culprit, and for divergence
every rank (the culprit is alive and should learn of it too). A survivor that has not
raised ``T + 5`` s after the fault is recorded as "did not raise" and the run is ended.

Each rank is a real ``python`` process started by this script (as torchrun would start
it: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a ``TCPStore(port=0)``
hosted by this parent, ``TORCHELASTIC_USE_AGENT_STORE=True``). The parent does not
react to a death (it reports nothing to the ranks): what the survivors learn, they learn
by themselves. Every process of a run is killed at its end, and each rank also exits by
itself through ``faulthandler.dump_traceback_later(..., exit=True)`` if the parent is
gone.

Usage::

    python benchmarks/bench_detection.py            # 4 faults x 2 sides x 3 repeats, ~4 min
    python benchmarks/bench_detection.py --quick    # 1 repeat, T = 3 s (smoke test)
    python benchmarks/bench_detection.py --kinds kill,hang --repeats 1

The full run writes ``benchmarks/results/detection.json`` and the timeline figure
``docs/img/detection_timeline.png`` (with matplotlib installed: ``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

NAME = "detection"
TITLE = "Detection latency: resilient_ddp vs plain torch"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
DOCS_IMG = ROOT / "docs" / "img"
QUICK_IMG = HERE / "results" / "quick" / "img"

KINDS = ("kill", "raise", "hang", "divergence")
IMPLS = ("rd", "torch")
IMPL_LABELS = {"rd": "resilient_ddp", "torch": "plain torch"}
WORLD_SIZE = 4  # with 3, every survivor would be a ring neighbour of the culprit
CULPRIT = 1
FAULT_STEP = 8
STEPS = FAULT_STEP + 12  # the divergence loop goes on this long when nothing raises
COMPUTE_S = 0.05  # stands for the forward pass of a real model, so that steps show
TIMEOUT_S = 10.0
QUICK_TIMEOUT_S = 3.0
GRACE_S = 5.0  # how long after T a survivor is still waited for
STARTUP_S = 60.0  # from launch to the fault, at most
REPEATS = 3
SIMULATED_ERROR = "CUDA out of memory (simulated)"


# -- one rank (runs in its own interpreter) -----------------------------------------------------
class _Events:
    """Append-only JSON lines, one file per rank: survives the rank's death."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - kept open

    def log(self, event: str, **fields: Any) -> None:
        fields.update(event=event, t=time.time())
        self._f.write(json.dumps(fields) + "\n")
        self._f.flush()


def _inject(kind: str, events: _Events) -> None:
    events.log("fault", kind=kind)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(SIMULATED_ERROR)
    elif kind == "hang":
        time.sleep(3600)


def _train(spec: dict[str, Any], rank: int, events: _Events) -> None:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import resilient_ddp as rd

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    model = rd.ResilientDDP(net) if spec["impl"] == "rd" else DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    events.log("ready")
    for step in range(spec["steps"]):
        x = torch.randn(32, 32, generator=g)
        time.sleep(spec["compute_s"])
        loss = model(x).pow(2).mean()
        if rank == spec["culprit"] and step == spec["fault_step"]:
            _inject(spec["kind"], events)
        loss.backward()
        opt.step()
        opt.zero_grad()
        events.log("step", step=step)


def _diverge(spec: dict[str, Any], rank: int, events: _Events) -> None:
    import torch
    import torch.distributed as dist

    import resilient_ddp as rd

    expected = float(sum(range(1, spec["world_size"] + 1)))
    events.log("ready")
    for step in range(spec["steps"]):
        n = 4
        if rank == spec["culprit"] and step == spec["fault_step"]:
            events.log("fault", kind="divergence")
            n = 5
        t = torch.full((n,), float(rank + 1))
        if spec["impl"] == "rd":
            rd.all_reduce(t, validate=True)
        else:
            dist.all_reduce(t)
        events.log("step", step=step, correct=bool((t[:4] == expected).all()))
        time.sleep(spec["compute_s"])


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: init, train (or all-reduce), fail on cue, record when it learned."""
    import faulthandler
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import resilient_ddp as rd

    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(spec["hard_limit_s"], exit=True)
    torch.set_num_threads(1)
    events = _Events(os.path.join(spec["dir"], f"rank{rank}.jsonl"))
    timeout = timedelta(seconds=spec["timeout_s"])
    if spec["impl"] == "rd":
        rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=timeout))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        (_diverge if spec["kind"] == "divergence" else _train)(spec, rank, events)
    except Exception as e:
        if rank != spec["culprit"] or spec["kind"] != "raise" or str(e) != SIMULATED_ERROR:
            ranks = getattr(e, "ranks", None)
            events.log(
                "raised",
                type=type(e).__name__,
                message=str(e)[:3000],
                ranks=list(ranks) if ranks is not None else None,
            )
        # Uncaught, as in a user's script: sys.excepthook, atexit, teardown, exit code 1.
        # (For plain torch, a rank that exits closes its connections, which is how the
        # ranks that are not the culprit's neighbours may learn of the failure.)
        raise
    events.log("finished")


# -- the parent: one run ------------------------------------------------------------------------
def _read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


class Zygote:
    """A Python process that has imported torch and resilient_ddp once, and forks a rank
    on request (like multiprocessing's forkserver).

    Unlike a forkserver child, a forked rank leaves as a script does: an uncaught exception
    goes through ``sys.excepthook``, then ``atexit`` handlers and the interpreter's
    teardown run. That matters here: how soon the peers of a rank that raises notice its
    end depends on that teardown. It saves the ~2.5 s of imports per rank and run.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        self.exits: dict[int, tuple[int, float]] = {}
        self._pids: queue.Queue[int] = queue.Queue()
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if self._lines.get(timeout=120) != "ready":
            raise RuntimeError("the zygote did not start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            word, *rest = raw.decode().split()
            if word == "pid":
                self._pids.put(int(rest[0]))
            elif word == "exit":
                self.exits[int(rest[0])] = (int(rest[1]), time.time())
            else:
                self._lines.put(word)

    def spawn(self, spec: dict[str, Any], env: dict[str, str], stderr: Path) -> int:
        assert self.proc.stdin is not None
        line = json.dumps({"spec": spec, "env": env, "stderr": str(stderr)}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        return self._pids.get(timeout=30)

    def poll(self, pid: int) -> int | None:
        return self.exits[pid][0] if pid in self.exits else None

    def kill(self, pid: int) -> None:
        if pid not in self.exits:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait(self, pid: int, timeout: float) -> None:
        end = time.time() + timeout
        while pid not in self.exits and time.time() < end:
            time.sleep(0.01)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def zygote_main() -> None:
    """The zygote's loop: import once, then fork a rank per request line on stdin and
    report ``pid N`` and ``exit N CODE`` on stdout. Ends at EOF, killing its ranks."""
    import torch
    import torch.distributed
    import torch.nn.parallel  # imported once here, for every rank

    import resilient_ddp  # noqa: F401 - imported for the ranks

    torch.set_num_threads(1)
    out = os.dup(1)  # the pipe to the parent; the ranks must not hold it

    def say(text: str) -> None:
        os.write(out, text.encode() + b"\n")

    say("ready")
    buf = b""
    live: set[int] = set()
    eof = False
    while not eof or live:
        ready, _, _ = select.select([] if eof else [0], [], [], 0.01)
        if ready:
            chunk = os.read(0, 1 << 16)
            eof = not chunk
            buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(out)
                _become_rank(req)  # never returns: the rank leaves as a script does
            live.add(pid)
            say(f"pid {pid}")
        if eof:
            for pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _become_rank(req: dict[str, Any]) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    os.environ.update(req["env"])
    rank_main(req["spec"])
    sys.exit(0)


def run_once(
    zygote: Zygote, kind: str, impl: str, timeout_s: float, world_size: int = WORLD_SIZE
) -> dict[str, Any]:
    """One launch of ``world_size`` ranks with one fault; every process is gone on return."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmp = Path(tempfile.mkdtemp(prefix="rd-detect-"))
    window = timeout_s + GRACE_S
    spec = {
        "impl": impl,
        "kind": kind,
        "culprit": CULPRIT,
        "fault_step": FAULT_STEP,
        "steps": STEPS,
        "compute_s": COMPUTE_S,
        "timeout_s": timeout_s,
        "world_size": world_size,
        "dir": str(tmp),
        "hard_limit_s": STARTUP_S + window + 30,
    }
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "GROUP_RANK": "0",
    }
    # For divergence the culprit is alive and should learn of it too.
    survivors = [r for r in range(world_size) if r != CULPRIT or kind == "divergence"]
    pids: list[int] = []
    t_launch = time.time()
    try:
        for rank in range(world_size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            pids.append(zygote.spawn(spec, rank_env, tmp / f"rank{rank}.stderr"))
        events, exits, t_end = _watch(zygote, tmp, pids, survivors, t_launch, window)
    finally:
        for pid in pids:
            zygote.kill(pid)
        for pid in pids:
            zygote.wait(pid, timeout=30)
        del store
    stderr_tails = {
        r: (tmp / f"rank{r}.stderr").read_text(encoding="utf-8", errors="replace")[-1500:]
        for r in range(world_size)
    }
    shutil.rmtree(tmp, ignore_errors=True)
    return _summarize_run(kind, impl, events, exits, survivors, t_launch, t_end, stderr_tails)


def _watch(
    zygote: Zygote,
    tmp: Path,
    pids: list[int],
    survivors: list[int],
    t_launch: float,
    window: float,
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, tuple[int, float]], float]:
    """Poll the ranks' event files until every survivor raised or finished, a survivor
    died, or the window after the fault (or the start-up budget) ran out."""
    exits: dict[int, tuple[int, float]] = {}
    while True:
        time.sleep(0.02)
        now = time.time()
        for r, pid in enumerate(pids):
            if r not in exits and zygote.poll(pid) is not None:
                exits[r] = zygote.exits[pid]
        events = {r: _read_events(tmp / f"rank{r}.jsonl") for r in range(len(pids))}
        fault = next((e for e in events[CULPRIT] if e["event"] == "fault"), None)
        done = all(
            r in exits or any(e["event"] in ("raised", "finished") for e in events[r])
            for r in survivors
        )
        if fault is not None and (done or now > fault["t"] + window):
            return events, exits, now
        if fault is None and (now > t_launch + STARTUP_S or len(exits) == len(pids)):
            return events, exits, now
        if fault is None and any(r in exits for r in survivors):
            return events, exits, now  # a rank died before the fault: a broken run


_RANK_RE = re.compile(rf"\brank\W{{0,3}}{CULPRIT}\b", re.IGNORECASE)


def _summarize_run(
    kind: str,
    impl: str,
    events: dict[int, list[dict[str, Any]]],
    exits: dict[int, tuple[int, float]],
    survivors: list[int],
    t_launch: float,
    t_end: float,
    stderr_tails: dict[int, str],
) -> dict[str, Any]:
    fault = next((e for e in events[CULPRIT] if e["event"] == "fault"), None)
    run: dict[str, Any] = {"kind": kind, "impl": impl, "observed_s": None, "ranks": {}}
    if fault is None:
        run["error"] = "no fault happened (the run broke before it)"
        run["stderr"] = stderr_tails
        return run
    t0 = fault["t"]
    run["observed_s"] = round(t_end - t0, 3)
    run["startup_s"] = round(t0 - t_launch, 3)
    for r, evs in events.items():
        info: dict[str, Any] = {
            "steps_s": [round(e["t"] - t0, 4) for e in evs if e["event"] == "step"],
            "survivor": r in survivors,
        }
        if kind == "divergence":
            info["wrong_steps_s"] = [
                round(e["t"] - t0, 4)
                for e in evs
                if e["event"] == "step" and not e.get("correct", True)
            ]
            info["wrong_results"] = len(info["wrong_steps_s"])
        raised = next((e for e in evs if e["event"] == "raised"), None)
        if raised is not None:
            ranks = raised["ranks"]
            info.update(
                raised_s=round(raised["t"] - t0, 4),
                type=raised["type"],
                message=raised["message"],
                names_culprit=(
                    CULPRIT in ranks
                    if ranks is not None
                    else bool(_RANK_RE.search(raised["message"]))
                ),
            )
        elif any(e["event"] == "finished" for e in evs):
            info["finished"] = True
        if r in exits:
            info["exit_code"] = exits[r][0]
            info["exit_s"] = round(exits[r][1] - t0, 3)
        run["ranks"][str(r)] = info
    raised = [run["ranks"][str(r)].get("raised_s") for r in survivors]
    run["all_raised"] = all(x is not None for x in raised)
    run["last_raised_s"] = max(raised) if run["all_raised"] else None  # type: ignore[type-var]
    got = [x for x in raised if x is not None]
    run["first_raised_s"] = min(got) if got else None
    if not run["all_raised"]:
        run["stderr"] = {
            r: stderr_tails[r] for r in survivors if "raised_s" not in run["ranks"][str(r)]
        }
    return run


# -- summary ------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]], kinds: list[str], window: float) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for impl in IMPLS:
            mine = [r for r in runs if r["kind"] == kind and r["impl"] == impl]
            ok = [r for r in mine if r.get("observed_s") is not None]
            complete = [r["last_raised_s"] for r in ok if r["all_raised"]]
            firsts = [r["first_raised_s"] for r in ok if r["first_raised_s"] is not None]
            raised_by: set[int] = set()
            names, types, first_lines = [], set(), []
            wrong: set[int] = set()
            for r in ok:
                for rank, info in r["ranks"].items():
                    if "raised_s" in info and info["survivor"]:
                        raised_by.add(int(rank))
                        names.append(bool(info["names_culprit"]))
                        types.add(info["type"])
                        first_lines.append(
                            info["message"].splitlines()[0] if info["message"] else ""
                        )
                    if info.get("wrong_results"):
                        wrong.add(int(rank))
            survivors = sorted(
                int(k) for k, v in (ok[0]["ranks"].items() if ok else []) if v["survivor"]
            )
            rows.append(
                {
                    "kind": kind,
                    "impl": impl,
                    "runs": len(mine),
                    "broken_runs": len(mine) - len(ok),
                    "runs_all_raised": len(complete),
                    "median_last_s": statistics.median(complete) if complete else None,
                    "last_s": complete,
                    "median_first_s": statistics.median(firsts) if firsts else None,
                    "survivors": survivors,
                    "raised_ranks": sorted(raised_by),
                    "names_culprit": (
                        "all" if names and all(names) else "some" if any(names) else "none"
                    ),
                    "error_types": sorted(types),
                    "message": first_lines[0] if first_lines else "",
                    "wrong_result_ranks": sorted(wrong),
                    "window_s": window,
                }
            )
    return rows


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["fault", "side", "last raised (median s)", "first (s)", "runs", "raised", "named"]
    body = []
    for r in rows:
        last = (
            _fmt_s(r["median_last_s"])
            if r["runs_all_raised"] == r["runs"]
            else f"not all within {r['window_s']:g} s ({r['runs_all_raised']}/{r['runs']})"
        )
        body.append(
            [
                r["kind"],
                IMPL_LABELS[r["impl"]],
                last,
                _fmt_s(r["median_first_s"]),
                str(r["runs"]),
                ",".join(map(str, r["raised_ranks"])) or "none",
                r["names_culprit"],
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in body]
    head = "  ".join(x.ljust(w) for x, w in zip(header, widths, strict=True))
    return "\n".join([head, "-" * len(head), *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, T = 3 s (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument("--repeats", type=int, help=f"runs per fault and side ({REPEATS})")
    parser.add_argument("--kinds", help="comma-separated subset of " + ",".join(KINDS))
    parser.add_argument("--timeout", type=float, help=f"T in seconds ({TIMEOUT_S:g})")
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE, help=f"ranks ({WORLD_SIZE})")
    parser.add_argument("--img-dir", type=Path, help="where to write the timeline figure")
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        zygote_main()
        return 0

    from bench_collectives import _display, _loadavg, machine_info, result_header
    from plots import TIMELINE_PNG, plot_timeline

    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    img_dir: Path = args.img_dir or (QUICK_IMG if args.quick else DOCS_IMG)
    repeats = args.repeats or (1 if args.quick else REPEATS)
    timeout_s = args.timeout or (QUICK_TIMEOUT_S if args.quick else TIMEOUT_S)
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kind(s): {', '.join(unknown)}")

    print(
        f"{TITLE}\n{args.world_size} gloo ranks on CPU, rank {CULPRIT} fails at step {FAULT_STEP}, "
        f"T = {timeout_s:g} s, {repeats} repeat(s)",
        flush=True,
    )
    load_before = _loadavg()
    t_start = time.perf_counter()
    runs = []
    zygote = Zygote()
    for rep in range(repeats):
        for kind in kinds:
            for impl in IMPLS if rep % 2 == 0 else tuple(reversed(IMPLS)):
                run = run_once(zygote, kind, impl, timeout_s, args.world_size)
                run["repeat"] = rep
                runs.append(run)
                print(
                    f"  [{rep + 1}/{repeats}] {kind:<10} {IMPL_LABELS[impl]:<13} "
                    + (
                        f"last survivor raised after {_fmt_s(run['last_raised_s'])} s"
                        if run.get("all_raised")
                        else run.get("error")
                        or f"not every survivor raised within {timeout_s + GRACE_S:g} s"
                    ),
                    flush=True,
                )
    zygote.close()
    elapsed = time.perf_counter() - t_start
    rows = summarize(runs, kinds, timeout_s + GRACE_S)
    print(format_table(rows))
    print(f"total {elapsed:.1f} s")

    cmd = ["python", "benchmarks/bench_detection.py"]
    if args.quick:
        cmd.append("--quick")
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": _loadavg()}
    data = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=elapsed, machine=machine
        ),
        "setup": {
            "world_size": args.world_size,
            "culprit": CULPRIT,
            "fault_step": FAULT_STEP,
            "timeout_s": timeout_s,
            "window_s": timeout_s + GRACE_S,
            "repeats": repeats,
            "compute_s": COMPUTE_S,
            "model": "MLP 32-64-1, batch 32, SGD",
            "rd": (
                f"rd.init_process_group('gloo', config=rd.ResilienceConfig(op_timeout="
                f"timedelta(seconds={timeout_s:g}))) + rd.ResilientDDP; divergence: "
                "rd.all_reduce(t, validate=True)"
            ),
            "torch": (
                f"dist.init_process_group('gloo', timeout=timedelta(seconds={timeout_s:g})) + "
                "DistributedDataParallel; divergence: dist.all_reduce(t)"
            ),
        },
        "rows": rows,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {_display(out)}")
    png = plot_timeline(data, img_dir / TIMELINE_PNG)
    if png is not None:
        print(f"wrote {_display(png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
