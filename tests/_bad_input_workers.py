"""Ranks that pass bad arguments to the library's calls (issue 29, item 10)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd


def _caught(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        return {
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
            "ranks": list(getattr(e, "ranks", ())),
            "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None,
            "elapsed": time.monotonic() - t0,
        }
    return {"type": None, "elapsed": time.monotonic() - t0}


class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def bad_arguments(rank: int, bad_rank: int) -> dict[str, Any]:
    """Each bad call in turn on every rank; the group stays usable between them (checked
    by an all_reduce after each)."""
    rd.init_process_group(
        "gloo", config=rd.ResilienceConfig(op_timeout=20.0, heartbeat_timeout=4.0)
    )
    out: dict[str, Any] = {}

    def healthy() -> float:
        return float(rd.all_reduce(torch.ones(1)).item())

    out["broadcast_src"] = _caught(lambda: rd.broadcast(torch.zeros(2), src=7))
    out["broadcast_object_src"] = _caught(lambda: rd.broadcast_object("x", src=-1))
    out["after_src"] = healthy()
    # A local function cannot be pickled (AttributeError: Can't pickle local object).
    unpicklable = (lambda: None) if rank == bad_rank else None
    out["all_gather_object"] = _caught(lambda: rd.all_gather_object({"f": unpicklable}))
    out["after_gather"] = healthy()
    out["broadcast_object"] = _caught(
        lambda: rd.broadcast_object(lambda: None if rank == bad_rank else 1, src=bad_rank)
    )
    out["after_broadcast"] = healthy()
    out["no_params"] = _caught(lambda: rd.ResilientDDP(_NoParams()))
    out["after_ddp"] = healthy()
    rd.destroy_process_group()
    return out
