"""The one training script of the launcher matrix (tests/test_launchers_mp.py) and its entry
points, one per launcher.

:func:`train` is what a user writes: ``rd.init_process_group()`` with no argument (env://),
``rd.ResilientDDP(model)``, a plain loop. Nothing is configured in code: the test sets
``RESILIENT_DDP_*`` in the environment, as an operator would. Rank :data:`CULPRIT` injects
the fault at step :data:`FAULT_STEP` (before its forward pass, where a data loader would
be). The only test instrumentation is around it: every rank writes a start record (pid,
process start time) and a result record (the error it got, with the wall time), the
culprit a fault record (the wall time of the fault), all as JSON files in ``out_dir``.

Entry points: :func:`rd_spawn_main` (``resilient_ddp.tools.launch.launch``; the parent hosts the
store), :func:`mp_spawn_main` (``torch.multiprocessing.spawn``, set up as in PyTorch's DDP
tutorial; rank 0 hosts the store) and :func:`script_main` (tests/_launcher_script.py,
started by torchrun, whose agent hosts the store, or by ``subprocess.Popen`` with the
variables ``srun`` would set; rank 0 hosts the store).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# DDP's constructor imports torch._dynamo (1.5-3 CPU-s) between the rendezvous and its first
# broadcast, whose limit here is the operator's hard 3 s (RESILIENT_DDP_OP_TIMEOUT): under
# `nox -s stress` a starved rank arrived 3.2 s after its peers and was named in the
# constructor, before any fault. Imported before the rendezvous, which waits for every rank.
import torch._dynamo
from torch import nn

import resilient_ddp as rd

from ._workers import write_json

WORLD = 3
CULPRIT = 1
FAULT_STEP = 3
STEPS = 8
FAULTS = ("kill", "raise", "hang")
# A hang lasts longer than any test deadline: the rank must be made to end.
HANG_S = 300.0
# A rank still running after this long dumps every thread's stack and exits (code 1): a
# stuck test leaves evidence. Shorter than the tests' own deadlines.
DUMP_AFTER_S = 55.0


def _start_time() -> int:
    """This process's start time in clock ticks since boot (field 22 of /proc/self/stat):
    with the pid, it tells this process apart from a later one that reuses the pid."""
    stat = Path("/proc/self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def _error_record(rank: int, stage: str, e: BaseException) -> dict[str, Any]:
    return {
        "rank": rank,
        "stage": stage,
        "t_error": time.time(),
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "ranks": [int(r) for r in getattr(e, "ranks", ())],
        "message": str(e),
        "traceback": traceback.format_exc(),
    }


def _inject(fault: str, out: Path, step: int) -> None:
    write_json(out / "fault.json", {"kind": fault, "step": step, "t_fault": time.time()})
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise":
        raise ValueError(f"injected failure at step {step} on rank {CULPRIT}")
    if fault == "hang":
        time.sleep(HANG_S)  # stuck in user code, outside any collective


def train(out_dir: str, fault: str) -> None:
    """The user's training script; re-raises whatever ended it, after recording it."""
    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    # The test sends SIGUSR1 to a rank that is stuck long after the fault: every thread's
    # stack goes to the log (registered before the start record names this pid).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    write_json(
        out / f"start{rank}.json",
        {"rank": rank, "pid": os.getpid(), "start_time": _start_time(), "t": time.time()},
    )
    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)
    stage = "init"
    try:
        rd.init_process_group()
        torch.manual_seed(0)
        model = rd.ResilientDDP(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        stage = "train"
        for step in range(STEPS):
            if rank == CULPRIT and step == FAULT_STEP:
                _inject(fault, out, step)
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except BaseException as e:
        write_json(out / f"result{rank}.json", _error_record(rank, stage, e))
        raise
    write_json(out / f"result{rank}.json", {"rank": rank, "stage": "done", "type": None})
    rd.destroy_process_group()


def _redirect_output(out_dir: str, rank: int) -> None:
    """Send this process's stdout and stderr (fds 1 and 2) to ``out_dir/log{rank}.txt``, for
    the failure report (launchers that share the test's terminal would mix them)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(out_dir, f"log{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def rd_spawn_main(rank: int, out_dir: str, fault: str) -> None:
    """Under ``resilient_ddp.tools.launch.launch``: it set RANK, MASTER_PORT, ... already."""
    _redirect_output(out_dir, rank)
    train(out_dir, fault)


def started_from(rank: int) -> dict[str, Any]:
    """How ``rd.spawn`` started this rank: its parent's command line (a fork server's lists
    what it preloaded), and a variable the caller set just before the call."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    return {"rank": rank, "ppid": os.getppid(), "parent": parent, "late": os.environ.get("RD_LATE")}


def mp_spawn_main(rank: int, world_size: int, port: int, out_dir: str, fault: str) -> None:
    """Under ``torch.multiprocessing.spawn``, as PyTorch's DDP tutorial sets it up: its
    ``setup()`` sets MASTER_ADDR and MASTER_PORT (and here RANK and WORLD_SIZE, so that the
    user code's ``rd.init_process_group()`` needs no argument); rank 0 hosts the store."""
    _redirect_output(out_dir, rank)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    train(out_dir, fault)


def script_main() -> None:
    """``python tests/_launcher_script.py OUT_DIR FAULT`` under torchrun or as a plain
    process (the environment gives RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    out_dir, fault = sys.argv[1], sys.argv[2]
    _redirect_output(out_dir, int(os.environ["RANK"]))
    train(out_dir, fault)
