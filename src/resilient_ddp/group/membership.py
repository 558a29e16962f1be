"""Membership: generations of the process group, and rebuilding it as a group decision.

Generation ``N``'s process group rendezvouses under store prefix ``rd/<job>/g<N>/pg``
(:func:`~resilient_ddp.control._control.group_prefix`) and its control plane lives under
``rd/<job>/g<N>/``. Moving to ``N+1`` needs every member to agree through the store (never
through the broken data plane), after which each member aborts and destroys the old group
and creates the new one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient_ddp.base import _clock
from resilient_ddp.base._backend import abort_group, default_pg_timeout, forget_failed_init
from resilient_ddp.control import _control as ctl
from resilient_ddp.control._events import rank_log
from resilient_ddp.detection.watchdog import Watchdog
from resilient_ddp.errors import PreflightError, RankFailureError
from resilient_ddp.runtime import _exit_guard
from resilient_ddp.runtime._runtime import Runtime

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")


def regroup(rt: Runtime, name: str, seq: int, attempt: int, deadline: float) -> None:
    """Agree with every rank to redo op ``seq`` and move the job to the next generation.

    Two-phase: every rank votes; a rank that gives up at ``deadline`` (``_clock.monotonic()``
    seconds) withdraws the offer for everyone, so that a late voter cannot rebuild alone.
    Polls the store every 20 ms.

    Raises:
        RankFailureError: Not every rank voted in time (one completed the op and moved on,
            or failed), a failure was reported meanwhile, or the new group could not form
            within the budget. Nobody retries then.
    """
    jobs = ctl.JobStore(rt.control_root)
    g = rt.generation
    votes = jobs.vote_retry(g, seq, attempt)
    while votes < rt.world_size or jobs.retry_called_off(g, seq, attempt):
        if jobs.retry_called_off(g, seq, attempt):
            raise rt.notify_failure(
                RankFailureError(
                    f"{name}#{seq}: the group retry was called off by a rank that gave up",
                    op=name,
                    seq=seq,
                    generation=rt.generation,
                )
            )
        if rt.failed_for(seq):
            raise rt.build_error(name, seq)
        if _clock.monotonic() >= deadline:
            jobs.call_off_retry(g, seq, attempt)
            rt.mark_raised()
            raise rt.notify_failure(
                RankFailureError(
                    f"{name}#{seq}: only {votes} of {rt.world_size} ranks agreed to retry within "
                    "the budget; the others completed the op or failed, so nobody retries",
                    op=name,
                    seq=seq,
                    generation=rt.generation,
                )
            )
        _clock.sleep(0.02)
        votes = jobs.retry_votes(g, seq, attempt)
    # Generation numbers come from one counter in the store (elastic training draws from it
    # too); the first voter's draw is the one every rank uses.
    gen = jobs.retry_generation(g, seq, attempt)
    rebuild(rt, gen, timeout_s=max(1.0, deadline - _clock.monotonic()))
    rank_log.of(rt).warning(
        "%s#%d retried as a group (attempt %d), now generation %d",
        name,
        seq,
        attempt + 1,
        rt.generation,
    )


def rebuild(
    rt: Runtime,
    generation: int,
    *,
    timeout_s: float,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Replace the default process group with a fresh one for ``generation``.

    ``rank`` and ``world_size`` default to the current ones (a group retry); elastic
    training passes the new ones. Blocks while the new group rendezvouses, at most
    ``timeout_s`` seconds. The watchdog of the old generation keeps running until the new
    group exists, so that failures during the rendezvous are still noticed.

    Raises:
        RankFailureError: The new group did not form in time (the backend's error is kept
            as ``__cause__``).
    """
    rank = rt.rank if rank is None else rank
    world_size = rt.world_size if world_size is None else world_size
    backend = rt.backend
    if dist.is_initialized():
        # An aborted gloo group must be abandoned, never reused; abort first so
        # that destroy does not wait on the stale op.
        abort_group()
        # Kept until no reducer holds it, then released (see release_retired).
        retire_group(dist.group.WORLD, rt.take_stuck())
        dist.destroy_process_group()
    store = dist.PrefixStore(ctl.group_prefix(generation), rt.control_root)
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as e:
        forget_failed_init()
        rt.mark_raised()
        raise rt.notify_failure(
            RankFailureError(
                f"rank {rt.rank} could not form generation {generation} within {timeout_s:.1f} s "
                f"({type(e).__name__}: {e})",
                generation=rt.generation,
            )
        ) from e
    rt.stop_watchdog()
    # Later ops must not inherit the short rendezvous timeout.
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        set_timeout(rt.backend_timeout or default_pg_timeout(backend))
    rt.enter_generation(generation, rank, world_size)
    try:
        join_control_plane(rt, timeout=timedelta(seconds=max(timeout_s, 1.0)))
    except PreflightError as e:
        rt.mark_raised()
        raise rt.notify_failure(RankFailureError(str(e), generation=generation)) from e
    if rt.rank == 0:
        # The launcher (rd.spawn) reads the current generation from here.
        ctl.JobStore(rt.control_root).set_generation(generation)
    # Earlier generations' groups that no reducer holds any more (ResilientDDP releases the
    # one it leaves when it rebuilds its reducer). Inside a recovery: a release that does
    # not end at once goes on in the background.
    release_retired(wait_s=0.1)


