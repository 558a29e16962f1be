"""Samplers that split a dataset across ranks by a per-item cost, without padding.

:class:`BalancedDistributedSampler` is a drop-in for :class:`torch.utils.data.DistributedSampler`
whose ranks get (nearly) equal total *cost* instead of equal counts, for loops in which ranks
do not meet at every batch (inference, evaluation, preprocessing). :class:`LockstepBatchSampler`
yields batches for loops that do meet at every step (DDP training, per-step metrics): every
rank gets the same number of steps, and the items are grouped so that the slowest rank of
each step is as fast as possible.

Both are pure index math: they never communicate. Every rank computes the same plan from the
same arguments (dataset length, costs, seed, epoch). The plan is computed in integer
arithmetic on costs quantised relative to the largest one, so it does not depend on the
number of threads or on the order of floating-point sums, which could otherwise differ
between hosts and lose or duplicate an item.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Sampler, default_collate

from resilient_ddp.errors import ConfigError

__all__ = ["BalancedDistributedSampler", "LockstepBatchSampler"]

Costs = Sequence[float] | torch.Tensor

# Quantised costs sum to less than 2**_SUM_BITS, so that twice a cumulative sum (the
# midpoint test of the water-filling) still fits in int64.
_SUM_BITS = 60
_MAX_BITS = 52  # float64's mantissa: finer steps would only quantise rounding noise
# Exact LPT (one heap operation per item, in Python) runs on the items larger than
# 1/_HEAD_SHARE of a rank's mean load, at least _HEAD_PER_RANK per rank and at most
# _HEAD_CAP in all; the rest is water-filled in vectorised torch code, where each rank
# ends within one such small item of the fill level.
_HEAD_SHARE = 1000
_HEAD_PER_RANK = 4
_HEAD_CAP = 200_000
# The lockstep split runs exact capacity-constrained LPT (one heap operation per item) on
# the steps whose costs differ most, up to this many items for each way of sizing steps.
_LOCKSTEP_EXACT = 100_000


# -- validation ---------------------------------------------------------------------------------
def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} should be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} should be an int, got {value!r}") from None


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            missing = " and ".join(
                name for name, v in (("num_replicas", num_replicas), ("rank", rank)) if v is None
            )
            raise ConfigError(
                f"{missing} not given and torch.distributed is not initialized; pass "
                "num_replicas= and rank= explicitly (e.g. num_replicas=4, rank=0)"
            )
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
    w = _as_int("num_replicas", num_replicas)
    if w < 1:
        raise ConfigError(f"num_replicas should be >= 1, got {w}")
    r = _as_int("rank", rank)
    if not 0 <= r < w:
        raise ConfigError(f"rank should be in [0, {w - 1}], got {r}")
    return w, r


def _length(dataset: Sized) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError(
            f"dataset should have a length (Sized), got {type(dataset).__name__}"
        ) from None


def _cost_tensor(
    n: int, costs: Costs | None, cost_fn: Callable[[int], float] | None
) -> torch.Tensor | None:
    """Validated float64 costs, one per item, or ``None`` when neither was given."""
    if costs is not None and cost_fn is not None:
        raise ConfigError("pass costs or cost_fn, not both")
    if cost_fn is not None:
        t, label = _call_cost_fn(n, cost_fn), "cost_fn({})"
    elif costs is not None:
        t, label = _given_costs(n, costs), "costs[{}]"
    else:
        return None
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ConfigError(f"{label.format(i)} should be a finite number >= 0, got {float(t[i])!r}")
    if not math.isfinite(float(t.sum())):
        raise ConfigError("costs should sum to a finite number, got inf; scale them down")
    return t


def _call_cost_fn(n: int, cost_fn: Callable[[int], float]) -> torch.Tensor:
    if not callable(cost_fn):
        raise ConfigError(f"cost_fn should be callable, got {cost_fn!r}")
    values = []
    for i in range(n):
        c = cost_fn(i)
        try:
            values.append(float(c))
        except (TypeError, ValueError):
            raise ConfigError(f"cost_fn({i}) should return a number, got {c!r}") from None
    return torch.tensor(values, dtype=torch.float64)


def _given_costs(n: int, costs: Costs) -> torch.Tensor:
    if isinstance(costs, torch.Tensor) and costs.is_complex():
        raise ConfigError(f"costs should be real numbers, got a {costs.dtype} tensor")
    try:
        if isinstance(costs, torch.Tensor):
            t = costs.detach().to("cpu", torch.float64)
        else:  # not as_tensor's default float32: it would round the costs
            t = torch.as_tensor(costs, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"costs should be a sequence of numbers, got {type(costs).__name__} ({e})"
        ) from None
    if t.ndim != 1:
        raise ConfigError(f"costs should be one-dimensional, got shape {tuple(t.shape)}")
    if t.numel() != n:
        raise ConfigError(
            f"costs should have one entry per item, len(dataset) = {n}, got {t.numel()}"
        )
    return t


def _quantise(costs: torch.Tensor | None) -> torch.Tensor | None:
    """Costs as int64 multiples of ``max(costs) / 2**bits``; ``None`` if all are zero.

    Integers make every later step exact: sums do not depend on their order, so ranks with
    different thread counts still compute the same plan.
    """
    if costs is None or costs.numel() == 0:
        return None
    top = float(costs.max())
    if top == 0.0:
        return None
    bits = min(_MAX_BITS, _SUM_BITS - costs.numel().bit_length())
    # Divide first (the ratio is <= 1), then scale by a power of two: no overflow.
    return torch.round(costs / top * 2.0**bits).to(torch.int64)


class _SkipEmpty:
    """Collate function that maps an empty batch to ``None`` (picklable, for workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) == 0:
            return None
        return self.collate_fn(batch)


