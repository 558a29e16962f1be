"""BalancedDistributedSampler and LockstepBatchSampler: coverage, determinism, balance, errors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient_ddp.errors import ConfigError
from resilient_ddp.inference.sampler import BalancedDistributedSampler, LockstepBatchSampler

BENCH_BATCH_SIZE = 8  # benchmarks/bench_sampler.py's lockstep batch size

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _with_outliers(c: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if c.numel():
        c[torch.randint(0, c.numel(), (3,), generator=g)] *= 1e9
    return c


def _sparse(n: int, g: torch.Generator) -> torch.Tensor:
    c = torch.zeros(n, dtype=torch.float64)
    if n:
        c[torch.randint(0, n, (max(1, n // 20),), generator=g)] = 5.0
    return c


COST_MAKERS: dict[str, Callable[[int, torch.Generator], torch.Tensor]] = {
    "uniform": lambda n, g: torch.rand(n, generator=g, dtype=torch.float64) * 10,
    # many ties and zeros
    "small_ints": lambda n, g: torch.randint(0, 4, (n,), generator=g).to(torch.float64),
    "outliers": lambda n, g: _with_outliers(
        torch.empty(n, dtype=torch.float64).log_normal_(0.0, 1.0, generator=g), g
    ),
    "all_zero": lambda n, g: torch.zeros(n, dtype=torch.float64),
    "mostly_zero": _sparse,
    # many orders of magnitude, some below the quantisation step
    "tiny": lambda n, g: torch.rand(n, generator=g, dtype=torch.float64) ** 30,
}
COST_KINDS = ("none", *COST_MAKERS)


def make_costs(kind: str, n: int, seed: int) -> torch.Tensor | None:
    """Costs of one kind, drawn from a private generator (the global RNG stays untouched)."""
    if kind == "none":
        return None
    return COST_MAKERS[kind](n, torch.Generator().manual_seed(seed))


def lognormal(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n, dtype=torch.float64).log_normal_(0.0, 1.0, generator=g)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(0, 400))
    return {
        "n": n,
        "w": draw(st.integers(1, 80)),
        "costs": make_costs(draw(st.sampled_from(COST_KINDS)), n, draw(st.integers(0, 2**16))),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(-(2**31), 2**31)),
        "epoch": draw(st.integers(0, 1000)),
    }


def balanced(p: dict[str, object], rank: int = 0) -> BalancedDistributedSampler:
    s = BalancedDistributedSampler(
        range(p["n"]),  # type: ignore[arg-type]
        p["w"],  # type: ignore[arg-type]
        rank,
        costs=p["costs"],  # type: ignore[arg-type]
        shuffle=p["shuffle"],  # type: ignore[arg-type]
        seed=p["seed"],  # type: ignore[arg-type]
    )
    s.set_epoch(p["epoch"])  # type: ignore[arg-type]
    return s


def lockstep(p: dict[str, object], batch_size: int, rank: int = 0) -> LockstepBatchSampler:
    s = LockstepBatchSampler(
        range(p["n"]),  # type: ignore[arg-type]
        batch_size,
        p["w"],  # type: ignore[arg-type]
        rank,
        costs=p["costs"],  # type: ignore[arg-type]
        shuffle=p["shuffle"],  # type: ignore[arg-type]
        seed=p["seed"],  # type: ignore[arg-type]
    )
    s.set_epoch(p["epoch"])  # type: ignore[arg-type]
    return s


def some_ranks(w: int) -> list[int]:
    return sorted({0, w // 2, w - 1})


def shuffled_position(p: dict[str, object]) -> torch.Tensor:
    """Position of every index in the epoch's shuffled order (torch's seeding)."""
    n = p["n"]
    g = torch.Generator().manual_seed(p["seed"] + p["epoch"])  # type: ignore[operator]
    perm = torch.randperm(n, generator=g)  # type: ignore[arg-type]
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(n)  # type: ignore[arg-type]
    return pos


@pytest.fixture
def global_rng_untouched() -> Iterator[None]:
    state = torch.get_rng_state()
    yield
    assert torch.equal(torch.get_rng_state(), state), "the global torch RNG was used"


# -- BalancedDistributedSampler -----------------------------------------------------------------
@SETTINGS
@given(problems())
def test_balanced_covers_every_index_once_and_is_deterministic(p: dict[str, object]) -> None:
    n, w = p["n"], p["w"]
    rng = torch.get_rng_state()
    s = balanced(p)
    plan = s.plan()
    assert len(plan) == w
    assert all(t.dtype == torch.int64 for t in plan)
    assert torch.cat(plan).sort().values.tolist() == list(range(n))  # type: ignore[arg-type]
    assert [t.tolist() for t in balanced(p).plan()] == [t.tolist() for t in plan]
    for r in some_ranks(w):  # type: ignore[arg-type]
        sr = balanced(p, rank=r)
        assert list(sr) == plan[r].tolist()
        assert len(sr) == plan[r].numel()
        assert sr.rank == r
    assert torch.equal(torch.get_rng_state(), rng)

    # Order within a rank: ascending index, or the shuffled order.
    key = shuffled_position(p) if p["shuffle"] else torch.arange(n)  # type: ignore[arg-type]
    for t in plan:
        assert bool((key[t].diff() > 0).all())

    # Predicted loads match the plan, and obey the LPT / water-filling bound.
    costs = p["costs"]
    real = torch.ones(n) if costs is None else costs  # type: ignore[arg-type]
    loads = s.loads
    assert loads.dtype == torch.float64
    assert loads.shape == (w,)
    for r, t in enumerate(plan):
        assert math.isclose(float(loads[r]), float(real[t].sum()), rel_tol=1e-9, abs_tol=1e-9)
    if n:
        total, top = float(real.sum()), float(real.max())
        assert float(loads.max()) <= (total / w + top) * (1 + 1e-9) + 1e-12  # type: ignore[operator]
        assert s.lower_bound == pytest.approx(max(total / w, top))  # type: ignore[operator]
        assert s.balance >= 1.0 - 1e-9
    else:
        assert s.lower_bound == 0.0
        assert s.balance == 1.0


@SETTINGS
@given(problems())
def test_balanced_without_costs_is_torchs_strided_split(p: dict[str, object]) -> None:
    p = {**p, "costs": None}
    n, w = p["n"], p["w"]
    plan = balanced(p).plan()
    key = torch.randperm(n, generator=torch.Generator().manual_seed(p["seed"] + p["epoch"]))  # type: ignore[operator, arg-type]
    if not p["shuffle"]:
        key = torch.arange(n)  # type: ignore[arg-type]
    for r, t in enumerate(plan):
        assert t.tolist() == key[r::w].tolist()
    counts = [t.numel() for t in plan]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=25, deadline=None)
@given(problems())
def test_all_zero_costs_behave_like_no_costs(p: dict[str, object]) -> None:
    zero = {**p, "costs": torch.zeros(p["n"], dtype=torch.float64)}  # type: ignore[arg-type]
    none = {**p, "costs": None}
    assert [t.tolist() for t in balanced(zero).plan()] == [
        t.tolist() for t in balanced(none).plan()
    ]
    assert balanced(zero).balance == 1.0
    assert lockstep(zero, 3).plan() == lockstep(none, 3).plan()


@settings(max_examples=25, deadline=None)
@given(problems())
def test_shuffle_epoch_changes_order_but_keeps_coverage(p: dict[str, object]) -> None:
    p = {**p, "shuffle": True}
    s = balanced(p)
    first = [t.tolist() for t in s.plan()]
    s.set_epoch(p["epoch"] + 1)  # type: ignore[operator]
    assert s.epoch == p["epoch"] + 1  # type: ignore[operator]
    second = [t.tolist() for t in s.plan()]
    assert sorted(i for t in second for i in t) == list(range(p["n"]))  # type: ignore[arg-type]
    if p["n"] >= 20 and p["costs"] is None:  # type: ignore[operator]
        assert first != second
    ls = lockstep(p, 4)
    ls.set_epoch(p["epoch"] + 1)  # type: ignore[operator]
    assert sorted(i for r in ls.plan() for b in r for i in b) == list(range(p["n"]))  # type: ignore[arg-type]


def test_zero_cost_items_are_spread_by_count() -> None:
    costs = [0.0] * 1000 + [1.0] * 8
    plan = BalancedDistributedSampler(range(1008), 8, 0, costs=costs).plan()
    assert [t.numel() for t in plan] == [126] * 8


def test_cost_fn_equals_costs() -> None:
    costs = [float((i * 7) % 11) for i in range(100)]
    a = BalancedDistributedSampler(range(100), 4, 1, costs=costs).plan()
    b = BalancedDistributedSampler(range(100), 4, 1, cost_fn=lambda i: costs[i]).plan()
    c = BalancedDistributedSampler(range(100), 4, 1, costs=torch.tensor(costs)).plan()
    assert [t.tolist() for t in a] == [t.tolist() for t in b] == [t.tolist() for t in c]


def test_plan_does_not_depend_on_thread_count() -> None:
    costs = lognormal(20_000, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = BalancedDistributedSampler(range(20_000), 8, 0, costs=costs, shuffle=True).plan()
        one_ls = LockstepBatchSampler(range(20_000), 8, 8, 0, costs=costs).plan()
    finally:
        torch.set_num_threads(threads)
    many = BalancedDistributedSampler(range(20_000), 8, 0, costs=costs, shuffle=True).plan()
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    assert one_ls == LockstepBatchSampler(range(20_000), 8, 8, 0, costs=costs).plan()


def test_global_rng_untouched_while_shuffling(global_rng_untouched: None) -> None:
    costs = lognormal(500)
    for shuffle in (False, True):
        s = BalancedDistributedSampler(range(500), 4, 2, costs=costs, shuffle=shuffle, seed=5)
        s.set_epoch(3)
        list(s)
        ls = LockstepBatchSampler(range(500), 4, 4, 2, costs=costs, shuffle=shuffle, seed=5)
        ls.set_epoch(3)
        list(ls)
        ls.plan()


def torch_load_ratio(costs: torch.Tensor, w: int) -> float:
    """Largest per-rank cost under torch's DistributedSampler (padding included) / LB."""
    n = costs.numel()
    lb = max(float(costs.sum()) / w, float(costs.max()))
    loads = [float(costs[list(DistributedSampler(range(n), w, r))].sum()) for r in range(w)]
    return max(loads) / lb


