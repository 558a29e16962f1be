"""The work pool of distributed inference: the chunk plan, the store protocol, the files.

Items are grouped into chunks (:func:`plan_chunks`); ranks pull chunks from the control
plane as they finish the last one; rank 0 collects the results, returns the chunks of a
rank that failed to the pool (once), and ends the call. Everything here is pure or talks to
one ``dist.Store``-like object (``add``, ``set``, ``get``, ``check``, ``multi_set``,
``delete_key``), so the protocol is tested with an in-memory store.

Keys of inference call ``c``, under the current generation's prefix (``rd/<job>/g<N>/``):

=====================  ==================================================================
``inf/<c>/plan``       rank 0's plan id and the plan chunks left to run (JSON; the chunks
                       already written in ``output_dir`` are not): ticket ``t`` below
                       their number is the ``t``-th of them
``inf/<c>/next``       tickets drawn (a counter): ticket ``t < chunks`` is chunk ``t``;
                       ticket ``chunks + k`` is redo entry ``k``
``inf/<c>/redo/n``     redo entries published by rank 0 (a counter); ``END`` added once
                       the call is over
``inf/<c>/redo/<k>``   redo entry ``k``: the chunk, its items still to do, the ranks that
                       must not run it (JSON)
``inf/<c>/lease/<r>``  the ticket rank ``r`` holds (its current or next work)
``inf/<c>/res/<t>``    ticket ``t``'s delivery: pickled results (or, with ``output_dir``,
                       the name of the file that holds them) and the items that raised;
                       or, for one over :data:`PART_BYTES`, its record: how many parts
                       and their SHA-256; deleted by rank 0 once read
``inf/<c>/res/<t>/<k>`` part ``k`` of ticket ``t``'s delivery when it is split (at most
                       :data:`PART_BYTES` each); deleted by rank 0 once read
``inf/<c>/given_up``   the workers rank 0 gave up on, and why (JSON), written before
                       ``END``: one resumed late raises instead of returning
``inf/<c>/guests``     replacements that came to help (a counter): helper ``k`` works as
                       worker ``world_size + k`` (its lease under that number)
``inf/<c>/guest/<w>/beat`` helper ``w``'s heartbeat (a counter it bumps every
                       ``heartbeat_interval``): rank 0 gives its lease back when it stops
=====================  ==================================================================

A replacement started while a call runs (``rd.spawn(restarts=N)``, an elastic launcher)
finds the call in the job's ``inf/open`` record (sealed, outside the generation) and helps
with it: it pulls and delivers chunks as a rank does, without joining the process group.

A worker's round trips per chunk: one ``add`` on ``next`` (its next ticket) and one
``multi_set`` that delivers the chunk it ran and records its next ticket as its lease.
Only a worker with nothing left to do (at the very end) and rank 0 poll.

Large deliveries: torch's libuv ``TCPStore`` (the default since torch 2.4) refuses a value
over 8 MiB; it drops the client's connection, and every rank then sees the store as gone.
A delivery whose bytes exceed :data:`PART_BYTES` (4 MiB, half that limit, so headers and a
future lower limit leave room) is therefore cut into parts written under
``res/<t>/<k>``, and ``res/<t>`` holds a small sealed record naming how many parts there
are and the SHA-256 of their bytes. The parts are written before the record (in the same
``multi_set`` when they total at most :data:`MULTI_SET_BYTES`, else in ``multi_set`` calls of
at most that many bytes, the record and the lease in the last), so a rank that dies while
writing leaves no record and rank 0 takes nothing: its ticket goes back to the pool as any
dead rank's does, and rank 0 deletes the parts left behind at the end of the call
(:func:`sweep_parts`). A split delivery costs the worker ``ceil(bytes / MULTI_SET_BYTES)``
``multi_set`` calls instead of one, and rank 0 one ``check``, one ``get`` and one
``delete_key`` per part more.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import math
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from resilient_ddp.errors import ResilientDDPError

FORMAT_VERSION = 1
END = 1 << 40  # added to ``redo/n`` when the call is over
MANIFEST = "manifest.json"
CHUNKS_PER_RANK = 8  # default chunk size: about this many chunks per rank
TAPER = 2  # by default no chunk holds more than the items left over TAPER * world_size
# The libuv TCPStore refuses a value over 8 MiB (and drops the connection): deliveries over
# PART_BYTES are split into parts (see the module's docstring).
PART_BYTES = 4 << 20
# Parts a worker writes in one multi_set, in bytes (the limit is per value, not per call;
# this bound keeps one message, and the store's copy of it, moderate).
MULTI_SET_BYTES = 32 << 20


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the pool uses."""

    def add(self, key: str, value: int) -> int: ...
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...
    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Chunk:
    """One unit of work: dataset indices run together by one rank.

    Attributes:
        index: The chunk's number in the plan (0 = first drawn).
        items: Dataset indices, in the order they are run.
        cost: Their summed cost (their count without costs).
    """

    index: int
    items: tuple[int, ...]
    cost: float


