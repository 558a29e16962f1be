"""The diagnosis's verdicts, in one process, from hand-written states: no store, no ranks.

Each row of the tables is one rank's last published state (or answer) and what
``_diagnosis`` must conclude. The expected texts are those the runtime produced before the
diagnosis moved to ``_diagnosis``; the troubleshooting page quotes them.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from resilient_ddp.control._control import HeartbeatState
from resilient_ddp.detection import _diagnosis
from resilient_ddp.detection._diagnosis import Blame, Verdict, majority, majority_rule, root_causes
from resilient_ddp.detection._diagnosis import what_blocks as _what_blocks

_DOCS = Path(__file__).resolve().parent.parent / "docs"
NAME, SEQ, NOW, RECOVERY = "all_reduce", 5, 1000.0, "recovery"


def what_blocks(
    state: HeartbeatState, *, answered: bool = True, stopped: bool = False
) -> Verdict | None:
    return _what_blocks(
        state,
        answered=answered,
        stopped=stopped,
        name=NAME,
        seq=SEQ,
        now=NOW,
        recovery_phase=RECOVERY,
    )


# (id, state, answered, stopped, blame, text)
VERDICTS: list[tuple[str, HeartbeatState, bool, bool, Blame, str]] = [
    (
        "diverged",
        HeartbeatState(seq=5, op="broadcast", in_op=True, status="running"),
        True,
        False,
        Blame.DIVERGED,
        "issued a different collective: broadcast#5",
    ),
    (
        "diverged-then-left",  # judged before its departure
        HeartbeatState(seq=5, op="broadcast", status="left", raised=True),
        True,
        False,
        Blame.DIVERGED,
        "issued a different collective: broadcast#5",
    ),
    (
        "diverged-unanswered",
        HeartbeatState(seq=5, op="barrier", t=NOW - 30),
        False,
        True,
        Blame.DIVERGED,
        "issued a different collective: barrier#5",
    ),
    ("failed", HeartbeatState(seq=3, op="x", status="failed"), True, False, Blame.FAILED, "failed"),
    (
        "failed-unanswered",  # its status says enough: no need to have answered
        HeartbeatState(seq=3, status="failed"),
        False,
        True,
        Blame.FAILED,
        "failed",
    ),
    ("left", HeartbeatState(seq=4, status="left"), True, False, Blame.LEFT, "left the group"),
    (
        "failed-after-own-error",
        HeartbeatState(seq=4, status="failed", raised=True),
        True,
        False,
        Blame.FAILED_AFTER_OWN_ERROR,
        "failed after an error of its own",
    ),
    (
        "left-after-own-error",
        HeartbeatState(seq=4, status="left", raised=True),
        True,
        False,
        Blame.LEFT_AFTER_OWN_ERROR,
        "left the group after an error of its own",
    ),
    (
        "stopped",
        HeartbeatState(seq=4, op="all_reduce", t=NOW - 1),
        False,
        True,
        Blame.STOPPED,
        "is stopped (SIGSTOP or a debugger) and not responding",
    ),
    (
        "not-responding",
        HeartbeatState(seq=4, op="all_reduce", t=NOW - 16.04),
        False,
        False,
        Blame.NOT_RESPONDING,
        "is not responding (last heartbeat 16.0 s ago)",
    ),
    (
        "not-responding-no-state",
        HeartbeatState(),
        False,
        False,
        Blame.NOT_RESPONDING,
        "is not responding (last heartbeat 1000.0 s ago)",
    ),
    (
        "gave-up-raised",
        HeartbeatState(seq=5, op="all_reduce", in_op=False, raised=True),
        True,
        False,
        Blame.GAVE_UP_AFTER_OWN_ERROR,
        "gave up on all_reduce#5 itself, after an error of its own",
    ),
    (
        "gave-up-recovering",
        HeartbeatState(seq=5, op="all_reduce", in_op=False, phase="recovery"),
        True,
        False,
        Blame.GAVE_UP_AFTER_OWN_ERROR,
        "gave up on all_reduce#5 itself, after an error of its own",
    ),
    (
        "never-arrived-idle",
        HeartbeatState(seq=4, op="all_reduce", in_op=False, phase="data"),
        True,
        False,
        Blame.NEVER_ARRIVED_IDLE,
        "never arrived at all_reduce#5: it is outside any collective",
    ),
    (
        "never-arrived-same-seq-not-in-op",  # published seq 5 but left the op (no error)
        HeartbeatState(seq=5, op="all_reduce", in_op=False),
        True,
        False,
        Blame.NEVER_ARRIVED_IDLE,
        "never arrived at all_reduce#5: it is outside any collective",
    ),
    (
        "never-arrived-no-seq",
        HeartbeatState(status="running"),
        True,
        False,
        Blame.NEVER_ARRIVED_IDLE,
        "never arrived at all_reduce#5: it is outside any collective",
    ),
    (
        "never-arrived-in-op",
        HeartbeatState(seq=3, op="broadcast", in_op=True),
        True,
        False,
        Blame.NEVER_ARRIVED_IN_OP,
        "never arrived at all_reduce#5: it is in broadcast#3",
    ),
    (
        "never-arrived-in-op-raised",  # raised, but in an earlier op: not a consequence
        HeartbeatState(seq=3, op="broadcast", in_op=True, raised=True),
        True,
        False,
        Blame.NEVER_ARRIVED_IN_OP,
        "never arrived at all_reduce#5: it is in broadcast#3",
    ),
    (
        "ahead",
        HeartbeatState(seq=7, op="barrier", in_op=True),
        True,
        False,
        Blame.AHEAD,
        "is ahead: already in barrier#7",
    ),
    (
        "ahead-idle",
        HeartbeatState(seq=6, op="broadcast", in_op=False),
        True,
        False,
        Blame.AHEAD,
        "is ahead: already in broadcast#6",
    ),
]


@pytest.mark.parametrize(
    ("state", "answered", "stopped", "blame", "text"),
    [row[1:] for row in VERDICTS],
    ids=[row[0] for row in VERDICTS],
)
def test_what_blocks_verdicts(
    state: HeartbeatState, answered: bool, stopped: bool, blame: Blame, text: str
) -> None:
    assert what_blocks(state, answered=answered, stopped=stopped) == Verdict(blame, text)


def test_a_silent_rank_whose_process_runs_is_not_called_unresponsive() -> None:
    """Not answered, not stopped, but its process runs on this host: its watchdog cannot
    run (a C call that holds the GIL); its silence still shows."""
    state = HeartbeatState(seq=4, op="all_reduce", t=NOW - 16.04)
    verdict = _what_blocks(
        state,
        answered=False,
        stopped=False,
        running=True,
        name=NAME,
        seq=SEQ,
        now=NOW,
        recovery_phase=RECOVERY,
    )
    assert verdict == Verdict(
        Blame.RUNNING_UNHEARD,
        "is not responding (last heartbeat 16.0 s ago) but its process is running: its "
        "watchdog thread cannot run, probably a C call that holds the GIL",
    )
    # A stopped process is stopped, running or not.
    assert what_blocks(state, answered=False, stopped=True).blame is Blame.STOPPED  # type: ignore[union-attr]


def test_every_blame_has_a_row() -> None:
    covered = {row[4] for row in VERDICTS} | {
        Blame.THIS_RANK_DIVERGED,  # majority_rule's
        Blame.RUNNING_UNHEARD,  # its own test above
    }
    assert covered == set(Blame)


@pytest.mark.parametrize(
    "state",
    [
        HeartbeatState(seq=5, op="all_reduce", in_op=True, status="running"),
        HeartbeatState(seq=5, op="all_reduce", in_op=True, raised=True),  # still in it
    ],
)
def test_a_rank_in_the_op_blocks_nothing(state: HeartbeatState) -> None:
    assert what_blocks(state) is None


def test_stopped_is_only_read_for_a_rank_that_did_not_answer() -> None:
    state = HeartbeatState(seq=4, op="all_reduce", in_op=False)
    assert what_blocks(state, answered=True, stopped=True).blame is Blame.NEVER_ARRIVED_IDLE


LEVELS = {
    Blame.DIVERGED: 0,
    Blame.THIS_RANK_DIVERGED: 0,
    Blame.FAILED: 0,
    Blame.LEFT: 0,
    Blame.STOPPED: 0,
    Blame.NOT_RESPONDING: 0,
    Blame.RUNNING_UNHEARD: 0,
    Blame.NEVER_ARRIVED_IDLE: 0,
    Blame.NEVER_ARRIVED_IN_OP: 1,
    Blame.AHEAD: 2,
    Blame.FAILED_AFTER_OWN_ERROR: 3,
    Blame.LEFT_AFTER_OWN_ERROR: 3,
    Blame.GAVE_UP_AFTER_OWN_ERROR: 3,
}


@pytest.mark.parametrize("blame", list(Blame), ids=lambda b: b.name)
def test_levels(blame: Blame) -> None:
    assert blame.level == LEVELS[blame]


def _old_blame_level(what: str) -> int:
    """The runtime's former ranking, which parsed the text (kept to prove the same order)."""
    if what.endswith("after an error of its own"):
        return 3
    if what.startswith("is ahead"):
        return 2
    if what.startswith("never arrived") and "outside any collective" not in what:
        return 1
    return 0


