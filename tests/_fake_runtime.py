"""Fakes for the unit tests of the store wait loops: the parts of a ``Runtime`` they use,
and the waits of a fresh ``Backoff`` on a :class:`~resilient_ddp.base._clock.FakeClock`."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import Culprit

# A fresh Backoff of few ranks waits, by hand from POLL_FIRST_S = 5 ms growing by
# POLL_GROWTH = 1.5 a poll to POLL_MAX_S = 50 ms: 5, 7.5, 11.25, 16.875, 25.3125 and
# 37.96875 ms (103.90625 ms in all), then 50 ms each (test_wait_loops checks the constants).
RAMP = [0.005, 0.0075, 0.01125, 0.016875, 0.0253125, 0.03796875]


def backoff_waits(n: int) -> list[float]:
    """The first ``n`` waits of a fresh ``Backoff`` of few ranks, in seconds."""
    return (RAMP + [0.05] * max(0, n - len(RAMP)))[:n]


def fake_runtime(
    root: Any,
    world: int,
    rank: int = 0,
    dead: tuple[int, ...] = (),
    *,
    op_timeout: float = 5,
    interval: float = 0.2,
) -> Any:
    """The parts of a ``Runtime`` that the wait loops use; no watchdog: the failures it
    would have recorded are given (``dead``: crashed ranks)."""
    cfg = SimpleNamespace(
        op_timeout=timedelta(seconds=op_timeout),
        heartbeat_timeout=timedelta(seconds=5),
        heartbeat_interval=timedelta(seconds=interval),
        min_world_size=1,
    )
    return SimpleNamespace(
        rank=rank,
        world_size=world,
        generation=0,
        config=cfg,
        control_root=root,
        watchdog=None,
        lock=threading.RLock(),
        failures=[ctl.FailureEvent(ctl.EV_CRASH, 0, rank=r, culprit=Culprit(r)) for r in dead],
        left={},
    )
