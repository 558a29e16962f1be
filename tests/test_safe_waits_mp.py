"""Waits that stay safe (issue 29): real gloo ranks on CPU.

Item 8: a rank whose wall clock is off (45 s or an hour ahead, or behind) changes no
decision: a peer's ``rd.section`` budget is waited out past ``op_timeout``, nobody is
named dead or stuck, and a real kill is still named within ``heartbeat_timeout``.

Item 9: a rank killed inside ``rd.ResilientDDP(...)`` (during DDP's initial sync) is named
by the survivors with our ``RankFailureError``, not a raw gloo error.

Each test has a hard deadline under pytest-timeout's 120 s and asserts every rank's
outcome.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _safe_waits_workers as w

DEADLINE = timedelta(seconds=60)


def _values(outcomes: list[Any], ranks: list[int]) -> dict[int, Any]:
    report = format_outcomes(outcomes)
    for r in ranks:
        assert outcomes[r].exitcode == 0, report
    return {r: outcomes[r].value for r in ranks}


@pytest.mark.parametrize("offset_s", [45.0, 3600.0])
def test_a_wall_clock_off_changes_no_decision(offset_s: float) -> None:
    outcomes = run_ranks(w.clock_offset, 3, (offset_s,), timeout=DEADLINE)
    values = _values(outcomes, [0, 2])
    for r, v in values.items():
        # The section's budget was waited out (op_timeout alone would have failed it).
        assert v["section_value"] == 3.0, (r, v)
        assert v["section_waited"] >= w.BUSY_S - 0.5, (r, v)
        kill = v["kill"]
        assert isinstance(kill, dict), (r, v)
        assert kill["type"] == "RankFailureError", (r, kill)
        assert kill["ranks"] == [1], (r, kill)
        assert kill["elapsed"] < w.CFG["heartbeat_timeout"] + 2.0, (r, kill)


def test_a_rank_killed_in_construction_is_named() -> None:
    outcomes = run_ranks(w.killed_in_construction, 3, (), timeout=DEADLINE)
    values = _values(outcomes, [0, 1])
    for r, v in values.items():
        assert v["type"] == "RankFailureError", (r, v)
        assert v["ranks"] == [2], (r, v)
        assert v["elapsed"] < w.CFG["heartbeat_timeout"] + 2.0, (r, v)


def test_a_replacement_does_not_wait_for_a_job_that_failed_in_construction() -> None:
    """on_failure="shrink", rd.spawn's restarts=1: rank 2 dies before the construction's
    agreement check, so both others fail inside ResilientDDP(...) (no recovery there).
    Its replacement gives up at once, with a PreflightError saying why."""
    # init_timeout past the test's deadline: a replacement that waited it out fails here.
    init_timeout = 100.0
    outcomes = run_ranks(
        w.killed_in_construction_shrink,
        3,
        (init_timeout, "agreement"),
        timeout=DEADLINE,
        grace=timedelta(seconds=20),  # the replacement's start-up (imports) on a busy machine
        restarts=1,
    )
    values = _values(outcomes, [0, 1, 2])
    for r in (0, 1):
        v = values[r]
        assert not v["joiner"], (r, v)
        assert v["type"] == "RankFailureError", (r, v)
        assert v["ranks"] == [2], (r, v)
        assert v["elapsed"] < w.CFG["heartbeat_timeout"] + 5.0, (r, v)
    joiner = values[2]
    assert joiner["joiner"], joiner
    assert joiner["type"] == "PreflightError", joiner
    assert "failed before admitting it" in joiner["message"], joiner
    assert joiner["elapsed"] < 10.0, joiner
    assert len(outcomes[2].previous) == 1, format_outcomes(outcomes)  # the killed one
