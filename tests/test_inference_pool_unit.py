"""Single-process parts of the pulled inference engine (issue 28): the chunk plan, the claim
protocol over an in-memory store (round trips counted exactly), rank 0's ledger (a lease
given back exactly once, late duplicates dropped, poison items), the files and resuming."""

from __future__ import annotations

import io
import itertools
import os
import pickle
from pathlib import Path

import pytest
import torch

import resilient_ddp as rd
from resilient_ddp.inference import _work_pool as wp
from resilient_ddp.inference.inference import _Bar


class CountingStore:
    """An in-memory store that counts round trips (one per call, as a TCPStore makes)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[str] = []

    def add(self, key: str, value: int) -> int:
        self.calls.append("add")
        n = int(self.data.get(key, b"0")) + value
        self.data[key] = str(n).encode()
        return n

    def set(self, key: str, value: str | bytes) -> None:
        self.calls.append("set")
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        self.calls.append("get")
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        return all(k in self.data for k in keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.calls.append("multi_set")
        for k, v in zip(keys, values, strict=True):
            self.data[k] = v.encode() if isinstance(v, str) else v

    def delete_key(self, key: str) -> bool:
        self.calls.append("delete_key")
        return self.data.pop(key, None) is not None


# -- the plan --------------------------------------------------------------------------------
def test_plan_without_costs_is_consecutive_ranges() -> None:
    chunks = wp.plan_chunks(10, 4)
    assert [c.items for c in chunks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert wp.plan_chunks(0, 4) == ()


def test_plan_with_costs_goes_from_heavy_to_light_and_holds_every_item_once() -> None:
    costs = [float((i * 37) % 11) + (100.0 if i == 5 else 0.0) for i in range(50)]
    chunks = wp.plan_chunks(50, 8, costs)
    items = [i for c in chunks for i in c.items]
    assert sorted(items) == list(range(50))
    assert chunks[0].items[0] == 5  # the heaviest item is in the first chunk drawn
    assert all(len(c.items) <= 8 for c in chunks)
    # Each chunk's items are no lighter than the next chunk's.
    for a, b in itertools.pairwise(chunks):
        assert min(costs[i] for i in a.items) >= max(costs[i] for i in b.items)
    assert sum(c.cost for c in chunks) == pytest.approx(sum(costs))


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        wp.plan_chunks(3, 0)
    with pytest.raises(ValueError, match="2 values for 3"):
        wp.plan_chunks(3, 1, [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        wp.plan_chunks(2, 1, [1.0, float("nan")])


@pytest.mark.parametrize(
    ("n", "world", "batch", "expect"),
    [
        # 100 items, 2 ranks, batches of 4: largest 8 (ceil(100 / 16) = 7 -> 8); the share
        # is left / (2 x 2 ranks) in whole batches: 8 while more than 16 are left (100, 92,
        # ..., 20: eleven chunks), then 12 -> 4, 8 -> 4, 4 -> 4.
        (100, 2, 4, [8] * 11 + [4] * 3),
        (10, 4, 8, [8, 2]),  # at least one batch; the last takes what is left
        (0, 3, 4, []),
    ],
)
def test_tapered_sizes_shrink_to_a_batch_as_the_work_runs_out(
    n: int, world: int, batch: int, expect: list[int]
) -> None:
    largest = wp.default_chunk_size(n, world, batch) if n else batch
    assert wp.tapered_sizes(n, world, batch, largest) == expect


def test_the_default_plan_tapers_and_covers_every_item_once_in_order() -> None:
    chunks = wp.plan(2000, None, 4, 4)
    sizes = [len(c.items) for c in chunks]
    assert [i for c in chunks for i in c.items] == list(range(2000))
    assert sizes[0] == wp.default_chunk_size(2000, 4, 4) == 64
    assert sizes == sorted(sizes, reverse=True)  # never grows
    assert sizes[-4:] == [4, 4, 4, 4]  # one batch each at the very end
    left = 2000
    for size in sizes:  # none holds more than the items left over 2 x ranks (whole batches)
        assert size <= max(4, -(-left // (wp.TAPER * 4) // 4) * 4 + 4)
        left -= size
    # A chunk size given, or costs: the plan is plan_chunks's, unchanged.
    assert wp.plan(2000, 50, 4, 4) == wp.plan_chunks(2000, 50)
    costs = [float(i % 13) for i in range(2000)]
    assert wp.plan(2000, None, 4, 4, costs) == wp.plan_chunks(2000, 64, costs)


def test_default_chunk_size_is_whole_batches_and_several_chunks_per_rank() -> None:
    assert wp.default_chunk_size(1000, 4, 8) == 32  # 1000 / 32 = 31.25 -> 32 (4 batches)
    assert wp.default_chunk_size(10, 4, 8) == 8  # at least one batch
    size = wp.default_chunk_size(10_000, 3, 5)
    assert size % 5 == 0
    assert len(wp.plan_chunks(10_000, size)) >= 3 * wp.CHUNKS_PER_RANK - 1


# -- the claim protocol ----------------------------------------------------------------------
def _delivery(t: int, entry: wp.Entry, rank: int) -> wp.Delivery:
    return wp.Delivery(t, rank, entry.items, [i * 10 for i in entry.items], compute_s=0.01)


def _collect(store: CountingStore, keys: wp.Keys, led: wp.Ledger, out: dict[int, int]) -> None:
    """What rank 0's collector does with the deliveries present in ``store``."""
    for t in range(led.published):
        name = keys.res(t)
        if t in led.delivered or name not in store.data:
            continue
        d = wp.unpack(None, name, store.data.pop(name))
        assert d is not None
        fresh, _ = led.accept(d, {0, 1, 2})
        assert d.results is not None
        for i, r in zip(d.indices, d.results, strict=True):
            if i in fresh:
                assert i not in out, f"item {i} accepted twice"
                out[i] = r


