"""Why an op cannot complete: a typed verdict per rank, and which ranks to name.

Pure functions of the ranks' last published states: no store, no process group, no
:class:`~resilient_ddp.runtime._runtime.Runtime`.
:func:`resilient_ddp.detection._store_diagnosis.diagnose` gathers the
states and asks this module for the verdicts:

* :func:`what_blocks`: why one rank keeps an op from completing, as a :class:`Verdict`
  (a :class:`Blame` and the one-line English text that failure messages quote);
* :func:`majority_rule`: when ranks issued different collectives at the same sequence
  number, the minority is to blame, which may be this rank itself;
* :func:`root_causes`: among the remaining culprits, only the most basic causes are named
  (:attr:`Blame.level`).

Every text of a verdict is built here, once, from :class:`Blame` templates; the
troubleshooting page quotes them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__: list[str] = []

_Vote = TypeVar("_Vote", int, str)  # what ranks vote on in majority()


class Blame(enum.Enum):
    """The kind of a verdict on a rank. Each value is the template of its text.

    The template's fields are the facts :meth:`Verdict.of` takes: ``name`` and ``seq`` (the
    op this rank waits in), ``op`` and ``their_seq`` (the op the rank judged is in),
    ``silence`` (seconds since its last heartbeat), ``others`` and ``majority`` (the ranks
    of the majority and the op they issued).
    """

    #: At the same sequence number it issued another collective.
    DIVERGED = "issued a different collective: {op}#{seq}"
    #: This rank is in the minority of the ranks that diverged (it names itself).
    THIS_RANK_DIVERGED = (
        "(this rank) issued {name}#{seq} while rank(s) {others} issued {majority}#{seq}"
    )
    #: Its process failed (a crash its watchdog or a peer reported).
    FAILED = "failed"
    #: It left the group (destroy_process_group or a normal exit) before the op.
    LEFT = "left the group"
    #: It failed after raising one of the library's errors itself: a consequence.
    FAILED_AFTER_OWN_ERROR = "failed after an error of its own"
    #: It left after raising one of the library's errors itself: a consequence.
    LEFT_AFTER_OWN_ERROR = "left the group after an error of its own"
    #: Its process is stopped (SIGSTOP, a debugger), seen on this host.
    STOPPED = "is stopped (SIGSTOP or a debugger) and not responding"
    #: It did not answer the diagnosis request.
    NOT_RESPONDING = "is not responding (last heartbeat {silence:.1f} s ago)"
    #: It did not answer, but its process runs on this host: its watchdog thread cannot
    #: (a C call that holds the GIL). Busy, not dead.
    RUNNING_UNHEARD = (
        "is not responding (last heartbeat {silence:.1f} s ago) but its process is running: "
        "its watchdog thread cannot run, probably a C call that holds the GIL"
    )
    #: It arrived, then gave up on the op itself after an error of its own: a consequence.
    GAVE_UP_AFTER_OWN_ERROR = "gave up on {name}#{seq} itself, after an error of its own"
    #: It never arrived at the op and is in no collective (the usual hang).
    NEVER_ARRIVED_IDLE = "never arrived at {name}#{seq}: it is outside any collective"
    #: It never arrived at the op because it waits in an earlier one.
    NEVER_ARRIVED_IN_OP = "never arrived at {name}#{seq}: it is in {op}#{their_seq}"
    #: It is already in a later op (it may simply have completed its part).
    AHEAD = "is ahead: already in {op}#{their_seq}"

    @property
    def level(self) -> int:
        """How basic a cause this is: 0 a root cause, 1 blocked in another op, 2 ahead, 3 a
        consequence of an error of its own (never named). Only the lowest level present
        is named (:func:`root_causes`)."""
        return _LEVELS.get(self, 0)


_LEVELS: dict[Blame, int] = {
    Blame.NEVER_ARRIVED_IN_OP: 1,
    Blame.AHEAD: 2,
    Blame.FAILED_AFTER_OWN_ERROR: 3,
    Blame.LEFT_AFTER_OWN_ERROR: 3,
    Blame.GAVE_UP_AFTER_OWN_ERROR: 3,
}
# Levels that root_causes() may name, most basic first.
_NAMED_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class Verdict:
    """Why one rank keeps an op from completing.

    Attributes:
        blame: The kind of verdict.
        what: Its one-line English text (a culprit's ``what``), built by :meth:`of`.
    """

    blame: Blame
    what: str

    @classmethod
    def of(cls, blame: Blame, **facts: Any) -> Verdict:
        """Build a verdict, its text from ``blame``'s template and ``facts``.

        Args:
            blame: The kind of verdict.
            **facts: The template's fields (see :class:`Blame`).

        Returns:
            The verdict.

        Raises:
            KeyError: A field of the template is missing from ``facts``.
        """
        return cls(blame, blame.value.format(**facts))


class Heartbeat(Protocol):
    """What :func:`what_blocks` reads of a rank's last published state: the fields of a
    ``control._control.HeartbeatState`` (which this pure module does not import), each
    None or False where the rank did not say it."""

    @property
    def seq(self) -> int | None:
        """The sequence number of its last collective."""

    @property
    def op(self) -> str | None:
        """That collective's name."""

    @property
    def in_op(self) -> bool:
        """Whether it waits in that collective."""

    @property
    def phase(self) -> str | None:
        """The phase of its step."""

    @property
    def status(self) -> str | None:
        """``running``, ``left`` or ``failed``."""

    @property
    def raised(self) -> bool:
        """Whether it raised a failure error."""

    @property
    def t(self) -> float | None:
        """Its wall clock when it published the state."""


def what_blocks(  # noqa: PLR0911 - one return per verdict
    state: Heartbeat,
    *,
    answered: bool,
    stopped: bool,
    running: bool = False,
    name: str,
    seq: int,
    now: float,
    recovery_phase: str,
) -> Verdict | None:
    """Why a rank keeps op ``name#seq`` from completing, if it does.

    Args:
        state: The rank's last published state (its answer to the diagnosis request if it
            answered, else its last heartbeat; an empty ``HeartbeatState()`` if none).
        answered: Whether it answered the diagnosis request (or is no longer running).
        stopped: Whether its process is stopped on this host (read only if it did not
            answer).
        running: Whether its process is running on this host (read only if it did not
            answer and is not stopped).
        name: The op this rank waits in.
        seq: That op's sequence number.
        now: The wall-clock time (``time.time()``), to age its last heartbeat.
        recovery_phase: The phase a rank shows while it recovers from a failure.

    Returns:
        The verdict, or ``None`` if the rank is in the op and blocks nothing.
    """
    their_op = state.op
    if state.seq == seq and their_op != name:
        # Judged before its departure: it may have left because of its own divergence.
        return Verdict.of(Blame.DIVERGED, op=their_op, seq=seq)
    status = state.status
    if status in ("left", "failed"):
        # After raising one of our errors itself, it is a consequence (see Blame.level).
        if status == "left":
            return Verdict.of(Blame.LEFT_AFTER_OWN_ERROR if state.raised else Blame.LEFT)
        return Verdict.of(Blame.FAILED_AFTER_OWN_ERROR if state.raised else Blame.FAILED)
    if not answered:
        if stopped:
            return Verdict.of(Blame.STOPPED)
        silence = now - (0.0 if state.t is None else float(state.t))
        if running:
            return Verdict.of(Blame.RUNNING_UNHEARD, silence=silence)
        return Verdict.of(Blame.NOT_RESPONDING, silence=silence)
    their_seq = -1 if state.seq is None else state.seq
    in_op = state.in_op
    if their_seq == seq and not in_op and (state.raised or state.phase == recovery_phase):
        # It arrived, and gave up on the op first (its own deadline fired a moment
        # earlier): a consequence, like this rank's own timeout, never a cause.
        return Verdict.of(Blame.GAVE_UP_AFTER_OWN_ERROR, name=name, seq=seq)
    if their_seq < seq or (their_seq == seq and not in_op):
        if in_op:
            return Verdict.of(
                Blame.NEVER_ARRIVED_IN_OP, name=name, seq=seq, op=their_op, their_seq=their_seq
            )
        return Verdict.of(Blame.NEVER_ARRIVED_IDLE, name=name, seq=seq)
    if their_seq > seq:
        return Verdict.of(Blame.AHEAD, op=their_op, their_seq=their_seq)
    return None


def majority(
    values: Mapping[int, _Vote] | Sequence[_Vote], ignore: _Vote | None = None
) -> tuple[_Vote, list[int]]:
    """The majority vote of the ranks: the most common value and the odd ranks out.

    Args:
        values: Each rank's value, by rank (a mapping of rank to value, or a sequence
            indexed by rank); ranks absent from a mapping do not vote.
        ignore: A rank holding this value agrees with every value (it neither votes nor is
            odd).

    Returns:
        ``(majority_value, odd_ranks)``: the most common value (ties: the smallest) and the
        sorted ranks whose value differs from it. Every rank that sees the same values
        names the same majority and the same odd ranks.

    Raises:
        ValueError: No rank voted.
    """
    by_rank = list(values.items() if isinstance(values, Mapping) else enumerate(values))
    counts: dict[_Vote, int] = {}
    for _, v in by_rank:
        if v != ignore:
            counts[v] = counts.get(v, 0) + 1
    common = max(sorted(counts), key=lambda v: counts[v])
    return common, sorted(r for r, v in by_rank if v not in (common, ignore))


def majority_rule(
    rank: int,
    name: str,
    seq: int,
    verdicts: Mapping[int, Verdict],
    ops: Mapping[int, str],
) -> list[int] | Verdict:
    """Settle a divergence: the ranks in the minority are to blame, maybe this rank.

    Each side of a divergence sees the other as different; the :func:`majority` vote of
    the ops issued at ``seq`` decides, so that every rank names the same rank(s).

    Args:
        rank: This rank.
        name: The op this rank issued at ``seq``.
        seq: The sequence number.
        verdicts: The other ranks' verdicts (the culprits so far), by rank.
        ops: The op each other rank issued at ``seq``, by rank (ranks at another sequence
            number absent). This rank's entry, if any, is ignored: it issued ``name``.

    Returns:
        The sorted ranks of ``verdicts`` still to blame (all of them when none diverged),
        or, when this rank is in the minority, the verdict on this rank
        (:attr:`Blame.THIS_RANK_DIVERGED`): it alone is to blame.
    """
    if not any(v.blame is Blame.DIVERGED for v in verdicts.values()):
        return sorted(verdicts)
    issued = {**ops, rank: name}
    common, _ = majority(issued)
    if common == name:
        return sorted(
            r for r, v in verdicts.items() if v.blame is not Blame.DIVERGED or issued.get(r) != name
        )
    others = sorted(r for r, op in issued.items() if op == common)
    return Verdict.of(Blame.THIS_RANK_DIVERGED, name=name, seq=seq, others=others, majority=common)


def root_causes(verdicts: Mapping[int, Verdict]) -> list[int]:
    """The ranks to name: those of the most basic cause present.

    A rank blocked in an earlier collective is waiting on someone else; a rank ahead may
    simply have completed its part (a broadcast receiver does not wait for the others).
    Each is named only when nothing more basic explains the stall (then it skipped or
    diverged). A consequence of an error of its own (level 3) is never named.

    Args:
        verdicts: The culprits' verdicts, by rank.

    Returns:
        The sorted ranks whose verdict has the lowest level of 0, 1 and 2 present; empty
        if there is none.
    """
    for level in _NAMED_LEVELS:
        named = sorted(r for r, v in verdicts.items() if v.blame.level == level)
        if named:
            return named
    return []
