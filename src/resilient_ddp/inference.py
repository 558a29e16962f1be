"""Distributed inference in one call: balanced shards, a global progress bar, ordered results.

:func:`distributed_inference` shards a dataset with :class:`BalancedDistributedSampler`
(each item exactly once, per-rank cost balanced), runs a function on each local batch with
no collective between batches, shows on rank 0 the progress of *all* ranks (read from the
heartbeats every rank already publishes, not from per-batch collectives), and gathers the
results to rank 0 in dataset order with :func:`gather_to_rank0`.

A :class:`ResilientDDP` model may be called inside ``fn``: while the loop runs, its
forward calls the wrapped module directly, without DDP's per-forward buffer broadcast, which
would otherwise pair up calls of ranks that run different numbers of batches (a hang, or
buffers silently mixed between ranks).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ._runtime import Runtime
from ._wire import to_cpu
from .collectives import Duration, Op
from .errors import ConfigError
from .gather import gather_to_rank0
from .process_group import ensure_runtime
from .sampler import BalancedDistributedSampler

__all__ = ["distributed_inference"]

ProgressArg = bool | Callable[[int, int], None]
_REFRESH_S = 0.5


def distributed_inference(
    fn: Callable[[Any], Any],
    dataset: Dataset[Any],
    *,
    batch_size: int,
    costs: Sequence[float] | torch.Tensor | None = None,
    cost_fn: Callable[[int], float] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    progress: ProgressArg = True,
    timeout: Duration = None,
) -> list[Any] | None:
    """Run ``fn`` over ``dataset`` on every rank and return all results on rank 0, in order.

    Collective over the default group: every rank calls it with the same dataset and
    arguments. Each rank processes its balanced share of the items in batches of at most
    ``batch_size`` under ``torch.no_grad()``; no collective runs between batches, so ranks
    finish their shares independently and meet once, in the final gather.

    Args:
        fn: Called with one collated batch; returns one result per item of the batch: a
            tensor whose first dimension is the batch size (one row per item), a list of
            per-item results, or a dict or tuple of those (split into one dict or tuple per
            item).
        dataset: A map-style dataset (``len`` and ``dataset[i]``), the same on every rank.
        batch_size: Most items per call of ``fn``.
        costs: Predicted cost of each item (e.g. its length), used to balance the ranks'
            total work; see :class:`BalancedDistributedSampler`.
        cost_fn: ``cost_fn(index)`` instead of ``costs``.
        collate_fn: As DataLoader's (default: ``default_collate``).
        num_workers: DataLoader worker processes per rank.
        progress: ``True`` shows a progress bar of all ranks' items on rank 0 (stderr);
            a callable is called on rank 0 with ``(items_done, items_total)`` about twice a
            second instead, from a background thread, and once more with ``(total,
            total)`` from the calling thread at the end; ``False`` shows nothing.
        timeout: How long a rank may go without finishing a batch while the others wait
            for it at the end, and the final gather's per-piece timeout (timedelta or
            seconds; default ``config.op_timeout``). A slow rank that keeps finishing batches
            is waited for as long as it needs.

    Returns:
        On rank 0, a list with one result per dataset item, ``result[i]`` for
        ``dataset[i]``; tensors on the CPU (each batch's results are moved there as soon
        as ``fn`` returns). ``None`` on the other ranks.

    Raises:
        ConfigError: Invalid arguments, or ``fn`` returned something that does not split
            into one result per item (checked on the rank where it happened).
        RankFailureError: A rank crashed, raised, left or hung; names it (raised in the
            final gather on the ranks that were still healthy).
        CollectiveMismatchError: Ranks returned results of different kinds or dtypes.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size should be >= 1, got {batch_size}")
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"distributed_inference needs a map-style dataset with len(), got "
            f"{type(dataset).__name__}"
        )
    rt = ensure_runtime()
    total = len(dataset)
    sampler = BalancedDistributedSampler(
        dataset, dist.get_world_size(), rt.rank, costs=costs, cost_fn=cost_fn
    )
    plan = sampler.plan()
    mine = plan[rt.rank]
    item_costs = sampler._q  # the costs as the plan saw them (None: all equal)
    if item_costs is not None:
        # Most costly first: a batch holds items of similar cost (less padding), and the
        # long items do not all come last.
        mine = mine[torch.argsort(item_costs[mine], descending=True, stable=True)]
    order = mine.tolist()
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    loader: DataLoader[Any] = DataLoader(
        dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers
    )
    results: list[Any] = []
    step, phase = rt.step, rt.phase
    with _Progress(rt, total, progress) as bar:
        with _local_forward(rt), torch.no_grad():
            for i, (items, batch) in enumerate(zip(batches, loader, strict=True)):
                rt.step, rt.phase = i, "inference"
                # On the CPU at once: results of a long run must not pile up on the GPU.
                results.extend(_split(to_cpu(fn(batch)), len(items)))
                bar.advance(len(items))
        rt.phase = "waiting for peers"
        _await_peers(rt, [len(p) for p in plan], timeout)
        rt.phase = "gather"
        out = gather_to_rank0(results, indices=order, num_items=total, timeout=timeout)
    # Left as they were on an error: the failure report says where this rank was.
    rt.step, rt.phase = step, phase
    return out


