"""A batch sampler for elastic training: every sample of an epoch exactly once, whatever
the group does meanwhile.

Each step takes the next ``world_size * batch_size`` indices of the epoch's queue; rank
``r`` gets slot ``r``. The queue only moves when a step *commits* (its gradient reduction
completed on the group), so:

* a step that is skipped after a failure leaves its indices in the queue: the next step,
  on the new group, takes them again;
* a step redone over the survivors commits the survivors' slots; the slots of the ranks
  that failed go back to the front of the queue, so no shard is lost with its rank;
* joiners are appended after the existing ranks, so the slots of the existing ranks do not
  move when the group grows;
* a process that joins takes the queue over from the others and skips the epochs already
  done: the usual ``for epoch in ...: sampler.set_epoch(epoch)`` loop works unchanged.

The last step of an epoch splits what is left evenly; fewer indices than ranks are dropped
(every rank must take part in every step) and counted in :attr:`dropped`.

**Workers and prefetching.** A DataLoader with ``num_workers > 0`` takes index batches
from its batch sampler ahead of the steps that train them (``num_workers *
prefetch_factor`` of them). :class:`ElasticDataLoader` tells the sampler which batch
reaches the training loop (its batches come in the order they were planned): a batch
planned ahead stays a reservation of the queue until then. A world change (a shrink, an
admission, a skipped step, state taken over) invalidates every reservation: those
batches are dropped when they arrive (never seen by the loop) and their indices planned
again for the new group, from the committed position. While batches are in flight at an
epoch's end, the sampler hands the loader a one-sample filler batch (dropped too) instead
of ending the epoch, so that indices given back by a late failure are still trained in
it.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sized
from types import FrameType
from typing import Any

import torch
from torch.utils.data import DataLoader

from resilient_ddp.errors import ConfigError
from resilient_ddp.runtime import _runtime

__all__ = ["ElasticBatchSampler", "ElasticDataLoader", "ElasticDistributedSampler"]


class _Pass:
    """One ``iter()`` of the sampler: what it yielded, by position (``None``: a filler)."""

    def __init__(self, tracked: bool) -> None:
        self.tracked = tracked
        self.tickets: dict[int, dict[str, Any] | None] = {}
        self.yielded = 0


class ElasticBatchSampler:
    """Batch sampler whose shards follow the group through failures and joins.

    Pass it as ``batch_sampler`` of an :class:`ElasticDataLoader` (any ``num_workers``,
    ``prefetch_factor``, ``persistent_workers``), of a plain ``DataLoader`` with
    ``num_workers=0``, or iterate it directly. Every rank creates it with the same
    arguments. (It is not torch's ``torch.distributed.elastic.utils.data.
    ElasticDistributedSampler``, a ``sampler=``-style class.)

    Args:
        dataset: A sized dataset, or the number of samples.
        batch_size: Samples per rank and step.
        shuffle: Shuffle the order every epoch, from ``(seed, epoch)`` (never the global
            RNG).
        seed: Seed of the shuffle.

    Raises:
        ConfigError: ``batch_size`` is not positive; when iterated under elastic training
            by a plain ``DataLoader`` with worker processes (use
            :class:`ElasticDataLoader`).
    """

    def __init__(
        self,
        dataset: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size should be positive, got {batch_size}")
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.dropped = 0  # indices of the last finished epoch that no rank got
        self._requested = 0
        self._epoch = -1  # the epoch the queue belongs to (-1: none yet)
        self._head: list[int] = []  # indices given back by failed ranks, taken first
        self._order: list[int] = []
        self._pos = 0
        self._done = False  # the queue's epoch is finished
        self._pending: list[dict[str, Any]] = []  # fetches not committed yet
        # Batches planned for an ElasticDataLoader that did not reach the loop yet: they
        # reserve the queue after the pending ones until delivered or invalidated.
        self._ahead: list[dict[str, Any]] = []
        self._pass: _Pass | None = None
        self._track_next = False  # the next iter() is an ElasticDataLoader's
        self.plan_version = 0  # bumped when the batches planned ahead are invalidated
        self.stale_batches = 0  # batches dropped by ElasticDataLoader (planned for another plan)
        self.committed_steps = 0
        from resilient_ddp.training.elastic import register_elastic_participant

        register_elastic_participant(self)

    # -- the epoch ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate next (its shuffle depends on it)."""
        self._requested = epoch

    @property
    def epoch(self) -> int:
        """The epoch the queue is in (the job's current epoch after a join)."""
        return max(self._epoch, 0)

    def _start(self, epoch: int) -> None:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            self._order = list(range(self.num_samples))
        self._epoch, self._pos, self._head, self._done = epoch, 0, [], False
        self._pending = []
        self._invalidate()

    def __iter__(self) -> Iterator[list[int]]:
        tracked = self._track_next  # set during an ElasticDataLoader's iter() (which may
        # call iter() on its batch sampler more than once: the last pass is the one used)
        if self._pass is not None and self._pass.tracked:
            self._invalidate()  # what an earlier loader pass planned ahead never arrives
        self._pass = p = _Pass(tracked)
        if tracked:
            return self._iter_tracked(p)
        if _elastic() and _multiprocess_loader_caller():
            # Raised at the first batch, not here: torch's iterator is half built now.
            return self._refuse()
        return self._iter_plain()

    def _refuse(self) -> Iterator[list[int]]:
        raise ConfigError(
            f"{type(self).__name__} is the batch_sampler of a DataLoader with worker "
            "processes: that loader plans batches ahead of the steps that commit them, "
            "and would train batches planned for a group that changed. Use "
            "resilient_ddp.ElasticDataLoader (same arguments as DataLoader), which "
            "drops those batches, or num_workers=0"
        )
        yield []  # a generator

    def _iter_plain(self) -> Iterator[list[int]]:
        epoch = self._requested
        if self._epoch > epoch:
            return  # a joiner: the job is past this epoch
        if self._epoch < epoch or self._done:
            self._start(epoch)
        # The queue may move to a later epoch under this loop (state taken over from a
        # rank that got further): this epoch's loop ends then.
        while self._epoch == epoch:
            batch = self._fetch()
            if batch is None:
                return
            yield batch

    def _iter_tracked(self, p: _Pass) -> Iterator[list[int]]:
        """The batches of an :class:`ElasticDataLoader`'s pass, planned ahead (see
        :meth:`_deliver`); a filler while nothing can be planned but batches are in
        flight."""
        epoch = self._requested
        if self._epoch > epoch:
            return
        if self._epoch < epoch or self._done:
            self._start(epoch)
        while self._epoch == epoch and self._pass is p:
            f = self._fetch_ahead()
            if f is None:
                if not self._ahead:
                    return
                batch = [0]  # a filler, dropped on delivery
            else:
                batch = f["items"][f["starts"][f["rank"]] : f["starts"][f["rank"] + 1]]
            p.tickets[p.yielded] = f
            p.yielded += 1
            yield batch

    def _fetch_ahead(self) -> dict[str, Any] | None:
        world, rank, members = _membership()
        if not _elastic() and self._pending:
            # No elastic runtime: a fetch happens when the loop asks for another batch,
            # so every batch it got before is done.
            self.on_step_committed(members)
        if self._ahead and self._ahead[-1]["members"] != members:
            self._invalidate()
        offset = sum(f["n"] for f in self._pending) + sum(f["n"] for f in self._ahead)
        f = self._plan(offset, world, members)
        if f is None:
            if not self._pending and not self._ahead:
                self.dropped = self._available()
                self._done = True
            return None
        f["rank"] = rank
        f["version"] = self.plan_version
        self._ahead.append(f)
        return f

    def _deliver(self, p: _Pass, k: int) -> bool:
        """The ``k``-th batch of pass ``p`` reached the loop: whether to train it (it was
        planned under the plan that still holds), else it is dropped."""
        f = p.tickets.pop(k, None)
        _, _, members = _membership()
        if not _elastic() and self._pending:
            self.on_step_committed(members)
        if f is None:
            return False  # a filler
        if p is not self._pass or not self._ahead or self._ahead[0] is not f:
            self.stale_batches += 1
            if any(a is f for a in self._ahead):
                self._invalidate()  # never: batches arrive in the order they were planned
            return False
        if f["members"] != members or f["version"] != self.plan_version:
            self.stale_batches += 1
            self._invalidate()
            return False
        self._ahead.pop(0)
        self._pending.append(f)
        return True

    def _invalidate(self) -> None:
        """Forget the batches planned ahead: the plan changed (they are dropped when they
        arrive, and their indices planned again)."""
        self._ahead = []
        self.plan_version += 1

    def __len__(self) -> int:
        """Steps left in the epoch at the current world size (an estimate across changes)."""
        world, _, _ = _membership()
        left = len(self._head) + len(self._order) - self._pos if self._epoch >= 0 else 0
        if self._epoch < self._requested or self._done:
            left = self.num_samples
        full, rest = divmod(left, world * self.batch_size)
        return full + (1 if rest >= world else 0)

    # -- steps -------------------------------------------------------------------------------
    def _available(self) -> int:
        return len(self._head) + len(self._order) - self._pos

    def _take(self, offset: int, count: int) -> list[int]:
        """``count`` indices of the queue after the first ``offset`` (without consuming)."""
        out = self._head[offset : offset + count]
        start = self._pos + max(0, offset - len(self._head))
        return out + self._order[start : start + count - len(out)]

    def _fetch(self) -> list[int] | None:
        world, rank, members = _membership()
        if not _elastic():
            # No elastic runtime: each fetch commits the one before, as a plain sampler.
            self.on_step_committed(members)
        offset = sum(f["n"] for f in self._pending)
        f = self._plan(offset, world, members)
        if f is None:
            if not self._pending:
                self.dropped = self._available() - offset
                self._done = True
            return None
        self._pending.append(f)
        return f["items"][f["starts"][rank] : f["starts"][rank + 1]]  # type: ignore[no-any-return]

    def _plan(self, offset: int, world: int, members: list[int]) -> dict[str, Any] | None:
        """The next step after the first ``offset`` indices of the queue, or ``None`` when
        fewer indices than ranks are left there."""
        avail = self._available() - offset
        b = self.batch_size
        if avail >= world * b:
            sizes = [b] * world
        elif avail >= world:
            q, r = divmod(avail, world)
            sizes = [q + (1 if i < r else 0) for i in range(world)]
        else:
            return None
        starts = [sum(sizes[:i]) for i in range(world + 1)]
        return {
            "n": starts[-1],
            "slots": [(members[i], starts[i], starts[i + 1]) for i in range(world)],
            "items": self._take(offset, starts[-1]),
            "starts": starts,
            "members": list(members),
        }

    def on_step_committed(self, contributors: list[int]) -> None:
        """Consume the fetched steps; slots of non-contributors go back to the front."""
        given_back: list[int] = []
        for f in self._pending:
            n = f["n"]
            from_head = min(n, len(self._head))
            del self._head[:from_head]
            self._pos += n - from_head
            for uid, a, z in f["slots"]:
                if uid not in contributors:
                    given_back.extend(f["items"][a:z])
            self.committed_steps += 1
        self._pending = []
        if given_back:
            self._invalidate()  # the queue's front moved under the batches planned ahead
        self._head = given_back + self._head

    def on_step_discarded(self) -> None:
        """The step in flight is discarded on every member: its fetch is forgotten."""
        self._pending = []
        self._invalidate()

    def on_admission(self, joiners: list[int]) -> list[dict[str, Any]]:
        """Joiners take the slots after the existing ones in the step being fetched.

        Returns:
            The steps in flight as they were, for :meth:`on_admission_failed` if the admission
            fails.
        """
        saved = [{**f, "slots": list(f["slots"])} for f in self._pending]
        self._invalidate()  # batches planned ahead are for the group without the joiners
        if not self._pending:
            return saved
        f = self._pending[-1]
        for uid in joiners:
            avail = self._available() - sum(p["n"] for p in self._pending)
            count = min(self.batch_size, max(0, avail))
            f["slots"].append((uid, f["n"], f["n"] + count))
            f["items"] = f["items"] + self._take(f["n"], count)
            f["n"] += count
        return saved

    def on_admission_failed(self, saved: list[dict[str, Any]]) -> None:
        """Undo :meth:`on_admission` (the admission failed)."""
        self._pending = saved
        self._invalidate()

    def admission_step(self, at: int, world: int, new_world: int, committed: int) -> int:
        """The first step at or after ``at`` where joiners get full slots: when the epoch
        ends before, the first step of the next epoch."""
        per_step = world * self.batch_size
        avail = self._available()
        steps_left = avail // per_step + (1 if avail % per_step >= world else 0)
        if self._epoch < 0 or at - committed >= steps_left:
            return at
        if avail - (at - committed) * per_step >= new_world * self.batch_size:
            return at
        return committed + steps_left

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position (epoch, queue, counters); not the steps in flight."""
        return {
            "epoch": self._epoch,
            "pos": self._pos,
            "head": list(self._head),
            "done": self._done,
            "dropped": self.dropped,
            "committed_steps": self.committed_steps,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over another rank's position (drops this rank's steps in flight).

        Raises:
            ConfigError: The state is of a sampler over another dataset size or seed.
        """
        if (state["num_samples"], state["seed"], state["shuffle"]) != (
            self.num_samples,
            self.seed,
            self.shuffle,
        ):
            raise ConfigError(
                f"{type(self).__name__}.load_state_dict: the state is of a sampler with "
                f"num_samples={state['num_samples']}, seed={state['seed']}, "
                f"shuffle={state['shuffle']}; this one has {self.num_samples}, {self.seed}, "
                f"{self.shuffle}"
            )
        if state["epoch"] >= 0:
            self._start(int(state["epoch"]))
        self._pos = int(state["pos"])
        self._head = list(state["head"])
        self._done = bool(state["done"])
        self.dropped = int(state["dropped"])
        self.committed_steps = int(state["committed_steps"])
        self._pending = []
        self._invalidate()
        self._requested = max(self._requested, self._epoch)


