"""The frameworks' own training with torch's DDP and with resilient_ddp's one or two lines:
the step time, and what the framework's collectives do when a rank fails.

The training scripts are the framework tests' (tests/_framework_workers.py), started as
the tests start them (tests/test_frameworks_mp.py): Lightning's ``Trainer`` and ``Fabric``
as one process (Lightning starts the other ranks; rank 0 hosts the store), Accelerate and
the Hugging Face ``Trainer`` under torchrun. Each syncs the loss across ranks in every
step. ``plain`` is the framework with torch's own DDP, ``resilient`` the same script with
the library's lines. The environment is the operator's of the tests (tests/_matrix.py:
``RESILIENT_DDP_OP_TIMEOUT=3s``, ``OMP_NUM_THREADS=1``).

1. **Step time**: 2 ranks (on 2 cores), ``RD_FW_STEPS`` steps of the MLP 16 -> WIDTH -> 1
   (``RD_FW_WIDTH``; the Hugging Face ``Trainer`` trains its own 1-layer GPT-2 whatever
   the width), batch 4. A step is the time between two training forward passes on a rank
   (forward, loss sync, backward, optimizer step, next batch); the first ``WARMUP`` steps
   are dropped. A run's figure is the slower rank's median step; plain and resilient runs
   alternate in rounds (the order flips every round), and the ratio is the median over
   rounds of resilient / plain.
2. **Faults**: 3 ranks; rank 1 is killed (SIGKILL), raises a ``ValueError`` or hangs
   (``time.sleep``) in its forward pass of step 3. One run per framework x fault x mode.
   For each survivor (ranks 0 and 2): the error it recorded, its first line, and the
   seconds from the fault (the culprit's clock) to the error (the survivor's; one host);
   a survivor still blocked ``CAP_S`` after the fault is made to write its stacks
   (SIGUSR1, faulthandler) and then everything that names the run's folder is killed
   (tests/_procs.py ``kill_named``). Also the launcher's exit code and wall time.

Usage::

    python benchmarks/bench_frameworks.py          # both parts, about 10 minutes
    python benchmarks/bench_frameworks.py --quick  # 1 round of 20 steps; Lightning kill only

Needs the frameworks and the tests' dependencies (``pip install -e .[test,lightning,
accelerate,transformers]``, as ``nox -s tests`` installs them); without them it says so,
writes nothing and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # tests/: the scripts and the launch helpers of the tests
from bench_collectives import (  # noqa: E402 - one header
    _loadavg,
    machine_info,
    result_header,
    write_result,
)
from tests import _launcher_workers as lw  # noqa: E402 - needs the path above
from tests._procs import kill_named, wait_for  # noqa: E402

NAME = "frameworks"
TITLE = "Frameworks: their DDP against resilient_ddp's, step time and failures"
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

FRAMEWORKS = ("lightning", "fabric", "accelerate", "transformers")
# How each script is started: by Lightning from one process, or by torchrun.
LAUNCHER = {
    "lightning": "lightning",
    "fabric": "lightning",
    "accelerate": "torchrun",
    "transformers": "torchrun",
}
MODES = ("plain", "resilient")
FAULTS = ("kill", "raise", "hang")

STEP_WORLD = 2
STEP_WIDTH = 1024
STEPS, QUICK_STEPS = 100, 20
WARMUP = 5
ROUNDS = 3
HEALTHY_DEADLINE_S = 50.0  # a healthy run, start-up included (the ranks exit by 55 s)

FAULT_WORLD = lw.WORLD
CAP_S = 40.0  # a survivor still blocked this long after the fault is killed
STACK_WAIT_S = 1.0  # for the stacks asked with SIGUSR1 to reach the logs
ENDED_WITHIN_S = 5.0  # how long the ranks may outlive the launcher's return
# Each rank of the scripts exits by itself DUMP_AFTER_S after its start (faulthandler):
# the cap comes before that, whatever the start-up took.
RANK_MARGIN_S = 3.0


# -- one launch ----------------------------------------------------------------------------------
def _environment(world: int, steps: int, width: int | None) -> dict[str, str]:
    """The operator's environment of the tests, with the scripts' benchmark knobs."""
    from tests._matrix import FOREIGN_ENV, FOREIGN_ENV_PREFIXES, OPERATOR_ENV

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(FOREIGN_ENV_PREFIXES) and k not in FOREIGN_ENV
    }
    env.update(OPERATOR_ENV)
    env["RD_FW_WORLD"] = str(world)
    env["RD_FW_STEPS"] = str(steps)
    env.pop("RD_FW_WIDTH", None)
    if width is not None:
        env["RD_FW_WIDTH"] = str(width)
    return env


def _command(framework: str, out: Path, fault: str, mode: str, world: int) -> list[str]:
    script = ["-m", "tests._framework_workers", framework, str(out), fault, mode]
    if LAUNCHER[framework] == "lightning":
        return [sys.executable, *script]  # Lightning starts the other ranks as copies
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--monitor-interval", "0.2", *script,
    ]  # fmt: skip


def _records(out: Path, prefix: str, world: int) -> dict[int, dict[str, Any] | None]:
    from tests._matrix import read_record

    return {r: read_record(out / f"{prefix}{r}.json") for r in range(world)}


def _alive_ranks(out: Path, world: int) -> list[int]:
    from tests._matrix import alive

    return [r for r, s in _records(out, "start", world).items() if s and alive(s)]


def _stop(out: Path, world: int) -> None:
    """Kill whatever of this run still runs: everything naming its folder, and every rank
    whose start record is still alive."""
    from tests._matrix import alive

    kill_named(out)
    for start in _records(out, "start", world).values():
        if start and alive(start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(start["pid"], signal.SIGKILL)


# What the logs say about how a process ended, beyond its exit code.
LOG_MARKERS = (
    "terminate called without an active exception",  # an abort in gloo's teardown
    "SIGABRT",
    "Forcefully terminating all other processes",  # Lightning's launcher SIGKILLs all
)


def _log_markers(out: Path) -> dict[str, list[str]]:
    """For each marker found: the log files of this run that hold it."""
    found: dict[str, list[str]] = {}
    for log in sorted(out.glob("*.txt")):
        text = log.read_text(errors="replace")
        for marker in LOG_MARKERS:
            if marker in text:
                found.setdefault(marker, []).append(log.name)
    return found


def _launch(cmd: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with (out / "launcher.txt").open("wb") as log:  # the launcher keeps its own copy
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)


# -- part 1: step time ---------------------------------------------------------------------------
def _healthy_run(framework: str, mode: str, plan: dict[str, Any], work: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{framework}-{mode}-", dir=work))
    env = _environment(STEP_WORLD, plan["steps"], plan["width"])
    t0 = time.monotonic()
    proc = _launch(_command(framework, out, "none", mode, STEP_WORLD), out, env)
    try:
        rc: int | None = proc.wait(timeout=HEALTHY_DEADLINE_S)
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.monotonic() - t0
    left = _alive_ranks(out, STEP_WORLD) if rc is not None else []
    if rc is not None and left:
        wait_for(lambda: not _alive_ranks(out, STEP_WORLD), ENDED_WITHIN_S)
        left = _alive_ranks(out, STEP_WORLD)
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    _stop(out, STEP_WORLD)
    medians = {}
    for r, rec in _records(out, "losses", STEP_WORLD).items():
        steps = rec["step_s"][plan["warmup"] :] if rec else []
        if steps:
            medians[r] = statistics.median(steps)
    return {
        "exit_code": rc,
        "wall_s": round(wall, 2),
        "median_step_s": medians,
        "left_behind": left,
        "log_markers": _log_markers(out),
    }


def _slowest_ms(run: dict[str, Any]) -> float | None:
    medians = run["median_step_s"]
    return round(1000 * max(medians.values()), 2) if len(medians) == STEP_WORLD else None


def _count_markers(runs: list[dict[str, Any]]) -> dict[str, int]:
    """For each log marker: in how many of these runs it was found."""
    counts: dict[str, int] = {}
    for run in runs:
        for marker in run["log_markers"]:
            counts[marker] = counts.get(marker, 0) + 1
    return counts


def step_times(plan: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rnd in range(plan["rounds"]):
        order = MODES if rnd % 2 == 0 else MODES[::-1]
        for framework in plan["frameworks"]:
            for mode in order:
                run = _healthy_run(framework, mode, plan, work)
                runs.setdefault((framework, mode), []).append(run)
                ms = {r: round(v * 1000, 2) for r, v in run["median_step_s"].items()}
                print(
                    f"  round {rnd + 1} {framework:>12} {mode:>9}: median step ms per rank "
                    f"{ms}, exit code {run['exit_code']}, {run['wall_s']:.1f} s",
                    flush=True,
                )
    rows = []
    for framework in plan["frameworks"]:
        plain, res = runs[(framework, "plain")], runs[(framework, "resilient")]
        ratios, complete = [], []
        for p, q in zip(plain, res, strict=True):
            if len(p["median_step_s"]) == STEP_WORLD and len(q["median_step_s"]) == STEP_WORLD:
                slow_p, slow_q = max(p["median_step_s"].values()), max(q["median_step_s"].values())
                complete.append((slow_p, slow_q))
                ratios.append(slow_q / slow_p)
        row: dict[str, Any] = {
            "framework": framework,
            "rounds": len(ratios),
            "ratios": [round(x, 4) for x in ratios],
            # Each run's slower-rank median step, in run order (None: no losses recorded).
            "plain_ms_runs": [_slowest_ms(p) for p in plain],
            "resilient_ms_runs": [_slowest_ms(q) for q in res],
            "plain_exit_codes": [p["exit_code"] for p in plain],
            "resilient_exit_codes": [q["exit_code"] for q in res],
            "left_behind": sum(len(x["left_behind"]) for x in plain + res),
            "plain_log_markers": _count_markers(plain),
            "resilient_log_markers": _count_markers(res),
        }
        if complete:
            plain_ms = 1000 * statistics.median(p for p, _ in complete)
            res_ms = 1000 * statistics.median(q for _, q in complete)
            row.update(
                plain_ms=round(plain_ms, 2),
                resilient_ms=round(res_ms, 2),
                added_ms=round(1000 * statistics.median(q - p for p, q in complete), 2),
                ratio=round(statistics.median(ratios), 4),
            )
        rows.append(row)
    return rows


# -- part 2: faults ------------------------------------------------------------------------------
def _first_line(message: str, n: int = 160) -> str:
    lines = message.strip().splitlines()
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", lines[0]) if lines else ""  # gloo's
    return line if len(line) <= n else line[: n - 3] + "..."


def _where(log: Path) -> str:
    """The innermost frames of the main thread in the last stack dump of a rank's log
    (faulthandler, after SIGUSR1): where it was blocked."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    blocks = text.split("Current thread ")
    if len(blocks) < 2:
        return ""
    frames = []
    for raw in blocks[-1].splitlines()[1:]:
        line = raw.strip()
        if not line.startswith("File "):
            break
        # File "/.../site-packages/torch/distributed/distributed_c10d.py", line 2839 in all_reduce
        path, _, rest = line.removeprefix('File "').partition('", line ')
        lineno, _, func = rest.partition(" in ")
        short = path.split("site-packages/")[-1].split(str(ROOT) + "/")[-1]
        frames.append(f"{func} ({short}:{lineno})")
        if len(frames) == 3:
            break
    return " < ".join(frames)