@dataclass(frozen=True)
class Entry:
    """What a ticket stands for: a plan chunk, or a redo entry (part of one).

    Attributes:
        chunk: The plan chunk the items belong to.
        items: The items to run.
        exclude: Ranks that must not run them (the item raised there).
        why: Why it is redone (empty for a chunk's first run).
    """

    chunk: int
    items: tuple[int, ...]
    exclude: frozenset[int] = frozenset()
    why: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {"c": self.chunk, "i": list(self.items), "x": sorted(self.exclude), "w": self.why}
        )

    @staticmethod
    def from_json(raw: bytes | str) -> Entry:
        d = json.loads(raw)
        return Entry(int(d["c"]), tuple(d["i"]), frozenset(d["x"]), str(d["w"]))


@dataclass(frozen=True)
class InferenceItemFailure:
    """An item whose ``fn`` raised.

    Attributes:
        index: The dataset index.
        exc_type: The exception's class name.
        message: Its message.
        ranks: The ranks it raised on, in order.
    """

    index: int
    exc_type: str
    message: str
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Delivery:
    """A ticket's results as a worker delivers them.

    Attributes:
        ticket: The ticket.
        rank: The rank that ran it.
        indices: The items that succeeded, aligned with ``results``.
        results: Their results (``None`` when they are in ``file``).
        failures: Items that raised, as ``(index, exc_type, message)``.
        compute_s: Seconds spent running ``fn`` on it.
        file: The chunk file that holds the results (with ``output_dir``), else ``""``.
        declined: The rank may not run these items (it is excluded); nothing was run.
        parts: In a split delivery's record: how many parts hold the delivery (else 0).
        digest: In a split delivery's record: the SHA-256 (hex) of the parts' bytes.
    """

    ticket: int
    rank: int
    indices: tuple[int, ...]
    results: list[Any] | None
    failures: tuple[tuple[int, str, str], ...] = ()
    compute_s: float = 0.0
    file: str = ""
    declined: bool = False
    parts: int = 0
    digest: str = ""


# -- the plan --------------------------------------------------------------------------------
def default_chunk_size(num_items: int, world_size: int, batch_size: int) -> int:
    """Items per chunk when the caller gives none: about :data:`CHUNKS_PER_RANK` chunks per
    rank, at least one batch, a whole number of batches."""
    per = math.ceil(num_items / max(1, world_size * CHUNKS_PER_RANK))
    return max(batch_size, math.ceil(per / batch_size) * batch_size)


def plan(
    num_items: int,
    chunk_size: int | None,
    world_size: int,
    batch_size: int,
    costs: Sequence[float] | None = None,
) -> tuple[Chunk, ...]:
    """The chunks of a call: :func:`plan_chunks` with ``chunk_size``; by default (None),
    :func:`default_chunk_size` tapered at the end (:func:`tapered_sizes`) when the costs are
    unknown, cut by cost otherwise.

    Raises:
        ValueError: As :func:`plan_chunks`.
    """
    if chunk_size is not None or costs is not None:
        size = chunk_size or default_chunk_size(num_items, world_size, batch_size)
        return plan_chunks(num_items, size, costs)
    largest = default_chunk_size(num_items, world_size, batch_size)
    chunks: list[Chunk] = []
    start = 0
    for size in tapered_sizes(num_items, world_size, batch_size, largest):
        chunks.append(Chunk(len(chunks), tuple(range(start, start + size)), float(size)))
        start += size
    return tuple(chunks)


def tapered_sizes(num_items: int, world_size: int, batch_size: int, largest: int) -> list[int]:
    """Chunk sizes (items, in dataset order) that shrink as the work runs out: each at most
    ``largest`` and at most the items left over ``TAPER * world_size``, in whole batches,
    at least one batch. With costs nobody knows (generation lengths), the last chunks are
    small, so the ranks finish close together: a simulated heavy-tailed load (2000 items,
    4 ranks, log-normal and Pareto costs, 5 seeds) ends within 1.011 of the ideal, against
    up to 1.075 with equal chunks, for about 1.5 times as many chunks (two store round
    trips each)."""
    sizes: list[int] = []
    left = num_items
    while left > 0:
        share = math.ceil(left / (TAPER * max(1, world_size)) / batch_size) * batch_size
        size = min(left, largest, max(batch_size, share))
        sizes.append(size)
        left -= size
    return sizes


