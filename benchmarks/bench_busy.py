"""Busy is not stuck: false alarms over healthy jobs with a busy rank, and how long a real
hang takes to be named, with the library's default settings (issue 26).

Every run is 3 gloo ranks on CPU (the workers of ``tests/_busy_workers.py``):

* **false-alarm matrix**, healthy jobs that must complete with no rank raising: one rank
  busy for 9 s (3x the default stuck window) in a CPU-bound Python loop (``cpu``, as a
  compile or an evaluation), in throttled checkpoint writes (``io``), in rank-0-only
  evaluation inside a ``ResilientDDP`` loop (``ddp_eval``); a 3 s CPU pause (``gc_pause``);
  and a healthy ``ResilientDDP`` loop with a busy-looping process on each core beside the
  ranks (``loaded``);
* **hang matrix**: a deadlock on a ``threading.Lock``, a dead data loader (``queue.get``
  with a timeout, in a loop), ``time.sleep`` in a loop, SIGSTOP: the seconds from the hang
  to the error on the slowest peer, and whether every rank named the culprit.

Launchers: ``rd.spawn`` (the parent hosts the store), ``torchrun`` (its agent's store) and
``env`` (plain processes with ``MASTER_ADDR``/``MASTER_PORT``, rank 0 hosting the store, as
``srun`` starts them).

``--before SRC`` also runs the same matrix against another checkout's ``src`` folder (the
code before issue 26), once with its defaults and once with ``op_timeout=5 s`` (what a user
set to get hangs named in seconds), to show what the clock alone did.

Usage: ``python benchmarks/bench_busy.py [--runs N] [--launchers spawn,torchrun,env]
[--before PATH/TO/OLD/src]``. Prints one line per run and writes ``results/busy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from bench_collectives import result_header, write_result  # noqa: E402

NAME = "busy"
TITLE = "Busy or stuck: false alarms and hang detection"
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
WORLD = 3
CULPRIT = 0
BUSY_S = 9.0  # 3x the default stuck window (3 s)
BUSY: dict[str, tuple[str, list[Any]]] = {
    # case: (worker, its arguments after the rank)
    "cpu": ("late", [CULPRIT, "cpu", BUSY_S]),
    "io": ("late", [CULPRIT, "io", BUSY_S]),
    "gc_pause": ("late", [CULPRIT, "cpu", 3.0]),
    "ddp_eval": ("ddp_loop", [CULPRIT, "eval", BUSY_S]),
    "loaded": ("ddp_loop", [CULPRIT, "none", 0.0]),
}
HANGS = ["deadlock", "loader", "sleep", "stop"]
RUN_TIMEOUT_S = 150.0


def _args(worker: str, args: list[Any], tmp: str, cfg: dict[str, Any]) -> list[Any]:
    return [*args, tmp, cfg] if worker == "late" else [*args, cfg]


def _spawn(worker: str, args: list[Any]) -> list[Any]:
    from tests import _busy_workers

    from resilient_ddp.testing import run_ranks

    outcomes = run_ranks(
        getattr(_busy_workers, worker),
        WORLD,
        args,
        timeout=timedelta(seconds=RUN_TIMEOUT_S),
        grace=timedelta(seconds=5),
    )
    return [o.value if o.exitcode == 0 else {"exit": o.exitcode} for o in outcomes]


def _processes(worker: str, args: list[Any], launcher: str, env: dict[str, str]) -> list[Any]:
    """The ranks under torchrun, or as plain processes with env:// (rank 0 hosts the store)."""
    with tempfile.TemporaryDirectory() as out:
        script = [str(HERE / "_busy_rank.py"), out, worker, json.dumps(args)]
        base = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC")}
        store = None
        if launcher == "torchrun":
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                "--rdzv-conf", "is_host=0", "--monitor-interval", "0.2", *script,
            ]  # fmt: skip
            procs = [
                subprocess.Popen(
                    cmd,
                    env=base,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            ]
        else:
            port = _free_port()
            procs = [
                subprocess.Popen(
                    [sys.executable, *script],
                    env={
                        **base,
                        "RANK": str(r),
                        "WORLD_SIZE": str(WORLD),
                        "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    },
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                for r in range(WORLD)
            ]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        peers_done: float | None = None
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            # A stopped or hung culprit never ends by itself: once every peer wrote its
            # result, it gets a few seconds, then is killed (with torchrun's agent).
            if peers_done is None and all(
                (Path(out) / f"rank{r}.json").exists() for r in range(WORLD) if r != CULPRIT
            ):
                peers_done = time.monotonic()
            if peers_done is not None and time.monotonic() - peers_done > 3.0:
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        del store
        values: list[Any] = []
        for r in range(WORLD):
            f = Path(out) / f"rank{r}.json"
            values.append(json.loads(f.read_text()) if f.exists() else {"exit": "no result"})
        return values


def _free_port() -> int:
    """A port for rank 0's store (env://): rank 0 binds it itself, as under srun."""
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(s.port)
    del s
    return port


def _run(worker: str, args: list[Any], launcher: str) -> list[Any]:
    if launcher == "spawn":
        return _spawn(worker, args)
    return _processes(worker, args, launcher, dict(os.environ))


def _hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def busy_trial(case: str, launcher: str, cfg: dict[str, Any], tmp: str) -> dict[str, Any]:
    worker, args = BUSY[case]
    hogs = _hogs(os.cpu_count() or 2) if case == "loaded" else []
    t0 = time.monotonic()
    try:
        values = _run(worker, _args(worker, args, tmp, cfg), launcher)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    ok = all(isinstance(v, dict) and v.get("ok") for v in values)
    errors = [
        f"rank {r}: {v.get('type', v.get('exit'))} {str(v.get('message', ''))[:160]}"
        for r, v in enumerate(values)
        if not (isinstance(v, dict) and v.get("ok"))
    ]
    return {"ok": ok, "seconds": round(time.monotonic() - t0, 2), "errors": errors}


def hang_trial(case: str, launcher: str, cfg: dict[str, Any], tmp: str) -> dict[str, Any]:
    values = _run("late", [CULPRIT, case, 0.0, tmp, cfg], launcher)
    peers = [v for r, v in enumerate(values) if r != CULPRIT]
    named = all(isinstance(v, dict) and v.get("ranks") == [CULPRIT] for v in peers)
    waited = [float(v["waited"]) for v in peers if isinstance(v, dict) and "waited" in v]
    first = str(peers[0].get("message", "")).splitlines() if isinstance(peers[0], dict) else []
    return {
        "named": named,
        "detect_s": round(max(waited), 2) if waited and named else None,
        "message": " / ".join(first[:2])[:300],
    }


def run_matrix(
    runs: int, launchers: list[str], cfg: dict[str, Any], hang_runs: int, label: str
) -> dict[str, Any]:
    busy: dict[str, dict[str, Any]] = {}
    hangs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in BUSY:
            for launcher in launchers:
                trials = []
                for i in range(runs):
                    t = busy_trial(case, launcher, cfg, tmp)
                    trials.append(t)
                    print(f"[{label}] busy {case} {launcher} #{i}: {t}", flush=True)
                busy.setdefault(case, {})[launcher] = {
                    "runs": len(trials),
                    "false_alarms": sum(not t["ok"] for t in trials),
                    "errors": sorted({e for t in trials for e in t["errors"]})[:3],
                }
        for case in HANGS:
            for launcher in launchers:
                trials = []
                for i in range(hang_runs):
                    t = hang_trial(case, launcher, cfg, tmp)
                    trials.append(t)
                    print(f"[{label}] hang {case} {launcher} #{i}: {t}", flush=True)
                times = [t["detect_s"] for t in trials if t["detect_s"] is not None]
                hangs.setdefault(case, {})[launcher] = {
                    "runs": len(trials),
                    "named": sum(t["named"] for t in trials),
                    "median_s": round(statistics.median(times), 2) if times else None,
                    "max_s": max(times) if times else None,
                    "message": trials[0]["message"] if trials else "",
                }
    return {"label": label, "config": cfg, "busy": busy, "hangs": hangs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each, rd.spawn only")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--runs", type=int, default=3, help="runs of each busy case")
    parser.add_argument("--hang-runs", type=int, default=2, help="runs of each hang case")
    parser.add_argument("--launchers", default="spawn,torchrun,env")
    parser.add_argument("--before", type=Path, help="an older checkout's src folder")
    parser.add_argument("--label", default="after", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--trial-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    runs, hang_runs = (1, 1) if args.quick else (args.runs, args.hang_runs)
    launchers = ["spawn"] if args.quick else args.launchers.split(",")
    cfg = json.loads(args.config)
    t0 = time.perf_counter()
    trial = run_matrix(runs, launchers, cfg, hang_runs, args.label)
    if args.trial_only:
        print("TRIAL " + json.dumps(trial), flush=True)
        return 0
    trials = [trial]
    if args.before is not None:
        for label, before_cfg in (("before", {}), ("before, op_timeout=5 s", {"op_timeout": 5})):
            env = {**os.environ, "PYTHONPATH": str(args.before.resolve())}
            cmd = [sys.executable, __file__, "--trial-only", "--label", label]
            cmd += ["--config", json.dumps(before_cfg), "--runs", str(runs)]
            # The old code's hangs take op_timeout (60 s) each: one run, under rd.spawn.
            cmd += ["--hang-runs", "1", "--launchers", "spawn"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            sys.stdout.write(proc.stdout)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("TRIAL ")), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            trials.append(json.loads(line[len("TRIAL ") :]))
    elapsed = time.perf_counter() - t0
    command = "python benchmarks/bench_busy.py" + (" --quick" if args.quick else "")
    if not args.quick:
        command += f" --runs {runs} --hang-runs {hang_runs} --launchers {','.join(launchers)}"
    if args.before is not None:
        command += " --before <checkout of ec73c0c>/src"
    after = trials[0]
    alarms = sum(c["false_alarms"] for per in after["busy"].values() for c in per.values())
    cases = sum(c["runs"] for per in after["busy"].values() for c in per.values())
    worst = [
        c["max_s"]
        for per in after["hangs"].values()
        for c in per.values()
        if c["max_s"] is not None
    ]
    unnamed = sum(c["runs"] - c["named"] for per in after["hangs"].values() for c in per.values())
    targets = [
        {
            "target": "no false alarm over the busy matrix (default settings)",
            "met": alarms == 0,
            "measured": f"{alarms} of {cases} runs",
        },
        {
            "target": "a hang named within 5 s with default settings (slowest peer)",
            "met": bool(worst) and max(worst) < 5.0 and unnamed == 0,
            "measured": f"worst {max(worst):.2f} s, {unnamed} run(s) without the culprit named"
            if worst
            else "no hang named",
        },
    ]
    result = {
        **result_header(NAME, TITLE, command, quick=args.quick, seconds=elapsed),
        "setup": {"world_size": WORLD, "busy_s": BUSY_S, "culprit": CULPRIT},
        "trials": trials,
        "targets": targets,
    }
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    write_result(out, result)
    print(f"total {elapsed:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
