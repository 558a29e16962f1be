"""ResilientDDP with real gloo ranks: parity with DDP, and faults injected during training."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _ddp_workers as d

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}


def _values(fn: Any, world: int, *args: Any, ranks: list[int], grace: float = 10.0) -> dict:
    outcomes = run_ranks(
        fn, world, args, timeout=timedelta(seconds=45), grace=timedelta(seconds=grace)
    )
    report = format_outcomes(outcomes)
    for r in ranks:
        assert outcomes[r].exitcode == 0, report
    return {r: outcomes[r].value for r in ranks}


@pytest.mark.parametrize("mode", ["plain", "no_sync", "join", "hook", "amp", "checkpoint"])
def test_bitwise_parity_with_ddp(mode: str, tmp_path: Path) -> None:
    values = _values(d.parity, 3, mode, str(tmp_path), ranks=[0, 1, 2])
    for r, v in values.items():
        assert v["same"], (r, v)
        assert v["moved"], (r, v)
        if mode == "plain":
            assert v["isinstance"] is True
            assert v["module"] == "Sequential"


def test_parity_with_ddp_over_a_group_of_some_ranks() -> None:
    """ResilientDDP(process_group=a group of ranks 1 and 2): DDP passes the buffer
    broadcast's sender as a rank of that group (0), which the library once took for global
    rank 0, not in the group: the first forward raised ConfigError."""
    values = _values(d.subgroup_parity, 3, ranks=[0, 1, 2])
    assert values[0] == {"outside": True}, values
    for r in (1, 2):
        assert values[r]["same"], values
    # The buffers broadcast at the last forward came from rank 1, then each rank's own
    # batch moved them: they differ, as under DDP (same above).
    assert values[1]["running_mean"] != values[2]["running_mean"], values


# Every kind of fault at one point of the step; the other point of each is marked slow
# (skipped with --skip-slow; CI runs them all).
_SLOW = pytest.mark.slow
FAULTS = [
    pytest.param("kill", "forward", marks=_SLOW),
    ("kill", "backward"),
    ("raise", "forward"),
    pytest.param("raise", "backward", marks=_SLOW),
    ("sleep", "data"),
    pytest.param("sleep", "backward", marks=_SLOW),
    pytest.param("sigstop", "forward", marks=_SLOW),
    ("sigstop", "backward"),
]


@pytest.mark.parametrize(("kind", "where"), FAULTS)
def test_fault_during_training_is_named_on_every_survivor(kind: str, where: str) -> None:
    culprit = 2
    survivors = [0, 1, 3]
    grace = 2.0 if kind == "sigstop" else 10.0
    values = _values(d.fault_train, 4, kind, where, culprit, FAST, ranks=survivors, grace=grace)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert v["ranks"] == [culprit], v["message"]
        assert "RankFailureError" in v["mro"], v
        assert v["step"] == d.FAULT_STEP, v
        if kind in ("kill", "raise"):
            assert v["elapsed"] < 2.0, v
        else:
            assert v["type"] == "CollectiveTimeoutError", v
            assert v["elapsed"] < FAST["op_timeout"] + 2.0, v
        if kind == "raise":
            assert v["exc_type"] == "ValueError"
            assert "injected failure" in v["message"]
            # The culprit reports itself: the step it was in (ResilientDDP counts from 0).
            assert v["culprit_steps"] == [(d.FAULT_STEP, where)], v["message"]
        if kind == "sleep":
            assert "slow_data_loader" in v["stacks"][0], v["message"]
            phase = "data" if where == "data" else "backward"
            assert f"phase '{phase}'" in v["message"], v["message"]
            # Diagnosed from a heartbeat published with the stack, so fresh.
            assert v["culprit_steps"] == [(d.FAULT_STEP, phase)], v["message"]
        if kind == "sigstop":
            assert "stopped" in v["message"]


@pytest.mark.parametrize("kind", ["kill", "sigstop"])
def test_a_fault_at_ddps_bucket_rebuild_is_typed_and_bounded(kind: str) -> None:
    """DDP's forward after the first backward rebuilds the gradient buckets and agrees on
    them through a blocking broadcast that only the backend timeout bounds. A peer that
    dies there must still give our typed error (not gloo's RuntimeError) at once, and one
    that stops, within the op timeout (not a hang)."""
    culprit, survivors = 2, [0, 1]
    grace = 2.0 if kind == "sigstop" else 10.0
    values = _values(d.fault_train, 3, kind, "data", culprit, FAST, 1, ranks=survivors, grace=grace)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert "RankFailureError" in v["mro"], v
        assert v["ranks"] == [culprit], v["message"]
        assert v["step"] == 1, v
        limit = 2.0 if kind == "kill" else FAST["heartbeat_timeout"] + 2.0
        assert v["elapsed"] < limit, v


def test_one_batch_fewer_is_an_error_not_a_hang() -> None:
    values = _values(d.one_batch_fewer, 3, FAST, ranks=[0, 1, 2])
    assert values[1] == "no error"
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1], v["message"]
        assert "left the group" in v["message"]
        assert v["elapsed"] < 2.0


def test_mismatched_parameters_raise_preflight_error_with_table() -> None:
    values = _values(d.mismatched_params, 3, ranks=[0, 1, 2])
    for v in values.values():
        assert v["type"] == "PreflightError", v
        assert any("rank 1" in p and "(17, 8)" in p for p in v["problems"]), v["problems"]
        assert set(v["ptable"]) == {0, 1, 2}
        assert v["elapsed"] < 5.0


def test_section_budget_overrun_is_named_on_every_rank() -> None:
    values = _values(d.section_overrun, 3, ranks=[0, 1, 2])
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1], v["message"]
        assert "overran the 1.0 s budget of section 'eval'" in v["message"]
        assert "time.sleep(3)" in v["message"]  # where rank 1's main thread was
        assert v["elapsed"] < 1.0 + 1.5, v
    assert values[1]["type"] == "CollectiveTimeoutError"
    assert values[1]["ranks"] == [1]


def test_straggler_report_names_the_slow_rank() -> None:
    values = _values(d.straggler, 3, ranks=[0, 1, 2])
    for report in values.values():
        assert report["stragglers"] == [2], report
        assert report["compute_s"][2] > report["median_s"] + 0.1


def test_copies_behave_as_ddps_copies() -> None:
    """pickle, torch.save/torch.load of the whole model and copy.deepcopy give a working
    ResilientDDP, which trains on exactly as DDP's copy does."""
    values = _values(d.copies, 2, ranks=[0, 1])
    for r, v in values.items():
        assert v["steps_before"] == 2, (r, v)
        for how in ("pickle", "torch_save", "deepcopy"):
            row = v[how]
            assert row["type"] == "ResilientDDP", (r, how, row)
            assert row["isinstance_ddp"], (r, how, row)
            assert row["new_module"], (r, how, row)
            assert row["copied_params"], (r, how, row)
            assert row["same_state_keys"], (r, how, row)
            assert row["trained_like_ddp_copy"], (r, how, row)
            assert row["moved"], (r, how, row)
            assert row["original_untouched"], (r, how, row)
            # The copy counts on from the original's steps: 2 + its own 2.
            assert row["steps_after"] == 4, (r, how, row)
        assert v["original_trains_like_ddp"], (r, v)


def test_a_rank_dying_between_steps_is_named_in_its_new_step() -> None:
    """A rank killed at the start of step 3, well within one heartbeat interval of
    finishing step 2, is reported in step 3 and phase 'data', not with what its last
    regular beat said (step 2, or earlier). On its host a peer reads the culprit's board
    (rewritten at every change), so the report shows no age."""
    cfg = {"heartbeat_interval": 2.0, "heartbeat_timeout": 10.0, "op_timeout": 5.0}
    pause = 0.5
    values = _values(d.dies_between_steps, 2, cfg, 3, pause, ranks=[0])
    [culprit] = values[0]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, 3, "data"), culprit
    # Read from the board at the death, not from a heartbeat published before the pause.
    assert culprit["age"] is None, culprit  # shown without an age