def test_a_chunk_costs_a_worker_two_round_trips() -> None:
    store = CountingStore()
    keys = wp.Keys(1)
    chunks = wp.plan_chunks(40, 4)  # 10 chunks
    led = wp.Ledger(chunks, 2)
    workers = [wp.Worker(store, keys, r, None) for r in range(3)]
    per_rank: dict[int, list[str]] = {}
    tickets = {}
    for w in workers:
        before = len(store.calls)
        tickets[w.rank] = w.first()
        per_rank[w.rank] = store.calls[before:]
        assert per_rank[w.rank] == ["add", "set"]  # draw a ticket, record the lease
    out: dict[int, int] = {}
    runs = dict.fromkeys(range(3), 0)
    while any(t < len(chunks) for t in tickets.values()):
        for w in workers:
            t = tickets[w.rank]
            if t >= len(chunks):
                continue
            before = len(store.calls)
            tickets[w.rank] = w.deliver(_delivery(t, led.entry_of(t), w.rank))
            # Exactly one add (the next ticket) and one multi_set (delivery and lease).
            assert store.calls[before:] == ["add", "multi_set"]
            runs[w.rank] += 1
            assert store.data[keys.lease(w.rank)] == str(tickets[w.rank]).encode()
    _collect(store, keys, led, out)
    assert led.finished()
    assert out == {i: i * 10 for i in range(40)}
    assert sum(runs.values()) == len(chunks)
    # Every worker ends holding a ticket past the work: it waits on redo/n.
    assert all(t >= led.published for t in tickets.values())
    assert workers[1].redo_state() == 0


def test_a_dead_ranks_lease_goes_back_exactly_once_and_a_late_delivery_is_dropped() -> None:
    store = CountingStore()
    keys = wp.Keys(3)
    chunks = wp.plan_chunks(12, 4)  # 3 chunks
    led = wp.Ledger(chunks, 2)
    w0, w1 = wp.Worker(store, keys, 0, None), wp.Worker(store, keys, 1, None)
    t0, t1 = w0.first(), w1.first()
    assert (t0, t1) == (0, 1)
    # Rank 1 "dies" holding ticket 1: rank 0 gives it back, twice (two reports): once.
    queued = led.requeue(t1, "rank 1 died", 1, {0})
    assert [e.items for e in queued] == [chunks[1].items]
    assert led.requeue(t1, "rank 1 died", 1, {0}) == []
    assert led.published == 4  # chunks 0-2, then redo entry 0 (ticket 3)
    out: dict[int, int] = {}
    t0 = w0.deliver(_delivery(t0, led.entry_of(0), 0))  # ticket 2
    t0 = w0.deliver(_delivery(t0, led.entry_of(2), 0))  # ticket 3: the redo entry
    assert t0 == 3
    assert led.entry_of(3).why == "rank 1 died"
    t0 = w0.deliver(_delivery(t0, led.entry_of(3), 0))
    _collect(store, keys, led, out)
    assert led.finished()
    # Rank 1 was only stopped: resumed, it delivers ticket 1 late. Nothing is added.
    w1.deliver(_delivery(1, led.entry_of(1), 1))
    _collect(store, keys, led, out)
    assert out == {i: i * 10 for i in range(12)}
    assert led.redone == [{"ticket": 1, "chunk": 1, "rank": 1, "why": "rank 1 died", "items": 4}]


