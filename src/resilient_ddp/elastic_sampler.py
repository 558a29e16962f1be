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
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch

from . import _runtime
from .errors import ConfigError

__all__ = ["ElasticDistributedSampler"]


class ElasticDistributedSampler:
    """Batch sampler whose shards follow the group through failures and joins.

    Use it as a DataLoader's ``batch_sampler`` with ``num_workers=0`` (a worker pool
    fetches batches ahead of the steps that commit them), or iterate it directly. Every
    rank creates it with the same arguments.

    Args:
        dataset: A sized dataset, or the number of samples.
        batch_size: Samples per rank and step.
        shuffle: Shuffle the order every epoch, from ``(seed, epoch)`` (never the global
            RNG).
        seed: Seed of the shuffle.

    Raises:
        ConfigError: ``batch_size`` is not positive.
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
        self.committed_steps = 0
        from .elastic import register_elastic_participant

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

    def __iter__(self) -> Iterator[list[int]]:
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
        avail = self._available() - offset
        b = self.batch_size
        if avail >= world * b:
            sizes = [b] * world
        elif avail >= world:
            q, r = divmod(avail, world)
            sizes = [q + (1 if i < r else 0) for i in range(world)]
        else:
            if not self._pending:
                self.dropped = avail
                self._done = True
            return None
        starts = [sum(sizes[:i]) for i in range(world)]
        items = self._take(offset, sum(sizes))
        self._pending.append(
            {
                "n": sum(sizes),
                "slots": [(members[i], starts[i], starts[i] + sizes[i]) for i in range(world)],
                "items": items,
            }
        )
        return items[starts[rank] : starts[rank] + sizes[rank]]

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
        self._head = given_back + self._head

    def on_step_discarded(self) -> None:
        """The step in flight is discarded on every member: its fetch is forgotten."""
        self._pending = []

    def on_admission(self, joiners: list[int]) -> list[dict[str, Any]]:
        """Joiners take the slots after the existing ones in the step being fetched.

        Returns:
            The steps in flight as they were, for :meth:`on_admission_failed` if the admission
            fails.
        """
        saved = [{**f, "slots": list(f["slots"])} for f in self._pending]
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
                "ElasticDistributedSampler.load_state_dict: the state is of a sampler with "
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
        self._requested = max(self._requested, self._epoch)


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
