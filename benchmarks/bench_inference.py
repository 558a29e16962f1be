"""Distributed inference that finishes: balance, a killed rank, rank 0's memory, Ray Data.

Four parts, each on real ranks (gloo, ``rd.spawn``), all in one run:

* **balance**: 4 ranks, 2000 items whose costs the library is not told, drawn heavy-tailed
  as generation lengths are (log-normal, sigma 1; Pareto, alpha 1.5, capped at 64 times
  its minimum as ``max_new_tokens`` caps a generation). Rank 0's wall time of the call over
  the ideal (total work / ranks) for: the static plan without costs (today's path before
  issue 28, ``on_rank_failure="raise"``: a strided split then one gather), the static plan
  with the exact costs, pulled chunks without costs (the default), pulled chunks of one
  batch without costs, and pulled chunks with the exact costs, in 3 rounds (the median
  kept). The wall time is also given over the time ``fn`` really took on all ranks divided
  by the ranks (a sleep overshoots), and a pure simulation of each schedule (no processes,
  zero overhead) beside it.
* **kill**: the same log-normal work, pulled chunks, rank 3 SIGKILLs itself in its first
  batch past half of the items: wall time over a fault-free run of the same work just
  before, against the goal ``fault-free + (1 - f) * fault-free / (W - 1) + one chunk``
  (the lost rank's share of the work left, spread over the survivors, plus one chunk
  redone), computed from the same run.
* **memory**: 3 ranks, 800 results of 256 KiB (200 MiB in all): the growth of rank 0's
  peak resident memory (``VmHWM`` reset at the call's start: tensors and everything else)
  over the call, for the
  old static path (one final gather), the pulled list (``rd.distributed_inference``) and
  the stream (``rd.iter_inference``, each result dropped once read; and with half the
  results, to show that its peak does not follow the data); with the growth of the
  launching process that hosts the store (the results pass through it). Each variant runs
  in a fresh process tree (``ru_maxrss`` is a high-water mark).
* **ray**: the log-normal work under Ray Data (``ray.data.range(n).map_batches(fn,
  batch_size=4)``, Ray's default blocks, ``ray.init(num_cpus=4)``: 4 tasks at a time)
  beside ours, fault-free and with a worker SIGKILLed in its first batch past half of the
  items: wall time, results complete, duplicates. Ray is a benchmark-only dependency:
  ``nox -s bench_ray`` installs it; without it this part records why it did not run.

The work of an item is ``time.sleep(cost)`` (like a wait on a GPU): this machine has 2
cores, and 4 ranks that computed would fight for them, which would measure the machine, not
the schedule. ``fn`` calls ``rd.progress()`` after each item (a rank that sleeps uses no
CPU, and its peers would otherwise see no progress).

Usage::

    python benchmarks/bench_inference.py            # about 4 minutes on 2 cores
    python benchmarks/bench_inference.py --quick    # smoke test
    python -m nox -s bench_ray                      # the same, with Ray Data installed
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from bench_collectives import result_header, write_result  # one header for every bench

import resilient_ddp as rd
from resilient_ddp.testing import peak_rss_mib

NAME = "inference"
TITLE = "Distributed inference: balance, a killed rank, rank 0's memory, Ray Data"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

WORLD = 4
BATCH = 4
SEED = 0
PARETO_ALPHA = 1.5
PARETO_CAP = 64.0  # times the minimum (max_new_tokens)
MEM_WORLD = 3
MEM_ROW = 65536  # float32 values per result: 256 KiB
MEM_BATCH = 8
# 16 results of 256 KiB: 4 MiB a delivery, one store value (kept so the numbers compare
# with earlier runs). The default chunk here (40 items, 10 MiB) travels in 4 MiB parts;
# before that fix the libuv TCPStore refused it ("Invalid payload size ... max: 8388608")
# and every rank raised ControlPlaneError (found by this benchmark).
MEM_CHUNK = 16
# A short failure detection for the fault runs (the defaults: heartbeat_timeout 15 s).
FAULT_CONFIG = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "op_timeout": 10.0}
VARIANTS = {
    "static_nocost": "static plan, no costs (before)",
    "static_cost": "static plan, exact costs (before)",
    "pulled_nocost": "pulled chunks, no costs (default chunk)",
    "pulled_small": "pulled chunks of one batch, no costs",
    "pulled_cost": "pulled chunks, exact costs",
}


# -- the workload ------------------------------------------------------------------------------
def make_costs(dist_name: str, n: int, total_s: float, seed: int = SEED) -> list[float]:
    """``n`` heavy-tailed item costs in seconds that add up to ``total_s``."""
    g = torch.Generator().manual_seed(seed)
    if dist_name == "lognormal":
        raw = torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    elif dist_name == "pareto":
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
        raw = (u ** (-1.0 / PARETO_ALPHA)).clamp_max(PARETO_CAP)
    else:
        raise ValueError(dist_name)
    return (raw * (total_s / float(raw.sum()))).tolist()


class Items(torch.utils.data.Dataset[int]):
    """Item ``i`` is its index; the work is in ``fn``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def sleeper(costs: Sequence[float], die_at: int = -1, spent: list[float] | None = None) -> Any:
    """``fn``: sleeps each item's cost, returns one float per item (its index); with
    ``die_at``, SIGKILLs this process in its first batch that holds an item ``>= die_at``;
    adds the time it took to ``spent[0]`` (a sleep overshoots by a fraction of a ms)."""

    def fn(batch: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        idx = batch.tolist()
        if die_at >= 0 and max(idx) >= die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        for i in idx:
            time.sleep(costs[i])
            rd.progress()
        if spent is not None:
            spent[0] += time.perf_counter() - t0
        return batch.to(torch.float64)

    return fn


# -- pure simulations of the schedules ---------------------------------------------------------
def sim_static(costs: Sequence[float], shares: Sequence[Sequence[int]]) -> float:
    return max(sum(costs[i] for i in s) for s in shares)


def sim_pulled(chunk_costs: Sequence[float], world: int) -> float:
    free = [0.0] * world
    for c in chunk_costs:
        k = min(range(world), key=free.__getitem__)
        free[k] += c
    return max(free)


def simulate(costs: list[float], world: int, batch: int) -> dict[str, float]:
    from resilient_ddp.inference import _work_pool as wp

    n = len(costs)
    shares_nc = [
        list(rd.BalancedDistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False))
        for r in range(world)
    ]
    shares_c = [
        list(
            rd.BalancedDistributedSampler(
                range(n), num_replicas=world, rank=r, shuffle=False, costs=costs
            )
        )
        for r in range(world)
    ]

    def pulled(chunk: int | None, with_costs: bool) -> float:
        plan = wp.plan(n, chunk, world, batch, costs if with_costs else None)
        return sim_pulled([sum(costs[i] for i in c.items) for c in plan], world)

    return {
        "static_nocost": sim_static(costs, shares_nc),
        "static_cost": sim_static(costs, shares_c),
        "pulled_nocost": pulled(None, False),  # the default plan: tapered
        "pulled_small": pulled(batch, False),
        "pulled_cost": pulled(None, True),
    }


