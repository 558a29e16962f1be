"""The pure elastic decisions (``resilient_ddp.training._elastic_protocol``), table-driven,
no processes.

Failure kinds map onto the protocol's inputs as the watchdog reports them: a killed rank
(crash) or one that raised (exception) is known dead and never proposes; a stopped rank
(SIGSTOP, a hang) is named by a timeout, gone but not known dead, and silent.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import ControlPlaneError
from resilient_ddp.training import elastic
from resilient_ddp.training._elastic_protocol import (
    Admission,
    Proposal,
    ShrinkDecision,
    decide_admission,
    decide_shrink,
    members_digest,
    needs_ack,
    parse_proposals,
    pending_joiners,
    should_decide,
)
from resilient_ddp.training.elastic_sampler import ElasticBatchSampler

from ._counting_store import CountingStore
from ._fake_runtime import fake_runtime

NEXT_GEN = 7


def P(  # noqa: N802 - a table constructor, read as a record literal
    rank: int,
    committed: int = 5,
    where: str = "reduce",
    grads: bool = True,
    uid: int | None = None,
) -> Proposal:
    return Proposal(
        rank=rank,
        uid=rank if uid is None else uid,
        committed=committed,
        where=where,  # type: ignore[arg-type]
        grads=grads,
    )


def props(*ps: Proposal) -> dict[int, Proposal]:
    return {p.rank: p for p in ps}


# -- decide_shrink: outcomes, sources, kill/raise/stop mixes --------------------------------
# (proposals, world_size, dead) -> (old_ranks, lost, members, outcome, source, sync, committed)
GO_ON = [
    pytest.param(
        props(P(0), P(1), P(2)),
        4,
        {3},
        ((0, 1, 2), (3,), (0, 1, 2), "redo", 0, False, 5),
        id="killed-in-reduce-survivors-have-grads-redo",
    ),
    pytest.param(
        props(P(0), P(1, grads=False), P(2)),
        4,
        {3},
        ((0, 1, 2), (3,), (0, 1, 2), "skip", 0, False, 5),
        id="raised-one-survivor-lost-its-grads-skip",
    ),
    pytest.param(
        props(P(0, where="forward"), P(1, where="forward"), P(3, where="forward")),
        4,
        {2},
        ((0, 1, 3), (2,), (0, 1, 3), "continue", 0, False, 5),
        id="killed-before-forward-continue",
    ),
    pytest.param(
        props(P(0, where="forward"), P(1), P(2)),
        4,
        {3},
        ((0, 1, 2), (3,), (0, 1, 2), "skip", 0, False, 5),
        id="mixed-forward-and-reduce-skip",
    ),
    pytest.param(
        props(P(0, committed=4, where="forward"), P(1), P(2)),
        4,
        {3},
        ((0, 1, 2), (3,), (0, 1, 2), "skip", 1, True, 5),
        id="counts-differ-skip-and-sync-from-most-commits",
    ),
    pytest.param(
        props(P(0, 5), P(1, 6), P(2, 5), P(3, 6)),
        5,
        {4},
        ((0, 1, 2, 3), (4,), (0, 1, 2, 3), "skip", 1, True, 6),
        id="source-is-lowest-rank-with-most-commits",
    ),
    pytest.param(
        props(P(1, uid=11), P(2, uid=1000001), P(3, uid=13)),
        4,
        {0},
        ((1, 2, 3), (0,), (11, 1000001, 13), "redo", 0, False, 5),
        id="rank0-killed-members-are-uids-source-new-rank0",
    ),
    pytest.param(
        props(P(0), P(1)),
        4,
        {2, 3},
        ((0, 1), (2, 3), (0, 1), "redo", 0, False, 5),
        id="half-lost-killed-and-raised-known-dead-go-on",
    ),
    pytest.param(
        props(P(0), P(1), P(2)),
        5,
        {4},
        ((0, 1, 2), (3, 4), (0, 1, 2), "redo", 0, False, 5),
        id="killed-plus-stopped-majority-goes-on",
    ),
    pytest.param(
        props(P(0), P(1), P(2), P(3)),
        4,
        set(),
        ((0, 1, 2, 3), (), (0, 1, 2, 3), "redo", 0, False, 5),
        id="spurious-timeout-everyone-proposed",
    ),
]


@pytest.mark.parametrize(("proposals", "world", "dead", "want"), GO_ON)
def test_decide_shrink_goes_on(
    proposals: dict[int, Proposal], world: int, dead: set[int], want: tuple[Any, ...]
) -> None:
    calls: list[int] = []

    def draw() -> int:
        calls.append(1)
        return NEXT_GEN

    dec = decide_shrink(
        proposals,
        candidates=range(world),
        dead=dead,
        generation=3,
        world_size=world,
        min_world_size=2,
        next_generation=draw,
    )
    got = (dec.old_ranks, dec.lost, dec.members, dec.outcome, dec.source, dec.sync, dec.committed)
    assert got == want
    assert dec.fail is None
    assert dec.gen == NEXT_GEN
    assert calls == [1]  # one generation number drawn, only on success
    # What survivors read names the lost ranks; each derives the same decision from its
    # own copy of the member list, whether the ids are the ranks or not.
    ranks_as_ids = list(range(world))
    assert ShrinkDecision.from_record(dec.to_record(ranks_as_ids), ranks_as_ids) == dec
    ids = [proposals[r].uid if r in proposals else 100 + r for r in range(world)]
    record = dec.to_record(ids)
    assert record["moved"] == []
    assert ShrinkDecision.from_record(json.loads(json.dumps(record)), ids) == dec


# (proposals, world_size, dead, min_world_size) -> (old_ranks, lost, message)
FAIL = [
    pytest.param(
        props(P(0), P(1)),
        5,
        {2, 3, 4},
        2,
        (
            (0, 1),
            (2, 3, 4),
            "only 2 of 5 ranks of generation 3 reached the store together (lost: [2, 3, 4], "
            "not known dead): a minority does not go on alone",
        ),
        id="minority-2-of-5-even-if-dead",
    ),
    pytest.param(
        props(P(0), P(1)),
        4,
        set(),
        2,
        (
            (0, 1),
            (2, 3),
            "only 2 of 4 ranks of generation 3 reached the store together (lost: [2, 3], "
            "not known dead): a minority does not go on alone",
        ),
        id="half-2-of-4-stopped-not-known-dead",
    ),
    pytest.param(
        props(P(2), P(3)),
        4,
        {0},
        2,
        (
            (2, 3),
            (0, 1),
            "only 2 of 4 ranks of generation 3 reached the store together (lost: [0, 1], "
            "not known dead): a minority does not go on alone",
        ),
        id="half-2-of-4-one-killed-one-stopped",
    ),
    pytest.param(
        props(P(0), P(1)),
        3,
        {2},
        3,
        (
            (0, 1),
            (2,),
            "only 2 rank(s) survive the loss of rank(s) [2] in generation 3, fewer than "
            "min_world_size=3: training cannot go on",
        ),
        id="below-min-world-size",
    ),
    pytest.param(
        props(P(0)),
        1,
        set(),
        2,
        (
            (0,),
            (),
            "only 1 rank(s) survive in generation 3, fewer than min_world_size=2: training "
            "cannot go on",
        ),
        id="below-min-world-size-nothing-lost",
    ),
    pytest.param(
        {},
        2,
        {0, 1},
        1,
        (
            (),
            (0, 1),
            "only 0 rank(s) survive the loss of rank(s) [0, 1] in generation 3, fewer than "
            "min_world_size=1: training cannot go on",
        ),
        id="no-proposal-at-all",
    ),
]


@pytest.mark.parametrize(("proposals", "world", "dead", "min_world", "want"), FAIL)
def test_decide_shrink_fails(
    proposals: dict[int, Proposal],
    world: int,
    dead: set[int],
    min_world: int,
    want: tuple[Any, ...],
) -> None:
    def draw() -> int:
        raise AssertionError("a failed decision draws no generation number")

    dec = decide_shrink(
        proposals,
        candidates=range(world),
        dead=dead,
        generation=3,
        world_size=world,
        min_world_size=min_world,
        next_generation=draw,
    )
    assert (dec.old_ranks, dec.lost, dec.fail) == want
    assert (dec.gen, dec.members, dec.source, dec.outcome) == (None, (), None, None)
    assert dec.to_json() == {"old_ranks": list(want[0]), "lost": list(want[1]), "fail": want[2]}
    record = dec.to_record(list(range(world)))
    assert record == {"world": world, "lost": list(want[1]), "fail": want[2]}
    assert ShrinkDecision.from_record(record, list(range(world))) == dec


# -- decide_shrink: claims that are not believed ---------------------------------------------
# (proposals, candidates, world, dead, my_committed) -> (old_ranks, lost, members, source,
#                                                        committed, outcome) or a fail prefix
SANITY = [
    pytest.param(
        props(P(0), P(1), P(2), P(3)),
        (0, 1, 2),
        4,
        {3},
        None,
        ((0, 1, 2), (3,), (0, 1, 2), 0, 5, "redo"),
        id="proposal-from-non-candidate-ignored",
    ),
    pytest.param(
        {0: P(0), 1: P(1), 2: P(3)},
        range(4),
        4,
        {3},
        None,
        ((0, 1), (2, 3), "fail"),
        id="proposal-filed-under-another-rank-ignored",
    ),
    pytest.param(
        props(P(0), P(1), P(2), P(3), P(4, uid=1)),
        range(5),
        5,
        set(),
        None,
        ((0, 2, 3), (1, 4), (0, 2, 3), 0, 5, "redo"),
        id="duplicate-uid-both-ignored",
    ),
    pytest.param(
        props(P(0), P(1), P(2), P(3, committed=10**9)),
        range(4),
        4,
        set(),
        None,
        ((0, 1, 2), (3,), (0, 1, 2), 0, 5, "redo"),
        id="inflated-count-vs-median-ignored",
    ),
    pytest.param(
        props(P(0, 6), P(1, 5), P(2, 10**9)),
        range(3),
        3,
        set(),
        None,
        ((0, 1), (2,), (0, 1), 0, 6, "skip"),
        id="inflated-count-honest-differ-by-one-low-median",
    ),
    pytest.param(
        props(P(0, 10**9), P(1), P(2), P(3)),
        range(4),
        4,
        set(),
        5,
        ((1, 2, 3), (0,), (1, 2, 3), 0, 5, "redo"),
        id="inflated-rank0-vs-my-committed-never-source",
    ),
    pytest.param(
        props(P(0, 6), P(1, 6), P(2, 5), P(3, 0)),
        range(4),
        4,
        set(),
        6,
        ((0, 1, 2), (3,), (0, 1, 2), 0, 6, "skip"),
        id="garbage-low-count-ignored",
    ),
    pytest.param(
        props(P(0, 5), P(1, 10**9)),
        range(3),
        3,
        {2},
        5,
        ((0,), (1, 2), "fail"),
        id="two-left-my-committed-tells-which-lies",
    ),
    pytest.param(
        props(P(0, 5), P(1, 10**9)),
        range(3),
        3,
        {2},
        None,
        ((), (0, 1, 2), "fail"),
        id="two-left-without-reference-both-doubted",
    ),
    pytest.param(
        props(P(0, 5), P(1, 6)),
        range(3),
        3,
        {2},
        None,
        ((0, 1), (2,), (0, 1), 1, 6, "skip"),
        id="two-honest-one-apart-both-believed",
    ),
]


@pytest.mark.parametrize(("proposals", "candidates", "world", "dead", "mine", "want"), SANITY)
def test_decide_shrink_ignores_unbelievable_claims(
    proposals: dict[int, Proposal],
    candidates: Any,
    world: int,
    dead: set[int],
    mine: int | None,
    want: tuple[Any, ...],
) -> None:
    dec = decide_shrink(
        proposals,
        candidates=candidates,
        dead=dead,
        generation=0,
        world_size=world,
        min_world_size=2,
        next_generation=NEXT_GEN,
        my_committed=mine,
    )
    if want[-1] == "fail":
        assert (dec.old_ranks, dec.lost) == want[:2]
        assert dec.fail is not None
        assert dec.members == ()
        return
    assert dec.fail is None
    got = (dec.old_ranks, dec.lost, dec.members, dec.source, dec.committed, dec.outcome)
    assert got == want
    assert dec.gen == NEXT_GEN


def test_inflated_claim_never_becomes_the_source() -> None:
    honest = [P(r, committed=41 + r % 2, where="forward") for r in range(1, 8)]
    hostile = P(0, committed=10**9, where="forward")
    dec = decide_shrink(
        props(hostile, *honest),
        candidates=range(8),
        dead=set(),
        generation=2,
        world_size=8,
        min_world_size=2,
        next_generation=9,
    )
    assert dec.members == (1, 2, 3, 4, 5, 6, 7)
    assert dec.lost == (0,)
    assert (dec.source, dec.committed, dec.sync, dec.outcome) == (0, 42, True, "skip")


# -- should_decide ---------------------------------------------------------------------------
# (waiting, gone, dead, recovering, silent_since, now) -> (decide, silent_since); grace 1,
# deadline 100.
SHOULD = [
    pytest.param((), set(), set(), False, None, 10.0, (True, None), id="nobody-waiting"),
    pytest.param((3,), {3}, {3}, False, None, 10.0, (True, 10.0), id="waiting-on-killed"),
    pytest.param(
        (2, 3), {2, 3}, {2, 3}, False, None, 10.0, (True, 10.0), id="waiting-on-killed-raised"
    ),
    pytest.param((3,), {3}, set(), False, None, 10.0, (False, 10.0), id="stopped-grace-starts"),
    pytest.param((3,), {3}, set(), False, 9.5, 10.0, (False, 9.5), id="stopped-within-grace"),
    pytest.param((3,), {3}, set(), False, 9.0, 10.0, (True, 9.0), id="stopped-grace-over"),
    pytest.param((3,), {3}, set(), True, 5.0, 10.0, (False, None), id="named-but-recovering"),
    pytest.param(
        (2, 3), {2, 3}, {3}, False, 9.0, 10.0, (True, 9.0), id="killed-and-stopped-grace-over"
    ),
    pytest.param(
        (2, 3), {3}, {3}, False, 5.0, 10.0, (False, None), id="one-waiting-not-named-gone"
    ),
    pytest.param((2,), set(), set(), False, None, 100.0, (True, None), id="deadline"),
]


@pytest.mark.parametrize(("waiting", "gone", "dead", "recovering", "since", "now", "want"), SHOULD)
def test_should_decide(
    waiting: tuple[int, ...],
    gone: set[int],
    dead: set[int],
    recovering: bool,
    since: float | None,
    now: float,
    want: tuple[bool, float | None],
) -> None:
    args: dict[str, Any] = {
        "waiting": waiting,
        "gone": gone,
        "dead": dead,
        "silent_since": since,
        "now": now,
        "grace": 1.0,
        "deadline": 100.0,
    }
    assert should_decide(recovering=recovering, **args) == want
    assert should_decide(recovering=lambda: recovering, **args) == want


def test_should_decide_asks_about_recovery_only_when_all_waiting_are_gone() -> None:
    def never() -> bool:
        raise AssertionError("heartbeats read although a waiting rank is not gone")

    got = should_decide(
        waiting=(1, 2),
        gone={2},
        dead=set(),
        recovering=never,
        silent_since=None,
        now=1.0,
        grace=1.0,
        deadline=9.0,
    )
    assert got == (False, None)


# -- Proposal validation and JSON --------------------------------------------------------------
GOOD = {"rank": 2, "uid": 1000003, "committed": 17, "where": "reduce", "grads": False}
PARSE = [
    pytest.param(GOOD, P(2, 17, "reduce", False, 1000003), id="valid"),
    pytest.param({**GOOD, "where": "forward"}, P(2, 17, "forward", False, 1000003), id="fwd"),
    pytest.param({**GOOD, "extra": 1}, P(2, 17, "reduce", False, 1000003), id="extra-key"),
    pytest.param({k: v for k, v in GOOD.items() if k != "uid"}, None, id="missing-uid"),
    pytest.param({**GOOD, "rank": "2"}, None, id="rank-str"),
    pytest.param({**GOOD, "rank": -1}, None, id="rank-negative"),
    pytest.param({**GOOD, "committed": -3}, None, id="committed-negative"),
    pytest.param({**GOOD, "committed": 1.5}, None, id="committed-float"),
    pytest.param({**GOOD, "committed": True}, None, id="committed-bool"),
    pytest.param({**GOOD, "uid": None}, None, id="uid-none"),
    pytest.param({**GOOD, "where": "backward"}, None, id="unknown-where"),
    pytest.param({**GOOD, "grads": 1}, None, id="grads-int"),
    pytest.param([2, 1000003, 17, "reduce", False], None, id="not-a-mapping"),
    pytest.param(None, None, id="none"),
]


@pytest.mark.parametrize(("record", "want"), PARSE)
def test_proposal_parse(record: object, want: Proposal | None) -> None:
    assert Proposal.parse(record) == want
    if want is None:
        with pytest.raises(ValueError, match=r"."):
            Proposal.from_json(record)  # type: ignore[arg-type]


def test_parse_proposals_drops_malformed_and_keeps_the_first_per_rank() -> None:
    records = [
        {**GOOD, "rank": 0, "uid": 0, "committed": 5},
        {"rank": 1, "where": "reduce"},
        {**GOOD, "rank": 1, "uid": 1, "committed": 5},
        {**GOOD, "rank": 0, "uid": 0, "committed": 10**9},  # a later record for rank 0
    ]
    assert parse_proposals(records) == {
        0: P(0, 5, "reduce", False, 0),
        1: P(1, 5, "reduce", False, 1),
    }


STORED_GO_ON = {
    "old_ranks": [0, 2, 3],
    "lost": [1],
    "fail": None,
    "gen": 12,
    "members": [0, 1000002, 3],
    "source": 1,
    "outcome": "skip",
    "sync": True,
    "committed": 8,
}
DECISIONS = [
    pytest.param(
        ShrinkDecision(
            old_ranks=(0, 2, 3),
            lost=(1,),
            gen=12,
            members=(0, 1000002, 3),
            source=1,
            outcome="skip",
            sync=True,
            committed=8,
        ),
        STORED_GO_ON,
        id="go-on",
    ),
    pytest.param(
        ShrinkDecision(old_ranks=(0,), lost=(1, 2), fail="a minority does not go on alone"),
        {"old_ranks": [0], "lost": [1, 2], "fail": "a minority does not go on alone"},
        id="fail",
    ),
]


@pytest.mark.parametrize(("dec", "stored"), DECISIONS)
def test_shrink_decision_json_round_trip(dec: ShrinkDecision, stored: dict[str, Any]) -> None:
    assert dec.to_json() == stored  # the dict elastic.py stores today
    wire = json.loads(json.dumps(dec.to_json()))
    assert ShrinkDecision.from_json(wire) == dec
    assert ShrinkDecision.from_json(stored) == dec


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param({"old_ranks": [0], "lost": [1]}, id="no-fail-key"),
        pytest.param({"old_ranks": [0], "lost": [1], "fail": None}, id="go-on-without-fields"),
        pytest.param({"old_ranks": "0", "lost": [1], "fail": "x"}, id="old-ranks-str"),
        pytest.param({**STORED_GO_ON, "outcome": "retry"}, id="unknown-outcome"),
        pytest.param({**STORED_GO_ON, "sync": "yes"}, id="sync-str"),
    ],
)
def test_shrink_decision_from_json_rejects_malformed(broken: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"."):
        ShrinkDecision.from_json(broken)


# -- the compact record survivors read ----------------------------------------------------------
MEMBERS = (0, 1000002, 2, 3)  # generation N's member ids by rank, as every rank holds them
STORED_RECORD = {
    "world": 4,
    "lost": [2],
    "fail": None,
    "gen": 12,
    "source": 1,
    "outcome": "skip",
    "sync": True,
    "committed": 8,
    "digest": members_digest((0, 1000002, 3)),
    "moved": [],
}
GO_ON_DEC = ShrinkDecision(
    old_ranks=(0, 1, 3),
    lost=(2,),
    gen=12,
    members=(0, 1000002, 3),
    source=1,
    outcome="skip",
    sync=True,
    committed=8,
)


def test_shrink_record_names_the_lost_ranks_not_the_members() -> None:
    assert GO_ON_DEC.to_record(MEMBERS) == STORED_RECORD
    wire = json.loads(json.dumps(STORED_RECORD))
    assert ShrinkDecision.from_record(wire, MEMBERS) == GO_ON_DEC
    # A proposal under another id than the one the decider knows at that rank: the id
    # travels (``moved``), and every reader derives the decider's members.
    odd = ShrinkDecision(**{**GO_ON_DEC.__dict__, "members": (0, 77, 3)})
    record = odd.to_record(MEMBERS)
    assert record["moved"] == [[1, 77]]
    assert ShrinkDecision.from_record(record, MEMBERS) == odd


def test_shrink_record_size_does_not_grow_with_the_world() -> None:
    """The record a survivor reads holds the lost ranks, not the members: the same size at
    W = 8 and W = 4096 (but for the digits of the world and the lost rank)."""
    sizes = {}
    for world in (8, 4096):
        ids = list(range(world))
        dec = decide_shrink(
            {r: P(r) for r in range(world) if r != 5},
            candidates=range(world),
            dead={5},
            generation=0,
            world_size=world,
            min_world_size=1,
            next_generation=1,
        )
        assert len(dec.members) == world - 1
        sizes[world] = len(json.dumps(dec.to_record(ids)))
        assert ShrinkDecision.from_record(dec.to_record(ids), ids) == dec
    assert sizes[4096] <= sizes[8] + 3, sizes
    assert sizes[4096] < 250, sizes


def test_members_digest_tells_lists_apart_whatever_the_ids() -> None:
    assert members_digest([0, 1, 2]) == members_digest((0, 1, 2))
    assert len({members_digest(m) for m in ([0, 1, 2], [0, 2, 1], [0, 1], [0, 1, 3])}) == 4
    # An id beyond 64 bits is hashed as text; the record still round-trips.
    huge = [0, 2**70, 2]
    assert members_digest(huge) != members_digest([0, 2**70 + 1, 2])
    dec = ShrinkDecision(
        old_ranks=(0, 1),
        lost=(2,),
        gen=12,
        members=(0, 2**70),
        source=0,
        outcome="skip",
        sync=True,
        committed=8,
    )
    assert ShrinkDecision.from_record(dec.to_record(huge), huge) == dec


def test_shrink_record_needs_ranks_that_split_the_world() -> None:
    with pytest.raises(ValueError, match="do not split"):
        GO_ON_DEC.to_record(MEMBERS[:3])


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        pytest.param([STORED_RECORD], "mapping", id="not-a-mapping"),
        pytest.param({**STORED_RECORD, "world": 5}, "world of 5", id="another-world"),
        pytest.param({**STORED_RECORD, "world": True}, "'world'", id="world-bool"),
        pytest.param({**STORED_RECORD, "lost": [2, 2]}, "increasing", id="lost-repeated"),
        pytest.param({**STORED_RECORD, "lost": [3, 2]}, "increasing", id="lost-unordered"),
        pytest.param({**STORED_RECORD, "lost": [4]}, "increasing", id="lost-outside-world"),
        pytest.param({**STORED_RECORD, "lost": [-1]}, "increasing", id="lost-negative"),
        pytest.param({**STORED_RECORD, "lost": "2"}, "'lost'", id="lost-str"),
        pytest.param({**STORED_RECORD, "fail": 3}, "'fail'", id="fail-int"),
        pytest.param({**STORED_RECORD, "outcome": "retry"}, "'outcome'", id="unknown-outcome"),
        pytest.param({**STORED_RECORD, "sync": "yes"}, "'sync'", id="sync-str"),
        pytest.param({**STORED_RECORD, "source": 3}, "out of range", id="source-outside"),
        pytest.param({**STORED_RECORD, "committed": -1}, "out of range", id="negative-step"),
        pytest.param({**STORED_RECORD, "gen": "12"}, "'gen'", id="gen-str"),
        pytest.param({**STORED_RECORD, "moved": {}}, "'moved'", id="moved-not-a-list"),
        pytest.param({**STORED_RECORD, "moved": [[1, 7, 7]]}, "'moved'", id="moved-triple"),
        pytest.param({**STORED_RECORD, "moved": [[1, True]]}, "'moved'", id="moved-uid-bool"),
        pytest.param({**STORED_RECORD, "moved": [[2, 7]]}, "'moved'", id="moved-lost-rank"),
        pytest.param(
            {**STORED_RECORD, "moved": [[1, 7], [1, 8]]}, "'moved'", id="moved-rank-twice"
        ),
        pytest.param({**STORED_RECORD, "moved": [[1, 7]]}, "digest", id="moved-not-digested"),
        pytest.param({**STORED_RECORD, "digest": "0" * 16}, "digest", id="wrong-digest"),
        pytest.param({**STORED_RECORD, "digest": 5}, "'digest'", id="digest-int"),
        pytest.param(
            {k: v for k, v in STORED_RECORD.items() if k != "digest"}, "'digest'", id="no-digest"
        ),
        pytest.param(
            {k: v for k, v in STORED_RECORD.items() if k != "moved"}, "'moved'", id="no-moved"
        ),
        pytest.param({"world": 4, "lost": [2]}, "'fail'", id="no-fail-key"),
        # The members record of before this change: the decision must be re-derived.
        pytest.param(GO_ON_DEC.to_json(), "'world'", id="full-decision"),
    ],
)
def test_shrink_record_rejects_malformed(broken: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShrinkDecision.from_record(broken, MEMBERS)


def test_shrink_record_is_refused_by_a_rank_whose_member_list_differs() -> None:
    """A reader whose copy of the member list is not the decider's does not form another
    group from it: the digest of what it derives does not match."""
    with pytest.raises(ValueError, match="copy differs"):
        ShrinkDecision.from_record(STORED_RECORD, (0, 1000002, 2, 1000003))


def test_admission_record_leaves_the_members_out() -> None:
    adm = Admission(at=12, joiners=(1000001,), gen=9, from_gen=4, members=(0, 1, 1000001))
    record = adm.to_record()
    assert record == {
        "at": 12,
        "joiners": [1000001],
        "gen": 9,
        "from": 4,
        "world": 2,
        "digest": members_digest((0, 1, 1000001)),
    }
    assert Admission.from_record(json.loads(json.dumps(record)), [0, 1]) == adm
    sizes = {}
    for world in (8, 4096):
        big = Admission(
            at=3, joiners=(1000001,), gen=9, from_gen=4, members=(*range(world), 1000001)
        )
        sizes[world] = len(json.dumps(big.to_record()))
        assert Admission.from_record(big.to_record(), list(range(world))) == big
    assert sizes[4096] <= sizes[8] + 3, sizes


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        pytest.param("x", "mapping", id="not-a-mapping"),
        pytest.param({"world": 3}, "world of 3", id="another-world"),
        pytest.param({"joiners": []}, "none", id="no-joiner"),
        pytest.param({"joiners": [1]}, "are members", id="joiner-is-a-member"),
        pytest.param({"joiners": [1000001, 1000001]}, "repeat", id="joiner-twice"),
        pytest.param({"joiners": [1000002]}, "digest", id="another-joiner"),
        pytest.param({"digest": None}, "'digest'", id="digest-none"),
        pytest.param({"at": "12"}, "'at'", id="at-str"),
        pytest.param({"from": None}, "'from'", id="from-none"),
        pytest.param({"gen": None}, "'gen'", id="gen-none"),
        pytest.param({"world": None}, "'world'", id="world-none"),
    ],
)
def test_admission_record_rejects_malformed(broken: object, match: str) -> None:
    record = Admission(
        at=12, joiners=(1000001,), gen=9, from_gen=4, members=(0, 1, 1000001)
    ).to_record()
    obj = {**record, **broken} if isinstance(broken, dict) else broken
    with pytest.raises(ValueError, match=match):
        Admission.from_record(obj, [0, 1])
    with pytest.raises(ValueError, match="copy differs"):
        Admission.from_record(record, [0, 2])


def test_proposal_json_round_trip() -> None:
    p = P(3, 9, "forward", True, 1000007)
    assert p.to_json() == {
        "rank": 3,
        "uid": 1000007,
        "committed": 9,
        "where": "forward",
        "grads": True,
    }
    assert Proposal.from_json(json.loads(json.dumps(p.to_json()))) == p


# -- admission -------------------------------------------------------------------------------
def _sampler(pos: int | None) -> Callable[[int, int, int, int], int]:
    """The real sampler's step rule: 100 samples, batch 4, unshuffled, ``pos`` consumed
    (``None``: no epoch started yet)."""
    s = ElasticBatchSampler(100, 4, shuffle=False)
    if pos is not None:
        s._start(0)
        s._pos = pos
    return s.admission_step


def _fixed(result: int) -> Callable[[int, int, int, int], int]:
    return lambda at, _w, _n, _c: max(at, result)


# (committed, members, pending, samplers_step) -> at. Two members, batch 4: 8 per step.
ADMISSION = [
    pytest.param(10, [0, 1], [1000001], None, 11, id="no-sampler-next-step"),
    pytest.param(10, [0, 1], [1000001], [], 11, id="no-live-sampler"),
    pytest.param(10, [0, 1], [1000001], _sampler(None), 11, id="sampler-no-epoch-yet"),
    # 20 left: 3 steps (8, 8, 4); after one step 12 left >= 3 ranks * 4: full slots.
    pytest.param(10, [0, 1], [1000001], _sampler(80), 11, id="sampler-room-for-joiner"),
    # 16 left: 2 steps; after one step 8 left < 12: wait for the next epoch (10 + 2).
    pytest.param(10, [0, 1], [1000001], _sampler(84), 12, id="sampler-waits-for-next-epoch"),
    # 4 left: 1 short step, the admission step is past it already.
    pytest.param(10, [0, 1], [1000001], _sampler(96), 11, id="sampler-epoch-ends-first"),
    # 40 left, 2 joiners: after one step 32 >= 4 * 4.
    pytest.param(3, [0, 1], [1000001, 1000002], _sampler(60), 4, id="sampler-two-joiners"),
    pytest.param(10, [0, 1], [1000001], [_fixed(14), _fixed(12)], 14, id="samplers-in-turn"),
    pytest.param(10, [0, 1], [1000001], [_fixed(12), _sampler(84)], 12, id="later-sees-moved"),
]


@pytest.mark.parametrize(("committed", "members", "pending", "step", "at"), ADMISSION)
def test_decide_admission_step(
    committed: int, members: list[int], pending: list[int], step: Any, at: int
) -> None:
    draws: list[int] = []

    def draw() -> int:
        draws.append(1)
        return 6

    adm = decide_admission(
        committed=committed,
        members=members,
        pending=pending,
        next_generation=draw,
        generation=4,
        samplers_step=step,
    )
    assert adm == Admission(
        at=at,
        joiners=tuple(pending),
        gen=6,
        from_gen=4,
        members=(*members, *pending),
    )
    assert draws == [1]
    assert adm.old_world == len(members)
    assert adm.rank_of(pending[0]) == len(members)


@pytest.mark.parametrize(
    ("committed", "acked", "step", "at"),
    [
        # The acknowledged bound fixes the step; the sampler sees the decider's own count.
        pytest.param(10, 10, None, 11, id="decider-at-the-bound"),
        pytest.param(10, 9, None, 10, id="decider-a-step-past-the-bound-admits-now"),
        # 8 left: one step of the epoch is left at the decider's boundary, too few for 3
        # full slots: the sampler moves the admission to the next epoch's first step.
        pytest.param(10, 9, _sampler(92), 11, id="sampler-given-the-deciders-count"),
    ],
)
def test_decide_admission_from_the_acknowledged_bound(
    committed: int, acked: int, step: Any, at: int
) -> None:
    adm = decide_admission(
        committed=committed,
        acked=acked,
        members=[0, 1],
        pending=[1000001],
        next_generation=6,
        generation=4,
        samplers_step=step,
    )
    assert adm.at == at


def test_decide_admission_refuses_a_bound_more_than_a_step_behind() -> None:
    with pytest.raises(ValueError, match="more than a step before"):
        decide_admission(
            committed=10,
            acked=8,
            members=[0, 1],
            pending=[1000001],
            next_generation=6,
            generation=4,
            samplers_step=None,
        )


def test_decide_admission_passes_worlds_and_committed_to_the_sampler() -> None:
    seen: list[tuple[int, int, int, int]] = []

    def step(at: int, world: int, new_world: int, committed: int) -> int:
        seen.append((at, world, new_world, committed))
        return at

    decide_admission(
        committed=7,
        members=[0, 2, 5],
        pending=[1000001, 1000004],
        next_generation=3,
        generation=2,
        samplers_step=step,
    )
    assert seen == [(8, 3, 5, 7)]


@pytest.mark.parametrize(
    ("pending", "step"),
    [
        pytest.param([], None, id="nobody-pending"),
        pytest.param([1], None, id="joiner-is-a-member"),
        pytest.param([1000001, 1000001], None, id="joiner-twice"),
        pytest.param([1000001], lambda at, _w, _n, _c: at - 1, id="sampler-moves-earlier"),
    ],
)
def test_decide_admission_rejects(pending: list[int], step: Any) -> None:
    with pytest.raises(ValueError, match="decide_admission"):
        decide_admission(
            committed=5,
            members=[0, 1],
            pending=pending,
            next_generation=3,
            generation=2,
            samplers_step=step,
        )


def test_admission_json_round_trip() -> None:
    adm = Admission(at=12, joiners=(1000001,), gen=9, from_gen=4, members=(0, 1, 1000001))
    stored = {"at": 12, "joiners": [1000001], "gen": 9, "from": 4, "members": [0, 1, 1000001]}
    assert adm.to_json() == stored
    assert Admission.from_json(json.loads(json.dumps(adm.to_json()))) == adm
    # The joiner's copy (join/adm/<uid>) carries its rank too.
    assert Admission.from_json({**stored, "rank": adm.rank_of(1000001)}) == adm
    with pytest.raises(ValueError, match="'from'"):
        Admission.from_json({k: v for k, v in stored.items() if k != "from"})


# -- acknowledgements ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("acked", "need"),
    [
        pytest.param((-1, -1), True, id="never-acked"),
        pytest.param((3, 2), False, id="acked-this-round"),
        pytest.param((3, 1), True, id="another-request-since"),
        pytest.param((2, 2), True, id="acked-in-older-generation"),
    ],
)
def test_needs_ack(acked: tuple[int, int], need: bool) -> None:
    assert needs_ack(acked, generation=3, requests=2) is need


# -- pending joiners -------------------------------------------------------------------------
REQ = [{"uid": u, "host": "h", "pid": 1} for u in (1000001, 1000002, 1000003, 1000004)]
PENDING = [
    pytest.param(REQ, set(), set(), {}, [1000001, 1000002, 1000003, 1000004], id="all-new"),
    pytest.param(REQ + REQ[:2], set(), set(), {}, [1000001, 1000002, 1000003, 1000004], id="dup"),
    pytest.param(
        [{"uid": 0}, {"uid": 1000005}, *REQ[:1]], set(), set(), {}, [1000005, 1000001], id="member"
    ),
    pytest.param(REQ, {1000002}, set(), {}, [1000001, 1000003, 1000004], id="admitted-once"),
    pytest.param(REQ, set(), {1000003}, {}, [1000001, 1000002, 1000004], id="gave-up"),
    pytest.param(REQ, set(), set(), {1000004: 3}, [1000001, 1000002, 1000003], id="tries-used"),
    pytest.param(REQ, set(), set(), {1000004: 2}, [1000001, 1000002, 1000003, 1000004], id="tries"),
    pytest.param(
        [
            {"host": "h"},
            {"uid": "x"},
            {"uid": None},
            {"uid": True},
            {"uid": -3},
            {"uid": "1000009"},
        ],
        set(),
        set(),
        {},
        [1000009],
        id="malformed-records-skipped",
    ),
]


@pytest.mark.parametrize(("requests", "done", "gone", "tries", "want"), PENDING)
def test_pending_joiners(
    requests: list[dict[str, Any]],
    done: set[int],
    gone: set[int],
    tries: dict[int, int],
    want: list[int],
) -> None:
    members = [0, 1]
    assert pending_joiners(requests, members, done, gone, tries, 3) == want
    assert pending_joiners(requests, members, done, gone, lambda u: tries.get(u, 0), 3) == want


def test_pending_joiners_asks_only_about_ids_in_question() -> None:
    asked: list[int] = []

    def tries(uid: int) -> int:
        asked.append(uid)
        return 0

    got = pending_joiners(
        [{"uid": 0}, {"uid": 1000001}, {"uid": 1000001}, {"uid": 1000002}],
        [0, 1],
        {1000002},
        set(),
        tries,
        3,
    )
    assert got == [1000001]
    assert asked == [1000001]


# -- store reads of few requests, whatever the number of ranks --------------------------------
# (The wait loops themselves are tested on a fake clock in test_wait_loops.py.)
def test_present_names_the_missing_keys_in_few_requests() -> None:
    rng = random.Random(5)
    store = CountingStore(dist.HashStore())
    jobs = ctl.JobStore(store)  # type: ignore[arg-type]
    keys = [f"k/{i}" for i in range(1024)]
    for missing in [set(), {7}, {0, 1023}, set(rng.sample(range(1024), 9)), set(range(1024))]:
        for i, k in enumerate(keys):
            if i not in missing:
                store.inner.set(k, "1")
            elif store.inner.check([k]):
                store.inner.delete_key(k)
        store.calls.clear()
        assert jobs._present(keys) == [i not in missing for i in range(1024)]
        if len(missing) <= 2:
            assert store.count("check") <= 1 + 2 * max(1, len(missing)) * 10, len(missing)
        assert store.count("check") <= 2 * len(keys)
    assert jobs._present([]) == []


def test_missing_state_rereads_only_the_ranks_asked_about() -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    jobs = ctl.JobStore(store)  # type: ignore[arg-type]
    for r in (0, 1, 3):
        jobs.post_has_state(7, r)
    base.set("adm/g7/ok/4", "not a record")
    assert jobs.has_state_count(7) == 3
    assert jobs.missing_state(7, 5) == [2, 4]
    store.calls.clear()
    assert jobs.missing_state(7, 5, among=[2, 4]) == [2, 4]
    asked = {"adm/g7/ok/2", "adm/g7/ok/4"}
    assert all(set(keys) <= asked for n, keys in store.calls if n == "check"), store.calls
    jobs.post_has_state(7, 2)
    assert jobs.missing_state(7, 5, among=[2, 4]) == [4]
    assert not jobs.all_have_state(7, 5)


@pytest.mark.parametrize(
    ("count", "gone", "want"),
    [
        pytest.param(5, set(), True, id="all-counted"),
        pytest.param(4, set(), False, id="one-not-counted-not-gone"),
        pytest.param(4, {3}, True, id="one-not-counted-gone"),
        pytest.param(4, {9}, False, id="gone-not-a-candidate"),
        pytest.param(3, {3}, False, id="two-not-counted-one-gone"),
        pytest.param(6, set(), True, id="counted-more-than-valid"),
    ],
)
def test_may_decide(count: int, gone: set[int], want: bool) -> None:
    assert elastic._may_decide(count, gone, [0, 1, 2, 3, 4]) is want


def test_members_read_an_admission_that_does_not_grow_with_the_world() -> None:
    """The decider stores the admission without the member list (every member has its
    own); each member derives the same admission from it, the joiner gets the whole one
    with its rank, and what a member reads is the same size at W = 8 and W = 1024."""
    sizes = {}
    for world in (8, 1024):
        base = dist.HashStore()
        root = ctl.root_prefix(base, "job", "secret")
        jobs = ctl.JobStore(root)
        jobs.init_joins()
        jobs.request_join({"uid": 1000001, "host": "h", "pid": 1})
        decider = elastic.Elastic(uid=0, members=list(range(world)))
        assert elastic._decide(fake_runtime(root, world), decider, jobs, "grow/g0", 4)
        want = Admission(
            at=5, joiners=(1000001,), gen=1, from_gen=0, members=(*range(world), 1000001)
        )
        assert decider.grow == want
        record = jobs.decision("grow/g0")
        assert record is not None
        assert "members" not in record
        sizes[world] = len(base.get(f"{root.prefix}/grow/g0"))
        # Another member derives it from its own copy; one whose copy differs refuses it.
        assert elastic._admission("grow/g0", record, list(range(world))) == want
        with pytest.raises(ControlPlaneError, match="copy differs"):
            elastic._admission("grow/g0", record, [*range(world - 1), 5000])
        assert jobs.admission_for(1000001) == {  # the joiner's record: the wire format
            "at": 5,
            "joiners": [1000001],
            "gen": 1,
            "from": 0,
            "members": [*range(world), 1000001],
            "rank": world,
        }
    assert sizes[1024] <= sizes[8] + 3, sizes  # the digits of the world size
    assert sizes[1024] < 200, sizes


def test_forgetting_a_generation_deletes_its_arrival_counters() -> None:
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    before = base.num_keys()
    jobs = ctl.JobStore(root)
    jobs.post_ready(3, 0)
    jobs.post_has_state(3, 0)
    jobs.post_proposal("rec/g3/r1", P(0).to_json())
    jobs.ack(3, 2, 0, 7)
    assert (jobs.ready_count(3), jobs.has_state_count(3), jobs.proposal_count("rec/g3/r1")) == (
        1,
        1,
        1,
    )
    assert jobs.ack_count(3, 2) == 1
    jobs.forget_generation(3, 1, acked={2})
    assert base.num_keys() == before
