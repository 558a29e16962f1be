"""Workers of tests/test_busy_mp.py: a late rank that is busy (its progress signals move)
or stuck (they do not), with the library's default timing (no op_timeout set)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import resilient_ddp as rd

from ._workers import error_summary


def _failed(e: BaseException, t0: float) -> dict[str, Any]:
    """A rank's error as the tests read it (error_summary's fields; ``waited``: seconds
    from ``t0``, just before the fault, to the error)."""
    summary = error_summary(e, t0)
    return {"ok": False, "waited": summary["elapsed"], **summary}


def _busy_cpu(seconds: float) -> None:
    """A CPU-bound Python loop, its stack moving (evaluation, a compile)."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x = (x * 31 + 7) % 1_000_003


def _busy_io(seconds: float, path: str) -> None:
    """Writes in small pieces with little CPU (a checkpoint to a slow disk)."""
    end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
            time.sleep(0.05)


def _marked(seconds: float) -> None:
    """Waits on something the signals cannot see, calling rd.progress() as it goes."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
        rd.progress()


def _deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns


#: Busy loops sharing the starved rank's CPU: it gets 1/(HOGS + 1) of it, below the CPU
#: share (20%) that counts CPU time alone as work.
HOGS = 6


def starved_cpu() -> int:
    """The CPU the starved rank's main thread is pinned to (and the hogs)."""
    return min(os.sched_getaffinity(0))


@contextlib.contextmanager
def hogs(cpu: int) -> Iterator[None]:
    """:data:`HOGS` busy loops pinned to ``cpu``, started by the test's own process: the
    starved rank's children would count as its work (the child-process signal)."""
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(HOGS)]
    try:
        yield
    finally:
        for h in procs:
            h.kill()
        for h in procs:
            h.wait()


def _starved(seconds: float) -> None:
    """Computes (one-threaded matmuls, its stack cycling on two lines) on a CPU it shares
    with :data:`HOGS` busy loops (:func:`hogs`, started by the test): an overloaded host,
    where it gets about 14% of a core. Only its main thread is pinned there: its watchdog
    still beats."""
    os.sched_setaffinity(0, {starved_cpu()})  # 0: this thread (the main one) only
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


class SlowItems(torch.utils.data.Dataset[torch.Tensor]):
    """Items that take ``seconds`` to make (a heavy decode or augmentation); ``starved``:
    made on the CPU of :func:`hogs`, where the worker gets about 14% of a core."""

    def __init__(self, seconds: float, starved: bool = False) -> None:
        self.seconds = seconds
        self.starved = starved

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.starved:
            os.sched_setaffinity(0, {starved_cpu()})
        _busy_cpu(self.seconds)
        return torch.ones(1)


def _slow_loader(seconds: float, starved: bool = False) -> None:
    """Waits for the first batch of a DataLoader whose one worker (started by the rank's
    own start method: under the test harness, a fork server's child, the rank's
    grandchild) takes ``seconds`` of CPU to make it. The main thread only polls the
    loader's queue meanwhile: its own signals do not move."""
    loader = torch.utils.data.DataLoader(SlowItems(seconds, starved), num_workers=1)
    assert next(iter(loader)).sum().item() == 1.0


def _dead_loader() -> None:
    q: queue.Queue[int] = queue.Queue()
    while True:
        try:
            q.get(timeout=1.0)  # a data loader's poll of a queue nobody fills
        except queue.Empty:
            continue


def _sleep_loop() -> None:
    while True:
        time.sleep(0.2)


def _livelock() -> None:
    """Spins on one line for ever: busy (its CPU time rises), never done."""
    x = 0
    while True:
        x += 1


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


#: What the late rank does, by kind: (seconds, a scratch file) -> None.
_KINDS: dict[str, Callable[[float, str], None]] = {
    "cpu": lambda s, _: _busy_cpu(s),
    "io": _busy_io,
    "marks": lambda s, _: _marked(s),
    "starved": lambda s, _: _starved(s),
    "workers": lambda s, _: _slow_loader(s),
    "workers_starved": lambda s, _: _slow_loader(s, starved=True),
    "deadlock": lambda s, _: _deadlock(),
    "loader": lambda s, _: _dead_loader(),
    "sleep": lambda s, _: _sleep_loop(),
    "livelock": lambda s, _: _livelock(),
    "stop": lambda s, _: _stop_self(),
}


def late(rank: int, culprit: int, kind: str, arg: float, tmp: str, cfg: dict[str, Any]) -> Any:
    """Three all_reduces; before the second, ``culprit`` does ``kind`` for ``arg`` s."""
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))
    t = torch.ones(1)
    rd.all_reduce(t)
    t0 = time.monotonic()
    try:
        if rank == culprit:
            _KINDS[kind](arg, os.path.join(tmp, f"ckpt{rank}"))
        t = torch.ones(1)
        rd.all_reduce(t)
        rd.all_reduce(t)
        return {"ok": True, "value": float(t.item()), "waited": time.monotonic() - t0}
    except rd.RankFailureError as e:
        return _failed(e, t0)
    finally:
        rd.destroy_process_group()


def gil_hog(rank: int, culprit: int, n: int, cfg: dict[str, Any]) -> Any:
    """``culprit`` runs one C call that holds the GIL (``sum(range(n))``: no bytecode
    runs, so no thread of its process gets the GIL) between two all_reduces; it takes
    longer than heartbeat_timeout. Returns how long it held the GIL on the culprit."""
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))
    try:
        t = torch.ones(1)
        rd.all_reduce(t)
        held = 0.0
        if rank == culprit:
            t0 = time.monotonic()
            sum(range(n))
            held = time.monotonic() - t0
        t = torch.ones(1)
        rd.all_reduce(t)
        return {"value": float(t.item()), "held": held}
    finally:
        rd.destroy_process_group()


def ddp_loop(rank: int, culprit: int, kind: str, seconds: float, cfg: dict[str, Any]) -> Any:
    """Six ResilientDDP steps; at step 3 ``culprit`` evaluates alone (``kind="eval"``, a
    CPU-bound loop outside any section, as rank-0-only evaluation inside a training loop
    is), deadlocks (``kind="deadlock"``) or does nothing more (any other kind). Returns
    the final weights or the error."""
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))
    torch.manual_seed(0)
    model = rd.ResilientDDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.monotonic()
    try:
        for step in range(6):
            if step == 3 and rank == culprit:
                if kind == "eval":
                    _busy_cpu(seconds)
                elif kind == "deadlock":
                    _deadlock()
            opt.zero_grad()
            x = torch.full((4, 8), float(rank + step))
            model(x).sum().backward()
            opt.step()
        return {"ok": True, "weight": model.module.weight.detach().tolist()}
    except rd.RankFailureError as e:
        return _failed(e, t0)
    finally:
        rd.destroy_process_group()