# -- (a) balance -------------------------------------------------------------------------------
def _call(variant: str, costs: list[float], fn: Any, ds: Items, cfg: dict[str, Any]) -> Any:
    if variant.startswith("static"):
        return rd.distributed_inference(
            fn,
            ds,
            batch_size=BATCH,
            costs=costs if variant == "static_cost" else None,
            progress=False,
            on_rank_failure="raise",
            timeout=60,
        )
    return rd.distributed_inference(
        fn,
        ds,
        batch_size=BATCH,
        costs=costs if variant == "pulled_cost" else None,
        chunk_size=BATCH if variant == "pulled_small" else None,
        progress=False,
        **cfg,
    )


def _balance_worker(
    rank: int, costs: list[float], variants: list[str], repeats: int
) -> dict[str, Any]:
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=60))
    try:
        ds = Items(len(costs))
        spent = [0.0]
        fn = sleeper(costs, spent=spent)
        out: dict[str, Any] = {v: {"wall_s": [], "compute_s": [], "exact": True} for v in variants}
        for _ in range(repeats):  # rounds of every variant: a change of load hits them all
            for v in variants:
                rd.barrier()
                spent[0] = 0.0
                t0 = time.perf_counter()
                res = _call(v, costs, fn, ds, {})
                out[v]["wall_s"].append(time.perf_counter() - t0)
                out[v]["compute_s"].append(spent[0])
                if rank == 0:
                    ok = res is not None and [int(x) for x in res] == list(range(len(costs)))
                    out[v]["exact"] = out[v]["exact"] and ok
        return out
    finally:
        rd.destroy_process_group()


