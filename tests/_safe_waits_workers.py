"""Workers of tests/test_safe_waits_mp.py: a rank whose wall clock is off (issue 29,
item 8) and a rank killed inside ``rd.ResilientDDP(...)`` (item 9)."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd
from resilient_ddp.base import _clock
from resilient_ddp.training import ddp as rd_ddp

from ._workers import error_summary

# Short, so that op_timeout (not the section's budget) would end a wait that ignored it.
CFG: dict[str, Any] = {"op_timeout": 1.5, "heartbeat_interval": 0.2, "heartbeat_timeout": 3}
SECTION_S = 4.0  # the section's budget: well past op_timeout
BUSY_S = 3.0  # what rank 1 spends in it


def _init() -> None:
    faulthandler.dump_traceback_later(50, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**CFG))


def clock_offset(rank: int, offset_s: float) -> dict[str, Any]:
    """Rank 0's wall clock is ``offset_s`` ahead, rank 1's as much behind, rank 2's right.

    Rank 1 spends :data:`BUSY_S` in a section budgeted :data:`SECTION_S` (past
    op_timeout) while the others wait in an all-reduce: they must wait for it. Then rank 1
    is SIGKILLed outside any collective while the others wait in the next one: they must
    name it within heartbeat_timeout.
    """
    _clock.set_wall_offset({0: offset_s, 1: -offset_s}.get(rank, 0.0))
    _init()
    out: dict[str, Any] = {}
    t = torch.ones(1)
    rd.all_reduce(t)
    t0 = time.monotonic()
    if rank == 1:
        with rd.section("save", budget=SECTION_S):
            time.sleep(BUSY_S)
    t = torch.ones(1)
    rd.all_reduce(t)
    out["section_value"], out["section_waited"] = float(t), time.monotonic() - t0
    rd.all_reduce(torch.ones(1))  # every rank is out of the section step
    if rank == 1:
        time.sleep(0.5)  # the others are waiting in the next all-reduce
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rd.all_reduce(torch.ones(1))
        out["kill"] = "no error"
    except rd.ResilientDDPError as e:
        out["kill"] = error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return out


def _die_in_construction(where: str) -> None:
    """SIGKILL this process inside ``rd.ResilientDDP(...)``: ``"sync"``: after the
    agreement check, just before DDP's initial sync (its shape check and state broadcast),
    which the others then run without it; ``"agreement"``: before the agreement check."""

    def die(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "sync":
        torch.nn.parallel.DistributedDataParallel._build_params_for_reducer = die  # type: ignore[method-assign]
    else:
        rd_ddp._check_agreement = die


def killed_in_construction(rank: int) -> dict[str, Any]:
    """Rank 2 is SIGKILLed inside ``rd.ResilientDDP(...)``, just before DDP's initial
    sync, which the others run without it."""
    _init()
    model = nn.Linear(8, 4)
    if rank == 2:
        _die_in_construction("sync")
    t0 = time.monotonic()
    try:
        # A survivor whose part of the broadcast did not need rank 2 completes the
        # construction; it names rank 2 in its first step at the latest.
        ddp = rd.ResilientDDP(model)
        ddp(torch.ones(2, 8)).sum().backward()
        return {"type": "no error"}
    except Exception as e:  # noqa: BLE001 - the test asserts which type it is
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


def killed_in_construction_shrink(rank: int, init_timeout_s: float, where: str) -> dict[str, Any]:
    """Rank 2 is SIGKILLed inside ``rd.ResilientDDP(...)`` (see :func:`_die_in_construction`)
    with ``on_failure="shrink"``, under a launcher that replaces the killed process once
    (``restarts=1``): the replacement asks to join."""
    faulthandler.dump_traceback_later(50, exit=True)
    joiner = os.environ.get("RESILIENT_DDP_JOINER") == "1"
    t0 = time.monotonic()
    cfg = {**CFG, "on_failure": "shrink", "init_timeout": init_timeout_s}
    try:
        rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))
        model = nn.Linear(8, 4)
        if rank == 2 and not joiner:
            _die_in_construction(where)
        ddp = rd.ResilientDDP(model)
        for _ in range(3):
            ddp(torch.ones(2, 8)).sum().backward()
        return {"type": "no error", "joiner": joiner, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test asserts which type it is
        return {**error_summary(e, t0), "joiner": joiner}
    finally:
        if rd.is_initialized():
            rd.destroy_process_group()


def construction_sync(rank: int, bucket_bytes: int) -> dict[str, Any]:
    """Each rank starts with its own weights and buffers; after ``rd.ResilientDDP(...)``
    every rank holds rank 0's (DDP's initial sync, in buckets of ``bucket_bytes``)."""
    _init()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank + 1))
    sync, send = (
        rd.ResilientDDP._rd_sync_initial_state,
        rd.ResilientDDP._default_broadcast_coalesced,
    )
    sends = []

    def small_buckets(self: Any, **kwargs: Any) -> None:
        self.broadcast_bucket_size = bucket_bytes
        sync(self, **kwargs)

    def counted(self: Any, bufs: Any = None, *args: Any, **kwargs: Any) -> None:
        sends.append(len(bufs or ()))
        send(self, bufs, *args, **kwargs)

    rd.ResilientDDP._rd_sync_initial_state = small_buckets  # type: ignore[method-assign]
    rd.ResilientDDP._default_broadcast_coalesced = counted  # type: ignore[method-assign]
    try:
        ddp = rd.ResilientDDP(model)
        state = {k: v.tolist() for k, v in ddp.module.state_dict().items()}
        return {"state": state, "sends": sends}
    finally:
        rd.destroy_process_group()
