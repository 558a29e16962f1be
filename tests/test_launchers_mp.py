"""The launcher matrix of issue 13: the same training script under four launchers, with
three faults on rank 1 of 3.

Launchers, by who hosts the store (the control plane):

- ``rd_spawn``: ``resilient_ddp.tools.launch.launch`` (through ``rd.testing.run_ranks``, so
  started as conftest's ``--rank-start`` says); the test process (the parent) hosts it.
- ``torchrun``: ``python -m torch.distributed.run --standalone``; the agent hosts it.
- ``mp_spawn``: ``torch.multiprocessing.spawn`` set up as in PyTorch's DDP tutorial
  (MASTER_ADDR/MASTER_PORT set in the rank); rank 0 hosts it.
- ``popen``: three plain ``subprocess.Popen`` processes with RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT in their environment, as ``srun`` starts them; rank 0 hosts
  it.

Faults, at step :data:`~tests._launcher_workers.FAULT_STEP` of a small ``rd.ResilientDDP``
loop (tests/_launcher_workers.py, the same user code for every launcher): ``kill``
(SIGKILL itself), ``raise`` (ValueError in user code), ``hang`` (``time.sleep`` outside
any collective). The library is configured from the environment only, as an operator
would: ``RESILIENT_DDP_OP_TIMEOUT=3s``.

The promise checked, per case: each survivor (ranks 0 and 2) raises ``RankFailureError``
(``CollectiveTimeoutError`` for a hang) naming ``[1]``, within 3 s of the fault (kill,
raise) or the op timeout + 4 s (hang); the hung rank raises our error naming itself or
exits with the library's distinct code (which one is printed); every process ends; every
exit code a launcher reports is non-zero. All problems of a case are reported together,
with every rank's record and output.

Ports: torchrun's agent and ``rd.spawn``'s parent bind port 0 themselves (no race). When
rank 0 hosts the store, the test must name a port before rank 0 binds it: it takes one from
``TCPStore(port=0)`` and frees it, which leaves a window in which another process on the
machine may take it. Rank 0 then fails its init with "MASTER_PORT ... already in use"
(PreflightError, before any fault): that attempt is discarded and the case starts again on
a new port (at most :data:`PORT_ATTEMPTS` times, within the same deadline).

Repeat mode: ``RD_LAUNCHER_REPEAT=20`` runs the rank-0-hosted kill and raise cases
(``mp_spawn``, ``popen``) 20 times each (default 1), e.g.
``RD_LAUNCHER_REPEAT=20 pytest tests/test_launchers_mp.py -k "mp_spawn or popen"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from resilient_ddp.testing import run_ranks
from resilient_ddp.tools.launch import FORK_SERVER_PRELOAD

from . import _launcher_workers as w
from ._matrix import (
    DEADLINE_S,
    ROOT,
    Run,
    attempt_dir,
    check,
    kill_everything,
    kill_handles,
    launch_command,
    operator_environment,
    read_record,
    report,
    run_for_json,
    stacks_of_stuck_ranks,
)

SCRIPT = Path(__file__).resolve().parent / "_launcher_script.py"

LAUNCHERS = ("rd_spawn", "torchrun", "mp_spawn", "popen")
RANK0_HOSTED = ("mp_spawn", "popen")
# rd.spawn: how long the others may take to end after the first failure.
RD_SPAWN_GRACE_S = 20.0
PORT_ATTEMPTS = 3

REPEAT = int(os.environ.get("RD_LAUNCHER_REPEAT", "1"))


def _cases() -> list[Any]:
    cases = []
    for launcher in LAUNCHERS:
        for fault in w.FAULTS:
            n = REPEAT if launcher in RANK0_HOSTED and fault in ("kill", "raise") else 1
            marks = [pytest.mark.torchrun] if launcher == "torchrun" else []
            for i in range(n):
                name = f"{launcher}-{fault}" + (f"-{i}" if n > 1 else "")
                cases.append(pytest.param(launcher, fault, id=name, marks=marks))
    return cases


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The operator's environment (see tests/_matrix.py)."""
    return operator_environment(monkeypatch)


