"""The preflight exchange with one checker: rank 0 reads every rank's facts once and
publishes the verdict, the other ranks read the verdict. Ranks are threads over one
HashStore, so W of them fit in one process.

Run as a script (``python -m tests.test_preflight_checker 1024``) it prints the bytes
start-up reads from the store at W ranks with facts of a realistic size.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.base import _clock
from resilient_ddp.control._control import PreflightKeys
from resilient_ddp.errors import PreflightError
from resilient_ddp.group import preflight
from resilient_ddp.group.preflight import Environment

from ._counting_store import CountingStore
from ._fake_runtime import backoff_waits

KEYS = PreflightKeys(0)  # attempt 0's start-up keys


class ByteCountingStore(CountingStore):
    """A :class:`CountingStore` that also adds up the bytes of the values it returns."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self.read_bytes = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = super().__getattr__(name)

        def call(*args: Any) -> Any:
            out = fn(*args)
            if name in ("get", "compare_set"):
                size = len(out)
            elif name == "multi_get":
                size = sum(len(v) for v in out)
            else:
                size = 0
            with self._lock:
                self.read_bytes += size
            return out

        return call

    def facts_read(self, restart: int = 0) -> int:
        """How many ranks' facts records were read (``get`` or ``multi_get``)."""

        def is_facts(key: str) -> bool:
            head, _, last = key.rpartition("/")
            return head == PreflightKeys(restart).prefix and last.isdigit()

        with self._lock:
            calls = list(self.calls)
        return sum(
            sum(map(is_facts, arg)) if name == "multi_get" else int(is_facts(arg))
            for name, arg in calls
            if name in ("get", "multi_get")
        )


def facts_of(rank: int) -> dict[str, str]:
    """Facts shaped like ``local_facts`` on an 8-GPU node (323 bytes of JSON)."""
    return {
        "host": f"gpu-node-{rank // 8:04d}.cluster.example.org",
        "pid": str(100000 + rank),
        "local_rank": str(rank % 8),
        "python": "3.11.9",
        "torch": "2.13.0+cu130",
        "cuda": "13.0",
        "nccl": "2.28.9",
        "backend": "nccl",
        "backend_ok": "yes",
        "host_free_gib": "1843.2",
        "device": f"cuda:{rank % 8}",
        "gpu": f"GPU-{rank:08x}-1a2b-3c4d-5e6f-{rank * 7919:012x}",
        "gpu_free_gib": "139.1",
    }


def env_of(rank: int, world: int, restart: int = 0) -> Environment:
    return Environment("127.0.0.1", 29500, rank, world, rank % 8, 8, restart, True)


def simulate(
    world: int,
    store: dist.Store,
    *,
    facts: Callable[[int], dict[str, str]] = facts_of,
    ranks: Sequence[int] | None = None,
    budget_s: float = 60.0,
    restart: int = 0,
) -> dict[int, Any]:
    """Run ``_exchange`` for ``ranks`` (default all ``world``), a thread each, over
    ``store``; each rank's returned table or raised :class:`PreflightError`."""
    ranks = list(range(world)) if ranks is None else list(ranks)
    deadline = time.monotonic() + budget_s

    def rank_main(r: int) -> Any:
        try:
            return preflight._exchange(store, env_of(r, world, restart), facts(r), deadline)
        except PreflightError as e:
            return e

    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {r: pool.submit(rank_main, r) for r in ranks}
        return {r: f.result(timeout=budget_s + 30) for r, f in futures.items()}


def _arrive(store: dist.Store, rank: int, facts: dict[str, str], restart: int = 0) -> None:
    keys = PreflightKeys(restart)
    store.set(keys.facts(rank), json.dumps(facts))
    store.add(keys.arrived, 1)