def _survivor(res: dict[str, Any] | None, t_fault: float | None, blocked: bool) -> dict[str, Any]:
    if res is None:
        return {"outcome": "blocked" if blocked else "no record"}
    if res.get("type") is None:
        return {"outcome": "finished"}
    return {
        "outcome": "raised",
        "type": res["type"],
        "rd_error": "ResilientDDPError" in res.get("mro", []),
        "ranks": res.get("ranks", []),
        "stage": res.get("stage"),
        "after_fault_s": None if t_fault is None else round(res["t_error"] - t_fault, 2),
        "message": _first_line(str(res.get("message", ""))),
        "raised_in": _raised_in(str(res.get("traceback", ""))),
    }


def _raised_in(traceback: str) -> str:
    """The innermost frames of a recorded traceback: where the error was raised."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback)
    return " < ".join(
        f"{func} ({path.split('site-packages/')[-1].split(str(ROOT) + '/')[-1]}:{line})"
        for path, line, func in reversed(frames[-3:])
    )


def _wait_or_cap(proc: subprocess.Popen[bytes], out: Path, t_launch: float) -> int | None:
    """The launcher's exit code, or None once the cap passed: CAP_S after the fault, or
    before the ranks' own limit (whichever comes first)."""
    from tests._matrix import read_record

    while (rc := proc.poll()) is None:
        fault_rec = read_record(out / "fault.json")
        starts = [s["t"] for s in _records(out, "start", FAULT_WORLD).values() if s]
        deadline = t_launch + HEALTHY_DEADLINE_S  # never reached the fault: stop anyway
        if fault_rec:
            deadline = fault_rec["t_fault"] + CAP_S
        if starts:
            deadline = min(deadline, min(starts) + lw.DUMP_AFTER_S - RANK_MARGIN_S)
        if time.time() >= deadline:
            return None
        time.sleep(0.1)
    return rc


