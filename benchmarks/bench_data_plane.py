"""An op every rank has arrived at: waited for while its data moves, named when it stalls.

Runs 3 gloo ranks under ``torchrun`` (its agent hosts the store) with the library's
default settings (stuck window 3 s, ``op_timeout`` 60 s), ``heartbeat_interval`` given
through ``RESILIENT_DDP_HEARTBEAT_INTERVAL`` as a user would:

* ``moving``: every rank queues 150 all_reduces of 40 MB on torch's own gloo
  (``async_op=True``), then one ``rd.all_reduce``: every rank arrives at it at once, and
  it completes only when gloo has moved the 6 GB queued before it. It must complete.
* ``lost``: rank 1's ``rd.all_reduce`` is lost in its data plane (a work handle that never
  completes, ``tests/_workers.py``); every rank is alive. It must be named, with no rank to
  blame, long before ``op_timeout``.

Usage: ``python benchmarks/bench_data_plane.py [--quick] [--out PATH] [--before SRC]``.
``--before SRC`` runs both cases again on another checkout's ``src`` folder (the code
before the data plane was judged). Writes ``benchmarks/results/data_plane.json``
(``--quick``: 60 queued all_reduces, to ``results/quick/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_collectives import result_header

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAME = "data_plane"
TITLE = "An op every rank arrived at: a moving data plane vs a stalled one"

QUEUED = 150
FLOATS = 10_000_000  # 40 MB each


def worker(mode: str, queued: int) -> None:
    """One rank of ``mode``; prints its outcome as a JSON line."""
    import torch
    import torch.distributed as dist
    from tests._workers import _NeverCompletes

    import resilient_ddp as rd

    rd.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, object] = {"rank": rank, "mode": mode}
    t0 = time.monotonic()
    try:
        if mode == "moving":
            big = torch.ones(FLOATS)
            rd.all_reduce(torch.ones(1))
            works = [dist.all_reduce(big, async_op=True) for _ in range(queued)]
            t = torch.ones(1)
            t0 = time.monotonic()
            rd.all_reduce(t)
            out.update(value=t.item(), waited_s=round(time.monotonic() - t0, 2))
            for work in works:
                work.wait()
        else:
            if rank == 1:
                dist.all_reduce = lambda *a, **k: _NeverCompletes()  # type: ignore[assignment]
            rd.all_reduce(torch.ones(3))
            out["value"] = "completed"
    except rd.ResilientDDPError as e:
        out.update(
            error=type(e).__name__,
            ranks=list(e.ranks),
            waited_s=round(time.monotonic() - t0, 2),
            message=str(e).splitlines()[0],
        )
    finally:
        rd.destroy_process_group()
    print(json.dumps(out), flush=True)


def run_cases(src: Path, queued: int) -> list[dict[str, Any]]:
    """Both cases on the code in ``src``: one outcome per rank and case."""
    env = {**os.environ, "RESILIENT_DDP_HEARTBEAT_INTERVAL": "0.5"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    rows: list[dict[str, Any]] = []
    for mode in ("moving", "lost"):
        proc = subprocess.run(
            [*torchrun, __file__, "--worker", mode, str(queued)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        # The ranks print at about the same moment: two lines may come out interleaved.
        decoder, text, i = json.JSONDecoder(), proc.stdout, proc.stdout.find("{")
        while i >= 0:
            row, end = decoder.raw_decode(text, i)
            print(json.dumps(row))
            rows.append(row)
            i = text.find("{", end)
    return sorted(rows, key=lambda r: (r["mode"] != "moving", r["rank"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--before", type=Path, metavar="SRC")
    args = parser.parse_args()
    queued = 60 if args.quick else QUEUED
    t0 = time.perf_counter()
    now = run_cases(ROOT / "src", queued)
    before = run_cases(args.before.resolve(), queued) if args.before else []
    cmd = ["python", "benchmarks/bench_data_plane.py"]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--before", "<checkout of the old code>/src"] if args.before else []
    data = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=time.perf_counter() - t0
        ),
        "setup": {"queued": queued, "megabytes_each": FLOATS * 4 // 10**6},
        "now": now,
        "before": before,
    }
    out: Path = args.out or ROOT / "benchmarks" / "results" / (
        "quick/data_plane.json" if args.quick else "data_plane.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
