"""Functions run inside the ranks spawned by the tests (importable by spawned children)."""

from __future__ import annotations

import faulthandler
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import resilient_ddp as rd
from resilient_ddp.testing import kill_self, stop_self

# Every child dumps its stacks if it is still running after this long: a hang in a test
# leaves evidence instead of silence.
CHILD_DUMP_AFTER_S = 50

OPS = ["all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object"]


def write_json(path: str | Path, record: Any) -> None:
    """Write ``record`` to ``path`` whole, then rename it there: a test that reads the file
    as soon as it exists never sees half of it (an empty file was read once, in CI)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def expected(op: str, world: int) -> Any:
    """What a healthy ``run_op(op, rank)`` returns, computed independently of the library."""
    if op == "all_reduce":
        return [float(sum(r + 1 for r in range(world)))] * 3
    if op == "broadcast":
        return [1.0, 1.0, 1.0]
    if op == "barrier":
        return None
    if op == "all_gather":
        return [[float(r)] * (r + 1) for r in range(world)]
    if op == "all_gather_object":
        return [{"rank": r, "tag": "x" * r} for r in range(world)]
    if op == "broadcast_object":
        return {"from": 0, "payload": [1, 2, 3]}
    raise ValueError(op)


def run_op(op: str, rank: int, **kw: Any) -> Any:
    if op == "all_reduce":
        return rd.all_reduce(torch.full((3,), float(rank + 1)), **kw).tolist()
    if op == "broadcast":
        return rd.broadcast(torch.full((3,), float(rank + 1)), src=0, **kw).tolist()
    if op == "barrier":
        return rd.barrier(**kw)
    if op == "all_gather":
        return [t.tolist() for t in rd.all_gather(torch.full((rank + 1,), float(rank)), **kw)]
    if op == "all_gather_object":
        return rd.all_gather_object({"rank": rank, "tag": "x" * rank}, **kw)
    if op == "broadcast_object":
        obj = {"from": 0, "payload": [1, 2, 3]} if rank == 0 else None
        return rd.broadcast_object(obj, src=0, **kw)
    raise ValueError(op)


def error_summary(e: BaseException, t0: float) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "ranks": list(getattr(e, "ranks", ())),
        "hosts": list(getattr(e, "hosts", ())),
        "op": getattr(e, "op", None),
        "seq": getattr(e, "seq", None),
        "exc_type": getattr(e, "exc_type", None),
        "exc_message": getattr(e, "exc_message", None),
        "stacks": [c.stack for c in getattr(e, "culprits", ())],
        "table": getattr(e, "table", None),
        "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None,
        "elapsed": time.monotonic() - t0,
        "message": str(e),
    }


def _init(cfg_kwargs: dict[str, Any]) -> None:
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg_kwargs))


def healthy(rank: int, world: int) -> dict[str, Any]:
    """Every collective once, with uneven shapes and objects."""
    _init({})
    out = {op: run_op(op, rank) for op in OPS}
    rd.destroy_process_group()
    return out


def all_done(tag: str, timeout_s: float = 30.0) -> None:
    """Wait on the store (not the backend) until every rank of the group has got here."""
    store = dist.distributed_c10d._get_default_store()
    key = f"test/all_done/{tag}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < dist.get_world_size():
        assert time.monotonic() < deadline, f"not every rank reached {tag!r} in {timeout_s} s"
        time.sleep(0.01)


def slow_data_loader(seconds: float) -> None:
    time.sleep(seconds)


def fault(rank: int, op: str, kind: str, culprit: int, cfg_kwargs: dict[str, Any]) -> Any:
    """Run ``op`` once healthy, then inject ``kind`` on ``culprit`` and run it again."""
    _init(cfg_kwargs)
    assert run_op(op, rank) == expected(op, dist.get_world_size())
    # A broadcast's receiver can finish before another has entered it: the culprit must
    # not fail until every rank has finished the healthy op (else that one is the op hit).
    all_done("healthy_op")
    if rank == culprit:
        if kind == "kill":
            kill_self()
        elif kind == "raise":
            raise ValueError("injected failure on the culprit")
        elif kind == "sleep":
            with rd.phase("data"):
                slow_data_loader(cfg_kwargs["op_timeout"] + 4)
        elif kind == "sigstop":
            stop_self()
    t0 = time.monotonic()
    try:
        run_op(op, rank)
        # A rank whose part of the op did not need the culprit (a broadcast receiver, say)
        # completes it legitimately; it must learn of the failure at its next op.
        rd.barrier()
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return "no error"


def stuck_rank_diagnosed_once(rank: int, culprit: int, cfg_kwargs: dict[str, Any]) -> Any:
    """``culprit`` stalls before an all_reduce; the others return their error's summary and
    how many diagnoses the generation has seen when they read it (after their own)."""
    from resilient_ddp.runtime import _runtime

    _init(cfg_kwargs)
    assert rd.all_reduce(torch.ones(1)).item() == dist.get_world_size()
    if rank == culprit:
        with rd.phase("data"):
            slow_data_loader(cfg_kwargs["op_timeout"] + 4)
    t0 = time.monotonic()
    try:
        rd.all_reduce(torch.ones(1))
    except rd.CollectiveTimeoutError as e:
        out = error_summary(e, t0)
        rt = _runtime.current()
        assert rt is not None
        out["diagnoses"] = rt.control.store.add("diag", 0)
        return out
    finally:
        rd.destroy_process_group()
    return "no error"


def diverge(rank: int, kind: str, validate: bool, cfg_kwargs: dict[str, Any]) -> Any:
    """Rank 1 issues something other than the rest at the second op."""
    _init({**cfg_kwargs, "validate": validate})
    run_op("all_reduce", rank)
    t0 = time.monotonic()
    try:
        t = torch.ones(4)
        if rank == 1 and kind == "shape":
            t = torch.ones(5)
        if rank == 1 and kind == "dtype":
            t = torch.ones(4, dtype=torch.float64)
        if rank == 1 and kind == "op":
            rd.broadcast(t, src=0)
        elif rank == 1 and kind == "skip":
            rd.all_reduce(torch.ones(2))  # skipped the [4] all_reduce, went on to the next
        else:
            rd.all_reduce(t)
            if kind == "skip":
                rd.all_reduce(torch.ones(2))
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return "no error"


def uneven_batches(rank: int, cfg_kwargs: dict[str, Any]) -> Any:
    """Rank 1 runs one batch fewer than the others, then leaves (the classic hang)."""
    _init(cfg_kwargs)
    batches = 3 if rank == 1 else 4
    t0 = time.monotonic()
    try:
        for _ in range(batches):
            t0 = time.monotonic()
            rd.all_reduce(torch.ones(2))
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()
    return "no error"


def late_rank(rank: int, delay: float, cfg_kwargs: dict[str, Any]) -> Any:
    """Rank 2 arrives ``delay`` seconds late, past one op timeout but within the budget."""
    _init(cfg_kwargs)
    t = torch.full((3,), float(rank + 1))
    if rank == 2:
        time.sleep(delay)
    rd.all_reduce(t)
    after = rd.all_reduce(torch.ones(1)).item()  # the group still pairs ops correctly
    rd.destroy_process_group()
    return {"value": t.tolist(), "after": after}


class _NeverCompletes:
    """A backend work handle that never completes: a data plane that lost this rank's op.

    Behaves as gloo's work does on a timed wait: sleeps the timeout, then raises
    ``RuntimeError("Operation timed out!")``, and stays incomplete.
    """

    def __init__(self) -> None:
        self._fut: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        time.sleep(timeout.total_seconds() if timeout else 3600)
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


def lost_op(rank: int, attempts: int, cfg_kwargs: dict[str, Any]) -> Any:
    """Rank 1's first all_reduce is lost in the data plane while every rank is alive."""
    _init(cfg_kwargs)
    real = dist.all_reduce
    if rank == 1:
        calls = {"n": 0}

        def flaky(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                return _NeverCompletes()
            return real(*args, **kwargs)

        dist.all_reduce = flaky  # type: ignore[assignment]
    t = torch.full((3,), float(rank + 1))
    t0 = time.monotonic()
    try:
        rd.all_reduce(t, retry=attempts)
        after = rd.all_reduce(torch.ones(1)).item()
        rt = rd.runtime._runtime.current()
        gen = rt.generation if rt is not None else -1
        return {"value": t.tolist(), "after": after, "generation": gen}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        dist.all_reduce = real
        rd.destroy_process_group()


def behind_queued_transfers(rank: int, queued: int, floats: int, cfg_kwargs: dict[str, Any]) -> Any:
    """Every rank queues ``queued`` all_reduces of ``floats`` floats on torch's own gloo
    (``async_op=True``), then one of the library's: every rank arrives at it at once, and
    it completes only when gloo has moved the data queued before it. Returns its value,
    how long it waited, and the error if it raised."""
    _init(cfg_kwargs)
    big = torch.ones(floats)
    rd.all_reduce(torch.ones(1))
    works = [dist.all_reduce(big, async_op=True) for _ in range(queued)]
    t = torch.ones(1)
    t0 = time.monotonic()
    try:
        rd.all_reduce(t)
        return {"value": t.item(), "waited": time.monotonic() - t0}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        for work in works:
            work.wait()
        rd.destroy_process_group()


class _FreezesWhileWaited(_NeverCompletes):
    """A backend work handle whose process freezes (SIGSTOP, every thread) once it has been
    waited on for ``after`` seconds: a rank that froze inside an op every rank arrived at
    (its peers had diagnosed it there, alive)."""

    def __init__(self, after: float) -> None:
        super().__init__()
        self._left = after

    def wait(self, timeout: timedelta | None = None) -> bool:
        step = timeout.total_seconds() if timeout else 3600
        self._left -= step
        if self._left <= 0:
            stop_self()
        return super().wait(timeout)


def frozen_in_op(rank: int, after: float, cfg_kwargs: dict[str, Any]) -> Any:
    """Every rank arrives at an all_reduce; rank 1 freezes in it ``after`` seconds later."""
    _init(cfg_kwargs)
    real = dist.all_reduce
    if rank == 1:
        dist.all_reduce = lambda *a, **k: _FreezesWhileWaited(after)  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        rd.all_reduce(torch.ones(3))
        return {"value": "completed"}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        dist.all_reduce = real
        rd.destroy_process_group()


def rebuild_after_a_failed_attempt(rank: int, cfg_kwargs: dict[str, Any]) -> Any:
    """Rank 0 tries to form generation 5 alone and times out; then both ranks form
    generation 6, which must not fail because of what rank 0's failed attempt left."""
    from resilient_ddp.group.membership import rebuild

    _init(cfg_kwargs)
    rt = rd.runtime._runtime.current()
    assert rt is not None
    store = rt.control_root
    try:
        if rank == 0:
            try:
                rebuild(rt, 5, timeout_s=0.5)
            except rd.RankFailureError as e:
                store.set("test/first_failed", type(e).__name__)
        store.wait(["test/first_failed"], timedelta(seconds=20))
        rebuild(rt, 6, timeout_s=5.0)
        total = rd.all_reduce(torch.ones(1)).item()
        return {
            "first": store.get("test/first_failed").decode(),
            "sum": total,
            "gen": rt.generation,
        }
    finally:
        rd.destroy_process_group()


def plain_torch_init(rank: int, kind: str) -> Any:
    """The user initialised torch.distributed themselves; rd ops attach on first use."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rd.set_config(rd.ResilienceConfig(op_timeout=5, heartbeat_interval=0.2, heartbeat_timeout=3))
    value = rd.all_reduce(torch.ones(2)).tolist()
    if rank == 2 and kind == "kill":
        kill_self()
    t0 = time.monotonic()
    try:
        rd.all_reduce(torch.ones(2))
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.set_config(None)
        rd.destroy_process_group()
    return {"value": value}


def torchrun_main() -> None:
    """Entry point of the script run under real torchrun (see test_torchrun)."""
    import json
    import sys

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    _init({"op_timeout": 2, "heartbeat_interval": 0.2, "heartbeat_timeout": 4})
    result: Any = {"value": run_op("all_reduce", rank)}
    if rank == 2:
        with rd.phase("data"):
            slow_data_loader(6)
    t0 = time.monotonic()
    try:
        run_op("all_reduce", rank)
    except rd.ResilientDDPError as e:
        result["error"] = error_summary(e, t0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    rd.destroy_process_group()


def standalone_main() -> None:
    """A rank started as a plain subprocess (no rd.spawn), as torchrun would start it.

    ``RD_TEST_FAULT`` (kill|stop) hits rank 2 after one op; ``RD_TEST_END``
    (destroy|return|exit3) says how the survivors end after catching the error.
    """
    import sys

    fault, end = os.environ["RD_TEST_FAULT"], os.environ["RD_TEST_END"]
    rank = int(os.environ["RANK"])
    _init({"op_timeout": 1.5, "heartbeat_interval": 0.2, "heartbeat_timeout": 4.0})
    rd.all_reduce(torch.ones(2))
    if rank == 2:
        kill_self() if fault == "kill" else stop_self()
    try:
        rd.all_reduce(torch.ones(2))
    except rd.RankFailureError as e:
        print(f"rank {rank} caught {type(e).__name__} naming {list(e.ranks)}", flush=True)
    if end in ("destroy", "exit3"):
        rd.destroy_process_group()
    if end == "exit3":
        sys.exit(3)
