"""The frameworks' own training, made resilient with the library's one or two lines, with
the real packages: Lightning's ``Trainer`` and ``Fabric`` (launched by Lightning: rank 0
starts the other ranks and hosts the store), Accelerate and the Hugging Face ``Trainer``
(under torchrun). The scripts are in tests/_framework_workers.py.

Each framework syncs the loss across ranks in every step (``self.log(..., sync_dist=True)``,
``fabric.all_reduce``, ``accelerator.reduce``, the Trainer's loss logging): a survivor
meets the fault there, in the framework's own call to torch, or in the backward pass.

Lightning's ``Trainer`` runs twice: launched by Lightning, and under torchrun (there with
a kill only: torchrun's raise and hang are the launcher matrix's, Lightning's the cases
launched by Lightning).

The promise checked (tests/_matrix.py, as for the launcher matrix): rank 1 is killed,
raises or hangs in its forward pass; every survivor raises the library's typed error naming
rank 1, within 3 s of the fault (kill, raise) or the op timeout set in the environment + 4 s
(hang); every process ends. A kill runs 3 ranks (two survivors, the store's host and
another); a raise and a hang run 2: each rank of a framework's job is a cold start
(Lightning's import alone is 4 s of CPU), and what the framework does with the error is the
same on every survivor. And a healthy run of 2 ranks gives, on every rank, the same losses
as the framework with its own DDP, bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import _launcher_workers as w
from ._matrix import (
    DEADLINE_S,
    ROOT,
    Run,
    attempt_dir,
    check,
    kill_everything,
    launch_command,
    operator_environment,
    read_record,
    report,
    run_for_json,
    stacks_of_stuck_ranks,
)

# Case -> (the script in tests/_framework_workers.py, the package it needs, how its job is
# started: by Lightning from one process, or by torchrun).
FRAMEWORKS = {
    "lightning": ("lightning", "lightning", "lightning"),
    "lightning-torchrun": ("lightning", "lightning", "torchrun"),
    "fabric": ("fabric", "lightning", "lightning"),
    "accelerate": ("accelerate", "accelerate", "torchrun"),
    "transformers": ("transformers", "transformers", "torchrun"),
}


def _command(
    framework: str, out: Path, fault: str, mode: str = "resilient", world: int = w.WORLD
) -> list[str]:
    """The job's command; ``world`` ranks (the scripts read it from ``RD_FW_WORLD`` in
    the environment, which the caller sets to the same number)."""
    script_name, _, launcher = FRAMEWORKS[framework]
    script = ["-m", "tests._framework_workers", script_name, str(out), fault, mode]
    if launcher == "lightning":
        # One process: Lightning starts the other ranks as copies of this command.
        return [sys.executable, *script]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--monitor-interval", "0.2", *script,
    ]  # fmt: skip


# The loss comparison's ranks: two ranks average their gradients as three do, and each
# run costs a cold start (imports of torch and the framework) less.
PARITY_WORLD = 2


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The operator's environment (see tests/_matrix.py)."""
    return operator_environment(monkeypatch)


def _needs(framework: str) -> None:
    """Skip without the framework (``nox -s tests`` installs them all). Not imported here:
    importing Lightning sets variables in this process's environment."""
    package = FRAMEWORKS[framework][1]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (nox -s tests installs it)")


# The fault cases: every framework with every fault, but Lightning's Trainer under torchrun
# with a kill only (see the module's docstring).
FAULT_CASES = [
    (framework, fault)
    for framework in FRAMEWORKS
    for fault in w.FAULTS
    if framework != "lightning-torchrun" or fault == "kill"
]


def _fault_world(fault: str) -> int:
    """The ranks of a fault case: 3 for a kill, 2 for a raise or a hang."""
    return w.WORLD if fault == "kill" else 2


@pytest.mark.parametrize(("framework", "fault"), FAULT_CASES)
def test_every_survivor_names_the_culprit(
    framework: str, fault: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    _needs(framework)
    deadline = time.monotonic() + DEADLINE_S
    run: Run | None = None
    world = _fault_world(fault)
    try:
        out = attempt_dir(tmp_path, 0)
        t_launch = time.time()
        with stacks_of_stuck_ranks(tmp_path):
            launcher = FRAMEWORKS[framework][2]
            run = launch_command(
                _command(framework, out, fault, world=world),
                out,
                {**operator_env, "RD_FW_WORLD": str(world)},
                deadline,
                launcher,
            )
        run.t_launch, run.t_returned = t_launch, time.time()
        if launcher == "lightning":
            run.codes[0] = run.handles[0].returncode  # rank 0 is the launched process
            run.kills_siblings = True
        problems, summary = check(framework, fault, run, world)
        print(json.dumps(summary))  # shown with -rP: timings, how the hung rank ended
        assert not problems, (
            f"{framework}/{fault}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems)
            + "\n"
            + report(run)
        )
    finally:
        kill_everything(tmp_path, run)


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "lightning-torchrun"])
def test_a_healthy_run_matches_the_framework_with_its_own_ddp(
    framework: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    _needs(framework)
    losses: dict[str, list[list[float]]] = {}
    try:
        for mode in ("plain", "resilient"):
            out = tmp_path / mode
            out.mkdir()
            proc = subprocess.run(
                _command(framework, out, "none", mode, PARITY_WORLD),
                env={**operator_env, "RD_FW_WORLD": str(PARITY_WORLD)},
                cwd=ROOT,
                capture_output=True,
                timeout=DEADLINE_S,
                check=False,
            )
            runs = [read_record(out / f"losses{r}.json") for r in range(PARITY_WORLD)]
            detail = report(Run(out, launcher=f"exit code {proc.returncode}"))
            # The framework with torch's DDP may abort at exit (gloo's teardown after the
            # losses were written; seen with Lightning): only its losses are compared.
            if mode == "resilient":
                assert proc.returncode == 0, detail
            assert all(r is not None for r in runs), detail
            losses[mode] = [r["losses"] for r in runs if r is not None]
        assert [len(x) for x in losses["resilient"]] == [w.STEPS] * PARITY_WORLD, losses
        assert losses["resilient"] == losses["plain"], losses
    finally:
        kill_everything(tmp_path, None)


def test_registered_names_and_what_is_refused(operator_env: dict[str, str]) -> None:
    _needs("lightning")
    code = (
        "import json; from tests._framework_workers import registry; print(json.dumps(registry()))"
    )
    found = run_for_json(["-c", code], operator_env, ROOT)
    for name, start in (("resilient_ddp", "popen"), ("resilient_ddp_spawn", "spawn")):
        assert found[name] == {
            "trainer": "resilient_ddp.integrations.lightning.ResilientDDPStrategy",
            "trainer_start": start,
            "fabric": "resilient_ddp.integrations.fabric.ResilientDDPStrategy",
            "fabric_start": start,
        }, found
    for key in ("lightning_shrink", "fabric_shrink", "env_shrink"):
        assert "on_failure='shrink' is not supported" in found[key], found
        assert "HINT" in found[key], found