def join_control_plane(rt: Runtime, timeout: timedelta | None = None) -> None:
    """Attach ``rt`` to its generation's control plane and start its watchdog: publish
    this rank's identity and first heartbeat, then wait for every rank of the generation
    to have attached.

    Blocks at most ``timeout`` (default ``config.init_timeout``) for the other ranks.

    Raises:
        PreflightError: Some rank did not attach in time.
    """
    c = rt.control
    timeout = rt.config.init_timeout if timeout is None else timeout
    # The watchdog's own connection, made and used once here, under the start-up budget:
    # a new connection to a TCPStore sometimes answers its first calls only after about
    # 5 s (see Runtime.connection), and a watchdog must never wait that long.
    rt.connection("watchdog").event_count()
    c.publish_info(rt.rank, rt.identity)
    c.init_counters()
    c.publish_state(rt.rank, rt.snapshot(0))
    missing = c.wait_attached(rt.world_size, timeout)
    if missing:
        raise PreflightError(
            f"Rank(s) {missing} did not attach to resilient_ddp within "
            f"{timeout}: every rank must call resilient_ddp.init_process_group() "
            "(or its first resilient_ddp collective) at start-up.",
            problems=[f"rank {r} never attached" for r in missing],
        )
    rt.start_watchdog(c.read_infos(list(range(rt.world_size))), Watchdog)


# Groups of earlier generations (elastic shrink and admission, group retries), each with
# the works that failed on it (``Runtime.stuck``), waiting to be released: see retire_group.
_retiring: list[tuple[Any, list[Any]]] = []
# Models whose reducer may hold a retired group (ResilientDDP adds itself).
_group_users: weakref.WeakSet[Any] = weakref.WeakSet()
# Reducers (each with DDP's logger and the group it holds) left behind while a thread was
# stuck in their bucket exchange, with that thread: see leave_behind.
_left_behind: list[tuple[Any, Any, Any, threading.Thread]] = []
# Releases still blocked in the backend after release_retired stopped waiting for them.
_releasing: list[threading.Thread] = []
# How long release_retired waits for the backend to let a group go, before it leaves the
# rest to its helper thread (a group whose op waits on a peer that is stopped, not dead).
_RELEASE_WAIT_S = 0.5


def retire_group(group: Any, works: list[Any]) -> None:
    """Keep ``group`` (just destroyed: a new generation replaces it) and its failed
    ``works`` until :func:`release_retired` can let them go safely."""
    _retiring.append((group, list(works)))


def leave_behind(group: Any, reducer: Any, logger: Any, worker: threading.Thread) -> None:
    """Keep ``reducer`` and DDP's ``logger`` (both hold ``group``) while ``worker`` is
    stuck in their bucket exchange: destructing either would wait for it with the GIL
    held (the exchange holds the reducer's mutex). :func:`release_retired` lets them go,
    with the group's handle, once ``worker`` has ended (on a dead peer, as soon as the
    backend notices; on a stopped one, at the backend's timeout)."""
    _left_behind.append((group, reducer, logger, worker))


def release_retired(wait_s: float = _RELEASE_WAIT_S) -> None:
    """Release the retired groups that no model's reducer still holds, with their works:
    their sockets, threads and buffers.

    Each rebuild of the process group used to keep the old one for good (about W file
    descriptors, 3 threads and the failed works' bucket tensors per generation). Letting
    it go is safe only (a) through its Python handle, whose destructor releases the GIL
    while ``~ProcessGroupGloo`` joins the group's worker threads (a worker finishing a late
    op needs the GIL to free a tensor Python saw), so never while a reducer still holds the
    group (its C++ destructor would drop the last reference with the GIL held); and (b) not
    in the main thread when an op of the group is still blocked in the backend (on a peer
    that is stopped rather than dead, or on a survivor that has not released its own old
    group yet): the destructor waits for it, up to the backend's timeout.

    So the handles are dropped in a helper thread, and this waits at most ``wait_s`` for it
    (an idle group goes in a few milliseconds); a release still blocked then goes on in the
    background (the exit guard is armed: the process must not run the backend's
    destructors at exit), and ends once the op does: the peer's connection closes, or the
    backend's timeout passes. Call it from the main thread.

    Reducers left behind (:func:`leave_behind`) whose stuck thread has ended go with
    them: before their group's handle, which the helper drops last.
    """
    in_use = [
        m.__dict__.get("process_group") for m in list(_group_users) if "reducer" in m.__dict__
    ]
    free_ids = {id(e[0]) for e in _retiring if not any(u is e[0] for u in in_use)}
    _releasing[:] = [t for t in _releasing if t.is_alive()]
    unstuck = [e for e in _left_behind if not e[3].is_alive()]
    if not free_ids and not unstuck:
        return
    # Handed over in a box that the helper empties: no frame of this thread may keep a
    # reference (its last one would then be dropped here, where the op may block). The
    # helper pops from the end: a left-behind reducer and logger go before any handle of
    # their group (a tuple drops its items last to first: the logger, the reducer, then
    # the group's handle, whose destructor releases the GIL).
    box: list[list[tuple[Any, ...]]] = [
        [e for e in _retiring if id(e[0]) in free_ids] + [e[:3] for e in unstuck]
    ]
    _retiring[:] = [e for e in _retiring if id(e[0]) not in free_ids]
    gone = {id(e) for e in unstuck}
    _left_behind[:] = [e for e in _left_behind if id(e) not in gone]
    del unstuck
    worker = threading.Thread(
        target=_release, args=(box,), name="resilient_ddp-release", daemon=True
    )
    worker.start()
    del box
    worker.join(wait_s)
    if worker.is_alive():
        log.debug("a retired process group waits for a blocked op; released in background")
        _exit_guard.arm_exit_guard()
        _releasing.append(worker)


def _release(box: list[list[tuple[Any, ...]]]) -> None:
    entries = box.pop()
    t0 = time.monotonic()
    n = len(entries)
    while entries:
        # The popped entry is dropped at once: torch's handle releases the GIL while the
        # group's destructor joins its threads and closes its connections.
        entries.pop()
    log.debug("released %d retired group(s) or reducer(s) in %.3f s", n, time.monotonic() - t0)