def fault_run(framework: str, fault: str, mode: str, work: Path) -> dict[str, Any]:
    from tests._matrix import read_record

    out = Path(tempfile.mkdtemp(prefix=f"{framework}-{fault}-{mode}-", dir=work))
    env = _environment(FAULT_WORLD, lw.STEPS, None)
    t_launch, t0 = time.time(), time.monotonic()
    proc = _launch(_command(framework, out, fault, mode, FAULT_WORLD), out, env)
    rc = _wait_or_cap(proc, out, t_launch)
    cap_hit = rc is None
    t_end = time.time()
    wall = time.monotonic() - t0
    fault_rec = read_record(out / "fault.json")
    t_fault = fault_rec["t_fault"] if fault_rec else None
    left: list[int] = []
    if cap_hit:
        blocked = _alive_ranks(out, FAULT_WORLD)
        for r in blocked:  # every thread's stack to its log, for where it was blocked
            start = read_record(out / f"start{r}.json")
            if start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(start["pid"], signal.SIGUSR1)
        time.sleep(STACK_WAIT_S)
        proc.kill()
        proc.wait(10)
    else:
        wait_for(lambda: not _alive_ranks(out, FAULT_WORLD), ENDED_WITHIN_S)
        blocked = []
        left = _alive_ranks(out, FAULT_WORLD)
    _stop(out, FAULT_WORLD)
    results = _records(out, "result", FAULT_WORLD)
    survivors = {}
    for r in range(FAULT_WORLD):
        if r == lw.CULPRIT:
            continue
        s = _survivor(results[r], t_fault, r in blocked)
        if s["outcome"] == "blocked":
            s["blocked_s"] = None if t_fault is None else round(t_end - t_fault, 1)
            s["where"] = _where(out / f"log{r}.txt")
        survivors[str(r)] = s
    culprit = results[lw.CULPRIT]
    return {
        "framework": framework,
        "launcher": LAUNCHER[framework],
        "fault": fault,
        "mode": mode,
        "exit_code": rc,
        "cap_hit": cap_hit,
        "wall_s": round(wall, 1),
        "fault_after_launch_s": None if t_fault is None else round(t_fault - t_launch, 1),
        "survivors": survivors,
        "culprit": (
            {"type": culprit.get("type"), "message": _first_line(str(culprit.get("message")))}
            if culprit and culprit.get("type")
            else None
        ),
        "culprit_blocked": lw.CULPRIT in blocked,
        "left_behind": left,
        "log_markers": _log_markers(out),
    }


