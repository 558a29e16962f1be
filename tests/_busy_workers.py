"""Workers of tests/test_busy_mp.py: a late rank that is busy (its progress signals move)
or stuck (they do not), with the library's default timing (no op_timeout set)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
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


def _starved(seconds: float) -> None:
    """Computes (one-threaded matmuls, its stack cycling on two lines) on a CPU it shares
    with :data:`HOGS` busy loops: an overloaded host, where it gets about 14% of a core.
    Only its main thread is pinned there: its watchdog still beats."""
    cpu = min(os.sched_getaffinity(0))
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(HOGS)]
    try:
        os.sched_setaffinity(0, {cpu})  # 0: this thread (the main one) only
        torch.set_num_threads(1)
        a = torch.randn(256, 256)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


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


def late(rank: int, culprit: int, kind: str, arg: float, tmp: str, cfg: dict[str, Any]) -> Any:
    """Three all_reduces; before the second, ``culprit`` does ``kind`` for ``arg`` s."""
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**cfg))
    t = torch.ones(1)
    rd.all_reduce(t)
    t0 = time.monotonic()
    try:
        if rank == culprit:
            if kind == "cpu":
                _busy_cpu(arg)
            elif kind == "io":
                _busy_io(arg, os.path.join(tmp, f"ckpt{rank}"))
            elif kind == "marks":
                _marked(arg)
            elif kind == "starved":
                _starved(arg)
            elif kind == "deadlock":
                _deadlock()
            elif kind == "loader":
                _dead_loader()
            elif kind == "sleep":
                _sleep_loop()
            elif kind == "livelock":
                _livelock()
            elif kind == "stop":
                _stop_self()
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
