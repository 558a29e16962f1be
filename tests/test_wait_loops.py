"""The store wait loops (``Backoff``, elastic's form/agree/admission waits), on a fake clock.

Every rank of a job polls these loops at once, on one store: a poll must cost each rank a
fixed number of requests (a counter, a decision key), not one key (or log line) per rank.
The loops run in the test's thread on a :class:`~resilient_ddp.base._clock.FakeClock`: its
sleeps take no time, what the other ranks do is scheduled on it, and the tests count the
polls and the waits exactly. The runtime is a fake (``tests/_fake_runtime.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.base import _clock
from resilient_ddp.base._clock import FakeClock
from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import Culprit, RankFailureError
from resilient_ddp.training import elastic
from resilient_ddp.training._elastic_protocol import Admission, Proposal

from ._counting_store import CountingStore
from ._fake_runtime import RAMP, backoff_waits
from ._fake_runtime import fake_runtime as _rt


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    with _clock.use(FakeClock()) as fake:
        yield fake
    assert fake.pending == 0, "an action scheduled on the clock never ran"


def _proposal(rank: int) -> str:
    return Proposal(rank=rank, uid=rank, committed=5, where="reduce", grads=True).to_json()


# -- the clock and Backoff ---------------------------------------------------------------------
def test_the_hand_computed_waits_follow_the_poll_constants() -> None:
    # RAMP (tests/_fake_runtime.py) was computed by hand from these: change them, change it.
    assert (ctl.POLL_FIRST_S, ctl.POLL_GROWTH, ctl.POLL_MAX_S) == (0.005, 1.5, 0.05)
    assert backoff_waits(8) == pytest.approx([*RAMP, 0.05, 0.05])
    assert sum(RAMP) == pytest.approx(0.10390625)


def test_fake_clock_sleeps_at_once_records_the_waits_and_runs_what_is_due() -> None:
    fake = FakeClock(start=50.0)
    ran: list[str] = []
    fake.at(50.25, lambda: ran.append("b"))
    fake.after(0.1, lambda: ran.append("a"))
    fake.at(50.25, lambda: ran.append("c"))  # due with "b": after it, as scheduled
    fake.sleep(0.05)
    assert (fake.monotonic(), ran) == (50.05, [])
    fake.sleep(0.3)
    assert fake.monotonic() == pytest.approx(50.35)
    assert ran == ["a", "b", "c"]  # in time order, then in the order scheduled
    fake.sleep(-1.0)
    assert fake.waits == [0.05, 0.3, 0.0]
    assert fake.pending == 0


def test_fake_clock_stops_a_loop_that_never_ends() -> None:
    fake = FakeClock(max_sleeps=3)
    for _ in range(3):
        fake.sleep(1.0)
    with pytest.raises(RuntimeError, match="more than 3 sleeps"):
        fake.sleep(1.0)


def test_use_routes_the_module_clock_and_restores_the_one_before() -> None:
    assert _clock._current is _clock.REAL
    outer, inner = FakeClock(start=10.0), FakeClock(start=20.0)
    with _clock.use(outer):
        _clock.sleep(2.0)
        seen: list[float] = []

        def fails_inside() -> None:
            with _clock.use(inner):
                seen.append(_clock.monotonic())
                raise KeyError("restored even so")

        with pytest.raises(KeyError):
            fails_inside()
        assert seen == [20.0]
        assert (_clock.monotonic(), outer.waits, inner.waits) == (12.0, [2.0], [])
    assert _clock._current is _clock.REAL


def test_backoff_grows_to_its_cap_resets_and_keeps_to_the_deadline() -> None:
    poll = ctl.Backoff(4, 2)
    waits = [poll.next_wait(0.0) for _ in range(8)]
    assert waits == pytest.approx(backoff_waits(8))
    poll.reset()
    assert poll.next_wait(0.0) == pytest.approx(0.005)
    # Never past `until` (but not below the first wait: no busy loop at a deadline).
    assert poll.next_wait(10.0, until=10.002) == pytest.approx(0.005)
    assert poll.next_wait(10.0, until=10.004) == pytest.approx(0.005)
    assert ctl.Backoff(4, 2).next_wait(10.0, until=9.0) == pytest.approx(0.005)


def test_backoff_sleeps_on_the_clock_in_use(clock: FakeClock) -> None:
    poll = ctl.Backoff(4, 2)
    for _ in range(7):
        poll.sleep()
    assert clock.waits == pytest.approx(backoff_waits(7))
    poll.sleep(until=clock.now + 0.02)  # 50 ms due: cut to the 20 ms left
    poll.reset()
    poll.sleep(until=clock.now + 1.0)
    assert clock.waits[7:] == pytest.approx([0.02, 0.005])


def test_backoff_keeps_every_rank_together_under_the_store_rate() -> None:
    for ranks, requests in [(8, 1), (250, 2), (1024, 2), (4096, 4)]:
        poll = ctl.Backoff(ranks, requests)
        waits = [poll.next_wait(0.0) for _ in range(20)]
        assert ranks * requests / min(waits) <= ctl.POLL_RATE + 1e-6
        assert max(waits) == pytest.approx(max(ctl.POLL_MAX_S, waits[0]))
    # Few ranks: the latency of a shrink or formation stays small.
    assert ctl.Backoff(32, 2).next_wait(0.0) == pytest.approx(ctl.POLL_FIRST_S)


def test_tally_moves_on_the_first_read_and_on_each_change() -> None:
    jobs = ctl.JobStore(dist.HashStore())
    tally = elastic._Tally(lambda: jobs.ready_count(3))
    assert tally.moved()
    assert tally.value == 0  # read, never bumped: 0
    assert not tally.moved()
    jobs.post_ready(3, 1)
    assert tally.moved()
    assert tally.value == 1
    assert not tally.moved()


# -- forming a generation ----------------------------------------------------------------------
def _members_arrive(others: ctl.JobStore, gen: int, ranks: list[int]) -> None:
    for r in ranks:
        others.post_ready(gen, r)


def test_form_polls_one_counter_and_reads_the_flags_once_all_arrived(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 4)
    rebuilt: list[tuple[int, int, list[int]]] = []
    monkeypatch.setattr(elastic, "_rebuild", lambda rt, g, r, m: rebuilt.append((g, r, m)))
    el = SimpleNamespace(uid=0, grow="x", acked=(0, 0))
    others = ctl.JobStore(base)
    _members_arrive(others, 9, [1, 2])
    seen: dict[str, Any] = {}

    def last_arrives() -> None:
        seen.update(calls=list(store.calls), names={n for n, _ in store.calls})
        others.post_ready(9, 3)

    # 300 ms on: 103.9 ms of ramp, then 50 ms waits; the 10th wait ends at 303.9 ms.
    clock.after(0.3, last_arrives)
    elastic._form(rt, el, 9, [0, 1, 2, 3], [0, 1, 2, 3])  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(10))  # it arrived: no wait after
    # Counters are read with compare_set (an add on a value that is not a number breaks
    # the connection); its own arrival is one, before its add. One poll a wait, and one
    # more that saw the last arrival.
    assert seen["names"] == {"set", "add", "compare_set"}, seen["calls"]  # no flag read
    assert sum(n == "compare_set" for n, _ in seen["calls"]) == 1 + 10
    assert store.count("compare_set") == 1 + 11
    assert store.count("add") == 1  # its own arrival
    assert rebuilt == [(9, 0, [0, 1, 2, 3])]
    assert store.wide_checks() == 1  # the four flags, once
    assert (el.grow, el.acked) == (None, (-1, -1))


def test_form_gives_up_at_once_on_a_member_dead_before_arriving(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 4, dead=(2,))
    monkeypatch.setattr(elastic, "_rebuild", lambda *a: pytest.fail("formed without rank 2"))
    _members_arrive(ctl.JobStore(base), 9, [1, 3])
    el = SimpleNamespace(uid=0, grow=None, acked=(0, 0))
    with pytest.raises(RankFailureError, match=r"member\(s\) \[2\] did not arrive"):
        elastic._form(rt, el, 9, [0, 1, 2, 3], [0, 1, 2, 3])  # type: ignore[arg-type]
    assert clock.waits == []  # at the first poll
    assert store.count("check") == 1  # the dead member's flag alone


def test_form_looks_at_a_dead_member_that_arrived_once(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """A member that died after arriving is not given up on at once (as before): its flag is
    read once, not on every poll, and the group forms when the others arrive."""
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 4, dead=(1,))
    rebuilt: list[int] = []
    monkeypatch.setattr(elastic, "_rebuild", lambda rt, g, r, m: rebuilt.append(g))
    others = ctl.JobStore(base)
    _members_arrive(others, 9, [1, 2])
    el = SimpleNamespace(uid=0, grow=None, acked=(0, 0))
    looks: list[int] = []

    def flag_reads(rank: int) -> int:
        return store.count("check", lambda keys: keys == [f"form/g9/{rank}"])

    def another_dies() -> None:  # arrived, then died
        looks.append(flag_reads(1))
        rt.failures.append(ctl.FailureEvent(ctl.EV_EXCEPTION, 2, rank=2, culprit=Culprit(2)))

    # Rank 2 dies in the 8th wait (ends at 203.9 ms): a change, so the waits start again
    # from 5 ms; rank 3 arrives in the 8th wait after that (ends at 407.8 ms).
    clock.after(0.2, another_dies)
    clock.after(0.4, lambda: others.post_ready(9, 3))
    elastic._form(rt, el, 9, [0, 1, 2, 3], [0, 1, 2, 3])  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(8) + backoff_waits(8))
    assert looks == [1]
    assert (flag_reads(1), flag_reads(2)) == (1, 1)
    assert rebuilt == [9]
    assert store.count("check", lambda keys: len(keys) == 1) == 2


# -- agreeing on a shrink ----------------------------------------------------------------------
def test_agree_reads_the_proposal_log_only_when_a_decision_may_be_due(clock: FakeClock) -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 3)
    others = ctl.JobStore(base)
    others.post_proposal("rec/g0/r0", _proposal(1))
    el = SimpleNamespace(uid=0, committed=5, members=list(range(3)))
    seen: dict[str, int] = {}

    def log_reads() -> int:
        return store.count("get", lambda key: key == "rec/g0/r0/log")

    def rank_2_proposes() -> None:
        seen.update(
            log=log_reads(),
            polls=store.count("check", lambda keys: keys == ["rec/g0/r0/d"]),
            compare_set=store.count("compare_set"),
            add=store.count("add"),
        )
        others.post_proposal("rec/g0/r0", _proposal(2))

    clock.after(0.3, rank_2_proposes)  # in the 10th wait (ends at 303.9 ms)
    dec = elastic._agree(rt, el, "rec/g0/r0", [0, 1, 2], "reduce", True, (0, 3))  # type: ignore[arg-type]
    assert (dec.members, dec.outcome) == ((0, 1, 2), "redo"), dec
    assert clock.waits == pytest.approx(backoff_waits(10))
    # Rank 2 is not gone: no decision was due, the log unread. A poll: the decision (one
    # check) and the proposal count (compare_set); + its own proposal's count (then an add).
    assert seen == {"log": 0, "polls": 10, "compare_set": 10 + 1, "add": 1}, seen
    assert log_reads() == 1  # once all proposed: it decides from that read


def test_agree_goes_on_without_a_dead_rank_once_the_others_proposed(clock: FakeClock) -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 5, dead=(4,))
    others = ctl.JobStore(base)
    for r in (1, 2):
        others.post_proposal("rec/g0/r0", _proposal(r))
    el = SimpleNamespace(uid=0, committed=5, members=list(range(5)))
    log_reads: list[int] = []

    def rank_3_proposes() -> None:
        log_reads.append(store.count("get", lambda key: key == "rec/g0/r0/log"))
        others.post_proposal("rec/g0/r0", _proposal(3))

    clock.after(0.2, rank_3_proposes)  # in the 8th wait (ends at 203.9 ms)
    dec = elastic._agree(rt, el, "rec/g0/r0", [0, 1, 2, 3, 4], "reduce", True, (0, 5))  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(8))  # it waited for rank 3
    assert log_reads == [0]
    assert (dec.members, dec.lost) == ((0, 1, 2, 3), (4,)), dec


def test_agree_decides_from_the_log_when_a_count_lags_it(clock: FakeClock) -> None:
    """A proposer that died between its line and its count: its proposal is not read while
    waiting (not counted), but the decision, once it is known dead, includes it, as when
    every poll read the log."""
    base = dist.HashStore()
    rt = _rt(base, 3)
    others = ctl.JobStore(base)
    others.post_proposal("rec/g0/r0", _proposal(1))
    el = SimpleNamespace(uid=0, committed=5, members=list(range(3)))

    def rank_2_dies() -> None:
        with rt.lock:
            rt.failures.append(ctl.FailureEvent(ctl.EV_CRASH, 0, rank=2, culprit=Culprit(2)))

    # Its line alone (no count) changes nothing the loop looks at: no reset. It is known
    # dead in the 12th wait (ends at 403.9 ms).
    clock.after(0.2, lambda: others._append("rec/g0/r0/log", _proposal(2)))
    clock.after(0.4, rank_2_dies)
    dec = elastic._agree(rt, el, "rec/g0/r0", [0, 1, 2], "reduce", True, (0, 3))  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(12))
    assert dec.members == (0, 1, 2), dec


# -- admissions ----------------------------------------------------------------------------------
def test_admission_result_reads_the_confirmations_once_all_counted(clock: FakeClock) -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    rt = _rt(store, 3)
    others = ctl.JobStore(base)
    others.post_has_state(7, 1)
    adm = Admission(at=5, joiners=(2,), gen=7, from_gen=6, members=(0, 1, 2))
    seen: list[tuple[int, int]] = []

    def rank_2_confirms() -> None:
        seen.append((store.count("multi_get"), store.wide_checks()))
        others.post_has_state(7, 2)

    clock.after(0.3, rank_2_confirms)  # in the 10th wait (ends at 303.9 ms)
    assert elastic._admission_result(rt, adm, 0, ok=True) is True  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(10))
    assert seen == [(0, 0)]
    assert (store.count("multi_get"), store.wide_checks()) == (1, 1)


def test_acks_bound_is_read_once_every_member_is_counted() -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    jobs = ctl.JobStore(store)  # type: ignore[arg-type]
    rt = _rt(store, 3)
    acks = elastic._Tally(lambda: jobs.ack_count(0, 2))
    poll = ctl.Backoff(3, 4)
    jobs.ack(0, 2, 0, 5)
    jobs.ack(0, 2, 1, 6)
    assert elastic._acks_bound(rt, jobs, 2, acks, poll) is None
    assert elastic._acks_bound(rt, jobs, 2, acks, poll) is None
    assert store.wide_checks() == 0
    jobs.ack(0, 2, 2, 5)
    assert elastic._acks_bound(rt, jobs, 2, acks, poll) == 6
    assert elastic._acks_bound(rt, jobs, 2, acks, poll) is None  # read once
    assert store.wide_checks() == 1