@pytest.mark.parametrize("row", VERDICTS, ids=[row[0] for row in VERDICTS])
def test_level_is_the_one_the_text_used_to_give(row: tuple[Any, ...]) -> None:
    assert row[4].level == _old_blame_level(row[5])


def _v(blame: Blame, **facts: Any) -> Verdict:
    defaults: dict[str, Any] = {
        "name": NAME,
        "seq": SEQ,
        "op": "broadcast",
        "their_seq": 3,
        "silence": 9.0,
        "others": [0],
        "majority": NAME,
    }
    return Verdict.of(blame, **{**defaults, **facts})


# (id, verdicts by rank, ranks named)
ROOT_CAUSES: list[tuple[str, dict[int, Verdict], list[int]]] = [
    ("none", {}, []),
    ("dead-hides-ahead", {1: _v(Blame.FAILED), 2: _v(Blame.AHEAD)}, [1]),
    ("idle-hides-in-op", {1: _v(Blame.NEVER_ARRIVED_IN_OP), 3: _v(Blame.NEVER_ARRIVED_IDLE)}, [3]),
    ("in-op-hides-ahead", {1: _v(Blame.AHEAD), 2: _v(Blame.NEVER_ARRIVED_IN_OP)}, [2]),
    ("ahead-alone", {2: _v(Blame.AHEAD), 3: _v(Blame.AHEAD)}, [2, 3]),
    ("consequence-never-named", {1: _v(Blame.LEFT_AFTER_OWN_ERROR)}, []),
    (
        "consequence-under-ahead",
        {1: _v(Blame.GAVE_UP_AFTER_OWN_ERROR), 2: _v(Blame.AHEAD)},
        [2],
    ),
    (
        "every-root-cause",
        {
            1: _v(Blame.STOPPED),
            2: _v(Blame.NOT_RESPONDING),
            3: _v(Blame.DIVERGED),
            4: _v(Blame.LEFT),
            5: _v(Blame.FAILED_AFTER_OWN_ERROR),
            6: _v(Blame.NEVER_ARRIVED_IN_OP),
        },
        [1, 2, 3, 4],
    ),
]