def run_balance(n: int, ideal_s: float, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for dist_name in ("lognormal", "pareto"):
        costs = make_costs(dist_name, n, ideal_s * WORLD)
        ideal = sum(costs) / WORLD
        sim = simulate(costs, WORLD, BATCH)
        per_rank = rd.spawn(
            _balance_worker,
            WORLD,
            args=(costs, list(VARIANTS), repeats),
            timeout=_dt.timedelta(minutes=5),
        )
        for v, label in VARIANTS.items():
            # The median round by rank 0's wall time; the time fn took in that round.
            walls = per_rank[0][v]["wall_s"]
            k = sorted(range(repeats), key=walls.__getitem__)[repeats // 2]
            wall = walls[k]
            spent = sum(r[v]["compute_s"][k] for r in per_rank) / WORLD
            rows.append(
                {
                    "distribution": dist_name,
                    "variant": v,
                    "label": label,
                    "items": n,
                    "ideal_s": round(ideal, 3),
                    "largest_item_s": round(max(costs), 4),
                    "wall_s": round(wall, 3),
                    "walls_s": [round(w, 3) for w in walls],
                    "ratio": round(wall / ideal, 3),
                    "sim_ratio": round(sim[v] / ideal, 3),
                    "spent_ideal_s": round(spent, 3),
                    "spent_ratio": round(wall / spent, 3),
                    "exact": per_rank[0][v]["exact"],
                }
            )
            print(
                f"{dist_name:>9} {label:>42}: {wall:6.2f} s, "
                f"{wall / ideal:5.3f} x ideal (simulated {sim[v] / ideal:5.3f}; "
                f"{wall / spent:5.3f} x the time fn took / ranks), "
                f"results exact: {per_rank[0][v]['exact']}",
                flush=True,
            )
    return rows


# -- (b) a rank killed at 50 % -----------------------------------------------------------------
def _kill_worker(rank: int, costs: list[float], victim: int, die_at: int) -> dict[str, Any]:
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAULT_CONFIG))
    try:
        fn = sleeper(costs, die_at if rank == victim else -1)
        rd.barrier()
        t0 = time.perf_counter()
        res = rd.distributed_inference(fn, Items(len(costs)), batch_size=BATCH, progress=False)
        wall = time.perf_counter() - t0
        if rank != 0:
            return {"wall_s": wall}
        s = rd.last_inference_summary()
        assert s is not None
        got = [int(x) for x in res] if res is not None else []
        return {
            "wall_s": wall,
            "exact": got == list(range(len(costs))),
            "chunks": s.chunks,
            "chunks_redone": s.chunks_redone,
            "redone": [dict(r) for r in s.redone],
            "failed_ranks": {str(k): v for k, v in s.failed_ranks.items()},
            "per_rank_items": {str(k): v for k, v in s.per_rank_items.items()},
            "summary": str(s),
        }
    finally:
        rd.destroy_process_group()


def _spawn_outcomes(fn: Any, world: int, args: tuple[Any, ...]) -> list[Any]:
    try:
        return rd.spawn(fn, world, args=args, timeout=_dt.timedelta(minutes=3))
    except rd.SpawnError as e:  # the killed rank
        return [o.value for o in e.outcomes]


