"""Bounded ``torch.distributed`` collectives for code that calls torch directly.

Frameworks call torch's collectives themselves: Lightning's ``self.log(...,
sync_dist=True)`` and ``strategy.barrier()``, torchmetrics' state sync, Accelerate's
``gather``, ``reduce`` and ``wait_for_everyone``. Those calls know nothing of the library:
after a peer failed they block until the process group's own timeout (30 minutes by
default) or end with gloo's ``Connection closed by peer``.

:func:`bound_torch_collectives` replaces the blocking collectives in the
``torch.distributed`` namespace with functions of the same signature that issue torch's
own op asynchronously and wait for it as the library waits for its own ops: bounded by
``op_timeout``, failed at once when a failure is already known, and raising the library's
typed error that names the culprit. Asynchronous calls (``async_op=True``) and calls made
before the library's runtime is attached go to torch unchanged.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from resilient_ddp.ops.collectives import Op, all_gather_object, broadcast_object, op_signature
from resilient_ddp.runtime import _runtime

__all__ = ["bound_torch_collectives"]

# torch.distributed's collectives that take ``async_op``: the bounded version issues them
# asynchronously and waits for the work.
_ASYNC_OPS = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
)
# Object collectives (no ``async_op`` in torch): replaced by the library's own.
_OBJECT_OPS = ("all_gather_object", "broadcast_object_list")

_originals: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


def bound_torch_collectives(enabled: bool = True) -> None:
    """Bound ``torch.distributed``'s blocking collectives in time, with typed errors.

    After the call, ``torch.distributed.all_reduce``, ``broadcast``, ``barrier``,
    ``all_gather``, ``all_gather_into_tensor``, ``all_gather_single``,
    ``reduce_scatter_tensor``, ``reduce_scatter_single``, ``reduce_scatter``, ``reduce``,
    ``gather``, ``scatter``, ``all_to_all``, ``all_to_all_single``,
    ``all_reduce_coalesced``, ``all_gather_coalesced`` (those the installed torch has),
    ``all_gather_object`` and ``broadcast_object_list`` wait like
    the library's own collectives: at most ``op_timeout`` per attempt (late but alive ranks
    are waited for within ``op_budget``), at once when a failure is already known, and
    with :class:`RankFailureError` or :class:`CollectiveTimeoutError` naming the culprit
    instead of a hang or gloo's ``Connection closed by peer``. Signatures and results are
    torch's. :func:`make_resilient` and the framework integrations call it for you.

    What stays torch's: calls with ``async_op=True`` (the caller waits on the work), calls
    made before the library's runtime is attached (before a :class:`ResilientDDP` or
    :func:`init_process_group` of the library), and code that imported a function by name
    before this call (``from torch.distributed import all_reduce``).

    Args:
        enabled: ``False`` puts torch's own functions back.

    Raises:
        Nothing itself; the replaced collectives raise what the library's collectives
        raise (:class:`RankFailureError`, :class:`CollectiveTimeoutError`).
    """
    with _lock:
        if not enabled:
            for name, fn in _originals.items():
                setattr(dist, name, fn)
            _originals.clear()
            return
        if _originals:
            return
        for name in _ASYNC_OPS + _OBJECT_OPS:
            original = getattr(dist, name, None)
            if original is None:
                continue  # not in this torch release
            _originals[name] = original
            maker = _bounded_async if name in _ASYNC_OPS else _bounded_object
            setattr(dist, name, maker(name, original))


def _active(group: Any) -> bool:
    """Whether a call on ``group`` goes through the library: the runtime is attached and
    the group is one of this process's (not a group of another backend's world)."""
    return (
        _runtime.current() is not None
        and dist.is_initialized()
        and (group is None or isinstance(group, dist.ProcessGroup))
    )


def _bounded_async(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if bound.arguments.get("async_op") or not _active(group):
            return original(*args, **kwargs)
        bound.arguments["async_op"] = True
        tensors = [t for t in tree_flatten((bound.args, bound.kwargs))[0] if _is_tensor(t)]
        rt = _runtime.current()
        cuda = any(t.is_cuda for t in tensors) or (
            name == "barrier" and rt is not None and rt.backend == "nccl"
        )
        op = Op(
            f"torch.distributed.{name}",
            group=None if group is dist.group.WORLD else group,
            retry=1,
        )

        def body() -> None:
            work = original(*bound.args, **bound.kwargs)
            if isinstance(work, torch._C.Future):
                # The coalesced ops hand back their work's future, not the work.
                # (torch._C.Future, the base of torch.futures.Future: same methods.)
                op.wait_pending(op.track(cast("torch.futures.Future[Any]", work)), work)
            elif work is not None:  # None: this rank takes no part (not in the group)
                op.wait(work, cuda=cuda)

        first = tensors[0] if tensors else None
        op.run(body, signature=lambda: op_signature(name, first))
        return None

    return bounded


def _bounded_object(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        group = bound.arguments.get("group")
        if not _active(group) or bound.arguments.get("group_src") is not None:
            return original(*args, **kwargs)
        object_list = bound.arguments["object_list"]
        group = None if group is dist.group.WORLD else group
        if name == "all_gather_object":
            object_list[:] = all_gather_object(bound.arguments["obj"], group=group)
        else:
            src = bound.arguments.get("src")
            src = 0 if src is None else int(src)
            mine = list(object_list) if dist.get_rank() == src else None
            object_list[:] = broadcast_object(mine, src=src, group=group)
        return None

    return bounded


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
