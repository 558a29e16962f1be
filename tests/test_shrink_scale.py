"""One reader of a shrink round's proposal log (issue 16): the first survivor to claim the
round reads the log, decides and publishes; the others read the decision key alone, and
read the log themselves only when that decider fails before publishing (or never does).

Each test runs several ranks' real ``elastic._agree`` in threads of this process, each over
its own :class:`CountingStore` on one shared ``HashStore``, and counts who read the log.
No processes; every thread is joined before the test ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from resilient_ddp import _control as ctl
from resilient_ddp import elastic
from resilient_ddp._elastic_protocol import Proposal

from ._counting_store import CountingStore

BASE = "rec/g0/r0"
LOG = f"{BASE}/log"
CLAIM = f"g0/dg/{BASE}/claim"


def _rt(root: Any, world: int, rank: int, dead: tuple[int, ...], interval: float = 0.2) -> Any:
    """The parts of a ``Runtime`` that ``_agree`` uses; no watchdog: the failures it would
    have recorded are given (``dead``: crashed ranks)."""
    cfg = SimpleNamespace(
        op_timeout=timedelta(seconds=10),
        heartbeat_timeout=timedelta(seconds=5),
        heartbeat_interval=timedelta(seconds=interval),
        min_world_size=1,
    )
    return SimpleNamespace(
        rank=rank,
        world_size=world,
        generation=0,
        config=cfg,
        control_root=root,
        watchdog=None,
        lock=threading.RLock(),
        failures=[{"kind": "crash", "rank": r} for r in dead],
        left={},
    )


class _Ranks:
    """``ranks`` of a world of ``world``, each with its own counting connection to one
    store (``root``), running ``_agree`` in a thread each."""

    def __init__(
        self,
        root: Any,
        world: int,
        ranks: list[int],
        dead: tuple[int, ...],
        interval: float = 0.2,
    ) -> None:
        self.world = world
        self.ranks = ranks
        self.stores = {r: CountingStore(root) for r in ranks}
        self.rts = {r: _rt(self.stores[r], world, r, dead, interval) for r in ranks}
        self.pool = ThreadPoolExecutor(len(ranks))
        self.futures: dict[int, Any] = {}

    def start(self) -> None:
        for r in self.ranks:
            el = SimpleNamespace(uid=r, committed=5)
            self.futures[r] = self.pool.submit(
                elastic._agree,
                self.rts[r],  # type: ignore[arg-type]
                el,  # type: ignore[arg-type]
                BASE,
                list(range(self.world)),
                "reduce",
                True,
                (0, self.world),
            )

    def decisions(self) -> dict[int, dict[str, Any]]:
        try:
            return {r: f.result(timeout=30) for r, f in self.futures.items()}
        finally:
            self.pool.shutdown(wait=True)

    def count(self, name: str, where: Callable[[Any], bool]) -> dict[int, int]:
        return {r: s.count(name, where) for r, s in self.stores.items()}

    def log_reads(self) -> dict[int, int]:
        return self.count("get", lambda key: key == LOG)

    def claims(self) -> dict[int, int]:
        return self.count("compare_set", lambda key: key == CLAIM)

    def wait_until(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        """Poll a condition on the recorded requests (not a guess at how long it takes)."""
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out waiting for the ranks"
            time.sleep(0.01)


def _proposal(rank: int) -> dict[str, Any]:
    return Proposal(rank=rank, uid=rank, committed=5, where="reduce", grads=True).to_json()


def _same(decisions: dict[int, dict[str, Any]]) -> dict[str, Any]:
    first = next(iter(decisions.values()))
    assert all(d == first for d in decisions.values()), decisions
    return first


def test_one_rank_reads_the_log_when_its_decider_is_healthy() -> None:
    """Eight ranks, one killed: the seven survivors post, each claims the round once, and
    only the claim's winner reads the log; the others read the decision key, one request a
    poll."""
    base = dist.HashStore()
    ranks = _Ranks(base, 8, list(range(7)), dead=(7,))
    ranks.start()
    dec = _same(ranks.decisions())
    assert (dec["members"], dec["lost"], dec["outcome"]) == (list(range(7)), [7], "redo"), dec
    reads = ranks.log_reads()
    readers = [r for r, n in reads.items() if n]
    assert len(readers) == 1, reads
    assert reads[readers[0]] == 1, reads
    # The reader is the rank whose claim stands; every rank asked at most once.
    claimed = ctl.unseal_dict(None, CLAIM, base.get(CLAIM))
    assert claimed == {"rank": readers[0]}
    assert all(n <= 1 for n in ranks.claims().values()), ranks.claims()
    # A waiter's requests: its proposal (append, add), its polls before the claim (the
    # decision and the count), the claim, and then the decision key alone.
    for r in ranks.ranks:
        if r == readers[0]:
            continue
        calls = {name for name, _ in ranks.stores[r].calls}
        assert calls <= {"append", "add", "check", "get", "compare_set"}, calls
        assert ranks.stores[r].count("multi_get") == 0


def test_the_others_read_the_log_when_the_decider_dies_before_publishing() -> None:
    """Rank 3 proposes and claims the round, then dies without deciding: the survivors wait
    for its decision without reading the log, and once the watchdog reports it dead, each
    reads the log and decides (the first decision stored wins)."""
    base = dist.HashStore()
    jobs = ctl.JobStore(base)
    jobs.post_proposal(
        BASE, Proposal(rank=3, uid=3, committed=5, where="reduce", grads=True).to_json()
    )
    assert jobs.claim_decision(0, BASE, 3) == 3
    survivors = [0, 1, 2, 4, 5, 6]
    # Heartbeats of 1 s: the survivors wait 5.5 s for rank 3 before deciding without it.
    ranks = _Ranks(base, 8, survivors, dead=(7,), interval=1.0)
    ranks.start()
    # Every survivor claimed (and lost to rank 3): they wait on the decision key now.
    ranks.wait_until(lambda: all(n == 1 for n in ranks.claims().values()))
    seen = {r: len(s.calls) for r, s in ranks.stores.items()}
    ranks.wait_until(lambda: all(len(s.calls) >= seen[r] + 2 for r, s in ranks.stores.items()))
    assert not any(ranks.futures[r].done() for r in survivors)
    # Waiting, each reads the decision key alone, one request a poll; no one read the log.
    for r, s in ranks.stores.items():
        assert set(map(str, s.calls[seen[r] :])) == {str(("check", [f"{BASE}/d"]))}, r
    assert sum(ranks.log_reads().values()) == 0, ranks.log_reads()
    for rt in ranks.rts.values():
        with rt.lock:
            rt.failures.append({"kind": "crash", "rank": 3})
    dec = _same(ranks.decisions())
    # Rank 3 proposed, so it is in the decision: forming the group finds it missing and
    # starts another round, as before.
    assert (dec["members"], dec["lost"]) == (list(range(7)), [7]), dec
    # The first of them to read decides; the others may find its decision before reading.
    assert sum(ranks.log_reads().values()) >= 1, ranks.log_reads()


def test_the_others_decide_when_the_decider_never_publishes() -> None:
    """A decider that claimed the round and hangs without being reported: the others read
    the log after the grace plus two heartbeat intervals and a second, not before."""
    base = dist.HashStore()
    jobs = ctl.JobStore(base)
    jobs.post_proposal(
        BASE, Proposal(rank=0, uid=0, committed=5, where="reduce", grads=True).to_json()
    )
    assert jobs.claim_decision(0, BASE, 0) == 0
    ranks = _Ranks(base, 4, [1, 2], dead=(3,))
    t0 = time.monotonic()
    ranks.start()
    dec = _same(ranks.decisions())
    took = time.monotonic() - t0
    cfg = ranks.rts[1].config
    bound = elastic._grace(cfg) + 2 * cfg.heartbeat_interval.total_seconds() + 1.0
    assert took >= bound, (took, bound)
    assert (dec["members"], dec["lost"]) == ([0, 1, 2], [3]), dec
    assert sum(ranks.log_reads().values()) >= 1, ranks.log_reads()


def test_a_claim_that_is_not_a_claim_makes_every_rank_decide() -> None:
    """Garbage (or a claim without the job's MAC) in the claim key, written by a process
    outside the job: no rank waits for a decider that does not exist; each that claims
    reads the log and decides, as before the claim existed, and they agree."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    ranks = _Ranks(root, 4, [0, 1, 2], dead=(3,))
    base.set(f"rd/job/{CLAIM}", '{"rank": 0}')  # plain JSON: no MAC
    t0 = time.monotonic()
    ranks.start()
    dec = _same(ranks.decisions())
    took = time.monotonic() - t0
    assert (dec["members"], dec["lost"]) == ([0, 1, 2], [3]), dec
    # Each rank that claimed read the log unless it found a decision first; none waited.
    reads, claims = ranks.log_reads(), ranks.claims()
    assert sum(reads.values()) >= 1, reads
    assert all(reads[r] <= claims[r] for r in reads), (reads, claims)
    assert took < elastic._grace(ranks.rts[0].config), took


def test_forgetting_the_generation_deletes_the_claim() -> None:
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    before = base.num_keys()
    jobs = ctl.JobStore(root)
    jobs.post_proposal(BASE, {"rank": 0})
    assert jobs.claim_decision(0, BASE, 0) == 0
    assert jobs.claim_decision(0, BASE, 1) == 0  # the first claim stands
    assert base.check([f"rd/job/{CLAIM}"])
    jobs.forget_generation(0, 4)
    assert base.num_keys() == before
