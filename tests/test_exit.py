"""Processes not started by rd.spawn (torchrun-style) end cleanly after a peer failed.

Gloo objects of a failed group, destructed during interpreter teardown, block on a stopped
peer or abort the process (SIGABRT) on a dead one; the library's exit guard must prevent
both, and keep the exit code the program chose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("fault", "end", "code"),
    [("kill", "destroy", 0), ("kill", "return", 0), ("stop", "destroy", 0), ("stop", "exit3", 3)],
)
def test_survivors_exit_with_their_own_code(fault: str, end: str, code: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(3):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "RD_TEST_FAULT": fault,
            "RD_TEST_END": end,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", "from tests._workers import standalone_main as m; m()"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = {}
        deadline = time.monotonic() + 40
        for r in (0, 1):
            outs[r] = procs[r].communicate(timeout=max(1, deadline - time.monotonic()))[0]
        for r in (0, 1):
            assert f"rank {r} caught RankFailureError naming [2]" in outs[r] or (
                f"rank {r} caught CollectiveTimeoutError naming [2]" in outs[r]
            ), outs[r]
            assert procs[r].returncode == code, (r, procs[r].returncode, outs[r][-2000:])
            assert "terminate called" not in outs[r]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
