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

import functools
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from resilient_ddp.base import _clock
from resilient_ddp.control._control import HeartbeatState
from resilient_ddp.detection import _store_diagnosis
from resilient_ddp.runtime import _runtime
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


# -- unit tables: what the decisions above are computed from (no process, no store) -------
class _Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("their_wall_offset", [0.0, 45.0, 3600.0, -3600.0])
@pytest.mark.parametrize(
    ("section_left", "seen_ago", "busy_left"),
    [(10.0, 0.0, 10.0), (10.0, 4.0, 6.0), (10.0, 12.0, 0.0), (0.5, 0.2, 0.3)],
)
def test_a_section_budget_is_seconds_left_on_the_observers_clock(
    monkeypatch: pytest.MonkeyPatch,
    their_wall_offset: float,
    section_left: float,
    seen_ago: float,
    busy_left: float,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_clock, "monotonic", clock)
    beat = HeartbeatState(beat=7, t=time.time() + their_wall_offset, section_left=section_left)
    extra = _store_diagnosis._culprit_extra(
        beat, beat, silent_s=seen_ago, seen=clock.now - seen_ago
    )
    assert extra["busy_left"] == pytest.approx(busy_left)
    assert extra["state_age"] == pytest.approx(seen_ago)
    assert "busy_until" not in extra


def test_a_heartbeat_is_aged_from_when_this_process_saw_it_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_clock, "monotonic", clock)
    rt = SimpleNamespace(generation=0, _beats_seen={}, _beats_lock=threading.Lock())
    note = functools.partial(_runtime.Runtime.note_beat, rt)
    age = functools.partial(_runtime.Runtime.beat_age, rt)
    assert age(1) == 0.0  # never seen
    # Its wall-clock "t" (an hour off) plays no part: only its beat counter.
    assert note(1, HeartbeatState(beat=3, t=time.time() - 3600)) == 1000.0
    clock.now += 2.0
    assert note(1, HeartbeatState(beat=3, t=time.time() + 3600)) == 1000.0  # the same beat
    assert age(1) == pytest.approx(2.0)
    clock.now += 1.0
    assert note(1, HeartbeatState(beat=4, t=0.0)) == 1003.0  # it changed: fresh again
    assert age(1) == 0.0
    clock.now += 5.0
    assert age(1) == pytest.approx(5.0)
    rt.generation = 1  # a new generation's rank 1 is another process
    assert age(1) == 0.0


class _States:
    def __init__(self, states: dict[int, HeartbeatState]) -> None:
        self.states = states

    def read_states(self, ranks: list[int]) -> dict[int, HeartbeatState]:
        return {r: self.states[r] for r in ranks if r in self.states}


@pytest.mark.parametrize(
    ("verdict", "author_state", "stale"),
    [
        ({"by": 0, "beat": 10}, {"beat": 10}, False),
        ({"by": 0, "beat": 10}, {"beat": 15}, False),  # 2.5 s later (0.5 s beats)
        ({"by": 0, "beat": 10}, {"beat": 16}, False),  # 3 s: heartbeat_timeout itself
        ({"by": 0, "beat": 10}, {"beat": 17}, True),  # 3.5 s: older than heartbeat_timeout
        ({"by": 0, "beat": 10}, {"beat": -1}, False),  # it left since (beat -1)
        ({"by": 0}, {"beat": 10}, True),  # no beat (no watchdog): diagnose here
        ({"by": 0, "beat": "x"}, {"beat": 10}, True),  # garbage
        ({"by": 0, "beat": 10}, None, True),  # its state is gone
        ({"by": "0", "beat": 10}, {"beat": 10}, True),
    ],
)
def test_a_shared_verdict_is_aged_in_its_authors_heartbeats(
    verdict: dict[str, Any], author_state: dict[str, Any] | None, stale: bool
) -> None:
    from resilient_ddp import ResilienceConfig

    cfg = ResilienceConfig(heartbeat_interval=0.5, heartbeat_timeout=3)
    rt = SimpleNamespace(config=cfg)
    control = _States({} if author_state is None else {0: HeartbeatState(**author_state)})
    verdict = {**verdict, "t": time.time() + 3600}  # its wall clock plays no part
    assert _store_diagnosis.verdict_stale(rt, control, verdict) is stale  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("culprits", "taken"),
    [
        ([{"rank": 1}], [1]),
        ([{"rank": 1}, {"rank": 2}], [1]),  # the reader arrived since: not its own culprit
        ([{"rank": 2}], None),  # only the reader was named: it diagnoses itself
        ([], []),  # nobody late (the op completed meanwhile)
        ("x", None),  # garbage: diagnosed here
        ([{"rank": 1}, "x"], [1]),
    ],
)
def test_a_shared_verdict_never_names_its_reader(culprits: Any, taken: list[int] | None) -> None:
    got = _store_diagnosis.culprits_for_reader({"by": 0, "culprits": culprits}, 2)
    assert (None if got is None else [c["rank"] for c in got]) == taken


def test_the_wall_clock_offset_moves_wall_only() -> None:
    try:
        _clock.set_wall_offset(3600.0)
        assert _clock.wall() - time.time() == pytest.approx(3600.0, abs=1.0)
        assert abs(_clock.monotonic() - time.monotonic()) < 1.0
    finally:
        _clock.set_wall_offset(0.0)
    assert _clock.wall() == pytest.approx(time.time(), abs=1.0)


@pytest.mark.parametrize("bucket_bytes", [250 * 1024 * 1024, 40])
def test_construction_gives_every_rank_rank_0s_state(bucket_bytes: int) -> None:
    outcomes = run_ranks(w.construction_sync, 2, (bucket_bytes,), timeout=DEADLINE)
    values = _values(outcomes, [0, 1])
    assert values[0]["state"] == values[1]["state"]
    assert values[1]["state"]["1.running_mean"] == [1.0] * 4  # rank 0's buffer
    # Every parameter and buffer sent once: in one bucket, or in several of at most
    # 40 bytes each (a tensor over that alone).
    sends, n = values[0]["sends"], len(values[0]["state"])
    assert sum(sends) == n, sends
    assert sends == [n] if bucket_bytes > 1000 else len(sends) >= 4, sends