def _expected_message(rank: int, table: dict[int, dict[str, str]], world: int) -> str:
    """The message each rank raised before the checker, when it compared the facts itself."""
    problems = preflight.compare(table, world)
    return (
        f"Preflight found {len(problems)} problem(s) (rank {rank} reports):\n"
        + "\n".join(f"  - {p}" for p in problems)
        + "\n"
        + preflight.format_table(table)
    )


# -- the healthy path ------------------------------------------------------------------------
def test_the_facts_are_read_once_in_all_and_every_key_is_deleted() -> None:
    world = 24
    base = dist.HashStore()
    store = ByteCountingStore(base)
    results = simulate(world, store)  # type: ignore[arg-type]
    assert all(isinstance(v, dict) for v in results.values()), results
    # Once in all: rank 0 reads every rank's record, the others none (W^2 = 576 before).
    assert store.facts_read() == world
    assert results[0] == {r: facts_of(r) for r in range(world)}
    for r in range(1, world):
        assert results[r] == {r: facts_of(r)}
    # Rank 0's one read of the facts, and W small verdicts: well under one record a rank
    # more than the facts themselves.
    facts_bytes = sum(len(json.dumps(facts_of(r))) for r in range(world))
    assert facts_bytes <= store.read_bytes < facts_bytes + world * 64, store.read_bytes
    # No rank reads a list of keys but the checker, once.
    assert store.count("multi_get") == 1
    assert store.wide_checks() == 1
    assert base.num_keys() == 0  # facts, counters and verdict: all deleted


def test_a_waiting_rank_polls_one_key() -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    seen: dict[str, Any] = {}

    def rank_0_arrives_and_checks() -> None:
        seen.update(calls=list(store.calls))
        seen["table"] = preflight._exchange(base, env_of(0, 2), facts_of(0), deadline)

    # On a fake clock: rank 0 comes 300 ms on, in rank 1's 10th wait (5 ms, growing by 1.5
    # a poll to 50 ms: 103.9 ms in 6 waits, then 50 ms each; the 10th ends at 303.9 ms).
    with _clock.use(_clock.FakeClock()) as clock:
        deadline = clock.monotonic() + 20
        clock.after(0.3, rank_0_arrives_and_checks)
        assert preflight._exchange(store, env_of(1, 2), facts_of(1), deadline) == {  # type: ignore[arg-type]
            1: facts_of(1)
        }
    assert clock.waits == pytest.approx(backoff_waits(10))
    assert seen["table"] == {0: facts_of(0), 1: facts_of(1)}
    # Before rank 0 came: its own arrival (the facts, then the count: compare_set checks it
    # is a number, then add), then one key a poll (the verdict); never the count.
    verdict = [KEYS.verdict()]
    assert seen["calls"][:3] == [
        ("set", KEYS.facts(1)),
        ("compare_set", KEYS.arrived),
        ("add", KEYS.arrived),
    ]
    assert seen["calls"][3:] == [("check", verdict)] * 10
    assert store.count("check") == 11  # and the poll that found it
    assert store.count("get") == 1  # the verdict


# -- facts that differ -----------------------------------------------------------------------
def _odd_facts(rank: int) -> dict[str, str]:
    facts = facts_of(rank)
    if rank == 3:
        facts["torch"] = "2.99.0"
    if rank in (5, 6):
        facts["gpu"] = "GPU-1234"
    return facts


def test_each_rank_raises_the_error_it_raised_when_it_compared_itself() -> None:
    world = 12
    store = ByteCountingStore(dist.HashStore())
    results = simulate(world, store, facts=_odd_facts)  # type: ignore[arg-type]
    table = {r: _odd_facts(r) for r in range(world)}
    problems = preflight.compare(table, world)
    assert len(problems) == 2, problems
    for r, e in results.items():
        assert isinstance(e, PreflightError), (r, e)
        assert str(e) == _expected_message(r, table, world)
        assert e.problems == tuple(problems)
        assert e.table == table
    assert store.facts_read() == world  # still once in all


