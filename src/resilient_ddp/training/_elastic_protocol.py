"""The pure decisions of elastic training: no store, no ``torch.distributed``, no runtime.

:mod:`resilient_ddp.training.elastic` moves the records below through the control-plane store and
acts on the decisions; everything here is a function of explicit inputs, so each rule can
be tested with a table of cases.

**Shrink.** Each survivor of generation ``N`` posts a :class:`Proposal`. Once
:func:`should_decide` says so, the survivor that claimed the round (the others wait for it,
and take its place only if it fails) computes :func:`decide_shrink`, and the first
``compare_set`` of a :meth:`ShrinkDecision.to_record` wins.

**Grow.** Members acknowledge the join requests they saw (:func:`needs_ack`); once every
member acknowledged the same count, the first member to see it computes
:func:`decide_admission` over :func:`pending_joiners`, and the first ``compare_set`` of an
:meth:`Admission.to_record` wins.

**Records survivors read are O(failures), not O(W).** Every rank holds its generation's
member list, so a stored decision carries only what a rank cannot derive from it: the lost
ranks (a shrink) or the joiners (an admission), the outcome, and a digest of the new member
list (:func:`members_digest`). Each reader derives the new member list from its own copy
(:meth:`ShrinkDecision.from_record`, :meth:`Admission.from_record`) and checks it against
the digest: a rank whose copy differs from the decider's refuses the decision rather than
form another group.

Claims are checked before they are believed (see :func:`decide_shrink`): a malformed
proposal, one from a rank that is not a candidate, one whose member id another proposal
also claims, or one whose step count is implausible never shapes the decision.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import sys
from array import array
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

__all__ = [
    "Admission",
    "ElasticParticipant",
    "Proposal",
    "ShrinkDecision",
    "decide_admission",
    "decide_shrink",
    "members_digest",
    "needs_ack",
    "parse_proposals",
    "pending_joiners",
    "should_decide",
]

Where = Literal["forward", "reduce"]
Outcome = Literal["redo", "continue", "skip"]
#: ``(old_world, new_world, committed)`` are passed after the candidate step ``at``.
AdmissionStep = Callable[[int, int, int, int], int]

_WHERES: tuple[str, ...] = ("forward", "reduce")
_OUTCOMES: tuple[str, ...] = ("redo", "continue", "skip")


@runtime_checkable
class ElasticParticipant(Protocol):
    """An object whose state follows the job's committed steps, as a data sampler's
    position does (:class:`resilient_ddp.ElasticBatchSampler` is one).

    Register one with :func:`resilient_ddp.register_elastic_participant` on every rank, in
    the same order. Elastic training (``on_failure="shrink"``) then calls, on the training
    thread, between steps or during a recovery or admission:

    * :meth:`on_step_committed` when a gradient reduction completed, with the member ids
      whose gradients it holds (the others' work of that step is to be done again);
    * :meth:`on_step_discarded` when the step in flight is discarded on every member;
    * :meth:`admission_step` when members decide at which step joiners come in: return
      ``at`` or a later step (never earlier);
    * :meth:`on_admission` at that step, with the joiners' member ids; what it returns is
      passed to :meth:`on_admission_failed` if the admission is undone;
    * :meth:`state_dict` on the state source, and :meth:`load_state_dict` on the ranks that
      take its state over (survivors out of step, and joiners). The state travels
      ``weights_only``: plain containers, numbers, strings and tensors.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def on_step_committed(self, contributors: list[int]) -> None: ...

    def on_step_discarded(self) -> None: ...

    def admission_step(self, at: int, world: int, new_world: int, committed: int) -> int: ...

    def on_admission(self, joiners: list[int]) -> Any: ...

    def on_admission_failed(self, undo: Any) -> None: ...


def _is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` proper (``bool`` is not a count or a rank)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(obj: Mapping[str, Any], key: str) -> int:
    value = obj[key]
    if not _is_int(value):
        raise ValueError(f"{key!r} must be an int, got {value!r}")
    return cast(int, value)


def _ints(obj: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = obj[key]
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise ValueError(f"{key!r} must be a list of ints, got {value!r}")
    return tuple(value)


def _resolve(next_generation: Callable[[], int] | int) -> int:
    return next_generation() if callable(next_generation) else next_generation


_DIGEST_CHARS = 16


def _digest(obj: Mapping[str, Any]) -> str:
    value = obj["digest"]
    if not isinstance(value, str) or len(value) != _DIGEST_CHARS:
        raise ValueError(f"'digest' must be a str of {_DIGEST_CHARS} characters, got {value!r}")
    return value


def members_digest(members: Sequence[int]) -> str:
    """A fingerprint of a member list (ids by rank): 16 hex digits of a SHA-256.

    A compact decision carries it in place of the list; a reader that derived the list from
    its own copy checks it against this. It detects copies that differ, not forgeries: the
    record's MAC does that. The ids are hashed as 8-byte little-endian integers (the same
    bytes on every platform; their decimal text if one does not fit): about 15 µs for
    1024 ids, where the text of each would take 80.
    """
    try:
        ids = array("q", members)
    except OverflowError:
        data = ",".join(str(int(m)) for m in members).encode()
    else:
        if sys.byteorder != "little":
            ids.byteswap()
        data = ids.tobytes()
    return hashlib.sha256(data).hexdigest()[:_DIGEST_CHARS]


def _without(items: Sequence[int], lost: Sequence[int]) -> tuple[int, ...]:
    """``items`` without the positions ``lost`` (increasing, within ``items``), in order:
    a slice per run of positions kept, not a test per item (every survivor of a large world
    derives its members this way at once, on a CPU it may share)."""
    bounds = zip((-1, *lost), (*lost, len(items)), strict=True)
    return tuple(itertools.chain.from_iterable(items[a + 1 : b] for a, b in bounds))


# -- shrink ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proposal:
    """One survivor's proposal after a failure in generation ``N``.

    Attributes:
        rank: The proposer's rank in generation ``N``.
        uid: Its member id (stable across generations).
        committed: Gradient reductions it completed (optimizer steps applied).
        where: ``"forward"`` (it failed at the start of a step's forward) or
            ``"reduce"`` (in the step's gradient reduction).
        grads: Whether it still holds its local gradients of the step in flight.
    """

    rank: int
    uid: int
    committed: int
    where: Where
    grads: bool

    def to_json(self) -> dict[str, Any]:
        """The record :mod:`~resilient_ddp.training.elastic` appends to the round's log."""
        return {
            "rank": self.rank,
            "uid": self.uid,
            "committed": self.committed,
            "where": self.where,
            "grads": self.grads,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Proposal:
        """The proposal in a record written by :meth:`to_json`.

        Raises:
            ValueError: The record is malformed (see :meth:`parse`).
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"a proposal is a mapping, got {type(obj).__name__}")
        try:
            rank, uid, committed = _int(obj, "rank"), _int(obj, "uid"), _int(obj, "committed")
            where, grads = obj["where"], obj["grads"]
        except KeyError as e:
            raise ValueError(f"a proposal needs {e.args[0]!r}") from None
        if rank < 0 or committed < 0:
            raise ValueError(f"negative rank or step count in proposal {dict(obj)!r}")
        if where not in _WHERES:
            raise ValueError(f"'where' must be one of {_WHERES}, got {where!r}")
        if not isinstance(grads, bool):
            raise ValueError(f"'grads' must be a bool, got {grads!r}")
        return cls(rank=rank, uid=uid, committed=committed, where=where, grads=grads)

    @classmethod
    def parse(cls, obj: object) -> Proposal | None:
        """Like :meth:`from_json`, but ``None`` for a malformed record.

        Malformed: not a mapping, a missing key, ``rank``/``uid``/``committed`` not an
        ``int`` (a ``bool`` is not one), a negative ``rank`` or ``committed``, ``where``
        other than ``"forward"``/``"reduce"``, or ``grads`` not a ``bool``.
        """
        if not isinstance(obj, Mapping):
            return None
        try:
            return cls.from_json(obj)
        except ValueError:
            return None


def parse_proposals(records: Iterable[object]) -> dict[int, Proposal]:
    """The valid proposals in a round's log, by proposer rank.

    Malformed records are dropped (:meth:`Proposal.parse`). An honest rank posts once per
    round, so a second record under the same rank is not believed: the first one wins.
    """
    out: dict[int, Proposal] = {}
    for record in records:
        p = Proposal.parse(record)
        if p is not None and p.rank not in out:
            out[p.rank] = p
    return out


@dataclass(frozen=True)
class ShrinkDecision:
    """What every survivor of generation ``N`` does after a failure.

    Attributes:
        old_ranks: The next generation's members by their rank in generation ``N``, in
            new-rank order.
        lost: The ranks of generation ``N`` that are not members of the next one.
        fail: Why training cannot go on (every survivor raises), or ``None``. When set,
            only ``old_ranks`` and ``lost`` are meaningful.
        gen: The next generation's number.
        members: Member ids by new rank.
        source: The new rank whose state every other member takes over.
        outcome: For the step in flight: ``"redo"`` its reduction over the survivors,
            ``"continue"`` it, or ``"skip"`` it everywhere.
        sync: Whether the state must be sent from ``source`` (step counts differ).
        committed: The step count every member has once in sync.
    """

    old_ranks: tuple[int, ...]
    lost: tuple[int, ...]
    fail: str | None = None
    gen: int | None = None
    members: tuple[int, ...] = ()
    source: int | None = None
    outcome: Outcome | None = None
    sync: bool = False
    committed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The whole decision as :mod:`~resilient_ddp.training.elastic` acts on it (lists, not
        tuples): the members and their old ranks in full. The store holds the compact
        :meth:`to_record`, from which each survivor derives this.

        A failed decision has only ``old_ranks``, ``lost`` and ``fail``.
        """
        out: dict[str, Any] = {
            "old_ranks": list(self.old_ranks),
            "lost": list(self.lost),
            "fail": self.fail,
        }
        if self.fail is None:
            out.update(
                gen=self.gen,
                members=list(self.members),
                source=self.source,
                outcome=self.outcome,
                sync=self.sync,
                committed=self.committed,
            )
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShrinkDecision:
        """The decision in a dict written by :meth:`to_json`.

        Raises:
            ValueError: A key is missing or of the wrong type.
        """
        try:
            old_ranks, lost, fail = _ints(obj, "old_ranks"), _ints(obj, "lost"), obj["fail"]
            if fail is not None:
                if not isinstance(fail, str):
                    raise ValueError(f"'fail' must be a str or None, got {fail!r}")
                return cls(old_ranks=old_ranks, lost=lost, fail=fail)
            outcome, sync = obj["outcome"], obj["sync"]
            if outcome not in _OUTCOMES:
                raise ValueError(f"'outcome' must be one of {_OUTCOMES}, got {outcome!r}")
            if not isinstance(sync, bool):
                raise ValueError(f"'sync' must be a bool, got {sync!r}")
            return cls(
                old_ranks=old_ranks,
                lost=lost,
                gen=_int(obj, "gen"),
                members=_ints(obj, "members"),
                source=_int(obj, "source"),
                outcome=outcome,
                sync=sync,
                committed=_int(obj, "committed"),
            )
        except KeyError as e:
            raise ValueError(f"a shrink decision needs {e.args[0]!r}") from None

    def to_record(self, members: Sequence[int]) -> dict[str, Any]:
        """The compact record stored under the round's decision key: what a survivor
        cannot derive from its own copy of generation ``N``'s member list, a few dozen
        bytes plus a few per lost rank, whatever the world size.

        ``world`` (generation ``N``'s size), ``lost`` and ``fail``; unless failed, also
        ``gen``, ``source``, ``outcome``, ``sync``, ``committed``, ``digest`` (of
        ``members`` by new rank, :func:`members_digest`) and ``moved``: ``[rank, uid]``
        for each member whose id is not ``members[rank]`` (none when every proposal came
        from the member the decider knows at that rank, as in a job whose ranks agree).
        :meth:`from_record` gives this decision back.

        Args:
            members: Generation ``N``'s member ids by rank, as the decider knows them
                (their number is the world size).

        Raises:
            ValueError: ``old_ranks`` and ``lost`` do not split ``range(len(members))``.
        """
        world = len(members)
        if sorted((*self.old_ranks, *self.lost)) != list(range(world)):
            raise ValueError(
                f"ranks {list(self.old_ranks)} and lost {list(self.lost)} do not split a "
                f"world of {world}"
            )
        out: dict[str, Any] = {"world": world, "lost": list(self.lost), "fail": self.fail}
        if self.fail is None:
            out.update(
                gen=self.gen,
                source=self.source,
                outcome=self.outcome,
                sync=self.sync,
                committed=self.committed,
                digest=members_digest(self.members),
                moved=[
                    [r, uid]
                    for r, uid in zip(self.old_ranks, self.members, strict=True)
                    if members[r] != uid
                ],
            )
        return out

    @classmethod
    def from_record(cls, obj: object, members: Sequence[int]) -> ShrinkDecision:
        """The decision in a record written by :meth:`to_record`, derived with this rank's
        own copy of generation ``N``'s member list: the members are ``members`` without
        the lost ranks, in rank order (with ``moved`` applied), exactly the decider's.

        Args:
            obj: The record read from the store (after its MAC was checked).
            members: Generation ``N``'s member ids by rank, as this rank knows them.

        Raises:
            ValueError: The record is malformed (not a mapping, a key missing or of the
                wrong type, lost ranks not increasing within the world, a moved rank
                not a member, a source outside the members, a negative step count), or
                it was decided over another world size, or the member list derived here
                does not match its digest (this rank's copy differs from the decider's).
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"a shrink decision is a mapping, got {type(obj).__name__}")
        try:
            world, lost, fail = _int(obj, "world"), _ints(obj, "lost"), obj["fail"]
            if world != len(members):
                raise ValueError(
                    f"the decision is over a world of {world} ranks, this rank's generation "
                    f"has {len(members)}"
                )
            if list(lost) != sorted(set(lost)) or any(not 0 <= r < world for r in lost):
                raise ValueError(f"'lost' must be increasing ranks below {world}, got {lost}")
            old_ranks = _without(range(world), lost)
            if fail is not None:
                if not isinstance(fail, str):
                    raise ValueError(f"'fail' must be a str or None, got {fail!r}")
                return cls(old_ranks=old_ranks, lost=lost, fail=fail)
            outcome, sync, moved_raw = obj["outcome"], obj["sync"], obj["moved"]
            if outcome not in _OUTCOMES:
                raise ValueError(f"'outcome' must be one of {_OUTCOMES}, got {outcome!r}")
            if not isinstance(sync, bool):
                raise ValueError(f"'sync' must be a bool, got {sync!r}")
            new = list(_without(members, lost))
            for r, uid in _moved(moved_raw, world, lost).items():
                new[r - bisect.bisect_left(lost, r)] = uid  # its new rank
            source, committed, gen = _int(obj, "source"), _int(obj, "committed"), _int(obj, "gen")
            if not 0 <= source < len(new) or committed < 0:
                raise ValueError(f"source {source} or step count {committed} out of range")
            if _digest(obj) != members_digest(new):
                raise ValueError(
                    "the members derived from this rank's copy of the member list do not "
                    "match the decision's digest: its copy differs from the decider's"
                )
            return cls(
                old_ranks=old_ranks,
                lost=lost,
                gen=gen,
                members=tuple(new),
                source=source,
                outcome=outcome,
                sync=sync,
                committed=committed,
            )
        except KeyError as e:
            raise ValueError(f"a shrink decision needs {e.args[0]!r}") from None


def _moved(raw: object, world: int, lost: Sequence[int]) -> dict[int, int]:
    """A record's ``moved`` list, ``[[rank, uid], ...]``, as ``{rank: uid}``.

    Raises:
        ValueError: Not a list of int pairs, a rank outside ``range(world)`` or in
            ``lost``, or a rank repeated.
    """
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"'moved' must be a list, got {raw!r}")
    out: dict[int, int] = {}
    for pair in raw:
        # Two ints proper (type() is int: a bool is not a rank or an id).
        ints = isinstance(pair, (list, tuple)) and [type(v) for v in pair] == [int, int]
        kept = ints and 0 <= pair[0] < world and pair[0] not in lost
        if not kept or pair[0] in out:
            raise ValueError(f"'moved' must hold [rank, uid] of distinct members, got {pair!r}")
        out[pair[0]] = pair[1]
    return out


def _plausible(proposals: list[Proposal], my_committed: int | None) -> list[Proposal]:
    """The proposals whose step count is within one of the reference (see decide_shrink)."""
    if my_committed is not None:
        return [p for p in proposals if abs(p.committed - my_committed) <= 1]
    out = []
    for p in proposals:
        others = sorted(q.committed for q in proposals if q is not p)
        # The low median: with {n, n + 1, garbage} the honest ones see each other.
        if not others or abs(p.committed - others[(len(others) - 1) // 2]) <= 1:
            out.append(p)
    return out


def decide_shrink(
    proposals: Mapping[int, Proposal],
    *,
    candidates: Collection[int],
    dead: Collection[int],
    generation: int,
    world_size: int,
    min_world_size: int,
    next_generation: Callable[[], int] | int,
    my_committed: int | None = None,
) -> ShrinkDecision:
    """The next generation from the proposals of the survivors of generation ``generation``.

    Only believable proposals count; the others' ranks are lost like silent ones:

    * a proposal filed under another rank than its own (``proposals[r].rank != r``), or
      from a rank not in ``candidates``, is ignored;
    * proposals that claim the same member id are all ignored (ids are unique; which
      one is genuine cannot be told);
    * honest step counts differ by at most one (no reduction completes anywhere before
      every rank entered it), so a count more than one away from ``my_committed`` (the
      deciding rank's own count, when given) is a garbage or inflated claim and ignored.
      Without ``my_committed``, each count is compared with the low median of the
      others' counts. A hostile ``committed=10**9`` thus never becomes the state source.

    Then, as before: too few survivors (fewer than ``min_world_size``) or a minority of
    ``world_size`` (exactly half only when every lost rank is in ``dead``) fail. Otherwise
    the members are the proposers in old-rank order; the state source is the lowest rank
    among those with the most commits; the step in flight is redone when every member is
    in its reduction with its gradients and all counts agree, continued when every member
    is at its forward and all counts agree, and skipped otherwise.

    Args:
        proposals: Proposals by proposer rank (see :func:`parse_proposals`).
        candidates: Ranks of generation ``generation`` still taking part in this round.
        dead: Ranks known dead (crashed, raised or left), not merely silent.
        generation: The generation that failed (used in messages).
        world_size: Its number of ranks.
        min_world_size: The fewest ranks training goes on with.
        next_generation: The next generation's number, or a function that draws it; it
            is called only when the decision is not a failure.
        my_committed: The deciding rank's own step count, the reference for plausibility.

    Returns:
        The decision; ``fail`` is set when training cannot go on.
    """
    believed = [p for r, p in proposals.items() if p.rank == r and r in candidates]
    uids: dict[int, int] = {}
    for p in believed:
        uids[p.uid] = uids.get(p.uid, 0) + 1
    believed = [p for p in believed if uids[p.uid] == 1]
    by_rank = {p.rank: p for p in _plausible(believed, my_committed)}
    ranks = sorted(by_rank)
    n = len(ranks)
    lost = [r for r in range(world_size) if r not in by_rank]
    fail = None
    if n < min_world_size:
        loss = f" the loss of rank(s) {lost}" if lost else ""
        fail = (
            f"only {n} rank(s) survive{loss} in generation {generation}, fewer than "
            f"min_world_size={min_world_size}: training cannot go on"
        )
    elif 2 * n < world_size or (2 * n == world_size and not set(lost) <= set(dead)):
        fail = (
            f"only {n} of {world_size} ranks of generation {generation} reached the "
            f"store together (lost: {lost}, not known dead): a minority does not go on "
            "alone"
        )
    if fail is not None:
        return ShrinkDecision(old_ranks=tuple(ranks), lost=tuple(lost), fail=fail)
    props = [by_rank[r] for r in ranks]
    top = max(p.committed for p in props)
    source = next(i for i, p in enumerate(props) if p.committed == top)
    same = all(p.committed == top for p in props)
    wheres = {p.where for p in props}
    outcome: Outcome
    if same and wheres == {"reduce"} and all(p.grads for p in props):
        outcome = "redo"
    elif same and wheres == {"forward"}:
        outcome = "continue"
    else:
        outcome = "skip"
    return ShrinkDecision(
        old_ranks=tuple(ranks),
        lost=tuple(lost),
        gen=_resolve(next_generation),
        members=tuple(p.uid for p in props),
        source=source,
        outcome=outcome,
        sync=not same,
        committed=top,
    )


def should_decide(
    *,
    waiting: Collection[int],
    gone: Collection[int],
    dead: Collection[int],
    recovering: bool | Callable[[], bool],
    silent_since: float | None,
    now: float,
    grace: float,
    deadline: float,
) -> tuple[bool, float | None]:
    """Whether a survivor stops waiting for proposals and decides now.

    It decides when every rank it waits for is known dead (or none is left), when every
    one of them is known gone (named by the watchdog) and none says it is recovering for
    ``grace`` seconds in a row, or at ``deadline``. A rank a timeout named may only have
    been slower to give up: the grace lets it propose.

    Args:
        waiting: Candidate ranks that have not proposed.
        gone: Ranks the watchdog reported failed (dead or silent).
        dead: Ranks known dead.
        recovering: Whether one of the ``waiting`` ranks not known dead says, in its
            heartbeat, that it is in recovery; a function is called only when needed.
        silent_since: When the ``waiting`` ranks were first all gone and silent, as
            returned by the previous call (``None`` on the first).
        now: The current time (a monotonic clock, like ``deadline``).
        grace: Seconds gone-and-silent ranks are waited for.
        deadline: When the round decides whatever it has.

    Returns:
        ``(decide_now, silent_since)``: pass ``silent_since`` to the next call.
    """
    quiet = (
        bool(waiting)
        and all(r in gone for r in waiting)
        and not (recovering() if callable(recovering) else recovering)
    )
    since = (now if silent_since is None else silent_since) if quiet else None
    decide = (
        all(r in dead for r in waiting)
        or (since is not None and now - since >= grace)
        or now >= deadline
    )
    return decide, since


# -- grow --------------------------------------------------------------------------------------
def needs_ack(acked: tuple[int, int], *, generation: int, requests: int) -> bool:
    """Whether a member that last acknowledged ``acked`` (``(generation, requests)``, or
    ``(-1, -1)`` for none) must acknowledge again: its generation or the number of
    requests changed since."""
    return acked != (generation, requests)


def pending_joiners(
    requests: Iterable[Mapping[str, Any]],
    members: Collection[int],
    done: Container[int],
    gone: Container[int],
    tries: Mapping[int, int] | Callable[[int], int],
    max_tries: int,
) -> list[int]:
    """The member ids of the join requests to admit now, in request order, once each.

    A request is skipped when its id is a member already, was admitted once (``done``:
    a member since, maybe gone), gave up (``gone``), or failed ``max_tries`` admissions
    (``tries``; never arrived: dead or unreachable). A record without a non-negative
    integer ``uid`` is skipped. ``done``, ``gone`` and ``tries`` are asked, in that order,
    only about ids still in question, so store-backed lazy lookups cost what they did.
    """
    out: list[int] = []
    for req in requests:
        raw = req.get("uid") if isinstance(req, Mapping) else None
        if isinstance(raw, bool):
            continue
        try:
            uid = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if uid < 0:
            continue
        if uid in members or uid in out or uid in done or uid in gone:
            continue
        count = tries(uid) if callable(tries) else tries.get(uid, 0)
        if count >= max_tries:
            continue
        out.append(uid)
    return out


@dataclass(frozen=True)
class Admission:
    """The members' decision to admit joiners.

    Attributes:
        at: The admission step: members admit at the first forward with at least ``at``
            steps committed.
        joiners: The joiners' member ids, in their new-rank order after the members.
        gen: The grown generation's number.
        from_gen: The generation the members are in (``"from"`` in JSON).
        members: Member ids by new rank: the members, then the joiners.
    """

    at: int
    joiners: tuple[int, ...]
    gen: int
    from_gen: int
    members: tuple[int, ...]

    @property
    def old_world(self) -> int:
        """How many ranks the generation had before the admission."""
        return len(self.members) - len(self.joiners)

    def rank_of(self, uid: int) -> int:
        """The new rank of member id ``uid``.

        Raises:
            ValueError: ``uid`` is not a member of the grown generation.
        """
        return self.members.index(uid)

    def to_json(self) -> dict[str, Any]:
        """The whole admission: what each joiner's record ``join/adm/<uid>`` holds (with its
        ``rank`` added), and what a member acts on once it derived it from the compact
        :meth:`to_record` stored under ``grow/g<from>``."""
        return {
            "at": self.at,
            "joiners": list(self.joiners),
            "gen": self.gen,
            "from": self.from_gen,
            "members": list(self.members),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Admission:
        """The admission in a dict written by :meth:`to_json` (other keys are ignored).

        Raises:
            ValueError: A key is missing or of the wrong type.
        """
        try:
            return cls(
                at=_int(obj, "at"),
                joiners=_ints(obj, "joiners"),
                gen=_int(obj, "gen"),
                from_gen=_int(obj, "from"),
                members=_ints(obj, "members"),
            )
        except KeyError as e:
            raise ValueError(f"an admission needs {e.args[0]!r}") from None

    def to_record(self) -> dict[str, Any]:
        """The compact record stored under ``grow/g<from>``, which every member reads: the
        members before the admission are left out (each has its own copy), so its size
        grows with the joiners, not the world. ``world`` is their number and ``digest``
        that of :attr:`members` (:func:`members_digest`); :meth:`from_record` gives this
        admission back. A joiner, which has no copy, reads :meth:`to_json` instead."""
        return {
            "at": self.at,
            "joiners": list(self.joiners),
            "gen": self.gen,
            "from": self.from_gen,
            "world": self.old_world,
            "digest": members_digest(self.members),
        }

    @classmethod
    def from_record(cls, obj: object, members: Sequence[int]) -> Admission:
        """The admission in a record written by :meth:`to_record`, derived with this
        member's own copy of the current member list: ``members`` then the joiners.

        Args:
            obj: The record read from the store (after its MAC was checked).
            members: The current generation's member ids by rank, as this member knows them.

        Raises:
            ValueError: The record is malformed (not a mapping, a key missing or of the
                wrong type, no joiner, a joiner repeated or a member already), it was
                decided over another world size, or the member list derived here does not
                match its digest (this member's copy differs from the decider's).
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"an admission is a mapping, got {type(obj).__name__}")
        try:
            world, joiners = _int(obj, "world"), _ints(obj, "joiners")
            if world != len(members):
                raise ValueError(
                    f"the admission is over a world of {world} ranks, this member's "
                    f"generation has {len(members)}"
                )
            new = (*members, *joiners)
            unique = set(joiners)
            if not joiners or len(unique) != len(joiners) or not unique.isdisjoint(members):
                raise ValueError(f"joiners {list(joiners)} are none, repeat or are members")
            if _digest(obj) != members_digest(new):
                raise ValueError(
                    "the members derived from this member's copy of the member list do not "
                    "match the admission's digest: its copy differs from the decider's"
                )
            return cls(
                at=_int(obj, "at"),
                joiners=joiners,
                gen=_int(obj, "gen"),
                from_gen=_int(obj, "from"),
                members=new,
            )
        except KeyError as e:
            raise ValueError(f"an admission needs {e.args[0]!r}") from None


def decide_admission(
    *,
    committed: int,
    members: Sequence[int],
    pending: Sequence[int],
    next_generation: Callable[[], int] | int,
    generation: int,
    samplers_step: AdmissionStep | Iterable[AdmissionStep] | None,
    acked: int | None = None,
) -> Admission:
    """The admission of ``pending`` joiners, decided by a member with ``committed`` steps.

    The step is ``acked + 1``: the largest committed step count in the members'
    acknowledgements plus one. Each member looks for the decision at every step boundary
    after its acknowledged count and cannot pass one without it, so none can be past
    that step (without ``acked``: the decider's next step boundary, ``committed + 1``).
    Each elastic sampler may then move it later, to where the joiners get full slots
    (:meth:`ElasticParticipant.admission_step`, given the decider's ``committed``),
    applied in turn.

    Args:
        committed: The deciding member's committed step count.
        members: The current generation's member ids by rank.
        pending: The joiners to admit (:func:`pending_joiners`).
        next_generation: The grown generation's number, or a function that draws it
            (called once).
        generation: The current generation.
        samplers_step: One participant's ``admission_step``, several (applied in order), or
            ``None``.
        acked: The largest committed step count the members acknowledged the requests
            with (at least ``committed - 1``: the members are within a step of each other).

    Raises:
        ValueError: ``pending`` is empty or names a member, ``acked`` is below
            ``committed - 1``, or a sampler moved the step
            earlier (a member could be past it before it reads the decision).
    """
    if not pending:
        raise ValueError("decide_admission: no joiner to admit")
    if any(uid in members for uid in pending) or len(set(pending)) != len(pending):
        raise ValueError(f"decide_admission: joiners {list(pending)} repeat or are members")
    steps: Iterable[AdmissionStep]
    if samplers_step is None:
        steps = ()
    elif callable(samplers_step):
        steps = (samplers_step,)
    else:
        steps = samplers_step
    world, new_world = len(members), len(members) + len(pending)
    if acked is not None and acked < committed - 1:
        raise ValueError(
            f"decide_admission: acknowledged step {acked} is more than a step before the "
            f"decider's {committed}"
        )
    at = committed + 1 if acked is None else acked + 1
    for step in steps:
        moved = step(at, world, new_world, committed)
        if moved < at:
            raise ValueError(
                f"decide_admission: a sampler moved the admission step {at} to {moved}"
            )
        at = moved
    return Admission(
        at=at,
        joiners=tuple(pending),
        gen=_resolve(next_generation),
        from_gen=generation,
        members=(*members, *pending),
    )
