"""Elastic training (``on_failure="shrink"``): survivors go on, replacements join.

Everything here goes through the control-plane store, never through the broken data plane.

**Shrink.** A rank whose ``ResilientDDP`` forward or gradient reduction fails because a
peer failed posts a proposal under ``rd/rec/g<N>/r<k>/``: its member id, how many steps it
has committed (gradient reductions completed), and where it is (``forward`` or
``reduce``, with or without its local gradients). Once every rank of generation ``N`` has
proposed or is known to have failed (the watchdog's reports), or ``op_timeout`` passed, the
first rank to claim the round reads the proposals, decides and publishes the decision; the
others wait for it, reading one key a poll, and decide themselves only if that rank fails
or does not publish in time. The first decision stored (``compare_set``) wins, so every
rank acts on the same one. It names the lost ranks, not the members: each rank derives the
members and their new ranks from its own copy of the generation's member list, so what
each survivor reads does not grow with the world:

* the members of the next generation (those that proposed, in their old order);
* the outcome for the step in flight: ``redo`` its reduction over the survivors (every
  survivor was in the reduction of the same step and has its local gradients),
  ``continue`` (every survivor was at the start of the same step's forward), or ``skip``
  it on every survivor (mixed positions);
* the state source: the lowest rank among those that committed the most steps (counts
  differ by at most one, since a reduction completes nowhere before every rank entered
  it); the others take its model, optimizer, sampler and counter state over the new group.

Too few survivors (``min_world_size``) or a minority of the previous generation (half is
enough only when the lost ranks are known dead, not merely silent) make every survivor raise
:class:`RankFailureError`: a partitioned minority never trains on its own. A failure while
the new group forms (or while state is sent) starts another round.

**Grow.** A process started with ``RESILIENT_DDP_JOINER=1`` posts a join request. The
members' watchdogs see it (an authenticated request: with a job secret, a request without a
valid MAC is ignored); each member then acknowledges at its next forward, keyed by the
generation and the number of requests it saw, and the first member that sees every
acknowledgement fixes the admission step ``S``: its own next step boundary
(``committed + 1``), moved later by elastic samplers to where the joiners get full slots.
Every member reads the decision before reaching ``S``, because no rank can pass a
reduction another has not entered. The pure decisions (shrink, admission, acks, pending
joiners) live in :mod:`._elastic_protocol`. At the forward of
step ``S`` the members and the joiners form the next generation and rank 0 sends the state.
Healthy steps pay nothing for this: no store call, no vote, only a flag check.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from resilient_ddp.base import _clock, _timings
from resilient_ddp.config import ResilienceConfig
from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _events
from resilient_ddp.control._events import rank_log
from resilient_ddp.errors import ControlPlaneError, RankFailureError, ResilientDDPError
from resilient_ddp.inference._guest import Guest
from resilient_ddp.runtime._runtime import RECOVERY_PHASE, Runtime, phase
from resilient_ddp.training import _elastic_protocol as proto
from resilient_ddp.training._elastic_protocol import ElasticParticipant

__all__ = ["ElasticParticipant", "register_elastic_participant"]

log = logging.getLogger("resilient_ddp")

JOINER_ENV = "RESILIENT_DDP_JOINER"
UID_ENV = "RESILIENT_DDP_UID"
# Wait loops poll the store from every rank at once: a few requests a poll, each one a
# counter or a decision key, never every rank's key (see _Tally), at the intervals of a
# ctl.Backoff.
_RECHECK_S = 0.1  # while waiting for acknowledgements: how often the requests are re-read
# The heartbeat phase of a rank that sends or receives an admission's state: busy, not
# missing, however long a large state takes.
TRANSFER_PHASE = "state transfer"
_MAX_JOIN_TRIES = 3  # admissions failed by a joiner itself before it gives up
_GUEST_LOOK_S = 0.1  # how often a waiting joiner reads the inference record (one get)


@dataclass
class Elastic:
    """One process's elastic state (``Runtime.elastic``); read by the sampler and stats."""

    uid: int
    members: list[int]  # member ids by rank, current generation
    committed: int = 0  # gradient reductions committed (= optimizer steps applied)
    skip_step: bool = False  # the next optimizer step must not apply (discarded step)
    rebuild: bool = False  # ResilientDDP's reducer must be rebuilt at the next forward
    join_seen: bool = False  # the watchdog saw join requests
    joins_seen: int = 0
    # (generation, number of join requests) this rank acknowledged: one round of acks
    acked: tuple[int, int] = (-1, -1)
    # (generation, committed steps) of this rank's first acknowledgement in that
    # generation: it looks for the admission at every step boundary after that one
    first_ack: tuple[int, int] = (-1, -1)
    # Acknowledgements come from the watchdog and from the training thread: one at a time,
    # so that what is posted and first_ack agree.
    ack_lock: threading.Lock = field(default_factory=threading.Lock)
    first_ack_t: float = 0.0  # time.time() of that first acknowledgement
    acks_seen: set[int] = field(default_factory=set)  # request counts acked this generation
    grow: proto.Admission | None = None  # the admission decision for this generation
    received: dict[str, Any] | None = None  # joiner: state received at admission
    pending_optim: list[Any] | None = None  # optimizer states to load at the next step
    optimizers: list[weakref.ReferenceType[Any]] = field(default_factory=list)
    # ElasticParticipant objects (the elastic samplers), by weak reference
    samplers: list[weakref.ReferenceType[Any]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    redone: int = 0
    skipped: int = 0
    # World-size changes not yet given to the listeners (delivered before the next step).
    world_changes: list[WorldSizeChange] = field(default_factory=list)
    # Generations this process was a member of whose keys are still in the store:
    # (generation, world size, request counts it acknowledged there)
    past: list[tuple[int, int, set[int]]] = field(default_factory=list)

    def deliver_world_changes(self) -> None:
        """Give the queued world-size changes to the listeners, in order (the training
        thread, before an optimizer step over the model). A listener's exception is logged."""
        changes, self.world_changes = self.world_changes, []
        for change in changes:
            for fn in list(_world_size_listeners.values()):
                try:
                    fn(change)
                except Exception:
                    logger = rank_log.of(change)
                    logger.exception("a world-size listener raised; going on")

    def acknowledge_pending(
        self, rt: Runtime, jobs: ctl.JobStore, generation: int, rank: int, requests: int
    ) -> None:
        """The watchdog saw ``requests`` join requests (as ``rank`` of ``generation``):
        acknowledge them (:func:`acknowledge`) if one is still to be admitted. Every member
        acknowledges a round when, and only when, a request in it is still to be admitted:
        a round that one member would wait for, all complete. Reads the join requests (one
        store call each, a few per request); raises what the store calls raise."""
        if pending_joiners(jobs, self, note=False):
            acknowledge(rt, self, jobs, generation, rank, requests)

    # -- samplers ----------------------------------------------------------------------------
    def live_samplers(self) -> list[Any]:
        return live(self.samplers)

    def commit(self, contributors: list[int]) -> None:
        """A reduction completed with the gradients of ``contributors`` (member ids)."""
        self.committed += 1
        for s in self.live_samplers():
            s.on_step_committed(contributors)

    def rollback(self) -> None:
        """The step in flight is discarded on every member."""
        for s in self.live_samplers():
            s.on_step_discarded()

    def note_world(self, rt: Runtime, why: str, before: int | None = None) -> None:
        """Record the world after a change (``why``: start, shrink, join); with ``before``,
        the world size before it, queue the change for the world-size listeners."""
        if before is not None and self.history:
            self.world_changes.append(
                WorldSizeChange(
                    old_world_size=before,
                    new_world_size=rt.world_size,
                    initial_world_size=int(self.history[0]["world_size"]),
                    step=self.committed,
                    generation=rt.generation,
                    rank=rt.rank,
                    reason="shrink" if why == "shrink" else "join",
                )
            )
        self.history.append(
            {
                "t": time.time(),
                "generation": rt.generation,
                "world_size": rt.world_size,
                "members": list(self.members),
                "step": self.committed,
                "why": why,
            }
        )


@dataclass(frozen=True)
class WorldSizeChange:
    """A change of the job's world size under elastic training, as a listener sees it
    (:func:`add_world_size_listener`).

    Attributes:
        old_world_size: Ranks before the change.
        new_world_size: Ranks after it (this process is one of them).
        initial_world_size: Ranks the job started with.
        step: Steps committed when the change took effect (the next step trains with
            ``new_world_size`` ranks).
        generation: The process group's generation after the change.
        rank: This process's rank after the change.
        reason: ``"shrink"`` (ranks failed) or ``"join"`` (replacements were admitted).
    """

    old_world_size: int
    new_world_size: int
    initial_world_size: int
    step: int
    generation: int
    rank: int
    reason: Literal["shrink", "join"]


_world_size_listeners: OrderedDict[int, Callable[[WorldSizeChange], object]] = OrderedDict()


def add_world_size_listener(fn: Callable[[WorldSizeChange], object]) -> RemovableHandle:
    """Call ``fn(change)`` on every process of the job when the world size changes under
    elastic training (``on_failure="shrink"``): after a shrink and after an admission, on
    the survivors and members and on the joiners alike.

    By default nothing else changes with the world: each rank keeps its batch size, so
    the global batch shrinks with the world (and grows back when replacements join), and
    so does the effective learning rate per sample. ``fn`` is the place to react, e.g. to
    rescale the learning rate (the linear scaling rule)::

        base_lr = 0.1


        def rescale(change: rd.WorldSizeChange) -> None:
            for group in optimizer.param_groups:
                group["lr"] = base_lr * change.new_world_size / change.initial_world_size


        rd.add_world_size_listener(rescale)

    ``fn`` runs on the training thread just before the next ``step()`` of an optimizer over
    the model's parameters, once per change (several changes before one step: in order),
    after a joiner's optimizer received the members' state: a parameter-group change made
    there applies to that step on every rank alike. Set values from the change (as above),
    not relative to the current ones: a joiner loads the members' values from before the
    change. Without elastic training it is never called.

    Args:
        fn: Called with a :class:`WorldSizeChange`; its return value is ignored.

    Returns:
        A handle whose ``remove()`` takes the listener off again.
    """
    handle = RemovableHandle(_world_size_listeners)
    _world_size_listeners[handle.id] = fn
    return handle


def register_elastic_participant(obj: ElasticParticipant) -> None:
    """Make ``obj`` follow the job's committed steps under elastic training.

    Call it on every rank, in the same order, after ``init_process_group``; the objects are
    held by weak reference. In a process that joined a running job, ``obj`` takes over the
    state the job's participant of the same position had (``load_state_dict``) at once.
    Without elastic training (``on_failure`` other than ``"shrink"``, or no process group)
    it does nothing.

    Raises:
        TypeError: ``obj`` lacks a method of :class:`ElasticParticipant`.
    """
    from resilient_ddp.runtime import _runtime

    if not isinstance(obj, ElasticParticipant):
        raise TypeError(
            f"{type(obj).__name__} is not an ElasticParticipant: it needs state_dict, "
            "load_state_dict, on_step_committed, on_step_discarded, admission_step, "
            "on_admission and on_admission_failed"
        )
    rt = _runtime.current()
    el: Elastic | None = getattr(rt, "elastic", None) if rt is not None else None
    if el is None:
        return
    index = len(el.live_samplers())
    el.samplers.append(weakref.ref(obj))
    received = el.received.get("samplers") if el.received is not None else None
    if received is not None and index < len(received):
        obj.load_state_dict(received[index])


def live(refs: list[weakref.ReferenceType[Any]]) -> list[Any]:
    """The objects behind ``refs`` that still exist, in order."""
    out = [r() for r in refs]
    return [o for o in out if o is not None]


_F = TypeVar("_F", bound=Callable[..., Any])
# What a store call raises when the store's host is gone or does not answer in time.
_STORE_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(dist, name) for name in ("DistNetworkError", "DistStoreError") if hasattr(dist, name)
)


