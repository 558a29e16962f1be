"""Worker for the generation-leak test: kill-and-rejoin cycles at 4 ranks
(``on_failure="shrink"``), each process sampling its open descriptors, threads and RSS
once per cycle."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import faulthandler
import gc
import itertools
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd
from resilient_ddp.testing import kill_self

WORLD = 4
# Steps after a join (the world whole again) at which every process samples itself, at
# which the victim of the next cycle dies, and at which the job ends after the last cycle.
SAMPLE_AFTER = 2
KILL_AFTER = 3
END_AFTER = 4
VICTIM_RANK = WORLD - 1  # the newest rank: the joiner of the previous cycle (rank 3 at first)
# A debugging option: every sample lists the store's keys (the test then names those that
# stayed). Off by default: the lists are kept in every process's samples.
LIST_KEYS_ENV = "LEAK_TEST_LIST_KEYS"  # not RESILIENT_DDP_*: the library rejects unknown ones


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds() -> int:
    """Open descriptors, less the ``/proc`` files other threads read for a moment (the
    watchdog checks local peers through ``/proc/<pid>/stat``)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        n += not target.startswith("/proc/")
    return n


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


# The C library (malloc_trim, mallinfo2), loaded once; None where it cannot be found.
_LIBC = _load_libc()


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): byte counts over all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_kib() -> int | None:
    """Bytes (KiB) the C heap holds for live allocations, in every arena and in mmapped
    chunks (``uordblks + hblkhd``): what was allocated and not freed, whatever the
    allocator keeps around it. Python objects, tensors' storage and gloo's buffers are all
    allocated there. None where the C library has no ``mallinfo2``."""
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd) // 1024


# The library's helper threads that clean up after earlier generations: they release a
# retired process group (its sockets and threads) and delete old generations' store keys.
# Under load they may still run a step or two after a join: what they hold is on its way
# out, not leaked.
CLEANUP_THREADS = ("resilient_ddp-release", "resilient_ddp-forget")
# The longest a sample waits for them (it holds up the next step's collective, which the
# others wait for up to op_timeout, 4 s).
SETTLE_S = 2.0


def _settle() -> bool:
    """Wait (at most ``SETTLE_S``) for the clean-up threads still running to end; whether
    they all did."""
    deadline = time.monotonic() + SETTLE_S
    for t in threading.enumerate():
        if t.name in CLEANUP_THREADS:
            t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.name in CLEANUP_THREADS for t in threading.enumerate())


def resources() -> dict[str, int | None]:
    """This process's open descriptors, native threads (``/proc/self/task``: gloo's too),
    RSS as it is (KiB), RSS of live memory: after ``gc.collect()`` and glibc's
    ``malloc_trim(0)``, which hand back what was freed but kept by the garbage collector's
    generations or by the allocator (it is reused, not leaked), and the heap's live bytes
    (``_heap_kib``: not moved by the allocator's fragmentation, which RSS is). Descriptors
    and threads are the least of three reads 10 ms apart: another thread's short-lived
    ones do not count. Taken once the clean-up of earlier generations ended
    (``_settle``)."""
    settled = _settle()
    fds, threads = [], []
    for _ in range(3):
        fds.append(_fds())
        threads.append(len(os.listdir("/proc/self/task")))
        time.sleep(0.01)
    raw = _rss_kib()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return {
        # False: a clean-up thread outlived SETTLE_S (a loaded machine): its group's sockets
        # and threads are counted in this sample, on their way out.
        "settled": int(settled),
        "fds": min(fds),
        "threads": min(threads),
        "rss_kib": raw,
        "live_kib": _rss_kib(),
        "heap_kib": _heap_kib(),
    }


def _store_keys() -> dict[str, Any]:
    """Keys in the job's store (all of them: the library's and torch's): their number, and
    their names with ``LEAK_TEST_LIST_KEYS=1`` where the store can list them
    (``TCPStore.list_keys``), for the test to name the keys that stayed."""
    from resilient_ddp.runtime import _runtime

    rt = _runtime.current()
    assert rt is not None
    base = rt.control_root.base
    names = None
    if os.environ.get(LIST_KEYS_ENV) == "1":
        with contextlib.suppress(AttributeError, RuntimeError, NotImplementedError):
            names = sorted(base.list_keys())
    return {"keys": int(base.num_keys()), "key_names": names}


def _cfg() -> rd.ResilienceConfig:
    return rd.ResilienceConfig(
        on_failure="shrink",
        min_world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        heartbeat_timeout=timedelta(seconds=2),
        op_timeout=timedelta(seconds=4),
    )


def _joins(stats: dict[str, Any]) -> tuple[int, int]:
    """Cycles completed (the world grew back) and the step at which the last one did; the
    same on every rank (the history goes to joiners with the state)."""
    n, at = 0, 0
    for (_, a), (step, b) in itertools.pairwise(stats["world_size_history"]):
        if b > a:
            n, at = n + 1, step
    return n, at


def cycles(rank: int, n_cycles: int, deadline_s: float) -> dict[str, Any]:
    """Train until ``n_cycles`` kill-and-rejoin cycles are done. In each, the process of
    rank 3 dies by SIGKILL (before its forward on even cycles; 2 ms into the step, mostly
    inside the gradient all-reduce, on odd ones) and the launcher's replacement joins.

    Returns:
        ``{"pid", "uid", "samples": [{"cycle", "step", "fds", "threads", "rss_kib",
        "live_kib", "heap_kib", "keys", "key_names"}]}``: one sample per cycle this process
        saw complete, taken ``SAMPLE_AFTER`` steps after the join that completed it (on
        every rank at the same step). Each sample is also printed.
    """
    torch.set_num_threads(1)
    # Stacks of every thread, then exit, before the launcher's deadline.
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    rd.init_process_group("gloo", config=_cfg())
    torch.manual_seed(0)
    # Several gradient buckets: a failed pass leaves more than one op behind.
    model = rd.ResilientDDP(
        nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 1)),
        bucket_cap_mb=0.5,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(8, 64)
    y = x.sum(dim=1, keepdim=True)
    samples: list[dict[str, Any]] = []
    sampled = -1  # the last cycle sampled (a joiner samples the cycle that admitted it)
    dying = False
    while True:
        stats = model.resilience_stats
        done, at = _joins(stats)
        step, whole = stats["step"], stats["world_size"] == WORLD
        if whole and done and step >= at + SAMPLE_AFTER and done != sampled:
            sampled = done
            samples.append({"cycle": done, "step": step, **resources(), **_store_keys()})
            brief = {k: v for k, v in samples[-1].items() if k != "key_names"}
            print(f"[pid {os.getpid()} rank {stats['rank']}] {brief}", flush=True)
        if whole and done >= n_cycles and step >= at + END_AFTER:
            break
        if (
            whole
            and done < n_cycles
            and stats["rank"] == VICTIM_RANK
            and step >= at + KILL_AFTER
            and not dying
        ):
            if done % 2 == 0:
                kill_self()
            dying = True
            threading.Timer(0.002, kill_self).start()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.005)
    rd.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return {
        "pid": os.getpid(),
        "uid": int(os.environ.get("RESILIENT_DDP_UID", rank)),
        "samples": samples,
    }
