"""Training functions run inside spawned ranks by tests/test_ddp_mp.py."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import io
import os
import pickle
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import resilient_ddp as rd
from resilient_ddp.testing import kill_self, stop_self

from ._workers import error_summary, slow_data_loader

FAULT_STEP = 3


class FaultLayer(nn.Module):
    """Identity; injects the configured fault on the culprit at FAULT_STEP, in forward or in
    backward."""

    def __init__(self) -> None:
        super().__init__()
        self.kind = ""
        self.where = ""
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind and self.where == "forward" and self.step == FAULT_STEP:
            inject(self.kind, 6.0)
        return _Backward.apply(x, self) if self.where == "backward" else x


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: FaultLayer) -> torch.Tensor:
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layer = ctx.layer
        if layer.kind and layer.step == FAULT_STEP:
            inject(layer.kind, 6.0)
        return grad, None


def inject(kind: str, sleep_s: float) -> None:
    if kind == "kill":
        kill_self()
    elif kind == "raise":
        raise ValueError("injected failure on the culprit")
    elif kind == "sleep":
        slow_data_loader(sleep_s)
    elif kind == "sigstop":
        stop_self()


def make_model(width: int = 16, fault: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.BatchNorm1d(width),
        fault or nn.Identity(),
        nn.ReLU(),
        nn.Linear(width, 1),
    )


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _init(cfg: dict[str, Any] | None = None) -> None:
    faulthandler.dump_traceback_later(50, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**(cfg or {})))


def _train(model: nn.Module, data: Any, accumulate: int = 1) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accumulate == 0
        ctx = model.no_sync() if not last else contextlib.nullcontext()
        with ctx:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
        if last:
            opt.step()
            opt.zero_grad()
    return [t.detach().clone() for t in model.state_dict().values()]


def _train_amp(model: nn.Module, data: Any) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((model(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [t.detach().clone() for t in model.state_dict().values()]


def parity(rank: int, mode: str, tmp: str) -> Any:
    """Train ResilientDDP and plain DDP on the same data; report whether they agree."""
    _init()
    data = batches(rank, 6)
    extra: dict[str, Any] = {}
    if mode == "plain":
        m1 = rd.ResilientDDP(make_model())
        extra = {
            "isinstance": isinstance(m1, DistributedDataParallel),
            "module": type(m1.module).__name__,
        }
        a = _train(m1, data)
        b = _train(DistributedDataParallel(make_model()), data)
    elif mode == "no_sync":
        a = _train(rd.ResilientDDP(make_model()), data, accumulate=3)
        b = _train(DistributedDataParallel(make_model()), data, accumulate=3)
    elif mode == "join":
        uneven = batches(rank, 3 + rank)  # rank r has 3 + r batches
        m1, m2 = (
            rd.ResilientDDP(make_model()),
            DistributedDataParallel(make_model()),
        )
        with m1.join():
            a = _train(m1, uneven)
        with m2.join():
            b = _train(m2, uneven)
    elif mode == "amp":
        # torch.autocast and GradScaler are used exactly as with DDP.
        a = _train_amp(rd.ResilientDDP(make_model()), data)
        b = _train_amp(DistributedDataParallel(make_model()), data)
    elif mode == "hook":
        m1, m2 = (
            rd.ResilientDDP(make_model()),
            DistributedDataParallel(make_model()),
        )
        m1.register_comm_hook(None, default_hooks.allreduce_hook)
        m2.register_comm_hook(None, default_hooks.allreduce_hook)
        a, b = _train(m1, data), _train(m2, data)
    elif mode == "checkpoint":
        # Saved from ResilientDDP, loaded into DDP (and back): same keys, same values.
        m1 = rd.ResilientDDP(make_model())
        a = _train(m1, data)
        path = os.path.join(tmp, "ckpt.pt")
        if rank == 0:
            torch.save(m1.state_dict(), path)
        rd.barrier()
        m2 = DistributedDataParallel(make_model())
        m2.load_state_dict(torch.load(path))
        # Buffers (BatchNorm running stats) are per rank after the last forward; the
        # parameters are what every rank shares.
        a = [p.detach().clone() for p in m1.parameters()]
        b = [p.detach().clone() for p in m2.parameters()]
        m3 = rd.ResilientDDP(make_model())
        m3.load_state_dict(m2.state_dict())
        assert list(m1.state_dict()) == list(m2.state_dict()) == list(m3.state_dict())
        assert all(
            torch.equal(x, y)
            for x, y in zip(m2.state_dict().values(), m3.state_dict().values(), strict=True)
        )
    else:
        raise ValueError(mode)
    same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # The models must really have trained (parity of untouched weights proves nothing).
    moved = not torch.equal(a[0], make_model().state_dict()["0.weight"])  # 0.weight first
    rd.destroy_process_group()
    return {"same": same, "moved": moved, **extra}


def subgroup_parity(rank: int) -> Any:
    """DDP over a group of ranks 1 and 2 of 3 (rank 0 outside it, as an evaluation or a
    pipeline rank is): ResilientDDP matches DDP, BatchNorm's buffers included, which DDP
    broadcasts at each forward from the group's first rank (global rank 1)."""
    _init()
    sub = torch.distributed.new_group([1, 2])
    out: dict[str, Any] = {"outside": True}
    if rank != 0:
        data = batches(rank, 4)
        a = _train(rd.ResilientDDP(make_model(), process_group=sub), data)
        b = _train(DistributedDataParallel(make_model(), process_group=sub), data)
        out = {
            "same": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
            "running_mean": a[4].tolist(),  # 1.running_mean: the buffer broadcast
        }
    rd.barrier()
    rd.destroy_process_group()
    return out


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _copy_of(model: nn.Module, how: str) -> Any:
    """A copy of the whole wrapper: by pickle, torch.save/torch.load, or copy.deepcopy."""
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))  # noqa: S301 - bytes we just made
    if how == "torch_save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    if how == "deepcopy":
        return copy.deepcopy(model)
    raise ValueError(how)


