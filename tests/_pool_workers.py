"""Rank functions (and a script, for torchrun and env:// launches) for the pulled
distributed-inference engine: faults on one rank at a given share of the work.

Faults, on the culprit rank once it has run ``at`` items of its own (by item count, never
by time): ``kill`` (SIGKILL itself), ``raise`` (``fn`` raises on every item it runs from
then on: a broken rank that stays up), ``hang`` (blocks for good on a lock: no CPU, no
stack change) and ``stop`` (SIGSTOP: every thread frozen; rank 0 sends SIGCONT once it has
its results, and the resumed rank must add nothing).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import resilient_ddp as rd
from resilient_ddp.testing import kill_self, stop_self

FAST = {
    "heartbeat_interval": 0.1,
    "heartbeat_timeout": 1.5,
    "op_timeout": 1.5,
    "stuck_window": 1.5,
}
N = 160  # 20 chunks of 8
BATCH = 4
CHUNK = 8
ITEM_S = 0.002  # fn's time per item
POISON = 37  # the item that raises everywhere in the poison case


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    """Item ``i`` is ``[i, i % 7]``; item ``bad`` cannot be read (a corrupt sample)."""

    def __init__(self, n: int, bad: int = -1) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise OSError(f"sample {i} is corrupt")
        return torch.tensor([float(i), float(i % 7)])


def expected(i: int) -> torch.Tensor:
    """What one process computes for item ``i`` (the reference)."""
    return torch.tensor([float(i), float(i % 7)]) * 3 + 1


def reference(n: int) -> list[torch.Tensor]:
    return [expected(i) for i in range(n)]


def _init(cfg: dict[str, Any]) -> None:
    faulthandler.dump_traceback_later(90, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))


def wait_for(flag: str | Path, limit_s: float, *, mark: bool = False) -> None:
    """Wait (at most ``limit_s``) for file ``flag`` to exist; with ``mark``, as a rank that
    works (``rd.progress()`` while it waits: its peers must not name it stuck)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(flag) and time.monotonic() < deadline:
        if mark:
            rd.progress()
        time.sleep(0.002)


