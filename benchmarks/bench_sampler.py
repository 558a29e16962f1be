"""Cost balance and plan time of the samplers, against ``torch.utils.data.DistributedSampler``.

Balance: 10,000 items with lognormal (sigma = 1) costs, seeded, split across 2, 4, 8 and 64
ranks. Every ratio is over the lower bound ``LB = max(sum / W, max cost)`` that no split can
beat.

* plain: the largest per-rank total cost, ``BalancedDistributedSampler`` against torch's
  ``DistributedSampler`` (which pads by repeating items: the repeats are counted and their
  cost is included, since a rank does process them);
* lockstep: the sum over steps of the slowest rank's batch cost, ``LockstepBatchSampler``
  against torch's sampler cut into batches of the same size (at the default batch size,
  and at 1, 8 and 32 for 64 ranks);
* both again at 64 ranks for other seeds of the same distribution: the figures depend on
  the draw, mostly on how large the largest item is next to a rank's share.

Plan time: the median over a few repeats of what one rank pays per epoch: constructing the
sampler from a float64 cost tensor (validation included), ``set_epoch`` and ``list(sampler)``
(the whole plan and this rank's share), with ``shuffle=True``, for 1e5, 1e6 and 1e7 items at 8
and 64 ranks. ``list(DistributedSampler(...))`` is timed alongside for reference.

Usage::

    python benchmarks/bench_sampler.py            # full run, about a minute on 2 cores
    python benchmarks/bench_sampler.py --quick    # smoke test: no 1e7 row, one repeat

The full run writes ``benchmarks/results/sampler.json`` and the figure
``docs/img/sampler_balance.png`` (with matplotlib: ``pip install -e .[bench]``). ``--quick``
writes to ``benchmarks/results/quick/`` by default so that it never replaces the recorded
figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_collectives import _display, _loadavg, machine_info, result_header
from plots import BALANCE_PNG, plot_balance
from torch.utils.data import DistributedSampler

from resilient_ddp.inference.sampler import BalancedDistributedSampler, LockstepBatchSampler

NAME = "sampler"
TITLE = "Cost-balanced samplers vs torch's DistributedSampler"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
DOCS_IMG = ROOT / "docs" / "img"
QUICK_IMG = HERE / "results" / "quick" / "img"

N_BALANCE = 10_000
SIGMA = 1.0
SEED = 0
WORLDS = (2, 4, 8, 64)
BATCH_SIZE = 8  # representative: 1.05 at 64 ranks; batch sizes 1 and 32 are in the sweep
SWEEP_WORLD = 64
SWEEP_BATCH_SIZES = (1, 8, 32)
PLAIN_TARGET = 1.01
LOCKSTEP_TARGET = 1.10
BUILD_TARGET_S = 5.0
BUILD_TARGET_N = 10_000_000
BUILD_WORLDS = (8, 64)
FULL_SIZES = {100_000: 5, 1_000_000: 5, 10_000_000: 3}  # items: repeats
FULL_SEEDS = tuple(range(8))  # other draws of the same distribution, at SWEEP_WORLD ranks
QUICK_SEEDS = (1,)
QUICK_SIZES = {100_000: 1, 1_000_000: 1}


def lognormal(n: int, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n, dtype=torch.float64).log_normal_(0.0, SIGMA, generator=g)


def lower_bound(costs: torch.Tensor, w: int) -> float:
    return max(float(costs.sum()) / w, float(costs.max()))


def torch_shares(n: int, w: int) -> list[torch.Tensor]:
    return [torch.tensor(list(DistributedSampler(range(n), w, r, shuffle=False))) for r in range(w)]


# -- balance ------------------------------------------------------------------------------------
def plain_row(costs: torch.Tensor, w: int) -> dict[str, Any]:
    n = costs.numel()
    ours = BalancedDistributedSampler(range(n), w, 0, costs=costs)
    counts = [t.numel() for t in ours.plan()]
    shares = torch_shares(n, w)
    theirs = max(float(costs[s].sum()) for s in shares) / lower_bound(costs, w)
    return {
        "world_size": w,
        "ours": ours.balance,
        "torch": theirs,
        "torch_duplicates": sum(s.numel() for s in shares) - n,
        "ours_count_min": min(counts),
        "ours_count_max": max(counts),
    }


def lockstep_row(costs: torch.Tensor, w: int, batch_size: int) -> dict[str, Any]:
    n = costs.numel()
    ours = LockstepBatchSampler(range(n), batch_size, w, 0, costs=costs)
    plan = ours.plan()
    shares = torch_shares(n, w)
    torch_steps = math.ceil(shares[0].numel() / batch_size)
    slowest = sum(
        max(float(costs[s[k * batch_size : (k + 1) * batch_size]].sum()) for s in shares)
        for k in range(torch_steps)
    )
    return {
        "world_size": w,
        "batch_size": batch_size,
        "ours": ours.balance,
        "torch": slowest / lower_bound(costs, w),
        "ours_steps": len(ours),
        "torch_steps": torch_steps,
        "ours_empty_batches": sum(1 for r in plan for b in r if not b),
        "torch_duplicates": sum(s.numel() for s in shares) - n,
    }


def seed_row(seed: int) -> dict[str, Any]:
    costs = lognormal(N_BALANCE, seed)
    w = SWEEP_WORLD
    plain, lock = plain_row(costs, w), lockstep_row(costs, w, BATCH_SIZE)
    return {
        "seed": seed,
        "max_cost_share": float(costs.max()) / (float(costs.sum()) / w),
        "plain_ours": plain["ours"],
        "plain_torch": plain["torch"],
        "lockstep_ours": lock["ours"],
        "lockstep_torch": lock["torch"],
    }


# -- plan time ----------------------------------------------------------------------------------
def _median_s(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def build_rows(sizes: dict[int, int]) -> list[dict[str, Any]]:
    rows = []
    for n, repeats in sizes.items():
        costs = lognormal(n, seed=1)
        for w in BUILD_WORLDS:

            def plain(n: int = n, w: int = w, costs: torch.Tensor = costs) -> None:
                s = BalancedDistributedSampler(range(n), w, 0, costs=costs, shuffle=True)
                s.set_epoch(1)
                list(s)

            def lockstep(n: int = n, w: int = w, costs: torch.Tensor = costs) -> None:
                s = LockstepBatchSampler(range(n), BATCH_SIZE, w, 0, costs=costs, shuffle=True)
                s.set_epoch(1)
                list(s)

            def reference(n: int = n, w: int = w) -> None:
                s = DistributedSampler(range(n), w, 0, shuffle=True)
                s.set_epoch(1)
                list(s)

            row: dict[str, Any] = {"items": n, "world_size": w, "repeats": repeats}
            for name, fn in (("plain", plain), ("lockstep", lockstep), ("torch", reference)):
                row[f"{name}_s"], row[f"{name}_samples_s"] = _median_s(fn, repeats)
            print(
                f"  n={n:>10,}  W={w:>2}  plain {row['plain_s']:.3f} s  lockstep "
                f"{row['lockstep_s']:.3f} s  torch {row['torch_s']:.3f} s",
                flush=True,
            )
            rows.append(row)
    return rows


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    plain = result["plain"]
    worst = max(plain, key=lambda r: r["ours"])
    out = [
        {
            "target": (
                f"Plain: max rank cost / LB <= {PLAIN_TARGET} at W = "
                + ", ".join(str(w) for w in WORLDS)
            ),
            "met": all(r["ours"] <= PLAIN_TARGET for r in plain),
            "measured": (
                f"worst {worst['ours']:.4f} at W = {worst['world_size']} "
                f"(torch's DistributedSampler: {worst['torch']:.3f})"
            ),
        }
    ]
    at = next(r for r in result["lockstep"] if r["world_size"] == SWEEP_WORLD)
    out.append(
        {
            "target": (
                f"Lockstep: sum of slowest batch / LB <= {LOCKSTEP_TARGET} at W = "
                f"{SWEEP_WORLD}, batch size {BATCH_SIZE}"
            ),
            "met": at["ours"] <= LOCKSTEP_TARGET,
            "measured": f"{at['ours']:.4f} (torch's sampler in batches: {at['torch']:.3f})",
        }
    )
    big = [r for r in result["build"] if r["items"] == BUILD_TARGET_N]
    if big:
        slowest = max(
            ((r, k) for r in big for k in ("plain_s", "lockstep_s")), key=lambda rk: rk[0][rk[1]]
        )
        r, k = slowest
        out.append(
            {
                "target": (
                    f"Plan for {BUILD_TARGET_N:,} items in <= {BUILD_TARGET_S:g} s "
                    "(plain and lockstep, W = 8 and 64)"
                ),
                "met": all(
                    x["plain_s"] <= BUILD_TARGET_S and x["lockstep_s"] <= BUILD_TARGET_S
                    for x in big
                ),
                "measured": (
                    f"slowest median {r[k]:.2f} s ({k.removesuffix('_s')}, W = {r['world_size']})"
                ),
            }
        )
    return out


def format_tables(result: dict[str, Any]) -> str:
    def table(header: list[str], body: list[list[str]]) -> str:
        widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
        lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in body]
        head = "  ".join(x.rjust(w) for x, w in zip(header, widths, strict=True))
        return "\n".join([head, "-" * len(head), *lines])

    plain = table(
        ["W", "ours max/LB", "torch max/LB", "torch dups", "our counts"],
        [
            [
                str(r["world_size"]),
                f"{r['ours']:.4f}",
                f"{r['torch']:.4f}",
                str(r["torch_duplicates"]),
                f"{r['ours_count_min']}-{r['ours_count_max']}",
            ]
            for r in result["plain"]
        ],
    )
    lock = table(
        ["W", "batch", "ours", "torch", "steps ours/torch", "our empty batches", "torch dups"],
        [
            [
                str(r["world_size"]),
                str(r["batch_size"]),
                f"{r['ours']:.4f}",
                f"{r['torch']:.4f}",
                f"{r['ours_steps']}/{r['torch_steps']}",
                str(r["ours_empty_batches"]),
                str(r["torch_duplicates"]),
            ]
            for r in result["lockstep"] + result["lockstep_sweep"]
        ],
    )
    build = table(
        ["items", "W", "plain s", "lockstep s", "torch s"],
        [
            [
                f"{r['items']:,}",
                str(r["world_size"]),
                f"{r['plain_s']:.3f}",
                f"{r['lockstep_s']:.3f}",
                f"{r['torch_s']:.3f}",
            ]
            for r in result["build"]
        ],
    )
    seeds = table(
        ["seed", "max cost / (sum/W)", "plain ours", "plain torch", "lockstep ours", "torch"],
        [
            [
                str(r["seed"]),
                f"{r['max_cost_share']:.3f}",
                f"{r['plain_ours']:.4f}",
                f"{r['plain_torch']:.3f}",
                f"{r['lockstep_ours']:.4f}",
                f"{r['lockstep_torch']:.3f}",
            ]
            for r in result["seeds"]
        ],
    )
    return (
        f"plain\n{plain}\n\nlockstep (sum of slowest batch / LB)\n{lock}\n\n"
        f"other draws, W = {SWEEP_WORLD}, batch size {BATCH_SIZE}\n{seeds}\n\nplan time\n{build}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    args = parser.parse_args(argv)
    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    seeds = QUICK_SEEDS if args.quick else FULL_SEEDS

    print(TITLE + (" (quick run)" if args.quick else ""), flush=True)
    load_before = _loadavg()
    t0 = time.perf_counter()
    costs = lognormal(N_BALANCE)
    result: dict[str, Any] = {
        "plain": [plain_row(costs, w) for w in WORLDS],
        "lockstep": [lockstep_row(costs, w, BATCH_SIZE) for w in WORLDS],
        "lockstep_sweep": [
            lockstep_row(costs, SWEEP_WORLD, b) for b in SWEEP_BATCH_SIZES if b != BATCH_SIZE
        ],
        "seeds": [seed_row(seed) for seed in seeds],
    }
    print("plan time (median):", flush=True)
    result["build"] = build_rows(sizes)
    elapsed = time.perf_counter() - t0
    load_after = _loadavg()
    targets = evaluate_targets(result)

    print(format_tables(result))
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    print(f"total {elapsed:.1f} s")

    cmd = ["python", "benchmarks/bench_sampler.py"]
    if args.quick:
        cmd.append("--quick")
    machine = {
        **machine_info(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
    }
    data = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=elapsed, machine=machine
        ),
        "setup": {
            "items": N_BALANCE,
            "costs": f"lognormal(mu=0, sigma={SIGMA}), float64, torch.Generator seed {SEED}",
            "lower_bound": "LB = max(sum(costs) / W, max(costs))",
            "batch_size": BATCH_SIZE,
            "torch_sampler": "torch.utils.data.DistributedSampler(shuffle=False, drop_last=False)",
            "plan_time": (
                "median wall time of: construct from a float64 cost tensor, set_epoch(1), "
                "list(sampler) on rank 0; shuffle=True; build costs lognormal seed 1"
            ),
        },
        **result,
        "targets": targets,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {_display(out)}")
    png = plot_balance(data, (QUICK_IMG if args.quick else DOCS_IMG) / BALANCE_PNG)
    if png is not None:
        print(f"wrote {_display(png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