@pytest.mark.parametrize(("launcher", "fault"), _cases())
def test_every_survivor_names_the_culprit(
    launcher: str, fault: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    deadline = time.monotonic() + DEADLINE_S
    run: Run | None = None
    try:
        t_launch = time.time()
        with stacks_of_stuck_ranks(tmp_path):
            run = _LAUNCH[launcher](tmp_path, fault, operator_env, deadline)
        run.t_launch, run.t_returned = t_launch, time.time()
        problems, summary = check(launcher, fault, run)
        print(json.dumps(summary))  # shown with -rP: which way the hung rank ended, timings
        assert not problems, (
            f"{launcher}/{fault}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems)
            + "\n"
            + report(run)
        )
    finally:
        kill_everything(tmp_path, run)


# -- launchers -------------------------------------------------------------------------------
def _free_port() -> int:
    """A port that was free a moment ago (see the module docstring for the window)."""
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(probe.port)
    del probe  # the last reference: the server closes and rank 0 may bind the port
    return port


def _port_taken(out: Path) -> bool:
    """Whether rank 0 of this attempt could not host the store: its port was taken."""
    res = read_record(out / "result0.json")
    return bool(res and res.get("stage") == "init" and "already in use" in res["message"])


def _launch_rd_spawn(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    out = attempt_dir(tmp_path, 0)
    # resilient_ddp.tools.launch.launch, starting the ranks as the session chose (conftest's
    # --rank-start: forks of a server that imported torch, or spawn for a cold start).
    outcomes = run_ranks(
        w.rd_spawn_main,
        w.WORLD,
        (str(out), fault),
        timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        grace=timedelta(seconds=RD_SPAWN_GRACE_S),
    )
    run = Run(out)
    for o in outcomes:
        run.codes[o.rank] = o.exitcode
    run.launcher = "; ".join(
        f"rank {o.rank}: exitcode={o.exitcode} exc={o.exc_type}: {o.exc_message}" for o in outcomes
    )
    run.launcher_ok = any(not o.ok for o in outcomes)
    run.deadline_hit = time.monotonic() >= deadline
    return run


def _launch_torchrun(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    out = attempt_dir(tmp_path, 0)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(w.WORLD), "--monitor-interval", "0.2",
        str(SCRIPT), str(out), fault,
    ]  # fmt: skip
    return launch_command(cmd, out, env, deadline, "torchrun")


def _launch_mp_spawn(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    for attempt in range(PORT_ATTEMPTS):
        out = attempt_dir(tmp_path, attempt)
        run = Run(out, attempts=attempt + 1)
        ctx = torch_mp.spawn(
            w.mp_spawn_main,
            args=(w.WORLD, _free_port(), str(out), fault),
            nprocs=w.WORLD,
            join=False,
        )
        run.handles.extend(ctx.processes)
        run.launcher = "mp.spawn returned"
        run.launcher_ok = False
        try:
            # As join=True does, but with a deadline. After a failure, join() sends SIGTERM
            # to the others and waits for them (up to 30 s) before it raises.
            while not ctx.join(timeout=0.5):
                if time.monotonic() >= deadline:
                    run.deadline_hit = True
                    run.launcher = "deadline: mp.spawn had not returned"
                    break
        except (torch_mp.ProcessExitedException, torch_mp.ProcessRaisedException) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            tail = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            run.launcher = (
                f"{type(e).__name__} (error_index={e.error_index}): {first_line} ... {tail}"
            )
            run.launcher_ok = True
        for p in ctx.processes:
            p.join(0.1)
            run.codes[ctx.processes.index(p)] = p.exitcode
        if not _port_taken(out) or attempt == PORT_ATTEMPTS - 1:
            return run
        kill_handles(run.handles)
    raise AssertionError("not reached")  # pragma: no cover


def _launch_popen(tmp_path: Path, fault: str, env: dict[str, str], deadline: float) -> Run:
    for attempt in range(PORT_ATTEMPTS):
        out = attempt_dir(tmp_path, attempt)
        run = Run(out, attempts=attempt + 1)
        port = _free_port()
        for rank in range(w.WORLD):
            rank_env = {
                **env,
                "RANK": str(rank),
                "WORLD_SIZE": str(w.WORLD),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            # The rank's own log (it appends there itself once started); the child keeps
            # its own copy of the descriptor.
            with (out / f"log{rank}.txt").open("ab") as log:
                run.handles.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), str(out), fault],
                        cwd=ROOT,
                        env=rank_env,
                        stdout=log,
                        stderr=log,
                    )
                )
        taken = False
        while any(p.poll() is None for p in run.handles):
            if time.monotonic() >= deadline:
                run.deadline_hit = True
                break
            taken = _port_taken(out)
            if taken:
                break
            time.sleep(0.1)
        taken = taken or _port_taken(out)
        if taken and attempt < PORT_ATTEMPTS - 1:
            kill_handles(run.handles)
            continue
        for rank, p in enumerate(run.handles):
            run.codes[rank] = p.poll()
        run.launcher = "return codes " + str([p.poll() for p in run.handles])
        return run
    raise AssertionError("not reached")  # pragma: no cover


_LAUNCH = {
    "rd_spawn": _launch_rd_spawn,
    "torchrun": _launch_torchrun,
    "mp_spawn": _launch_mp_spawn,
    "popen": _launch_popen,
}


# A user's script: its ranks are rd.spawn's default; the caller may have chosen what the
# fork server preloads.
_STARTED_FROM_SCRIPT = """
import json, multiprocessing, os, sys
import resilient_ddp as rd
from tests._launcher_workers import started_from

if __name__ == "__main__":
    if sys.argv[1:]:
        multiprocessing.set_forkserver_preload(sys.argv[1:])
    os.environ["RD_LATE"] = "set just before the call"
    print(json.dumps({"caller": os.getpid(), "ranks": rd.spawn(started_from, 2)}))
"""


@pytest.mark.parametrize("preload", [[], ["json"]], ids=["default", "callers_preload"])
def test_rd_spawns_ranks_fork_from_a_server_that_imported_torch(
    preload: list[str], operator_env: dict[str, str], tmp_path: Path
) -> None:
    """``rd.spawn``'s default start: each rank is a child of a fork server (not of the
    caller) that imported torch, torch._dynamo and the library once, unless the caller
    chose the server's preload itself; either way a rank gets the caller's environment as
    it is at the call."""
    script = tmp_path / "job.py"
    script.write_text(_STARTED_FROM_SCRIPT)
    found = run_for_json(
        [str(script), *preload], {**operator_env, "PYTHONPATH": str(ROOT)}, tmp_path
    )
    ranks = found["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1], found
    expected = repr(preload or list(FORK_SERVER_PRELOAD))
    for r in ranks:
        assert r["ppid"] != found["caller"], found
        assert "multiprocessing.forkserver" in r["parent"], r
        assert expected in r["parent"], r
        assert r["late"] == "set just before the call", r