def _typed_store_errors(what: str) -> Callable[[_F], _F]:
    """Report a store call of the elastic protocol that fails as a
    :class:`ControlPlaneError` naming what the protocol was doing and, where it can, the
    rank that hosted the store (a ``DistNetworkError`` from ``forward()``, or "the store
    is unreachable" alone, would say neither)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ControlPlaneError as e:
                cause = e.__cause__
                if (
                    e.culprits
                    or isinstance(cause, ResilientDDPError)  # also a RuntimeError: ours
                    or not isinstance(cause, (RuntimeError, OSError))
                ):
                    raise  # not a store call that failed, or it names who it can already
                rt = args[0] if args and isinstance(args[0], Runtime) else None
                raise _store_error(rt, what, cause) from cause
            except _STORE_ERRORS as e:
                rt = args[0] if args and isinstance(args[0], Runtime) else None
                raise _store_error(rt, what, e) from e

        return wrapper  # type: ignore[return-value]

    return decorate


def _store_error(rt: Runtime | None, what: str, e: BaseException) -> ControlPlaneError:
    """The error for a store that stopped answering during elastic ``what``, naming the
    rank that hosted it where that is known."""
    host = rt.store_host_culprit() if rt is not None else None
    who = f"rank {rt.rank}" if rt is not None else "this process"
    message = (
        f"{who}: the control-plane store stopped answering during elastic {what} "
        f"({type(e).__name__}: {e})"
    )
    if host is not None:
        message += f"; rank {host.rank} hosted it and {host.what}"
    if rt is not None:
        rt.mark_raised()
    return ControlPlaneError(
        message,
        culprits=[host] if host is not None else [],
        generation=rt.generation if rt is not None else 0,
    )


def setup(rt: Runtime) -> None:
    """Give a runtime of generation 0 its elastic state (``on_failure="shrink"``)."""
    if rt.config.on_failure != "shrink" or getattr(rt, "elastic", None) is not None:
        return
    # The counter first: the watchdog reads it in its poll once rt.elastic is set.
    _jobs(rt.control_root).init_joins()
    # The first generation's member ids are its ranks; joiners get other ids.
    el = Elastic(uid=rt.rank, members=list(range(rt.world_size)))
    rt.start_elastic(el)
    el.note_world(rt, "start")


# -- shrink ------------------------------------------------------------------------------------
@_typed_store_errors("recovery")
def recover(
    rt: Runtime,
    *,
    where: str,
    has_grads: bool,
    cause: BaseException,
    snapshot: Callable[[], dict[str, Any]],
    load: Callable[[dict[str, Any]], None],
) -> proto.ShrinkDecision:
    """Agree on the next generation with the other survivors, form it, and make every
    survivor's state identical. Blocks at most a few ``op_timeout``.

    Returns:
        The decision followed (never a failed one: ``outcome`` is ``"redo"``,
        ``"continue"`` or ``"skip"``).

    Raises:
        RankFailureError: Too few survivors, a minority, this rank was removed from the
            group, or no new generation could be formed within the budget.
        ControlPlaneError: The store stopped answering (its host died).
    """
    el = rt.elastic_state()
    t0 = _clock.monotonic()
    if isinstance(cause, RankFailureError):
        rt.notify_failure(cause)  # if the failed op did not already
    rt.phase = RECOVERY_PHASE  # peers waiting for this rank's proposal see it coming
    if rt.watchdog is not None:
        rt.watchdog.poke()
    cfg = rt.config
    budget = _timings.shrink_recovery_budget(cfg)
    # A failed admission is recovered by the members of the generation it started from:
    # the joiners were never part of the job (they wait for another admission).
    gen_from = getattr(cause, "gen_from", rt.generation)
    world_before = world = getattr(cause, "world_from", rt.world_size)
    # The watchdog's record, or else what the failed op itself found.
    first_culprits = _culprits(rt) or list(getattr(cause, "culprits", None) or [])
    round_, candidates = 0, list(range(world))
    while True:
        if _clock.monotonic() - t0 > budget:
            rt.mark_raised()
            raise rt.notify_failure(
                RankFailureError(
                    f"rank {rt.rank}: no new generation could be formed within {budget:.0f} s "
                    "after a failure; giving up",
                    culprits=first_culprits,
                    generation=rt.generation,
                )
            ) from cause
        dec = _agree(
            rt,
            el,
            ctl.JobKeys.shrink_round(gen_from, round_),
            candidates,
            where,
            has_grads,
            (gen_from, world),
        )
        if dec.fail:
            rt.mark_raised()
            _mark_ended(rt.control_root, el, dec.fail)
            raise rt.notify_failure(
                RankFailureError(
                    dec.fail + "".join("\n" + c.describe() for c in first_culprits),
                    culprits=first_culprits,
                    generation=rt.generation,
                )
            ) from cause
        # One that did not fail names both (ShrinkDecision.from_record).
        assert dec.gen is not None
        assert dec.source is not None
        if el.uid not in dec.members:
            rt.mark_raised()
            raise rt.notify_failure(
                RankFailureError(
                    f"rank {rt.rank} (member {el.uid}) was removed from the group: the others "
                    f"formed generation {dec.gen} without it (it did not answer in time)",
                    generation=rt.generation,
                )
            ) from cause
        try:
            _form(rt, el, dec.gen, dec.members, dec.old_ranks)
        except RankFailureError as e:
            rank_log.of(rt).warning("forming generation %d failed: %s", dec.gen, e)
            _abandon(el, dec.gen, len(dec.members))
            round_ += 1
            candidates = list(dec.old_ranks)
            continue
        try:
            if dec.sync:
                _send_state(rt, dec.source, snapshot, load)
        except RankFailureError as e:
            # The source (or another member) failed while sending: start over from the
            # generation just formed.
            rank_log.of(rt).warning("state transfer failed: %s", e)
            _abandon(el, gen_from, world)
            round_, candidates, gen_from = 0, list(range(rt.world_size)), rt.generation
            world = rt.world_size
            continue
        break
    _publish_members(rt, gen_from, world)
    rt.clear_raised(notify_again=True)  # the next failure calls the listeners again
    # Only the ranks the group lost: a timeout can also name a rank that merely gave up
    # first (it was recovering already, and is still a member).
    lost = [c for c in first_culprits if c.rank in dec.lost]
    _record_shrink(rt, el, dec, lost, world_before, _clock.monotonic() - t0)
    return dec


def _record_shrink(
    rt: Runtime,
    el: Elastic,
    dec: proto.ShrinkDecision,
    culprits: list[Any],
    world_before: int,
    took: float,
) -> None:
    """Count, record and log (one line) a completed shrink (``world_before`` ranks
    before it)."""
    outcome = dec.outcome
    assert outcome is not None  # a decision followed, not a failed one
    if outcome == "redo":
        el.redone += 1
    elif outcome == "skip":
        el.skipped += 1
    event = {
        "t": time.time(),
        "kind": "shrink",
        "culprits": [
            {"rank": c.rank, "host": c.host, "what": c.what, "phase": c.phase} for c in culprits
        ],
        "generation": rt.generation,
        "world_size_before": world_before,
        "world_size": rt.world_size,
        "step": el.committed,
        "outcome": outcome,
        "state_from": dec.source if dec.sync else None,
        "recovery_s": round(took, 4),
    }
    el.events.append(event)
    _events.record(rt, "shrink", **{k: v for k, v in event.items() if k not in ("t", "kind")})
    el.note_world(rt, "shrink", before=world_before)
    who = ", ".join(f"rank {c.rank} ({c.what})" for c in culprits) or "a peer"
    log.warning(
        "resilient_ddp: %s failed at step %d; going on with %d rank(s) (was %d) as "
        "generation %d, this process is now rank %d; step %s; recovered in %.2f s",
        who,
        el.committed,
        rt.world_size,
        world_before,
        rt.generation,
        rt.rank,
        {"redo": "redone over the survivors", "skip": "skipped", "continue": "kept"}[outcome],
        took,
    )


def _culprits(rt: Runtime) -> list[Any]:
    try:
        return rt.culprits_for(rt.seq + 1)[1]
    except Exception:  # noqa: BLE001 - naming is best effort here
        return []


def _gone(rt: Runtime) -> tuple[set[int], set[int]]:
    """Ranks the watchdog knows failed, and those of them known dead (not just silent)."""
    gone: set[int] = set()
    dead: set[int] = set()
    with rt.lock:
        failures = list(rt.failures)
        left = dict(rt.left)
    for ev in failures:
        gone.update(ev.ranks)
        if ev.kind in (ctl.EV_CRASH, ctl.EV_EXCEPTION):
            dead.add(ev.rank)
    gone.update(left)
    dead.update(left)
    return gone, dead


def _jobs(root: dist.Store) -> ctl.JobStore:
    return ctl.JobStore(root)


class _Tally:
    """An arrival counter (:meth:`JobStore._tally <._control.JobStore._tally>`) as a
    waiter sees it: read once a poll, one request, whatever the number of ranks.

    Every rank bumps the counter after writing its own record, so the records are worth
    reading (``world`` keys, or a log of ``world`` lines) only when the count
    :meth:`moved`: the last record's bump is then seen after the record itself. A count
    may run ahead of the records (a record that is not valid) or behind them (a rank died
    between its record and its bump): callers read the records themselves before giving
    up or deciding, as they did on every poll before."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self.value = -1  # never read yet: the first read moves

    def moved(self) -> bool:
        """Read the count; whether it changed since the last read."""
        n = self._read()
        moved, self.value = n != self.value, n
        return moved


