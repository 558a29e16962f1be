"""Progress signals: is a rank that has not arrived at a collective working, or stuck?

A clock alone cannot tell a rank that evaluates for ten minutes from one that deadlocked.
What moves can: the watchdog samples, once per tick, signals of this process's main thread
that change while it works, and publishes how long none of them has moved (``idle``) with
its heartbeat. A peer waiting for this rank judges from that:

* **CPU time** of the main thread (``/proc/self/task/<tid>/stat``, utime + stime): a
  Python loop, a long C call (a matmul, a compile), garbage collection. It counts only
  when it rose by at least :data:`CPU_SHARE` of the time since the last sample, so that a
  thread that polls (``queue.get`` with a timeout, a sleep loop) is not read as working.
* **Runnable** but short of CPU: on an overloaded host a working thread gets a small share
  of a core and spends the rest waiting for one (its run-queue wait,
  ``/proc/self/task/<tid>/schedstat``). It counts when the thread is running at the
  sample and its CPU time and run-queue wait together rose by at least
  :data:`RUNNABLE_SHARE` of the time since the last sample: a thread that polls sleeps
  most of the time, however loaded the host.
* **Python stack** of the main thread: a fingerprint of its frames (file, function,
  line). It counts only when it is one not seen among the last :data:`STACK_MEMORY`
  distinct ones: a loop that sleeps and polls cycles through a few fingerprints, and is
  not progress.
* **I/O** of the main thread (``/proc/self/task/<tid>/io``, rchar + wchar): a checkpoint
  being written, a shard being read.
* **Waiting on the disk**: the main thread is in uninterruptible sleep (state ``D``), as
  a write to a slow or throttled disk is.
* **Child processes**: the CPU time of this process's live descendants (its DataLoader
  workers, a compile's worker pool, a tool it waits on), read through
  ``/proc/<pid>/task/<tid>/children``, counted like the main thread's: :data:`CPU_SHARE`
  of one core, or on an overloaded host their CPU time and run-queue wait together
  :data:`RUNNABLE_SHARE` of the time (workers short of CPU). A main thread that waits
  for its loader's first batch while the workers start (each a new interpreter that
  imports torch) or compute a heavy batch is working.
* **Marks**: :func:`resilient_ddp.progress` calls, for work none of the above can see.
* **CUDA**: a tracked CUDA event completed since the last sample (work queued by the main
  thread advanced).

Pure bookkeeping over injectable readers and a clock: no store, no process group.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from resilient_ddp.control._control import proc_stat

__all__ = ["progress"]

#: Share of one core that the main thread's CPU time must have used since the last sample
#: for the rise to count as progress (a poll loop uses far less; work uses far more).
CPU_SHARE = 0.2
#: Share of the time since the last sample that the main thread must have spent running or
#: waiting for a CPU (and be running at the sample) to count as working though starved.
RUNNABLE_SHARE = 0.5
#: Distinct stack fingerprints remembered: a new one that is among them is a cycle.
STACK_MEMORY = 16
#: Frames of the main thread that make a fingerprint (innermost first).
STACK_DEPTH = 12
#: Generations of descendants whose CPU time counts (a DataLoader's workers under a fork
#: server are the rank's grandchildren).
CHILD_DEPTH = 3

_marks = [0]  # rd.progress() calls in this process
_ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def progress() -> None:
    """Tell the library that this rank is making progress.

    Call it from work that none of the automatic signals sees (the main thread's CPU time,
    its Python stack, its I/O; see :doc:`failure-model`): for example a loop that waits on
    a remote service and gets answers. While a rank calls it, its peers wait for it as
    for a busy rank, up to ``busy_timeout``. Costs one integer increment; never blocks.
    """
    _marks[0] += 1


@dataclass(frozen=True)
class Sample:
    """One reading of the main thread's signals.

    Attributes:
        cpu_s: CPU time of the main thread (seconds), or -1.0 where unreadable.
        state: Its scheduler state (``R``, ``S``, ``D``, ``T``...), ``"?"`` if unknown.
        stack: Fingerprint of its Python frames (0 if it has none).
        io: Bytes it read and wrote (rchar + wchar), or -1 where unreadable.
        marks: :func:`progress` calls so far.
        gpu: Tracked CUDA events completed so far.
        where: Its innermost frame outside the library, ``"fn() at file.py:41"``.
        inside: Whether its innermost frame is the library's own (it waits in one of the
            library's bounded waits: elastic recovery, an admission, a state transfer).
        waited_s: How long it waited for a CPU while runnable (run-queue wait, seconds),
            or -1.0 where unreadable.
        children_s: CPU time of the process's live descendants (seconds,
            :func:`read_children`), or -1.0 where unreadable.
        children_waited_s: Their run-queue wait (seconds), or -1.0 where unreadable.
    """

    cpu_s: float
    state: str
    stack: int
    io: int
    marks: int
    gpu: int
    where: str
    inside: bool = False
    waited_s: float = -1.0
    children_s: float = -1.0
    children_waited_s: float = -1.0


def _task_path(tid: int, name: str) -> str:
    return f"/proc/self/task/{tid}/{name}"


def read_stat(tid: int, path: str | None = None) -> tuple[str, float]:
    """The scheduler state and CPU time (seconds) of thread ``tid`` of this process (or of
    the process whose ``stat`` file is ``path``); ``("?", -1.0)`` where ``/proc`` cannot
    tell."""
    stat = proc_stat(path or _task_path(tid, "stat"))
    if stat is None:
        return "?", -1.0
    try:
        fields = stat[1]
        return fields[0], (int(fields[11]) + int(fields[12])) / _ticks_per_s
    except (ValueError, IndexError):
        return "?", -1.0


def read_waited(tid: int, path: str | None = None) -> float:
    """How long thread ``tid`` of this process (or the task whose ``schedstat`` file is
    ``path``) waited for a CPU while runnable (seconds); -1.0 where ``/proc`` cannot tell
    (a kernel without scheduler statistics)."""
    try:
        with open(path or _task_path(tid, "schedstat"), "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return -1.0


def read_io(tid: int, path: str | None = None) -> int:
    """Bytes thread ``tid`` of this process (or the task whose ``io`` file is ``path``)
    read and wrote (rchar + wchar); -1 where ``/proc`` cannot tell (or denies it)."""
    try:
        with open(path or _task_path(tid, "io"), "rb") as f:
            total = 0
            for line in f.read().decode(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar"):
                    total += int(value)
            return total
    except (OSError, ValueError):
        return -1


def read_children(
    pid: str = "self", proc: str = "/proc", depth: int = CHILD_DEPTH
) -> tuple[float, float]:
    """The CPU time and the run-queue wait (seconds) of the live descendants of process
    ``pid``, up to ``depth`` generations: its DataLoader workers, a fork server and the
    workers it forked, a subprocess it waits on. A descendant that exited no longer counts
    (the sums may fall).

    Reads ``<proc>/<pid>/task/<tid>/children`` for each thread (a child belongs to the
    thread that forked it), and each child's ``stat`` and ``schedstat`` (its main thread's
    wait for a CPU): a few small reads per thread; never blocks.

    Args:
        pid: The process (``"self"``; a test passes a fake tree's pid).
        proc: Where ``/proc`` is (a test passes a fake one).
        depth: Generations to count.

    Returns:
        ``(cpu_s, waited_s)``; -1.0 for either where ``/proc`` cannot tell (a kernel
        without the ``children`` files, or without scheduler statistics).
    """
    total = waited = 0.0
    readable = False
    children = waits = 0  # children seen; of them, whose run-queue wait was read

    def walk(parent: str, left: int) -> None:
        nonlocal total, waited, readable, children, waits
        try:
            tids = os.listdir(f"{proc}/{parent}/task")
        except OSError:
            return  # it exited
        for tid in tids:
            try:
                with open(f"{proc}/{parent}/task/{tid}/children", "rb") as f:
                    kids = f.read().split()
            except OSError:
                continue  # the thread ended, or no such file on this kernel
            readable = True
            for kid in kids:
                child = kid.decode()
                _, cpu = read_stat(0, f"{proc}/{child}/stat")
                if cpu >= 0:
                    total += cpu
                wait = read_waited(0, f"{proc}/{child}/schedstat")
                children += 1
                if wait >= 0:
                    waited, waits = waited + wait, waits + 1
                if left > 1:
                    walk(child, left - 1)

    walk(pid, depth)
    if not readable:
        return -1.0, -1.0
    # A child that exited between the listing and the reads has nothing to read; a kernel
    # without scheduler statistics has nothing for any child.
    return total, waited if waits or not children else -1.0


#: Name prefixes of the threads that move a gloo collective's data: gloo's transport
#: loop (``gloo_tcp_loop``) and torch's gloo workers (``pt_gloo_runloop``).
DATA_PLANE_THREADS = ("gloo", "pt_gloo")


def data_plane(task_dir: str = "/proc/self/task") -> int | None:
    """How much this process's data plane has done so far: the bytes its threads read and
    wrote plus their CPU ticks, summed into one count that rises while a collective's data
    moves (by the network, or by a reduction).

    Only the threads named in :data:`DATA_PLANE_THREADS` count: the watchdog's heartbeats
    and a store hosted in this process move bytes too, and must not read as a collective's
    progress. Costs a few small reads per thread of the process; never blocks.

    Args:
        task_dir: The process's thread directory (a test passes a fake one).

    Returns:
        The count, or None when the process has no such thread (no gloo group: NCCL moves
        its data on the GPU, where ``/proc`` cannot see it) or ``/proc`` cannot tell.
    """
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    total = 0
    seen = False
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm", "rb") as f:
                name = f.read().decode(errors="replace").strip()
        except OSError:
            continue  # the thread ended
        if not name.startswith(DATA_PLANE_THREADS):
            continue
        io = read_io(0, f"{task_dir}/{tid}/io")
        _, cpu = read_stat(0, f"{task_dir}/{tid}/stat")
        if io < 0 or cpu < 0:
            continue
        seen = True
        total += io + round(cpu * _ticks_per_s)
    return total if seen else None


def fingerprint(frame: FrameType | None, depth: int = STACK_DEPTH) -> int:
    """A hash of the innermost ``depth`` frames from ``frame`` (code and line of each)."""
    parts: list[tuple[int, int]] = []
    while frame is not None and len(parts) < depth:
        parts.append((id(frame.f_code), frame.f_lineno or 0))
        frame = frame.f_back
    return hash(tuple(parts))


def where(frame: FrameType | None, internal: Callable[[str], bool]) -> str:
    """The innermost frame from ``frame`` whose file is not ``internal``, as
    ``"fn() at file.py:41"`` ("" if none)."""
    while frame is not None:
        code = frame.f_code
        if not internal(code.co_filename):
            return f"{code.co_name}() at {os.path.basename(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class CudaProgress:
    """Completed CUDA work of the main thread, never synchronised: at each step the
    training thread records an event on its current stream (:meth:`record`); the watchdog
    counts the recorded events that completed (:meth:`completed`, ``Event.query()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[Any] = deque(maxlen=64)
        self._done = 0

    def record(self) -> None:
        """Record an event on the current CUDA stream (a no-op without CUDA)."""
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        with self._lock:
            self._pending.append(event)

    def completed(self) -> int:
        """How many recorded events have completed so far (queried, not waited for)."""
        with self._lock:
            while self._pending and self._pending[0].query():
                self._pending.popleft()
                self._done += 1
            return self._done


cuda_progress = CudaProgress()


class Tracker:
    """When the main thread's signals last moved, from one :class:`Sample` per tick.

    Args:
        read: Takes a sample (the watchdog's reads of ``/proc`` and the main thread's
            frame; tests pass their own).
        clock: Monotonic seconds (injectable).
    """

    def __init__(self, read: Callable[[], Sample], clock: Callable[[], float] = time.monotonic):
        self._read = read
        self._clock = clock
        self.last: Sample | None = None
        self._last_t = clock()
        self.moved_t = self._last_t
        #: Which signals moved at the last sample where any did.
        self.moving: tuple[str, ...] = ()
        self._stacks: deque[int] = deque(maxlen=STACK_MEMORY)

    def observe(self, *, baseline: bool = False) -> Sample:
        """Take a sample and note which signals moved since the previous one.

        Args:
            baseline: Take the sample as a new starting point, with no movement counted
                (the thread just left a collective: its stack and counters changed because
                it left, not because it works).

        Returns:
            The sample.
        """
        now = self._clock()
        s = self._read()
        prev, elapsed = self.last, max(now - self._last_t, 1e-6)
        self.last, self._last_t = s, now
        if prev is None or baseline:
            if s.stack not in self._stacks:
                self._stacks.append(s.stack)
            if prev is None:
                self.moved_t = now
            elif cpu := _cpu_signal(prev, s, elapsed):
                # CPU time used since is work all the same (a C call that held the GIL
                # from the op's end until now: no sample could be taken in between).
                self.moved_t = now
                self.moving = (cpu,)
            return s
        cpu = _cpu_signal(prev, s, elapsed)
        moved = [cpu] if cpu else []
        if s.stack != prev.stack and s.stack not in self._stacks:
            moved.append("stack")
        if s.io >= 0 and prev.io >= 0 and s.io != prev.io:
            moved.append("io")
        if _children_signal(prev, s, elapsed):
            moved.append("children")
        if s.state == "D":
            moved.append("disk")
        if s.marks != prev.marks:
            moved.append("marks")
        if s.gpu != prev.gpu:
            moved.append("gpu")
        if s.stack not in self._stacks:
            self._stacks.append(s.stack)
        if moved:
            self.moved_t = now
            self.moving = tuple(moved)
        return s

    def idle(self) -> float:
        """Seconds since a signal last moved (as of the last sample)."""
        return max(0.0, self._last_t - self.moved_t)

    def restart(self) -> None:
        """Count idleness from now (the rank just left a collective: waiting in one is not
        idleness)."""
        self.moved_t = self._last_t = self._clock()


def _worked(
    cpu: tuple[float, float], waited: tuple[float, float], elapsed: float, running: bool
) -> str | None:
    """The rule both CPU signals follow, over a counter's two readings ``(before, now)``
    (seconds; -1.0: unreadable): ``"cpu"`` when the CPU time rose by :data:`CPU_SHARE` of
    the ``elapsed`` seconds; else ``"runnable"`` when, ``running`` at the second reading,
    CPU time and run-queue wait together rose by :data:`RUNNABLE_SHARE` of them (work on a
    host that gives it little CPU: a poll loop sleeps most of the time, however loaded the
    host); else None."""
    if min(cpu) < 0:
        return None
    used = cpu[1] - cpu[0]
    if used >= CPU_SHARE * elapsed:
        return "cpu"
    if not running or min(waited) < 0:
        return None
    return "runnable" if used + waited[1] - waited[0] >= RUNNABLE_SHARE * elapsed else None


def _cpu_signal(prev: Sample, s: Sample, elapsed: float) -> str | None:
    """The main thread's CPU signal from ``prev`` to ``s`` (:func:`_worked`; it must be
    running at ``s`` to count as starved)."""
    return _worked((prev.cpu_s, s.cpu_s), (prev.waited_s, s.waited_s), elapsed, s.state == "R")


def _children_signal(prev: Sample, s: Sample, elapsed: float) -> bool:
    """Whether the process's descendants worked from ``prev`` to ``s`` (:func:`_worked`
    over their summed CPU time and run-queue wait; the sum of several processes has no one
    state to ask)."""
    cpu = (prev.children_s, s.children_s)
    waited = (prev.children_waited_s, s.children_waited_s)
    return _worked(cpu, waited, elapsed, running=True) is not None


class WaitHistory:
    """How long this rank's completed ops waited, per kind of op (the name without its
    index: every ``ddp_bucket<i>`` is one kind), the first :data:`WARMUP` of each kind
    apart (first steps compile, allocate and rebuild buckets)."""

    #: Ops of a kind not learned from (warm-up).
    WARMUP = 2
    #: Waits needed before a kind's window follows them.
    MIN_SAMPLES = 8
    #: The window is this multiple of the kind's 95th-percentile wait.
    MARGIN = 1.5

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._seen: dict[str, int] = {}
        self._waits: dict[str, deque[float]] = {}

    @staticmethod
    def kind(name: str) -> str:
        """``"ddp_bucket"`` for ``"ddp_bucket3"``: the name without its trailing digits."""
        return name.rstrip("0123456789")

    def add(self, name: str, seconds: float) -> None:
        """Note a completed op ``name`` that waited ``seconds``."""
        k = self.kind(name)
        self._seen[k] = n = self._seen.get(k, 0) + 1
        if n > self.WARMUP:
            self._waits.setdefault(k, deque(maxlen=self._keep)).append(seconds)

    def window(self, name: str, base: float) -> float:
        """The stuck window for op ``name``: ``base``, or :data:`MARGIN` times the 95th
        percentile of its kind's waits when that is longer (seconds)."""
        waits = self._waits.get(self.kind(name))
        if waits is None or len(waits) < self.MIN_SAMPLES:
            return base
        ordered = sorted(waits)
        q95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return max(base, self.MARGIN * q95)


#: Serialises :func:`thread_frame`'s switching of the collector (two watchdog-side readers
#: must not re-enable it under each other).
_frames_lock = threading.Lock()


def thread_frame(ident: int) -> FrameType | None:
    """The current frame of thread ``ident`` of this process (None if it has ended).

    ``sys._current_frames()`` holds the interpreter's thread-list lock while it builds the
    frame objects; on CPython before 3.12 an allocation there can start a garbage
    collection that frees a ``threading.local``, whose clean-up takes that same lock: the
    reading thread deadlocks with the GIL held and the whole process freezes (seen with
    3 ranks: every rank froze in ``init_process_group``). The collector is off for the
    call (microseconds) and back on after, unless it was already off.
    """
    with _frames_lock:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames().get(ident)
        finally:
            if was_enabled:
                gc.enable()


def inside(frame: FrameType | None, ours: Callable[[str], bool]) -> bool:
    """Whether the innermost frame from ``frame`` outside ``threading`` (a wait on an
    event or a lock goes through it) is in a file that is ``ours``."""
    while frame is not None and frame.f_code.co_filename == threading.__file__:
        frame = frame.f_back
    return frame is not None and ours(frame.f_code.co_filename)


def sampler(
    main_ident: int, main_tid: int, internal: Callable[[str], bool], ours: Callable[[str], bool]
) -> Callable[[], Sample]:
    """The reader of this process's main thread for a :class:`Tracker`.

    Args:
        main_ident: ``threading.get_ident()`` of the main thread (for its frame).
        main_tid: Its kernel thread id (``threading.get_native_id()``, for ``/proc``).
        internal: Whether a file is skipped by ``where`` (the library's, ``threading``).
        ours: Whether a file is the library's own (for ``inside``).
    """

    def read() -> Sample:
        frame = thread_frame(main_ident)
        state, cpu = read_stat(main_tid)
        children = read_children()
        return Sample(
            cpu_s=cpu,
            waited_s=read_waited(main_tid),
            children_s=children[0],
            children_waited_s=children[1],
            state=state,
            stack=fingerprint(frame),
            io=read_io(main_tid),
            marks=_marks[0],
            gpu=cuda_progress.completed(),
            where=where(frame, internal),
            inside=inside(frame, ours),
        )

    return read


#: How a peer's message says what moved (``busy`` reports).
SIGNAL_TEXT = {
    "cpu": "its CPU time still rising",
    "runnable": "running, though short of CPU (an overloaded host)",
    "stack": "its Python stack moving",
    "io": "its I/O moving",
    "children": "its child processes working (DataLoader workers?)",
    "disk": "waiting on the disk",
    "marks": "calling rd.progress()",
    "gpu": "its CUDA work completing",
}


def describe(moving: tuple[str, ...] | list[str]) -> str:
    """``"its CPU time still rising, its Python stack moving"`` for ``("cpu", "stack")``."""
    return ", ".join(SIGNAL_TEXT.get(m, m) for m in moving)
