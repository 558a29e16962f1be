"""The NCCL path (CUDA tensors): skipped without at least 2 GPUs.

With NCCL the watchdog also aborts the communicator when a failure is reported, so that
kernels waiting on a dead peer are released; waits go through the work's future.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import resilient_ddp as rd
from resilient_ddp.testing import format_outcomes, kill_self, run_ranks

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs CUDA with at least 2 GPUs",
    ),
]


def _nccl_worker(rank: int, kind: str) -> Any:
    torch.cuda.set_device(rank)
    cfg = rd.ResilienceConfig(op_timeout=5, heartbeat_interval=0.2, heartbeat_timeout=4)
    rd.init_process_group("nccl", config=cfg, device_id=torch.device("cuda", rank))
    t = torch.full((1024,), float(rank + 1), device="cuda")
    rd.all_reduce(t)
    torch.cuda.synchronize()
    value = t[0].item()
    if kind == "kill" and rank == 1:
        kill_self()
    t0 = time.monotonic()
    try:
        rd.all_reduce(t)
        torch.cuda.synchronize()
    except rd.ResilientDDPError as e:
        return {
            "value": value,
            "type": type(e).__name__,
            "ranks": list(getattr(e, "ranks", ())),
            "elapsed": time.monotonic() - t0,
        }
    finally:
        rd.destroy_process_group()
    return {"value": value}


def test_nccl_all_reduce_and_dead_peer() -> None:
    world = min(torch.cuda.device_count(), 3)
    outcomes = run_ranks(_nccl_worker, world, ("kill",), timeout=timedelta(seconds=90))
    for r in (0, 2) if world == 3 else (0,):
        v = outcomes[r].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v["value"] == sum(range(1, world + 1))
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1]
        assert v["elapsed"] < 5.0
    assert os.environ.get("RESILIENT_DDP_STORE") is None