def _await_peers(rt: Runtime, shares: list[int], timeout: Duration) -> None:
    """Return once every rank has processed its share.

    Ranks with lighter shares wait here rather than in the gather, so that a slow rank
    that keeps finishing batches is never timed out, while a stuck one still is: an
    unfinished rank whose count (from its heartbeat) stays the same for ``timeout`` is
    named with its stack, as a collective would name it.

    The store load does not grow with the world twice over: each finished rank counts
    itself on one counter and the waiting ranks read that counter; only the first rank to
    finish reads the heartbeats of the ranks still at work (to tell slow from stuck), and
    its verdict reaches the others as a failure report.

    Raises:
        CollectiveTimeoutError: An unfinished rank made no progress for ``timeout``.
        RankFailureError: A rank crashed, raised or left meanwhile.
    """
    o = Op("distributed_inference", timeout=timeout, retry=1, validate=False)
    try:
        if rt.watchdog is not None:
            rt.watchdog.poke()  # publish this rank's final count now, not at the next beat
        call, world = rt.inference_calls, rt.world_size
        finished = rt.control.finish_inference(call)
        watcher = finished == 1
        interval = min(0.1, rt.config.heartbeat_interval.total_seconds())
        seen: dict[int, tuple[int, float]] = {}
        pending = [r for r in range(world) if r != rt.rank]
        while finished < world:
            if rt.failed_for(o.seq):
                raise rt.build_error(o.name, o.seq)
            if watcher:
                states = rt.control.read_states(pending)
                now = time.monotonic()
                for r in pending:
                    done = _done(states.get(r, {}), call)
                    if seen.get(r, (-1, 0.0))[0] != done:
                        seen[r] = (done, now)
                pending = [r for r in pending if seen[r][0] < shares[r]]
                if any(now - seen[r][1] > o.attempt_s for r in pending):
                    o.raise_timeout(rt.diagnose(rt.control, o.name, o.seq))
            time.sleep(interval)
            finished = rt.control.inference_finished(call)
    finally:
        o.end()


@contextmanager
def _local_forward(rt: Runtime) -> Iterator[None]:
    """While active, :class:`ResilientDDP` forwards run the wrapped module alone."""
    rt.local_forward += 1
    try:
        yield
    finally:
        rt.local_forward -= 1


def _split(out: Any, n: int) -> list[Any]:
    """One result per item from what ``fn`` returned for a batch of ``n`` items."""
    if isinstance(out, torch.Tensor):
        if out.dim() >= 1 and out.shape[0] == n:
            return list(out.unbind(0))
    elif isinstance(out, list):
        if len(out) == n:
            return out
    elif isinstance(out, dict):
        columns = {k: _split(v, n) for k, v in out.items()}
        return [{k: col[i] for k, col in columns.items()} for i in range(n)]
    elif isinstance(out, tuple):
        columns_t = [_split(v, n) for v in out]
        return [tuple(col[i] for col in columns_t) for i in range(n)]
    raise ConfigError(
        f"fn returned {_describe(out)} for a batch of {n} item(s); it should return one "
        "result per item: a tensor with first dimension {n}, a list of {n}, or a dict or "
        "tuple of those".replace("{n}", str(n))
    )


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, list):
        return f"a list of {len(out)}"
    return f"a {type(out).__name__}"


def _done(state: dict[str, Any], call: int) -> int:
    """Items a rank's heartbeat says it processed in inference call ``call`` (0 while its
    heartbeat still shows an earlier call)."""
    progress = state.get("progress")
    if isinstance(progress, list) and progress[:1] == [call]:
        return int(progress[-1])
    return 0


class _Progress:
    """Rank 0's view of every rank's progress, drawn from the heartbeats.

    Each rank's count is published by its watchdog (no collective); rank 0 runs a thread
    that reads all of them about twice a second, until the final gather is over.
    """

    def __init__(self, rt: Runtime, total: int, progress: ProgressArg) -> None:
        self.rt = rt
        self.total = total
        self.done = 0
        self.callback: Callable[[int, int], None] | None = None
        if rt.rank == 0 and progress is not False and total > 0:
            self.callback = progress if callable(progress) else _Bar(total).update
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def __enter__(self) -> _Progress:
        self.rt.inference_calls += 1  # every rank counts its calls alike
        self.call = self.rt.inference_calls
        self.rt.progress = [self.call, 0]
        if self.callback is not None:
            self._thread = threading.Thread(
                target=self._run, name="resilient_ddp-progress", daemon=True
            )
            self._thread.start()
        return self

    def advance(self, n: int) -> None:
        self.done += n
        self.rt.progress = [self.call, self.done]

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if exc[0] is None and self.callback is not None:
                self.callback(self.total, self.total)
        self.rt.progress = None

    def _run(self) -> None:
        control = self.rt.connection("progress")
        ranks = list(range(self.rt.world_size))
        last = -1
        while not self._stop.wait(_REFRESH_S):
            try:
                states = control.read_states(ranks)
            except Exception:  # noqa: BLE001 - the bar is best effort; the watchdog reports
                continue
            done = self.done + sum(_done(s, self.call) for r, s in states.items() if r != 0)
            if done != last:
                last = done
                assert self.callback is not None
                self.callback(min(done, self.total), self.total)


class _Bar:
    """A one-line text progress bar on stderr (a line per 10% when stderr is not a tty)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.next_decile = 1

    def update(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.start
        frac = done / total if total else 1.0
        rate = done / elapsed if elapsed > 0 else 0.0
        line = (
            f"inference [{'#' * int(frac * 30):<30}] {done}/{total} items "
            f"({frac:.0%}, {rate:.0f} items/s, {elapsed:.1f} s)"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= total else ""))
            sys.stderr.flush()
        elif frac * 10 >= self.next_decile or done >= total:
            self.next_decile = int(frac * 10) + 1
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
