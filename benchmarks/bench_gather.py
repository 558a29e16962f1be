"""Gathering results to rank 0: time and peak memory per rank, ours vs torch's ways.

Every rank holds ``MIB`` MiB of results as 4 KiB rows (one float32 row of 1024 values per
item, each its own tensor) and rank 0 needs all of them. Variants:

* ``rd.gather_to_rank0``: ``rd.gather_to_rank0(rows, indices=...)``: rank 0 only, dataset
  order, streamed in 4 MiB pieces;
* ``gather_object``: ``torch.distributed.gather_object(rows, ..., dst=0)``: rank 0 only,
  rank order;
* ``all_gather_object``: ``torch.distributed.all_gather_object``: everything on every rank;
* ``all_gather``: ``torch.distributed.all_gather`` of one stacked tensor per rank: the
  fastest torch path, but it needs equal shapes on every rank (gloo aborts the process
  otherwise) and returns everything on every rank.

Each variant runs in fresh processes (3 ranks, gloo): the peak resident memory growth
(``VmHWM``, reset at the start) of each rank is measured over the first call, then the call is timed
3 more times (not for the slow ``*_object`` variants, whose first call is their time) and
the median kept (rank 0's wall time, from a barrier).

Usage::

    python benchmarks/bench_gather.py            # full run, about 1.5 minutes on 2 cores
    python benchmarks/bench_gather.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_collectives import result_header, write_result  # one header for every bench

import resilient_ddp as rd
from resilient_ddp.testing import peak_rss_mib

NAME = "gather"
TITLE = "Gather to rank 0: rd.gather_to_rank0 vs torch's gather_object / all_gather(_object)"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

WORLD_SIZE = 3
ROW = 1024  # float32 values per item: 4 KiB
VARIANTS = ("rd", "gather_object", "all_gather_object", "all_gather")
# The object variants take 10-35 s per call at 128 MiB (pickling dominates, so the first
# call is like the others): one call each keeps ``nox -s benchmarks`` within 10 minutes.
SLOW_VARIANTS = frozenset({"gather_object", "all_gather_object"})
LABELS = {
    "rd": "rd.gather_to_rank0",
    "gather_object": "dist.gather_object",
    "all_gather_object": "dist.all_gather_object",
    "all_gather": "dist.all_gather (equal shapes)",
}


def _call(variant: str, rank: int, rows: list[torch.Tensor], indices: list[int]) -> Any:
    if variant == "rd":
        return rd.gather_to_rank0(rows, indices=indices)
    world = dist.get_world_size()
    if variant == "gather_object":
        out: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(rows, out, dst=0)
        return out
    if variant == "all_gather_object":
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, rows)
        return everyone
    stacked = torch.stack(rows)
    parts = [torch.empty_like(stacked) for _ in range(world)]
    dist.all_gather(parts, stacked)
    return parts


def _worker(rank: int, variant: str, mib: int, repeats: int) -> dict[str, Any]:
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=120))
    try:
        n = mib * 256  # 4 KiB rows
        g = torch.Generator().manual_seed(rank)
        # Row by row: no transient copy of the whole data that would raise the peak
        # before the measurement starts.
        rows = [torch.randn(ROW, generator=g) for _ in range(n)]
        indices = list(range(rank, n * WORLD_SIZE, WORLD_SIZE))
        rd.barrier()
        before = peak_rss_mib(reset=True)
        t0 = time.perf_counter()
        result = _call(variant, rank, rows, indices)
        first_s = time.perf_counter() - t0
        growth = peak_rss_mib() - before
        if rank == 0 and variant == "rd":
            assert result is not None
            assert len(result) == n * WORLD_SIZE
        del result
        times = [first_s]
        for _ in range(repeats):
            rd.barrier()
            t0 = time.perf_counter()
            _call(variant, rank, rows, indices)
            times.append(time.perf_counter() - t0)
        return {"growth_mib": growth, "median_s": statistics.median(times), "times_s": times}
    finally:
        rd.destroy_process_group()


def run(mib: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for variant in VARIANTS:
        n = 0 if variant in SLOW_VARIANTS else repeats
        per_rank = rd.spawn(
            _worker, WORLD_SIZE, args=(variant, mib, n), timeout=_dt.timedelta(minutes=5)
        )
        rows.append(
            {
                "variant": variant,
                "label": LABELS[variant],
                "data_per_rank_mib": mib,
                "rank0_median_s": per_rank[0]["median_s"],
                "calls": len(per_rank[0]["times_s"]),
                "peak_growth_mib": [round(r["growth_mib"], 1) for r in per_rank],
            }
        )
        print(
            f"{LABELS[variant]:>32}: {per_rank[0]['median_s'] * 1000:8.1f} ms on rank 0; "
            f"peak growth per rank (MiB): {rows[-1]['peak_growth_mib']}",
            flush=True,
        )
    return rows


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = next(r for r in rows if r["variant"] == "rd")
    mib = ours["data_per_rank_mib"]
    worst_sender = max(ours["peak_growth_mib"][1:])
    return [
        {
            "target": "a non-zero rank's peak memory stays near its own data (growth < 25%)",
            "measured": f"{worst_sender:.0f} MiB growth while sending {mib} MiB",
            "met": worst_sender < 0.25 * mib,
        }
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    args = parser.parse_args(argv)
    mib, repeats = (16, 1) if args.quick else (128, 3)
    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    print(f"{TITLE}\n{WORLD_SIZE} ranks, gloo, {mib} MiB of 4 KiB rows per rank", flush=True)
    t0 = time.perf_counter()
    rows = run(mib, repeats)
    targets = evaluate_targets(rows)
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    cmd = ["python", "benchmarks/bench_gather.py"] + (["--quick"] if args.quick else [])
    result = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=time.perf_counter() - t0
        ),
        "setup": {
            "world_size": WORLD_SIZE,
            "backend": "gloo",
            "data_per_rank_mib": mib,
            "row_bytes": ROW * 4,
            "statistic": (
                "time: median over the calls on rank 0 (4 calls, first included; the "
                "*_object variants: their one call); memory: growth of the peak RSS (VmHWM) "
                "over the first call"
            ),
        },
        "variants": {v: LABELS[v] for v in VARIANTS},
        "rows": rows,
        "targets": targets,
    }
    write_result(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
