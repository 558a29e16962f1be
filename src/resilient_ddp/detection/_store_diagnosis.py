"""Store-side diagnosis: which ranks keep an op from completing, and why.

When a bounded op times out, one waiting rank asks every other rank for its state (and
main-thread stack) through the control plane, judges each answer with the pure rules of
:mod:`._diagnosis`, and publishes the verdict for the others (:func:`diagnose`). Also the
straggler report (:func:`straggler_report`). Above the runtime (it reads a rank's view of
the job through :class:`Runtime`'s methods), beside the watchdog.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from resilient_ddp.base import _clock, _timings
from resilient_ddp.control import _control as ctl
from resilient_ddp.control._board import with_board
from resilient_ddp.control._events import rank_log
from resilient_ddp.detection import _diagnosis as dg
from resilient_ddp.errors import ControlPlaneError, Culprit, CulpritRecord, decode_culprit
from resilient_ddp.runtime._runtime import RECOVERY_PHASE, Runtime, in_own_wait

# Verdicts worded from the diagnosing rank's side (the majority rule): never shared.
_RELATIVE_BLAMES = frozenset({dg.Blame.DIVERGED.name, dg.Blame.THIS_RANK_DIVERGED.name})


def diagnose(rt: Runtime, control: ctl.ControlPlane, name: str, seq: int) -> list[CulpritRecord]:
    """Find the ranks that keep op ``seq`` from completing, asking each for its stack.

    One rank diagnoses each round (the first of the ranks waiting in ``seq`` whose
    attempt timed out: they all time out at about the same moment); the others wait for
    its verdict on the store and take it as theirs. So a stuck rank costs O(W) store
    requests in all, not every survivor reading every state (O(W^2)). A rank diagnoses
    itself when no verdict comes (its diagnoser died), when the verdict is older than
    ``heartbeat_timeout`` (this rank came late), was cut short by a failure, or found
    ranks that issued another collective (the majority rule is relative to each rank).

    Blocks at most the diagnosis window (``config.diagnosis_timeout``, at least two
    heartbeat intervals), twice that in a double fault.

    Raises:
        ControlPlaneError: The store is unreachable.
    """
    k = rt.next_diagnosis_round((control.generation, seq))
    if control.claim_diagnosis(seq, k):
        verdict: dict[str, Any] = {"by": rt.rank, "t": _clock.wall(), "shared": False}
        try:
            culprits = _diagnose_here(rt, control, name, seq)
            # Its age is judged by the heartbeats this rank sent since (see below).
            verdict["beat"] = rt.watchdog.beats if rt.watchdog is not None else None
            divergent = any(c.get("blame") in _RELATIVE_BLAMES for c in culprits)
            verdict.update(culprits=culprits, shared=not divergent and not rt.failed_for(seq))
            return culprits
        finally:
            with contextlib.suppress(ControlPlaneError):
                control.publish_verdict(seq, k, verdict)
    wait = _timings.shared_verdict_wait(rt.config)
    shared = control.read_verdict(seq, k, timedelta(seconds=wait))
    if shared is None or not shared.get("shared") or verdict_stale(rt, control, shared):
        return _diagnose_here(rt, control, name, seq)
    taken = culprits_for_reader(shared, rt.rank)
    if taken is None:
        return _diagnose_here(rt, control, name, seq)
    rank_log.of(rt).debug("%s#%d: rank %s's diagnosis", name, seq, shared.get("by"))
    return taken


def culprits_for_reader(verdict: dict[str, Any], rank: int) -> list[CulpritRecord] | None:
    """The culprits of a peer's shared ``verdict`` that hold for ``rank``, its reader, or
    None when it must diagnose itself. The verdict was made when the reader had not
    arrived yet, maybe: the reader waits in the op now, so it is never its own culprit
    (it would read "rank 2 waits for rank 2"); when it was the only one named, what
    blocks it now is another matter, which it diagnoses itself."""
    culprits = verdict.get("culprits")
    if not isinstance(culprits, list):
        return None
    named = [c for c in map(decode_culprit, culprits) if c is not None]
    mine = [c for c in named if c.get("rank") != rank]
    if named and not mine:
        return None
    return mine


def verdict_stale(rt: Runtime, control: ctl.ControlPlane, verdict: dict[str, Any]) -> bool:
    """Whether a peer's shared verdict is older than ``heartbeat_timeout`` (this rank
    came late): its author sent that many heartbeats since it published it. Counted in
    the author's heartbeats, never by comparing the author's clock with this one's."""
    by, beat = verdict.get("by"), verdict.get("beat")
    if not isinstance(by, int) or isinstance(beat, bool) or not isinstance(beat, int):
        return True
    state = control.read_states([by]).get(by)
    now = None if state is None else state.beat
    if now is None:
        return True
    interval = rt.config.heartbeat_interval.total_seconds()
    return (now - beat) * interval > rt.config.heartbeat_timeout.total_seconds()


