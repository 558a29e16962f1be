"""Rank functions for the gather, state-sharing and distributed-inference tests."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd
from resilient_ddp.testing import kill_self, peak_rss_mib

from ._workers import _init, error_summary, slow_data_loader

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}
N_ITEMS = 103  # not divisible by 3 ranks


# -- expected values, computed without the library -------------------------------------------
def owner_of(i: int, world: int) -> int:
    """A deliberately uneven split: rank 0 gets every 5th item, the rest alternate."""
    if i % 5 == 0:
        return 0
    return 1 + i % (world - 1)


def item(i: int) -> torch.Tensor:
    """Item ``i``: a tensor whose shape depends on ``i``."""
    return torch.arange(i % 4 + 1, dtype=torch.float32).repeat(2, 1) + i


def obj(i: int) -> dict[str, Any]:
    return {"i": i, "pair": (i, str(i) * (i % 3)), "t": torch.tensor([i, -i]), "nested": [{}]}


def state(seed: int = 0) -> dict[str, Any]:
    """A checkpoint-like nest: model and optimizer state, odd dtypes and shapes."""
    g = torch.Generator().manual_seed(seed)
    model = {
        "w": torch.randn(37, 11, generator=g),
        "b": torch.randn(11, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "mask": torch.rand(13, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "ids": torch.randint(0, 1 << 40, (5,), generator=g),
    }
    optim = {
        "state": {0: {"exp_avg": torch.randn(37, 11, generator=g), "step": 3}},
        "param_groups": [{"lr": 0.1, "params": [0], "name": "main"}],
    }
    return {"model": model, "optimizer": optim, "epoch": 4, "tag": "ckpt"}


def same(a: Any, b: Any) -> bool:
    """Exact equality of nests of tensors (dtype, shape, bits) and plain values."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


# -- gather ----------------------------------------------------------------------------------
def gather_healthy(rank: int, world: int, n: int) -> Any:
    _init(FAST)
    try:
        mine = [i for i in range(n) if owner_of(i, world) == rank]
        out: dict[str, Any] = {}
        # Tensors of uneven shapes, dataset order restored, many small pieces.
        tensors = rd.gather_to_rank0(
            [item(i) for i in mine], indices=mine, num_items=n, chunk_bytes=200
        )
        # Nested objects with tensors inside, no indices: rank order.
        objects = rd.gather_to_rank0([obj(i) for i in mine])
        # Rows of one batch tensor (views): each arrives as its own row only.
        batch = torch.stack([torch.full((3,), float(i)) for i in mine]) if mine else None
        rows = rd.gather_to_rank0(list(batch) if batch is not None else [], indices=mine)
        # A rank with nothing to send.
        nothing = rd.gather_to_rank0([] if rank == 1 else [rank], indices=None)
        if rank != 0:
            return {"all_none": all(x is None for x in (tensors, objects, rows, nothing))}
        assert tensors is not None
        assert objects is not None
        assert rows is not None
        out["tensors_ok"] = same(tensors, [item(i) for i in range(n)])
        order = [i for r in range(world) for i in range(n) if owner_of(i, world) == r]
        out["objects_ok"] = same(objects, [obj(i) for i in order])
        out["rows_ok"] = same(rows, [torch.full((3,), float(i)) for i in range(n)])
        out["row_storage"] = max(
            r.untyped_storage().nbytes() for i, r in enumerate(rows) if owner_of(i, world) != 0
        )
        out["nothing"] = nothing
        return out
    finally:
        rd.destroy_process_group()


def _misbehave(  # noqa: PLR0911 - one return per fault
    kind: str, rank: int, data: list[Any], indices: Any
) -> tuple[list[Any], Any]:
    """The culprit's entries and indices for fault ``kind``."""
    extra: dict[str, Any] = {
        "unpicklable": {"fn": lambda: 0},  # a lambda cannot be pickled
        "fails_to_load": _FailsToLoad(),
    }
    if kind == "dtype":
        return [d.double() for d in data], indices
    if kind == "objects":
        return [{"x": 1}] * 3, indices
    if kind == "no_indices":
        return data, None
    if kind == "duplicate":
        return data, [0, 1, 2]  # rank 0's
    if kind == "missing":
        return data, [3 * rank, 3 * rank + 1, 100]
    if kind in extra:
        return [*data, extra[kind]], [*indices, 99]
    if kind == "kill_mid_stream":
        return [torch.zeros(1000)] * 5 + [_Bomb()] + data, list(range(100, 106)) + indices
    return data, indices


