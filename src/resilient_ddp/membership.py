"""Membership: generations of the process group, and rebuilding it as a group decision.

Generation ``N``'s process group rendezvouses under store prefix ``rd/g<N>/pg`` and its
control plane lives under ``rd/g<N>/``. Moving to ``N+1`` needs every member to agree
through the store (never through the broken data plane), after which each member aborts and
destroys the old group and creates the new one.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from . import _control as ctl
from ._backend import abort_group, default_pg_timeout
from ._runtime import Runtime
from .errors import RankFailureError
from .process_group import _join_control_plane

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")


def regroup(rt: Runtime, name: str, seq: int, attempt: int, deadline: float) -> None:
    """Agree with every rank to redo op ``seq`` and move the job to the next generation.

    Blocks until every rank voted (polling the store every 20 ms) or ``deadline``
    (``time.monotonic()`` seconds).

    Raises:
        RankFailureError: A rank did not vote in time (it completed the op and moved on,
            or failed) or a failure was reported meanwhile; nobody retries then.
    """
    key = f"retry/{seq}/{attempt}"
    votes = int(rt.control.store.add(key, 1))
    while votes < rt.world_size:
        if rt.failed_for(seq):
            raise rt.build_error(name, seq)
        if time.monotonic() >= deadline:
            raise RankFailureError(
                f"{name}#{seq}: only {votes} of {rt.world_size} ranks agreed to retry within "
                "the budget; the others completed the op or failed, so nobody retries",
                op=name,
                seq=seq,
                generation=rt.generation,
            )
        time.sleep(0.02)
        votes = int(rt.control.store.add(key, 0))
    rebuild(rt, rt.generation + 1)
    log.warning(
        "rank %d: %s#%d retried as a group (attempt %d), now generation %d",
        rt.rank,
        name,
        seq,
        attempt + 1,
        rt.generation,
    )


def rebuild(rt: Runtime, generation: int) -> None:
    """Replace the default process group with a fresh one for ``generation``.

    Blocks while the new group rendezvouses (bounded by the backend's timeout).
    """
    if rt.watchdog is not None:
        rt.watchdog.stop(timeout=2 * rt.config.heartbeat_interval.total_seconds() + 1)
    backend = rt.backend
    # An aborted gloo group must be abandoned, never reused (FINDINGS); abort first so that
    # destroy does not wait on the stale op.
    abort_group()
    from .process_group import _abandoned

    _abandoned.append((dist.group.WORLD, list(rt.stuck)))
    rt.stuck.clear()
    dist.destroy_process_group()
    store = dist.PrefixStore(f"g{generation}/pg", rt.control_root)
    dist.init_process_group(
        backend,
        store=store,
        rank=rt.rank,
        world_size=rt.world_size,
        timeout=default_pg_timeout(rt.config.effective_op_budget, rt.config.heartbeat_timeout),
    )
    rt.generation = generation
    rt.control = ctl.ControlPlane(rt.control_root, generation)
    with rt.lock:
        rt.failures.clear()
        rt.left.clear()
    rt.owns_group = True
    _join_control_plane(rt)
