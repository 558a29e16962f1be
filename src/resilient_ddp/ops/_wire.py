"""Bytes on the wire: objects to ``uint8`` tensors and back, for the object collectives."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


def dumps(obj: Any, *, compact_tensors: bool = False) -> torch.Tensor:
    """Pickle ``obj`` into a CPU ``uint8`` tensor.

    Args:
        obj: Any picklable object.
        compact_tensors: Pickle each tensor as its own bytes (see :class:`CompactPickler`)
            instead of torch's default, which keeps a view's whole storage and the device.
    """
    buf = io.BytesIO()
    pickler = CompactPickler if compact_tensors else pickle.Pickler
    pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)


def loads(t: torch.Tensor, *, weights_only: bool = False) -> Any:
    """The object pickled into the ``uint8`` tensor ``t``.

    Args:
        t: The bytes.
        weights_only: Unpickle only what a state dict holds (see :class:`SafeUnpickler`),
            as ``torch.load(weights_only=True)`` does.

    Raises:
        pickle.UnpicklingError: With ``weights_only``, the bytes name another type.
    """
    if weights_only:
        return SafeUnpickler(io.BytesIO(bytes(buffer_of(t)))).load()
    return pickle.loads(buffer_of(t))  # noqa: S301 - the peers of one job


# What a state dict (model, optimizer, scheduler, sampler) is made of, besides tensors.
_SAFE_GLOBALS = frozenset(
    [("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float")]
    + [("builtins", n) for n in ("complex", "bool", "str", "bytes", "bytearray", "slice")]
    + [("builtins", "range"), ("collections", "OrderedDict"), ("torch", "Size")]
    + [("torch", "device"), ("torch._utils", "_rebuild_tensor_v2")]
)


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds containers, numbers, strings, ``torch.Size``,
    ``torch.device``, dtypes and the globals allowed by
    ``torch.serialization.add_safe_globals``, and refuses anything else (an arbitrary
    callable in the stream could run code: the ``weights_only`` rule of ``torch.load``).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or _is_dtype(module, name) or _user_safe(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"weights_only: {module}.{name} is not allowed in a state received from a peer; "
            "if your state holds it and you trust it, allow it with "
            f"torch.serialization.add_safe_globals([{module}.{name}])"
        )


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _user_safe(module: str, name: str) -> bool:
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        label = entry[1] if isinstance(entry, tuple) else None
        qual = label or f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if qual == f"{module}.{name}":
            return True
    return False


def buffer_of(t: torch.Tensor) -> Any:
    """A bytes-like view of a ``uint8`` tensor's data (a copy only without numpy)."""
    t = t.cpu().contiguous()
    try:
        array: Any = t.numpy()  # Any: numpy may be absent where this is type-checked
        return memoryview(array)
    except RuntimeError:  # numpy is not installed: slower, same bytes
        return bytes(t.tolist())


class CompactPickler(pickle.Pickler):
    """Pickles a dense tensor as its own bytes, detached and for the CPU.

    torch's default pickling keeps a view's whole storage (``out[i]`` of a large batch would
    carry the batch) and rebuilds a CUDA tensor on a GPU of the receiver.
    """

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach()
        if t.layout != torch.strided or t.is_quantized:
            return NotImplemented
        t = t.resolve_conj().resolve_neg().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        try:
            array: Any = raw.numpy()
            buf: Any = pickle.PickleBuffer(array)  # copied once, into the stream
        except RuntimeError:  # numpy is not installed
            buf = bytearray(raw.tolist())
        return _rebuild_tensor, (buf, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _rebuild_tensor(buf: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not buf:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(buf, dtype=dt).reshape(shape)


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in its lists, tuples and dicts detached and on the CPU."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), obj)
