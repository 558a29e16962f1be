"""Distributed inference that finishes: work pulled in chunks, a failed rank's share redone.

:func:`distributed_inference` and :func:`iter_inference` group the dataset's items into
chunks (by cost when costs are given, heaviest first; by count otherwise). Every rank pulls
chunks from the control plane as it finishes the last one (one ``add`` and one
``multi_set`` on the store per chunk, see :mod:`resilient_ddp.inference._work_pool`), runs ``fn`` on
each chunk in batches, and delivers the chunk's results; rank 0 collects them in dataset
order. A rank that dies, hangs (no progress for the stuck window while holding a chunk),
is stopped, or raises gives its chunks back to the pool, once, and the others redo them;
an item whose ``fn`` raised on ``max_item_failures`` ranks is a poison item, reported and
never retried again. With ``output_dir`` each chunk is a file of its own, and a job
restarted on the folder (any world size) skips the chunks already written.

``on_rank_failure="raise"`` keeps the behaviour from before: balanced shares planned with
:class:`BalancedDistributedSampler`, one final gather with :func:`gather_to_rank0`, and
any failure raised on every rank.

A :class:`ResilientDDP` model may be called inside ``fn``: while the loop runs, its
forward calls the wrapped module directly, without DDP's per-forward buffer broadcast, which
would otherwise pair up calls of ranks that run different numbers of batches (a hang, or
buffers silently mixed between ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from resilient_ddp.base import _timings
from resilient_ddp.config import Duration
from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _events
from resilient_ddp.control._events import rank_log
from resilient_ddp.detection import _store_diagnosis
from resilient_ddp.detection._progress import progress as _mark_progress
from resilient_ddp.errors import (
    ConfigError,
    Culprit,
    ItemFailureError,
    RankFailureError,
    ResilientDDPError,
    error_head,
)
from resilient_ddp.group.process_group import ensure_runtime
from resilient_ddp.inference import _guest
from resilient_ddp.inference import _work_pool as wp
from resilient_ddp.inference.gather import gather_to_rank0
from resilient_ddp.inference.sampler import BalancedDistributedSampler
from resilient_ddp.ops._wire import to_cpu
from resilient_ddp.ops.collectives import Op
from resilient_ddp.runtime._runtime import Runtime, in_own_wait

__all__ = [
    "InferenceItemFailure",
    "InferenceSummary",
    "distributed_inference",
    "iter_inference",
    "last_inference_summary",
    "load_inference_results",
]

log = logging.getLogger("resilient_ddp")

ProgressArg = bool | Callable[[int, int], None]
OnRankFailure = Literal["redo", "raise"]
_REFRESH_S = 0.5
_ITEM_WARNINGS = 5  # fn failures a rank logs; further ones are counted only
InferenceItemFailure = wp.InferenceItemFailure


@dataclass(frozen=True)
class InferenceSummary:
    """What one inference call did, as rank 0 saw it (see :func:`last_inference_summary`).

    Attributes:
        items: Items in the dataset.
        items_done: Items with a result (this call's and, when resumed, earlier ones').
        resumed_items: Items found already written in ``output_dir`` (not run again).
        chunks: Chunks run in this call (chunks found written are not counted).
        chunks_redone: Redo entries run because a rank failed or an item raised.
        redone: One dict per piece of work given back: ``ticket``, ``chunk``, ``rank``,
            ``why`` (``"rank 2 died"``, ``"rank 1 hung ..."``, ``"item 7 raised ..."``),
            ``items``.
        failed_ranks: Rank -> why rank 0 gave up on it.
        poison: The items whose ``fn`` raised on ``max_item_failures`` ranks (or that no
            rank was left to run), with index, exception type, message and ranks.
        wall_s: Seconds from the start of the call to its end, on rank 0.
        ideal_s: The sum of the chunks' compute times over the number of ranks (seconds).
        world_size: Ranks at the start.
        per_rank_items: Rank -> items it delivered first (its share of the results).
    """

    items: int
    items_done: int
    resumed_items: int
    chunks: int
    chunks_redone: int
    redone: tuple[dict[str, Any], ...]
    failed_ranks: dict[int, str]
    poison: tuple[wp.InferenceItemFailure, ...]
    wall_s: float
    ideal_s: float
    world_size: int
    per_rank_items: dict[int, int] = field(default_factory=dict)
    text: str = field(default="", repr=False)

    def __str__(self) -> str:
        return self.text


_last_summary: InferenceSummary | None = None


def last_inference_summary() -> InferenceSummary | None:
    """The summary of this process's last inference call on rank 0 (``None`` elsewhere,
    before any call, and for ``on_rank_failure="raise"`` calls)."""
    return _last_summary


def load_inference_results(output_dir: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, result)`` for every item written under ``output_dir``, in dataset
    order, reading the chunk files lazily (a file is held until its items are yielded;
    with costs, a chunk's items are spread over the dataset, so more files can be held).

    Needs no process group. Items not written (the job stopped, or poison items) are
    absent. The files can also be read without the library: each ``chunk-*.pt`` is one
    ``torch.save`` of ``{"indices": [...], "results": [...]}``; ``manifest.json`` holds the
    plan.

    Raises:
        FileNotFoundError: ``output_dir`` holds no ``manifest.json``.
    """
    return wp.iter_results(os.fspath(output_dir))


