"""CUDA tensors: the NCCL path, and gloo with CUDA tensors. Skipped without CUDA.

With NCCL the watchdog also aborts the communicator when a failure is reported, so that
kernels waiting on a dead or hung peer are released; waits on CUDA work go through the
work's future, whatever the backend.

Each test runs twice: over NCCL with one GPU per rank (NCCL refuses two ranks on one GPU:
"Duplicate GPU detected"), and over gloo with CUDA tensors, 3 ranks sharing the GPUs there
are, which one GPU is enough for.
"""

from __future__ import annotations

import copy
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import resilient_ddp as rd
from resilient_ddp.testing import format_outcomes, kill_self, run_ranks

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(_GPUS < 1, reason="needs CUDA"),
]

BACKENDS = [
    pytest.param(
        "nccl",
        marks=pytest.mark.skipif(_GPUS < 2, reason="NCCL needs a GPU per rank, 2 at least"),
    ),
    "gloo",
]


def _world(backend: str) -> int:
    return min(_GPUS, 3) if backend == "nccl" else 3


def _survivors(backend: str) -> list[int]:
    return [r for r in range(_world(backend)) if r != 1]


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count())


def _init(rank: int, backend: str, op_timeout: float = 5) -> torch.device:
    dev = _device(rank)
    torch.cuda.set_device(dev)
    cfg = rd.ResilienceConfig(op_timeout=op_timeout, heartbeat_interval=0.2, heartbeat_timeout=4)
    rd.init_process_group(backend, config=cfg, device_id=dev if backend == "nccl" else None)
    return dev


def _failure(e: rd.ResilientDDPError, t0: float, **extra: Any) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "ranks": list(getattr(e, "ranks", ())),
        "elapsed": time.monotonic() - t0,
        "message": str(e)[:400],
        **extra,
    }


def _worker(rank: int, backend: str, kind: str) -> Any:
    _init(rank, backend)
    t = torch.full((1024,), float(rank + 1), device="cuda")
    rd.all_reduce(t)
    torch.cuda.synchronize()
    value = t[0].item()
    if kind == "kill" and rank == 1:
        kill_self()
    if kind == "hang" and rank == 1:
        time.sleep(120)
    t0 = time.monotonic()
    try:
        rd.all_reduce(t)
        torch.cuda.synchronize()
    except rd.ResilientDDPError as e:
        return _failure(e, t0, value=value)
    finally:
        rd.destroy_process_group()
    return {"value": value}