# -- deliveries over the store's value limit ------------------------------------------------
class DyingStore(CountingStore):
    """A CountingStore whose process "dies" (raises) on its ``fail_on``-th multi_set."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.multi_sets = 0

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.multi_sets += 1
        if self.multi_sets == self.fail_on:
            raise ConnectionError("the rank died")
        super().multi_set(keys, values)


def _big(t: int, entry: wp.Entry, rank: int) -> wp.Delivery:
    """About 10.5 MiB of results: over the libuv TCPStore's 8 MiB value limit."""
    res = [torch.full((64 * 1024,), float(i)) for i in entry.items]  # 256 KiB each
    return wp.Delivery(t, rank, entry.items, list(res), compute_s=0.5)


def test_a_delivery_over_the_part_size_is_split_and_read_back_exactly() -> None:
    store = CountingStore()
    keys, mac = wp.Keys(4), b"k" * 32
    chunks = wp.plan_chunks(80, 40)  # 2 chunks of 40 items: 10 MiB each
    led = wp.Ledger(chunks, 2)
    w = wp.Worker(store, keys, 1, mac)
    t = w.first()
    before = len(store.calls)
    t_next = w.deliver(_big(t, led.entry_of(t), 1))
    # Still one add and one multi_set: the parts, then the record, then the lease.
    assert store.calls[before:] == ["add", "multi_set"]
    assert t_next == 1
    parts = [k for k in store.data if k.startswith(keys.res(t) + "/")]
    assert parts == [keys.part(t, k) for k in range(3)]  # 10.5 MiB in 4 MiB parts
    assert max(len(store.data[k]) for k in parts) <= wp.PART_BYTES
    assert len(store.data[keys.res(t)]) < 4096  # the record is small
    assert list(store.data).index(keys.res(t)) > list(store.data).index(parts[-1])
    before = len(store.calls)
    d = wp.take(store, keys, mac, t)
    # Rank 0: get and delete the record, check the parts, then a get and a delete each.
    assert store.calls[before:] == ["get", "delete_key", "check"] + ["get"] * 3 + ["delete_key"] * 3
    assert d is not None
    assert d.results is not None
    assert (d.ticket, d.rank, d.indices, d.compute_s, d.parts) == (0, 1, chunks[0].items, 0.5, 0)
    for i, r in zip(d.indices, d.results, strict=True):
        assert torch.equal(r, torch.full((64 * 1024,), float(i)))
    assert not [k for k in store.data if k.startswith(keys.res(t))]  # all deleted
    assert led.accept(d, {0, 1})[0] == list(chunks[0].items)
    # Under the part size nothing changes: one value, read with one get.
    small = wp.Delivery(1, 1, (40,), [1])
    w.deliver(small)
    assert not [k for k in store.data if k.startswith(keys.res(1) + "/")]
    before = len(store.calls)
    assert wp.take(store, keys, mac, 1) == small
    assert store.calls[before:] == ["get", "delete_key"]


def test_parts_over_the_multi_set_bound_go_in_several_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wp, "PART_BYTES", 1 << 20)
    monkeypatch.setattr(wp, "MULTI_SET_BYTES", 4 << 20)
    store = CountingStore()
    keys = wp.Keys(5)
    w = wp.Worker(store, keys, 0, None)
    entry = wp.Entry(0, tuple(range(40)))
    before = len(store.calls)
    w.deliver(_big(0, entry, 0))  # 10.5 MiB: 11 parts of 1 MiB, 4 per multi_set
    assert store.calls[before:] == ["add", "multi_set", "multi_set", "multi_set"]
    d = wp.take(store, keys, None, 0)
    assert d is not None
    assert d.indices == entry.items
    assert d.results is not None
    assert torch.equal(d.results[39], torch.full((64 * 1024,), 39.0))
    assert store.data.keys() == {keys.next, keys.lease(0)}