def run_kill(n: int, ideal_s: float) -> dict[str, Any]:
    from resilient_ddp.inference import _work_pool as wp

    costs = make_costs("lognormal", n, ideal_s * WORLD, seed=SEED + 1)
    victim = WORLD - 1
    die_at = n // 2
    clean = _spawn_outcomes(_kill_worker, WORLD, (costs, -1, -1))[0]
    faulty = _spawn_outcomes(_kill_worker, WORLD, (costs, victim, die_at))[0]
    size = wp.default_chunk_size(n, WORLD, BATCH)
    chunk_costs = [sum(costs[i] for i in c.items) for c in wp.plan_chunks(n, size)]
    f = sum(costs[:die_at]) / sum(costs)
    w0 = clean["wall_s"]
    goal = w0 + (1 - f) * w0 / (WORLD - 1) + sum(chunk_costs) / len(chunk_costs)
    row = {
        "items": n,
        "ranks": WORLD,
        "victim": victim,
        "killed_at_fraction": round(f, 3),
        "chunk_items": size,
        "mean_chunk_s": round(sum(chunk_costs) / len(chunk_costs), 3),
        "largest_chunk_s": round(max(chunk_costs), 3),
        "ideal_s": round(sum(costs) / WORLD, 3),
        "fault_free_s": round(w0, 3),
        "killed_s": round(faulty["wall_s"], 3),
        "ratio": round(faulty["wall_s"] / w0, 3),
        "goal_s": round(goal, 3),
        "goal_ratio": round(goal / w0, 3),
        "fault_free_exact": clean["exact"],
        "killed_exact": faulty["exact"],
        "chunks_redone": faulty["chunks_redone"],
        "redone": faulty["redone"],
        "failed_ranks": faulty["failed_ranks"],
        "per_rank_items": faulty["per_rank_items"],
        "summary": faulty["summary"],
    }
    print(
        f"kill rank {victim} at {f:.0%}: {faulty['wall_s']:.2f} s vs {w0:.2f} s fault-free "
        f"({row['ratio']:.3f} x; goal {goal:.2f} s = {row['goal_ratio']:.3f} x); "
        f"results exact: {faulty['exact']}; redone: {faulty['redone']}",
        flush=True,
    )
    print(faulty["summary"], flush=True)
    return row


# -- (c) rank 0's memory -----------------------------------------------------------------------
class Rows(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _rows_fn(batch: torch.Tensor) -> torch.Tensor:
    return batch.to(torch.float32)[:, None].expand(-1, MEM_ROW).clone()


def _mem_worker(rank: int, variant: str, n: int) -> dict[str, Any]:
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=120))
    try:
        ds = Rows(n)
        rd.barrier()
        before = peak_rss_mib(reset=True)
        t0 = time.perf_counter()
        seen = 0
        checksum = 0.0
        if variant.startswith("stream"):
            stream = rd.iter_inference(
                _rows_fn, ds, batch_size=MEM_BATCH, chunk_size=MEM_CHUNK, progress=False
            )
            for i, r in stream:
                seen += 1
                checksum += float(r[0]) - i
        else:
            res = rd.distributed_inference(
                _rows_fn,
                ds,
                batch_size=MEM_BATCH,
                progress=False,
                on_rank_failure="raise" if variant == "gather" else "redo",
                **({} if variant == "gather" else {"chunk_size": MEM_CHUNK}),
            )
            if res is not None:
                seen = len(res)
                checksum = sum(float(r[0]) - i for i, r in enumerate(res))
            del res
        wall = time.perf_counter() - t0
        return {
            "growth_mib": peak_rss_mib() - before,
            "wall_s": wall,
            "seen": seen,
            "exact": checksum == 0.0,
        }
    finally:
        rd.destroy_process_group()


def _mem_child(variant: str, n: int) -> None:
    """One variant in this fresh process (``--mem-child``): prints its row as JSON."""
    before = peak_rss_mib(reset=True)
    per_rank = rd.spawn(_mem_worker, MEM_WORLD, args=(variant, n), timeout=_dt.timedelta(minutes=3))
    r0 = per_rank[0]
    row = {
        "variant": variant,
        "rank0_growth_mib": round(r0["growth_mib"], 1),
        "others_growth_mib": [round(r["growth_mib"], 1) for r in per_rank[1:]],
        "store_host_growth_mib": round(peak_rss_mib() - before, 1),
        "wall_s": round(r0["wall_s"], 2),
        "results": r0["seen"],
        "exact": r0["exact"],
    }
    print("ROW " + json.dumps(row), flush=True)


MEM_LABELS = {
    "gather": "static plan + final gather (before)",
    "list": "rd.distributed_inference (pulled, list)",
    "stream": "rd.iter_inference (stream, dropped)",
    "stream_half": "rd.iter_inference, half the results",
}


