"""This process's board: its step, phase and last op in a small file in shared memory.

A heartbeat carries them too, but only as of its last publication (a store round trip);
the board is rewritten at every change (about 0.5 us), and outlives the process, so that a
peer or a launcher on this host that finds the process dead or stopped reads what it was
doing when it stopped (:func:`read_board`, :func:`with_board`). Written by
:class:`resilient_ddp.runtime._runtime.Runtime`; removed by the launcher (:func:`remove_boards`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import mmap
import os
import secrets
import struct
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from resilient_ddp.control import _control as ctl

_BOARD_PREFIX = "resilient_ddp-board-"
_BOARD_GC_AGE_S = 120.0  # a dead process's board older than this is removed by the next one
_TEXT = 63  # bytes of the phase and of the op name kept on the board


class _Board:
    """This process's step, phase and last op in a small file in shared memory
    (``/dev/shm`` where it exists), rewritten in place at every change.

    The training thread writes one packed record per change (about 0.5 us: no system
    call, no store round trip); the page outlives the process, so a peer or the launcher
    on the same host that finds the process gone (SIGKILL, the OOM killer) or stopped reads
    exactly what it was doing. The record starts and ends with the same counter: a reader
    that finds them different (a write cut short) ignores the record.
    """

    RECORD = struct.Struct(f"<QqqdB{_TEXT}s{_TEXT}sQ")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._map = mmap.mmap(fd, self.RECORD.size)
        self._count = 0
        self._pid = os.getpid()

    @classmethod
    def create(cls) -> _Board | None:
        """A new board for this process (``None`` where no file can be made)."""
        folder = board_folder()
        path = os.path.join(folder, f"{_BOARD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, cls.RECORD.size)
            board = cls(path, fd)
        except (OSError, ValueError):
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        _collect_boards(folder)
        return board

    def write(self, step: int, seq: int, op: str, phase: str, in_op: bool) -> None:
        """Record the current state (the training thread, at every change)."""
        if os.getpid() != self._pid:
            return  # a forked child (a data loader worker) is not this rank
        self._count += 1
        try:  # noqa: SIM105 - on every change: contextlib.suppress would double the cost
            self.RECORD.pack_into(
                self._map,
                0,
                self._count,
                step,
                seq,
                time.time(),
                in_op,
                phase.encode(errors="replace")[:_TEXT],
                op.encode(errors="replace")[:_TEXT],
                self._count,
            )
        except (ValueError, TypeError):
            pass  # closed at exit (atexit) while a thread still runs: nothing to tell

    def close(self) -> None:
        """Remove the board (this process ends)."""
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(OSError, ValueError):
            self._map.close()
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_process_board: list[_Board | None] = []  # created on first use; one for the process


def process_board() -> _Board | None:
    """This process's board, created on first use (``None`` where none can be made)."""
    if not _process_board or (
        _process_board[0] is not None and _process_board[0]._pid != os.getpid()
    ):
        _process_board[:] = [_Board.create()]
        board = _process_board[0]
        if board is not None:
            atexit.register(board.close)
    return _process_board[0]


def board_folder() -> str:
    """Where boards are: ``/dev/shm`` (memory, on Linux), else the temporary folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _collect_boards(folder: str) -> None:
    """Remove the boards of processes killed long ago (a SIGKILLed rank cannot remove its
    own; its peers read it first, within seconds)."""
    now = time.time()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_BOARD_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_BOARD_PREFIX) :].split("-", 1)[0]
        path = os.path.join(folder, name)
        try:
            if not pid.isdigit() or ctl.process_state(int(pid)) is not None:
                continue
            if now - os.stat(path).st_mtime > _BOARD_GC_AGE_S:
                os.unlink(path)
        except OSError:
            continue


def remove_boards(pids: Iterator[int] | Sequence[int]) -> None:
    """Remove the boards of the processes ``pids`` (a launcher, once they ended)."""
    folder = board_folder()
    wanted = {str(pid) for pid in pids}
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(_BOARD_PREFIX) and name[len(_BOARD_PREFIX) :].split("-")[0] in wanted:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def read_board(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """The step, phase and op that the process of ``info`` (a rank's published identity)
    last wrote to its board: ``{"step", "seq", "op", "phase", "in_op", "t"}``, or ``None``
    when it has no board on this host or the record is unreadable."""
    path = (info or {}).get("board")
    if not isinstance(path, str) or not os.path.basename(path).startswith(_BOARD_PREFIX):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(_Board.RECORD.size)
        first, step, seq, t, in_op, phase, op, last = _Board.RECORD.unpack(raw)
    except (OSError, struct.error):
        return None
    if first != last or first == 0:
        return None
    return {
        "step": step,
        "seq": seq,
        "op": op.rstrip(b"\0").decode(errors="replace"),
        "phase": phase.rstrip(b"\0").decode(errors="replace"),
        "in_op": bool(in_op),
        "t": t,
    }


def with_board(state: ctl.HeartbeatState | None, info: dict[str, Any] | None) -> ctl.HeartbeatState:
    """``state`` (a rank's last heartbeat; ``None``: none, read as an empty one) with the
    step, phase and op of its board when this host can read it (a copy: the state is
    frozen): for a process that is gone or stopped, what it was doing when it stopped,
    not as of its last heartbeat.

    The board holds the process's latest state whenever it was written (its ``t`` is the
    time of the last change, which may be older than the heartbeat's, published since
    without a change). The result's ``t`` is now: nothing newer can have happened in a
    process that no longer runs, so a report shows no age (``state_age``); ``board``
    marks it.
    """
    state = state if state is not None else ctl.HeartbeatState()
    board = read_board(info)
    if board is None:
        return state
    return dataclasses.replace(
        state,
        step=board["step"],
        seq=board["seq"],
        op=board["op"],
        phase=board["phase"],
        in_op=board["in_op"],
        t=time.time(),
        board=True,
    )