# -- shared by both samplers --------------------------------------------------------------------
class _CostSplit:
    """Validated arguments, epochs and the seeded shuffle, shared by both samplers."""

    def _configure(
        self,
        dataset: Sized,
        num_replicas: int | None,
        rank: int | None,
        costs: Costs | None,
        cost_fn: Callable[[int], float] | None,
        shuffle: bool,
        seed: int,
    ) -> None:
        self._n = _length(dataset)
        self._num_replicas, self._rank = _world(num_replicas, rank)
        self._costs = _cost_tensor(self._n, costs, cost_fn)
        self._q = _quantise(self._costs)
        self._shuffle = bool(shuffle)
        self._seed = _as_int("seed", seed)
        self._epoch = 0
        w = self._num_replicas
        if self._n == 0:
            self._lower_bound = 0.0
        elif self._costs is None:
            self._lower_bound = max(self._n / w, 1.0)
        else:
            self._lower_bound = max(float(self._costs.sum()) / w, float(self._costs.max()))

    @property
    def num_replicas(self) -> int:
        """Number of ranks the dataset is split across."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """The rank whose share this sampler yields."""
        return self._rank

    @property
    def epoch(self) -> int:
        """The epoch set by :meth:`set_epoch` (0 until then)."""
        return self._epoch

    @property
    def lower_bound(self) -> float:
        """``max(sum(costs) / num_replicas, max(costs))``: no split can beat it (0.0 if empty).

        Without costs every item costs 1.
        """
        return self._lower_bound

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` it changes the order (seeded by seed + epoch).

        Call it on every rank with the same value before each epoch, as with torch's
        :class:`~torch.utils.data.DistributedSampler`.

        Raises:
            ConfigError: ``epoch`` is not an int.
        """
        self._epoch = _as_int("epoch", epoch)

    def _shuffled(self) -> tuple[torch.Tensor, torch.Generator | None]:
        """The epoch's order of items (the "key order") and the generator that drew it."""
        if not self._shuffle:
            return torch.arange(self._n), None
        # A private generator: the global RNG (and so the user's other random draws) is
        # never touched. Seeding matches torch's DistributedSampler.
        g = torch.Generator()
        g.manual_seed(self._seed + self._epoch)
        return torch.randperm(self._n, generator=g), g

    def _sorted_by_cost(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key positions ordered by cost, largest first (ties: key order), and those costs.

        The order compares the top 31 bits of the quantised costs only: an ascending
        stable int32 sort is about three times as fast as a descending int64 one, and
        costs closer than ``max(costs) * 2**-31`` are as good as tied for grouping.
        """
        if self._q is None:
            return torch.arange(self._n), torch.ones(self._n, dtype=torch.int64)
        q_key = self._q[key]
        shift = max(0, int(q_key.max()).bit_length() - 31)
        rank_key = ((1 << 31) - 1 - (q_key >> shift)).to(torch.int32)
        pos = torch.argsort(rank_key, stable=True)
        return pos, q_key[pos]

    def _cost_weights(self, items: torch.Tensor) -> torch.Tensor | None:
        """Real costs of ``items`` (``None``: unit costs, for ``bincount``'s weights)."""
        return None if self._costs is None else self._costs[items]


def _bin_costs(bins: torch.Tensor, weights: torch.Tensor | None, size: int) -> torch.Tensor:
    return torch.bincount(bins, weights=weights, minlength=size).to(torch.float64)


# -- the balanced split -------------------------------------------------------------------------
def _top(q: torch.Tensor, m: int) -> torch.Tensor:
    """Positions of the ``m`` largest entries, largest first (ties: lower position first)."""
    if m == 0:
        return torch.empty(0, dtype=torch.int64)
    v = int(torch.topk(q, m, sorted=True).values[-1])
    above = (q > v).nonzero().flatten()
    ties = (q == v).nonzero().flatten()[: m - above.numel()]
    pos = torch.cat([above, ties]).sort().values
    return pos[torch.argsort(q[pos], descending=True, stable=True)]


def _lpt(sizes: list[int], loads: list[int]) -> list[int]:
    """Longest processing time first: each item (largest first) to the least loaded bin.

    ``loads`` is updated in place; ties go to the lower bin.
    """
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    out = []
    for c in sizes:
        load, b = heap[0]
        heapq.heapreplace(heap, (load + c, b))
        out.append(b)
    for load, b in heap:
        loads[b] = load
    return out


def _water_fill(sizes: torch.Tensor, loads: list[int]) -> torch.Tensor:
    """Bins for ``sizes`` (int64, in the order given) that raise the lowest loads to one level.

    The level ``lam`` solves ``sum_b max(0, lam - loads[b]) = sum(sizes)``; the bins below it
    take consecutive runs of items, cut where the running sum of sizes crosses each bin's
    deficit (an item goes where its midpoint falls). A bin thus ends within one item of
    ``lam <= sum(all loads) / len(loads)``. ``loads`` is updated in place.
    """
    total = int(sizes.sum())
    order = sorted(range(len(loads)), key=lambda b: (loads[b], b))
    k, prefix, running = 1, loads[order[0]], 0
    for j, b in enumerate(order, start=1):
        running += loads[b]
        # The level with the j lowest bins filled must reach the j-th lowest load; once it
        # does not, it never does again for a larger j.
        if total + running < j * loads[b]:
            break
        k, prefix = j, running
    level, rem = divmod(total + prefix, k)
    deficits = [level - loads[b] + (1 if j < rem else 0) for j, b in enumerate(order[:k])]
    bounds2 = torch.tensor(deficits, dtype=torch.int64).cumsum(0) * 2
    ends = sizes.cumsum(0)
    slot = torch.searchsorted(bounds2, 2 * ends - sizes, right=True).clamp_(max=k - 1)
    added = torch.zeros(k, dtype=torch.int64).index_add_(0, slot, sizes).tolist()
    for j, b in enumerate(order[:k]):
        loads[b] += added[j]
    return torch.tensor(order[:k], dtype=torch.int64)[slot]


def _balanced_owner(q: torch.Tensor, w: int) -> torch.Tensor:
    """Rank of each item (int64 costs ``q``, in key order) minimising the largest load."""
    n = q.numel()
    owner = torch.empty(n, dtype=torch.int64)
    positive = q > 0
    n_pos = int(positive.sum())
    total = int(q.sum())
    big = int((q > total // (w * _HEAD_SHARE)).sum())
    m = min(n_pos, max(min(big, _HEAD_CAP), _HEAD_PER_RANK * w))
    loads = [0] * w
    head = _top(q, m)
    owner[head] = torch.tensor(_lpt(q[head].tolist(), loads), dtype=torch.int64)
    rest = positive.clone()
    rest[head] = False
    tail = rest.nonzero().flatten()
    if tail.numel():
        owner[tail] = _water_fill(q[tail], loads)
    zeros = (~positive).nonzero().flatten()
    if zeros.numel():
        # Free items are spread by count, so that no rank gets all of them.
        counts = torch.bincount(owner[positive], minlength=w).tolist()
        owner[zeros] = _water_fill(torch.ones(zeros.numel(), dtype=torch.int64), counts)
    return owner


class _Plan(NamedTuple):
    epoch: int
    key: torch.Tensor  # the epoch's item order: ranks list their items in this order
    owner: torch.Tensor | None  # rank of the item at each key position; None: strided


class BalancedDistributedSampler(_CostSplit, Sampler[int]):
    """Split a dataset across ranks so that every rank gets about the same total cost.

    Each item has a cost (e.g. its number of tokens, or a measured time); the split
    minimises the largest per-rank total against the bound ``max(sum / num_replicas,
    max cost)``, by exact LPT (largest item first to the least loaded rank) on the large
    items and a vectorised water-filling of the small ones: a rank's total exceeds
    ``sum / num_replicas`` by at most one item. The plan for 10 million items takes a few
    seconds on two cores. Without costs every item costs 1 and the split is torch's
    strided one: rank ``r`` gets positions ``r, r + num_replicas, ...`` of the (optionally
    shuffled) order, so counts differ by at most one.

    Every rank must be built with the same arguments; it yields its own share, each item
    once across all ranks, in ascending index order (``shuffle=False``) or in the epoch's
    shuffled order. Nothing is communicated; the plan is computed on first use in an epoch
    and cached.

    Note:
        Unlike :class:`torch.utils.data.DistributedSampler` it never pads and never drops:
        no item is seen twice, so metrics are never computed on duplicates. Ranks may
        therefore get different *counts* of items. That is right for a loop without
        per-batch collectives (inference, evaluation with one final all-reduce); for a loop
        that synchronises every step use :class:`LockstepBatchSampler`.

    Example::

        lengths = [len(doc) for doc in dataset]
        sampler = rd.BalancedDistributedSampler(dataset, costs=lengths)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...
        print(sampler.balance)  # largest predicted rank load / lower bound, e.g. 1.001

    Args:
        dataset: Anything with a length; only ``len(dataset)`` is used.
        num_replicas: Number of ranks (default: the world size of the initialized default
            process group).
        rank: This rank, in ``[0, num_replicas - 1]`` (default: the process group's rank).
        costs: One finite cost >= 0 per item (a sequence or a 1-D tensor). Units do not
            matter, only ratios. The plan rounds costs to multiples of ``max(costs) / 2**k``
            (``k`` = 52 for small datasets, 36 for 10 million items), so a cost below half
            of that counts as 0; items of cost 0 are spread by count.
        cost_fn: Called as ``cost_fn(index)`` once per item at construction instead of
            ``costs``: one Python call per item, so pass ``costs`` for large datasets. It
            must return the same values on every rank.
        shuffle: Shuffle with a private generator seeded with ``seed + epoch``; ties
            between equal costs and the order within a rank follow that shuffle.
        seed: Shuffle seed; must be the same on every rank.

    Raises:
        ConfigError: An argument is invalid (the message names it, its value and the
            allowed range), both ``costs`` and ``cost_fn`` were given, or ``num_replicas``/
            ``rank`` were omitted while torch.distributed is not initialized.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        costs: Costs | None = None,
        cost_fn: Callable[[int], float] | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        self._configure(dataset, num_replicas, rank, costs, cost_fn, shuffle, seed)
        self._cache: _Plan | None = None

    def _plan(self) -> _Plan:
        if self._cache is None or self._cache.epoch != self._epoch:
            key, _ = self._shuffled()
            owner = None if self._q is None else _balanced_owner(self._q[key], self._num_replicas)
            self._cache = _Plan(self._epoch, key, owner)
        return self._cache

    def _indices(self, rank: int) -> torch.Tensor:
        p = self._plan()
        if p.owner is None:
            return p.key[rank :: self._num_replicas]
        return p.key[p.owner == rank]

    def plan(self) -> list[torch.Tensor]:
        """Every rank's indices (int64 tensors, in iteration order) for the current epoch."""
        p = self._plan()
        w = self._num_replicas
        if p.owner is None:
            return [p.key[r::w].clone() for r in range(w)]
        by_rank = torch.argsort(p.owner, stable=True)
        counts = torch.bincount(p.owner, minlength=w).tolist()
        return [t.clone() for t in torch.split(p.key[by_rank], counts)]

    @property
    def loads(self) -> torch.Tensor:
        """Predicted total cost of each rank (float64 tensor of ``num_replicas`` entries)."""
        p = self._plan()
        w = self._num_replicas
        owner = torch.arange(self._n) % w if p.owner is None else p.owner
        return _bin_costs(owner, self._cost_weights(p.key), w)

    @property
    def balance(self) -> float:
        """Largest rank load over :attr:`lower_bound` (1.0 is perfect; 1.0 when empty)."""
        if self._lower_bound == 0.0:
            return 1.0
        return float(self.loads.max()) / self._lower_bound

    def __iter__(self) -> Iterator[int]:
        global _balanced_iterated
        _balanced_iterated = True
        return iter(self._indices(self._rank).tolist())

    def __len__(self) -> int:
        """Number of items this rank yields in the current epoch."""
        if self._q is None:
            return len(range(self._rank, self._n, self._num_replicas))
        return int(self._indices(self._rank).numel())


# Whether a BalancedDistributedSampler was iterated in this process: a training rank that
# then leaves its group while its peers still run collectives is told which samplers train
# (see _runtime._sampler_hint).
_balanced_iterated = False


def balanced_iterated() -> bool:
    """Whether a :class:`BalancedDistributedSampler` was iterated in this process."""
    return _balanced_iterated


# -- the lockstep split -------------------------------------------------------------------------
def _lockstep_owner(
    q_sorted: torch.Tensor, w: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank and step of each item (int64 costs, largest first); and the number of steps.

    The minimal number of steps ``S = ceil(n / (w * batch_size))`` is used, and each step
    takes a consecutive run of the sorted items: the heavy items share the front steps, so
    that a rank with a large item waits for other ranks with large items, not for nothing.
    Two ways to size the runs are tried (:func:`_step_sizes`) and the one with the smaller
    sum over steps of the slowest rank is kept.
    """
    n = q_sorted.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, 0
    steps = -(-n // (w * batch_size))
    best: tuple[int, torch.Tensor, torch.Tensor] | None = None
    for whole_rows in (True, False) if batch_size > 1 else (True,):
        sizes = _step_sizes(n, w, batch_size, steps, whole_rows=whole_rows)
        cost, owner = _split_steps(q_sorted, w, batch_size, sizes)
        if best is None or cost < best[0]:
            best = (cost, owner, sizes)
    _, owner, sizes = best  # type: ignore[misc]
    step = torch.searchsorted(sizes.cumsum(0), torch.arange(n), right=True)
    return owner, step, steps


def _step_sizes(n: int, w: int, batch_size: int, steps: int, *, whole_rows: bool) -> torch.Tensor:
    """Items per step, at most ``w * batch_size``; at least ``w`` when ``n >= w * steps``.

    ``whole_rows``: steps of whole rows of ``w`` items, as even as possible, so that every
    rank gets the same number of items in a step and a step of items of similar cost is
    balanced; the ``n % w`` items left over form one partial row in the last step with
    room. Otherwise: sizes as even as possible (they differ by at most one), which spreads
    the free slots over all steps. The smaller steps are the front ones when
    ``batch_size > 1``: they hold the largest items, and free slots let a rank with a very
    large item take fewer items. With ``batch_size == 1`` a step costs its largest item,
    which full front steps minimise.
    """
    unit, total = (w, n // w) if whole_rows else (1, n)
    base, extra = divmod(total, steps)
    per_step = torch.full((steps,), base, dtype=torch.int64)
    if batch_size == 1:
        per_step[:extra] += 1
    else:
        per_step[steps - extra :] += 1
    sizes = per_step * unit
    if whole_rows and n % w:
        room = (per_step < batch_size).nonzero()
        sizes[int(room[-1])] += n % w
    return sizes


def _split_steps(
    q_sorted: torch.Tensor, w: int, batch_size: int, sizes: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """Split each step's run across the ranks; the sum over steps of the slowest, and ranks.

    Within a step, round ``j`` deals its ``w`` items, largest first, to the ranks in
    ascending order of their load in that step: LPT with at most ``batch_size`` items per
    rank, vectorised across all steps. That forces every rank to take one item per round,
    also a rank that already holds a very large item; so the steps whose items differ most
    are also split by exact capacity-constrained LPT (:func:`_capacity_lpt`), which lets
    such a rank take fewer items, and the better split of each step is kept.
    """
    n, steps = q_sorted.numel(), sizes.numel()
    ends = sizes.cumsum(0)
    starts = ends - sizes
    ranks = torch.arange(w)
    # Ties between equal loads go to a rank that rotates with the step, so that no rank is
    # always the one that gets an extra item.
    rotation = (ranks[None, :] + torch.arange(steps)[:, None]) % w
    loads = torch.zeros(steps, w, dtype=torch.int64)
    owner = torch.empty(n, dtype=torch.int64)
    for j in range(-(-int(sizes.max()) // w)):
        p = j * w + ranks
        valid = p[None, :] < sizes[:, None]
        g = torch.where(valid, starts[:, None] + p[None, :], 0)
        c = torch.where(valid, q_sorted[g], 0)
        by_load = rotation.gather(1, torch.argsort(loads.gather(1, rotation), dim=1, stable=True))
        loads.scatter_add_(1, by_load, c)
        owner[g[valid]] = by_load[valid]
    slowest = loads.max(dim=1).values
    if batch_size == 1:  # one item per rank and step: both splits are the same
        return int(slowest.sum()), owner
    # Widest cost range first, at most _LOCKSTEP_EXACT items in all through the Python loop.
    chosen = torch.argsort(q_sorted[starts] - q_sorted[ends - 1], descending=True, stable=True)
    fits = sizes[chosen].cumsum(0) <= _LOCKSTEP_EXACT
    for s in chosen[fits].tolist():
        a, z = int(starts[s]), int(ends[s])
        exact, worst = _capacity_lpt(q_sorted[a:z].tolist(), w, batch_size, s)
        if worst < int(slowest[s]):
            owner[a:z] = torch.tensor(exact, dtype=torch.int64)
            slowest[s] = worst
    return int(slowest.sum()), owner


def _capacity_lpt(sizes: list[int], w: int, capacity: int, turn: int) -> tuple[list[int], int]:
    """LPT with at most ``capacity`` items per bin; the bins and the largest final load.

    Ties go to the bin with fewer items (so the first ``w`` items land in distinct bins,
    zero-cost ones too), then to bin ``turn``, ``turn + 1``, ... (mod ``w``).
    """
    heap = [(0, 0, k) for k in range(w)]
    out, worst = [], 0
    for c in sizes:
        load, count, k = heapq.heappop(heap)
        load += c
        worst = max(worst, load)
        if count + 1 < capacity:
            heapq.heappush(heap, (load, count + 1, k))
        out.append((k + turn) % w)
    return out, worst


def _split(items: list[int], counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for c in counts:
        out.append(items[start : start + c])
        start += c
    return out


class _LockstepPlan(NamedTuple):
    epoch: int
    key: torch.Tensor  # the epoch's item order
    pos: torch.Tensor  # key positions, sorted by cost (largest first)
    owner: torch.Tensor  # rank of the item at each entry of pos
    step: torch.Tensor  # step (in yield order) of the item at each entry of pos
    steps: int


class LockstepBatchSampler(_CostSplit, Sampler[list[int]]):
    """Batches for a loop that synchronises every step: equal step counts, balanced steps.

    Every rank yields the same number of batches ``S = ceil(len(dataset) / (num_replicas *
    batch_size))`` (the fewest possible), each of at most ``batch_size`` indices, and every
    index appears exactly once across all ranks and steps: no padding, no duplicates. A
    step costs what its slowest rank's batch costs, so the split minimises the sum over
    steps of the largest batch cost: items are sorted by cost, each step takes a run of
    items of similar cost (the large items share the front steps, so a rank with a large
    item waits for other large items), and within a step the batches are balanced by LPT
    with at most ``batch_size`` items per rank, which lets a rank with a very large item
    take fewer items where the step has room. Nothing is communicated; the plan is
    computed on first use in an epoch and cached. Within a batch indices are ascending
    (``shuffle=False``) or in the epoch's shuffled order; with ``shuffle=True`` the order of
    the steps is shuffled too, but a batch still holds items of similar cost (like
    bucketing by length).

    A rank's batch may be smaller than ``batch_size``, or empty (``[]``) when that cannot be
    avoided: only when ``len(dataset) < num_replicas * S``, so that some step has fewer
    items than ranks (e.g. ``len(dataset) < num_replicas``, or a length that is not a
    multiple of ``num_replicas`` with ``batch_size=1``). An empty or
    ``None`` step must still take part in the step's collectives (run the forward on an
    empty batch, or join with a zero contribution), or the other ranks will wait for it.
    :meth:`collate` maps an empty batch to ``None``::

        sampler = rd.LockstepBatchSampler(dataset, batch_size=32, costs=lengths)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=sampler.collate())
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                if batch is None:
                    ...  # nothing to compute here, but join the step's collectives
                else:
                    ...

    Args:
        dataset: Anything with a length; only ``len(dataset)`` is used.
        batch_size: Largest number of indices in one batch (>= 1).
        num_replicas: Number of ranks (default: the initialized process group's size).
        rank: This rank, in ``[0, num_replicas - 1]`` (default: the process group's rank).
        costs: One finite cost >= 0 per item (sequence or 1-D tensor); units do not matter.
        cost_fn: ``cost_fn(index)`` called once per item at construction (a Python call per
            item: pass ``costs`` for large datasets). Not together with ``costs``.
        shuffle: Shuffle ties, batches' contents order and steps with a private generator
            seeded with ``seed + epoch``.
        seed: Shuffle seed; must be the same on every rank.

    Raises:
        ConfigError: An argument is invalid (the message names it, its value and the
            allowed range), both ``costs`` and ``cost_fn`` were given, or ``num_replicas``/
            ``rank`` were omitted while torch.distributed is not initialized.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        costs: Costs | None = None,
        cost_fn: Callable[[int], float] | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        self._batch_size = _as_int("batch_size", batch_size)
        if self._batch_size < 1:
            raise ConfigError(f"batch_size should be >= 1, got {self._batch_size}")
        self._configure(dataset, num_replicas, rank, costs, cost_fn, shuffle, seed)
        self._steps = -(-self._n // (self._num_replicas * self._batch_size))
        self._cache: _LockstepPlan | None = None

    @property
    def batch_size(self) -> int:
        """Largest number of indices in one batch."""
        return self._batch_size

    @staticmethod
    def collate(
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Callable[[list[Any]], Any]:
        """A collate function for ``DataLoader(batch_sampler=...)`` that maps ``[]`` to ``None``.

        ``default_collate([])`` raises, and a rank may get an empty batch. Other batches go
        to ``collate_fn`` (default :func:`torch.utils.data.default_collate`). The result can
        be pickled when ``collate_fn`` can (DataLoader workers).
        """
        return _SkipEmpty(default_collate if collate_fn is None else collate_fn)

    def _plan(self) -> _LockstepPlan:
        if self._cache is None or self._cache.epoch != self._epoch:
            key, g = self._shuffled()
            pos, q_sorted = self._sorted_by_cost(key)
            owner, step, steps = _lockstep_owner(q_sorted, self._num_replicas, self._batch_size)
            if g is not None and steps > 1:
                # Step s is yielded at position place[s]: heavy steps are not always first.
                place = torch.empty(steps, dtype=torch.int64)
                place[torch.randperm(steps, generator=g)] = torch.arange(steps)
                step = place[step]
            self._cache = _LockstepPlan(self._epoch, key, pos, owner, step, steps)
        return self._cache

    def _rank_batches(self, rank: int) -> list[list[int]]:
        p = self._plan()
        mine = p.owner == rank
        return _split(*self._grouped(p, p.pos[mine], p.step[mine], p.steps))

    def _grouped(
        self, p: _LockstepPlan, pos: torch.Tensor, group: torch.Tensor, groups: int
    ) -> tuple[list[int], list[int]]:
        """Items at key positions ``pos`` sorted by (group, key order), and the group sizes."""
        order = torch.argsort(group * max(self._n, 1) + pos)
        counts = torch.bincount(group, minlength=groups).tolist()
        return p.key[pos[order]].tolist(), counts

    def plan(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: ``plan()[rank][step]`` lists indices."""
        p = self._plan()
        w, steps = self._num_replicas, p.steps
        # One sort of everything by (rank, step, key order); the key fits int64 for any
        # dataset that fits in memory (w * steps * n is about n**2 / batch_size).
        batches = _split(*self._grouped(p, p.pos, p.owner * steps + p.step, w * steps))
        return [batches[r * steps : (r + 1) * steps] for r in range(w)]

    @property
    def step_costs(self) -> torch.Tensor:
        """Predicted cost of every batch: float64 tensor of shape ``(len(self), num_replicas)``."""
        p = self._plan()
        w = self._num_replicas
        flat = _bin_costs(p.step * w + p.owner, self._cost_weights(p.key[p.pos]), p.steps * w)
        return flat.view(p.steps, w)

    @property
    def balance(self) -> float:
        """Sum over steps of the largest batch cost, over :attr:`lower_bound` (1.0 if empty)."""
        if self._lower_bound == 0.0:
            return 1.0
        return float(self.step_costs.max(dim=1).values.sum()) / self._lower_bound

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._rank_batches(self._rank))

    def __len__(self) -> int:
        """Number of batches, the same on every rank."""
        return self._steps