@pytest.mark.parametrize(
    ("verdicts", "named"), [r[1:] for r in ROOT_CAUSES], ids=[r[0] for r in ROOT_CAUSES]
)
def test_root_causes(verdicts: dict[int, Verdict], named: list[int]) -> None:
    assert root_causes(verdicts) == named


# -- majority ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "ignore", "expected"),
    [
        ([1, 1, 2], None, (1, [2])),
        ({0: "a", 2: "b", 5: "b"}, None, ("b", [0])),
        ([3, 4], None, (3, [1])),  # a tie: the smallest value
        ({1: "y", 0: "x"}, None, ("x", [1])),
        ([0, 7, 0, 7, 7], 0, (7, [])),  # ignored value: neither votes nor is odd
        ([0, 7, 0, 8, 8], 0, (8, [1])),
        (["b", "a", "b", "a"], None, ("a", [0, 2])),
    ],
)
def test_majority(values: Any, ignore: Any, expected: tuple[Any, list[int]]) -> None:
    assert majority(values, ignore=ignore) == expected


def test_majority_without_votes() -> None:
    with pytest.raises(ValueError, match="empty"):
        majority([0, 0], ignore=0)


def test_majority_rule_without_divergence_keeps_every_culprit() -> None:
    verdicts = {1: _v(Blame.NEVER_ARRIVED_IDLE), 2: _v(Blame.AHEAD)}
    assert majority_rule(0, NAME, SEQ, verdicts, {2: "barrier"}) == [1, 2]