def distributed_inference(
    fn: Callable[[Any], Any],
    dataset: Dataset[Any],
    *,
    batch_size: int,
    costs: Sequence[float] | torch.Tensor | None = None,
    cost_fn: Callable[[int], float] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    progress: ProgressArg = True,
    timeout: Duration = None,
    chunk_size: int | None = None,
    on_rank_failure: OnRankFailure = "redo",
    max_item_failures: int = 2,
    output_dir: str | os.PathLike[str] | None = None,
) -> list[Any] | None:
    """Run ``fn`` over ``dataset`` on every rank and return all results on rank 0, in order.

    Collective over the default group: every rank calls it with the same dataset and
    arguments. Items are grouped into chunks; each rank pulls the next chunk from the
    control plane when it finishes one and runs it in batches of at most ``batch_size``
    under ``torch.no_grad()``; no collective runs at all. Rank 0 collects the results.

    A rank that dies, is stopped, hangs (holds a chunk while its progress signals do not
    move for the stuck window) or raises outside ``fn`` gives its unfinished chunk back,
    once, and the others redo it: the call returns on rank 0 with every item's result
    exactly once (a late delivery of a resumed rank is dropped), and warns. When ``fn``
    raises, its batch is rerun item by item on that rank: the other items' results are kept,
    the failing item goes back to the pool for another rank; one that raised on
    ``max_item_failures`` ranks is a poison item, never run again.

    A replacement for a failed rank started while the call runs (``rd.spawn(restarts=N)``,
    an elastic launcher; it needs the job's secret, as any joiner) helps with it: its
    ``init_process_group()`` returns without a group, and its own call of this function
    pulls chunks as the ranks do and returns ``None``.

    Args:
        fn: Called with one collated batch; returns one result per item of the batch: a
            tensor whose first dimension is the batch size (one row per item), a list of
            per-item results, or a dict or tuple of those (split into one dict or tuple per
            item).
        dataset: A map-style dataset (``len`` and ``dataset[i]``), the same on every rank.
        batch_size: Most items per call of ``fn``.
        costs: Predicted cost of each item (e.g. its length): chunks are cut by cost,
            heaviest first, so that the pulled schedule ends balanced.
        cost_fn: ``cost_fn(index)`` instead of ``costs``.
        collate_fn: As DataLoader's (default: ``default_collate``).
        num_workers: DataLoader worker processes per rank (kept from chunk to chunk).
        progress: ``True`` shows a progress bar of all ranks' items on rank 0 (stderr),
            with throughput (items/s over all ranks) and ETA; a callable is called on rank
            0 with ``(items_done, items_total)`` about twice a second instead, from a
            background thread, and once more with ``(total, total)`` from the calling
            thread at the end; ``False`` shows nothing.
        timeout: With ``on_rank_failure="raise"``: how long a rank may go without finishing
            a batch while the others wait for it, and the final gather's per-piece timeout
            (timedelta or seconds; default ``config.op_timeout``). Not used otherwise: a
            hung rank is told by its progress signals (``config.stuck_window``).
        chunk_size: Items per chunk (default: about 8 chunks per rank, a whole number of
            batches, the last ones smaller: none holds more than the items left over twice
            the ranks, so that ranks finish together when costs are unknown). With
            ``output_dir`` a resumed call keeps the plan written there.
        on_rank_failure: ``"redo"`` (default): the survivors redo a failed rank's chunks.
            ``"raise"``: the behaviour before: shares planned up front, one final gather,
            every rank raises :class:`RankFailureError` naming the failed rank
            (``output_dir`` and ``chunk_size`` do not apply).
        max_item_failures: Ranks an item may raise on before it is a poison item (>= 1).
        output_dir: A folder (created if needed) where each finished chunk is written by
            the rank that ran it, as ``chunk-NNNNNN.pt`` (one ``torch.save`` of
            ``{"indices": [...], "results": [...]}``, renamed into place), with a
            ``manifest.json`` (items, chunk plan, format version, fingerprint). A call on
            a folder that holds a manifest resumes: chunks already written are not run
            again, whatever the world size. Every rank must see the folder.

    Returns:
        On rank 0, a list with one result per dataset item, ``result[i]`` for
        ``dataset[i]``; tensors on the CPU. ``None`` on the other ranks. Rank 0's
        :func:`last_inference_summary` tells what was redone and why.

    Raises:
        ConfigError: Invalid arguments, ``fn`` returned something that does not split
            into one result per item, or ``output_dir`` holds another job's plan
            (another item count, costs or chunk size).
        ItemFailureError: On rank 0, items whose ``fn`` raised on ``max_item_failures``
            ranks; its ``results`` holds every other result (``None`` for those items).
        RankFailureError: Rank 0 (the collector) failed: raised on the others, naming it
            (with ``output_dir``, a restart resumes); or, with ``on_rank_failure="raise"``,
            any rank failed.
        CollectiveMismatchError: With ``on_rank_failure="raise"``: ranks returned results
            of different kinds or dtypes.
    """
    if on_rank_failure == "raise":
        if output_dir is not None:
            raise ConfigError('output_dir needs on_rank_failure="redo"')
        return _static_inference(
            fn,
            dataset,
            batch_size=batch_size,
            costs=costs,
            cost_fn=cost_fn,
            collate_fn=collate_fn,
            num_workers=num_workers,
            progress=progress,
            timeout=timeout,
        )
    engine = _Pool(
        fn,
        dataset,
        batch_size=batch_size,
        costs=costs,
        cost_fn=cost_fn,
        collate_fn=collate_fn,
        num_workers=num_workers,
        progress=progress,
        chunk_size=chunk_size,
        on_rank_failure=on_rank_failure,
        max_item_failures=max_item_failures,
        output_dir=output_dir,
    )
    out: list[Any] = [None] * engine.total
    for i, r in engine.run():
        out[i] = r
    if engine.rank != 0:
        return None
    engine.raise_poison(out)
    return out


def iter_inference(
    fn: Callable[[Any], Any],
    dataset: Dataset[Any],
    *,
    batch_size: int,
    costs: Sequence[float] | torch.Tensor | None = None,
    cost_fn: Callable[[int], float] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    progress: ProgressArg = True,
    chunk_size: int | None = None,
    max_item_failures: int = 2,
    output_dir: str | os.PathLike[str] | None = None,
) -> Iterator[tuple[int, Any]]:
    """:func:`distributed_inference` as a stream: an iterator on every rank that runs the
    work as it is consumed; on rank 0 it yields ``(index, result)`` in dataset order while
    the work runs, holding only results not yet yielded (a few chunks when the chunks are
    consecutive, i.e. without costs); on the other ranks it yields nothing. Every rank must
    exhaust it. With ``output_dir``, rank 0 yields once the work is done, reading the
    chunk files lazily (see :func:`load_inference_results`).

    Same arguments as :func:`distributed_inference` (failures are always redone).

    Raises:
        As :func:`distributed_inference`; :class:`ItemFailureError` (rank 0, after the last
        item) has ``results=None``: the results were yielded.
    """
    engine = _Pool(
        fn,
        dataset,
        batch_size=batch_size,
        costs=costs,
        cost_fn=cost_fn,
        collate_fn=collate_fn,
        num_workers=num_workers,
        progress=progress,
        chunk_size=chunk_size,
        on_rank_failure="redo",
        max_item_failures=max_item_failures,
        output_dir=output_dir,
    )

    def stream() -> Iterator[tuple[int, Any]]:
        yield from engine.run()
        if engine.rank == 0:
            engine.raise_poison(None)

    return stream()