@pytest.mark.parametrize("w", [2, 4, 8, 64])
def test_balanced_on_lognormal_costs(w: int) -> None:
    costs = lognormal(10_000)
    s = BalancedDistributedSampler(range(10_000), w, 0, costs=costs)
    assert s.balance <= 1.01
    assert s.lower_bound == pytest.approx(max(float(costs.sum()) / w, float(costs.max())))
    assert s.balance < torch_load_ratio(costs, w)


# -- LockstepBatchSampler -----------------------------------------------------------------------
@SETTINGS
@given(problems(), st.integers(1, 40))
def test_lockstep_properties(p: dict[str, object], batch_size: int) -> None:
    n, w = p["n"], p["w"]
    rng = torch.get_rng_state()
    s = lockstep(p, batch_size)
    steps = -(-n // (w * batch_size))  # type: ignore[operator]
    assert len(s) == steps
    assert s.batch_size == batch_size
    plan = s.plan()
    assert len(plan) == w
    assert all(len(r) == steps for r in plan)
    assert all(len(b) <= batch_size for r in plan for b in r)
    assert sorted(i for r in plan for b in r for i in b) == list(range(n))  # type: ignore[arg-type]
    if n >= w * steps:  # type: ignore[operator]
        assert all(len(b) >= 1 for r in plan for b in r), "avoidable empty batch"
    assert lockstep(p, batch_size).plan() == plan
    for r in some_ranks(w):  # type: ignore[arg-type]
        sr = lockstep(p, batch_size, rank=r)
        assert len(sr) == steps
        assert list(sr) == plan[r]
    assert torch.equal(torch.get_rng_state(), rng)

    key = shuffled_position(p) if p["shuffle"] else torch.arange(n)  # type: ignore[arg-type]
    for r in plan:
        for b in r:
            assert bool((key[b].diff() > 0).all())

    costs = p["costs"]
    real = torch.ones(n) if costs is None else costs  # type: ignore[arg-type]
    sc = s.step_costs
    assert sc.shape == (steps, w)
    assert sc.dtype == torch.float64
    for r in range(w):  # type: ignore[call-overload]
        for k in range(steps):
            expected = float(real[plan[r][k]].sum())
            assert math.isclose(float(sc[k, r]), expected, rel_tol=1e-9, abs_tol=1e-9)
    if s.lower_bound > 0:
        assert s.balance == pytest.approx(float(sc.max(dim=1).values.sum()) / s.lower_bound)
    else:
        assert s.balance == 1.0


def lockstep_torch_ratio(costs: torch.Tensor, w: int, batch_size: int) -> float:
    """Sum over steps of the slowest rank's batch under torch's sampler, over the LB."""
    n = costs.numel()
    lb = max(float(costs.sum()) / w, float(costs.max()))
    per_rank = [costs[list(DistributedSampler(range(n), w, r))] for r in range(w)]
    total = 0.0
    for start in range(0, per_rank[0].numel(), batch_size):
        total += max(float(c[start : start + batch_size].sum()) for c in per_rank)
    return total / lb


def test_lockstep_on_lognormal_costs() -> None:
    costs = lognormal(10_000)
    s = LockstepBatchSampler(range(10_000), BENCH_BATCH_SIZE, 64, 0, costs=costs)
    assert len(s) == math.ceil(10_000 / (64 * BENCH_BATCH_SIZE))
    assert s.balance <= 1.10
    assert s.balance < lockstep_torch_ratio(costs, 64, BENCH_BATCH_SIZE)


def test_lockstep_with_a_dataloader_yields_none_for_empty_steps() -> None:
    data = TensorDataset(torch.arange(5.0), torch.arange(5) * 10)
    # 5 items, 4 ranks, batch size 1: 2 steps of 3 and 2 items: some ranks sit out a step.
    seen: list[int] = []
    nones = 0
    for r in range(4):
        sampler = LockstepBatchSampler(data, 1, 4, r)
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate())
        batches = list(loader)
        assert len(batches) == len(sampler) == 2
        for batch in batches:
            if batch is None:
                nones += 1
                continue
            x, y = batch
            assert isinstance(x, torch.Tensor)
            assert torch.equal(y, x.long() * 10)
            seen += x.long().tolist()
    assert sorted(seen) == list(range(5))
    assert nones == 3