def test_a_rank_dying_while_writing_parts_leaves_no_delivery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wp, "PART_BYTES", 1 << 20)
    monkeypatch.setattr(wp, "MULTI_SET_BYTES", 4 << 20)
    store = DyingStore(fail_on=2)  # the first 4 parts are written, then the rank dies
    keys = wp.Keys(6)
    chunks = wp.plan_chunks(40, 40)  # 1 chunk
    led = wp.Ledger(chunks, 2)
    w1, w2 = wp.Worker(store, keys, 1, None), wp.Worker(store, keys, 2, None)
    t, t2 = w1.first(), w2.first()  # rank 2 holds ticket 1: no work yet, it waits
    with pytest.raises(ConnectionError):
        w1.deliver(_big(t, led.entry_of(t), 1))
    assert keys.part(t, 3) in store.data  # parts are there ...
    assert keys.res(t) not in store.data  # ... but no record: rank 0 takes nothing
    # Rank 0 gives the ticket back; rank 2 runs it and delivers it whole.
    led.requeue(t, "rank 1 died", 1, {2})  # rank 2 alone to run it: one piece
    assert led.entry_of(t2).items == chunks[0].items  # ticket 1: the redo entry
    w2.deliver(_big(t2, led.entry_of(t2), 2))
    d = wp.take(store, keys, None, t2)
    assert d is not None
    assert led.accept(d, {0, 2})[0] == list(range(40))
    assert led.finished()
    # At the end of the call rank 0 deletes what the dead rank left (a prefix of parts).
    assert wp.sweep_parts(store, keys, t) == 4
    assert not [k for k in store.data if k.startswith(keys.base + "/res/")]


def test_a_tampered_or_incomplete_split_delivery_is_not_taken() -> None:
    store = CountingStore()
    keys, mac = wp.Keys(7), b"k" * 32
    entry = wp.Entry(0, tuple(range(40)))
    w = wp.Worker(store, keys, 1, mac)
    w.deliver(_big(0, entry, 1))
    p1 = store.data[keys.part(0, 1)]
    store.data[keys.part(0, 1)] = p1[:-1] + bytes([p1[-1] ^ 1])
    assert wp.take(store, keys, mac, 0) is None  # the digest does not match
    assert not [k for k in store.data if k.startswith(keys.res(0))]  # deleted anyway
    w.deliver(_big(0, entry, 1))
    del store.data[keys.part(0, 2)]
    assert wp.take(store, keys, mac, 0) is None  # a part missing: not waited for
    # A record moved to another ticket's key does not pass its seal.
    w.deliver(_big(0, entry, 1))
    store.data[keys.res(1)] = store.data.pop(keys.res(0))
    assert wp.take(store, keys, mac, 1) is None


def test_a_late_split_delivery_of_a_redone_chunk_is_dropped() -> None:
    store = CountingStore()
    keys = wp.Keys(8)
    chunks = wp.plan_chunks(40, 40)
    led = wp.Ledger(chunks, 2)
    w1, w2 = wp.Worker(store, keys, 1, None), wp.Worker(store, keys, 2, None)
    t1, t2 = w1.first(), w2.first()
    led.requeue(t1, "rank 1 hung", 1, {2})  # ticket 1 = the redo entry (one piece), rank 2's
    w2.deliver(_big(t2, led.entry_of(t2), 2))
    d2 = wp.take(store, keys, None, t2)
    assert d2 is not None
    assert led.accept(d2, {0, 2})[0] == list(range(40))
    w1.deliver(_big(t1, led.entry_of(t1), 1))  # rank 1 resumes, delivers late
    d1 = wp.take(store, keys, None, t1)
    assert d1 is not None
    assert d1.indices == tuple(range(40))
    assert led.accept(d1, {0, 2}) == ([], [])  # nothing added twice
    assert not [k for k in store.data if k.startswith(keys.base + "/res/")]


def test_a_future_ticket_of_a_rank_given_up_on_is_skipped() -> None:
    chunks = wp.plan_chunks(8, 4)  # 2 chunks: tickets 0, 1
    led = wp.Ledger(chunks, 2)
    # Rank 2 waits on ticket 2 (the first redo entry to come) and dies.
    assert led.requeue(2, "rank 2 died", 2, {0, 1}) == []
    assert 2 in led.skip
    # Rank 1 dies with chunk 1: its redo entry skips ticket 2 and is published again at 3.
    queued = led.requeue(1, "rank 1 died", 1, {0})
    assert len(queued) == 2
    assert led.published == 4
    assert led.entry_of(3).items == chunks[1].items
    assert 2 in led.requeued  # never an orphan
    assert led.orphans({0: 3}, {0}) == []


