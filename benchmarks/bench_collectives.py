"""Overhead of ``rd.all_reduce`` over ``torch.distributed.all_reduce`` (2 ranks, gloo, CPU).

For each message size (float32, 4 B to 64 MiB) one process group times three variants of
the same all-reduce, interleaved in rounds so that machine noise hits them equally:

* ``raw``: ``torch.distributed.all_reduce(t)``
* ``rd``: ``resilient_ddp.all_reduce(t, timeout=..., validate=False)``
* ``rd+validate``: ``resilient_ddp.all_reduce(t, timeout=..., validate=True)``

Every round runs one block of each variant, in an order that rotates from round to round.
Every op is timed on its own; the table gives the median per op as measured on rank 0
(rank 1's medians are in the JSON). The ratio and added-time columns compare each round's
block with the raw block of the same round and take the median over rounds, so that slow
changes in the machine's load (other processes) cancel out. Both ranks run exactly the
same sequence of collectives: the plan is computed once in the parent and nothing in it
depends on the rank.

Usage::

    python benchmarks/bench_collectives.py            # full run, ~1-2 min on 2 cores
    python benchmarks/bench_collectives.py --quick    # smoke test, a few seconds

The full run writes ``benchmarks/results/collectives.json``. ``--quick`` writes to
``benchmarks/results/quick/`` by default so that it never replaces the recorded figures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import resilient_ddp as rd

NAME = "collectives"
TITLE = "Collective overhead: rd.all_reduce vs torch.distributed.all_reduce"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

WORLD_SIZE = 2
OP_TIMEOUT_S = 120.0  # generous: a 64 MiB all-reduce on a busy 2-core machine is slow
KIB, MIB = 1024, 1024 * 1024
VARIANTS = ("raw", "rd", "rd_validate")
LABELS = {"raw": "raw", "rd": "rd", "rd_validate": "rd+validate"}
LARGE_BYTES = MIB  # "large" ops: the 5 % target; everything below is "small"
SMALL_ADDED_US = 100.0
LARGE_RATIO = 1.05
VALIDATE_RATIO_4B = 2.0

# (bytes, rounds, ops per block): each variant runs rounds * block timed ops per size.
FULL_PLAN: list[tuple[int, int, int]] = [
    (4, 50, 20),
    (64, 50, 20),
    (1 * KIB, 50, 20),
    (16 * KIB, 50, 20),
    (256 * KIB, 40, 10),
    (1 * MIB, 40, 10),
    (4 * MIB, 40, 4),
    (16 * MIB, 60, 1),
    (64 * MIB, 30, 1),
]
QUICK_PLAN: list[tuple[int, int, int]] = [
    (4, 6, 5),
    (64, 3, 3),
    (1 * KIB, 3, 3),
    (16 * KIB, 3, 3),
    (256 * KIB, 3, 2),
    (1 * MIB, 3, 1),
    (4 * MIB, 3, 1),
    (16 * MIB, 3, 1),
    (64 * MIB, 3, 1),
]


def size_label(nbytes: int) -> str:
    for unit, div in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


# -- inside each rank ---------------------------------------------------------------------------
def _variants(t: torch.Tensor) -> dict[str, Callable[[], Any]]:
    return {
        "raw": lambda: dist.all_reduce(t),
        "rd": lambda: rd.all_reduce(t, timeout=OP_TIMEOUT_S, validate=False),
        "rd_validate": lambda: rd.all_reduce(t, timeout=OP_TIMEOUT_S, validate=True),
    }


def _timed(fn: Callable[[], Any], n: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)


def _check_results() -> None:
    """Each variant must actually reduce: a benchmark of a no-op would look great."""
    for v in VARIANTS:
        t = torch.ones(3)
        _variants(t)[v]()
        if t.tolist() != [float(WORLD_SIZE)] * 3:
            raise RuntimeError(f"{v} all_reduce returned {t.tolist()}, expected {WORLD_SIZE}s")


def _worker(rank: int, plan: list[tuple[int, int, int]], warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # 2 ranks on 2 cores: no intra-op threads competing with gloo
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=OP_TIMEOUT_S))
    try:
        _check_results()
        rows = []
        for nbytes, rounds, block in plan:
            t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)  # zeros: no overflow
            fns = _variants(t)
            samples: dict[str, list[int]] = {v: [] for v in VARIANTS}
            for v in VARIANTS:
                _timed(fns[v], warmup if nbytes < LARGE_BYTES else 1, [])
            gc.collect()
            t_start = time.perf_counter()
            for r in range(rounds):
                k = r % len(VARIANTS)
                for v in VARIANTS[k:] + VARIANTS[:k]:
                    _timed(fns[v], block, samples[v])
            rows.append(
                {
                    "bytes": nbytes,
                    "seconds": time.perf_counter() - t_start,
                    "samples_ns": samples,
                }
            )
        return {"rank": rank, "rows": rows}
    finally:
        rd.destroy_process_group()


# -- in the parent ------------------------------------------------------------------------------
def _quantile(values: list[int], q: float) -> float:
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i] / 1e3


def summarize(per_rank: list[dict[str, Any]], plan: list[tuple[int, int, int]]) -> list[dict]:
    rows = []
    for i, (nbytes, rounds, block) in enumerate(plan):
        r0 = per_rank[0]["rows"][i]
        med = {v: statistics.median(r0["samples_ns"][v]) / 1e3 for v in VARIANTS}
        # Per round, the median of each variant's block; the rounds of one variant are
        # compared with the raw block of the same round, so that slow drifts in the
        # machine's load (other processes) cancel out.
        per_round = {
            v: [
                statistics.median(r0["samples_ns"][v][k * block : (k + 1) * block]) / 1e3
                for k in range(rounds)
            ]
            for v in VARIANTS
        }
        others = [v for v in VARIANTS if v != "raw"]
        raw_rounds = per_round["raw"]
        rows.append(
            {
                "bytes": nbytes,
                "size": size_label(nbytes),
                "ops_per_variant": rounds * block,
                "rounds": rounds,
                "block": block,
                "median_us": med,
                "p10_us": {v: _quantile(r0["samples_ns"][v], 0.1) for v in VARIANTS},
                "p90_us": {v: _quantile(r0["samples_ns"][v], 0.9) for v in VARIANTS},
                "ratio": {
                    v: statistics.median(
                        [a / b for a, b in zip(per_round[v], raw_rounds, strict=True)]
                    )
                    for v in others
                },
                "added_us": {
                    v: statistics.median(
                        [a - b for a, b in zip(per_round[v], raw_rounds, strict=True)]
                    )
                    for v in others
                },
                "ratio_of_medians": {v: med[v] / med["raw"] for v in others},
                "median_us_by_rank": [
                    {v: statistics.median(pr["rows"][i]["samples_ns"][v]) / 1e3 for v in VARIANTS}
                    for pr in per_rank
                ],
                "seconds": r0["seconds"],
            }
        )
    return rows


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    large = [r for r in rows if r["bytes"] >= LARGE_BYTES]
    small = [r for r in rows if r["bytes"] < LARGE_BYTES]
    four = [r for r in rows if r["bytes"] == 4]

    def worst(rs: list[dict[str, Any]], key: str, v: str) -> dict[str, Any]:
        return max(rs, key=lambda r: r[key][v])

    out = []
    if large:
        w = worst(large, "ratio", "rd")
        wv = worst(large, "ratio", "rd_validate")
        out.append(
            {
                "target": f"At {size_label(LARGE_BYTES)} and above, rd within 5% of raw",
                "met": w["ratio"]["rd"] <= LARGE_RATIO,
                "measured": (
                    f"worst rd/raw {w['ratio']['rd']:.3f} at {w['size']} "
                    f"(with validation: {wv['ratio']['rd_validate']:.3f} at {wv['size']})"
                ),
            }
        )
    if small:
        w = worst(small, "added_us", "rd")
        out.append(
            {
                "target": (
                    f"Small ops (below {size_label(LARGE_BYTES)}) add under "
                    f"{SMALL_ADDED_US:.0f} µs with validation off"
                ),
                "met": all(r["added_us"]["rd"] < SMALL_ADDED_US for r in small),
                "measured": f"worst +{w['added_us']['rd']:.0f} µs at {w['size']}",
            }
        )
    if four:
        ratio = four[0]["ratio"]["rd_validate"]
        out.append(
            {
                "target": f"Validation on: at most {VALIDATE_RATIO_4B:g}x raw on a 4 B all-reduce",
                "met": ratio <= VALIDATE_RATIO_4B,
                "measured": f"rd+validate/raw {ratio:.2f}x at 4 B",
            }
        )
    return out


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "resilient_ddp": rd.__version__,
        "git": commit,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "size",
        "raw us",
        "rd us",
        "rd+val us",
        "rd/raw",
        "rd+val/raw",
        "rd-raw us",
        "rd+val-raw us",
        "ops",
    ]
    body = [
        [
            r["size"],
            f"{r['median_us']['raw']:.1f}",
            f"{r['median_us']['rd']:.1f}",
            f"{r['median_us']['rd_validate']:.1f}",
            f"{r['ratio']['rd']:.3f}",
            f"{r['ratio']['rd_validate']:.3f}",
            f"{r['added_us']['rd']:+.1f}",
            f"{r['added_us']['rd_validate']:+.1f}",
            str(r["ops_per_variant"]),
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in body]
    head = "  ".join(x.rjust(w) for x, w in zip(header, widths, strict=True))
    return "\n".join([head, "-" * len(head), *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    warmup = 3 if args.quick else 20

    print(
        f"{TITLE}\n{WORLD_SIZE} ranks, gloo, float32, median per op on rank 0"
        + (" (quick run: noisy figures)" if args.quick else ""),
        flush=True,
    )
    load_before = _loadavg()
    t0 = time.perf_counter()
    per_rank = rd.spawn(_worker, WORLD_SIZE, args=(plan, warmup), timeout=_dt.timedelta(minutes=15))
    elapsed = time.perf_counter() - t0
    load_after = _loadavg()
    rows = summarize(per_rank, plan)
    targets = evaluate_targets(rows)

    print(format_table(rows))
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    print(f"total {elapsed:.1f} s")

    cmd = ["python", "benchmarks/bench_collectives.py"]
    if args.quick:
        cmd.append("--quick")
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": load_after}
    result = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=elapsed, machine=machine
        ),
        "setup": {
            "world_size": WORLD_SIZE,
            "backend": "gloo",
            "device": "cpu",
            "dtype": "float32",
            "torch_threads_per_rank": 1,
            "statistic": (
                "times: median per op on rank 0; ratio and added time: median over rounds "
                "of the per-round comparison with the raw block of the same round"
            ),
            "op_timeout_s": OP_TIMEOUT_S,
            "warmup_ops": warmup,
        },
        "variants": {
            "raw": "torch.distributed.all_reduce(t)",
            "rd": "resilient_ddp.all_reduce(t, timeout=..., validate=False)",
            "rd_validate": "resilient_ddp.all_reduce(t, timeout=..., validate=True)",
        },
        "rows": rows,
        "targets": targets,
    }
    write_result(out, result)
    print(f"wrote {_display(out)}")
    return 0


def result_header(
    name: str,
    title: str,
    command: str,
    *,
    quick: bool,
    seconds: float,
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields every benchmark's JSON result starts with (run_all renders them)."""
    return {
        "benchmark": name,
        "title": title,
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "seconds": round(seconds, 1),
        "machine": machine_info() if machine is None else machine,
    }


def write_result(out: Path, result: dict[str, Any]) -> None:
    """Write a benchmark's JSON result to ``out`` (its folder made if need be)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