class _Guarded:
    """A store whose failed calls raise :class:`ControlPlaneError` (the store is gone)."""

    def __init__(self, store: dist.Store) -> None:
        self.s = store

    def add(self, key: str, value: int) -> int:
        return int(ctl.ControlPlane._call(self.s.add, key, value))

    def set(self, key: str, value: str | bytes) -> None:
        ctl.ControlPlane._call(self.s.set, key, value)

    def get(self, key: str) -> bytes:
        out: bytes = ctl.ControlPlane._call(self.s.get, key)
        return out

    def check(self, keys: list[str]) -> bool:
        return bool(ctl.ControlPlane._call(self.s.check, keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ctl.ControlPlane._call(getattr(self.s, "multi_set"), keys, values)  # noqa: B009 - not in the stubs

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = ctl.ControlPlane._call(self.s.multi_get, keys)
        return out

    def delete_key(self, key: str) -> bool:
        return bool(ctl.ControlPlane._call(self.s.delete_key, key))


class _Pool:
    """One call of the pulled engine, on one rank."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        dataset: Dataset[Any],
        *,
        batch_size: int,
        costs: Sequence[float] | torch.Tensor | None,
        cost_fn: Callable[[int], float] | None,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_workers: int,
        progress: ProgressArg,
        chunk_size: int | None,
        on_rank_failure: str,
        max_item_failures: int,
        output_dir: str | os.PathLike[str] | None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size should be >= 1, got {batch_size}")
        if not isinstance(dataset, Sized):
            raise ConfigError(
                f"distributed_inference needs a map-style dataset with len(), got "
                f"{type(dataset).__name__}"
            )
        if on_rank_failure not in ("redo", "raise"):
            raise ConfigError(
                f"on_rank_failure should be 'redo' or 'raise', got {on_rank_failure!r}"
            )
        if isinstance(max_item_failures, bool) or max_item_failures < 1:
            raise ConfigError(f"max_item_failures should be >= 1, got {max_item_failures}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size < 1):
            raise ConfigError(f"chunk_size should be >= 1, got {chunk_size}")
        if costs is not None and cost_fn is not None:
            raise ConfigError("give costs or cost_fn, not both")
        self.fn = fn
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate_fn if collate_fn is not None else default_collate
        self.num_workers = num_workers
        self.progress = progress
        self.chunk_size = chunk_size
        self.max_item_failures = max_item_failures
        self.output_dir = os.fspath(output_dir) if output_dir is not None else None
        self.total = len(dataset)
        self.costs: list[float] | None = None
        if costs is not None:
            values = costs.tolist() if isinstance(costs, torch.Tensor) else list(costs)
            self.costs = [float(c) for c in values]
        elif cost_fn is not None:
            self.costs = [float(cost_fn(i)) for i in range(self.total)]
        if self.costs is not None and len(self.costs) != self.total:
            raise ConfigError(f"costs has {len(self.costs)} values for {self.total} items")
        self.guest = _guest.current()
        self.rt = ensure_runtime() if self.guest is None else _guest_runtime(self.guest)
        self.rank = self.rt.rank
        self.world = self.rt.world_size
        self.done = 0
        self.batches = 0
        self.item_failures = 0
        self.in_chunk = False  # the main thread runs a chunk (read by rank 0's collector)
        self._chunk_batches = _ChunkBatches()
        self._dl: DataLoader[Any] | None = None
        self.poison: tuple[wp.InferenceItemFailure, ...] = ()

    # -- the plan ----------------------------------------------------------------------------
    def _plan(self) -> tuple[wp.Chunk, ...]:
        size = self.chunk_size or wp.default_chunk_size(self.total, self.world, self.batch_size)
        try:
            if self.output_dir is None:
                return wp.plan(self.total, self.chunk_size, self.world, self.batch_size, self.costs)
            fp = wp.fingerprint(self.total, self.costs, self.chunk_size or 0)
            m = wp.read_manifest(self.output_dir)
            if m is not None:
                if m.get("format") != wp.FORMAT_VERSION or m.get("fingerprint") != fp:
                    raise ConfigError(
                        f"output_dir {self.output_dir!r} holds the results of another job "
                        f"({m.get('num_items')} items, chunk_size {m.get('chunk_size')}, "
                        "other costs or format): use another folder, or the same arguments"
                    )
                return wp.chunks_of(m)
            chunks = wp.plan(self.total, self.chunk_size, self.world, self.batch_size, self.costs)
            if self.rank == 0:
                os.makedirs(self.output_dir, exist_ok=True)
                wp.write_manifest(self.output_dir, wp.manifest(self.total, chunks, size, fp))
            return chunks
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(str(e)) from e

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[int, Any]]:  # noqa: PLR0912, PLR0915 - one loop
        rt = self.rt
        if self.guest is not None and self.guest.served:
            return  # a later call of the members': they run it without this process
        rt.begin_inference_call()  # every rank counts its calls alike
        self.call = call = rt.inference_calls
        keys = wp.Keys(call)
        store = _Guarded(rt.control.store)
        self.start = time.monotonic()
        chunks = self._plan()
        self._plan_id = f"{self.total} items, {len(chunks)} chunks, " + wp.fingerprint(
            self.total, self.costs, self.chunk_size or 0
        )
        self.by_index = {c.index: c for c in chunks}
        plan_key = f"{keys.base}/plan"
        step, phase = rt.step, rt.phase
        rt.phase = "inference"
        collector: _Collector | None = None
        self.beat: _GuestBeat | None = None
        jobs = ctl.JobStore(rt.control_root) if self.rank == 0 else None
        try:
            if self.rank == 0:
                written = set()
                if self.output_dir is not None:
                    written = {
                        c.index
                        for c in chunks
                        if os.path.exists(os.path.join(self.output_dir, f"chunk-{c.index:06d}.pt"))
                    }
                remaining = [c.index for c in chunks if c.index not in written]
                store.set(plan_key, json.dumps({"remaining": remaining, "plan": self._plan_id}))
                with contextlib.suppress(Exception):
                    rt.control.note_keys([plan_key, keys.next, keys.redo_n])
                assert jobs is not None
                self._announce(jobs, call, closed=False)  # replacements may help
            else:
                backoff = ctl.Backoff(self.world, 1)
                while not store.check([plan_key]):
                    self._check_abort()
                    backoff.sleep()
                published = json.loads(store.get(plan_key))
                if published.get("plan") != self._plan_id:
                    raise ConfigError(
                        f"distributed_inference on rank {rt.rank}: rank 0 planned another "
                        f"call ({published.get('plan')}, here {self._plan_id}): every rank "
                        "must call it with the same dataset length, costs and chunk_size"
                    )
                remaining = published["remaining"]
            todo = tuple(self.by_index[k] for k in remaining)
            self.resumed = self.total - sum(len(c.items) for c in todo)
            worker = wp.Worker(store, keys, self.rank, rt.control.key)
            if self.guest is not None:
                self.beat = _GuestBeat(self, keys)
                self.beat.start()
            if self.rank == 0:
                ledger = wp.Ledger(todo, self.max_item_failures)
                collector = _Collector(self, keys, ledger)
                collector.start()
            rt.set_inference_progress(call, 0)
            with _local_forward(rt), torch.no_grad():
                t = worker.first()
                while True:
                    entry: wp.Entry | None = None
                    if t < len(todo):
                        entry = wp.Entry(todo[t].index, todo[t].items)
                    else:
                        backoff = ctl.Backoff(self.world, 1)
                        rt.phase = "inference: waiting for work"
                        while True:
                            if self._check_abort(collector, worker):
                                break
                            if collector is not None:
                                yield from collector.ready()
                            n = worker.redo_state()
                            if n >= wp.END:
                                break
                            if t - len(todo) < n:
                                entry = worker.entry(t - len(todo))
                                break
                            backoff.sleep()
                        rt.phase = "inference"
                        if entry is None:
                            break
                    delivery = self._run_entry(t, entry)
                    if self._check_abort(collector, worker):
                        break
                    t = worker.deliver(delivery)
                    if collector is not None:
                        yield from collector.ready()
            if collector is None:
                self._raise_if_given_up(store, keys)
            if collector is not None:
                while not collector.finished.wait(0.02):
                    self._check_abort(collector)
                    yield from collector.ready()
                self._check_abort(collector)
                yield from collector.ready()
                if self.output_dir is not None:
                    yield from wp.iter_results(self.output_dir)
                collector.end_progress()
                self.poison = tuple(
                    sorted(collector.ledger.failures.values(), key=lambda f: f.index)
                )
                collector.summarise()
        except GeneratorExit:
            # Rank 0's caller stopped reading (a break out of iter_inference): end the
            # call for everyone, or the others would wait for more work for good.
            if collector is not None:
                collector.stop.set()
                with contextlib.suppress(ResilientDDPError):
                    store.add(keys.redo_n, wp.END)
            raise
        finally:
            if jobs is not None:
                self._announce(jobs, call, closed=True)
            if self.beat is not None:
                self.beat.stop.set()
                self.beat.join(timeout=_timings.inference_thread_join_wait(rt.config))
            if self.guest is not None:
                self.guest.served = True
            if collector is not None:
                collector.stop.set()
                collector.join(timeout=_timings.inference_thread_join_wait(rt.config))
            rt.end_inference_progress()
            self._dl = None  # its workers end with it
        # Left as they were on an error: the failure report says where this rank was.
        rt.step, rt.phase = step, phase

    def _announce(self, jobs: ctl.JobStore, call: int, *, closed: bool) -> None:
        """Rank 0: say in the job's ``inf/open`` record that call ``call`` runs (or, with
        ``closed``, has ended), for a replacement that asks to join meanwhile (see
        ``elastic._inference_to_help``). Best effort: one ``set``."""
        rt = self.rt
        record: dict[str, Any] = {"gen": rt.generation, "call": call, "world": self.world}
        if closed:
            record["closed"] = True
        # Elastic training (an evaluation inside it): a replacement waits for its admission
        # at a step boundary instead. A joiner reads this, not join/n, which its own
        # request creates.
        record["elastic"] = rt.elastic is not None
        with contextlib.suppress(ResilientDDPError):
            jobs.open_inference(record)

    def _raise_if_given_up(self, store: _Guarded, keys: wp.Keys) -> None:
        """Raise on a worker that rank 0 gave up on (stopped, hung, silent) and that got to
        the end of the call anyway (it was resumed late): its work was redone by others
        and what it delivered since was dropped. Told by its watchdog, it usually raises
        sooner; this makes it certain. One ``check`` (and a ``get`` when someone was given
        up on)."""
        try:
            if not store.check([keys.given_up]):
                return
            gone = json.loads(store.get(keys.given_up))
        except (ResilientDDPError, ValueError):
            return
        why = gone.get(str(self.rank)) if isinstance(gone, dict) else None
        if not isinstance(why, str):
            return
        raise RankFailureError(
            f"{_worker_name(self.rank, self.world)}: rank 0 gave this process's "
            f"distributed_inference work to the others because it {why}; what it delivered "
            "after that was dropped. Raised here, in the main thread.",
            culprits=[Culprit.of(self.rank, what=why)],
            op="distributed_inference",
            generation=self.rt.generation,
        )

    def raise_poison(self, results: list[Any] | None) -> None:
        if not self.poison:
            return
        lines = "\n".join(
            f"  item {f.index}: {f.exc_type}: {f.message} (ranks {list(f.ranks)})"
            for f in self.poison[:20]
        )
        more = f"\n  ... and {len(self.poison) - 20} more" if len(self.poison) > 20 else ""  # noqa: PLR2004
        raise ItemFailureError(
            f"distributed_inference: {len(self.poison)} item(s) could not be run (fn raised "
            f"on {self.max_item_failures} rank(s), or no rank was left to run them); every "
            f"other result is kept in .results:\n{lines}{more}",
            failures=self.poison,
            results=results,
        )

    def _check_abort(
        self, collector: _Collector | None = None, worker: wp.Worker | None = None
    ) -> bool:
        """Raise if the call cannot finish here: rank 0 (the collector) failed, the store
        is gone, or this rank's collector thread failed. Returns True when the call is
        over (rank 0 ended it and left: nothing failed)."""
        rt = self.rt
        if collector is not None and collector.error is not None:
            raise collector.error
        if self.beat is not None and self.beat.lost:
            if _call_ended(worker):
                return True
            what = self.beat.lost
            raise RankFailureError(
                f"distributed_inference on replacement worker {self.rank} cannot finish: "
                f"rank 0 collects the results and {what}",
                culprits=[Culprit.of(0, what=what)],
                op="distributed_inference",
                generation=rt.generation,
            )
        if rt.control_plane_error is not None:
            raise rt.build_error("distributed_inference", rt.op_seq)
        if self.rank != 0:
            with rt.lock:
                failed = [ev for ev in rt.failures if 0 in ev.ranks]
                left = 0 in rt.left
            if failed or left:
                # Rank 0 ends the call before it leaves: its departure (or a failure after
                # the end) is no failure of this call.
                if _call_ended(worker):
                    return True
                raise rt.build_error(
                    "distributed_inference",
                    rt.op_seq,
                    head=f"{error_head('distributed_inference', rt.rank)} cannot finish: rank 0 "
                    "collects the results and failed (with output_dir, a restart resumes)",
                )
        return False

    def _load(self, items: Sequence[int]) -> Any:
        return self.collate([self.dataset[i] for i in items])

    def _groups(self, items: tuple[int, ...]) -> list[list[int]]:
        return [list(items[i : i + self.batch_size]) for i in range(0, len(items), self.batch_size)]

    def _loader(self, groups: list[list[int]]) -> Iterator[Any] | None:
        """Batches from worker processes (``num_workers``), or None: loaded in this one.

        One DataLoader per call, its workers kept between chunks (``persistent_workers``):
        each chunk only sets the batches its sampler yields next."""
        if self.num_workers == 0:
            return None
        if self._dl is None:
            self._dl = DataLoader(
                self.dataset,
                batch_sampler=self._chunk_batches,
                collate_fn=self.collate,
                num_workers=self.num_workers,
                persistent_workers=True,
            )
        self._chunk_batches.groups = groups
        return iter(self._dl)

    def _call(self, batch: Any, n: int) -> list[Any]:
        return _split(to_cpu(self.fn(batch)), n)

    def _isolate(
        self,
        group: list[int],
        indices: list[int],
        results: list[Any],
        failures: list[tuple[int, str, str]],
    ) -> None:
        """Run ``group`` item by item (its batch raised): keep what succeeds, note what
        raises (such an item goes back to the pool for another rank)."""
        for i in group:
            try:
                one = self._call(self._load([i]), 1)
            except Exception as e:
                if isinstance(e, ResilientDDPError):
                    raise
                failures.append((i, type(e).__name__, str(e)[:1000]))
                self.item_failures += 1
                if self.item_failures > _ITEM_WARNINGS:
                    continue
                rank_log.of(self.rt).warning(
                    "distributed_inference: item %d raised (%s: %s); "
                    "the item goes to another rank%s",
                    i,
                    type(e).__name__,
                    e,
                    " (further failures on this rank are not logged)"
                    if self.item_failures == _ITEM_WARNINGS
                    else "",
                )
            else:
                indices.append(i)
                results.extend(one)

    def _run_entry(self, ticket: int, entry: wp.Entry) -> wp.Delivery:
        if self.rank in entry.exclude:
            return wp.Delivery(ticket, self.rank, (), None, declined=True)
        self.in_chunk = True
        try:
            return self._run_chunk(ticket, entry)
        finally:
            self.in_chunk = False

    def _run_chunk(self, ticket: int, entry: wp.Entry) -> wp.Delivery:
        rt = self.rt
        t0 = time.monotonic()
        indices: list[int] = []
        results: list[Any] = []
        failures: list[tuple[int, str, str]] = []
        groups = self._groups(entry.items)
        loader = self._loader(groups)
        for group in groups:
            rt.step = self.batches
            self.batches += 1
            try:
                # Loading is inside: a sample that cannot be read is an item that raised.
                if loader is not None:
                    try:
                        with _LoaderProgress():
                            batch = next(loader)
                    except BaseException:
                        loader = None  # the rest of the chunk is loaded here
                        raise
                else:
                    batch = self._load(group)
                out = self._call(batch, len(group))
            except Exception as e:
                if isinstance(e, ResilientDDPError):
                    raise
                # Isolate the failing item(s): the batch again, item by item.
                self._isolate(group, indices, results, failures)
            else:
                indices.extend(group)
                results.extend(out)
            self.done += len(group)
            rt.set_inference_progress(self.call, self.done)
            _mark_progress()
        compute = time.monotonic() - t0
        name = ""
        if self.output_dir is not None and indices:
            # The chunk's own name only when it holds every item of the chunk: a resumed
            # call skips the chunks that have one, and reruns the others whole.
            full = entry.items == self.by_index[entry.chunk].items and not failures
            name = (
                f"chunk-{entry.chunk:06d}.pt" if full else f"chunk-{entry.chunk:06d}.r{ticket}.pt"
            )
            wp.write_file(self.output_dir, name, indices, results)
        return wp.Delivery(
            ticket,
            self.rank,
            tuple(indices),
            None if name else results,
            tuple(failures),
            compute,
            name,
        )


def _guest_runtime(guest: _guest.Guest) -> Runtime:
    """A runtime for a guest's call (never the process's current one: no group, no
    watchdog), under the next free worker number ``world_size + k`` of that call."""
    store = ctl.ControlPlane(guest.root, guest.generation).store
    k = int(store.add(wp.Keys(guest.call).guests, 1)) - 1
    return Runtime.of_guest(
        worker=guest.world_size + k,
        world_size=guest.world_size,
        backend=guest.backend,
        control_root=guest.root,
        config=guest.config,
        generation=guest.generation,
        inference_calls=guest.call - 1,  # run() counts this one
    )


class _GuestBeat(threading.Thread):
    """A guest's heartbeat for rank 0's collector (a counter bumped every
    ``heartbeat_interval``), and its watch on rank 0: ``lost`` says why the call cannot
    finish (rank 0's heartbeat stopped for ``heartbeat_timeout``, or the store is gone)."""

    def __init__(self, pool: _Pool, keys: wp.Keys) -> None:
        super().__init__(name="resilient_ddp-inference-guest", daemon=True)
        self.rt, self.worker, self.keys = pool.rt, pool.rank, keys
        self.stop = threading.Event()
        self.lost = ""

    def run(self) -> None:
        rt = self.rt
        control = rt.connection("guest")
        store = _Guarded(control.store)
        every = rt.config.heartbeat_interval.total_seconds()
        timeout = rt.config.heartbeat_timeout.total_seconds()
        try:
            while True:
                store.add(self.keys.guest_beat(self.worker), 1)
                state = control.read_states([0]).get(0)
                if state is not None:
                    rt.note_beat(0, state)
                if rt.beat_age(0) >= timeout:
                    self.lost = f"sent no heartbeat for {rt.beat_age(0):.1f} s"
                    return
                if self.stop.wait(every):
                    return
        except ResilientDDPError as e:
            self.lost = f"cannot be reached: the store stopped answering ({e})"


class _LoaderProgress:
    """While the main thread waits for a batch from DataLoader workers, count their CPU
    time as this rank's progress (``rd.progress()``): a rank whose workers decode a slow
    batch is busy, not hung (its own thread sits in a queue read). Workers that use no CPU
    (deadlocked) add nothing: the rank is still judged hung."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="resilient_ddp-loader-progress", daemon=True
        )

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = _children_cpu()
        while not self._stop.wait(0.2):
            now = _children_cpu()
            if now > last:
                _mark_progress()
            last = now


def _children_cpu() -> int:
    """CPU ticks (user + system) of this process's live multiprocessing children."""
    import multiprocessing

    total = 0
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total


class _ChunkBatches:
    """The batch sampler of a call's DataLoader: the batches of the current chunk."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.groups))

    def __len__(self) -> int:
        return len(self.groups)


def _call_ended(worker: wp.Worker | None) -> bool:
    """Whether rank 0 has ended the call (``END`` published): a failure of rank 0 seen
    after that is no failure of this call. False when the store cannot tell."""
    if worker is None:
        return False
    with contextlib.suppress(ResilientDDPError):
        return worker.redo_state() >= wp.END
    return False


def _worker_name(worker: int, world_size: int) -> str:
    """``rank 2``, or ``replacement worker 4`` for a helping replacement (see _guest)."""
    return f"rank {worker}" if worker < world_size else f"replacement worker {worker}"


_WHY = {
    ctl.EV_CRASH: "died",
    ctl.EV_UNRESPONSIVE: "stopped responding",
    ctl.EV_EXCEPTION: "raised",
    ctl.EV_TIMEOUT: "was named stuck",
    ctl.EV_SECTION: "overran a section",
}


class _Collector(threading.Thread):
    """Rank 0's thread: takes deliveries, gives a failed rank's work back, ends the call."""

    def __init__(self, pool: _Pool, keys: wp.Keys, ledger: wp.Ledger) -> None:
        super().__init__(name="resilient_ddp-inference", daemon=True)
        self.pool = pool
        self.rt = pool.rt
        self.keys = keys
        self.ledger = ledger
        control = self.rt.connection("inference")
        self.control = control
        self.store = _Guarded(control.store)
        self.mac = control.key
        self.lock = threading.Lock()
        self.buffer: dict[int, Any] = {}
        self.frontier = 0
        self.finished = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.given_up: dict[int, str] = {}
        self.seen: dict[int, tuple[Any, float]] = {}
        self.held: dict[int, tuple[int, float]] = {}  # rank -> (ticket, since)
        self.n_pub = 0
        self.streaming = pool.output_dir is None
        self.callback: Callable[[int, int], None] | None = None
        if pool.progress is not False and pool.total > 0:
            self.callback = pool.progress if callable(pool.progress) else _Bar(pool.total).update
        self.last_done = -1
        self._poison_told: set[int] = set()
        self.per_rank: dict[int, int] = {}
        # Replacements helping (see _guest): worker number -> (its beat count, when this
        # process saw that count first, on its monotonic clock).
        self.guests: dict[int, tuple[int, float]] = {}

    # -- the main thread's side --------------------------------------------------------------
    def ready(self) -> Iterator[tuple[int, Any]]:
        """The results now available in dataset order (taken from the buffer)."""
        out: list[tuple[int, Any]] = []
        with self.lock:
            total = self.pool.total
            while self.frontier < total:
                i = self.frontier
                if i in self.buffer:
                    out.append((i, self.buffer.pop(i)))
                elif i in self.ledger.todo:
                    break
                self.frontier += 1  # done elsewhere (a file, resumed) or poison
        yield from out

    def end_progress(self) -> None:
        if self.callback is not None:
            self.callback(self.pool.total, self.pool.total)

    def live(self) -> set[int]:
        """The workers that may still deliver: ranks and helping replacements not given up."""
        ranks = set(range(self.rt.world_size)) | set(self.guests)
        return {r for r in ranks if r not in self.given_up}

    # -- the thread --------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            self.finished.set()

    def _loop(self) -> None:
        rt, led = self.rt, self.ledger
        backoff = ctl.Backoff(1, 4)
        hb = rt.config.heartbeat_interval.total_seconds()
        next_look = time.monotonic()
        next_bar = 0.0
        seen_failures = 0
        while not led.finished() and not self.stop.is_set():
            changed = False
            with rt.lock:
                fresh = list(rt.failures[seen_failures:])
                seen_failures += len(fresh)
                left = [r for r in rt.left if r not in self.given_up]
            for ev in fresh:
                why = _WHY.get(ev.kind, "failed")
                for r in ev.ranks:
                    what = (ev.culprit.what if ev.culprit is not None else "") or why
                    changed |= self._give_up(r, f"{why}: {what}")
            for r in left:
                changed |= self._give_up(r, "left the group")
            leases = self._leases()  # before the deliveries (see Ledger.orphans)
            changed |= self._take_deliveries()
            now = time.monotonic()
            if now >= next_look:
                next_look = now + hb
                changed |= self._look_for_guests(now)
                changed |= self._look_for_hangs(leases)
            for t in led.orphans(leases, self.live()):
                led.requeue(t, "its rank failed before delivering it", -1, self.live())
                changed = True
            self._flush()
            if self.callback is not None and now >= next_bar:
                done = self.pool.total - len(led.todo)
                if done != self.last_done:
                    self.last_done = done
                    next_bar = now + _REFRESH_S
                    self.callback(min(done, self.pool.total), self.pool.total)
            if changed:
                backoff.reset()
            backoff.sleep()
        if not self.stop.is_set():
            self._end_call()

    def _end_call(self) -> None:
        """End the call for every worker: who was given up on (a late one raises), then
        ``END``; note the keys to forget with the generation."""
        rt, keys = self.rt, self.keys
        if self.given_up:
            gone = {str(r): why for r, why in self.given_up.items()}
            self.store.set(keys.given_up, json.dumps(gone))
        self.store.add(keys.redo_n, wp.END)
        # Kept until the generation is forgotten: a rank resumed late may still read
        # them (a get of a deleted key would block).
        names = [keys.lease(r) for r in range(rt.world_size)] + [keys.given_up]
        names += [keys.redo(k) for k in range(self.n_pub)]
        # A ticket not taken (its rank died or was given up on): the parts of a split
        # delivery it left go now; its record, if one comes late, with the generation.
        for t in range(self.ledger.published):
            if t not in self.ledger.delivered:
                with contextlib.suppress(Exception):
                    wp.sweep_parts(self.store, keys, t)
                names.append(keys.res(t))
        with contextlib.suppress(Exception):
            self.control.note_keys(names)

    def _leases(self) -> dict[int, int]:
        ranks = sorted(self.live())
        names = [self.keys.lease(r) for r in ranks]
        there = ctl.present(self.store.check, names)
        have = [r for r, ok in zip(ranks, there, strict=True) if ok]
        if not have:
            return {}
        raw = self.store.multi_get([self.keys.lease(r) for r in have])
        return {r: int(v) for r, v in zip(have, raw, strict=True)}

    def _take_deliveries(self) -> bool:
        led, keys = self.ledger, self.keys
        claimed = self.store.add(keys.next, 0)
        waiting = [t for t in range(min(claimed, led.published)) if t not in led.delivered]
        if not waiting:
            return False
        there = ctl.present(self.store.check, [keys.res(t) for t in waiting])
        changed = False
        for t, ok in zip(waiting, there, strict=True):
            if not ok:
                continue
            d = wp.take(self.store, keys, self.mac, t)
            if d is None:
                rank_log.of(self.rt).warning(
                    "distributed_inference: ignored a malformed delivery of ticket %d", t
                )
                continue
            fresh, _ = led.accept(d, self.live())
            self.per_rank[d.rank] = self.per_rank.get(d.rank, 0) + len(fresh)
            for i in list(led.failures):
                if i not in self._poison_told:
                    self._poison_told.add(i)
                    f = led.failures[i]
                    log.warning(
                        "distributed_inference: item %d is a poison item: %s: %s (raised on "
                        "rank(s) %s); it is not run again",
                        i,
                        f.exc_type,
                        f.message,
                        list(f.ranks),
                    )
                    _events.record(
                        self.rt,
                        "inference_poison",
                        item=i,
                        exc_type=f.exc_type,
                        ranks=list(f.ranks),
                    )
            if self.streaming and d.results is not None and fresh:
                keep = set(fresh)
                with self.lock:
                    for i, r in zip(d.indices, d.results, strict=True):
                        if i in keep:
                            self.buffer[i] = r
            changed = True
        return changed

    def _look_for_guests(self, now: float) -> bool:
        """Note the replacements that came to help (their first beat makes them workers:
        they hold a lease by then) and give up on one whose beat stopped for
        ``heartbeat_timeout``. Round trips: one ``add``; with helpers, a ``check`` and a
        ``multi_get`` of their beats."""
        world, keys = self.rt.world_size, self.keys
        n = int(self.store.add(keys.guests, 0))
        ids = [world + k for k in range(n) if world + k not in self.given_up]
        if not ids:
            return False
        names = [keys.guest_beat(w) for w in ids]
        there = [w for w, ok in zip(ids, ctl.present(self.store.check, names), strict=True) if ok]
        if not there:
            return False
        beats = self.store.multi_get([keys.guest_beat(w) for w in there])
        timeout = self.rt.config.heartbeat_timeout.total_seconds()
        changed = False
        for w, raw in zip(there, beats, strict=True):
            beat = int(raw)
            seen = self.guests.get(w)
            if seen is None:
                rank_log.of(self.rt).info(
                    "distributed_inference: a replacement helps as worker %d", w
                )
                _events.record(self.rt, "inference_guest", worker=w)
                changed = True
            if seen is None or seen[0] != beat:
                self.guests[w] = (beat, now)
            elif now - seen[1] >= timeout:
                changed |= self._give_up(w, f"stopped sending heartbeats for {timeout:.1f} s")
        return changed

    def _give_up(self, r: int, why: str) -> bool:
        known = 0 <= r < self.rt.world_size or r in self.guests
        if r == self.rt.rank or r in self.given_up or not known:
            return False
        self.given_up[r] = why
        lease = self._leases_of(r)
        before = len(self.ledger.redone)
        if lease is not None:
            self.ledger.requeue(lease, f"rank {r} {why}", r, self.live())
        redone = self.ledger.redone[before:]
        items = sum(x["items"] for x in redone)
        log.warning(
            "%s %s during distributed_inference; %s",
            _worker_name(r, self.rt.world_size),
            why,
            f"its chunk ({items} item(s)) goes to the other ranks"
            if items
            else "it held no unfinished chunk",
        )
        warnings.warn(
            f"distributed_inference: {_worker_name(r, self.rt.world_size)} {why}; its "
            f"unfinished work ({items} item(s)) is redone by the other ranks",
            RuntimeWarning,
            stacklevel=1,
        )
        _events.record(self.rt, "inference_redo", failed_rank=r, why=why, items=items)
        return True

    def _leases_of(self, r: int) -> int | None:
        name = self.keys.lease(r)
        if not self.store.check([name]):
            return None
        return int(self.store.get(name))

    def _look_for_hangs(self, leases: dict[int, int]) -> bool:
        """Give up on a rank that holds an unfinished ticket while its progress signals have
        not moved for the stuck window (and its heartbeat still comes: a stopped rank is
        the watchdog's), and tell it (it raises RankFailureError in its main thread)."""
        led, rt = self.ledger, self.rt
        holders = [
            r
            for r in sorted(self.live())
            # Rank 0 itself only while its main thread runs a chunk (not while the caller
            # of iter_inference holds it between results).
            if (r != rt.rank or self.pool.in_chunk)
            and r in leases
            and leases[r] < led.published
            and leases[r] not in led.delivered
            and leases[r] not in led.requeued
        ]
        if not holders:
            return False
        # Only ranks publish a state (a helping replacement has none; it is judged by its
        # beat and busy_timeout alone): asking for it would only cost a read more.
        states = self.control.read_states([r for r in holders if r < rt.world_size])
        now = time.monotonic()
        window = rt.config.base_stuck_window
        changed = False
        busy = rt.config.busy_timeout.total_seconds()
        for r in holders:
            s = states.get(r, ctl.HeartbeatState())  # none: an empty one
            held = self.held.get(r)
            if held is None or held[0] != leases[r]:
                held = self.held[r] = (leases[r], now)
            key = (leases[r], json.dumps(s.progress))
            prev = self.seen.get(r)
            if prev is None or prev[0] != key:
                prev = self.seen[r] = (key, now)
            stuck = (
                s.status == "running"
                # Waiting inside the library (a delivery's store write to a store host
                # that is slow to read it) is a bounded wait of ours, not a hang.
                and not in_own_wait(s.inside, s.phase)
                and float(s.idle or 0.0) >= window
                and now - prev[1] >= window
            )
            overdue = now - held[1] >= busy  # busy all along: a livelock
            if not stuck and not overdue:
                continue
            if stuck:
                what = (
                    f"hung in distributed_inference: holds ticket {leases[r]} and its "
                    f"progress signals did not move for {float(s.idle or 0.0):.1f} s "
                    f"(at {'?' if s.where is None else s.where})"
                )
                why = f"hung (no progress for {window:.1f} s)"
            else:
                what = (
                    f"held ticket {leases[r]} of distributed_inference for {now - held[1]:.0f} "
                    f"s, past busy_timeout, its signals still moving "
                    f"(at {'?' if s.where is None else s.where})"
                )
                why = f"was busy on one chunk past busy_timeout ({busy:.0f} s)"
            if self.control.claim(r):
                culprit = Culprit.record(
                    r, what=what, info=rt.infos.get(r), state=s.record(), stack=s.stack or ""
                )
                self.control.post_events(
                    [
                        {
                            "kind": ctl.EV_UNRESPONSIVE,
                            "rank": r,
                            "reporter": rt.rank,
                            "gen": rt.generation,
                            "t": time.time(),
                            "culprit": culprit,
                        }
                    ]
                )
            if r == rt.rank:
                # The collector's own rank: nobody can finish the call without it. Its main
                # thread raises (the others raise naming it when they read the event).
                err = RankFailureError(
                    f"rank {r} (host {rt.identity['host']}): {what}; distributed_inference "
                    "cannot finish without rank 0, which collects the results. Raised "
                    "here, in the main thread.",
                    culprits=[Culprit.of(r, what=what, state=s.record())],
                    op="distributed_inference",
                    generation=rt.generation,
                )
                self.error = err  # raised by the main thread when it returns, if not told
                rt.tell_main(err)
                self.stop.set()
                continue
            changed |= self._give_up(r, why)
        return changed

    def _flush(self) -> None:
        """Publish the redo entries the ledger queued."""
        while self.n_pub < len(self.ledger.entries):
            k = self.n_pub
            self.store.set(self.keys.redo(k), self.ledger.entries[k].to_json())
            self.store.add(self.keys.redo_n, 1)
            self.n_pub += 1

    def summarise(self) -> None:
        global _last_summary
        led, pool = self.ledger, self.pool
        wall = time.monotonic() - pool.start
        ideal = led.compute_s / max(1, self.rt.world_size)
        redone = tuple(led.redone)
        poison = tuple(sorted(led.failures.values(), key=lambda f: f.index))
        why = "; ".join(
            f"ticket {x['ticket']} (chunk {x['chunk']}, {x['items']} item(s)): {x['why']}"
            for x in redone
        )
        failed = "; ".join(
            f"{_worker_name(r, self.rt.world_size)} {w}" for r, w in sorted(self.given_up.items())
        )
        text = (
            f"distributed_inference: {pool.total - len(poison)}/{pool.total} items in "
            f"{len(led.chunks)} chunks on {self.rt.world_size} ranks"
            + (f" ({pool.resumed} found written and skipped)" if pool.resumed else "")
            + "; items per rank "
            + ", ".join(
                f"{r if r < self.rt.world_size else f'{r} (replacement)'}: {n}"
                for r, n in sorted(self.per_rank.items())
            )
            + f"; {len(redone)} piece(s) of work redone"
            + (f" ({why})" if why else "")
            + (f"; failed ranks: {failed}" if failed else "")
            + f"; {len(poison)} poison item(s)"
            + (f" ({[f.index for f in poison]})" if poison else "")
            + f"; wall time {wall:.2f} s against an ideal {ideal:.2f} s (compute "
            f"{led.compute_s:.2f} s / {self.rt.world_size} ranks)."
        )
        log.info("%s", text)
        _last_summary = InferenceSummary(
            items=pool.total,
            items_done=pool.total - len(poison),
            resumed_items=pool.resumed,
            chunks=len(led.chunks),
            chunks_redone=len(redone),
            redone=redone,
            failed_ranks=dict(self.given_up),
            poison=poison,
            wall_s=wall,
            ideal_s=ideal,
            world_size=self.rt.world_size,
            per_rank_items=dict(sorted(self.per_rank.items())),
            text=text,
        )


def _static_inference(
    fn: Callable[[Any], Any],
    dataset: Dataset[Any],
    *,
    batch_size: int,
    costs: Sequence[float] | torch.Tensor | None = None,
    cost_fn: Callable[[int], float] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    progress: ProgressArg = True,
    timeout: Duration = None,
) -> list[Any] | None:
    """``on_rank_failure="raise"``: the behaviour before issue 28 (planned shares, one final
    gather; any failure raises on every rank).

    Collective over the default group: every rank calls it with the same dataset and
    arguments. Each rank processes its balanced share of the items in batches of at most
    ``batch_size`` under ``torch.no_grad()``; no collective runs between batches, so ranks
    finish their shares independently and meet once, in the final gather.

    Args:
        fn: Called with one collated batch; returns one result per item of the batch: a
            tensor whose first dimension is the batch size (one row per item), a list of
            per-item results, or a dict or tuple of those (split into one dict or tuple per
            item).
        dataset: A map-style dataset (``len`` and ``dataset[i]``), the same on every rank.
        batch_size: Most items per call of ``fn``.
        costs: Predicted cost of each item (e.g. its length), used to balance the ranks'
            total work; see :class:`BalancedDistributedSampler`.
        cost_fn: ``cost_fn(index)`` instead of ``costs``.
        collate_fn: As DataLoader's (default: ``default_collate``).
        num_workers: DataLoader worker processes per rank.
        progress: ``True`` shows a progress bar of all ranks' items on rank 0 (stderr);
            a callable is called on rank 0 with ``(items_done, items_total)`` about twice a
            second instead, from a background thread, and once more with ``(total,
            total)`` from the calling thread at the end; ``False`` shows nothing.
        timeout: How long a rank may go without finishing a batch while the others wait
            for it at the end, and the final gather's per-piece timeout (timedelta or
            seconds; default ``config.op_timeout``). A slow rank that keeps finishing batches
            is waited for as long as it needs.

    Returns:
        On rank 0, a list with one result per dataset item, ``result[i]`` for
        ``dataset[i]``; tensors on the CPU (each batch's results are moved there as soon
        as ``fn`` returns). ``None`` on the other ranks.

    Raises:
        ConfigError: Invalid arguments, or ``fn`` returned something that does not split
            into one result per item (checked on the rank where it happened).
        RankFailureError: A rank crashed, raised, left or hung; names it (raised in the
            final gather on the ranks that were still healthy).
        CollectiveMismatchError: Ranks returned results of different kinds or dtypes.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size should be >= 1, got {batch_size}")
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"distributed_inference needs a map-style dataset with len(), got "
            f"{type(dataset).__name__}"
        )
    rt = ensure_runtime()
    total = len(dataset)
    sampler = BalancedDistributedSampler(
        dataset, dist.get_world_size(), rt.rank, costs=costs, cost_fn=cost_fn
    )
    plan = sampler.plan()
    mine = plan[rt.rank]
    item_costs = sampler._q  # the costs as the plan saw them (None: all equal)
    if item_costs is not None:
        # Most costly first: a batch holds items of similar cost (less padding), and the
        # long items do not all come last.
        mine = mine[torch.argsort(item_costs[mine], descending=True, stable=True)]
    order = mine.tolist()
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    loader: DataLoader[Any] = DataLoader(
        dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers
    )
    results: list[Any] = []
    step, phase = rt.step, rt.phase
    with _Progress(rt, total, progress) as bar:
        with _local_forward(rt), torch.no_grad():
            for i, (items, batch) in enumerate(zip(batches, loader, strict=True)):
                rt.step, rt.phase = i, "inference"
                # On the CPU at once: results of a long run must not pile up on the GPU.
                results.extend(_split(to_cpu(fn(batch)), len(items)))
                bar.advance(len(items))
        rt.phase = "waiting for peers"
        _await_peers(rt, [len(p) for p in plan], timeout)
        rt.phase = "gather"
        out = gather_to_rank0(results, indices=order, num_items=total, timeout=timeout)
    # Left as they were on an error: the failure report says where this rank was.
    rt.step, rt.phase = step, phase
    return out


def _await_peers(rt: Runtime, shares: list[int], timeout: Duration) -> None:
    """Return once every rank has processed its share.

    Ranks with lighter shares wait here rather than in the gather, so that a slow rank
    that keeps finishing batches is never timed out, while a stuck one still is: an
    unfinished rank whose count (from its heartbeat) stays the same for ``timeout`` is
    named with its stack, as a collective would name it.

    The store load does not grow with the world twice over: each finished rank counts
    itself on one counter and the waiting ranks read that counter; only the first rank to
    finish reads the heartbeats of the ranks still at work (to tell slow from stuck), and
    its verdict reaches the others as a failure report.

    Raises:
        CollectiveTimeoutError: An unfinished rank made no progress for ``timeout``.
        RankFailureError: A rank crashed, raised or left meanwhile.
    """
    o = Op("distributed_inference", timeout=timeout, retry=1, validate=False)
    try:
        if rt.watchdog is not None:
            rt.watchdog.poke()  # publish this rank's final count now, not at the next beat
        call, world = rt.inference_calls, rt.world_size
        finished = rt.control.finish_inference(call)
        watcher = finished == 1
        interval = _timings.inference_finish_poll(rt.config)
        seen: dict[int, tuple[int, float]] = {}
        pending = [r for r in range(world) if r != rt.rank]
        while finished < world:
            if rt.failed_for(o.seq):
                raise rt.build_error(o.name, o.seq)
            if watcher:
                states = rt.control.read_states(pending)
                now = time.monotonic()
                for r in pending:
                    done = _done(states.get(r), call)
                    if seen.get(r, (-1, 0.0))[0] != done:
                        seen[r] = (done, now)
                pending = [r for r in pending if seen[r][0] < shares[r]]
                if any(now - seen[r][1] > o.attempt_s for r in pending):
                    o.raise_timeout(_store_diagnosis.diagnose(rt, rt.control, o.name, o.seq))
            time.sleep(interval)
            finished = rt.control.inference_finished(call)
    finally:
        o.end()


@contextmanager
def _local_forward(rt: Runtime) -> Iterator[None]:
    """While active, :class:`ResilientDDP` forwards run the wrapped module alone."""
    rt.enter_local_forward()
    try:
        yield
    finally:
        rt.leave_local_forward()


def _split(out: Any, n: int) -> list[Any]:
    """One result per item from what ``fn`` returned for a batch of ``n`` items."""
    if isinstance(out, torch.Tensor):
        if out.dim() >= 1 and out.shape[0] == n:
            return list(out.unbind(0))
    elif isinstance(out, list):
        if len(out) == n:
            return out
    elif isinstance(out, dict):
        columns = {k: _split(v, n) for k, v in out.items()}
        return [{k: col[i] for k, col in columns.items()} for i in range(n)]
    elif isinstance(out, tuple):
        columns_t = [_split(v, n) for v in out]
        return [tuple(col[i] for col in columns_t) for i in range(n)]
    raise ConfigError(
        f"fn returned {_describe(out)} for a batch of {n} item(s); it should return one "
        "result per item: a tensor with first dimension {n}, a list of {n}, or a dict or "
        "tuple of those".replace("{n}", str(n))
    )


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, list):
        return f"a list of {len(out)}"
    return f"a {type(out).__name__}"


def _done(state: ctl.HeartbeatState | None, call: int) -> int:
    """Items a rank's heartbeat (None: none) says it processed in inference call ``call``
    (0 while its heartbeat still shows an earlier call)."""
    progress = None if state is None else state.progress
    if progress is not None and progress[:1] == (call,):
        return int(progress[-1])
    return 0


class _Progress:
    """Rank 0's view of every rank's progress, drawn from the heartbeats.

    Each rank's count is published by its watchdog (no collective); rank 0 runs a thread
    that reads all of them about twice a second, until the final gather is over.
    """

    def __init__(self, rt: Runtime, total: int, progress: ProgressArg) -> None:
        self.rt = rt
        self.total = total
        self.done = 0
        self.callback: Callable[[int, int], None] | None = None
        if rt.rank == 0 and progress is not False and total > 0:
            self.callback = progress if callable(progress) else _Bar(total).update
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def __enter__(self) -> _Progress:
        self.rt.begin_inference_call()  # every rank counts its calls alike
        self.call = self.rt.inference_calls
        self.rt.set_inference_progress(self.call, 0)
        if self.callback is not None:
            self._thread = threading.Thread(
                target=self._run, name="resilient_ddp-progress", daemon=True
            )
            self._thread.start()
        return self

    def advance(self, n: int) -> None:
        self.done += n
        self.rt.set_inference_progress(self.call, self.done)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if exc[0] is None and self.callback is not None:
                self.callback(self.total, self.total)
        self.rt.end_inference_progress()

    def _run(self) -> None:
        control = self.rt.connection("progress")
        ranks = list(range(self.rt.world_size))
        last = -1
        while not self._stop.wait(_REFRESH_S):
            try:
                states = control.read_states(ranks)
            except Exception:  # noqa: BLE001 - the bar is best effort; the watchdog reports
                continue
            done = self.done + sum(_done(s, self.call) for r, s in states.items() if r != 0)
            if done != last:
                last = done
                assert self.callback is not None
                self.callback(min(done, self.total), self.total)


class _Bar:
    """A one-line text progress bar on stderr (a line per 10% when stderr is not a tty)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.next_decile = 1

    def update(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.start
        frac = done / total if total else 1.0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {(total - done) / rate:.0f} s" if rate > 0 and done < total else ""
        line = (
            f"inference [{'#' * int(frac * 30):<30}] {done}/{total} items "
            f"({frac:.0%}, {rate:.0f} items/s over all ranks, {elapsed:.1f} s{eta})"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= total else ""))
            sys.stderr.flush()
        elif frac * 10 >= self.next_decile or done >= total:
            self.next_decile = int(frac * 10) + 1
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