def _agree(
    rt: Runtime,
    el: Elastic,
    base: str,
    candidates: list[int],
    where: str,
    has_grads: bool,
    basis: tuple[int, int],
) -> proto.ShrinkDecision:
    """Post this rank's proposal for shrink round ``base`` and return the round's decision.

    Every survivor waits, reading the decision and the proposal count (one key each) a
    poll, until a decision may be due (:func:`_may_decide`) or ``op_timeout`` passed. Then
    the first survivor to claim the round (:meth:`JobStore.claim_decision
    <._control.JobStore.claim_decision>`) reads the proposal log, decides and publishes
    (:func:`_decide_round`); the others wait for its decision, one key a poll
    (:func:`_await_decision`), and read the log and decide themselves only if the decider
    is reported failed or has not published within ``grace`` plus two heartbeat intervals
    and a second: the first decision stored wins either way. So one rank reads the log
    (``W`` lines) per round, not every one of them, and the others read a decision that
    names the lost ranks, not the members (:meth:`ShrinkDecision.to_record
    <._elastic_protocol.ShrinkDecision.to_record>`; each derives the members from its own
    copy of the member list): O(W) bytes in all, not O(W^2).

    Args:
        rt: This rank's runtime.
        el: Its elastic state (member id, committed steps, member list: the first
            ``basis[1]`` ids are generation ``N``'s by rank).
        base: The round's key prefix, ``rec/g<N>/r<k>``.
        candidates: The ranks of generation ``N`` taking part in the round.
        where: Where this rank failed: ``"reduce"`` or ``"forward"``.
        has_grads: Whether it still holds its local gradients of the step in flight.
        basis: ``(N, its world size)``, for the majority rule.

    Blocks about ``op_timeout`` at most, plus the wait for a decider (a few heartbeat
    intervals) when the deadline decides.

    Returns:
        The decision, with the members and their old ranks in full, derived here
        (:meth:`ShrinkDecision.from_record <._elastic_protocol.ShrinkDecision.from_record>`).

    Raises:
        ControlPlaneError: The store is unreachable, holds garbage in every decision
            slot, or the decision taken cannot be followed (:func:`_follow`).
    """
    jobs = _jobs(rt.control_root)
    members = list(el.members[: basis[1]])
    mine = proto.Proposal(
        rank=rt.rank,
        uid=el.uid,
        committed=el.committed,
        where="reduce" if where == "reduce" else "forward",
        grads=has_grads,
    )
    jobs.post_proposal(base, mine.to_json())
    cfg = rt.config
    deadline = _clock.monotonic() + cfg.op_timeout.total_seconds()
    decided = ctl.JobKeys.round_decision(base)
    count = _Tally(functools.partial(jobs.proposal_count, base))
    # A poll: the decision, the proposal count, and the watchdog's tick (poked: two).
    poll = ctl.Backoff(len(candidates), 4)
    known: tuple[set[int], set[int]] | None = None  # the watchdog's (gone, dead), last seen
    while True:
        taken = jobs.decision(decided)
        if taken is not None:
            return _follow(decided, taken, members)
        moved = count.moved()
        gone, dead = _gone(rt)
        changed = known != (gone, dead)
        known = (gone, dead)
        if moved or changed:
            poll.reset()
        if _may_decide(count.value, gone, candidates) or _clock.monotonic() >= deadline:
            break
        # While proposals come in, the decision waits for them; once they stop, it may
        # wait for a failure report: the watchdog ticks now rather than at its interval.
        # (A poke costs two requests: at W = 1024 the survivors come in over a heartbeat
        # interval or more, and a poke at every poll of the early ones is that much load.)
        if not moved and rt.watchdog is not None:
            rt.watchdog.poke()
        poll.sleep(deadline)
    decider = jobs.claim_decision(basis[0], base, rt.rank)
    if decider is not None and decider != rt.rank and decider in candidates:
        taken = _await_decision(rt, jobs, decided, decider, len(candidates))
        if taken is not None:
            return _follow(decided, taken, members)
    taken = _decide_round(rt, el, jobs, base, candidates, basis, deadline, members)
    return _follow(decided, taken, members)


