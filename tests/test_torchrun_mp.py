"""resilient_ddp under real torchrun: the error files behind torchrun's closing summary, the
restart of a job whose rank hung (resumed from its snapshot), and the restart trap of a
group created by torch's own ``init_process_group``.

The torchrun jobs run tests/_torchrun_scripts/train_ddp.py, a DDP script as a user writes
it. Each job has a hard deadline below pytest-timeout; on any failure the whole process tree
is killed (tests/_procs.py) and every rank's output is shown.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import resilient_ddp as rd
from resilient_ddp.control import _torchelastic
from resilient_ddp.errors import Culprit
from tests._procs import kill_named
from tests._torchrun_scripts import train_ddp

SCRIPT = Path(train_ddp.__file__)
WORLD = 3
OP_TIMEOUT_S = 3.0
# "Within the op timeout and a few seconds": the op's last wait slice, the verdict through
# the store and the exception's way up, on a shared 2-core machine.
NAMING_SLACK_S = 4.0
# Each job's own deadline, well below pytest-timeout's 120 s: a hang fails here with every
# rank's output rather than with a bare timeout.
DEADLINE_S = 90.0


@dataclass
class Job:
    """How one torchrun job ended: its exit code (``None`` if it overran the deadline), the
    agent's output (with the closing summary) and its ``--log-dir``."""

    returncode: int | None
    output: str
    logs: Path

    def error(self, attempt: int, rank: int) -> dict[str, Any] | None:
        """The error file a worker of ``attempt`` left (local rank = rank: one node)."""
        found = list(self.logs.glob(f"*/attempt_{attempt}/{rank}/error.json"))
        return json.loads(found[0].read_text()) if found else None

    def error_path(self, attempt: int, rank: int) -> Path:
        return next(self.logs.glob(f"*/attempt_{attempt}/{rank}/error.json"))

    def stdout(self, attempt: int, rank: int) -> str:
        found = list(self.logs.glob(f"*/attempt_{attempt}/{rank}/stdout.log"))
        return found[0].read_text(errors="replace") if found else ""

    def report(self) -> str:
        """Every rank's output of every attempt, then the agent's: for failure messages."""
        parts = [
            f"--- {p.relative_to(self.logs)}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.glob("*/attempt_*/*/*"))
        ]
        return "\n".join([*parts, f"--- torchrun (rc {self.returncode})\n{self.output[-6000:]}"])


def run_torchrun(
    tmp_path: Path, *args: str, restarts: int, env: dict[str, str], deadline: float = DEADLINE_S
) -> Job:
    """Run train_ddp.py under torchrun, 3 workers on one node, and wait for it.

    The rendezvous store is one this test hosts on a free port (``TCPStore(port=0)``, as
    the other torchrun tests do) with ``is_host=0``: no port is picked and then released.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
        "--max-restarts", str(restarts), "--monitor-interval", "0.2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-conf", "is_host=0", "--log-dir", str(logs), "--redirects", "3",
        str(SCRIPT), str(out), *args,
    ]  # fmt: skip
    # Only what this test sets: no resilient_ddp setting or torchrun variable of the caller.
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_DDP", "TORCHELASTIC"))
    }
    agent_log = tmp_path / "torchrun.log"
    with agent_log.open("w") as log:
        proc = subprocess.Popen(
            cmd, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        try:
            returncode: int | None = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            # The agent and its workers (sessions of their own): all name tmp_path.
            kill_named(tmp_path)
            proc.wait()
    return Job(returncode, agent_log.read_text(errors="replace"), logs)


def expected_state() -> dict[str, torch.Tensor]:
    """train_ddp's model after all its steps without any fault, computed in one process:
    DDP's gradient is the mean of the ranks' gradients."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=train_ddp.LR, momentum=train_ddp.MOMENTUM)
    for step in range(train_ddp.STEPS):
        losses = [
            nn.functional.mse_loss(model(x), y)
            for x, y in (train_ddp.batch(step, r) for r in range(WORLD))
        ]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def summary_of(job: Job, attempt: int) -> str:
    """torchrun's closing summary for ``attempt``, built by torch's own code from the
    workers' error files, exactly as the agent builds it when no restart is left."""
    failures = {
        rank: ProcessFailure(
            local_rank=rank, pid=0, exitcode=1, error_file=str(job.error_path(attempt, rank))
        )
        for rank in range(WORLD)
    }
    return ChildFailedError("train_ddp.py", failures).format_msg()


def root_cause(summary: str) -> str:
    return summary.split("Root Cause (first observed failure):", 1)[1]


@pytest.mark.torchrun
def test_a_hung_rank_is_named_and_torchrun_resumes_from_the_snapshot(tmp_path: Path) -> None:
    """The issue's proof: the README's two lines, RESILIENT_DDP_OP_TIMEOUT in the
    environment, --max-restarts 1. Rank 2 hangs at step 6 of attempt 0; the survivors name
    it within the op timeout, the stuck rank is told, torchrun restarts, every rank resumes
    from the step-4 snapshot and training completes with the model of a run without fault."""
    hang_rank, hang_step = 2, 6
    t0 = time.monotonic()
    job = run_torchrun(
        tmp_path,
        restarts=1,
        env={
            "RESILIENT_DDP_OP_TIMEOUT": f"{OP_TIMEOUT_S:g}s",
            "FAULT": "hang",
            "FAULT_RANK": str(hang_rank),
            "FAULT_STEP": str(hang_step),
        },
    )
    elapsed = time.monotonic() - t0
    report = job.report()
    assert job.returncode == 0, report

    hung = re.search(r"hangs at step \d+, t=([\d.]+)", job.stdout(0, hang_rank))
    assert hung is not None, report
    hung_at = float(hung.group(1))
    for rank in (0, 1):
        err = job.error(0, rank)
        assert err is not None, f"rank {rank} left no error file\n{report}"
        message = err["message"]["message"]
        assert message.startswith("resilient_ddp.CollectiveTimeoutError: "), message
        assert f"culprit rank(s): {hang_rank}" in message, message
        assert f"rank {hang_rank} (host" in message, message
        assert f"step {hang_step}" in message, message
        waited = re.search(r"timed out after ([\d.]+) s", message)
        assert waited is not None, message
        assert OP_TIMEOUT_S <= float(waited.group(1)) <= OP_TIMEOUT_S + NAMING_SLACK_S, message
        # When it was raised: the error file is written by the rank's excepthook.
        named_after = job.error_path(0, rank).stat().st_mtime - hung_at
        assert named_after <= OP_TIMEOUT_S + NAMING_SLACK_S, (named_after, report)

    # The stuck rank itself is told: it raises the same typed error rather than being
    # killed by torchrun's SIGTERM.
    err = job.error(0, hang_rank)
    assert err is not None, f"the hung rank left no error file\n{report}"
    told = err["message"]["message"]
    assert told.startswith("resilient_ddp.CollectiveTimeoutError: "), told
    assert f"rank {hang_rank} (host" in told, told

    # The summary torchrun would print for that attempt names the hung rank as the cause.
    cause = root_cause(summary_of(job, 0))
    assert "resilient_ddp.CollectiveTimeoutError" in cause, cause
    assert f"rank {hang_rank} (host" in cause, cause
    assert "To enable traceback" not in cause, cause

    # Attempt 1 resumed from the last snapshot and finished every step, on every rank.
    last_snapshot = hang_step // train_ddp.SAVE_EVERY * train_ddp.SAVE_EVERY
    finals = [json.loads((tmp_path / "out" / f"final{r}.json").read_text()) for r in range(3)]
    for rank, final in enumerate(finals):
        assert f"rank {rank}: resumed from step {last_snapshot}" in job.stdout(1, rank), report
        assert (final["start"], final["steps"]) == (last_snapshot, train_ddp.STEPS), final
        assert final["state"] == finals[0]["state"], "ranks disagree"
    want = expected_state()
    for name, value in finals[0]["state"].items():
        torch.testing.assert_close(torch.tensor(value), want[name], rtol=1e-5, atol=1e-6)
    print(f"torchrun job with one restart: {elapsed:.1f} s")


@pytest.mark.slow
@pytest.mark.torchrun
def test_torchruns_summary_shows_the_culprits_exception_as_root_cause(tmp_path: Path) -> None:
    """No restart left: torchrun prints its summary. Rank 2 raised ValueError first: it is
    the root cause with its own traceback; the survivors' entries are our typed errors
    naming rank 2, none of them the bare "To enable traceback" of a worker without an
    error file."""
    job = run_torchrun(
        tmp_path,
        restarts=0,
        env={"FAULT": "raise", "FAULT_RANK": "2", "FAULT_STEP": "3"},
    )
    report = job.report()
    assert job.returncode not in (0, None), report
    summary = job.output[job.output.rindex("Failures:") :]
    cause = root_cause(summary)
    assert "rank      : 2 (local_rank: 2)" in cause, summary
    assert "ValueError: bad batch at step 3" in cause, summary
    assert "To enable traceback" not in summary, summary
    failures = summary.split("Root Cause", 1)[0]
    for rank in (0, 1):
        assert f"rank      : {rank} (local_rank: {rank})" in failures, summary
    assert failures.count("resilient_ddp.RankFailureError") == 2, summary
    assert failures.count("failed rank(s): 2") == 2, summary


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_plain_torch_init_survives_torchruns_restart(tmp_path: Path) -> None:
    """Measured before: with the user's own dist.init_process_group("gloo"), torchrun's restarted
    attempt failed in gloo's connectFullMesh (it read the dead attempt's addresses from the
    agent's store). The last rank to attach now deletes those keys; the job completes."""
    job = run_torchrun(
        tmp_path,
        "--plain-init",
        restarts=1,
        env={"FAULT": "raise", "FAULT_RANK": "2", "FAULT_STEP": "3"},
        deadline=60.0,
    )
    report = job.report()
    assert job.returncode == 0, report
    for rank in range(WORLD):
        final = json.loads((tmp_path / "out" / f"final{rank}.json").read_text())
        assert final["steps"] == train_ddp.STEPS, final
    assert "torch.distributed.init_process_group(): after a restart" not in report, report


@pytest.mark.torchrun
def test_a_script_that_sets_master_port_is_told_to_remove_the_line(tmp_path: Path) -> None:
    """Issue 30: PyTorch's DDP tutorial sets MASTER_PORT=12355 in the script. Under torchrun
    every rank would wait on that empty port for init_timeout (300 s) and then ask whether
    rank 0 runs; a rank names the line within 10 s instead. (torchrun stops the others when
    the first one exits: a rank still importing torch then never gets to say it.)"""
    job = run_torchrun(tmp_path, "--tutorial-port", restarts=0, env={}, deadline=60.0)
    report = job.report()
    assert job.returncode not in (0, None), report
    told = 0
    for rank in range(WORLD):
        (stderr,) = job.logs.glob(f"*/attempt_0/{rank}/stderr.log")
        text = stderr.read_text(errors="replace")
        if "PreflightError" not in text:
            continue
        told += 1
        assert "PreflightError: The rendezvous environment of this process is not usable" in (
            text
        ), report
        assert "the script sets MASTER_PORT=12355, but torchrun's rendezvous store is at " in (
            text
        ), report
        assert "remove os.environ['MASTER_PORT'] = ..." in text, report
        took = re.search(r"init ended after ([0-9.]+) s", job.stdout(0, rank))
        assert took is not None, report
        assert float(took.group(1)) < 10.0, report
    assert told >= 1, report


@pytest.mark.torchrun
def test_a_rank_killed_between_fast_steps_is_named_in_its_step(tmp_path: Path) -> None:
    """Issue 30: train_ddp's steps take about a millisecond, so the last heartbeat of a
    rank SIGKILLed at step 5 showed an earlier step. Its peers' watchdogs on its host read
    its board: step 5, phase 'data' (it dies before its forward pass), and no age. (A
    survivor that torchrun's SIGTERM reaches before it learnt of the death writes no
    error; at least one does.)"""
    job = run_torchrun(
        tmp_path,
        restarts=0,
        env={"FAULT": "kill", "FAULT_RANK": "1", "FAULT_STEP": "5"},
        deadline=60.0,
    )
    report = job.report()
    assert job.returncode not in (0, None), report
    named = [
        error["message"]["message"]
        for error in (job.error(0, rank) for rank in (0, 2))
        if error is not None and "rank 1 (host" in error["message"]["message"]
    ]
    assert named, report
    for message in named:
        line = next(x for x in message.splitlines() if x.startswith("rank 1 (host"))
        assert re.search(r"\) (died|was killed by SIGKILL)", line), report
        assert "[step 5, phase 'data', last op ddp_bucket0#" in line, report
        assert "as of" not in line, report


# -- the error file, read by torch's own parser ---------------------------------------------


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as e:  # noqa: BLE001  (the point is to give it a traceback)
        return e


def _failure_of(rank: int, exc: Exception, path: Path) -> ProcessFailure:
    _torchelastic.record_error_file(_raised(exc))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def _peer_failed(culprit: int) -> rd.RankFailureError:
    return rd.RankFailureError(
        f"ddp_bucket0#8 on rank 0 (generation 0) cannot complete; failed rank(s): {culprit}\n"
        f"rank {culprit} (host h, pid 7) raised ValueError [step 4, phase 'data']",
        culprits=[Culprit(rank=culprit, host="h", pid=7, what="raised ValueError", step=4)],
    )


def test_the_error_file_is_what_torchruns_summary_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    failure = _failure_of(0, _peer_failed(2), path)
    summary = ChildFailedError("train.py", {0: failure}).format_msg()
    assert "resilient_ddp.RankFailureError: ddp_bucket0#8 on rank 0" in summary, summary
    assert "rank 2 (host h, pid 7) raised ValueError [step 4" in summary, summary
    assert "in _raised" in summary, summary  # the traceback
    assert "To enable traceback" not in summary, summary
    assert failure.error_file == str(path)
    assert not list(tmp_path.glob("*.tmp")), "the temporary file stayed"


def test_the_first_failure_stays_the_root_cause_within_one_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun stamps failures in whole seconds and a tie goes to the lowest rank: a
    survivor (rank 0) that reports rank 2's failure in the same second is stamped with the
    next second, so rank 2's own exception is the root cause."""
    monkeypatch.setattr(time, "time", lambda: 1000.25)
    failures = {}
    for rank, exc in ((0, _peer_failed(2)), (1, _peer_failed(2)), (2, ValueError("bad"))):
        path = tmp_path / f"error{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setenv("RANK", str(rank))
        failures[rank] = _failure_of(rank, exc, path)
    assert [failures[r].timestamp for r in range(3)] == [1001, 1001, 1000]
    assert ChildFailedError("train.py", failures).get_first_failure()[0] == 2
    # A rank that is itself a culprit (the stuck rank, told) keeps its own second.
    path = tmp_path / "told.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert _failure_of(2, _peer_failed(2), path).timestamp == 1000


def test_the_error_file_keeps_the_first_word_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": "written by torch\'s @record"}')
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    _torchelastic.record_error_file(_raised(ValueError("later")))
    assert json.loads(path.read_text()) == {"message": "written by torch's @record"}

    path.unlink()
    _torchelastic.record_error_file(KeyboardInterrupt())  # torch's @record skips it too
    assert not path.exists()

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing" / "error.json"))
    _torchelastic.record_error_file(_raised(ValueError("cannot be written")))  # no raise

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    _torchelastic.record_error_file(_raised(ValueError("not under torchrun")))
    assert list(tmp_path.iterdir()) == []


