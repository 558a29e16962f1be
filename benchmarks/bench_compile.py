"""``torch.compile``: step time and graph breaks of ResilientDDP against DDP (2 ranks, gloo, CPU).

One process group trains two copies of the same small MLP (a module class of this file,
so that dynamo compiles it: it skips torch's own modules when they are not called from
compiled code), one wrapped in ``DistributedDataParallel`` and one in ``ResilientDDP``,
each passed to ``torch.compile``. For each, dynamo's graph breaks and graphs are counted
while it compiles (``torch._dynamo.utils.counters``, the first steps), then the compiled
steps (forward, backward, optimizer step) are timed in interleaved rounds, so that machine
noise hits both equally; the ratio is the median over rounds of the per-round ratio of
median step times. The same is measured without ``torch.compile`` for reference.

Usage::

    python benchmarks/bench_compile.py            # about a minute on 2 loaded cores
    python benchmarks/bench_compile.py --quick    # smoke test
    python benchmarks/bench_compile.py --backend aot_eager   # no C++ compiler needed

Prints one JSON line with the figures and writes ``benchmarks/results/compile.json``
(``--quick``: ``benchmarks/results/quick/compile.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from bench_collectives import result_header, write_result  # one header for every bench
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import resilient_ddp as rd

NAME = "compile"
TITLE = "torch.compile: ResilientDDP vs DistributedDataParallel"
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
WORLD_SIZE = 2
WIDTH, LAYERS = 256, 4


class MLP(nn.Module):
    """``LAYERS`` linear layers with ReLU between them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return rd.ResilientDDP(MLP()) if kind == "rd" else DistributedDataParallel(MLP())


def _compile(kind: str, backend: str, x: torch.Tensor, warmup: int) -> dict[str, Any]:
    """Compile a model of ``kind``; count dynamo's graph breaks and graphs over its first
    ``warmup`` steps (where it compiles)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(_build(kind), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    for _ in range(warmup):
        _step(model, opt, x)
    return {
        "model": model,
        "opt": opt,
        "breaks": sum(counters["graph_break"].values()),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "warmup_s": time.perf_counter() - t0,
    }


def _time(models: dict[str, Any], x: torch.Tensor, plan: dict[str, Any]) -> dict[str, float]:
    rounds: list[dict[str, float]] = []
    for r in range(plan["rounds"]):
        order = ["ddp", "rd"] if r % 2 == 0 else ["rd", "ddp"]
        rounds.append(
            {
                k: statistics.median(
                    _step(models[k]["model"], models[k]["opt"], x) for _ in range(plan["steps"])
                )
                for k in order
            }
        )
    return {
        "ddp_ms": 1000 * statistics.median(r["ddp"] for r in rounds),
        "rd_ms": 1000 * statistics.median(r["rd"] for r in rounds),
        "ratio": statistics.median(r["rd"] / r["ddp"] for r in rounds),
    }


def _worker(rank: int, plan: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", module="torch._dynamo")
    torch.set_num_threads(1)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=600))
    x = torch.randn(plan["batch"], WIDTH, generator=torch.Generator().manual_seed(rank))
    # Compiled: DDP's model is compiled (and counted) first, then ResilientDDP's; dynamo's
    # caches are reset between the two.
    compiled = {k: _compile(k, plan["backend"], x, plan["warmup"]) for k in ("ddp", "rd")}
    counts = {
        k: {"breaks": v["breaks"], "graphs": v["graphs"], "warmup_s": round(v["warmup_s"], 1)}
        for k, v in compiled.items()
    }
    timed = _time(compiled, x, plan)
    # Not compiled, for reference.
    eager = {}
    for k in ("ddp", "rd"):
        model = _build(k)
        eager[k] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-4)}
        for _ in range(plan["warmup"]):
            _step(model, eager[k]["opt"], x)
    reference = _time(eager, x, plan)
    rd.destroy_process_group()
    return {"compiled": timed, "counts": counts, "eager": reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    plan = {
        "backend": args.backend,
        "batch": 64,
        "warmup": 3 if args.quick else 10,
        "rounds": 3 if args.quick else 21,
        "steps": 5 if args.quick else 20,
    }
    print(f"{TITLE}\n{WORLD_SIZE} ranks, gloo, CPU, backend {args.backend}", flush=True)
    t0 = time.perf_counter()
    per_rank = rd.spawn(_worker, WORLD_SIZE, args=(plan,), timeout=_dt.timedelta(minutes=10))
    elapsed = time.perf_counter() - t0
    r0 = per_rank[0]
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    summary = {
        "benchmark": NAME,
        "backend": args.backend,
        "params": params,
        "compiled_ddp_ms": round(r0["compiled"]["ddp_ms"], 3),
        "compiled_rd_ms": round(r0["compiled"]["rd_ms"], 3),
        "compiled_ratio": round(r0["compiled"]["ratio"], 3),
        "compiled_ratio_rank1": round(per_rank[1]["compiled"]["ratio"], 3),
        "eager_ratio": round(r0["eager"]["ratio"], 3),
        "graph_breaks": {k: v["breaks"] for k, v in r0["counts"].items()},
        "graphs": {k: v["graphs"] for k, v in r0["counts"].items()},
        "seconds": round(elapsed, 1),
    }
    print(json.dumps(summary), flush=True)
    command = "python benchmarks/bench_compile.py" + (" --quick" if args.quick else "")
    if args.backend != "inductor":
        command += f" --backend {args.backend}"
    targets = [
        {
            "target": "graph breaks of a compiled ResilientDDP at most DDP's",
            "met": summary["graph_breaks"]["rd"] <= summary["graph_breaks"]["ddp"],
            "measured": f"{summary['graph_breaks']['rd']} vs {summary['graph_breaks']['ddp']}",
        }
    ]
    result = {
        **result_header(NAME, TITLE, command, quick=args.quick, seconds=elapsed),
        "setup": {**plan, "world_size": WORLD_SIZE, "width": WIDTH, "layers": LAYERS},
        "summary": summary,
        "per_rank": per_rank,
        "targets": targets,
    }
    write_result(out, result)
    print(f"total {elapsed:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