def _follow(key: str, record: dict[str, Any], members: list[int]) -> proto.ShrinkDecision:
    """The full decision of the compact ``record`` taken under ``key``, derived from
    ``members`` (this rank's copy of the generation's member list).

    Raises:
        ControlPlaneError: The record (its MAC valid, or the job has no secret) is not a
            decision this rank can follow: malformed, over another world size, or its
            digest does not match the members derived here (this rank's copy differs
            from the decider's: it raises alone, and the others, finding it missing when
            they form the group, start another round without it).
    """
    try:
        return proto.ShrinkDecision.from_record(record, members)
    except ValueError as e:
        raise ControlPlaneError(
            f"the shrink decision under {key!r} in the control-plane store cannot be followed: {e}"
        ) from None


def _await_decision(
    rt: Runtime, jobs: ctl.JobStore, decided: str, decider: int, ranks: int
) -> dict[str, Any] | None:
    """Wait for rank ``decider``'s decision under ``decided``, reading that one key a poll.

    Gives up when the watchdog reports ``decider`` failed since the claim (dead, or silent
    when it was not before), or after the longest a healthy decider may take: the grace
    for silent ranks, plus two heartbeat intervals and a second (as a diagnosis is waited
    for). ``ranks`` ranks wait together (the poll interval keeps them under the store's
    rate).

    Returns:
        The decision's record (:meth:`ShrinkDecision.to_record
        <._elastic_protocol.ShrinkDecision.to_record>`), or ``None``: the caller decides
        itself.

    Raises:
        ControlPlaneError: The store is unreachable.
    """
    cfg = rt.config
    until = _clock.monotonic() + _timings.shrink_decider_wait(cfg)
    silent_before, _ = _gone(rt)
    poll = ctl.Backoff(ranks, 1)
    while True:
        taken = jobs.decision(decided)
        if taken is not None:
            return taken
        gone, dead = _gone(rt)
        failed = decider in dead or (decider in gone and decider not in silent_before)
        if failed or _clock.monotonic() >= until:
            rank_log.of(rt).info(
                "rank %d claimed the decision under %s but %s; deciding here",
                decider,
                decided,
                "failed" if failed else "did not publish it in time",
            )
            return None
        poll.sleep(until)


def _decide_round(
    rt: Runtime,
    el: Elastic,
    jobs: ctl.JobStore,
    base: str,
    candidates: list[int],
    basis: tuple[int, int],
    deadline: float,
    members: list[int],
) -> dict[str, Any]:
    """Decide shrink round ``base`` from its proposal log: as soon as every candidate has
    proposed or is known dead, or every one that has not is gone and silent for a grace
    (:func:`._elastic_protocol.should_decide`), or at ``deadline``; the first decision
    stored wins (another rank's may be there first). Reads the log when the proposal
    count or the watchdog's view moved and a decision may be due, and once more to decide
    unless it was just read. The decision is stored as a compact record against
    ``members``, generation ``N``'s member list as this rank knows it.

    Returns:
        The record of the decision taken (:meth:`ShrinkDecision.to_record
        <._elastic_protocol.ShrinkDecision.to_record>`).

    Raises:
        ControlPlaneError: The store is unreachable, or holds garbage in every slot.
    """
    cfg = rt.config
    grace = _timings.late_proposer_grace(cfg)
    silent_since: float | None = None
    decided = ctl.JobKeys.round_decision(base)
    count = _Tally(functools.partial(jobs.proposal_count, base))
    props: dict[int, proto.Proposal] = {}
    known: tuple[set[int], set[int]] | None = None  # the watchdog's (gone, dead), last seen
    # A poll: the decision, the proposal count, and the watchdog's tick (poked: two).
    poll = ctl.Backoff(len(candidates), 4)
    while True:
        taken = jobs.decision(decided)
        if taken is not None:
            return taken
        moved = count.moved()
        gone, dead = _gone(rt)
        changed = known != (gone, dead)
        known = (gone, dead)
        fresh = False  # whether the log was read in this poll
        if moved or changed:
            poll.reset()
            # The log holds a line per proposer: read it only when the count moved (or
            # the watchdog's view changed) and a decision may be due by now. Proposals
            # read late only make the ranks waited for more, which never decides sooner.
            if _may_decide(count.value, gone, candidates):
                props = proto.parse_proposals(jobs.proposals(base))
                fresh = True
        waiting = [r for r in candidates if r not in props]
        now = _clock.monotonic()
        decide, silent_since = proto.should_decide(
            waiting=waiting,
            gone=gone,
            dead=dead,
            recovering=functools.partial(_recovering, rt, waiting, dead),
            silent_since=silent_since,
            now=now,
            grace=grace,
            deadline=deadline,
        )
        if decide:
            if not fresh:
                # The log itself: a proposer that died between its line and its count is
                # in the log only.
                props = proto.parse_proposals(jobs.proposals(base))
            dec = proto.decide_shrink(
                props,
                candidates=candidates,
                dead=dead,
                generation=basis[0],
                world_size=basis[1],
                min_world_size=cfg.min_world_size,
                next_generation=functools.partial(_next_generation, rt),
                my_committed=el.committed,
            )
            return jobs.decide(decided, dec.to_record(members))
        if rt.watchdog is not None:
            rt.watchdog.poke()
        poll.sleep(deadline if silent_since is None else min(deadline, silent_since + grace))


def _may_decide(proposals: int, gone: set[int], candidates: list[int]) -> bool:
    """Whether a shrink round may decide before its deadline, with ``proposals`` counted
    (:meth:`JobStore.proposal_count <._control.JobStore.proposal_count>`) and the ranks
    the watchdog knows ``gone``: only when every candidate not counted may be gone
    (:func:`._elastic_protocol.should_decide` waits for every other one).

    A proposer that died between its log line and its count is not counted but is in the
    log; it counts once it is known gone, dead, which is when the log is read again."""
    return proposals + len(gone.intersection(candidates)) >= len(candidates)


def _recovering(rt: Runtime, ranks: list[int], dead: set[int]) -> bool:
    """Whether one of ``ranks`` (not known dead) says, in its heartbeat, that it is in
    recovery: a timeout named it because it gave up first, it is on its way to propose."""
    alive = [r for r in ranks if r not in dead]
    if not alive:
        return False
    try:
        states = rt.control.read_states(alive)
    except Exception:  # noqa: BLE001 - unreadable: decide on what is known
        return False
    return any(s.phase == RECOVERY_PHASE for s in states.values())