def gather_fault(rank: int, kind: str, culprit: int) -> Any:
    """Every rank gathers; ``culprit`` misbehaves in the way ``kind`` says."""
    _init(FAST)
    t0 = time.monotonic()
    try:
        data: list[Any] = [torch.full((2,), float(rank))] * 3
        indices: Any = [3 * rank + k for k in range(3)]
        if kind in ("kill_mid_stream", "unpicklable", "fails_to_load"):
            data = [{"value": d} for d in data]  # objects on every rank, like the culprit's
        if rank == culprit:
            if kind == "other_op":
                return error_summary_or(lambda: rd.barrier(validate=True), t0)
            if kind == "late":
                slow_data_loader(30)
            data, indices = _misbehave(kind, rank, data, indices)
        num_items = 9 if kind == "missing" else None
        t0 = time.monotonic()
        rd.gather_to_rank0(data, indices=indices, num_items=num_items, chunk_bytes=4096)
        return "no error"
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


def error_summary_or(fn: Any, t0: float) -> Any:
    try:
        fn()
        return "no error"
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)


class _FailsToLoad:
    """Pickles fine, raises when rank 0 unpickles it."""

    def __reduce__(self) -> Any:
        return (_explode, ("no such class on rank 0",))


def _explode(message: str) -> Any:
    raise LookupError(message)


class _Bomb:
    """Kills its process when pickled: a rank that dies in the middle of a gather."""

    def __reduce__(self) -> Any:
        kill_self()
        raise AssertionError("unreachable")


def gather_memory(rank: int, mib: int, chunk_mib: int, how: str) -> Any:
    """Peak RSS growth (MiB) on this rank while gathering ``mib`` MiB of its own rows.

    A first gather of two pieces' worth warms the process (the library's threads, malloc's
    arenas, lazily imported modules), so that the growth measured is the gather's own.
    The peak is ``VmHWM``, which also moves with malloc's caching and with code pages the
    kernel reclaimed and faults back (+14 MiB once in CI for a 4 MiB piece): it can tell
    a copy of the data, not a piece (``test_sending_pieces_holds_one_piece_of_python_memory``
    measures that exactly).
    """
    _init({"op_timeout": 30.0})
    try:
        warm = list(torch.randn(2 * chunk_mib * 256, 1024).unbind(0))
        if how == "ours":
            rd.gather_to_rank0(warm, chunk_bytes=chunk_mib << 20)
        del warm
        rows = list(torch.randn(mib * 256, 1024).unbind(0))  # 4 KiB per row
        rd.barrier()
        before = peak_rss_mib(reset=True)
        if how == "ours":
            got = rd.gather_to_rank0(rows, chunk_bytes=chunk_mib << 20)
        else:
            got = rd.all_gather_object(rows)
        grew = peak_rss_mib() - before
        return {"grew": grew, "before": before, "items": None if got is None else len(got)}
    finally:
        rd.destroy_process_group()


# -- state sharing ---------------------------------------------------------------------------
def share_state(rank: int, chunk_bytes: int) -> Any:
    _init(FAST)
    try:
        sent = state() if rank == 0 else None
        # Receivers follow the sender's chunk size, whatever they pass.
        got = rd.broadcast_state_dict(sent, src=0, chunk_bytes=chunk_bytes + 77 * rank)
        return {"same": same(got, state()), "is_sent": got is sent}
    finally:
        rd.destroy_process_group()


def load_shared(rank: int, path: str) -> Any:
    _init(FAST)
    t0 = time.monotonic()
    try:
        got = rd.load_and_broadcast(path, src=1)
        return {"same": same(got, state())}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    except FileNotFoundError as e:
        return {"type": type(e).__name__, "elapsed": time.monotonic() - t0}
    finally:
        rd.destroy_process_group()


def share_fault(rank: int, kind: str) -> Any:
    """``broadcast_state_dict`` from rank 0, which sends a sparse tensor (``"sparse"``) or
    dies first (``"dies"``)."""
    _init(FAST)
    t0 = time.monotonic()
    try:
        sent = None
        if rank == 0 and kind == "dies":
            kill_self()
        if rank == 0 and kind == "sparse":
            sent = {"w": torch.eye(3).to_sparse()}
        rd.broadcast_state_dict(sent, src=0)
        return "no error"
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


