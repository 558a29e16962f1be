"""Ranks of tests/test_failure_listeners_mp.py: a failure listener that saves an emergency
checkpoint, in raise and shrink modes, and a fresh job that resumes from it."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import torch

import resilient_ddp as rd
from resilient_ddp.testing import kill_self

from ._ddp_workers import _init
from ._elastic_workers import _cfg, _model, state_hash

FAULT_STEP = 3
STEPS = 6


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s data (the model has no buffers: with BatchNorm, DDP's ranks hold
    different running statistics between forward passes, as rank 0's are broadcast at
    the start of each)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _survivor(rank: int, world: int, error: rd.RankFailureError) -> int:
    """The recipe's saver: the lowest rank that is not a culprit (rank 0 may be one)."""
    return min(r for r in range(world) if r not in error.ranks)


def _train(rank: int, culprit: int, model: Any, opt: torch.optim.Optimizer) -> None:
    """STEPS steps of this rank's data; rank ``culprit`` is killed at step FAULT_STEP."""
    for step, (x, y) in enumerate(batches(rank, STEPS)):
        if rank == culprit and step == FAULT_STEP:
            kill_self()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def emergency_checkpoint(rank: int, culprit: int, path: str, cfg: dict[str, Any]) -> Any:
    """Train until rank ``culprit`` is killed at step FAULT_STEP; a listener on every rank
    records the call, and the lowest surviving rank saves model, optimizer and step."""
    _init(cfg)
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls: list[dict[str, Any]] = []

    def save(error: rd.RankFailureError) -> None:
        calls.append(
            {
                "type": type(error).__name__,
                "ranks": list(error.ranks),
                "main_thread": threading.current_thread() is threading.main_thread(),
                "hash": state_hash(model.module, opt),
            }
        )
        if rank == _survivor(rank, model.resilience_stats["world_size"], error):
            state = {
                "model": model.module.state_dict(),
                "opt": opt.state_dict(),
                "step": model.resilience_stats["step"],
            }
            torch.save(state, path)

    def broken(error: rd.RankFailureError) -> None:
        raise OSError("a listener that fails (disk full)")

    rd.add_failure_listener(save)
    rd.add_failure_listener(broken)  # logged; must not hide the failure
    try:
        _train(rank, culprit, model, opt)
    except rd.RankFailureError as e:
        return {
            "raised": type(e).__name__,
            "ranks": list(e.ranks),
            "calls": calls,
            "hash_after": state_hash(model.module, opt),
            "step": model.resilience_stats["step"],
        }
    finally:
        rd.destroy_process_group()
    return {"raised": None, "calls": calls}


def resume(rank: int, path: str) -> Any:
    """A fresh job: load the emergency checkpoint on every rank, train one more step."""
    _init({})
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = torch.load(path, weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    loaded = state_hash(model.module, opt)
    x, y = batches(rank, 1)[0]
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    rd.destroy_process_group()
    return {"loaded": loaded, "step": state["step"]}


class _Records(logging.Handler):
    """Keeps the rank each record of the library's logger carries."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.ranks: list[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.ranks.append(getattr(record, "rank", None))


def shrink_listener(rank: int, culprit: int, event_log: str) -> Any:
    """on_failure="shrink": the listener is called once per failure on the survivors,
    before they recover; training goes on. Events go to ``event_log`` ({rank} in it)."""
    records = _Records()
    logging.getLogger("resilient_ddp").addHandler(records)
    rd.init_process_group("gloo", config=_cfg(event_log=event_log))
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[dict[str, Any]] = []
    rd.add_failure_listener(
        lambda e: calls.append(
            {
                "type": type(e).__name__,
                "ranks": list(e.ranks),
                "world": model.resilience_stats["world_size"],
                "t": time.monotonic(),
            }
        )
    )
    _train(rank, culprit, model, opt)
    stats = model.resilience_stats
    rd.destroy_process_group()
    return {
        "calls": calls,
        "world": stats["world_size"],
        "failures": stats["failures"],
        "log_ranks": records.ranks,
        "rank_after": stats["rank"],
    }


BASE_LR = 0.08
TOTAL_STEPS = 24
KILL_AT = 5


def world_size_listener(rank: int) -> Any:
    """Elastic training, 4 ranks: member 2 dies at step KILL_AT and a replacement joins. A
    world-size listener rescales the learning rate (the linear scaling rule) on every
    process, the joiner included; each records the changes it saw and (step, world, lr)
    after every step."""
    rd.init_process_group("gloo", config=_cfg())
    uid = int(os.environ.get("RESILIENT_DDP_UID", rank))
    joiner = os.environ.get("RESILIENT_DDP_JOINER", "") not in ("", "0")
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    changes: list[dict[str, Any]] = []

    def rescale(change: rd.WorldSizeChange) -> None:
        changes.append(dataclasses.asdict(change))
        for group in opt.param_groups:
            group["lr"] = BASE_LR * change.new_world_size / change.initial_world_size

    rd.add_world_size_listener(rescale)
    seen: list[tuple[int, int, float]] = []
    stats = model.resilience_stats
    while stats["step"] < TOTAL_STEPS:
        if uid == 2 and not joiner and stats["step"] == KILL_AT:
            kill_self()
        g = torch.Generator().manual_seed(100 * stats["step"] + stats["rank"])
        x = torch.randn(4, 4, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = model.resilience_stats
        seen.append((stats["step"], stats["world_size"], opt.param_groups[0]["lr"]))
    rd.destroy_process_group()
    return {
        "uid": uid,
        "joiner": joiner,
        "changes": changes,
        "seen": seen,
        "hash": state_hash(model.module, opt),
        "lr": opt.param_groups[0]["lr"],
    }