def _next_generation(rt: Runtime) -> int:
    """A generation number no group has used, above every one used so far: every
    generation after the first is drawn from this one counter (group retries too)."""
    return _jobs(rt.control_root).next_generation()


def _form(
    rt: Runtime,
    el: Elastic,
    gen: int,
    members: Sequence[int],
    old_ranks: Sequence[int] | None,
) -> None:
    """Form generation ``gen`` with ``members`` (ids by new rank); bounded.

    ``old_ranks``: each member's rank in the current generation, in new-rank order (joiners,
    after them, have none).

    Raises:
        RankFailureError: A member did not arrive in time (it died meanwhile).
    """
    timeout_s = _timings.rendezvous_form_timeout(rt.config)
    jobs = _jobs(rt.control_root)
    rank = members.index(el.uid)
    # Everyone posts "ready" first: a member that died after the decision is noticed here,
    # quickly, rather than by the backend's rendezvous timeout.
    jobs.post_ready(gen, rank)
    deadline = _clock.monotonic() + timeout_s
    world = len(members)
    arrived = _Tally(functools.partial(jobs.ready_count, gen))
    looked_at: set[int] = set()  # dead old ranks whose arrival was read
    poll = ctl.Backoff(world, 1)
    while True:
        # The flags are read when the count says every member arrived (or at the
        # deadline: a count can lag its flags), not on every poll.
        if arrived.moved():
            poll.reset()
            if arrived.value >= world and jobs.ready(gen, range(world)):
                break
        # Only a member known dead since the decision is given up on at once: one that a
        # timeout named (or that looked unresponsive) before it proposed is merely slower,
        # and one that stopped since is left to the deadline. A member's flag, once there,
        # stays: each dead one is looked at once.
        _, dead = _gone(rt)
        fresh = dead - looked_at
        lost: list[int] = []
        if fresh:
            looked_at |= fresh
            poll.reset()
            lost = [
                members[i]
                for i, old in enumerate(old_ranks or [])
                if old in fresh and not jobs.ready(gen, [i])
            ]
        if lost or _clock.monotonic() >= deadline:
            if not lost and jobs.ready(gen, range(world)):
                break
            raise RankFailureError(
                f"generation {gen} could not form: member(s) {lost or '?'} did not arrive",
                generation=rt.generation,
            )
        poll.sleep(deadline)
    _rebuild(rt, gen, rank, members)
    el.grow = None
    el.acked = (-1, -1)


def _publish_members(rt: Runtime, gen_from: int, world_from: int) -> None:
    """Rank 0 records who the members are, once a generation is complete (formed, state
    in sync, admissions confirmed): the launcher (rd.spawn) ends processes it removed.

    It then deletes, from a thread of its own, the keys of the generations before the one
    that came before this one (``gen_from`` of ``world_from`` ranks): no member reads
    them any more, and a long job's store must not grow with every generation."""
    el = rt.elastic_state()
    el.past.append((gen_from, world_from, set(el.acks_seen)))
    el.acks_seen = set()
    if rt.rank != 0:
        del el.past[:-1]
        return
    _jobs(rt.control_root).set_members(rt.generation, el.members)
    old, el.past = el.past[:-1], el.past[-1:]
    if old:
        threading.Thread(
            target=_forget, args=(rt, old), name="resilient_ddp-forget", daemon=True
        ).start()


def _abandon(el: Elastic, gen: int, world: int) -> None:
    """Generation ``gen`` (``world`` ranks) was drawn, and perhaps formed, but the job goes
    on without it (its formation, admission or state transfer failed): its keys are
    deleted with those of the generation before the next complete one (its rank 0 deletes
    every generation of ``el.past`` but the last)."""
    el.past.append((gen, world, set()))


def _forget(rt: Runtime, generations: list[tuple[int, int, set[int]]]) -> None:
    """Delete the keys of ``generations``; best effort (a failure leaves keys behind)."""
    try:
        jobs = ctl.JobStore(rt.connection("janitor").root)
        for gen, world, acked in generations:
            jobs.forget_generation(gen, world, mismatches=rt.mismatches, acked=acked)
    except Exception as e:  # noqa: BLE001 - cleaning up must never fail the job
        rank_log.of(rt).info("could not delete old generations' keys: %s", e)


def _rebuild(rt: Runtime, gen: int, rank: int, members: Sequence[int]) -> None:
    from resilient_ddp.group.membership import rebuild

    timeout_s = _timings.rendezvous_form_timeout(rt.config)
    rebuild(rt, gen, timeout_s=timeout_s, rank=rank, world_size=len(members))
    # Op sequence numbers start again with the generation (joiners start at 0); so does
    # the last op a heartbeat shows, or a peer's diagnosis would compare across generations.
    rt.restart_op_numbering()
    rt.elastic_state().members = list(members)


def _mark_ended(root: dist.Store, el: Elastic, why: str | None) -> None:
    """Tell waiting joiners that the job is over: it failed (``why``) or finished."""
    # Best effort: joiners also give up at their own timeout.
    with contextlib.suppress(Exception):
        _jobs(root).end(el.committed, why)


def leave(rt: Runtime) -> None:
    """A member leaves normally (``destroy_process_group``): the last one of its generation
    to leave marks the job finished, so that joiners still waiting exit."""
    el = rt.elastic
    if el is None or rt.raised:
        return
    try:
        left = _jobs(rt.control_root).leave(rt.generation)
    except Exception:  # noqa: BLE001 - best effort, as above
        return
    if left >= rt.world_size:
        _mark_ended(rt.control_root, el, None)


class _AdmissionError(RankFailureError):
    """An admission failed after the members started forming the grown generation: they
    recover as the generation it started from (``gen_from``, ``world_from`` ranks)."""

    def __init__(self, cause: RankFailureError, gen_from: int, world_from: int) -> None:
        super().__init__(str(cause), culprits=cause.culprits, generation=cause.generation)
        self.gen_from = gen_from
        self.world_from = world_from


def _send_state(
    rt: Runtime,
    src: int,
    snapshot: Callable[[], dict[str, Any]],
    load: Callable[[dict[str, Any]], None] | None = None,
    *,
    to: list[int] | None = None,
) -> None:
    """``src``'s state to every other rank of the group, loaded there with ``load``
    (recovery); or, point to point, to the ranks ``to`` only (an admission: the joiners
    load it at their first step, the members have it)."""
    from resilient_ddp.ops.checkpoint import broadcast_state_dict, send_state_dict

    payload = snapshot() if rt.rank == src else None
    timeout = rt.config.op_timeout
    # The receivers unpickle only what a state dict is made of: a peer's state never runs
    # code here.
    if to is not None:
        send_state_dict(payload, src, to, timeout=timeout, weights_only=True)
        return
    got = broadcast_state_dict(payload, src=src, timeout=timeout, weights_only=True)
    if rt.rank != src and load is not None:
        load(got)


