"""Functions run inside the ranks of tests/test_dropin_start.py (importable by spawned
children): start-up as PyTorch's DDP tutorial writes it, under ``rd.spawn``."""

from __future__ import annotations

import faulthandler
import os
import time
from typing import Any

import resilient_ddp as rd

from ._workers import CHILD_DUMP_AFTER_S, error_summary

# init_timeout of these ranks: a check that did not fire would show as an error after this
# long, well past the 10 s within which the mismatch must be named.
INIT_TIMEOUT_S = 30.0


def tutorial_setup(rank: int, port: str | None) -> dict[str, Any]:
    """The tutorial's ``setup()``: MASTER_ADDR and MASTER_PORT set in the script (``port``;
    ``None``: the launcher's own port set again), then ``rd.init_process_group``.

    Returns:
        ``{"ok": True, ...}`` after a barrier, or the error's summary; both with
        ``elapsed``, the seconds ``init_process_group`` took.
    """
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port if port is not None else os.environ["MASTER_PORT"]
    cfg = rd.ResilienceConfig(init_timeout=INIT_TIMEOUT_S, heartbeat_interval=0.2)
    t0 = time.monotonic()
    try:
        rd.init_process_group("gloo", config=cfg)
        rd.barrier()
        return {"ok": True, "elapsed": time.monotonic() - t0}
    except rd.ResilientDDPError as e:
        return {**error_summary(e, t0), "problems": list(getattr(e, "problems", ()))}
    finally:
        if rd.is_initialized():
            rd.destroy_process_group()


def uneven_training(rank: int) -> dict[str, Any]:
    """A training loop over ``rd.BalancedDistributedSampler`` where ``DistributedSampler``
    was: 10 items on 3 ranks, so rank 0 has a fourth step that ranks 1 and 2 do not run
    (they finish, and leave the group).

    Returns:
        ``{"steps": n}`` after the loop, or the error's summary.
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    cfg = rd.ResilienceConfig(heartbeat_interval=0.2, op_timeout=10)
    rd.init_process_group("gloo", config=cfg)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
    loader = DataLoader(data, batch_size=1, sampler=rd.BalancedDistributedSampler(data))
    model = rd.ResilientDDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    t0 = time.monotonic()
    try:
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    except rd.ResilientDDPError as e:
        return {**error_summary(e, t0), "steps": steps}
    return {"steps": steps}