def _diagnose_here(
    rt: Runtime, control: ctl.ControlPlane, name: str, seq: int
) -> list[CulpritRecord]:
    """:func:`diagnose`, by this rank: reads every other rank's state once, then those
    that have not answered every 50 ms."""
    others = [r for r in range(rt.world_size) if r != rt.rank]
    request = control.request_diagnosis()
    deadline = _clock.monotonic() + rt.diagnosis_window()
    answers: dict[int, ctl.HeartbeatState] = {}
    seen_at: dict[int, float] = {}  # when (monotonic) this process saw each answer
    states = control.read_states(others)
    while True:
        for r, st in states.items():
            seen = rt.note_beat(r, st)
            # Keep the first answer: the next heartbeat republishes it without the stack.
            if r not in answers and ((st.diag or 0) >= request or st.status != "running"):
                answers[r] = st
                seen_at[r] = seen
        if len(answers) == len(others) or rt.failed_for(seq):
            break
        if _clock.monotonic() >= deadline:
            break
        _clock.sleep(0.05)
        # Only the ranks that have not answered: with every survivor of a stuck rank
        # diagnosing at once, re-reading all W states each round made W^2 reads a round.
        states.update(control.read_states([r for r in others if r not in answers]))
    culprits: list[CulpritRecord] = []
    verdicts: dict[int, dg.Verdict] = {}
    ops: dict[int, str] = {}  # what the others issued at seq, for the majority rule
    hb_timeout = rt.config.heartbeat_timeout.total_seconds()
    for r in others:
        answered = r in answers
        last = answers.get(r, states.get(r))  # None: no state at all
        s = beat = last if last is not None else ctl.HeartbeatState()
        info = rt.infos.get(r, {})
        stopped = not answered and rt.is_stopped(r)
        running = not answered and not stopped and rt.is_running(r)
        if stopped:
            # Stopped on this host: its board has what it was doing when it stopped.
            s = with_board(beat, info)
        if s.seq == seq:
            ops[r] = str(s.op)
        # How long it has been silent, by this process's clock: since this process saw
        # its heartbeat change (its wall-clock "t" may come from a clock that is off).
        silent_s = rt.beat_age(r)
        verdict = dg.what_blocks(
            s,
            answered=answered,
            stopped=stopped,
            running=running,
            name=name,
            seq=seq,
            # what_blocks ages the heartbeat by its "t": give it this process's age.
            now=_number(beat.t) + silent_s,
            recovery_phase=RECOVERY_PHASE,
        )
        if verdict is not None:
            verdicts[r] = verdict
            fresh = last is not None and silent_s < hb_timeout  # no state at all: not fresh
            seen = seen_at[r] if r in seen_at else rt.note_beat(r, beat)
            extra = _culprit_extra(beat, s, silent_s, seen)
            culprits.append(
                Culprit.record(
                    r,
                    what=verdict.what,
                    blame=verdict.blame.name,
                    info=info,
                    state=s.record(),
                    stack=s.stack,
                    # A process on this host that exists and is not stopped counts
                    # as alive even with a stale heartbeat (it may have just left a
                    # C call that held the GIL): whether it is dead is the watchdog's
                    # verdict, within heartbeat_timeout (see _check_heartbeats).
                    alive=answered
                    or running
                    or (not stopped and (fresh or (rt.is_local(r) and not rt.is_gone(r)))),
                    **extra,
                )
            )
    # Ranks that issued another collective at seq: the minority is to blame, which may
    # be this rank itself (each side sees the other as different).
    ruling = dg.majority_rule(rt.rank, name, seq, verdicts, ops)
    if isinstance(ruling, dg.Verdict):
        me = Culprit.record(
            rt.rank,
            what=ruling.what,
            blame=ruling.blame.name,
            info=rt.identity,
            state=rt.snapshot(0).record(),
            alive=True,
        )
        return [me]
    # Name root causes only (see dg.root_causes): ranked by blame, never by text.
    kept = [c for c in culprits if c["rank"] in ruling]
    named = dg.root_causes({c["rank"]: verdicts[c["rank"]] for c in kept})
    return [c for c in kept if c["rank"] in named]


def straggler_report(rt: Runtime, control: ctl.ControlPlane) -> dict[str, Any]:
    """Every rank's median step compute time and the ranks slower than the group median
    by more than ``config.straggler_margin``. One store round trip."""
    states = control.read_states(list(range(rt.world_size)))
    times = {r: float(s.compute_s) for r, s in states.items()}
    measured = sorted(t for t in times.values() if t > 0)
    median = measured[len(measured) // 2] if measured else 0.0
    limit = median * (1 + rt.config.straggler_margin)
    slow = sorted(r for r, t in times.items() if median > 0 and t > limit)
    return {"median_s": median, "compute_s": times, "stragglers": slow}


def _culprit_extra(
    beat: ctl.HeartbeatState, state: ctl.HeartbeatState, silent_s: float, seen: float
) -> dict[str, Any]:
    """What a diagnosis adds to a late rank's culprit from its last heartbeat ``beat``
    (``state``: its state as judged), ``silent_s`` seconds old by this process's clock
    and first seen at ``seen`` (this process's monotonic clock)."""
    extra: dict[str, Any] = {}
    if not state.board:
        # Its heartbeat's age by this process's clock (the one Culprit.record would compute
        # compares its wall-clock "t" with this host's). A board (a stopped rank on this
        # host) has no age: Culprit.record leaves it out.
        extra["state_age"] = round(silent_s, 3)
    if beat.idle is not None:
        # Busy or stuck (see Op._stuck): seconds since its progress signals last moved,
        # measured by its own clock; what moved; where it is.
        extra["idle"] = float(beat.idle)
        extra["moving"] = [str(m) for m in beat.moving]
        extra["where"] = str(beat.where or "")
        # In one of the library's own waits (elastic recovery, an admission): bounded by
        # the library, not judged by progress.
        extra["inside"] = in_own_wait(beat.inside, state.phase)
    if beat.section_left is not None:
        # Seconds left in its section's budget now: what it published with that heartbeat,
        # less the time since this process saw that heartbeat (a relative duration: the
        # peers' clocks are never compared).
        since = _clock.monotonic() - seen
        extra["busy_left"] = max(0.0, _number(beat.section_left) - since)
    return extra


def _number(value: float | None) -> float:
    """``value`` (a published field) as a float, 0.0 if it is not a finite number."""
    if value is None:
        return 0.0
    return float(value) if abs(float(value)) < float("inf") else 0.0