# -- grow --------------------------------------------------------------------------------------
@_typed_store_errors("admission")
def maybe_admit(
    rt: Runtime,
    el: Elastic,
    snapshot: Callable[[], dict[str, Any]],
) -> bool:
    """Member side, at the start of a forward while join requests are pending.

    Returns:
        True if joiners were admitted (a new generation formed, state sent): the reducer
        must be rebuilt.

    Raises:
        RankFailureError: The admission failed once under way (a member or a joiner died):
            the members recover as the generation they were (see :func:`recover`).
    """
    jobs = _jobs(rt.control_root)
    if el.grow is None and not _grow_decision(rt, el):
        return False
    assert el.grow is not None
    if el.committed < el.grow.at:
        return False
    grow = el.grow
    t0 = _clock.monotonic()
    before, gen_from = rt.world_size, rt.generation
    saved = [(s, s.on_admission(list(grow.joiners))) for s in el.live_samplers()]
    error: RankFailureError | None = None
    try:
        _form(rt, el, grow.gen, grow.members, range(before))
        with phase(TRANSFER_PHASE):
            _send_state(rt, 0, snapshot, to=list(range(before, rt.world_size)))
    except RankFailureError as e:
        error = e
    if not _admission_result(rt, grow, grow.rank_of(el.uid), ok=error is None):
        gen = grow.gen
        if grow.rank_of(el.uid) == 0 and jobs.ready(gen, range(before)):
            # Every member arrived but a joiner did not (it died, hangs or came too
            # late): it is blamed, so that a dead one is not admitted again and again.
            for i, uid in enumerate(grow.joiners):
                if not jobs.ready(gen, [before + i]):
                    jobs.add_join_try(uid)
        el.grow = None
        _abandon(el, gen, len(grow.members))
        for s, undo in saved:
            s.on_admission_failed(undo)
        error = error or RankFailureError(
            f"the admission to generation {grow.gen} failed on another rank",
            generation=rt.generation,
        )
        rank_log.of(rt).warning(
            "admission of %s failed (%s); going on without them",
            list(grow.joiners),
            error,
        )
        raise _AdmissionError(error, gen_from, before) from error
    # Never a pending joiner again; any member may be the next to read the requests, so
    # each marks it.
    for uid in grow.joiners:
        jobs.mark_admitted(uid)
    _publish_members(rt, gen_from, before)
    if jobs.join_count() > el.joins_seen:
        el.join_seen = True  # more requests came meanwhile: look at the next forward
    else:
        _stop_looking(rt, el)
    took = _clock.monotonic() - t0
    fields = {
        "joiners": list(grow.joiners),
        "world_size_before": before,
        "world_size": rt.world_size,
        "step": el.committed,
        "admission_s": round(took, 4),
        # When this member acknowledged the request, and its committed steps then.
        "acked_t": el.first_ack_t,
        "acked_step": el.first_ack[1],
    }
    el.events.append({"t": time.time(), "kind": "join", "generation": rt.generation, **fields})
    _events.record(rt, "join", **fields)
    el.note_world(rt, "join", before=before)
    log.warning(
        "resilient_ddp: %d process(es) joined at step %d; %d rank(s) now (was %d), "
        "generation %d; admitted in %.2f s",
        len(grow.joiners),
        el.committed,
        rt.world_size,
        before,
        rt.generation,
        took,
    )
    return True


def _admission_result(rt: Runtime, adm: proto.Admission, rank: int, *, ok: bool) -> bool:
    """Whether admission ``adm`` succeeded everywhere: every member and joiner formed the
    group and has the state (this process is ``rank`` of its generation). Decided once
    (``compare_set``), so that all act alike; a rank that does not confirm within the form
    timeout fails it. Bounded."""
    jobs = _jobs(rt.control_root)
    gen, world = adm.gen, len(adm.members)
    result = ctl.JobKeys.admission_result(gen)
    if ok:
        jobs.post_has_state(gen, rank)
    else:
        jobs.decide(result, {"ok": False})
    deadline = _clock.monotonic() + _timings.rendezvous_form_timeout(rt.config)
    confirmed = _Tally(functools.partial(jobs.has_state_count, gen))
    missing: list[int] | None = None  # who had not confirmed at the last look (past the deadline)
    poll = ctl.Backoff(world, 2)
    while (taken := jobs.decision(result)) is None:
        # Every rank's confirmation is read when the count says all confirmed, not on
        # every poll.
        if confirmed.moved():
            poll.reset()
            if confirmed.value >= world and jobs.all_have_state(gen, world):
                jobs.decide(result, {"ok": True})
                continue
        if _clock.monotonic() < deadline:
            poll.sleep(deadline)
            continue
        # A confirmation stays: after the first look, only the ranks still missing are
        # read again. None missing: every rank confirmed (a count can lag).
        missing = jobs.missing_state(gen, world, among=missing)
        if not missing:
            jobs.decide(result, {"ok": True})
        elif ok and _transferring(rt, missing):
            # The state source (or a joiner taking the state) is busy, not missing: a
            # large state or a slow link takes longer than the form timeout. It is waited
            # for while its heartbeat says so; one that dies or hangs is reported by the
            # watchdogs (heartbeat_timeout), and its own transfer is bounded by op_timeout
            # per chunk.
            deadline = _clock.monotonic() + 0.1
        else:
            jobs.decide(result, {"ok": False})
    return bool(taken.get("ok"))


def _transferring(rt: Runtime, ranks: list[int]) -> bool:
    """Whether every rank of ``ranks`` (this generation) is alive as far as the watchdogs
    know and says in its heartbeat that it sends or receives the state."""
    if not ranks:
        return False
    gone, _ = _gone(rt)
    if any(r in gone for r in ranks):
        return False
    try:
        states = rt.control.read_states(ranks)
    except ControlPlaneError:
        return False
    return all(r in states and states[r].phase == TRANSFER_PHASE for r in ranks)


def _stop_looking(rt: Runtime, el: Elastic) -> None:
    """Stop looking for an admission at each forward, unless this member acknowledged
    requests in this generation: it promised to look at every step boundary after that
    (see :func:`_grow_decision`), until the generation changes."""
    with el.ack_lock:
        if el.acked[0] != rt.generation:
            el.join_seen = False


def acknowledge(
    rt: Runtime, el: Elastic, jobs: ctl.JobStore, generation: int, rank: int, n: int
) -> None:
    """Acknowledge ``n`` join requests as ``rank`` of ``generation``: "I saw them at my
    committed step count ``c``, and look for the admission at every step boundary after
    it". The watchdog calls it as soon as it sees a request (within a heartbeat interval,
    whatever the step time); the training thread calls it at a forward if the watchdog
    did not yet. Idempotent per ``(generation, n)``.

    ``join_seen`` is set before ``committed`` is read: a boundary the training thread
    passes without looking is then at most ``c``, and the admission step is after every
    member's ``c`` (see :func:`_grow_decision`).
    """
    with el.ack_lock:
        if (rt.generation, rt.rank) != (generation, rank):
            return  # a watchdog of a generation that just ended
        el.join_seen = True
        if el.acked[0] == generation and el.acked[1] >= n:
            return  # this round or a later one is acknowledged (records never go back)
        committed = el.committed
        jobs.ack(generation, n, rank, committed)
        el.acked = (generation, n)
        el.acks_seen.add(n)
        if el.first_ack[0] != generation:
            el.first_ack = (generation, committed)
            el.first_ack_t = time.time()


def _grow_decision(rt: Runtime, el: Elastic) -> bool:
    """At a step boundary (a forward) while join requests are pending: find or take the
    admission decision (step, joiners, generation), fixed once through ``compare_set``.

    The rule that keeps every member in step without a vote on healthy steps: each member
    acknowledges the requests with its committed step count ``c`` (:func:`acknowledge`,
    mostly from its watchdog, while the step in flight runs), and from then on never
    passes a step boundary after ``c`` without a decision. Once every member acknowledged,
    the admission step is the largest ``c`` plus one: no member can be past it (to
    complete a step after its own ``c``, a member needs every member's gradients for it),
    so the joiner trains from the step after the one in flight when the members saw its
    request. A member that reaches that boundary before the last acknowledgement arrives
    waits for it here (a heartbeat interval at most, while the peers live).

    Returns:
        Whether ``el.grow`` holds the decision now.

    Raises:
        RankFailureError: A failure was recorded while waiting, or a member did not
            acknowledge within the form timeout.
    """
    jobs = _jobs(rt.control_root)
    key = ctl.JobKeys.admission(rt.generation)
    round_n, deadline = -1, 0.0  # the round waited for, and until when
    recheck = 0.0  # when the pending requests are read again while waiting
    acks: dict[int, _Tally] = {}  # the acknowledgement count of each round waited for
    # A poll: the decision, the request count (two), the acknowledgement count.
    poll = ctl.Backoff(rt.world_size, 4)
    while True:
        taken = jobs.decision(key)
        if taken is not None:
            el.grow = _admission(key, taken, el.members)
            return True
        n = jobs.join_count()
        if proto.needs_ack(el.acked, generation=rt.generation, requests=n):
            if not pending_joiners(jobs, el):
                _stop_looking(rt, el)  # nothing to admit (yet): the watchdog wakes us again
                return False
            acknowledge(rt, el, jobs, rt.generation, rt.rank, n)
        if n not in acks:
            acks[n] = _Tally(functools.partial(jobs.ack_count, rt.generation, n))
        bound = _acks_bound(rt, jobs, n, acks[n], poll)
        if bound is not None:
            break
        first_gen, first_c = el.first_ack
        if first_gen == rt.generation and el.committed <= first_c:
            return False  # no admission can be at this boundary
        now = _clock.monotonic()
        if now >= recheck:
            # Nothing left to admit (a joiner gave up or was admitted): no member can decide
            # from this round any more, since the decider reads the pending requests after
            # the round completed (they only leave the list). Read every _RECHECK_S, not
            # every poll: it reads the whole request log.
            if not pending_joiners(jobs, el):
                return False
            recheck = now + _RECHECK_S
        if round_n != n:
            round_n, deadline = n, now + _timings.rendezvous_form_timeout(rt.config)
        rt.raise_if_failed("forward", rt.seq + 1)
        if _clock.monotonic() >= deadline:
            # The records themselves, not their count (it can lag them).
            bound = jobs.ack_bound(rt.generation, n, rt.world_size)
            if bound is not None:
                break
            raise _unacknowledged(rt, jobs, n)
        poll.sleep(min(deadline, recheck))
    return _decide(rt, el, jobs, key, bound)


