"""Membership: generations of the process group, and rebuilding it as a group decision.

Generation ``N``'s process group rendezvouses under store prefix ``rd/<job>/g<N>/pg``
(:func:`~resilient_ddp._control.group_prefix`) and its control plane lives under
``rd/<job>/g<N>/``. Moving to ``N+1`` needs every member to agree through the store (never
through the broken data plane), after which each member aborts and destroys the old group
and creates the new one.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from . import _clock
from . import _control as ctl
from ._backend import abort_group, default_pg_timeout, forget_failed_init
from ._events import rank_log
from ._runtime import Runtime
from .errors import PreflightError, RankFailureError
from .process_group import _join_control_plane, release_retired, retire_group

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
        _join_control_plane(rt, timeout=timedelta(seconds=max(timeout_s, 1.0)))
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
