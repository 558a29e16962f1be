"""One reader of a shrink round's proposal log (issue 16): the first survivor to claim the
round reads the log, decides and publishes; the others read the decision key alone, and
read the log themselves only when that decider fails before publishing (or never does).

Each test runs several ranks' real ``elastic._agree`` in threads of this process, each over
its own :class:`CountingStore` on one shared ``HashStore``, and counts who read the log,
and what the others read of the decision: a record that names the lost ranks, not the
members, the same size at W = 8 and W = 256. No processes; every thread is joined before
the test ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.base import _timings
from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import ControlPlaneError, Culprit
from resilient_ddp.training import elastic
from resilient_ddp.training._elastic_protocol import Proposal, ShrinkDecision

from ._counting_store import CountingStore
from ._fake_runtime import fake_runtime as protocol_rt

BASE = "rec/g0/r0"
LOG = f"{BASE}/log"
CLAIM = f"g0/dg/{BASE}/claim"
DECISION = f"{BASE}/d"


class ByteCountingStore(CountingStore):
    """A :class:`CountingStore` that also adds up, per key, the bytes of the values its
    ``get`` and ``compare_set`` requests return."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.read: dict[str, int] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = super().__getattr__(name)
        if name not in ("get", "compare_set"):
            return fn

        def call(*args: Any) -> Any:
            out = fn(*args)
            with self._lock:
                self.read[args[0]] = self.read.get(args[0], 0) + len(out)
            return out

        return call

    def read_bytes(self, where: Callable[[str], bool]) -> int:
        with self._lock:
            return sum(n for key, n in self.read.items() if where(key))


@pytest.fixture(autouse=True)
def _sealed_through_counting_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A JobStore over a counting store keeps the job's MAC key: ``ctl.mac_key`` looks
    through the wrapper (it finds a job's key by the store's type, which the wrapper hides),
    so that the tests with a secret read and write sealed records, as the job does."""
    mac_key = ctl.mac_key
    monkeypatch.setattr(ctl, "mac_key", lambda store: mac_key(getattr(store, "inner", store)))


def _rt(root: Any, world: int, rank: int, dead: tuple[int, ...], interval: float = 0.2) -> Any:
    """The parts of a ``Runtime`` that ``_agree`` uses (op_timeout 10 s)."""
    return protocol_rt(root, world, rank, dead, op_timeout=10, interval=interval)


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
        self.stores = {r: ByteCountingStore(root) for r in ranks}
        self.rts = {r: _rt(self.stores[r], world, r, dead, interval) for r in ranks}
        self.pool = ThreadPoolExecutor(len(ranks))
        self.futures: dict[int, Any] = {}

    def start(self) -> None:
        for r in self.ranks:
            el = SimpleNamespace(uid=r, committed=5, members=list(range(self.world)))
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

    def decisions(self) -> dict[int, ShrinkDecision]:
        try:
            return {r: f.result(timeout=30) for r, f in self.futures.items()}
        finally:
            self.pool.shutdown(wait=True)

    def count(self, name: str, where: Callable[[Any], bool]) -> dict[int, int]:
        return {r: s.count(name, where) for r, s in self.stores.items()}

    def decision_bytes(self) -> dict[int, int]:
        """Bytes each rank read from the round's decision slots."""
        return {
            r: s.read_bytes(lambda key: key.startswith(DECISION)) for r, s in self.stores.items()
        }

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


def _same(decisions: dict[int, ShrinkDecision]) -> ShrinkDecision:
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
    assert (dec.members, dec.lost, dec.outcome) == (tuple(range(7)), (7,), "redo"), dec
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


def _shrink_of(world: int) -> tuple[ShrinkDecision, dict[int, int], dict[int, int]]:
    """``world`` ranks, the last one killed, the others running ``_agree``: the decision,
    the bytes each survivor read from the decision key, and who read the log."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")  # records sealed with the job's MAC
    ranks = _Ranks(root, world, list(range(world - 1)), dead=(world - 1,))
    ranks.start()
    dec = _same(ranks.decisions())
    return dec, ranks.decision_bytes(), ranks.log_reads()


def test_what_each_survivor_reads_of_the_decision_does_not_grow_with_the_world() -> None:
    """W = 8 and W = 256 (255 survivors as threads): each survivor that did not decide
    reads the decision once, the same few hundred bytes at both sizes (it names the lost
    rank; the members it derives from its own copy of the member list): 169 and 173
    bytes here. The full decision each read before, members and their old ranks, is
    1,968 bytes sealed at W = 256."""
    per_rank: dict[int, int] = {}
    for world in (8, 256):
        dec, read, log_reads = _shrink_of(world)
        members = tuple(range(world - 1))
        assert (dec.members, dec.old_ranks, dec.lost) == (members, members, (world - 1,))
        assert dec.outcome == "redo", dec
        readers = [r for r, n in log_reads.items() if n]
        assert len(readers) == 1, readers
        waiters = {r: n for r, n in read.items() if r not in readers}
        assert all(n > 0 for n in waiters.values()), waiters
        per_rank[world] = max(waiters.values())
        assert per_rank[world] < 300, (world, per_rank[world])
        if world == 256:
            full = len(ctl.seal(b"k" * 32, DECISION, dec.to_json()))  # what each read before
            assert full > 1900, full
    # The same record but for the digits of the world size and of the lost rank.
    assert per_rank[256] <= per_rank[8] + 4, per_rank


def _plant(base: Any, value: str) -> None:
    # Under the job's namespace, whose name a keyed job derives from its key
    base.set(f"{ctl.root_prefix(base, 'job', 'secret').prefix}/{DECISION}", value)


def test_a_decision_without_the_jobs_mac_is_ignored() -> None:
    """A compact decision planted without the job's MAC (a process without its secret),
    removing rank 0: no rank follows it; they decide in the next slot and agree."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    forged = ShrinkDecision(
        old_ranks=(1, 2),
        lost=(0, 3),
        gen=9,
        members=(1, 2),
        source=0,
        outcome="redo",
        sync=False,
        committed=5,
    ).to_record([0, 1, 2, 3])
    _plant(base, json.dumps(forged))
    ranks = _Ranks(root, 4, [0, 1, 2], dead=(3,))
    ranks.start()
    dec = _same(ranks.decisions())
    assert (dec.members, dec.lost) == ((0, 1, 2), (3,)), dec
    assert base.check([f"{root.prefix}/{DECISION}/1"])


