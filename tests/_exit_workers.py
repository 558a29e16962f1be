"""Ranks for tests/test_exit.py: how a process ends after the exit guard was armed.

Each survivor starts a non-daemon thread that writes ``thread{rank}`` in the output folder
after :data:`THREAD_DELAY_S`, then ends as its entry of the ends list says:

- ``raise3``: ``raise SystemExit(3)`` (never goes through ``sys.exit``);
- ``exit4``: ``sys.exit(4)``;
- ``quit5``: the ``exit(5)`` builtin (``site``'s, which raises ``SystemExit`` itself);
- ``raise``: an uncaught ``ValueError`` (Python exits 1);
- ``return``: a normal end (0).

The culprit (``culprit`` >= 0) kills or stops itself after one collective, so the
survivors see a failure (``RankFailureError``) and the library arms its exit guard.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import torch

import resilient_ddp as rd
from resilient_ddp.runtime import _exit_guard
from resilient_ddp.testing import kill_self, stop_self

THREAD_DELAY_S = 0.5
# A rank still running after this long dumps its stacks and exits: shorter than the tests'
# own deadlines, so a hang leaves evidence.
DUMP_AFTER_S = 50
# Expected exit code of each way to end.
CODES = {"raise3": 3, "exit4": 4, "quit5": 5, "raise": 1, "return": 0, "message": 1}
_CONFIG = {"op_timeout": 3.0, "heartbeat_interval": 0.2, "heartbeat_timeout": 6.0}


def _write_later(path: Path) -> None:
    time.sleep(THREAD_DELAY_S)
    path.write_text("written")


def _end(rank: int, end: str, out: Path) -> bool:
    """Start the late writer, then end as ``end`` says (see the module's docstring).

    Returns:
        Whether the exit guard is armed (for ``return``, the one end that returns).
    """
    threading.Thread(target=_write_later, args=(out / f"thread{rank}",), daemon=False).start()
    armed = _exit_guard.exit_guard_armed()
    print(f"rank {rank} ends by {end}; exit guard armed: {armed}", flush=True)
    if end == "raise3":
        raise SystemExit(3)
    if end == "exit4":
        sys.exit(4)
    if end == "quit5":
        exit(5)  # noqa: PLR1722 - the builtin is the point
    if end == "raise":
        raise ValueError(f"rank {rank} ends by an uncaught exception")
    if end == "message":
        sys.exit("a message instead of a code")
    if end == "interrupt":
        raise KeyboardInterrupt
    assert end == "return", end
    return _exit_guard.exit_guard_armed()


def run(rank: int, fault: str, culprit: int, ends: list[str], out_dir: str) -> bool:
    """One rank: init, one all_reduce, the culprit's fault, then :func:`_end`."""
    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**_CONFIG))
    rd.all_reduce(torch.ones(2))
    if rank == culprit:
        kill_self() if fault == "kill" else stop_self()
    if culprit >= 0:
        try:
            rd.all_reduce(torch.ones(2))
            rd.barrier()
        except rd.RankFailureError as e:
            print(f"rank {rank} caught {type(e).__name__} naming {list(e.ranks)}", flush=True)
    return _end(rank, ends[rank], Path(out_dir))


def standalone_main() -> None:
    """A rank started as ``srun`` would start it (RANK etc. in its environment); the test
    passes the fault, the culprit, the ends and the output folder in ``RD_EXIT_*``."""
    run(
        int(os.environ["RANK"]),
        os.environ["RD_EXIT_FAULT"],
        int(os.environ["RD_EXIT_CULPRIT"]),
        os.environ["RD_EXIT_ENDS"].split(","),
        os.environ["RD_EXIT_OUT"],
    )


def guard_only_main() -> None:
    """No process group: arm the exit guard directly, then end as ``RD_EXIT_END`` says.

    ``RD_EXIT_FORK_FAILS=1`` makes ``os.fork`` fail (the guard's fallback);
    ``RD_EXIT_SIGCHLD_IGNORED=1`` ignores SIGCHLD (children are reaped by the kernel).
    """
    import signal

    if os.environ.get("RD_EXIT_FORK_FAILS") == "1":

        def _no_fork() -> int:
            raise OSError("fork disabled by the test")

        os.fork = _no_fork
    if os.environ.get("RD_EXIT_SIGCHLD_IGNORED") == "1":
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    _exit_guard.arm_exit_guard()
    _end(0, os.environ["RD_EXIT_END"], Path(os.environ["RD_EXIT_OUT"]))