def test_majority_rule_this_rank_in_the_majority() -> None:
    # Ranks 0 (this one) and 2 issued all_reduce#5, rank 1 broadcast#5; rank 3 is late.
    verdicts = {
        1: what_blocks(HeartbeatState(seq=5, op="broadcast", in_op=True)),
        3: what_blocks(HeartbeatState(seq=4, op="all_reduce", in_op=False)),
    }
    ops = {1: "broadcast", 2: "all_reduce"}
    kept = majority_rule(0, NAME, SEQ, verdicts, ops)
    assert kept == [1, 3]
    assert root_causes({r: verdicts[r] for r in kept}) == [1, 3]


def test_majority_rule_this_rank_in_the_minority() -> None:
    # This rank (1) issued broadcast#2 while ranks 0 and 2 issued all_reduce#2.
    verdicts = {
        0: Verdict.of(Blame.DIVERGED, op="all_reduce", seq=2),
        2: Verdict.of(Blame.DIVERGED, op="all_reduce", seq=2),
    }
    ruling = majority_rule(1, "broadcast", 2, verdicts, {0: "all_reduce", 2: "all_reduce"})
    assert ruling == Verdict(
        Blame.THIS_RANK_DIVERGED,
        "(this rank) issued broadcast#2 while rank(s) [0, 2] issued all_reduce#2",
    )


@pytest.mark.parametrize(
    ("rank", "name", "other", "other_op", "this_rank_named"),
    [
        (0, "all_reduce", 1, "broadcast", False),  # "all_reduce" sorts first: majority
        (1, "broadcast", 0, "all_reduce", True),  # the other side of the same tie
    ],
)
def test_majority_rule_tie_names_the_same_side_on_every_rank(
    rank: int, name: str, other: int, other_op: str, this_rank_named: bool
) -> None:
    verdicts = {other: Verdict.of(Blame.DIVERGED, op=other_op, seq=SEQ)}
    ruling = majority_rule(rank, name, SEQ, verdicts, {other: other_op})
    if this_rank_named:
        assert ruling == Verdict(
            Blame.THIS_RANK_DIVERGED,
            "(this rank) issued broadcast#5 while rank(s) [0] issued all_reduce#5",
        )
    else:
        assert ruling == [other]


def test_majority_rule_ignores_this_ranks_own_entry_in_ops() -> None:
    verdicts = {1: Verdict.of(Blame.DIVERGED, op="b", seq=1)}
    assert majority_rule(0, "a", 1, verdicts, {0: "zzz", 1: "b", 2: "a"}) == [1]


# -- the texts the docs quote -----------------------------------------------------------------
DOC_QUOTES = [
    Verdict.of(Blame.DIVERGED, op="broadcast", seq=2),
    Verdict.of(
        Blame.THIS_RANK_DIVERGED, name="broadcast", seq=2, others=[0, 2], majority="all_reduce"
    ),
    Verdict.of(Blame.NEVER_ARRIVED_IDLE, name="all_reduce", seq=2),
    Verdict.of(Blame.STOPPED),
    Verdict.of(Blame.NOT_RESPONDING, silence=16.0),
    Verdict.of(Blame.LEFT_AFTER_OWN_ERROR),
]


@pytest.mark.parametrize("verdict", DOC_QUOTES, ids=lambda v: v.blame.name)
def test_troubleshooting_quotes_the_texts(verdict: Verdict) -> None:
    assert verdict.what in (_DOCS / "troubleshooting.md").read_text()


def test_troubleshooting_headings_match_the_templates() -> None:
    text = (_DOCS / "troubleshooting.md").read_text()
    assert (
        Verdict.of(
            Blame.NEVER_ARRIVED_IN_OP, name="all_reduce", seq="N", op="broadcast", their_seq="M"
        ).what
        in text
    )
    assert Verdict.of(Blame.AHEAD, op="x", their_seq=1).what.startswith("is ahead: already in")


def test_the_module_is_pure() -> None:
    tree = ast.parse(Path(_diagnosis.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    assert imported <= {"__future__", "collections", "dataclasses", "enum", "typing"}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
