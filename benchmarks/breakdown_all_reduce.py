"""Where ``rd.all_reduce``'s overhead goes: an investigation aid, not part of ``run_all.py``.

Two ranks, gloo, one message size. Part 1 times, interleaved in rotating rounds like
``bench_collectives.py``, ways of waiting for the same all-reduce:

* ``raw``: ``dist.all_reduce(t)`` (blocking, the baseline)
* ``raw_x2``: a 2-element int64 MAX all-reduce, then ``dist.all_reduce(t)``: the floor for
  any validation that is one more blocking collective
* ``cpp_wait``: ``dist.all_reduce(t, async_op=True).wait(timedelta)``: a timed wait in C++
* ``py_callback``: a Python done-callback on the work's future sets a ``threading.Event``
  that the main thread waits on (the mechanism ``rd.all_reduce`` uses)
* ``rd`` and ``rd_validate``: the library

Part 2 replays ``rd.all_reduce``'s healthy path (validate=False) step by step with
timestamps, including when the done-callback runs on gloo's thread.

Usage::

    python benchmarks/breakdown_all_reduce.py [--bytes 4] [--rounds 50]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import resilient_ddp as rd
from resilient_ddp.ops.collectives import _Op, _sig
from resilient_ddp.runtime._runtime import PendingOp

BLOCK = 10
WAIT = timedelta(seconds=60)


def _variants(t: torch.Tensor) -> dict[str, Any]:
    def raw() -> None:
        dist.all_reduce(t)

    def raw_x2() -> None:
        dist.all_reduce(torch.tensor([1, -1], dtype=torch.int64), dist.ReduceOp.MAX)
        dist.all_reduce(t)

    def cpp_wait() -> None:
        dist.all_reduce(t, async_op=True).wait(WAIT)

    def py_callback() -> None:
        ev = threading.Event()
        fut = dist.all_reduce(t, async_op=True).get_future()
        fut.add_done_callback(lambda _: ev.set())
        ev.wait(60.0)

    return {
        "raw": raw,
        "raw_x2": raw_x2,
        "cpp_wait": cpp_wait,
        "py_callback": py_callback,
        "rd": lambda: rd.all_reduce(t, timeout=60.0, validate=False),
        "rd_validate": lambda: rd.all_reduce(t, timeout=60.0, validate=True),
    }


def _compare(t: torch.Tensor, rounds: int) -> dict[str, float]:
    fns = _variants(t)
    names = list(fns)
    samples: dict[str, list[int]] = {k: [] for k in names}
    for k in names:
        for _ in range(20):
            fns[k]()
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(BLOCK):
                t0 = time.perf_counter_ns()
                fns[k]()
                samples[k].append(time.perf_counter_ns() - t0)
    return {k: statistics.median(v) / 1e3 for k, v in samples.items()}


STEPS = [
    "_Op() (ensure_runtime, budgets, begin_op)",
    "_sig() (built even with validate=False)",
    "issue dist.all_reduce(async_op=True)",
    "PendingOp() + register",
    "attach (add_done_callback)",
    "event.wait",
    "unregister + end_op",
    "  of which: attach -> callback starts (gloo thread)",
    "  of which: callback body",
    "  of which: callback done -> main thread awake",
    "total",
]


def _timeline(t: torch.Tensor, n: int) -> dict[str, float]:
    ns = time.perf_counter_ns
    cb: dict[str, int] = {}
    original = PendingOp._on_backend_done

    def traced_cb(self: PendingOp, fut: Any) -> None:
        cb["enter"] = ns()
        original(self, fut)
        cb["exit"] = ns()

    PendingOp._on_backend_done = traced_cb  # type: ignore[method-assign]
    rows = []
    try:
        for i in range(n + 50):
            ts = [ns()]
            o = _Op("all_reduce", None, 60.0, None, None, False)
            ts.append(ns())
            _sig("all_reduce", t, reduce=str(dist.ReduceOp.SUM))
            ts.append(ns())
            try:
                work = dist.all_reduce(t, async_op=True)
                ts.append(ns())
                p = PendingOp(o.name, o.seq)
                o.rt.register(p)
                ts.append(ns())
                p.attach(work)
                ts.append(ns())
                p.event.wait(60.0)
                ts.append(ns())
                o.rt.unregister(p)
            finally:
                o.rt.end_op()
            ts.append(ns())
            if i >= 50:  # warm-up
                d = [(b - a) / 1e3 for a, b in itertools.pairwise(ts)]
                d += [
                    (cb["enter"] - ts[5]) / 1e3,
                    (cb["exit"] - cb["enter"]) / 1e3,
                    (ts[6] - cb["exit"]) / 1e3,
                    (ts[-1] - ts[0]) / 1e3,
                ]
                rows.append(d)
    finally:
        PendingOp._on_backend_done = original  # type: ignore[method-assign]
    return {
        k: statistics.median(col) for k, col in zip(STEPS, zip(*rows, strict=True), strict=True)
    }


def _worker(rank: int, nbytes: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=120))
    try:
        t = torch.zeros(max(1, nbytes // 4))
        return {"compare": _compare(t, rounds), "timeline": _timeline(t, rounds * BLOCK)}
    finally:
        rd.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4, help="message size (float32)")
    parser.add_argument("--rounds", type=int, default=50, help=f"rounds of {BLOCK} ops")
    args = parser.parse_args()
    res = rd.spawn(_worker, 2, args=(args.bytes, args.rounds))
    print(f"{args.bytes} B, median us per op, rank 0 (rank 1)")
    base = res[0]["compare"]["raw"]
    for k, v in res[0]["compare"].items():
        print(f"  {k:12s} {v:8.1f} ({res[1]['compare'][k]:8.1f})  {v / base:5.2f}x raw")
    print("rd.all_reduce replayed step by step, median us, rank 0 (rank 1)")
    for k, v in res[0]["timeline"].items():
        print(f"  {k:52s} {v:7.1f} ({res[1]['timeline'][k]:7.1f})")


if __name__ == "__main__":
    main()
