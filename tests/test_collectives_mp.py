"""Multi-process tests: real gloo ranks, faults injected on purpose.

Each test spawns ranks with ``rd.testing.run_ranks`` (the parent hosts the store on a free
port), has a hard deadline shorter than pytest-timeout, and on failure shows every rank's
traceback. Bounds come from issue 2: a crash or raise is known on every rank within 2 s, a
stall within the op timeout + 2 s, a silent process within the heartbeat timeout + 2 s, a
divergence with validation on within 2 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _workers as w

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}
DEADLINE = timedelta(seconds=45)


def _run(fn: Any, world: int, *args: Any, grace: float = 10.0) -> list[Any]:
    """Run ``fn`` on ``world`` ranks; ``grace``: how long the others may take to end after
    the first failure (a stalled rank needs long enough to wake up and see the error)."""
    return run_ranks(fn, world, args, timeout=DEADLINE, grace=timedelta(seconds=grace))


def _values(outcomes: list[Any], ranks: list[int]) -> dict[int, Any]:
    report = format_outcomes(outcomes)
    for r in ranks:
        assert outcomes[r].exitcode == 0, report
    return {r: outcomes[r].value for r in ranks}


def test_every_collective_healthy() -> None:
    world = 3
    outcomes = _run(w.healthy, world, world)
    values = _values(outcomes, list(range(world)))
    for op in w.OPS:
        for r in range(world):
            assert values[r][op] == w.expected(op, world), (op, r)


@pytest.mark.parametrize("op", w.OPS)
@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_dead_rank_is_named_on_every_rank_within_2s(kind: str, op: str) -> None:
    outcomes = _run(w.fault, 3, op, kind, 2, FAST)
    survivors = _values(outcomes, [0, 1])
    for r, v in survivors.items():
        assert isinstance(v, dict), (r, v, format_outcomes(outcomes))
        assert v["type"] == "RankFailureError", v["message"]
        assert v["ranks"] == [2], v["message"]
        assert v["hosts"]
        assert v["hosts"][0] != "?"
        assert v["op"] in (op, "barrier")
        assert v["elapsed"] < 2.0, v
        if kind == "raise":
            assert v["exc_type"] == "ValueError"
            assert v["exc_message"] == "injected failure on the culprit"
            assert "raise ValueError" in v["message"]
        else:
            assert "SIGKILL" in v["message"] or "is gone" in v["message"]
    if kind == "kill":
        assert outcomes[2].exitcode == -9
    else:
        assert outcomes[2].exc_type == "ValueError"


@pytest.mark.parametrize("op", w.OPS)
def test_stalled_rank_is_named_with_its_stack(op: str) -> None:
    outcomes = _run(w.fault, 3, op, "sleep", 1, FAST)
    values = _values(outcomes, [0, 2])
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "CollectiveTimeoutError", v
        assert {"RankFailureError", "TimeoutError"} <= set(v["mro"])
        assert v["ranks"] == [1], v["message"]
        assert v["elapsed"] < FAST["op_timeout"] + 2.0, (r, v["elapsed"], v["message"])
        assert "slow_data_loader" in v["stacks"][0], v["message"]
        assert "phase 'data'" in v["message"]
    # The stalled rank is told: the peers' verdict is raised in its main thread, from
    # inside the sleep it was stuck in, not when it comes back.
    stalled = outcomes[1]
    report = format_outcomes(outcomes)
    assert stalled.exc_type == "resilient_ddp.CollectiveTimeoutError", report
    assert "is stuck" in (stalled.exc_message or ""), report
    assert "slow_data_loader" in (stalled.traceback or ""), report


def test_a_stuck_rank_is_diagnosed_once_and_every_survivor_names_it() -> None:
    """The survivors of a stuck rank all time out at about the same moment; one of them
    diagnoses (asks every rank for its stack) and the others take its verdict: one
    diagnosis request in all, not one per survivor (each reading every rank's state), which
    made a stuck rank cost O(W^2) store requests."""
    outcomes = _run(w.stuck_rank_diagnosed_once, 4, 3, FAST)
    values = _values(outcomes, [0, 1, 2])
    report = format_outcomes(outcomes)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v, report)
        assert v["ranks"] == [3], v["message"]
        assert "slow_data_loader" in v["stacks"][0], v["message"]
        assert v["elapsed"] < FAST["op_timeout"] + 2.0, (r, v["elapsed"], v["message"])
    assert max(v["diagnoses"] for v in values.values()) == 1, report


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_object"])
def test_sigstopped_rank_is_named_within_op_timeout(op: str) -> None:
    outcomes = _run(w.fault, 3, op, "sigstop", 2, FAST, grace=2)
    values = _values(outcomes, [0, 1])
    for v in values.values():
        assert v["type"] == "CollectiveTimeoutError", v
        assert v["ranks"] == [2]
        assert "stopped" in v["message"], v["message"]
        assert v["elapsed"] < FAST["op_timeout"] + 2.0
    assert outcomes[2].exitcode is None  # frozen until the launcher killed it


def test_silent_process_is_declared_dead_by_heartbeat() -> None:
    # The op timeout is far away: only the heartbeat can detect the frozen rank in time.
    cfg = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "op_timeout": 30.0}
    outcomes = _run(w.fault, 3, "all_reduce", "sigstop", 1, cfg, grace=2)
    values = _values(outcomes, [0, 2])
    for v in values.values():
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1]
        assert v["elapsed"] < cfg["heartbeat_timeout"] + 2.0, v
        assert "heartbeat" in v["message"] or "stopped" in v["message"]


@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "skip"])
def test_divergence_with_validation_raises_mismatch_on_every_rank(kind: str) -> None:
    outcomes = _run(w.diverge, 3, kind, True, FAST)
    values = _values(outcomes, [0, 1, 2])
    for v in values.values():
        assert v["type"] == "CollectiveMismatchError", v
        assert v["ranks"] == [1], v["message"]
        assert v["elapsed"] < 2.0
        assert set(v["table"]) == {0, 1, 2}
    table = values[0]["table"]
    if kind == "shape":
        assert table[1]["shape"] == "(5,)"
        assert table[0]["shape"] == "(4,)"
    if kind == "dtype":
        assert table[1]["dtype"] == "float64"
        assert table[0]["dtype"] == "float32"
    if kind == "op":
        assert table[1]["op"] == "broadcast"
        assert table[0]["op"] == "all_reduce"
    if kind == "skip":
        assert table[1]["shape"] == "(2,)"


def test_divergence_without_validation_is_bounded_and_names_the_rank() -> None:
    outcomes = _run(w.diverge, 3, "op", False, FAST)
    values = _values(outcomes, [0, 1, 2])
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "CollectiveTimeoutError", v
        assert v["ranks"] == [1], v["message"]
        assert "broadcast" in v["message"]
        assert v["elapsed"] < FAST["op_timeout"] + 2.0


def test_uneven_batches_end_in_an_error_not_a_hang() -> None:
    outcomes = _run(w.uneven_batches, 3, FAST)
    values = _values(outcomes, [0, 1, 2])
    assert values[1] == "no error"
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1]
        assert "left the group after op #3" in v["message"]
        assert v["elapsed"] < 2.0


def test_late_rank_within_budget_completes_on_the_same_handle() -> None:
    cfg = {**FAST, "op_timeout": 1.0, "op_budget": 8.0}
    outcomes = _run(w.late_rank, 3, 2.5, cfg)
    values = _values(outcomes, [0, 1, 2])
    for v in values.values():
        assert v == {"value": [6.0, 6.0, 6.0], "after": 3.0}


def test_late_rank_past_budget_times_out() -> None:
    cfg = {**FAST, "op_timeout": 1.0, "op_budget": 2.0}
    outcomes = _run(w.fault, 3, "all_reduce", "sleep", 2, {**cfg, "op_timeout": 1.0})
    values = _values(outcomes, [0, 1])
    for v in values.values():
        assert v["type"] == "CollectiveTimeoutError"
        assert 2.0 <= v["elapsed"] < 2.0 + 2.0, v


def test_lost_op_is_retried_as_a_group_without_double_reduction() -> None:
    cfg = {**FAST, "op_timeout": 1.0, "op_budget": 10.0}
    outcomes = _run(w.lost_op, 3, 2, cfg)
    values = _values(outcomes, [0, 1, 2])
    for v in values.values():
        assert v == {"value": [6.0, 6.0, 6.0], "after": 3.0, "generation": 1}, v


def test_lost_op_without_retry_is_a_typed_error() -> None:
    cfg = {**FAST, "op_timeout": 1.0}
    outcomes = _run(w.lost_op, 3, 1, cfg)
    values = _values(outcomes, [0, 1, 2])
    for v in values.values():
        assert v["type"] == "CollectiveTimeoutError", v
        assert v["ranks"] == []


def test_a_group_forms_after_a_failed_attempt_in_one_of_its_processes() -> None:
    """torch counts a failed ``init_process_group``'s group: without undoing that, the
    next attempt of that process rendezvouses under another name than its peers'."""
    outcomes = _run(w.rebuild_after_a_failed_attempt, 2, FAST)
    values = _values(outcomes, [0, 1])
    for v in values.values():
        assert v == {"first": "RankFailureError", "sum": 2.0, "gen": 6}, v


def test_attaches_to_a_plain_torch_process_group() -> None:
    outcomes = _run(w.plain_torch_init, 3, "kill")
    values = _values(outcomes, [0, 1])
    for v in values.values():
        assert v["type"] == "RankFailureError"
        assert v["ranks"] == [2]
        assert v["elapsed"] < 2.0


@pytest.mark.torchrun
def test_under_real_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    tests_dir = Path(__file__).resolve().parent
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests_dir.parent)!r})\n"
        "from tests._workers import torchrun_main\n"
        "torchrun_main()\n"
    )
    # Not TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: it makes rank 0 host the store, which then
    # dies with rank 0 (the control plane must outlive every rank).
    env = dict(os.environ)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "--monitor-interval", "0.2", str(script), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r, res in results.items():
        assert res["value"] == [6.0, 6.0, 6.0], (r, proc.stderr[-3000:])
        err = res["error"]
        assert err["type"] == "CollectiveTimeoutError", err
        assert err["ranks"] == [2]
        assert "slow_data_loader" in err["stacks"][0]