def _assert_survivors_name_rank1(
    outcomes: list[Any], backend: str, kind: str, bound_s: float
) -> None:
    for r in _survivors(backend):
        v = outcomes[r].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v["type"] == kind, v
        assert v["ranks"] == [1], v
        assert v["elapsed"] < bound_s, v
        # Nothing left blocked on the failed peer kept the process from ending.
        assert outcomes[r].exitcode == 0, format_outcomes(outcomes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_of_cuda_tensors_and_a_dead_peer(backend: str) -> None:
    world = _world(backend)
    outcomes = run_ranks(_worker, world, (backend, "kill"), timeout=timedelta(seconds=90))
    for r in _survivors(backend):
        v = outcomes[r].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v["value"] == sum(range(1, world + 1))
    _assert_survivors_name_rank1(outcomes, backend, "RankFailureError", 5.0)
    assert os.environ.get("RESILIENT_DDP_STORE") is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hung_peer_is_named_and_the_waiting_ranks_released(backend: str) -> None:
    """A peer that stops (alive, never enters the op) is named within op_timeout + 2 s;
    with NCCL the survivors' kernels wait on it until the watchdog aborts the
    communicator."""
    outcomes = run_ranks(
        _worker,
        _world(backend),
        (backend, "hang"),
        timeout=timedelta(seconds=90),
        grace=timedelta(seconds=20),
    )
    _assert_survivors_name_rank1(outcomes, backend, "CollectiveTimeoutError", 5.0 + 2.0)


def _ddp_worker(rank: int, backend: str, fault: str) -> Any:
    dev = _init(rank, backend)
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)  # trained on CPU on every rank's batches at once
    ddp = rd.ResilientDDP(model.to(dev), device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def batch(r: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(4, 64, generator=g)

    done = 0
    t0 = time.monotonic()
    try:
        for step in range(6):
            if step == 3 and rank == 1 and fault == "kill":
                kill_self()
            if step == 3 and rank == 1 and fault == "hang":
                time.sleep(120)
            t0 = time.monotonic()
            loss = ddp(batch(rank, step).to(dev)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            ref_loss = sum(reference(batch(r, step)).pow(2).mean() for r in range(world)) / world
            ref_opt.zero_grad()
            ref_loss.backward()  # type: ignore[union-attr]
            ref_opt.step()
            done += 1
    except rd.ResilientDDPError as e:
        return _failure(e, t0, steps=done)
    finally:
        rd.destroy_process_group()
    gap = max(
        (p.detach().cpu() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    flat = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    return {"steps": done, "gap": gap, "flat": flat.tolist()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_resilient_ddp_on_cuda_matches_full_batch_training(backend: str) -> None:
    outcomes = run_ranks(
        _ddp_worker, _world(backend), (backend, "none"), timeout=timedelta(seconds=120)
    )
    values = [o.value for o in outcomes]
    assert all(isinstance(v, dict) and v["steps"] == 6 for v in values), format_outcomes(outcomes)
    assert all(v["gap"] < 1e-5 for v in values), [v["gap"] for v in values]
    assert all(v["flat"] == values[0]["flat"] for v in values)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("fault", "kind", "bound_s"),
    [("kill", "RankFailureError", 5.0), ("hang", "CollectiveTimeoutError", 5.0 + 2.0)],
)
def test_resilient_ddp_on_cuda_names_a_failed_rank_mid_training(
    backend: str, fault: str, kind: str, bound_s: float
) -> None:
    outcomes = run_ranks(
        _ddp_worker,
        _world(backend),
        (backend, fault),
        timeout=timedelta(seconds=120),
        grace=timedelta(seconds=20),
    )
    _assert_survivors_name_rank1(outcomes, backend, kind, bound_s)
    steps = [outcomes[r].value["steps"] for r in _survivors(backend)]
    assert steps == [3] * len(steps), format_outcomes(outcomes)


def _gather_worker(rank: int, backend: str) -> Any:
    _init(rank, backend, op_timeout=10)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_to_rank0_and_broadcast_state_dict_of_cuda_tensors(backend: str) -> None:
    outcomes = run_ranks(_gather_worker, _world(backend), (backend,), timeout=timedelta(seconds=90))
    values = [o.value for o in outcomes]
    assert all(isinstance(v, dict) for v in values), format_outcomes(outcomes)
    assert values[0]["gathered"] == [[float(i)] * (i % 3 + 1) for i in range(11)]
    assert values[0]["devices"] == ["cpu"]
    assert all(v["state_ok"] for v in values)
    assert all(v["gathered"] is None for v in values[1:])


def _single_rank_nccl_worker(rank: int) -> Any:
    """One NCCL rank: the library's collectives and DDP run over a real communicator, and
    the abort the watchdog uses on a failure takes effect (a later op fails, the process
    still ends)."""
    dev = _init(rank, "nccl")
    t = torch.full((8,), 3.0, device=dev)
    rd.all_reduce(t)
    model = torch.nn.Linear(16, 4).to(dev)
    ddp = rd.ResilientDDP(model, device_ids=[dev.index])
    ddp(torch.ones(2, 16, device=dev)).sum().backward()
    torch.cuda.synchronize()
    got = rd.broadcast_state_dict({"w": torch.arange(5.0, device=dev)}, src=0)
    from resilient_ddp.base._backend import abort_group, backend_name

    name = backend_name()
    abort_group()
    try:
        after = torch.ones(1, device=dev)
        torch.distributed.all_reduce(after)
        torch.cuda.synchronize()
        after_abort = "completed"
    except Exception as e:  # noqa: BLE001 (whatever an aborted communicator raises)
        after_abort = type(e).__name__
    rd.destroy_process_group()
    return {
        "sum": t.tolist(),
        "grad": model.weight.grad is not None,
        "state": got["w"].tolist(),
        "backend": name,
        "after_abort": after_abort,
    }


def test_one_nccl_rank_runs_the_library_and_its_abort_takes_effect() -> None:
    outcomes = run_ranks(_single_rank_nccl_worker, 1, (), timeout=timedelta(seconds=90))
    v = outcomes[0].value
    assert isinstance(v, dict), format_outcomes(outcomes)
    assert outcomes[0].exitcode == 0, format_outcomes(outcomes)
    assert v["sum"] == [3.0] * 8
    assert v["grad"]
    assert v["state"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "nccl" in v["backend"]
    assert v["after_abort"] != "completed", v