def send_state(rank: int, kind: str) -> Any:
    """``send_state_dict`` from rank 0 to rank 2 only; rank 1 takes no part. ``kind``:
    ``"ok"``, or ``"dies"`` (rank 2 dies first)."""
    from resilient_ddp.ops.checkpoint import send_state_dict

    _init(FAST)
    t0 = time.monotonic()
    try:
        if rank == 2 and kind == "dies":
            kill_self()
        got = send_state_dict(state() if rank == 0 else None, 0, [2], chunk_bytes=1000)
        after = rd.all_reduce(torch.ones(1)).item()  # one op on every rank: still in step
        return {"got": "none" if got is None else same(got, state()), "after": after}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


# -- distributed inference -------------------------------------------------------------------
class Items(torch.utils.data.Dataset[dict[str, Any]]):
    """Items of uneven cost: ``length`` features drawn from the item's own seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def cost(self, i: int) -> float:
        # Item 0 costs as much as a quarter of the rest: its rank gets far fewer items (and
        # runs far fewer forwards) than the others.
        return 300.0 if i == 0 else float(1 + (i * 7919) % 23)

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {"index": i, "x": torch.randn(8, generator=g), "label": i % 3}


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    # Buffers that differ from their defaults: a silently skipped sync would show.
    m[1].running_mean.uniform_(-1, 1)
    m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def reference(n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Predictions and logits computed on one process, item by item."""
    m = model()
    data = Items(n)
    with torch.no_grad():
        logits = [m(data[i]["x"][None])[0] for i in range(n)]
    return [int(t.argmax()) for t in logits], logits


def inference(
    rank: int, n: int, fail_at: int | None, pause: float = 0.0, on_rank_failure: str = "redo"
) -> Any:
    """Evaluate ``model()`` over ``Items(n)``; rank 2 raises at its batch ``fail_at``, or
    sleeps ``pause`` seconds in each of its batches."""
    _init(FAST)
    t0 = time.monotonic()
    try:
        ddp = rd.ResilientDDP(model())
        rd.barrier()  # the clock starts when every rank starts the loop
        t0 = time.monotonic()
        data = Items(n)
        calls: list[tuple[int, int]] = []
        batches = [0]
        items = [0]

        def fn(batch: dict[str, Any]) -> dict[str, Any]:
            batches[0] += 1
            items[0] += len(batch["index"])
            if fail_at is not None and rank == 2 and batches[0] == fail_at:
                raise ValueError("injected failure in fn")
            if rank == 2 and pause:
                slow_data_loader(pause)
            return {"index": batch["index"], "logits": ddp(batch["x"])}

        out = rd.distributed_inference(
            fn,
            data,
            batch_size=4,
            costs=[data.cost(i) for i in range(n)],
            progress=lambda done, total: calls.append((done, total)),
            on_rank_failure=on_rank_failure,  # type: ignore[arg-type]
        )
        if rank != 0:
            return {"none": out is None, "batches": batches[0], "items": items[0]}
        assert out is not None
        preds, logits = reference(n)
        return {
            "batches": batches[0],
            "items": items[0],
            "n": len(out),
            "in_order": [int(r["index"]) for r in out] == list(range(n)),
            "accuracy": sum(
                int(r["logits"].argmax()) == data[i]["label"] for i, r in enumerate(out)
            ),
            "ref_accuracy": sum(p == data[i]["label"] for i, p in enumerate(preds)),
            "max_diff": max(
                float((r["logits"] - t).abs().max()) for r, t in zip(out, logits, strict=True)
            ),
            "calls": calls,
        }
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


def gather_slow_receiver(rank: int, delay: float) -> Any:
    """Rank 0 takes ``delay`` seconds over each received piece: the senders wait longer
    than one wait slice (0.25 s) in every round, which must not fail the gather."""
    import resilient_ddp.inference.gather as gather_module

    _init(FAST)
    try:
        if rank == 0:
            parse = gather_module._parse

            def slow_parse(piece: torch.Tensor) -> Any:
                time.sleep(delay)
                return parse(piece)

            gather_module._parse = slow_parse  # type: ignore[assignment]
        mine = list(range(rank, 12, 3))
        out = rd.gather_to_rank0([item(i) for i in mine], indices=mine, chunk_bytes=1)
        return None if out is None else same(out, [item(i) for i in range(12)])
    finally:
        rd.destroy_process_group()
