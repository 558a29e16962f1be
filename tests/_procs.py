"""Helpers for the tests that start real torchrun agents (their workers run in sessions of
their own, so killing an agent's process group does not reach them)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def kill_named(out: Path) -> None:
    """SIGKILL every process whose command line names ``out`` (a test's folder: its
    agents, their workers and whatever else it started with that path)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(out) in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    """Poll ``predicate`` every 0.1 s: True once it holds, False after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False