def make_fn(
    rank: int, kind: str, culprit: int, at: int, hang_lock: threading.Lock, flag: str = ""
) -> Any:
    """``fn`` for ``rank``. The culprit injects ``kind`` in its first batch that holds an
    item ``>= at`` (chunks are drawn in index order: about ``at / n`` of the work is done
    then). With ``flag`` (a file path), the other ranks hold any batch with an item
    ``>= at`` until the culprit has written ``flag``, just before its fault: the culprit is
    sure to reach the fault point, whatever the machine's load (a condition, no timing)."""
    fired = [False]

    def fn(batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[0]
        late = bool((batch[:, 0] >= at).any())
        if rank == culprit and late and not fired[0] and kind in FAULTS:
            fired[0] = True
            if flag:
                Path(flag).write_text(str(os.getpid()))
            if kind == "kill":
                kill_self()
            elif kind == "hang":
                hang_lock.acquire()
                hang_lock.acquire()  # never returns: no CPU, no I/O, the same stack
            elif kind == "stop":
                stop_self()
        if rank == culprit and kind == "raise" and fired[0]:
            raise ValueError(f"rank {rank} is broken")
        if rank != culprit and late and flag and kind in FAULTS:
            wait_for(flag, 30)
        if kind == "poison" and bool((batch[:, 0] == POISON).any()):
            raise ValueError(f"item {POISON} is poison")
        time.sleep(ITEM_S * n)
        return batch * 3 + 1

    return fn


FAULTS = ("kill", "raise", "hang", "stop")


def summary_dict(s: rd.InferenceSummary | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "items": s.items,
        "items_done": s.items_done,
        "resumed": s.resumed_items,
        "chunks": s.chunks,
        "chunks_redone": s.chunks_redone,
        "redone": [dict(x) for x in s.redone],
        "failed_ranks": {int(k): v for k, v in s.failed_ranks.items()},
        "poison": [(f.index, f.exc_type, f.message, list(f.ranks)) for f in s.poison],
        "per_rank": {int(k): v for k, v in s.per_rank_items.items()},
        "text": s.text,
    }


def check(out: list[Any] | None, n: int) -> dict[str, Any]:
    assert out is not None
    ref = reference(n)
    bad = [i for i in range(n) if not torch.equal(out[i], ref[i])]
    return {"n": len(out), "bad": bad[:10], "ok": not bad and len(out) == n}


def pool_fault(
    rank: int,
    kind: str,
    culprit: int,
    at: int,
    flag: str = "",
    n: int = N,
    on_rank_failure: str = "redo",
) -> Any:
    """Run the pulled inference with fault ``kind`` on ``culprit`` at item ``at``."""
    _init(FAST)
    t0 = time.monotonic()
    output_dir = None
    try:
        lock = threading.Lock()
        fn = make_fn(rank, kind, culprit, at, lock, flag)
        if kind == "mismatch" and rank == culprit:
            n -= CHUNK  # another dataset on this rank
        with_warnings: list[str] = []
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = rd.distributed_inference(
                    fn,
                    Numbers(n, POISON if kind.startswith("poison_load") else -1),
                    batch_size=BATCH,
                    chunk_size=CHUNK,
                    num_workers=1 if kind == "poison_load_workers" else 0,
                    progress=False,
                    output_dir=output_dir,
                    on_rank_failure=on_rank_failure,  # type: ignore[arg-type]
                )
            except rd.ItemFailureError as e:
                return {
                    "type": "ItemFailureError",
                    "failures": [
                        (f.index, f.exc_type, f.message, list(f.ranks)) for f in e.failures
                    ],
                    "results": check(
                        [expected(i) if i == POISON else r for i, r in enumerate(e.results)], n
                    ),
                    "poison_none": e.results[POISON] is None,
                    "summary": summary_dict(rd.last_inference_summary()),
                }
            with_warnings = [
                str(w.message) for w in caught if "distributed_inference" in str(w.message)
            ]
        if kind == "stop" and rank == 0:
            _resume(culprit)
        if rank != 0:
            return {"none": out is None, "elapsed": time.monotonic() - t0}
        return {
            **check(out, n),
            "summary": summary_dict(rd.last_inference_summary()),
            "warnings": with_warnings,
            "elapsed": time.monotonic() - t0,
        }
    except rd.ResilientDDPError as e:
        if kind == "stop" and rank == 0:
            _resume(culprit)
        return {
            "type": type(e).__name__,
            "ranks": list(getattr(e, "ranks", [])),
            "message": str(e),
            "elapsed": time.monotonic() - t0,
        }
    finally:
        rd.destroy_process_group()


def _resume(culprit: int) -> None:
    """SIGCONT the stopped culprit (its pid from the runtime's identity records)."""
    from resilient_ddp.runtime import _runtime

    rt = _runtime.current()
    assert rt is not None
    pid = int(rt.infos[culprit]["pid"])
    os.kill(pid, signal.SIGCONT)


def resume_job(rank: int, output_dir: str, stop_after: int | None) -> Any:
    """A job on ``output_dir``; with ``stop_after``, every rank dies (SIGKILL) once it has
    run that many items of its own (the whole job killed). Returns rank 0's summary."""
    _init(FAST)
    try:
        fn = make_fn(
            rank,
            "kill" if stop_after is not None else "none",
            rank,
            stop_after or 0,
            threading.Lock(),
        )
        out = rd.distributed_inference(
            fn,
            Numbers(N),
            batch_size=BATCH,
            chunk_size=CHUNK,
            progress=False,
            output_dir=output_dir,
        )
        if rank != 0:
            return None
        return {**check(out, N), "summary": summary_dict(rd.last_inference_summary())}
    finally:
        rd.destroy_process_group()


def stream(rank: int, n: int, stop_after: int | None = None) -> Any:
    """iter_inference: rank 0 gets (index, result) in order; the others nothing. With
    ``stop_after``, rank 0 stops reading after that many results (a break)."""
    _init(FAST)
    try:
        got = []
        for i, r in rd.iter_inference(
            make_fn(rank, "none", -1, 0, threading.Lock()),
            Numbers(n),
            batch_size=BATCH,
            chunk_size=CHUNK,
            progress=False,
        ):
            got.append((i, r))
            if stop_after is not None and len(got) == stop_after:
                break
        if stop_after is not None:
            return {"count": len(got), "first": [i for i, _ in got]}
        if rank != 0:
            return {"count": len(got)}
        return {
            "indices_in_order": [i for i, _ in got] == list(range(n)),
            **check([r for _, r in got], n),
        }
    finally:
        rd.destroy_process_group()


BIG = 64 * 1024  # floats per item in big_results: 256 KiB each


def big_results(rank: int, n: int, chunk: int) -> Any:
    """distributed_inference whose results are 256 KiB an item: a chunk of ``chunk`` items
    delivers ``chunk / 4`` MiB (over the libuv TCPStore's 8 MiB value limit at 40)."""
    _init(FAST)
    try:

        def fn(batch: torch.Tensor) -> torch.Tensor:
            return batch[:, :1].repeat(1, BIG)  # item i: BIG copies of i

        out = rd.distributed_inference(
            fn, Numbers(n), batch_size=BATCH, chunk_size=chunk, progress=False
        )
        if rank != 0:
            return {"none": out is None}
        assert out is not None
        bad = [i for i in range(n) if not torch.equal(out[i], torch.full((BIG,), float(i)))]
        s = rd.last_inference_summary()
        assert s is not None
        return {"n": len(out), "bad": bad[:10], "per_rank": dict(s.per_rank_items)}
    finally:
        rd.destroy_process_group()


# -- as a script: torchrun or env:// (rank 0 hosts the store) -------------------------------
def script_job(rank: int, out: Path, fault: str, attempt: int) -> Any:
    """Rank 1 dies at half the work of attempt 0; with ``output_dir`` (torchrun, where the
    agent restarts the whole group) the next attempt resumes from the files."""
    _init(FAST)
    try:
        kind = fault if attempt == 0 else "none"
        fn = make_fn(rank, kind, 1, N // 2, threading.Lock(), str(out / "fired"))
        output_dir = str(out / "results") if os.environ.get("POOL_OUTPUT_DIR") else None
        result = rd.distributed_inference(
            fn,
            Numbers(N),
            batch_size=BATCH,
            chunk_size=CHUNK,
            progress=False,
            output_dir=output_dir,
        )
        if rank != 0:
            return {"none": result is None}
        return {**check(result, N), "summary": summary_dict(rd.last_inference_summary())}
    except rd.ResilientDDPError as e:
        return {"type": type(e).__name__, "ranks": list(getattr(e, "ranks", [])), "message": str(e)}
    finally:
        rd.destroy_process_group()


def main() -> None:
    out, fault = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    value = script_job(rank, out, fault, attempt)
    (out / f"result{attempt}-{rank}.json").write_text(json.dumps(value, default=str))


if __name__ == "__main__":
    main()


GUEST_AT = 16  # rank 1 dies in its first batch past this item
GUEST_HOLD = 64  # ranks 0 and 2 run no item past this one before the replacement worked


def pool_guest(rank: int, flags: str, late: bool = False) -> Any:
    """Rank 1 is killed early; ``rd.spawn(restarts=1)`` starts a replacement, which must
    help with the running call (as a guest). Ranks 0 and 2 hold any batch past
    ``GUEST_HOLD`` until the replacement has run a batch (a file flag; they mark progress
    meanwhile), so it always finds work, whatever the machine's load.

    ``late``: rank 1 dies in its first batch of the last three chunks instead (the others
    hold those until it fired), and nobody waits for the replacement: the call is over
    long before it has started, and it must end with code 0."""
    joiner = os.environ.get("RESILIENT_DDP_JOINER", "") not in ("", "0")
    guest_flag, fired, done = Path(flags) / "guest", Path(flags) / "fired", Path(flags) / "done"
    if late and joiner:
        wait_for(done, 45)  # pinned: it asks to join only once rank 0 has its results
    _init(FAST)
    at = N - 3 * CHUNK if late else GUEST_AT  # 3 chunks: ranks 0 and 2 hold one each
    try:

        def fn(batch: torch.Tensor) -> torch.Tensor:
            top = int(batch[:, 0].max())
            if rank == 1 and not joiner and top >= at:
                fired.write_text(str(os.getpid()))
                kill_self()
            if joiner:
                guest_flag.write_text(str(os.getpid()))
                # Slower than rank 0's looks (every heartbeat interval): it is seen holding
                # a ticket (a look that read a state it has not got would block).
                time.sleep(3 * FAST["heartbeat_interval"])
            elif late and top >= at:
                wait_for(fired, 45, mark=True)
            elif not late and top >= GUEST_HOLD:
                wait_for(guest_flag, 45, mark=True)
            time.sleep(ITEM_S * batch.shape[0])
            return batch * 3 + 1

        out = rd.distributed_inference(
            fn, Numbers(N), batch_size=BATCH, chunk_size=CHUNK, progress=False
        )
        if joiner:
            try:
                rd.barrier()
            except rd.ConfigError as e:
                no_group = str(e)
            return {"guest": True, "none": out is None, "no_group": no_group}
        if rank != 0:
            return {"none": out is None}
        done.write_text("1")
        return {**check(out, N), "summary": summary_dict(rd.last_inference_summary())}
    finally:
        rd.destroy_process_group()
