"""The library's clocks, in one place: wall time, monotonic time and sleeping.

Wall-clock time (:func:`wall`) is for timestamps that people read (event logs, records);
it may jump (NTP, an operator, a VM resumed) and differs between hosts, so nothing the
library decides across hosts is computed from it. Durations, deadlines and budgets use
:func:`monotonic` (this process's own clock, never exchanged as an instant): a peer's
heartbeat is judged by when this process saw it change, and a budget a peer publishes is
"seconds left as of that heartbeat", counted from when this process saw that heartbeat.

Tests move one process's wall clock with :func:`set_wall_offset` (a host whose clock is
ahead or behind) to show that no decision depends on it.
"""

from __future__ import annotations

import time

__all__: list[str] = []

_wall_offset = 0.0  # seconds added to time.time() (tests: a host whose clock is off)


def wall() -> float:
    """Wall-clock time in seconds since the epoch (``time.time()``, plus the offset a test
    set with :func:`set_wall_offset`). For timestamps only: never compare it with a time
    read on another host. Never blocks."""
    return time.time() + _wall_offset


def monotonic() -> float:
    """This process's monotonic clock in seconds (``time.monotonic()``): for durations and
    deadlines measured in this process only. Never blocks."""
    return time.monotonic()


def sleep(seconds: float) -> None:
    """Sleep ``seconds`` (at least 0). Blocks the calling thread for that long."""
    time.sleep(max(0.0, seconds))


def set_wall_offset(seconds: float) -> None:
    """Move this process's :func:`wall` clock by ``seconds`` (ahead if positive): for tests
    that show a host with a wrong clock changes no decision. Never blocks."""
    global _wall_offset
    _wall_offset = float(seconds)
