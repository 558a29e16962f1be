"""A DDP training script as a user writes it for torchrun, with the README's two lines
changed (``rd.init_process_group()``, ``rd.ResilientDDP``). Run by tests/test_torchrun_mp.py:

    torchrun --nproc-per-node 3 --max-restarts 1 ... train_ddp.py OUT_DIR [--plain-init]

It snapshots the model and optimizer every ``SAVE_EVERY`` steps and resumes from the last
snapshot when torchrun restarts it, as a plain DDP script would. Budgets come from the
environment (``RESILIENT_DDP_OP_TIMEOUT``), not from the code.

With ``--tutorial-port`` the script sets MASTER_ADDR and MASTER_PORT (12355) itself before
init, as PyTorch's DDP tutorial does. With ``--plain-init`` the group is created by torch's
own ``init_process_group("gloo")`` instead (``rd.ResilientDDP`` attaches to it): the restart
trap of docs/torchrun.md.

The one thing a user would not write is the fault: with ``FAULT`` (``hang``, ``raise`` or
``kill``), ``FAULT_RANK`` and ``FAULT_STEP`` set, that rank stops (sleeps in its training
loop), raises or is killed at that step, in torchrun's first attempt only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed
from torch import nn

import resilient_ddp as rd

STEPS = 10
SAVE_EVERY = 4
LR = 0.05
MOMENTUM = 0.9


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same in every attempt, so a resumed run sees the
    data the uninterrupted one would have seen."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def maybe_fail(step: int, rank: int) -> None:
    """The injected fault, in torchrun's first attempt only."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if str(rank) != os.environ.get("FAULT_RANK") or str(step) != os.environ.get("FAULT_STEP"):
        return
    if os.environ.get("FAULT") == "hang":
        print(f"rank {rank}: hangs at step {step}, t={time.time():.3f}", flush=True)
        time.sleep(300)
    elif os.environ.get("FAULT") == "raise":
        raise ValueError(f"bad batch at step {step}")
    elif os.environ.get("FAULT") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out = Path(sys.argv[1])
    snapshot = out / "snapshot.pt"
    if "--tutorial-port" in sys.argv:
        # As PyTorch's DDP tutorial's setup() does, which torchrun does not need.
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "12355"
    t0 = time.monotonic()
    try:
        if "--plain-init" in sys.argv:
            torch.distributed.init_process_group("gloo")
        else:
            rd.init_process_group()  # was: torch.distributed.init_process_group("gloo")
    finally:
        print(f"init ended after {time.monotonic() - t0:.3f} s", flush=True)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = rd.ResilientDDP(nn.Linear(8, 1))  # was: DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start = 0
    if snapshot.exists():
        state = torch.load(snapshot)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"rank {rank}: resumed from step {start}", flush=True)
    for step in range(start, STEPS):
        maybe_fail(step, rank)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank}: step {step} loss {loss.item():.6f}", flush=True)
        if rank == 0 and (step + 1) % SAVE_EVERY == 0:
            # Written aside and renamed: a rank killed mid-save leaves the last good one.
            tmp = snapshot.with_suffix(".tmp")
            torch.save(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                tmp,
            )
            os.replace(tmp, snapshot)
    final = {
        "rank": rank,
        "start": start,
        "steps": STEPS,
        "state": {k: v.tolist() for k, v in model.module.state_dict().items()},
    }
    (out / f"final{rank}.json").write_text(json.dumps(final))
    rd.destroy_process_group()


if __name__ == "__main__":
    main()