def _acks_bound(
    rt: Runtime, jobs: ctl.JobStore, n: int, acks: _Tally, poll: ctl.Backoff
) -> int | None:
    """:meth:`JobStore.ack_bound <._control.JobStore.ack_bound>` of round ``n``, read only
    when its count ``acks`` moved to every member (None otherwise)."""
    if not acks.moved():
        return None
    poll.reset()
    if acks.value < rt.world_size:
        return None
    return jobs.ack_bound(rt.generation, n, rt.world_size)


def _decide(rt: Runtime, el: Elastic, jobs: ctl.JobStore, key: str, bound: int) -> bool:
    """Every member acknowledged, the largest count being ``bound``: propose the admission
    of the pending joiners under ``key`` and keep the decision taken (``el.grow``).

    The members read a compact record (:meth:`Admission.to_record
    <._elastic_protocol.Admission.to_record>`: the joiners, not the members); the member
    whose proposal was taken gives each joiner the whole admission with its rank
    (``join/adm/<uid>``): a joiner has no copy of the member list.

    Returns:
        Whether a decision holds (False: nothing is pending any more).

    Raises:
        ControlPlaneError: The store is unreachable, holds garbage in every slot, or the
            decision taken cannot be followed (:func:`_admission`).
    """
    pending = pending_joiners(jobs, el)
    if not pending:
        _stop_looking(rt, el)
        return False
    dec = proto.decide_admission(
        committed=el.committed,
        acked=bound,
        members=el.members,
        pending=pending,
        next_generation=functools.partial(_next_generation, rt),
        generation=rt.generation,
        samplers_step=[s.admission_step for s in el.live_samplers()],
    )
    record = dec.to_record()
    taken = jobs.decide(key, record)
    el.grow = _admission(key, taken, el.members)
    if taken == record:
        full = dec.to_json()
        for i, uid in enumerate(pending):
            jobs.set_admission_for(uid, {**full, "rank": len(el.members) + i})
    return True


def _admission(key: str, record: dict[str, Any], members: list[int]) -> proto.Admission:
    """The full admission of the compact ``record`` taken under ``key``, derived from
    ``members`` (this member's copy of the generation's member list).

    Raises:
        ControlPlaneError: The record (its MAC valid, or the job has no secret) is not an
            admission this member can follow: malformed, over another world size, or its
            digest does not match the members derived here.
    """
    try:
        return proto.Admission.from_record(record, members)
    except ValueError as e:
        raise ControlPlaneError(
            f"the admission under {key!r} in the control-plane store cannot be followed: {e}"
        ) from None


def _unacknowledged(rt: Runtime, jobs: ctl.JobStore, n: int) -> Exception:
    """The error for a round of ``n`` join requests that some member did not acknowledge
    within the form timeout (its watchdog does not run, or the store lost its record)."""
    missing = jobs.missing_acks(rt.generation, n, rt.world_size)
    if not missing:
        return ControlPlaneError(
            "an acknowledgement of the join requests in the control-plane store is not a "
            "valid record: a process outside the job writes to its store"
        )
    limit_s = _timings.rendezvous_form_timeout(rt.config)
    what = (
        f"did not acknowledge {n} join request(s) within {limit_s:.1f} s "
        "(its watchdog does not run?)"
    )
    culprits = [rt.culprit(r, what) for r in missing]
    return rt.notify_failure(
        RankFailureError(
            f"rank(s) {missing} did not acknowledge the join requests: the admission step "
            "cannot be fixed",
            culprits=culprits,
            generation=rt.generation,
        )
    )


def pending_joiners(jobs: ctl.JobStore, el: Elastic, *, note: bool = True) -> list[int]:
    """The member ids of the join requests still to be admitted, in request order; with
    ``note``, the number of requests read is kept as ``el.joins_seen``."""
    requests = jobs.join_requests()
    if note:
        el.joins_seen = len(requests)
    return proto.pending_joiners(
        requests,
        el.members,
        # admitted once (a member since, maybe gone), or gave up
        _Asked(jobs.admitted),
        _Asked(jobs.gone),
        # never arrived at its admissions: dead or unreachable
        jobs.join_tries,
        _MAX_JOIN_TRIES,
    )


class _Asked:
    """``uid in flags``: ``ask(uid)``, asked lazily."""

    def __init__(self, ask: Callable[[int], bool]) -> None:
        self.ask = ask

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.ask(uid)


@_typed_store_errors("joining")
def join(
    backend: str | None, cfg: ResilienceConfig, timeout: timedelta
) -> tuple[Runtime, dict[str, Any]] | Guest:
    """Joiner side (``RESILIENT_DDP_JOINER=1``): ask to join the running job, wait until
    the members admit this process, form the group with them and receive the state.

    Blocks at most ``timeout``. An admission the members abandon (a failure among them)
    is waited out; one that fails because of this process counts against it, and it gives
    up after ``_MAX_JOIN_TRIES`` of them.

    While a job that does not train elastically runs a ``distributed_inference`` call
    instead (its ``inf/open`` record), no member will ever admit anyone: this process
    returns a :class:`~._guest.Guest` of that call (it helps with the work without a
    group); once that call has ended, nothing is left to do: it exits with code 0.

    Raises:
        PreflightError: Not admitted within ``timeout`` (no job with
            ``on_failure="shrink"`` is running on that store, or it cannot take members),
            admission failed too often, or the job failed before admitting this process.
        SystemExit: With code 0, when the job finished before admitting this process: it
            has nothing left to do.
    """
    # DDP's constructor imports torch._dynamo (over a second): do it before asking, not
    # while the members wait for this process in their first step with it.
    import torch._dynamo  # noqa: F401

    from resilient_ddp.errors import PreflightError

    root = ctl.control_store(None, joiner=True, timeout=timeout)
    jobs = _jobs(root)
    uid = int(os.environ[UID_ENV]) if UID_ENV in os.environ else 1_000_000 + jobs.new_joiner_uid()
    identity = ctl.my_identity(-1)
    jobs.request_join({"uid": uid, "host": identity["host"], "pid": identity["pid"]})
    requested = time.time()
    deadline = _clock.monotonic() + timeout.total_seconds()
    tried_gen, failures = -1, 0
    next_look = 0.0
    while True:
        _check_ended(jobs, uid)
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + _GUEST_LOOK_S
            guest = _inference_to_help(jobs, root, uid, backend, cfg)
            if guest is not None:
                return guest
        if jobs.join_tries(uid) >= _MAX_JOIN_TRIES:
            raise PreflightError(
                f"this process (member id {uid}) was not admitted: it did not reach "
                f"{_MAX_JOIN_TRIES} of its admissions in time, and the members gave up",
                problems=["joiner not admitted"],
            )
        if _clock.monotonic() >= deadline:
            raise PreflightError(
                f"this process (member id {uid}) asked to join the running job but was not "
                f"admitted within {timeout}: is a job with on_failure='shrink' running on "
                "this store, and still training? The job's ranks and this process must "
                f"share one store ({ctl.STORE_ENV}=<host>:<port>; under torchrun see the "
                "recipe in the elastic training docs)",
                problems=["joiner not admitted"],
            )
        record = jobs.admission_for(uid)
        if record is None or record["gen"] == tried_gen:
            _clock.sleep(0.01)
            continue
        tried_gen = record["gen"]
        adm, rank = _admission_of_joiner(uid, record)
        if not _await_members(jobs, adm, deadline, uid):
            continue  # the members went another way (a failure among them)
        rt, state, error = _admit(root, uid, adm, rank, backend, cfg)
        if rt is not None:
            rt.elastic_state().events.append(
                {
                    "t": time.time(),
                    "kind": "admitted",
                    "requested_t": requested,
                    "generation": rt.generation,
                    "world_size": rt.world_size,
                    "step": rt.elastic_state().committed,
                    "waited_s": round(time.time() - requested, 4),
                }
            )
            return rt, state
        if error is None:
            continue  # a member failed: not this process's fault
        failures += 1
        if failures >= _MAX_JOIN_TRIES:
            jobs.mark_gone(uid)
            raise PreflightError(
                f"this process (member id {uid}) could not be admitted to the running "
                f"job: {failures} admissions failed, the last one with: {error}",
                problems=["joiner admission failed"],
            ) from error


