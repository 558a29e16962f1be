"""Naming types and formatting stacks and tracebacks for the library's reports: which
frames are the library's own (elided from a culprit's stack), and which exceptions come
from torch.distributed's backend. Pure functions of their arguments."""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from types import FrameType, TracebackType

import torch
import torch.distributed

from resilient_ddp.errors import ResilientDDPError

# The package's folder: this module is in its base/ folder. Every module under it is the
# library's own (tests/test_progress_unit.py checks this for each one).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# rd.spawn's wrapper around a rank's function (tools/launch.py): its frames tell a reader
# of a culprit's stack nothing.
_LAUNCH_FILE = os.path.join(_PACKAGE_DIR, "tools", "launch.py")
_THREADING_FILE = os.path.abspath(threading.__file__)
_MULTIPROCESSING_DIR = os.path.dirname(os.path.abspath(multiprocessing.__file__))


def qualname(cls: type) -> str:
    """``module.Class`` (bare for builtins and ``__main__``), as reports name types."""
    mod = cls.__module__
    return cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"


# Modules of ours that run user-facing code (the demo, test helpers): never elided. By
# path, as _LAUNCH_FILE: a suffix would also match any other module ending in one.
_USER_FACING = frozenset(
    os.path.join(_PACKAGE_DIR, *parts) for parts in (("tools", "_demo.py"), ("testing.py",))
)


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path == _THREADING_FILE:
        return True
    return _is_ours(path)


def _is_ours(filename: str) -> bool:
    """Whether ``filename`` is one of the library's modules (not a user-facing one)."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) and path not in _USER_FACING


def format_stack(frame: FrameType, depth: int) -> str:
    """Innermost ``depth`` frames of ``frame``, our own and threading's waits elided."""
    # Launcher frames (multiprocessing, our spawn wrapper) tell the reader nothing.
    frames = [
        f
        for f in traceback.extract_stack(frame)
        if f.filename != "<string>"
        and not os.path.abspath(f.filename).startswith(_MULTIPROCESSING_DIR)
        and os.path.abspath(f.filename) != _LAUNCH_FILE
    ]
    inside = ""
    while frames and _is_internal(frames[-1].filename):
        inside = f"  (inside resilient_ddp: {frames[-1].name})"
        frames.pop()
    text = "".join(traceback.format_list(frames[-depth:])).rstrip("\n")
    return text + ("\n" + inside if inside else "")


def format_tb_summary(tb: TracebackType | None, depth: int) -> str:
    if tb is None:
        return ""
    frames = traceback.extract_tb(tb)
    return "".join(traceback.format_list(frames[-depth:])).rstrip("\n")


def _is_backend_error(exc: BaseException) -> bool:
    if isinstance(exc, ResilientDDPError):
        return False  # ours are DistErrors too (drop-in), but never a backend's
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(os.sep + os.path.join("torch", "distributed") + os.sep in f.filename for f in frames)