def test_orphans_only_once_every_live_rank_waits() -> None:
    chunks = wp.plan_chunks(12, 4)
    led = wp.Ledger(chunks, 2)
    led.accept(wp.Delivery(0, 0, chunks[0].items, [0] * 4), {0, 1})
    # Rank 1 still holds ticket 2: nothing is an orphan yet.
    assert led.orphans({0: 3, 1: 2}, {0, 1}) == []
    # Every live rank waits past the work; tickets 1 and 2 were never delivered (their
    # holder died between drawing a ticket and recording it).
    assert led.orphans({0: 3, 1: 4}, {0, 1}) == [1, 2]
    assert led.orphans({0: 3}, {0, 1}) == []  # rank 1 never drew: it may still


def test_an_item_that_raises_goes_to_another_rank_then_is_poison() -> None:
    chunks = wp.plan_chunks(4, 4)
    led = wp.Ledger(chunks, 2)
    d = wp.Delivery(0, 1, (0, 1, 3), [0, 1, 3], failures=((2, "ValueError", "bad"),))
    fresh, queued = led.accept(d, {0, 1, 2})
    assert fresh == [0, 1, 3]
    assert [(e.items, e.exclude) for e in queued] == [((2,), frozenset({1}))]
    # Rank 1 draws it: it declines (excluded), and the entry is published again.
    _, again = led.accept(wp.Delivery(1, 1, (), None, declined=True), {0, 1, 2})
    assert [e.items for e in again] == [(2,)]
    assert led.published == 3
    # It raises on rank 2 as well: a poison item, never published again.
    d2 = wp.Delivery(2, 2, (), [], failures=((2, "ValueError", "bad again"),))
    _, none = led.accept(d2, {0, 1, 2})
    assert none == []
    assert led.finished()
    assert led.failures == {2: wp.InferenceItemFailure(2, "ValueError", "bad again", (1, 2))}


def test_an_item_no_live_rank_may_run_is_poison_at_once() -> None:
    led = wp.Ledger(wp.plan_chunks(2, 2), 3)
    d = wp.Delivery(0, 1, (0,), [0], failures=((1, "KeyError", "x"),))
    _, queued = led.accept(d, {1})  # rank 1 is the only one left
    assert queued == []
    assert led.failures[1].ranks == (1,)
    assert led.finished()


def test_entries_and_deliveries_travel_intact_and_sealed() -> None:
    e = wp.Entry(3, (5, 9), frozenset({1, 2}), "rank 1 died")
    assert wp.Entry.from_json(e.to_json()) == e
    d = wp.Delivery(7, 2, (1, 2), [torch.ones(2), {"a": 1}], ((3, "E", "m"),), 0.5, "", False)
    key = b"k" * 32
    raw = wp.pack(key, "inf/1/res/7", d)
    back = wp.unpack(key, "inf/1/res/7", raw)
    assert back is not None
    assert back.indices == (1, 2)
    assert torch.equal(back.results[0], torch.ones(2))  # type: ignore[index]
    assert back.failures == ((3, "E", "m"),)
    assert wp.unpack(key, "inf/1/res/8", raw) is None  # moved to another key
    assert wp.unpack(key, "inf/1/res/7", raw[:-1] + b"x") is None  # tampered
    assert wp.unpack(None, "n", wp.pack(None, "n", d)) is not None


# -- files and resuming ----------------------------------------------------------------------
def test_files_manifest_and_ordered_reader(tmp_path: Path) -> None:
    costs = [float(i % 5) for i in range(10)]
    chunks = wp.plan_chunks(10, 3, costs)
    fp = wp.fingerprint(10, costs, 3)
    assert fp != wp.fingerprint(10, None, 3)
    assert fp != wp.fingerprint(10, costs, 4)
    wp.write_manifest(str(tmp_path), wp.manifest(10, chunks, 3, fp))
    m = wp.read_manifest(str(tmp_path))
    assert m is not None
    assert wp.chunks_of(m) == chunks
    for c in chunks:
        wp.write_file(str(tmp_path), f"chunk-{c.index:06d}.pt", c.items, [f"r{i}" for i in c.items])
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    got = list(rd.load_inference_results(tmp_path))
    assert got == [(i, f"r{i}") for i in range(10)]
    # Readable without the library: one torch.save per chunk.
    raw = (tmp_path / "chunk-000000.pt").read_bytes()
    data = torch.load(io.BytesIO(raw), weights_only=False)
    assert data == {"indices": list(chunks[0].items), "results": [f"r{i}" for i in chunks[0].items]}
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        list(rd.load_inference_results(tmp_path / "nothing"))