def test_a_checked_verdict_wins_over_a_later_deadline() -> None:
    # Rank 1 gave up first (rank 2 missing), then rank 2 arrived: rank 0 sees every rank,
    # compares, and follows the verdict that was there first.
    base = dist.HashStore()
    first = simulate(3, base, ranks=[1], budget_s=0.3)[1]
    assert isinstance(first, PreflightError)
    assert "rank(s) [0, 2] never arrived" in first.problems[0]
    _arrive(base, 2, facts_of(2))
    e = simulate(3, base, ranks=[0], budget_s=5)[0]
    assert isinstance(e, PreflightError)
    assert str(e) == f"{first}\n(rank 1 gave up first and published this; rank 0 raises it too)"
    assert e.problems == first.problems


# -- ranks that do not arrive, a checker that does not answer --------------------------------
def test_a_missing_checker_is_named_by_every_rank_at_the_deadline() -> None:
    world = 6
    results = simulate(world, dist.HashStore(), ranks=range(1, world), budget_s=0.5)
    for r, e in results.items():
        assert isinstance(e, PreflightError), (r, e)
        assert "rank(s) [0] never arrived" in e.problems[0], (r, e)


@pytest.mark.parametrize("odd", [False, True])
def test_a_checker_that_arrived_and_died_is_replaced_at_the_deadline(odd: bool) -> None:
    world = 6
    facts = _odd_facts if odd else facts_of
    base = dist.HashStore()
    _arrive(base, 0, facts(0))  # then it dies: no verdict
    t0 = time.monotonic()
    results = simulate(world, base, facts=facts, ranks=range(1, world), budget_s=0.5)
    assert time.monotonic() - t0 < 3.0
    table = {r: facts(r) for r in range(world)}
    for r, got in results.items():
        if odd:
            assert isinstance(got, PreflightError), (r, got)
            assert str(got) == _expected_message(r, table, world)
        else:
            # Every rank compared or read a verdict; the one whose verdict won has them all.
            assert isinstance(got, dict), (r, got)
            assert r in got
    if not odd:
        assert any(len(got) == world for got in results.values())


# -- restarts and leftovers ------------------------------------------------------------------
def test_the_next_attempt_deletes_what_a_failed_one_left() -> None:
    world = 4
    base = dist.HashStore()
    # Attempt 0: rank 3 never arrived; rank 1 crashed before it read the verdict.
    _arrive(base, 1, facts_of(1))
    simulate(world, base, ranks=[0, 2], budget_s=0.3)
    assert base.num_keys() > 0
    # Attempt 1: everyone; nothing is left of either attempt.
    results = simulate(world, base, restart=1)
    assert all(isinstance(v, dict) for v in results.values()), results
    assert base.num_keys() == 0


def test_a_foreign_verdict_is_reported_as_such() -> None:
    base = dist.HashStore()
    base.set(KEYS.verdict(), "not a verdict")
    results = simulate(2, base, ranks=[1], budget_s=5)
    assert "not written by this job" in str(results[1])


def _measure(world: int) -> None:
    store = ByteCountingStore(dist.HashStore())
    t0 = time.monotonic()
    results = simulate(world, store)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    failed = sum(not isinstance(v, dict) for v in results.values())
    print(
        f"W={world}: facts {len(json.dumps(facts_of(world - 1)))} B a rank; read "
        f"{store.read_bytes / 1e6:.3f} MB in {len(store.calls)} requests "
        f"({store.facts_read()} facts records); {elapsed:.1f} s; {failed} ranks failed"
    )
    store = ByteCountingStore(dist.HashStore())
    results = simulate(world, store, facts=_odd_facts)  # type: ignore[arg-type]
    raised = sum(isinstance(v, PreflightError) for v in results.values())
    print(
        f"W={world}, facts that differ: read {store.read_bytes / 1e6:.1f} MB "
        f"({store.facts_read()} facts records); {raised} ranks raised"
    )


if __name__ == "__main__":
    for w in sys.argv[1:] or ["1024"]:
        _measure(int(w))