class ElasticDistributedSampler(ElasticBatchSampler):
    """Deprecated name of :class:`ElasticBatchSampler` (it clashed with torch's
    ``torch.distributed.elastic.utils.data.ElasticDistributedSampler``, a different,
    ``sampler=``-style class). Same arguments; constructing it warns (``FutureWarning``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "ElasticDistributedSampler is deprecated (it clashes with torch's "
            "torch.distributed.elastic.utils.data.ElasticDistributedSampler): use "
            "resilient_ddp.ElasticBatchSampler, which takes the same arguments",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)


class ElasticDataLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` over an :class:`ElasticBatchSampler` that may use
    worker processes, prefetching and persistent workers under elastic training.

    Takes DataLoader's arguments; ``batch_sampler`` is required. The loop never sees a batch
    planned for a group that no longer holds: such batches (at most ``num_workers *
    prefetch_factor`` per world change) are dropped when they arrive, and their samples
    come again in later batches of the same epoch, so every sample of an epoch is still
    trained exactly once.

    Its worker processes end with the process that created the loader, even when that
    process is killed (SIGKILL) and even when they were started by a fork server or
    ``spawn`` (then torch's own check watches the fork server, which outlives the rank):
    each worker watches its creator through a pidfd and exits at once when it ends.

    Raises:
        ConfigError: ``batch_sampler`` is not an :class:`ElasticBatchSampler`, or
            ``in_order=False`` (batches must arrive in the order they were planned).
    """

    def __init__(self, dataset: Any, *, batch_sampler: ElasticBatchSampler, **kwargs: Any) -> None:
        if not isinstance(batch_sampler, ElasticBatchSampler):
            raise ConfigError(
                "ElasticDataLoader needs batch_sampler=ElasticBatchSampler(...), got "
                f"{type(batch_sampler).__name__}"
            )
        if kwargs.get("in_order", True) is not True:
            raise ConfigError(
                "ElasticDataLoader needs in_order=True: it matches each batch that arrives "
                "with the plan it was made under, in order"
            )
        kwargs["worker_init_fn"] = _EndWithCreator(os.getpid(), kwargs.get("worker_init_fn"))
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._rd_sampler = batch_sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self._rd_sampler
        sampler._track_next = True
        try:
            it = super().__iter__()
        finally:
            sampler._track_next = False
        p = sampler._pass
        assert p is not None
        assert p.tracked
        return _fresh(it, sampler, p)


