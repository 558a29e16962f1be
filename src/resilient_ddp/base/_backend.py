"""Backend-specific pieces: which device carries small control tensors, how to abort."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")


def nccl_version() -> str:
    """NCCL's version as ``"2.27.3"``; ``""`` without CUDA or NCCL, ``"?"`` if asking fails."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return ""
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError):
        return "?"


def backend_name(group: dist.ProcessGroup | None = None) -> str:
    """The backend of ``group`` (default: the world), lower-case, e.g. ``"gloo"``."""
    return str(dist.get_backend(group)).lower()


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    return "nccl" in backend_name(group)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a small tensor must live on to be communicated over ``group``."""
    if uses_nccl(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def abort_group(group: dist.ProcessGroup | None = None) -> None:
    """Abort ``group``'s communicators so that ops blocked on a dead peer return.

    With NCCL this is what releases kernels spinning on a dead peer; with gloo it returns at
    once but cannot interrupt an op already blocked, so the library never
    relies on it there.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return
    try:
        abort = getattr(pg, "abort", None)
        if abort is not None:
            abort()
            return
        c10d = dist.distributed_c10d
        fn = getattr(c10d, "_abort_process_group", None)
        if fn is not None:
            fn(pg)
    except Exception:
        log.debug("abort of process group failed", exc_info=True)


def default_pg_timeout(backend: str | None) -> timedelta:
    """torch's own default backend timeout for ``backend``: 10 minutes for NCCL, 30 for
    the others (gloo), as ``torch.distributed.init_process_group`` would pick.

    The library's collectives have their own deadlines; this one bounds only the plain
    ``torch.distributed`` calls, which must not fail sooner than without the library.
    """
    c10d = dist.distributed_c10d
    nccl = (backend or "").lower() == "nccl" or (backend is None and torch.cuda.is_available())
    default = getattr(c10d, "default_pg_timeout", timedelta(minutes=30))
    if nccl:
        return getattr(c10d, "default_pg_nccl_timeout", None) or timedelta(minutes=10)
    return default if isinstance(default, timedelta) else timedelta(minutes=30)


def forget_failed_init() -> None:
    """Undo what a failed ``init_process_group`` leaves behind, so that the next attempt
    rendezvouses under the same names as its peers.

    torch names process groups from a counter (``get_pg_count()``) that starts again at 0
    when the default group is destroyed; an init that fails (its rendezvous timed out)
    still counted its group, so a retry in that process would meet its peers under the
    next name (``pg/1`` against their ``pg/0``) and time out again, for ever.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        try:
            world.group_count = 0
        except Exception:  # a torch without the counter: nothing to undo
            log.debug("could not reset torch's process-group counter", exc_info=True)
