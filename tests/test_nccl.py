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


def _nccl_gather_worker(rank: int) -> Any:
    torch.cuda.set_device(rank)
    cfg = rd.ResilienceConfig(op_timeout=10, heartbeat_interval=0.2, heartbeat_timeout=4)
    rd.init_process_group("nccl", config=cfg, device_id=torch.device("cuda", rank))
    try:
        world = torch.distributed.get_world_size()
        mine = list(range(rank, 11, world))
        rows = [torch.full((i % 3 + 1,), float(i), device="cuda") for i in mine]
        out = rd.gather_to_rank0(rows, indices=mine, num_items=11, chunk_bytes=64)
        state = {"w": torch.arange(1000.0, device="cuda"), "step": 3} if rank == 0 else None
        got = rd.broadcast_state_dict(state, src=0, chunk_bytes=1000)
        return {
            "gathered": None if out is None else [t.tolist() for t in out],
            "devices": None if out is None else sorted({t.device.type for t in out}),
            "state_ok": torch.equal(got["w"].cpu(), torch.arange(1000.0)) and got["step"] == 3,
        }
    finally:
        rd.destroy_process_group()


def test_nccl_gather_to_rank0_and_broadcast_state_dict() -> None:
    world = min(torch.cuda.device_count(), 3)
    outcomes = run_ranks(_nccl_gather_worker, world, (), timeout=timedelta(seconds=90))
    values = [o.value for o in outcomes]
    assert all(isinstance(v, dict) for v in values), format_outcomes(outcomes)
    assert values[0]["gathered"] == [[float(i)] * (i % 3 + 1) for i in range(11)]
    assert values[0]["devices"] == ["cpu"]
    assert all(v["state_ok"] for v in values)
    assert all(v["gathered"] is None for v in values[1:])