class _EndWithCreator:
    """A DataLoader ``worker_init_fn`` that makes the worker exit when the process that
    created the loader ends, then calls the user's ``worker_init_fn``.

    A killed rank cannot stop its workers. torch's workers notice the end of their
    parent, but a worker started by a fork server (the default start method from Python
    3.14, and what a rank started by one inherits) has the fork server as parent, which
    lives on because the workers hold its liveness pipe: without this, such workers
    outlive the rank for good (each holding its memory).
    """

    def __init__(self, pid: int, user_fn: Any) -> None:
        self.pid = pid
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        threading.Thread(
            target=_exit_when_ended, args=(self.pid,), name="rd-end-with-creator", daemon=True
        ).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _exit_when_ended(pid: int) -> None:
    """Block until process ``pid`` ends (its pidfd becomes readable), then exit at once."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1  # no pidfd (not Linux >= 5.3, or the creator already ended): poll
    if fd >= 0:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass  # alive, another user's (pid reused): torch's own check remains
            time.sleep(0.5)
    os._exit(1)


def _fresh(it: Iterator[Any], sampler: ElasticBatchSampler, p: _Pass) -> Iterator[Any]:
    """The batches of ``it`` that the sampler still plans to train, in order."""
    for k, batch in enumerate(it):
        if sampler._deliver(p, k):
            yield batch


def _multiprocess_loader_caller() -> bool:
    """Whether a torch DataLoader iterator with worker processes called ``iter()`` on the
    sampler (it takes batches ahead of the steps)."""
    from torch.utils.data import dataloader

    cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if cls is None:
        return False
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), cls):
            return True
        frame = frame.f_back
    return False


def _elastic() -> bool:
    rt = _runtime.current()
    return rt is not None and rt.elastic is not None


def _membership() -> tuple[int, int, list[int]]:
    """World size, this rank's slot, and the member id of each slot."""
    rt = _runtime.current()
    if rt is not None and rt.elastic is not None:
        members = list(rt.elastic.members)
        return len(members), members.index(rt.elastic.uid), members
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    return world, rank, list(range(world))