def test_a_decision_a_rank_cannot_follow_is_refused() -> None:
    """A sealed record that is malformed, or whose members a rank derives differently
    from the decider (another copy of the member list), raises ``ControlPlaneError`` on
    that rank rather than form another group."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    jobs = ctl.JobStore(root)
    dec = ShrinkDecision(
        old_ranks=(0, 1, 2),
        lost=(3,),
        gen=9,
        members=(0, 1, 2),
        source=0,
        outcome="redo",
        sync=False,
        committed=5,
    )
    jobs.decide(DECISION, dec.to_record([0, 1, 2, 3]))
    rt = _rt(root, 4, 1, dead=(3,))

    def agree(members: list[int]) -> ShrinkDecision:
        el = SimpleNamespace(uid=1, committed=5, members=members)
        return elastic._agree(rt, el, BASE, [0, 1, 2, 3], "reduce", True, (0, 4))  # type: ignore[arg-type]

    assert agree([0, 1, 2, 3]) == dec
    with pytest.raises(ControlPlaneError, match="copy differs"):
        agree([0, 1, 7, 3])
    other = "rec/g0/r1/d"
    jobs.decide(other, {**dec.to_record([0, 1, 2, 3]), "lost": [9]})
    with pytest.raises(ControlPlaneError, match="cannot be followed"):
        elastic._agree(
            rt,
            SimpleNamespace(uid=1, committed=5, members=[0, 1, 2, 3]),  # type: ignore[arg-type]
            "rec/g0/r1",
            [0, 1, 2, 3],
            "reduce",
            True,
            (0, 4),
        )


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
            rt.failures.append(ctl.FailureEvent(ctl.EV_CRASH, 0, rank=3, culprit=Culprit(3)))
    dec = _same(ranks.decisions())
    # Rank 3 proposed, so it is in the decision: forming the group finds it missing and
    # starts another round, as before.
    assert (dec.members, dec.lost) == (tuple(range(7)), (7,)), dec
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
    bound = _timings.shrink_decider_wait(cfg)  # the late proposer's grace, two ticks and 1 s
    assert took >= bound, (took, bound)
    assert (dec.members, dec.lost) == ((0, 1, 2), (3,)), dec
    assert sum(ranks.log_reads().values()) >= 1, ranks.log_reads()


def test_a_claim_that_is_not_a_claim_makes_every_rank_decide() -> None:
    """Garbage (or a claim without the job's MAC) in the claim key, written by a process
    outside the job: no rank waits for a decider that does not exist; each that claims
    reads the log and decides, as before the claim existed, and they agree."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    ranks = _Ranks(root, 4, [0, 1, 2], dead=(3,))
    base.set(f"{root.prefix}/{CLAIM}", '{"rank": 0}')  # plain JSON: no MAC
    t0 = time.monotonic()
    ranks.start()
    dec = _same(ranks.decisions())
    took = time.monotonic() - t0
    assert (dec.members, dec.lost) == ((0, 1, 2), (3,)), dec
    # Each rank that claimed read the log unless it found a decision first; none waited.
    reads, claims = ranks.log_reads(), ranks.claims()
    assert sum(reads.values()) >= 1, reads
    assert all(reads[r] <= claims[r] for r in reads), (reads, claims)
    assert took < _timings.late_proposer_grace(ranks.rts[0].config), took


def test_forgetting_the_generation_deletes_the_claim() -> None:
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    before = base.num_keys()
    jobs = ctl.JobStore(root)
    jobs.post_proposal(BASE, {"rank": 0})
    assert jobs.claim_decision(0, BASE, 0) == 0
    assert jobs.claim_decision(0, BASE, 1) == 0  # the first claim stands
    assert base.check([f"{root.prefix}/{CLAIM}"])
    jobs.forget_generation(0, 4)
    assert base.num_keys() == before