def run_memory(n_full: int) -> list[dict[str, Any]]:
    rows = []
    for variant, label in MEM_LABELS.items():
        n = n_full // 2 if variant == "stream_half" else n_full
        script = str(Path(__file__).resolve())
        proc = subprocess.run(
            [sys.executable, script, "--mem-child", variant, "--mem-items", str(n)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
        if line is None:
            raise RuntimeError(f"{variant} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        row = {**json.loads(line[4:]), "label": label, "total_mib": n * MEM_ROW * 4 / 2**20}
        rows.append(row)
        print(
            f"{label:>42}: rank 0 peak +{row['rank0_growth_mib']:.0f} MiB, store host "
            f"+{row['store_host_growth_mib']:.0f} MiB, {row['wall_s']:.1f} s, "
            f"{row['results']} results exact: {row['exact']}",
            flush=True,
        )
    return rows


# -- (d) Ray Data ------------------------------------------------------------------------------
def _ray_run(costs: list[float], marker: str | None) -> dict[str, Any]:
    import numpy as np
    import ray

    die_at = len(costs) // 2

    def fn(batch: dict[str, Any]) -> dict[str, Any]:
        ids = [int(i) for i in batch["id"]]
        if marker is not None and max(ids) >= die_at:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        for i in ids:
            time.sleep(costs[i])
        return {"id": np.asarray(ids, dtype=np.int64)}

    t0 = time.perf_counter()
    ds = ray.data.range(len(costs)).map_batches(fn, batch_size=BATCH, num_cpus=1)
    rows = ds.take_all()
    wall = time.perf_counter() - t0
    ids = sorted(int(r["id"]) for r in rows)
    return {
        "wall_s": wall,
        "results": len(ids),
        "unique": len(set(ids)),
        "duplicates": len(ids) - len(set(ids)),
        "complete": set(ids) == set(range(len(costs))),
        "killed": marker is not None and os.path.exists(marker),
    }


def _ours_kill_and_clean(costs: list[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    clean = _spawn_outcomes(_kill_worker, WORLD, (costs, -1, -1))[0]
    faulty = _spawn_outcomes(_kill_worker, WORLD, (costs, WORLD - 1, len(costs) // 2))[0]
    return clean, faulty


def run_ray(n: int, ideal_s: float) -> dict[str, Any]:
    costs = make_costs("lognormal", n, ideal_s * WORLD, seed=SEED + 2)
    out: dict[str, Any] = {"items": n, "ideal_s": round(sum(costs) / WORLD, 3)}
    try:
        import ray
        import ray.data
    except ImportError as e:
        out["skipped"] = (
            f"ray is not installed ({e}); run `python -m nox -s bench_ray` for this part"
        )
        print(out["skipped"], flush=True)
        return out
    out["ray_version"] = ray.__version__
    t0 = time.perf_counter()
    ray.init(num_cpus=WORLD, include_dashboard=False, log_to_driver=False)
    out["ray_init_s"] = round(time.perf_counter() - t0, 2)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        with tempfile.TemporaryDirectory() as tmp:
            _ray_run(costs[:64], None)  # warm-up: worker processes started
            clean = _ray_run(costs, None)
            faulty = _ray_run(costs, os.path.join(tmp, "killed"))
    finally:
        ray.shutdown()
    ours_clean, ours_faulty = _ours_kill_and_clean(costs)
    ours = "rd.distributed_inference"

    def row(system: str, fault: str, run: dict[str, Any], **extra: Any) -> dict[str, Any]:
        complete = run["complete"] if "complete" in run else run["exact"]
        duplicates = run.get("duplicates", 0 if complete else None)
        return {
            "system": system,
            "fault": fault,
            "wall_s": round(run["wall_s"], 3),
            "items_per_s": round(n / run["wall_s"], 1),
            "complete": complete,
            "duplicates": duplicates,
            **extra,
        }

    out["rows"] = [
        row("Ray Data", "none", clean),
        row("Ray Data", "worker SIGKILL at 50 %", faulty, fired=faulty["killed"]),
        row(ours, "none", ours_clean),
        row(ours, "rank SIGKILL at 50 %", ours_faulty, redone=ours_faulty["redone"]),
    ]
    for r in out["rows"]:
        print(
            f"{r['system']:>25} {r['fault']:>24}: {r['wall_s']:6.2f} s, "
            f"{r['items_per_s']:7.1f} items/s, complete {r['complete']}, "
            f"duplicates {r['duplicates']}",
            flush=True,
        )
    return out


def _carry_ray(out: Path, skipped: dict[str, Any]) -> dict[str, Any]:
    """Without Ray here (``nox -s benchmarks``), keep the Ray part of the last run that had
    it (``nox -s bench_ray``), marked with its date and command, rather than losing it."""
    try:
        last = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return skipped
    ray = last.get("ray", {})
    if not ray.get("rows"):
        return skipped
    origin = ray.get("carried_from") or {"date": last.get("date"), "command": last.get("command")}
    print(f"ray part kept from the run of {origin['date']} ({origin['command']})", flush=True)
    return {**ray, "carried_from": origin}


# -- targets and main --------------------------------------------------------------------------
def evaluate_targets(
    balance: list[dict[str, Any]], kill: dict[str, Any], memory: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    targets = []
    for d in ("lognormal", "pareto"):
        row = next(r for r in balance if r["distribution"] == d and r["variant"] == "pulled_nocost")
        targets.append(
            {
                "target": f"pulled chunks without costs, {d}: makespan <= 1.05 x ideal (the "
                "time fn took on all ranks / ranks)",
                "measured": f"{row['spent_ratio']:.3f} x ({row['ratio']:.3f} x the nominal "
                f"costs / ranks; simulated {row['sim_ratio']:.3f} x)",
                "met": row["spent_ratio"] <= 1.05,
            }
        )
    targets.append(
        {
            "target": "rank killed at 50 %: wall <= fault-free + lost share / survivors + one "
            "chunk",
            "measured": f"{kill['killed_s']:.2f} s against {kill['goal_s']:.2f} s "
            f"({kill['ratio']:.3f} x vs {kill['goal_ratio']:.3f} x fault-free)",
            "met": kill["killed_s"] <= kill["goal_s"] and kill["killed_exact"],
        }
    )
    stream = next(r for r in memory if r["variant"] == "stream")
    half = next(r for r in memory if r["variant"] == "stream_half")
    gather = next(r for r in memory if r["variant"] == "gather")
    added = stream["total_mib"] - half["total_mib"]
    more = stream["rank0_growth_mib"] - half["rank0_growth_mib"]
    targets.append(
        {
            "target": "rank 0 streaming: peak memory does not follow the data (twice the "
            "results add < 25 % of the results added)",
            "measured": f"+{half['rank0_growth_mib']:.0f} MiB for {half['total_mib']:.0f} MiB, "
            f"+{stream['rank0_growth_mib']:.0f} MiB for {stream['total_mib']:.0f} MiB "
            f"(final gather: +{gather['rank0_growth_mib']:.0f} MiB)",
            "met": more < 0.25 * added,
        }
    )
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument("--mem-child", help=argparse.SUPPRESS)
    parser.add_argument("--mem-items", type=int, default=800, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mem_child:
        _mem_child(args.mem_child, args.mem_items)
        return 0
    n, ideal_s, mem_items, repeats = (400, 0.6, 160, 1) if args.quick else (2000, 3.0, 800, 3)
    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    print(f"{TITLE}\n{WORLD} ranks, gloo, {n} items, ideal {ideal_s} s", flush=True)
    t0 = time.perf_counter()
    balance = run_balance(n, ideal_s, repeats)
    kill = run_kill(n, ideal_s)
    memory = run_memory(mem_items)
    ray_part = run_ray(n, ideal_s)
    if "skipped" in ray_part:
        ray_part = _carry_ray(out, ray_part)
    targets = evaluate_targets(balance, kill, memory)
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    in_nox = "bench_ray" in sys.prefix
    cmd = (
        (["python -m nox -s bench_ray"] + (["-- --quick"] if args.quick else []))
        if in_nox
        else (["python", "benchmarks/bench_inference.py"] + (["--quick"] if args.quick else []))
    )
    result = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=time.perf_counter() - t0
        ),
        "setup": {
            "world_size": WORLD,
            "backend": "gloo",
            "launcher": "rd.spawn",
            "batch_size": BATCH,
            "work": "time.sleep(cost) per item, rd.progress() after each (2 cores, 4 ranks)",
            "pareto": {"alpha": PARETO_ALPHA, "cap_times_min": PARETO_CAP},
            "lognormal": {"sigma": 1.0},
            "fault_config": FAULT_CONFIG,
            "memory": {
                "world_size": MEM_WORLD,
                "result_bytes": MEM_ROW * 4,
                "batch_size": MEM_BATCH,
                "chunk_size": MEM_CHUNK,
                "statistic": (
                    "growth of the peak RSS (VmHWM, reset at the start) over the call "
                    "(whole process)"
                ),
            },
            "statistic": "wall time of the call on rank 0, from a barrier; balance: the "
            f"median of {repeats} rounds of every variant, the others: one run each",
        },
        "balance": balance,
        "kill": kill,
        "memory": memory,
        "ray": ray_part,
        "targets": targets,
    }
    write_result(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
