"""The library's clocks, in one place: wall time, monotonic time and sleeping.

Wall-clock time (:func:`wall`) is for timestamps that people read (event logs, records);
it may jump (NTP, an operator, a VM resumed) and differs between hosts, so nothing the
library decides across hosts is computed from it. Durations, deadlines and budgets use
:func:`monotonic` (this process's own clock, never exchanged as an instant): a peer's
heartbeat is judged by when this process saw it change, and a budget a peer publishes is
"seconds left as of that heartbeat", counted from when this process saw that heartbeat.

Tests move one process's wall clock with :func:`set_wall_offset` (a host whose clock is
ahead or behind) to show that no decision depends on it.

The wait loops (``_control.Backoff`` and the store polls that use it) read
:func:`monotonic` and call :func:`sleep`, which go to the :class:`Clock` in use: the real
one (:data:`REAL`), or for a test, a :class:`FakeClock` installed with :func:`use`, whose
sleeps advance its time at once and are recorded, so that a test counts polls exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

__all__: list[str] = []

_wall_offset = 0.0  # seconds added to time.time() (tests: a host whose clock is off)


class Clock(Protocol):
    """Where the wait loops read the time and sleep."""

    def monotonic(self) -> float:
        """A monotonic time in seconds (an instant of this process only). Never blocks."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a negative value counts as 0)."""
        ...


class _RealClock:
    """``time.monotonic`` and ``time.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


REAL: Clock = _RealClock()
_current: Clock = REAL


class FakeClock:
    """A clock for tests: :meth:`sleep` blocks not at all; it records the wait, advances
    :attr:`now` by it, then runs the actions scheduled (:meth:`at`) up to the new time, in
    time order. Starts at ``start`` seconds.

    Raises:
        RuntimeError: on a sleep after ``max_sleeps`` sleeps (a loop that never ends).
    """

    def __init__(self, start: float = 1000.0, *, max_sleeps: int = 100_000) -> None:
        self.now = float(start)
        self.waits: list[float] = []  # every sleep's seconds, in order
        self.max_sleeps = max_sleeps
        self._actions: list[tuple[float, int, Callable[[], object]]] = []
        self._scheduled = 0  # actions scheduled so far: their order among equal times
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        """:attr:`now`, in seconds. Never blocks."""
        return self.now

    def sleep(self, seconds: float) -> None:
        """Record ``seconds`` (a negative value as 0) in :attr:`waits`, advance :attr:`now`
        by it and run the actions now due, in the calling thread. Blocks only while they
        run; raises what an action raises."""
        with self._lock:
            if len(self.waits) >= self.max_sleeps:
                raise RuntimeError(f"FakeClock: more than {self.max_sleeps} sleeps")
            seconds = max(0.0, seconds)
            self.waits.append(seconds)
            self.now += seconds
            due = sorted((a for a in self._actions if a[0] <= self.now), key=lambda a: a[:2])
            self._actions = [a for a in self._actions if a[0] > self.now]
        for _, _, action in due:
            action()

    def at(self, when: float, action: Callable[[], object]) -> None:
        """Run ``action`` in the first sleep that reaches ``when`` (seconds on this clock),
        after the time moved; actions due together run in the order given."""
        with self._lock:
            self._actions.append((when, self._scheduled, action))
            self._scheduled += 1

    @property
    def pending(self) -> int:
        """How many scheduled actions have not run yet."""
        return len(self._actions)

    def after(self, seconds: float, action: Callable[[], object]) -> None:
        """Run ``action`` in the first sleep that reaches ``seconds`` from now."""
        self.at(self.now + seconds, action)


_C = TypeVar("_C", bound=Clock)


@contextmanager
def use(clock: _C) -> Iterator[_C]:
    """Make ``clock`` the one :func:`monotonic` and :func:`sleep` use, in every thread,
    until the block ends (then the one in use before it). For tests."""
    global _current
    before, _current = _current, clock
    try:
        yield clock
    finally:
        _current = before


def wall() -> float:
    """Wall-clock time in seconds since the epoch (``time.time()``, plus the offset a test
    set with :func:`set_wall_offset`). For timestamps only: never compare it with a time
    read on another host. Never blocks."""
    return time.time() + _wall_offset


def monotonic() -> float:
    """This process's monotonic clock in seconds (``time.monotonic()``, or the clock a test
    installed with :func:`use`): for durations and deadlines measured in this process only.
    Never blocks."""
    return _current.monotonic()


def sleep(seconds: float) -> None:
    """Sleep ``seconds`` (at least 0) on the clock in use. Blocks the calling thread for
    that long (a :class:`FakeClock` blocks not at all)."""
    _current.sleep(seconds)


def set_wall_offset(seconds: float) -> None:
    """Move this process's :func:`wall` clock by ``seconds`` (ahead if positive): for tests
    that show a host with a wrong clock changes no decision. Never blocks."""
    global _wall_offset
    _wall_offset = float(seconds)