def test_item_failure_error_is_ours_a_runtime_error_and_pickles() -> None:
    f = rd.InferenceItemFailure(4, "ValueError", "bad", (1, 2))
    e = rd.ItemFailureError("1 item", failures=[f], results=[1, None])
    assert isinstance(e, rd.ResilientDDPError)
    assert isinstance(e, RuntimeError)
    back = pickle.loads(pickle.dumps(e))  # noqa: S301 - our own bytes
    assert back.failures == (f,)
    assert back.results == [1, None]
    assert str(back) == "1 item"


def test_progress_bar_shows_throughput_and_eta(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = iter([0.0, 2.0])
    monkeypatch.setattr("resilient_ddp.inference.inference.time.monotonic", lambda: next(clock))
    bar = _Bar(100)
    bar.update(50, 100)
    line = capsys.readouterr().err
    assert "50/100 items" in line
    assert "25 items/s over all ranks" in line
    assert "ETA 2 s" in line


def test_invalid_arguments_are_config_errors() -> None:
    data = list(range(3))
    for kwargs, said in [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 1, "chunk_size": 0}, "chunk_size"),
        ({"batch_size": 1, "max_item_failures": 0}, "max_item_failures"),
        ({"batch_size": 1, "on_rank_failure": "retry"}, "on_rank_failure"),
        ({"batch_size": 1, "costs": [1.0]}, "1 values for 3"),
    ]:
        with pytest.raises(rd.ConfigError, match=said):
            rd.distributed_inference(lambda b: b, data, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(rd.ConfigError, match="output_dir needs"):
        rd.distributed_inference(
            lambda b: b, data, batch_size=1, on_rank_failure="raise", output_dir="x"
        )


class _Jobs:
    def __init__(self, rec: dict[str, object] | None) -> None:
        self.rec = rec

    def inference(self) -> dict[str, object] | None:
        return self.rec


@pytest.mark.parametrize(
    ("rec", "becomes"),
    [
        (None, "waits"),  # no call ran: an admission may come
        ({"gen": 0, "call": 1, "world": 3, "elastic": True}, "waits"),  # eval in training
        ({"gen": 0, "call": 1, "closed": True, "elastic": True}, "waits"),
        ({"gen": 2, "call": 1, "world": 3, "elastic": False}, "guest"),
        ({"gen": 0, "call": 1, "closed": True, "elastic": False}, "exits"),
        ({"gen": 0, "call": "x", "world": 3, "elastic": False}, "waits"),  # not a record
        ({"gen": 0, "call": 1, "world": 3}, "waits"),  # older writer: assume elastic
    ],
)
def test_a_joiner_helps_only_with_the_inference_of_a_job_that_admits_nobody(
    rec: dict[str, object] | None, becomes: str
) -> None:
    from resilient_ddp.config import ResilienceConfig
    from resilient_ddp.inference import _guest
    from resilient_ddp.training import elastic

    cfg = ResilienceConfig()

    def look() -> object:
        return elastic._inference_to_help(_Jobs(rec), CountingStore(), 7, "gloo", cfg)  # type: ignore[arg-type]

    if becomes == "exits":
        with pytest.raises(SystemExit) as exited:
            look()
        assert exited.value.code == 0
        return
    got = look()
    if becomes == "waits":
        assert got is None
        return
    assert isinstance(got, _guest.Guest)
    assert (got.uid, got.generation, got.call, got.world_size) == (7, 2, 1, 3)


def test_a_lost_chunk_goes_back_in_one_piece_per_live_worker() -> None:
    """The survivors share a failed rank's chunk (consecutive slices, one per live worker
    but the failed one) instead of one of them running it alone at the end; it is still
    recorded as one piece of work redone."""
    led = wp.Ledger(wp.plan_chunks(40, 10), 2)  # 4 chunks: tickets 0-3
    entries = led.requeue(1, "rank 3 died", 3, {0, 1, 2, 3})
    assert [e.items for e in entries] == [
        tuple(range(10, 14)),
        tuple(range(14, 18)),
        tuple(range(18, 20)),
    ]
    assert [e.why for e in entries] == ["rank 3 died"] * 3
    assert len(led.redone) == 1
    assert led.redone[0]["items"] == 10
    assert led.published == 4 + 3
    # Fewer items than workers: one item a piece; nobody else alive: one piece.
    assert len(wp.Ledger(wp.plan_chunks(2, 2), 2).requeue(0, "x", 5, {0, 1, 2, 5})) == 2
    assert len(wp.Ledger(wp.plan_chunks(6, 6), 2).requeue(0, "x", 1, {1})) == 1