# -- the plain-init restart trap ------------------------------------------------------------

_UNDER_TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_MAX_RESTARTS": "1",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.fixture
def plain_group(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    """A one-rank gloo group made by torch's own init over a store this test holds (as the
    agent's store under torchrun), with torchrun's variables of a job with restarts."""
    for k, v in _UNDER_TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(_torchelastic, "_attempt_namespaced", False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return store


def _gloo_keys(store: dist.TCPStore) -> list[str]:
    return [k for k in store.list_keys() if "//cpu//" in k]


def test_the_plain_init_trap_is_defused_when_the_control_plane_is_per_attempt(
    plain_group: dist.TCPStore,
) -> None:
    assert _gloo_keys(plain_group), "gloo's address keys were expected in the store"
    root = dist.distributed_c10d._get_default_store()
    assert _torchelastic.attempt_namespace(root) is not root
    assert _torchelastic.plain_init_restart_hint() is None
    assert _gloo_keys(plain_group) == []


def test_the_plain_init_trap_is_only_warned_of_while_the_control_plane_is_shared(
    plain_group: dist.TCPStore,
) -> None:
    hint = _torchelastic.plain_init_restart_hint()
    assert hint is not None
    assert "resilient_ddp.init_process_group()" in hint
    assert _gloo_keys(plain_group), "keys deleted although the restart would still fail"


def test_no_warning_without_restarts_or_without_the_agents_store(
    plain_group: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert _torchelastic.plain_init_restart_hint() is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 hosts a fresh store
    assert _torchelastic.plain_init_restart_hint() is None
    store = dist.distributed_c10d._get_default_store()
    assert _torchelastic.attempt_namespace(store) is store
    assert _gloo_keys(plain_group), "keys deleted without a shared store"
