"""Step time of ``ResilientDDP`` over plain ``DistributedDataParallel`` (2 ranks, gloo, CPU).

One process group trains three copies of the same MLP with the same data: plain DDP (its
C++ all-reduce), DDP with torch's own Python ``allreduce_hook`` (the path every Python comm
hook takes; a reference), and ResilientDDP. They run interleaved in rounds (the order
alternates) so that machine noise hits all equally. Each round times a block of steps
(forward, backward, optimizer step) for each; the ratio is the median over rounds of the
per-round ratio of median step times. Target (issue 3): at most 1.03 for a model of 10 M
parameters or more.

Usage::

    python benchmarks/bench_ddp_step.py            # 1 M, 10 M and 50 M parameters
    python benchmarks/bench_ddp_step.py --quick    # smoke test (1 M only, few steps)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_collectives import result_header, write_result  # one header for every bench
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import resilient_ddp as rd

NAME = "ddp_step"
TITLE = "Training step: ResilientDDP vs DistributedDataParallel"
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
WORLD_SIZE = 2
TARGET = 1.03
# (label, width, layers): parameters = layers * (width^2 + width)
MODELS = [("1M", 512, 4), ("10M", 1024, 10), ("50M", 2048, 12)]


def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _measure(rank: int, width: int, layers: int, plan: dict[str, Any]) -> dict[str, Any]:
    models = {
        "ddp": DistributedDataParallel(_mlp(width, layers)),
        "pyhook": DistributedDataParallel(_mlp(width, layers)),
        "rd": rd.ResilientDDP(_mlp(width, layers)),
    }
    # Reference: DDP with torch's own Python comm hook, the path any Python hook takes.
    models["pyhook"].register_comm_hook(None, default_hooks.allreduce_hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(plan["batch"], width, generator=torch.Generator().manual_seed(rank))
    for kind, model in models.items():  # warm-up: buckets are rebuilt after the first step
        for _ in range(plan["warmup"]):
            _step(model, opts[kind], x)
    rounds: list[dict[str, float]] = []
    for r in range(plan["rounds"]):
        order = ["ddp", "pyhook", "rd"] if r % 2 == 0 else ["rd", "pyhook", "ddp"]
        rounds.append(
            {
                k: statistics.median(_step(models[k], opts[k], x) for _ in range(plan["steps"]))
                for k in order
            }
        )
    return {
        "params": sum(p.numel() for p in models["ddp"].parameters()),
        "ddp_ms": 1000 * statistics.median(r["ddp"] for r in rounds),
        "rd_ms": 1000 * statistics.median(r["rd"] for r in rounds),
        "pyhook_ms": 1000 * statistics.median(r["pyhook"] for r in rounds),
        "ratio": statistics.median(r["rd"] / r["ddp"] for r in rounds),
        "ratio_pyhook": statistics.median(r["pyhook"] / r["ddp"] for r in rounds),
        "ratio_vs_pyhook": statistics.median(r["rd"] / r["pyhook"] for r in rounds),
        "rounds": plan["rounds"],
        "steps_per_round": plan["steps"],
    }


def _worker(rank: int, plan: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=600))
    out = {label: _measure(rank, w, n, plan) for label, w, n in plan["models"]}
    rd.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    plan = {
        "models": MODELS[:1] if args.quick else MODELS,
        "batch": 32,
        "warmup": 2 if args.quick else 5,
        "rounds": 2 if args.quick else 7,
        "steps": 3 if args.quick else 5,
    }
    print(f"{TITLE}\n{WORLD_SIZE} ranks, gloo, CPU, batch {plan['batch']}", flush=True)
    t0 = time.perf_counter()
    per_rank = rd.spawn(_worker, WORLD_SIZE, args=(plan,), timeout=_dt.timedelta(minutes=20))
    elapsed = time.perf_counter() - t0
    rows = []
    for label, _, _ in plan["models"]:
        r0 = per_rank[0][label]
        rows.append({"model": label, **r0, "ratio_rank1": per_rank[1][label]["ratio"]})
        print(
            f"  {label:>4} ({r0['params'] / 1e6:5.1f} M params): DDP {r0['ddp_ms']:8.1f} ms  "
            f"DDP+python hook {r0['pyhook_ms']:8.1f} ms  ResilientDDP {r0['rd_ms']:8.1f} ms  "
            f"ratio {r0['ratio']:.3f} (python hook {r0['ratio_pyhook']:.3f})",
            flush=True,
        )
    big = [r for r in rows if r["params"] >= 10_000_000]
    targets = []
    if big:
        worst = max(big, key=lambda r: r["ratio"])
        targets.append(
            {
                "target": f"ResilientDDP / DDP step time at most {TARGET} for >= 10 M parameters",
                "met": worst["ratio"] <= TARGET,
                "measured": f"worst {worst['ratio']:.3f} ({worst['model']})",
            }
        )
    command = "python benchmarks/bench_ddp_step.py" + (" --quick" if args.quick else "")
    result = {
        **result_header(NAME, TITLE, command, quick=args.quick, seconds=elapsed),
        "setup": {**plan, "world_size": WORLD_SIZE, "torch_threads_per_rank": 1},
        "rows": rows,
        "targets": targets,
    }
    write_result(out, result)
    print(f"total {elapsed:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