def copies(rank: int) -> dict[str, Any]:
    """Copy a trained ResilientDDP and a plain DDP trained alike, in each of the three ways
    torch users copy a DDP model; train the copies on; report how they compare.

    Both originals carry a comm hook, which a copy does not keep (DDP's reducer holds it):
    registering one again on the copy must work as on DDP's copy.
    """
    _init()
    data = batches(rank, 6)
    ours = rd.ResilientDDP(make_model())
    theirs = DistributedDataParallel(make_model())
    ours.register_comm_hook(None, default_hooks.allreduce_hook)
    theirs.register_comm_hook(None, default_hooks.allreduce_hook)
    _train(ours, data[:2])
    _train(theirs, data[:2])
    out: dict[str, Any] = {"steps_before": ours.resilience_stats["step"]}
    for how in ("pickle", "torch_save", "deepcopy"):
        mine, ref = _copy_of(ours, how), _copy_of(theirs, how)
        before = _params(ours)
        row: dict[str, Any] = {
            "type": type(mine).__name__,
            "isinstance_ddp": isinstance(mine, DistributedDataParallel),
            "new_module": mine.module is not ours.module,
            "copied_params": _same(_params(mine), before),
            "same_state_keys": list(mine.state_dict()) == list(ours.state_dict()),
        }
        mine.register_comm_hook(None, default_hooks.allreduce_hook)
        ref.register_comm_hook(None, default_hooks.allreduce_hook)
        _train(mine, data[2:4])
        _train(ref, data[2:4])
        row["trained_like_ddp_copy"] = _same(_params(mine), _params(ref))
        row["moved"] = not _same(_params(mine), before)
        row["original_untouched"] = _same(_params(ours), before)
        row["steps_after"] = mine.resilience_stats["step"]
        out[how] = row
    # The original still trains, alongside DDP's.
    _train(ours, data[4:])
    _train(theirs, data[4:])
    out["original_trains_like_ddp"] = _same(_params(ours), _params(theirs))
    rd.destroy_process_group()
    return out


