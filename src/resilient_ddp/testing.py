"""Helpers for testing code that uses resilient_ddp with real processes.

Never imported by the library itself.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from resilient_ddp.config import Duration
from resilient_ddp.errors import RankOutcome
from resilient_ddp.tools.launch import launch

__all__ = [
    "format_outcomes",
    "kill_self",
    "peak_rss_mib",
    "run_ranks",
    "set_start_method",
    "stop_self",
]

_START_METHODS = ("spawn", "forkserver", "fork")
_start_method = "spawn"


def set_start_method(method: str, *, preload: Sequence[str] = ()) -> None:
    """Choose how :func:`run_ranks` starts its processes when it is not told.

    ``"forkserver"`` with ``preload`` (e.g. ``["torch", "torch._dynamo", "resilient_ddp"]``)
    makes every rank a fork of one server process that imported those modules once: a rank
    starts in tens of milliseconds instead of the seconds that ``import torch`` takes. The
    server is started afresh by this process (not forked from it), holds no store
    connection and runs one thread, so each rank still starts as a fresh process would:
    no inherited threads, sockets, signal handlers or runtime. ``"spawn"`` (the default)
    starts a new interpreter per rank.

    Args:
        method: ``"spawn"``, ``"forkserver"`` or ``"fork"`` (``fork`` copies this process,
            threads and connections excepted: avoid it in a process that uses the store).
        preload: Modules the fork server imports once (``"forkserver"`` only).

    Raises:
        ValueError: An unknown method, or ``preload`` without ``"forkserver"``.
    """
    global _start_method
    if method not in _START_METHODS:
        raise ValueError(f"Argument method should be one of {_START_METHODS}, but given {method!r}")
    if preload and method != "forkserver":
        raise ValueError(f"preload applies to 'forkserver' only, but method is {method!r}")
    if preload:
        multiprocessing.set_forkserver_preload(list(preload))
    _start_method = method


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: Duration = timedelta(seconds=60),
    grace: Duration = timedelta(seconds=5),
    restarts: int = 0,
    start_method: str | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, *args)`` on ``world_size`` local processes, never raising.

    The parent hosts the store on a free port (``TCPStore(port=0)``). Blocks at most
    ``timeout``, and at most ``grace`` after the first failure (timedeltas or seconds);
    then kills what is left.

    With ``restarts``, failed processes are replaced by joiners (see
    :func:`resilient_ddp.spawn`). ``start_method`` defaults to the one chosen with
    :func:`set_start_method` (``"spawn"`` unless changed).

    Returns:
        How each rank ended, indexed by rank (with its traceback if it raised).
    """
    return launch(
        fn,
        world_size,
        args,
        timeout=timeout,
        grace=grace,
        restarts=restarts,
        start_method=start_method or _start_method,
    )


def format_outcomes(outcomes: Sequence[RankOutcome]) -> str:
    """A readable account of every rank's end, tracebacks included (for assert messages).

    With ``spawn(restarts=N)``, the processes each slot had before its last one (its
    ``previous`` outcomes) are listed under it, oldest first, with their tracebacks.
    """
    lines = []
    for o in outcomes:
        lines.append(f"--- rank {o.rank}: exitcode={o.exitcode} value={o.value!r}")
        if o.traceback:
            lines.append(o.traceback.rstrip())
        for i, p in enumerate(o.previous):
            what = f"raised {p.exc_type}" if p.exc_type else f"value={p.value!r}"
            lines.append(
                f"    rank {o.rank}, process {i + 1} of {len(o.previous) + 1}: "
                f"exitcode={p.exitcode} {what}"
            )
            if p.traceback:
                lines.extend("    " + line for line in p.traceback.rstrip().splitlines())
    return "\n".join(lines)


def kill_self() -> None:
    """Die at once by SIGKILL, as the OOM killer would do it."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover - not reached


def stop_self() -> None:
    """Freeze this whole process with SIGSTOP (every thread, the watchdog too)."""
    os.kill(os.getpid(), signal.SIGSTOP)


def peak_rss_mib(*, reset: bool = False) -> float:
    """This process's peak resident memory in MiB (Linux ``VmHWM``).

    Args:
        reset: Lower the peak to the present resident size first (``/proc/self/clear_refs``,
            Linux 4.0 and later), so that a later call measures from here.

    Unlike ``getrusage(RUSAGE_SELF).ru_maxrss``, which a process keeps across ``exec``
    (a rank started by ``spawn`` from a 700 MiB test runner begins at 700 MiB and shows
    no growth below that), ``VmHWM`` starts with the process's own memory. Where
    ``/proc`` cannot tell, ``ru_maxrss`` is returned. Never blocks, never raises.
    """
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
