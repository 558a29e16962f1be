"""Gather results to rank 0 only, in dataset order, in bounded chunks.

:func:`gather_to_rank0` is the end of a distributed evaluation or inference loop: every
rank holds the results of its own items (uneven counts, uneven shapes, arbitrary picklable
objects) and rank 0 needs all of them, in dataset order. torch's answers all fall short:
``all_gather_object`` copies everything to *every* rank (W times the memory), ``all_gather``
needs equal shapes (gloo aborts the process with SIGABRT otherwise) and ``gather`` returns
rank order. Here:

1. the ranks exchange a fixed-size header (entry count, kind of entries, whether indices
   were given), so a dtype mismatch or a rank that passed objects where the others passed
   tensors is a :class:`CollectiveMismatchError` on every rank before any data moves;
2. each rank ``r > 0`` streams its entries to rank 0 in pieces of about ``chunk_bytes`` (a
   piece is a run of pickled entries), one piece per rank per round, each round an uneven
   ``all_to_all_single`` in which only rank 0 receives (no padding): a non-zero rank never
   holds more than its own data, one piece and one entry's pickle, and never anyone else's
   data;
3. rank 0 restores dataset order from the indices, checks that no index is duplicated (or
   missing, with ``num_items``), and broadcasts its verdict, so that an index problem is the
   same error on every rank.

Every wait is bounded like the other collectives, and the timeout applies per piece: a long
gather that makes progress never times out, a rank that stops sending is named.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from resilient_ddp.base._backend import comm_device
from resilient_ddp.config import Duration
from resilient_ddp.detection._diagnosis import majority
from resilient_ddp.errors import CollectiveMismatchError, ConfigError
from resilient_ddp.ops._wire import CompactPickler, buffer_of, dumps, loads, to_cpu
from resilient_ddp.ops.collectives import Op, format_table, op_signature

__all__ = ["gather_to_rank0"]

DEFAULT_CHUNK_BYTES = 4 << 20
_HEADER = 4  # [entries, kind, has indices, num_items]
_LEN = 8  # bytes of the length in front of each entry's pickle
_KIND_NONE = -1  # no entries: agrees with every kind
_KIND_OBJECTS = -2  # anything but tensors of one dtype
# Tensor kinds are an index into this list; it only ever grows at the end.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def gather_to_rank0(
    data: Sequence[Any],
    *,
    indices: Sequence[int] | torch.Tensor | None = None,
    num_items: int | None = None,
    timeout: Duration = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[Any] | None:
    """Collect every rank's entries on rank 0, in dataset order when indices are given.

    Collective over the default group: every rank must call it, with its own entries
    (possibly none). Blocks until rank 0 has everything and has checked the indices.

    Args:
        data: One entry per local item: a tensor of any shape, or any picklable object (a
            nested dict or tuple is kept intact). Entries of all ranks should be of one kind:
            tensors of one dtype, or objects.
        indices: The dataset index of each entry (same length as ``data``). When given, rank
            0's result is ordered by index and an index sent twice is an error.
        num_items: With ``indices``, the number of items of the whole dataset: the indices
            must then be exactly ``range(num_items)``, and a missing one is an error.
        timeout: Longest wait for one piece to move (timedelta or seconds; default
            ``config.op_timeout``). The gather as a whole is not bounded: it may take as
            long as the data needs while pieces keep moving.
        chunk_bytes: Largest size of one piece, in bytes (default 4 MiB). It bounds the
            extra memory of a sending rank: one piece and one entry's pickle (an entry
            larger than a piece is sent as a piece of its own size).

    Returns:
        On rank 0, the list of every rank's entries: ordered by index when ``indices`` are
        given, else rank 0's entries, then rank 1's, and so on. Tensors arrive detached and
        on the CPU (rank 0's own entries too). On every other rank, ``None``.

    Raises:
        CollectiveMismatchError: On every rank: ranks passed entries of different kinds or
            tensor dtypes, some ranks passed ``indices`` and others not, or an index is
            duplicated, out of ``range(num_items)`` or missing. Names the ranks.
        RankFailureError: A rank crashed, raised, left or stopped sending; names it.
        CollectiveTimeoutError: A rank never called the gather (it is named, with where its
            main thread is).
        ConfigError: Invalid arguments (``indices`` of another length than ``data``, ...).
    """
    entries = list(data)
    idx = _index_tensor(indices, len(entries))
    if num_items is not None and (idx is None or num_items < 0):
        raise ConfigError(
            f"num_items ({num_items}) needs indices and must be non-negative: it says how "
            "many dataset items the indices must cover."
        )
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes should be positive, got {chunk_bytes}")
    # The gather is always validated: a rank that issued another op is then named (and the
    # fingerprint's single all-reduce is nothing next to the data).
    o = Op("gather_to_rank0", timeout=timeout, retry=1, validate=True)
    kind = _kind(entries)
    return o.run(
        lambda: _gather(o, entries, idx, kind, num_items, chunk_bytes),
        signature=lambda: op_signature(
            "gather_to_rank0", indices=idx is not None, num_items=num_items
        ),
    )


def _gather(
    o: Op,
    entries: list[Any],
    idx: torch.Tensor | None,
    kind: int,
    num_items: int | None,
    chunk_bytes: int,
) -> list[Any] | None:
    rank, world = o.rt.rank, dist.get_world_size()
    device = comm_device(None)
    # 1. Header: every rank learns every rank's count and kind.
    header = torch.tensor(
        [len(entries), kind, int(idx is not None), -1 if num_items is None else num_items],
        dtype=torch.int64,
    )
    headers = [torch.empty(_HEADER, dtype=torch.int64, device=device) for _ in range(world)]
    o.wait(dist.all_gather(headers, header.to(device), async_op=True), cuda=device.type == "cuda")
    rows = [h.tolist() for h in headers]
    _check_headers(o, rows)
    o.renew()
    own = [to_cpu(e) for e in entries] if rank == 0 else []  # before rank 0 is awaited
    # 2. Stream: rounds of one piece per rank, all to rank 0.
    parts, part_idx, problem = _stream(o, entries, idx, chunk_bytes, device)
    result: list[Any] | None = None
    if rank == 0 and problem is None:
        parts[0] = own
        part_idx[0] = [idx] if idx is not None else []
        result, problem = _assemble(o, parts, part_idx, idx is not None, num_items)
    # 3. Verdict: an index problem found by rank 0 is raised on every rank.
    _share_verdict(o, problem, device)
    return result


def _check_headers(o: Op, rows: list[list[int]]) -> None:
    kinds = {r[1] for r in rows if r[1] != _KIND_NONE}
    flags = {r[2] for r in rows}
    if len(kinds) <= 1 and len(flags) == 1:
        return
    table = {
        i: {"entries": str(r[0]), "kind": _kind_name(r[1]), "indices": "yes" if r[2] else "no"}
        for i, r in enumerate(rows)
    }

    odd_kind = majority([r[1] for r in rows], ignore=_KIND_NONE)[1] if len(kinds) > 1 else []
    odd_flag = majority([r[2] for r in rows])[1] if len(flags) > 1 else []
    odd = sorted(set(odd_kind) | set(odd_flag))
    what = "entries of different kinds or dtypes" if len(kinds) > 1 else ""
    if len(flags) > 1:
        what = (what + " and " if what else "") + "indices on some ranks only"
    o.rt.mark_raised()
    raise CollectiveMismatchError(
        f"gather_to_rank0#{o.seq}: ranks passed {what}; differing rank(s): {odd} "
        f"(this rank: {o.rt.rank})\n" + format_table(table, []),
        table=table,
        ranks=odd,
        op="gather_to_rank0",
        seq=o.seq,
    )


# -- streaming -------------------------------------------------------------------------------
def _stream(
    o: Op, entries: list[Any], idx: torch.Tensor | None, chunk_bytes: int, device: torch.device
) -> tuple[list[list[Any]], list[list[torch.Tensor]], dict[str, Any] | None]:
    """Move every rank's pieces to rank 0, one piece per rank per round.

    A round is two collectives: an all-gather of the pieces' sizes (all zero: done, on every
    rank at once), then an uneven ``all_to_all_single`` in which each rank sends its piece
    to rank 0 only. Collectives rather than point-to-point sends: a gloo send whose wait
    times out is failed for good, so it could not be waited on slice by slice.

    A rank that cannot pickle an entry announces size -1: every rank then stops at the
    same round, and that rank re-raises its own error while the others raise a mismatch
    naming it. An entry that rank 0 cannot unpickle is reported the same way through the
    verdict, after the remaining rounds are drained.

    Returns:
        On rank 0, every rank's entries and index tensors (rank 0's own left empty), and
        the problem to report, if any; elsewhere, empty lists and None.

    Raises:
        CollectiveMismatchError: A rank could not pickle its entries (on the other ranks).
        Exception: This rank's own pickling error.
    """
    rank, world = o.rt.rank, dist.get_world_size()
    cuda = device.type == "cuda"
    pieces = _pieces(entries, idx, chunk_bytes) if rank != 0 else iter(())
    parts: list[list[Any]] = [[] for _ in range(world)]
    part_idx: list[list[torch.Tensor]] = [[] for _ in range(world)]
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    problem: dict[str, Any] | None = None
    while True:
        failed: BaseException | None = None
        try:
            piece = next(pieces, None)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            failed, piece = e, None
        piece = empty if piece is None else piece.to(device)
        size = torch.tensor([-1 if failed else piece.numel()], dtype=torch.int64, device=device)
        sizes_t = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
        o.wait(dist.all_gather(sizes_t, size, async_op=True), cuda=cuda)
        sizes = [int(t) for t in sizes_t]
        if min(sizes) < 0:
            _raise_unpicklable(o, [r for r, n in enumerate(sizes) if n < 0], failed)
        if not any(sizes):
            return parts, part_idx, problem
        received = torch.empty(sum(sizes) if rank == 0 else 0, dtype=torch.uint8, device=device)
        work = dist.all_to_all_single(
            received,
            piece,
            output_split_sizes=sizes if rank == 0 else [0] * world,
            input_split_sizes=[piece.numel()] + [0] * (world - 1),
            async_op=True,
        )
        o.wait(work, cuda=cuda)
        o.renew()
        del piece
        if rank == 0 and problem is None:
            for r, chunk in enumerate(torch.split(received, sizes)):
                if not sizes[r]:
                    continue
                try:
                    got, ids = _parse(chunk)
                except Exception as e:  # noqa: BLE001 - reported on every rank by the verdict
                    problem = _unpickling_problem(o, r, e)
                    break
                parts[r].extend(got)
                if ids is not None:
                    part_idx[r].append(ids)


def _raise_unpicklable(o: Op, ranks: list[int], mine: BaseException | None) -> NoReturn:
    o.rt.mark_raised()
    if mine is not None:
        raise mine
    raise CollectiveMismatchError(
        f"gather_to_rank0#{o.seq}: rank(s) {ranks} could not pickle their entries (their own "
        f"error says why; this rank: {o.rt.rank})",
        table={r: {"entries": "could not be pickled"} for r in ranks},
        ranks=ranks,
        op="gather_to_rank0",
        seq=o.seq,
    )


def _unpickling_problem(o: Op, rank: int, error: BaseException) -> dict[str, Any]:
    return {
        "message": (
            f"gather_to_rank0#{o.seq}: rank 0 could not unpickle an entry sent by rank {rank}: "
            f"{type(error).__name__}: {error}"
        ),
        "table": {rank: {"entries": f"unpickling failed: {type(error).__name__}"}},
        "ranks": [rank],
    }


def _pieces(
    entries: list[Any], idx: torch.Tensor | None, chunk_bytes: int
) -> Iterator[torch.Tensor]:
    """This rank's entries as pieces of at most ``chunk_bytes`` (at least one entry each).

    A piece is ``[entry]... [indices] [count] [has indices]``: each entry is its own pickle
    behind its length, so that rank 0 unpickles it straight from the received buffer; the
    entries' int64 indices and two int64 counters close the piece.

    Every piece is written into one buffer of ``chunk_bytes``, reused from piece to piece
    (the caller has sent a piece before it asks for the next): the extra memory is that
    buffer and one entry's pickle, never a growing stream that reallocates (which held
    two pieces at once). An entry larger than the buffer gets a piece of its own size.
    """
    idx_len = _LEN if idx is not None else 0  # each entry's index, in the piece's tail
    out = bytearray(chunk_bytes)
    pending: memoryview | None = None  # an entry pickled that did not fit the last piece
    start = 0
    while start < len(entries):
        used, end = 0, start
        while end < len(entries):
            blob = pending if pending is not None else _pickled(entries[end])
            pending = None
            # Written so far, this entry behind its length, then the tail: the indices of
            # the piece's entries and the two counters.
            tail_len = idx_len * (end - start + 1) + 2 * _LEN
            if used + _LEN + len(blob) + tail_len > len(out):
                if end > start:
                    pending = blob
                    break
                out = bytearray(_LEN + len(blob) + tail_len)  # one entry, larger
            view = memoryview(out)
            view[used : used + _LEN] = len(blob).to_bytes(_LEN, "little")
            view[used + _LEN : used + _LEN + len(blob)] = blob
            used += _LEN + len(blob)
            end += 1
        tail = b""
        if idx is not None:
            tail = bytes(buffer_of(idx[start:end].contiguous().view(torch.uint8)))
        tail += _int64s(end - start, int(idx is not None))
        memoryview(out)[used : used + len(tail)] = tail
        yield torch.frombuffer(out, dtype=torch.uint8, count=used + len(tail))
        start = end
        if len(out) > chunk_bytes:
            out = bytearray(chunk_bytes)  # back to the usual size after a large entry


def _pickled(entry: Any) -> memoryview:
    buf = io.BytesIO()
    CompactPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(entry)
    return buf.getbuffer()


def _int64s(*values: int) -> bytes:
    return b"".join(v.to_bytes(_LEN, "little", signed=True) for v in values)


def _parse(piece: torch.Tensor) -> tuple[list[Any], torch.Tensor | None]:
    """The entries and indices of one received piece (see :func:`_pieces`)."""
    view = buffer_of(piece)
    end = len(view)
    count = int.from_bytes(view[end - 2 * _LEN : end - _LEN], "little", signed=True)
    has_idx = int.from_bytes(view[end - _LEN : end], "little", signed=True)
    end -= 2 * _LEN
    ids = None
    if has_idx:
        ids = torch.frombuffer(bytearray(view[end - count * _LEN : end]), dtype=torch.int64)
        end -= count * _LEN
    out = []
    at = 0
    while at < end:
        size = int.from_bytes(view[at : at + _LEN], "little")
        at += _LEN
        out.append(pickle.loads(view[at : at + size]))  # noqa: S301 - the peers of one job
        at += size
    return out, ids


def _assemble(
    o: Op,
    parts: list[list[Any]],
    part_idx: list[list[torch.Tensor]],
    has_idx: bool,
    num_items: int | None,
) -> tuple[list[Any], dict[str, Any] | None]:
    flat = [e for p in parts for e in p]
    if not has_idx:
        return flat, None
    counts = [len(p) for p in parts]
    idx = torch.cat([t for ts in part_idx for t in ts] or [torch.empty(0, dtype=torch.int64)])
    owner = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(counts))
    problem = _index_problem(idx, owner, counts, num_items, o.seq)
    if problem is not None:
        return [], problem
    order = torch.argsort(idx, stable=True).tolist()
    return [flat[i] for i in order], None


def _index_problem(
    idx: torch.Tensor, owner: torch.Tensor, counts: list[int], num_items: int | None, seq: int
) -> dict[str, Any] | None:
    """Describe duplicated, out-of-range and missing indices, or return None."""
    world = len(counts)
    sorted_idx = torch.sort(idx).values
    dup_pos = torch.nonzero(sorted_idx[1:] == sorted_idx[:-1]).flatten()
    dup_values = torch.unique(sorted_idx[dup_pos]) if dup_pos.numel() else sorted_idx[:0]
    is_dup = torch.isin(idx, dup_values)
    bad_range = torch.zeros_like(idx, dtype=torch.bool)
    missing: list[int] = []
    if num_items is not None:
        bad_range = (idx < 0) | (idx >= num_items)
        seen = torch.zeros(num_items, dtype=torch.bool)
        seen[idx[~bad_range]] = True
        missing = torch.nonzero(~seen).flatten().tolist()
    if not dup_values.numel() and not bool(bad_range.any()) and not missing:
        return None
    dups_per_rank = torch.bincount(owner[is_dup], minlength=world).tolist()
    range_per_rank = torch.bincount(owner[bad_range], minlength=world).tolist()
    ranks = [r for r in range(world) if dups_per_rank[r] or range_per_rank[r]]
    table = {
        r: {
            "entries": str(counts[r]),
            "duplicated": str(dups_per_rank[r]),
            "out_of_range": str(range_per_rank[r]),
        }
        for r in range(world)
    }
    said = []
    if dup_values.numel():
        first = int(dup_values[0])
        holders = sorted(set(owner[idx == first].tolist()))
        said.append(
            f"{dup_values.numel()} index(es) sent more than once (e.g. {first}, by ranks {holders})"
        )
    if bool(bad_range.any()):
        said.append(f"{int(bad_range.sum())} index(es) outside range({num_items})")
    if missing:
        said.append(f"{len(missing)} index(es) of range({num_items}) missing: {missing[:10]}")
    message = (
        f"gather_to_rank0#{seq}: {'; '.join(said)}; rank(s) at fault: {ranks}\n"
        + format_table(table, [])
    )
    return {"message": message, "table": table, "ranks": ranks}


def _share_verdict(o: Op, problem: dict[str, Any] | None, device: torch.device) -> None:
    cuda = device.type == "cuda"
    payload = dumps(problem) if problem is not None else None
    size = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    o.wait(dist.broadcast(size, 0, async_op=True), cuda=cuda)
    if int(size) == 0:
        return
    buf = (
        payload.to(device)
        if payload is not None
        else torch.empty(int(size), dtype=torch.uint8, device=device)
    )
    o.wait(dist.broadcast(buf, 0, async_op=True), cuda=cuda)
    verdict = loads(buf)
    o.rt.mark_raised()
    raise CollectiveMismatchError(
        verdict["message"],
        table=verdict["table"],
        ranks=verdict["ranks"],
        op="gather_to_rank0",
        seq=o.seq,
    )


# -- entries -----------------------------------------------------------------------------------
def _index_tensor(indices: Sequence[int] | torch.Tensor | None, n: int) -> torch.Tensor | None:
    if indices is None:
        return None
    idx = torch.as_tensor(indices)
    if idx.dim() != 1 or (idx.numel() and (idx.is_floating_point() or idx.is_complex())):
        raise ConfigError(
            "indices should be a 1-d sequence of ints, got a tensor of shape "
            f"{tuple(idx.shape)} and dtype {str(idx.dtype).removeprefix('torch.')}"
        )
    if idx.numel() != n:
        raise ConfigError(
            f"indices should give one index per entry of data: {idx.numel()} indices for "
            f"{n} entries"
        )
    return idx.to(dtype=torch.int64, device="cpu")


def _kind(entries: list[Any]) -> int:
    if not entries:
        return _KIND_NONE
    dtypes = {e.dtype if isinstance(e, torch.Tensor) else None for e in entries}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if dtype is not None and dtype in _DTYPES:
            return _DTYPES.index(dtype)
    return _KIND_OBJECTS


def _kind_name(kind: int) -> str:
    if kind == _KIND_NONE:
        return "(none)"
    if kind == _KIND_OBJECTS:
        return "objects"
    return f"tensor {str(_DTYPES[kind]).removeprefix('torch.')}"