def fault_train(
    rank: int, kind: str, where: str, culprit: int, cfg: dict[str, Any], at: int = FAULT_STEP
) -> Any:
    """Train; on the culprit inject ``kind`` at step ``at`` in ``where`` (forward, backward
    or data; data faults only at another ``at``). Survivors report the error and how long
    after the step began it came."""
    _init(cfg)
    layer = FaultLayer()
    if rank == culprit:
        layer.kind, layer.where = (kind, where) if where != "data" else ("", "")
    model = rd.ResilientDDP(make_model(fault=layer))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.monotonic()
    try:
        for step, (x, y) in enumerate(batches(rank, FAULT_STEP + 3)):
            layer.step = step
            t0 = time.monotonic()
            if rank == culprit and where == "data" and step == at:
                inject(kind, cfg["op_timeout"] + 4)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except rd.ResilientDDPError as e:
        out = error_summary(e, t0)
        out["step"] = layer.step
        out["culprit_steps"] = [(c.step, c.phase) for c in e.culprits]
        return out
    finally:
        rd.destroy_process_group()
    return "no error"


def dies_between_steps(rank: int, cfg: dict[str, Any], at: int, pause: float) -> Any:
    """Train steps that end ``pause`` seconds after the optimizer step (a slow data loader);
    rank 1 dies at the start of step ``at``. The survivor reports the culprit's step and
    phase, which come from the culprit's last heartbeat."""
    _init(cfg)
    model = rd.ResilientDDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step, (x, y) in enumerate(batches(rank, at + 2)):
            assert model.resilience_stats["step"] == step
            if rank == 1 and step == at:
                kill_self()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(pause)
    except rd.RankFailureError as e:
        return [
            {"rank": c.rank, "step": c.step, "phase": c.phase, "age": c.state_age}
            for c in e.culprits
        ]
    finally:
        rd.destroy_process_group()
    return "no error"


def one_batch_fewer(rank: int, cfg: dict[str, Any]) -> Any:
    """Rank 1 has one batch fewer than the others (the classic uneven-data hang)."""
    _init(cfg)
    model = rd.ResilientDDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(rank, 4 if rank == 1 else 5)
    t0 = time.monotonic()
    try:
        for x, y in data:
            t0 = time.monotonic()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return "no error"


def mismatched_params(rank: int) -> Any:
    _init({"op_timeout": 5})
    t0 = time.monotonic()
    try:
        rd.ResilientDDP(make_model(width=17 if rank == 1 else 16))
    except rd.PreflightError as e:
        out = error_summary(e, t0)
        out["problems"] = list(e.problems)
        out["ptable"] = e.table
        return out
    finally:
        rd.destroy_process_group()
    return "no error"


def section_overrun(rank: int) -> Any:
    """Rank 1 spends 3 s in a section budgeted at 1 s; the others wait in a collective."""
    _init({"op_timeout": 30, "heartbeat_interval": 0.2, "heartbeat_timeout": 10})
    rd.all_reduce(torch.ones(1))
    t0 = time.monotonic()
    try:
        if rank == 1:
            with rd.section("eval", budget=1.0):
                time.sleep(3)
        rd.all_reduce(torch.ones(1))
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return "no error"


class _Slow(nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return x


def straggler(rank: int) -> Any:
    """Rank 2 computes 150 ms longer per step: the report names it, and only it.

    The others' compute time of this tiny model swings between 1 and 100 ms on a loaded
    2-core machine (3 ranks share it), so the delay is well above that noise and the
    report's medians cover 20 steps (the window ResilientDDP keeps). One thread per rank
    keeps the ranks' OpenMP pools from spinning against each other."""
    torch.set_num_threads(1)
    _init({"straggler_interval": 0.2})
    model = rd.ResilientDDP(make_model(fault=_Slow(0.15 if rank == 2 else 0.0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(rank, 20):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    time.sleep(0.5)  # let every heartbeat carry the latest compute times
    report = model.straggler_report()
    rd.barrier()
    rd.destroy_process_group()
    return report