def _fault_line(row: dict[str, Any]) -> str:
    parts = []
    for r, s in row["survivors"].items():
        if s["outcome"] == "raised":
            parts.append(f"rank {r}: {s['type']} {s['ranks']} +{s['after_fault_s']} s")
        else:
            parts.append(f"rank {r}: {s['outcome']} {s.get('blocked_s', '')}")
    return (
        f"  {row['framework']:>12} {row['fault']:>5} {row['mode']:>9}: {'; '.join(parts)}; "
        f"exit code {row['exit_code']}, {row['wall_s']:.1f} s"
    )


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    needed = ("pytest", "lightning", "torchmetrics", "accelerate", "transformers")
    missing = [p for p in needed if importlib.util.find_spec(p) is None]
    if missing:
        print(
            f"{NAME}: skipped, not installed: {', '.join(missing)} "
            "(pip install -e .[test,lightning,accelerate,transformers]); nothing written"
        )
        return 0
    plan: dict[str, Any] = {
        "frameworks": list(FRAMEWORKS[:1] if args.quick else FRAMEWORKS),
        "world_size": STEP_WORLD,
        "width": STEP_WIDTH,
        "mlp_params": 16 * STEP_WIDTH + STEP_WIDTH + STEP_WIDTH + 1,
        "batch": 4,
        "steps": QUICK_STEPS if args.quick else STEPS,
        "warmup": WARMUP,
        "rounds": 1 if args.quick else ROUNDS,
    }
    cases = [
        (f, fault, mode)
        for f in (FRAMEWORKS[:1] if args.quick else FRAMEWORKS)
        for fault in (FAULTS[:1] if args.quick else FAULTS)
        for mode in MODES
    ]
    from tests._matrix import OPERATOR_ENV

    load_before = _loadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rd-bench-frameworks-") as tmp:
        work = Path(tmp)
        print(f"{TITLE}\n1. step time: {plan}", flush=True)
        step_rows = step_times(plan, work)
        for row in step_rows:
            print(
                f"  {row['framework']:>12}: plain {row.get('plain_ms', '?')} ms, resilient "
                f"{row.get('resilient_ms', '?')} ms, ratio {row.get('ratio', '?')} "
                f"(rounds {row['ratios']})",
                flush=True,
            )
        print(f"2. faults: {len(cases)} runs, {FAULT_WORLD} ranks, cap {CAP_S:g} s", flush=True)
        fault_rows = []
        for framework, fault, mode in cases:
            row = fault_run(framework, fault, mode, work)
            fault_rows.append(row)
            print(_fault_line(row), flush=True)
    elapsed = time.perf_counter() - t0
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": _loadavg()}
    command = "python benchmarks/bench_frameworks.py" + (" --quick" if args.quick else "")
    result = {
        **result_header(NAME, TITLE, command, quick=args.quick, seconds=elapsed, machine=machine),
        "setup": {
            "env": OPERATOR_ENV,
            "step": plan,
            "faults": {
                "world_size": FAULT_WORLD,
                "culprit": lw.CULPRIT,
                "fault_step": lw.FAULT_STEP,
                "steps": lw.STEPS,
                "cap_s": CAP_S,
                "hang_s": lw.HANG_S,
            },
        },
        "step_rows": step_rows,
        "fault_rows": fault_rows,
    }
    write_result(out, result)
    print(f"total {elapsed:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
