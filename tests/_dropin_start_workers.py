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


# The fast loop of issue 30, item 6: about 10 ms a step, rank KILL_RANK kills itself
# (SIGKILL) at step KILL_STEP, right after its forward pass.
STEP_S = 0.01
KILL_RANK = 1
KILL_STEP = 99


def fast_loop_kill(rank: int, signum: int = 9) -> dict[str, Any]:
    """Train steps of about ``STEP_S`` (the rest of each step after compute is spent in
    the data phase, as a data loader would) until rank ``KILL_RANK`` sends itself
    ``signum`` (SIGKILL, or SIGSTOP) after the forward pass of step ``KILL_STEP``.

    Returns:
        On a survivor, the error's summary with the culprit's step, phase and
        ``state_age`` (``culprit``), and the steps this rank completed.
    """
    import signal

    import torch
    from torch import nn

    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    # The library's defaults (heartbeat every 0.5 s), with a shorter op timeout (a
    # stopped rank is named when it runs out).
    rd.init_process_group("gloo", config=rd.ResilienceConfig(op_timeout=3))
    torch.manual_seed(0)
    model = rd.ResilientDDP(nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    step = 0
    t0 = time.monotonic()
    try:
        for step in range(KILL_STEP + 50):
            start = time.monotonic()
            out = model(x)
            if rank == KILL_RANK and step == KILL_STEP:
                os.kill(os.getpid(), signal.Signals(signum))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(max(0.0, STEP_S - (time.monotonic() - start)))  # the data phase
    except rd.ResilientDDPError as e:
        (culprit,) = getattr(e, "culprits", [])
        return {
            **error_summary(e, t0),
            "completed": step,
            "culprit": {
                "rank": culprit.rank,
                "step": culprit.step,
                "phase": culprit.phase,
                "state_age": culprit.state_age,
                "what": culprit.what,
            },
        }
    return {"completed": step}
