"""The demo behind ``python -m resilient_ddp demo``: train on local gloo ranks, inject a
fault, and show what every rank saw and how fast it knew."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

FAULTS = ("kill", "raise", "hang", "stop", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="number of local gloo ranks (4)")
    p.add_argument("--fault", choices=FAULTS, default="kill", help="what to inject (kill)")
    p.add_argument("--rank", type=int, default=2, help="the rank that fails (2)")
    p.add_argument("--step", type=int, default=5, help="the step at which it fails (5)")
    p.add_argument("--steps", type=int, default=12, help="training steps (12)")
    p.add_argument(
        "--op-timeout", type=float, default=3.0, help="seconds before a stall is diagnosed (3)"
    )


def _worker(rank: int, args: dict[str, Any], out_dir: str) -> dict[str, Any]:
    import torch
    from torch import nn

    import resilient_ddp as rd

    cfg = rd.ResilienceConfig(
        op_timeout=timedelta(seconds=args["op_timeout"]),
        heartbeat_interval=timedelta(milliseconds=250),
        heartbeat_timeout=timedelta(seconds=5),
    )
    rd.init_process_group("gloo", config=cfg)
    torch.manual_seed(0)
    model = rd.ResilientDDP(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x_all, w = (
        torch.randn(512, 32, generator=g),
        torch.randn(32, 1, generator=torch.Generator().manual_seed(7)),
    )
    y_all = x_all @ w
    culprit = rank == args["rank"] and args["fault"] != "none"
    result: dict[str, Any] = {"rank": rank, "steps": 0}
    try:
        for step in range(args["steps"]):
            if culprit and step == args["step"]:
                _inject(args["fault"], out_dir)
            idx = torch.randint(0, 512, (32,), generator=g)
            loss = ((model(x_all[idx]) - y_all[idx]) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            result["steps"] = step + 1
            if rank == 0:
                print(f"  step {step + 1:>3}/{args['steps']}  loss {loss.item():8.4f}", flush=True)
            time.sleep(0.05)  # a step of a real model takes a while
    except rd.ResilientDDPError as e:
        result.update(
            {
                "error": type(e).__name__,
                "ranks": list(getattr(e, "ranks", ())),
                "at": time.time(),
                "message": str(e),
            }
        )
    finally:
        rd.destroy_process_group()
    return result


def _inject(kind: str, out_dir: str) -> None:
    with open(os.path.join(out_dir, "fault.json"), "w") as f:
        json.dump({"t": time.time(), "pid": os.getpid()}, f)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError("CUDA out of memory (simulated by the demo)")
    if kind == "hang":
        time.sleep(3600)  # a stuck data loader
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def run(args: argparse.Namespace) -> int:
    import resilient_ddp as rd
    from resilient_ddp.launch import launch

    if not 0 <= args.rank < args.nproc:
        print(f"--rank should be in [0, {args.nproc - 1}], but given {args.rank}", file=sys.stderr)
        return 2
    opts = vars(args).copy()
    what = {
        "kill": "killed with SIGKILL (like the OOM killer)",
        "raise": "raises an exception",
        "hang": "hangs in its data loader",
        "stop": "is frozen with SIGSTOP",
        "none": "",
    }[args.fault]
    print(
        f"resilient_ddp {rd.__version__} demo: {args.nproc} gloo ranks, ResilientDDP, "
        f"{args.steps} steps"
    )
    if args.fault != "none":
        print(f"fault: rank {args.rank} {what} at step {args.step}")
    print()
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.time()
        outcomes = launch(
            _worker, args.nproc, (opts, out_dir),
            timeout=timedelta(seconds=120), grace=timedelta(seconds=3),
        )  # fmt: skip
        fault_path = os.path.join(out_dir, "fault.json")
        fault_t = None
        if os.path.exists(fault_path):
            with open(fault_path) as f:
                fault_t = json.load(f)["t"]
    print()
    print(f"{'rank':>4}  {'outcome':<28} {'named':<7} {'knew after':>10}  first line of the error")
    ok = True
    for o in outcomes:
        v = o.value if isinstance(o.value, dict) else {}
        if o.exitcode is None:
            outcome, named, after, line = "killed by the launcher", "", "", "(never came back)"
        elif o.exitcode < 0:
            outcome = f"died ({signal.Signals(-o.exitcode).name})"
            named, after, line = "", "", ""
        elif o.exc_type:
            outcome, named, after = f"raised {o.exc_type}", "", ""
            line = (o.exc_message or "").splitlines()[0][:70]
        elif "error" in v:
            outcome = v["error"]
            named = ",".join(map(str, v["ranks"]))
            after = f"{v['at'] - fault_t:.2f} s" if fault_t else ""
            line = v["message"].splitlines()[1 if len(v["message"].splitlines()) > 1 else 0][:70]
        else:
            outcome, named, after, line = f"finished {v.get('steps', '?')} steps", "", "", ""
        ok = ok and o.exitcode == 0 and "error" not in v
        print(f"{o.rank:>4}  {outcome:<28} {named:<7} {after:>10}  {line}")
    first = next(
        (o.value for o in outcomes if isinstance(o.value, dict) and "error" in o.value), None
    )
    if first is not None:
        print(f"\nWhat rank {first['rank']} raised ({first['error']}):")
        print("\n".join("  | " + line for line in first["message"].splitlines()))
    print(f"\ntotal {time.time() - start:.1f} s.", end=" ")
    if args.fault == "none":
        print("No fault injected: every rank finished." if ok else "Something failed.")
    else:
        print(
            "Plain DistributedDataParallel would have left the survivors waiting for the process"
            " group timeout (30 min on gloo) or failing with 'Connection closed by peer'."
        )
    return 0 if ok else 1
