"""Load a checkpoint once, share it over the group.

Every rank reading the same checkpoint from a shared filesystem at start-up is a classic
cause of stalls: W readers of one file, and a slow mount makes the fastest rank wait in its
first collective until the timeout. :func:`load_and_broadcast` reads on one rank and
:func:`broadcast_state_dict` sends the result to the others over the process group, in
bounded chunks, with the same typed errors and per-chunk timeout as every other op.

The structure (nested dicts, lists, optimizer ``param_groups``, any picklable leaf) travels
as a small pickle with the tensors left out; the tensors' bytes then follow as one stream
cut into chunks, which the receivers take straight into their final buffer.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from resilient_ddp.base._backend import comm_device
from resilient_ddp.config import Duration
from resilient_ddp.errors import (
    CollectiveMismatchError,
    ConfigError,
    Culprit,
    RankFailureError,
    error_head,
    failure_message,
)
from resilient_ddp.ops._wire import SafeUnpickler, dumps, loads
from resilient_ddp.ops.collectives import Op, op_signature
from resilient_ddp.runtime._runtime import ensure_runtime

__all__ = ["broadcast_state_dict", "load_and_broadcast"]

DEFAULT_CHUNK_BYTES = 64 << 20
_ALIGN = 64  # every tensor starts at a multiple of this many bytes of the stream


def broadcast_state_dict(
    state_dict: Any = None,
    src: int = 0,
    *,
    device: torch.device | str | None = None,
    timeout: Duration = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    weights_only: bool = False,
) -> Any:
    """Send ``src``'s state dict (or any nest of tensors and picklable objects) to every rank.

    Collective over the default group: every rank calls it; only ``src``'s ``state_dict``
    is read. Blocks until this rank has the whole state.

    Args:
        state_dict: On ``src``: what to send, e.g. ``model.state_dict()`` or a checkpoint
            dict holding model and optimizer state. Ignored on the other ranks.
        src: Global rank that sends.
        device: Where the received tensors are placed (default: the CPU, like
            ``torch.load(map_location="cpu")``).
        timeout: Longest wait for one chunk (timedelta or seconds; default
            ``config.op_timeout``). The transfer as a whole may take as long as the data
            needs while chunks keep moving.
        chunk_bytes: Size of one chunk of tensor data, in bytes (default 64 MiB): the extra
            memory ``src`` uses to send.
        weights_only: The receivers rebuild only tensors, containers, numbers, strings,
            ``torch.Size``/``device``/dtypes and what ``torch.serialization
            .add_safe_globals`` allows, as ``torch.load(weights_only=True)``; anything else
            raises ``pickle.UnpicklingError`` there. Elastic training sends its state so.

    Returns:
        On ``src``, ``state_dict`` itself. Elsewhere, an equal structure whose tensors hold
        ``src``'s values (detached, on ``device``). They are views into one buffer of the
        whole state: load them into a model (``load_state_dict`` copies) rather than keep
        a few of them, which would keep the whole buffer alive.

    Raises:
        RankFailureError: ``src`` (or another rank) crashed, raised, left or stopped
            responding; names it.
        CollectiveTimeoutError: A rank never called it; names the rank.
        CollectiveMismatchError: Ranks passed different ``src``, or (on the other ranks)
            ``src`` could not pickle ``state_dict``; ``src`` raises its own error.
        ConfigError: ``src`` out of range, ``chunk_bytes`` not positive, no process group,
            or (on ``src``) a sparse or quantized tensor in ``state_dict``.
    """
    world = ensure_runtime().world_size
    if not 0 <= src < world:
        raise ConfigError(f"src should be in [0, {world - 1}], got {src}")
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes should be positive, got {chunk_bytes}")
    o = Op("broadcast_state_dict", timeout=timeout, retry=1, validate=True)
    return o.run(
        lambda: _broadcast(o, state_dict, src, device, chunk_bytes, None, weights_only),
        signature=lambda: op_signature("broadcast_state_dict", src=src),
    )


def send_state_dict(
    state_dict: Any,
    src: int,
    dsts: list[int],
    *,
    timeout: Duration = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    weights_only: bool = False,
) -> Any:
    """:func:`broadcast_state_dict` to the ranks ``dsts`` only, point to point: ``src``
    sends the bytes once to each of them and the other ranks take no part in the transfer
    (elastic training hands its state to joiners so). Every rank of the default group
    calls it, in the same order as its other ops (it counts as one op everywhere).
    ``timeout``, ``chunk_bytes`` and ``weights_only`` are :func:`broadcast_state_dict`'s.

    Returns:
        On ``src``, ``state_dict``; on a rank of ``dsts``, the received copy (as
        :func:`broadcast_state_dict`); elsewhere ``None``.

    Raises:
        RankFailureError: On ``src`` and ``dsts``: the other side of the transfer died,
            left, stopped or hangs; names it.
    """
    o = Op("send_state_dict", timeout=timeout, retry=1, validate=True)
    return o.run(
        lambda: _broadcast(o, state_dict, src, None, chunk_bytes, sorted(dsts), weights_only),
        signature=lambda: op_signature("send_state_dict", src=src),
    )


def load_and_broadcast(
    path: str | os.PathLike[str] | Callable[[], Any],
    src: int = 0,
    *,
    device: torch.device | str | None = None,
    weights_only: bool = True,
    timeout: Duration = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Any:
    """Read a checkpoint on ``src`` only and give it to every rank.

    Args:
        path: The file to ``torch.load`` (on the CPU), or a function that returns the
            object to share (for another format); only ``src`` opens or calls it.
        src: Global rank that reads.
        device: Where every rank's tensors are placed (default: the CPU).
        weights_only: Passed to ``torch.load``.
        timeout: As :func:`broadcast_state_dict`; reading the file on ``src`` is not
            bounded by it.
        chunk_bytes: As :func:`broadcast_state_dict`.

    Returns:
        The loaded object, on every rank (on ``src``, as ``torch.load`` returned it, moved
        to ``device`` when one is given).

    Raises:
        RankFailureError: On every rank but ``src`` when ``src`` could not read the
            checkpoint (the culprit holds its exception); ``src`` raises that exception.
        Others: as :func:`broadcast_state_dict`.
    """
    rt = ensure_runtime()
    error: BaseException | None = None
    obj: Any = None
    if rt.rank == src:
        try:
            obj = (
                path()
                if callable(path)
                else torch.load(path, map_location="cpu", weights_only=weights_only)
            )
            if device is not None:
                obj = _move(obj, torch.device(device))
        except Exception as e:  # noqa: BLE001 - every rank learns of it, then src re-raises it
            error = e
            obj = _LoadFailed(type(e).__qualname__, str(e))
    shared = broadcast_state_dict(obj, src, device=device, timeout=timeout, chunk_bytes=chunk_bytes)
    if error is not None:
        raise error
    if isinstance(shared, _LoadFailed):
        # The group itself is healthy (the failure was reported through it): unlike a
        # peer's crash, this error does not fail later ops.
        culprit = Culprit.of(
            src,
            f"raised {shared.exc_type} while loading {path!r}",
            info=rt.infos.get(src),
            exc_type=shared.exc_type,
            exc_message=shared.message,
        )
        head = error_head("load_and_broadcast", rt.rank, generation=rt.generation)
        raise RankFailureError(
            failure_message(f"{head}: rank {src} could not load the checkpoint", [culprit]),
            culprits=[culprit],
            op="load_and_broadcast",
            generation=rt.generation,
        )
    return shared


class _LoadFailed:
    """What ``src`` sends instead of the checkpoint when reading it raised."""

    def __init__(self, exc_type: str, message: str) -> None:
        self.exc_type = exc_type
        self.message = message


def _broadcast(
    o: Op,
    state: Any,
    src: int,
    device: torch.device | str | None,
    chunk_bytes: int,
    dsts: list[int] | None,
    weights_only: bool = False,
) -> Any:
    """``state`` from ``src`` to every rank, or to the ranks ``dsts`` point to point."""
    comm = comm_device(None)
    cuda = comm.type == "cuda"
    is_src = o.rt.rank == src
    if dsts is not None and not is_src and o.rt.rank not in dsts:
        return None

    def send(t: torch.Tensor) -> None:
        if dsts is None:
            o.wait(dist.broadcast(t, src, async_op=True), cuda=cuda)
        elif is_src:
            works = [(d, dist.isend(t, d)) for d in dsts]
            for d, work in works:
                o.wait_p2p(work, d, cuda=cuda)
        else:
            o.wait_p2p(dist.irecv(t, src), src, cuda=cuda)

    target = torch.device(device) if device is not None else torch.device("cpu")
    # 1. The structure, tensors left out, and each tensor's dtype, shape and offset; the
    # sender's chunk size travels with it, so that every rank loops the same way. A sender
    # that cannot pickle the structure announces size -1 instead.
    tensors: list[torch.Tensor] = []
    meta = torch.empty(0, dtype=torch.uint8)
    failed: BaseException | None = None
    if is_src:
        try:
            buf = io.BytesIO()
            _SkeletonPickler(buf, tensors).dump(state)
            specs, total = _layout(tensors)
            meta = dumps((buf.getvalue(), specs, total, chunk_bytes))
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            failed = e
    size = torch.tensor([-1 if failed else meta.numel()], dtype=torch.int64, device=comm)
    send(size)
    if int(size) < 0:
        o.rt.mark_raised()
        if failed is not None:
            raise failed
        raise CollectiveMismatchError(
            f"broadcast_state_dict#{o.seq}: rank {src} could not pickle its state (its own "
            f"error says why; this rank: {o.rt.rank})",
            table={src: {"state": "could not be pickled"}},
            ranks=[src],
            op="broadcast_state_dict",
            seq=o.seq,
        )
    meta_buf = meta.to(comm) if is_src else torch.empty(int(size), dtype=torch.uint8, device=comm)
    send(meta_buf)
    o.renew()
    skeleton, specs, total, chunk = loads(meta_buf, weights_only=True)
    # 2. The tensors' bytes as one stream, chunk by chunk. Receivers take each chunk into
    # their final buffer on ``device`` (straight, or through a staging buffer on the
    # communication device when that differs); src copies one chunk at a time.
    flat = torch.empty(0 if is_src else total, dtype=torch.uint8, device=target)
    direct = flat.device == comm
    staging = torch.empty(
        min(chunk, total) if is_src or not direct else 0, dtype=torch.uint8, device=comm
    )
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        piece = flat[start:end] if direct and not is_src else staging[: end - start]
        if is_src:
            _fill(piece, start, tensors, specs)
        send(piece)
        if not is_src and not direct:
            flat[start:end].copy_(piece)
        o.renew()
    if is_src:
        return state
    # 3. Rebuild: views into the one buffer.
    rebuilt = [
        flat[off : off + nbytes].view(getattr(torch, dtype)).reshape(shape)
        for dtype, shape, off, nbytes in specs
    ]
    return _SkeletonUnpickler(io.BytesIO(skeleton), rebuilt, weights_only).load()


def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    specs = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return specs, offset


def _fill(
    chunk: torch.Tensor,
    start: int,
    tensors: list[torch.Tensor],
    specs: list[tuple[str, tuple[int, ...], int, int]],
) -> None:
    """Copy the stream's bytes ``[start, start + len(chunk))`` from the tensors into
    ``chunk`` (alignment gaps are left as they are: nobody reads them)."""
    end = start + chunk.numel()
    for t, (_, _, off, nbytes) in zip(tensors, specs, strict=True):
        if off + nbytes <= start or off >= end:
            continue
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        a, b = max(off, start), min(off + nbytes, end)
        chunk[a - start : b - start].copy_(raw[a - off : b - off])


class _SkeletonPickler(pickle.Pickler):
    """Pickles a structure with every tensor replaced by its position in ``tensors``."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                raise ConfigError(
                    f"broadcast_state_dict sends dense tensors only, got one with layout "
                    f"{obj.layout}{' (quantized)' if obj.is_quantized else ''}"
                )
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _SkeletonUnpickler(SafeUnpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor], weights_only: bool) -> None:
        super().__init__(file)
        self.tensors = tensors
        self.weights_only = weights_only

    def find_class(self, module: str, name: str) -> Any:
        if self.weights_only:
            return super().find_class(module, name)
        return pickle.Unpickler.find_class(self, module, name)

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[int(pid)]


def _move(obj: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), obj)