def _inference_to_help(
    jobs: ctl.JobStore, root: dist.Store, uid: int, backend: str | None, cfg: ResilienceConfig
) -> Guest | None:
    """The running inference call this joiner can help with (see :func:`join`), or None.

    Raises:
        SystemExit: With code 0: the call it was started for has ended and the job does
            not train elastically (nobody would ever admit it).
    """
    rec = jobs.inference()
    if rec is None or rec.get("elastic", True):
        # Elastic training (the call is an evaluation inside it): the members admit
        # replacements at a step boundary, which is what this process waits for.
        return None
    if rec.get("closed"):
        log.warning(
            "joiner %d: the job's distributed_inference call %s ended before this process "
            "could help with it, and the job does not train elastically; exiting",
            uid,
            rec.get("call"),
        )
        raise SystemExit(0)
    try:
        gen, call, world = int(rec["gen"]), int(rec["call"]), int(rec["world"])
    except (KeyError, TypeError, ValueError):
        return None
    log.warning(
        "joiner %d: the job runs distributed_inference (call %d of generation %d, %d "
        "ranks): this process helps with it without joining the process group",
        uid,
        call,
        gen,
        world,
    )
    return Guest(
        root=root,
        uid=uid,
        generation=gen,
        call=call,
        world_size=world,
        config=cfg,
        backend=backend or "gloo",
    )


def _admission_of_joiner(uid: int, record: dict[str, Any]) -> tuple[proto.Admission, int]:
    """The admission in joiner ``uid``'s record (``join/adm/<uid>``: :meth:`Admission.to_json
    <._elastic_protocol.Admission.to_json>` with the joiner's ``rank`` added), and that rank.

    Raises:
        ControlPlaneError: The record (its MAC valid, or the job has no secret) is not an
            admission: a key is missing or of the wrong type.
    """
    try:
        return proto.Admission.from_json(record), int(record["rank"])
    except (KeyError, TypeError, ValueError) as e:
        raise ControlPlaneError(
            f"the admission of joiner {uid} in the control-plane store is not valid: {e}"
        ) from None


def _admit(
    root: dist.Store,
    uid: int,
    adm: proto.Admission,
    rank: int,
    backend: str | None,
    cfg: ResilienceConfig,
) -> tuple[Runtime | None, dict[str, Any], BaseException | None]:
    """Form the admission's generation with the members (as ``rank``) and receive the
    state.

    Returns:
        ``(runtime, state, None)`` when admitted; ``(None, {}, error)`` when the admission
        failed because of this process, ``(None, {}, None)`` when because of a member.
    """
    from resilient_ddp.ops.checkpoint import send_state_dict
    from resilient_ddp.runtime import _runtime

    gen, members = adm.gen, list(adm.members)
    n_old = adm.old_world
    # The members admit at the first forward with ``at`` steps committed: its watchdog may
    # acknowledge requests before the state (which says the same) arrives.
    el = Elastic(uid=uid, members=members, committed=adm.at)
    rt = Runtime.of_group(
        rank=rank,
        world_size=len(members),
        backend=backend or "gloo",
        control_root=root,
        config=cfg,
        elastic=el,
    )
    _jobs(root).post_ready(gen, rank)
    error: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        _runtime.set_current(rt)
        _rebuild(rt, gen, rank, members)
        with phase(TRANSFER_PHASE):
            state = send_state_dict(
                None, 0, list(range(n_old, len(members))), timeout=cfg.op_timeout, weights_only=True
            )
    except (RankFailureError, ControlPlaneError) as e:
        error = e
    if _admission_result(rt, adm, rank, ok=error is None):
        rt.clear_raised(notify_again=False)
        el.received = state
        el.committed = int(state["committed"])
        el.history = list(state.get("history", []))
        el.note_world(rt, "join", before=n_old)
        _events.record(rt, "joined", world_size=rt.world_size, step=el.committed, uid=uid)
        rt.begin_startup()
        return rt, state, None
    _runtime.set_current(None)
    rt.stop_watchdog()
    log.warning(
        "joiner %d: admission to generation %d failed: %s",
        uid,
        gen,
        error or "it failed on another rank",
    )
    ranks = {c.rank for c in getattr(error, "culprits", [])}
    if error is None or (ranks and all(r < n_old for r in ranks)):
        return None, {}, None
    if not _all_arrived(root, gen, len(members)):
        # The group could not form because another process of the admission (a member,
        # or another joiner) never came to form it: not this process's failure.
        return None, {}, None
    return None, {}, error


def _all_arrived(root: dist.Store, gen: int, world: int) -> bool:
    """Whether every process of generation ``gen`` (``world`` ranks) posted that it came
    to form it; False when the store cannot tell (its keys deleted, or unreachable)."""
    try:
        return _jobs(root).ready(gen, range(world))
    except ControlPlaneError:
        return False


def _await_members(jobs: ctl.JobStore, adm: proto.Admission, deadline: float, uid: int) -> bool:
    """Wait until every member of the admission reached its step (they post "ready" then).

    Returns:
        False if the members abandoned it (the job moved to another generation).
    """
    gen, n_old = adm.gen, adm.old_world
    arrived = _Tally(functools.partial(jobs.ready_count, gen))
    # A poll: the arrival count, the end of the job (one, or more if garbage), the
    # generation (two); the joiners poll, not the members.
    poll = ctl.Backoff(len(adm.joiners), 4)
    while True:
        # The members' flags are read when the count says they may all be there (the
        # joiners count too, once they arrive: after this).
        if arrived.moved():
            poll.reset()
            if arrived.value >= n_old and jobs.ready(gen, range(n_old)):
                return True
        _check_ended(jobs, uid)
        if _clock.monotonic() >= deadline:
            return jobs.ready(gen, range(n_old))  # the flags: a count can lag them
        # Generation numbers only grow: a newer one than the admission's base means the
        # members recovered from a failure instead of reaching the admission step.
        current = jobs.generation()
        if current > adm.from_gen and current != gen:
            return False
        poll.sleep(deadline)


def _check_ended(jobs: ctl.JobStore, uid: int) -> None:
    ended = jobs.ended()
    if ended is None:
        return
    from resilient_ddp.errors import PreflightError

    if ended["failed"]:
        raise PreflightError(
            f"this process (member id {uid}) was to join a job that failed before "
            f"admitting it: {ended['failed']}",
            problems=["job failed"],
        )
    log.warning(
        "joiner %d: the job finished (step %d) before admitting this process; exiting",
        uid,
        ended["step"],
    )
    raise SystemExit(0)
