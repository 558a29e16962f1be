"""Helpers for testing code that uses resilient_ddp with real processes.

Never imported by the library itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from .errors import RankOutcome
from .launch import launch

__all__ = ["format_outcomes", "kill_self", "run_ranks", "stop_self"]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: timedelta = timedelta(seconds=60),
    grace: timedelta = timedelta(seconds=5),
    restarts: int = 0,
) -> list[RankOutcome]:
    """Run ``fn(rank, *args)`` on ``world_size`` local processes, never raising.

    The parent hosts the store on a free port (``TCPStore(port=0)``). Blocks at most
    ``timeout``, and at most ``grace`` after the first failure; then kills what is left.

    With ``restarts``, failed processes are replaced by joiners (see
    :func:`resilient_ddp.spawn`).

    Returns:
        How each rank ended, indexed by rank (with its traceback if it raised).
    """
    return launch(fn, world_size, args, timeout=timeout, grace=grace, restarts=restarts)


def format_outcomes(outcomes: Sequence[RankOutcome]) -> str:
    """A readable account of every rank's end, tracebacks included (for assert messages)."""
    lines = []
    for o in outcomes:
        lines.append(f"--- rank {o.rank}: exitcode={o.exitcode} value={o.value!r}")
        if o.traceback:
            lines.append(o.traceback.rstrip())
    return "\n".join(lines)


def kill_self() -> None:
    """Die at once by SIGKILL, as the OOM killer would do it."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover - not reached


def stop_self() -> None:
    """Freeze this whole process with SIGSTOP (every thread, the watchdog too)."""
    os.kill(os.getpid(), signal.SIGSTOP)