def plan_chunks(
    num_items: int, chunk_size: int, costs: Sequence[float] | None = None
) -> tuple[Chunk, ...]:
    """Group ``range(num_items)`` into chunks of at most ``chunk_size`` items.

    Without costs: consecutive ranges, in dataset order. With costs: items heaviest first
    (stable), cut into chunks of about equal cost (the mean chunk cost with
    ``ceil(num_items / chunk_size)`` chunks) and at most ``chunk_size`` items, so chunks
    drawn in order go from heavy to light and a pulled schedule ends balanced.

    Raises:
        ValueError: ``chunk_size < 1``, or ``costs`` of another length or with a negative
            or non-finite value.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size should be >= 1, got {chunk_size}")
    if costs is None:
        return tuple(
            Chunk(
                k,
                tuple(range(s, min(s + chunk_size, num_items))),
                float(min(chunk_size, num_items - s)),
            )
            for k, s in enumerate(range(0, num_items, chunk_size))
        )
    if len(costs) != num_items:
        raise ValueError(f"costs has {len(costs)} values for {num_items} items")
    cs = [float(c) for c in costs]
    if any(not math.isfinite(c) or c < 0 for c in cs):
        raise ValueError("costs should be finite and >= 0")
    order = sorted(range(num_items), key=lambda i: -cs[i])
    n_chunks = max(1, math.ceil(num_items / chunk_size))
    target = sum(cs) / n_chunks
    chunks: list[Chunk] = []
    cur: list[int] = []
    acc = 0.0
    for i in order:
        if cur and (len(cur) >= chunk_size or acc + cs[i] > target * 1.0000001):
            chunks.append(Chunk(len(chunks), tuple(cur), acc))
            cur, acc = [], 0.0
        cur.append(i)
        acc += cs[i]
    if cur:
        chunks.append(Chunk(len(chunks), tuple(cur), acc))
    return tuple(chunks)


# -- wire ------------------------------------------------------------------------------------
def _mac(key: bytes | None, name: str, body: bytes) -> bytes:
    if key is None:
        return b""
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest()


def pack(key: bytes | None, name: str, d: Delivery) -> bytes:
    """A delivery's bytes in the store (sealed with the job's key when it has one)."""
    buf = io.BytesIO()
    torch.save(
        {
            "ticket": d.ticket,
            "rank": d.rank,
            "indices": list(d.indices),
            "results": d.results,
            "failures": [list(f) for f in d.failures],
            "compute_s": d.compute_s,
            "file": d.file,
            "declined": d.declined,
            "parts": d.parts,
            "digest": d.digest,
        },
        buf,
    )
    body = buf.getvalue()
    return _mac(key, name, body) + body


def unpack(key: bytes | None, name: str, raw: bytes) -> Delivery | None:
    """The delivery stored under ``name``, or None if it is not one the job wrote."""
    n = 32 if key is not None else 0
    mac, body = raw[:n], raw[n:]
    if key is not None and not hmac.compare_digest(mac, _mac(key, name, body)):
        return None
    try:
        d = torch.load(io.BytesIO(body), weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError):
        return None
    return Delivery(
        ticket=int(d["ticket"]),
        rank=int(d["rank"]),
        indices=tuple(d["indices"]),
        results=d["results"],
        failures=tuple((int(a), str(b), str(c)) for a, b, c in d["failures"]),
        compute_s=float(d["compute_s"]),
        file=str(d["file"]),
        declined=bool(d["declined"]),
        parts=int(d.get("parts", 0)),
        digest=str(d.get("digest", "")),
    )


# -- the keys --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Keys:
    """Key names of inference call ``call`` (see the module's table)."""

    call: int

    @property
    def base(self) -> str:
        return f"inf/{self.call}"

    @property
    def next(self) -> str:
        return f"{self.base}/next"

    @property
    def redo_n(self) -> str:
        return f"{self.base}/redo/n"

    def redo(self, k: int) -> str:
        return f"{self.base}/redo/{k}"

    def lease(self, rank: int) -> str:
        return f"{self.base}/lease/{rank}"

    def res(self, ticket: int) -> str:
        return f"{self.base}/res/{ticket}"

    @property
    def given_up(self) -> str:
        """The workers rank 0 gave up on, and why (JSON; written before ``END``)."""
        return f"{self.base}/given_up"

    @property
    def guests(self) -> str:
        """Counter of the replacements that came to help (ids ``world_size + k``)."""
        return f"{self.base}/guests"

    def guest_beat(self, worker: int) -> str:
        """Counter a helping replacement bumps every heartbeat interval."""
        return f"{self.base}/guest/{worker}/beat"

    def part(self, ticket: int, k: int) -> str:
        return f"{self.base}/res/{ticket}/{k}"


def split(body: bytes) -> list[bytes]:
    """``body`` cut into parts of at most :data:`PART_BYTES` (one part when it fits)."""
    return [body[i : i + PART_BYTES] for i in range(0, len(body), PART_BYTES)] or [b""]


def take(store: Store, keys: Keys, mac: bytes | None, ticket: int) -> Delivery | None:
    """Read ticket ``ticket``'s delivery (present: its record was seen) and delete it, its
    parts included. Round trips: a ``get`` and a ``delete_key``; for a split delivery also
    one ``check`` and, per part, one ``get`` and one ``delete_key``.

    Returns:
        The delivery, or None if it is not one the job wrote (bad seal, a part missing or
        not matching the record's digest, another ticket's).
    """
    name = keys.res(ticket)
    raw = store.get(name)
    store.delete_key(name)
    d = unpack(mac, name, raw)
    if d is None or d.ticket != ticket:
        return None
    if d.parts == 0:
        return d
    if d.parts > (1 << 20):
        return None
    names = [keys.part(ticket, k) for k in range(d.parts)]
    body = b""
    if store.check(names):
        body = b"".join(store.get(n) for n in names)
    for n in names:
        store.delete_key(n)
    if not body or not hmac.compare_digest(hashlib.sha256(body).hexdigest(), d.digest):
        return None
    whole = unpack(mac, name, body)
    if whole is None or whole.ticket != ticket or whole.parts != 0:
        return None
    return whole


def sweep_parts(store: Store, keys: Keys, ticket: int) -> int:
    """Delete the parts a rank wrote for ``ticket`` without delivering it (it died while
    writing them: they are a prefix ``0, 1, ...``). Returns how many were deleted."""
    k = 0
    while store.delete_key(keys.part(ticket, k)):
        k += 1
    return k


# -- the worker's side -----------------------------------------------------------------------
class Worker:
    """One rank's claims and deliveries (every rank, rank 0 included).

    Round trips: :meth:`first` two (``add``, ``set``); then per chunk, :meth:`deliver` two
    (``add`` for the next ticket, one ``multi_set`` with the delivery and the new lease),
    and one ``multi_set`` more per :data:`MULTI_SET_BYTES` of a delivery over that size.
    """

    def __init__(self, store: Store, keys: Keys, rank: int, mac: bytes | None) -> None:
        self.store = store
        self.keys = keys
        self.rank = rank
        self.mac = mac

    def first(self) -> int:
        """Draw this rank's first ticket and record it as its lease."""
        t = int(self.store.add(self.keys.next, 1)) - 1
        self.store.set(self.keys.lease(self.rank), str(t))
        return t

    def deliver(self, d: Delivery) -> int:
        """Draw the next ticket, then deliver ``d`` and lease that ticket in one call (a
        delivery over :data:`PART_BYTES` is split: its parts go first, its record last)."""
        t = int(self.store.add(self.keys.next, 1)) - 1
        name = self.keys.res(d.ticket)
        body = pack(self.mac, name, d)
        names: list[str] = []
        values: list[str | bytes] = []
        if len(body) > PART_BYTES:
            size = 0
            parts = split(body)
            for k, part in enumerate(parts):
                if names and size + len(part) > MULTI_SET_BYTES:
                    self.store.multi_set(names, values)
                    names, values, size = [], [], 0
                names.append(self.keys.part(d.ticket, k))
                values.append(part)
                size += len(part)
            head = Delivery(
                d.ticket,
                d.rank,
                (),
                None,
                parts=len(parts),
                digest=hashlib.sha256(body).hexdigest(),
            )
            body = pack(self.mac, name, head)
        self.store.multi_set([*names, name, self.keys.lease(self.rank)], [*values, body, str(t)])
        return t

    def redo_state(self) -> int:
        """``redo/n``: redo entries published, plus :data:`END` once the call is over."""
        return int(self.store.add(self.keys.redo_n, 0))

    def entry(self, k: int) -> Entry:
        return Entry.from_json(self.store.get(self.keys.redo(k)))


# -- rank 0's bookkeeping (pure) -------------------------------------------------------------
@dataclass
class Ledger:
    """Rank 0's record of the call: what each ticket is, what is done, what failed.

    Pure: the collector feeds it what it reads and does what it returns.
    """

    chunks: tuple[Chunk, ...]
    max_item_failures: int
    todo: set[int] = field(default_factory=set)  # items neither done nor poison
    entries: list[Entry] = field(default_factory=list)  # redo entries published, by k
    delivered: set[int] = field(default_factory=set)  # tickets
    requeued: set[int] = field(default_factory=set)  # tickets whose work went back to the pool
    skip: set[int] = field(default_factory=set)  # future tickets held by ranks given up on
    fail_ranks: dict[int, list[int]] = field(default_factory=dict)  # item -> ranks it raised on
    failures: dict[int, InferenceItemFailure] = field(default_factory=dict)  # poison items
    last_error: dict[int, tuple[str, str]] = field(default_factory=dict)
    redone: list[dict[str, Any]] = field(default_factory=list)  # what went back, and why
    compute_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.todo:
            self.todo = {i for c in self.chunks for i in c.items}

    @property
    def published(self) -> int:
        """Tickets that stand for work so far (chunks, then redo entries)."""
        return len(self.chunks) + len(self.entries)

    def entry_of(self, ticket: int) -> Entry:
        if ticket < len(self.chunks):
            c = self.chunks[ticket]
            return Entry(c.index, c.items)
        return self.entries[ticket - len(self.chunks)]

    def finished(self) -> bool:
        return not self.todo

    def publish(self, entry: Entry, live: set[int]) -> list[Entry]:
        """Queue ``entry`` as a redo entry (its items not done yet); returns the entries to
        publish in order (more than one when the ticket of the first is held by a rank
        given up on: skipped). Items no live rank may run become poison."""
        items = tuple(i for i in entry.items if i in self.todo)
        if not items:
            return []
        if live and live <= entry.exclude:
            for i in items:
                self._poison(i)
            return []
        entry = Entry(entry.chunk, items, entry.exclude, entry.why)
        out: list[Entry] = []
        while True:
            self.entries.append(entry)
            out.append(entry)
            ticket = self.published - 1
            if ticket not in self.skip:
                return out
            self.requeued.add(ticket)  # its holder was given up on: published again

    def requeue(self, ticket: int, why: str, rank: int, live: set[int]) -> list[Entry]:
        """Return ticket ``ticket``'s undone items to the pool, once: in one entry per
        live worker (consecutive slices, at most that many), so that the survivors share
        a lost chunk instead of one of them running it alone at the end."""
        if ticket in self.requeued or ticket in self.delivered:
            return []
        if ticket >= self.published:
            self.skip.add(ticket)  # a future ticket: its work, once published, goes on
            return []
        self.requeued.add(ticket)
        e = self.entry_of(ticket)
        left = [i for i in e.items if i in self.todo]
        if not left:
            return []
        self.redone.append(
            {"ticket": ticket, "chunk": e.chunk, "rank": rank, "why": why, "items": len(left)}
        )
        pieces = max(1, min(len(live - {rank}) or 1, len(left)))
        size = -(-len(left) // pieces)
        out: list[Entry] = []
        for k in range(0, len(left), size):
            out += self.publish(Entry(e.chunk, tuple(left[k : k + size]), e.exclude, why), live)
        return out

    def accept(self, d: Delivery, live: set[int]) -> tuple[list[int], list[Entry]]:
        """Take delivery ``d``: returns the indices newly done (results to keep; a late
        duplicate's are dropped) and the redo entries to publish."""
        if d.ticket in self.delivered:
            return [], []
        self.delivered.add(d.ticket)
        if d.declined:
            e = self.entry_of(d.ticket)
            return [], self.publish(e, live)
        self.compute_s += d.compute_s
        fresh = [i for i in d.indices if i in self.todo]
        self.todo.difference_update(fresh)
        redo: list[Entry] = []
        chunk = self.entry_of(d.ticket).chunk if d.ticket < self.published else -1
        for index, exc_type, message in d.failures:
            if index not in self.todo:
                continue
            ranks = self.fail_ranks.setdefault(index, [])
            if d.rank not in ranks:
                ranks.append(d.rank)
            self.last_error[index] = (exc_type, message)
            if len(ranks) >= self.max_item_failures:
                self._poison(index)
                continue
            why = f"item {index} raised {exc_type} on rank {d.rank}"
            queued = self.publish(Entry(chunk, (index,), frozenset(ranks), why), live)
            if queued:
                self.redone.append(
                    {"ticket": d.ticket, "chunk": chunk, "rank": d.rank, "why": why, "items": 1}
                )
            redo += queued
        return fresh, redo

    def _poison(self, index: int) -> None:
        exc_type, message = self.last_error.get(index, ("", "no live rank may run it"))
        self.failures[index] = InferenceItemFailure(
            index, exc_type, message, tuple(self.fail_ranks.get(index, ()))
        )
        self.todo.discard(index)

    def orphans(self, leases: dict[int, int], live: set[int]) -> list[int]:
        """Tickets whose work no live rank will deliver: every live rank holds a ticket
        past the published work (it waits), yet items are left. Read the leases before
        the deliveries, or a delivery made meanwhile reads as an orphan (redone twice,
        harmless but counted)."""
        if self.finished() or not live:
            return []
        if any(r not in leases or leases[r] < self.published for r in live):
            return []
        return [
            t
            for t in range(self.published)
            if t not in self.delivered
            and t not in self.requeued
            and any(i in self.todo for i in self.entry_of(t).items)
        ]


# -- files -----------------------------------------------------------------------------------
def write_file(folder: str, name: str, indices: Sequence[int], results: list[Any]) -> None:
    """Write one chunk file atomically: a ``torch.save`` of ``{"indices", "results"}``."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    torch.save({"indices": list(indices), "results": results}, tmp)
    os.replace(tmp, os.path.join(folder, name))


def read_file(folder: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(os.path.join(folder, name), weights_only=False)
    return out


def fingerprint(num_items: int, costs: Sequence[float] | None, chunk_size: int) -> str:
    """What a resumed call must match: the item count, the costs, the chunk size."""
    h = hashlib.sha256(f"{num_items}:{chunk_size}:".encode())
    if costs is not None:
        h.update(json.dumps([float(c) for c in costs]).encode())
    return h.hexdigest()[:32]


def manifest(num_items: int, chunks: Sequence[Chunk], chunk_size: int, fp: str) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "num_items": num_items,
        "chunk_size": chunk_size,
        "fingerprint": fp,
        "chunks": [list(c.items) for c in chunks],
        "costs": [c.cost for c in chunks],
    }


def write_manifest(folder: str, m: dict[str, Any]) -> None:
    tmp = os.path.join(folder, f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(m, f)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        out: dict[str, Any] = json.load(f)
    return out


def chunks_of(m: dict[str, Any]) -> tuple[Chunk, ...]:
    return tuple(
        Chunk(k, tuple(items), float(cost))
        for k, (items, cost) in enumerate(zip(m["chunks"], m["costs"], strict=True))
    )


def done_on_disk(folder: str, chunks: Sequence[Chunk]) -> dict[int, str]:
    """Items already written (index -> file name), read from the files' indices."""
    out: dict[int, str] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("chunk-") and name.endswith(".pt"):
            try:
                data = read_file(folder, name)
            except ResilientDDPError:
                raise  # the peers' verdict on this rank (Runtime.tell_main), not the file's fault
            except Exception:  # noqa: BLE001 - a torn or foreign file: its items are redone
                continue
            for i in data.get("indices", []):
                out.setdefault(int(i), name)
    return out


def iter_results(folder: str) -> Iterator[tuple[int, Any]]:
    """``(index, result)`` for every item written under ``folder``, in dataset order,
    holding only the files whose items are not all yielded yet."""
    m = read_manifest(folder)
    if m is None:
        raise FileNotFoundError(f"no {MANIFEST} in {folder!r}: not an inference output folder")
    where: dict[int, str] = {}
    counts: dict[str, int] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("chunk-") and name.endswith(".pt"):
            data = read_file(folder, name)
            for i in data["indices"]:
                if int(i) not in where:
                    where[int(i)] = name
                    counts[name] = counts.get(name, 0) + 1
    cache: dict[str, dict[int, Any]] = {}
    for i in range(int(m["num_items"])):
        if i not in where:
            continue
        name = where[i]
        if name not in cache:
            data = read_file(folder, name)
            cache[name] = dict(zip((int(x) for x in data["indices"]), data["results"], strict=True))
        yield i, cache[name][i]
        counts[name] -= 1
        if counts[name] == 0:
            del cache[name]