def test_collate_passes_a_custom_function_and_pickles() -> None:
    import pickle

    fn = pickle.loads(pickle.dumps(LockstepBatchSampler.collate(len)))  # noqa: S301 (our own bytes)
    assert fn([]) is None
    assert fn([1, 2]) == 2


# -- defaults and errors ------------------------------------------------------------------------
def test_world_defaults_from_an_initialized_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = BalancedDistributedSampler(range(10))
    assert (s.num_replicas, s.rank) == (1, 0)
    assert LockstepBatchSampler(range(10), 4).num_replicas == 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_replicas": 4, "rank": 5}, ["rank", "[0, 3]", "5"]),
        ({"num_replicas": 4, "rank": -1}, ["rank", "[0, 3]", "-1"]),
        ({"num_replicas": 0, "rank": 0}, ["num_replicas", ">= 1", "0"]),
        ({"num_replicas": 2.5, "rank": 0}, ["num_replicas", "int", "2.5"]),
        ({"num_replicas": 2, "rank": 0, "costs": [1.0] * 9}, ["costs", "10", "9"]),
        ({"num_replicas": 2, "rank": 0, "costs": [1.0] * 8 + [-1.0, 2]}, ["costs[8]", "-1.0"]),
        (
            {"num_replicas": 2, "rank": 0, "costs": [1.0, math.nan] + [1.0] * 7 + [math.inf]},
            ["costs[1]", "nan"],
        ),
        ({"num_replicas": 2, "rank": 0, "costs": [[1.0] * 10]}, ["one-dimensional", "(1, 10)"]),
        ({"num_replicas": 2, "rank": 0, "costs": ["a"] * 10}, ["costs", "numbers"]),
        (
            {"num_replicas": 2, "rank": 0, "costs": [1.0] * 10, "cost_fn": float},
            ["costs or cost_fn"],
        ),
        ({"num_replicas": 2, "rank": 0, "cost_fn": lambda i: -i}, ["cost_fn(1)", "-1"]),
        ({"num_replicas": 2, "rank": 0, "cost_fn": lambda i: "x"}, ["cost_fn(0)", "'x'"]),
        ({"num_replicas": 2, "rank": 0, "seed": "1"}, ["seed", "'1'"]),
        ({"num_replicas": 2, "rank": 0, "costs": [1e308] * 10}, ["sum", "inf"]),
        ({}, ["num_replicas and rank", "not initialized", "num_replicas="]),
        ({"num_replicas": 2}, ["rank not given", "not initialized"]),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, object], words: list[str]) -> None:
    for make in (
        lambda: BalancedDistributedSampler(range(10), **kwargs),  # type: ignore[arg-type]
        lambda: LockstepBatchSampler(range(10), 2, **kwargs),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError) as info:
            make()
        assert isinstance(info.value, ValueError)
        for word in words:
            assert word in str(info.value)


def test_bad_batch_size_and_epoch() -> None:
    with pytest.raises(ConfigError, match=r"batch_size should be >= 1, got 0"):
        LockstepBatchSampler(range(10), 0, 2, 0)
    s = BalancedDistributedSampler(range(10), 2, 0)
    with pytest.raises(ConfigError, match=r"epoch should be an int, got 1.5"):
        s.set_epoch(1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Sized"):
        BalancedDistributedSampler(iter([]), 2, 0)  # type: ignore[arg-type]
