"""Progress signals (resilient_ddp.detection._progress): what counts as the main thread moving.

Table tests over a scripted reader and an injected clock (no sleeping), plus the real
readers of /proc on this process's own threads.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import resilient_ddp as rd
from resilient_ddp.base import _traces
from resilient_ddp.control._control import ControlPlane
from resilient_ddp.detection import _progress as pg

BASE = pg.Sample(cpu_s=1.0, state="S", stack=1, io=100, marks=0, gpu=0, where="f() at x.py:1")


class Script:
    """A reader that returns scripted samples and a clock that advances 1 s per sample."""

    def __init__(self, samples: list[pg.Sample]) -> None:
        self.samples = samples
        self.i = -1
        self.t = 0.0

    def read(self) -> pg.Sample:
        self.i += 1
        return self.samples[self.i]

    def clock(self) -> float:
        return self.t

    def run(self) -> pg.Tracker:
        tr = pg.Tracker(self.read, clock=self.clock)
        for _ in self.samples:
            self.t += 1.0
            tr.observe()
        return tr


def _seq(*changes: dict[str, object]) -> list[pg.Sample]:
    out, cur = [], BASE
    for ch in changes:
        cur = replace(cur, **ch)  # type: ignore[arg-type]
        out.append(cur)
    return out


@pytest.mark.parametrize(
    ("case", "samples", "idle", "moving"),
    [
        # Nothing moves: a deadlock on a lock, a dead data loader's queue.get.
        ("frozen", _seq({}, {}, {}, {}, {}), 4.0, ()),
        # CPU rising by half a core a second: a Python loop or a C call.
        ("cpu", _seq({}, {"cpu_s": 1.5}, {"cpu_s": 2.0}, {"cpu_s": 2.5}), 0.0, ("cpu",)),
        # A poll loop: a tick of CPU now and then is not work.
        ("poll", _seq({}, {"cpu_s": 1.01}, {"cpu_s": 1.02}, {"cpu_s": 1.03}), 3.0, ()),
        # New stacks: work with little CPU.
        ("stack", _seq({}, {"stack": 2}, {"stack": 3}, {"stack": 4}), 0.0, ("stack",)),
        # A sleep-and-check loop cycles through two stacks: not progress after the first.
        (
            "cycle",
            _seq({}, {"stack": 2}, {"stack": 1}, {"stack": 2}, {"stack": 1}),
            3.0,
            ("stack",),
        ),
        # I/O moving (a checkpoint written, a shard read).
        ("io", _seq({}, {"io": 200}, {"io": 300}), 0.0, ("io",)),
        # Blocked on a slow disk (uninterruptible sleep).
        ("disk", _seq({}, {"state": "D"}, {"state": "D"}), 0.0, ("disk",)),
        ("marks", _seq({}, {"marks": 1}, {"marks": 1}), 1.0, ("marks",)),
        ("gpu", _seq({}, {"gpu": 1}, {"gpu": 2}), 0.0, ("gpu",)),
        # The main thread waits (a DataLoader's queue) while its workers compute: their
        # CPU time (half a core a second, summed over the live descendants) is work.
        (
            "children",
            _seq({"children_s": 0.0}, {"children_s": 0.5}, {"children_s": 1.0}),
            0.0,
            ("children",),
        ),
        # Workers on an overloaded host: 10% of a core each second, waiting for one the
        # rest of the time.
        (
            "children_starved",
            _seq(
                {"children_s": 0.0, "children_waited_s": 0.0},
                {"children_s": 0.1, "children_waited_s": 0.9},
                {"children_s": 0.2, "children_waited_s": 1.8},
            ),
            0.0,
            ("children",),
        ),
        # Children that poll on that host: a little CPU, a little wait: not work.
        (
            "children_poll",
            _seq(
                {"children_s": 0.0, "children_waited_s": 0.0},
                {"children_s": 0.02, "children_waited_s": 0.2},
                {"children_s": 0.04, "children_waited_s": 0.4},
            ),
            2.0,
            (),
        ),
        # A child that only polls, and a child that exited (the sum fell): not work.
        (
            "children_idle",
            _seq({"children_s": 5.0}, {"children_s": 5.01}, {"children_s": 0.0}),
            2.0,
            (),
        ),
        # Unreadable /proc: CPU and I/O never count.
        ("unreadable", _seq({"cpu_s": -1.0, "io": -1}, {}, {}), 2.0, ()),
        # An overloaded host: a working thread gets 10% of a core and waits for one the
        # rest of the time (running at each sample). Seen in CI: a rank computing in
        # F.linear named stuck because its CPU time rose too slowly.
        (
            "starved",
            _seq(
                {"state": "R", "waited_s": 0.0},
                {"state": "R", "cpu_s": 1.1, "waited_s": 0.9},
                {"state": "R", "cpu_s": 1.2, "waited_s": 1.8},
            ),
            0.0,
            ("runnable",),
        ),
        # A poll loop on that host: caught running at a sample, but it sleeps most of
        # the time (little CPU, little run-queue wait): not work.
        (
            "starved_poll",
            _seq(
                {"waited_s": 0.0},
                {"state": "R", "cpu_s": 1.01, "waited_s": 0.2},
                {"state": "R", "cpu_s": 1.02, "waited_s": 0.4},
            ),
            2.0,
            (),
        ),
        # Waiting for a CPU, but asleep at the sample (it woke and slept in between).
        (
            "starved_asleep",
            _seq({"waited_s": 0.0}, {"cpu_s": 1.1, "waited_s": 0.9}),
            1.0,
            (),
        ),
        # No scheduler statistics: the run-queue wait never counts.
        (
            "no_schedstat",
            _seq({"state": "R"}, {"state": "R", "cpu_s": 1.1}, {"state": "R", "cpu_s": 1.2}),
            2.0,
            (),
        ),
    ],
)
def test_what_counts_as_moving(
    case: str, samples: list[pg.Sample], idle: float, moving: tuple[str, ...]
) -> None:
    tr = Script(samples).run()
    assert tr.idle() == pytest.approx(idle), case
    assert tr.moving == moving, case


def test_restart_counts_idleness_from_now() -> None:
    s = Script(_seq({}, {}, {}, {}))
    tr = pg.Tracker(s.read, clock=s.clock)
    for _ in range(3):
        s.t += 1.0
        tr.observe()
    assert tr.idle() == pytest.approx(2.0)
    tr.restart()
    s.t += 1.0
    tr.observe()
    assert tr.idle() == pytest.approx(1.0)


def test_a_baseline_ignores_the_stack_but_not_cpu_time() -> None:
    """After a collective the stack changed because the thread left it (not work), but
    CPU time used meanwhile (a C call that held the GIL, no sample possible) is work."""
    for change, idle in (({"stack": 2, "io": 999}, 1.0), ({"cpu_s": 3.0}, 0.0)):
        s = Script(_seq({}, change))
        tr = pg.Tracker(s.read, clock=s.clock)
        s.t += 1.0
        tr.observe()
        s.t += 1.0
        tr.observe(baseline=True)
        assert tr.idle() == pytest.approx(idle), change


def test_progress_marks_are_seen() -> None:
    before = pg._marks[0]
    rd.progress()
    rd.progress()
    assert pg._marks[0] == before + 2


def test_describe() -> None:
    assert pg.describe(("cpu", "io")) == "its CPU time still rising, its I/O moving"


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def test_real_readers_see_a_spinning_thread_and_a_blocked_one() -> None:
    """The /proc readers on two threads of this process: one spins, one waits on a lock."""
    stop = threading.Event()
    lock = threading.Lock()
    lock.acquire()
    spinner = threading.Thread(target=_spin, args=(stop,))
    blocked = threading.Thread(target=lock.acquire)
    spinner.start()
    blocked.start()
    try:
        assert spinner.native_id is not None
        assert blocked.native_id is not None
        _, cpu0 = pg.read_stat(spinner.native_id)
        state_b, cpu_b0 = pg.read_stat(blocked.native_id)
        # Spin until the spinner has used measurable CPU (no sleep: poll its own counter).
        cpu1 = cpu0
        for _ in range(10_000_000):
            _, cpu1 = pg.read_stat(spinner.native_id)
            if cpu1 - cpu0 >= 0.05:
                break
        assert cpu1 - cpu0 >= 0.05
        state_b, cpu_b1 = pg.read_stat(blocked.native_id)
        assert state_b == "S"
        assert cpu_b1 - cpu_b0 < 0.05
        assert pg.read_io(blocked.native_id) >= 0
    finally:
        stop.set()
        lock.release()
        spinner.join()
        blocked.join()


def test_fingerprint_and_where_of_this_frame() -> None:
    frame = sys._getframe()
    caller = frame.f_back  # its line does not move while this test runs
    assert caller is not None
    a = pg.fingerprint(caller)
    assert a == pg.fingerprint(caller)
    assert a != pg.fingerprint(caller.f_back)
    here = pg.where(frame, internal=lambda f: False)
    assert here.startswith("test_fingerprint_and_where_of_this_frame() at test_progress_unit.py:")


def test_every_module_of_the_package_is_the_librarys_own() -> None:
    # What `inside` and `where` rest on: a rank waiting in any of the library's modules (a
    # store call in control/, a collective in ops/) is in a wait of ours, and reports name
    # the user's frame around it. The package's folders are all of it, not the one that
    # holds _traces.py (base/): the layout by folders once left every other one out.
    root = Path(rd.__file__).parent
    user_facing = {root / "testing.py", root / "tools" / "_demo.py"}
    modules = sorted(root.rglob("*.py"))
    assert {p.parent.name for p in modules} >= {"control", "ops", "inference", "base"}
    for path in modules:
        assert _traces._is_ours(str(path)) == (path not in user_facing), path
    assert not _traces._is_ours(__file__)
    assert not _traces._is_ours(torch.__file__)
    assert not _traces._is_ours(str(root) + "_extra/x.py")  # a sibling folder is not ours


def _frame_in_a_store_call() -> FrameType:
    """The frame of the library's store call (control/) while its store function runs."""
    frames: list[FrameType] = []

    def store_fn() -> None:
        caller = sys._getframe(1)
        frames.append(caller)

    ControlPlane._call(store_fn)
    return frames[0]


def test_a_wait_in_a_store_call_is_inside_the_library_and_named_by_its_caller() -> None:
    frame = _frame_in_a_store_call()
    assert frame.f_code.co_name == "_call"
    assert pg.inside(frame, _traces._is_ours)
    # Named by the user's code around it: here, this test's helper.
    assert pg.where(frame, _traces._is_internal).startswith(
        "_frame_in_a_store_call() at test_progress_unit.py:"
    )
    stack = _traces.format_stack(frame, 3)
    assert "_control.py" not in stack, stack
    assert stack.endswith("(inside resilient_ddp: _call)"), stack
    assert "in _frame_in_a_store_call" in stack, stack


_FRAME_READER = """
import gc, sys, threading
from resilient_ddp.detection import _progress
main = threading.get_ident()
def garbage():
    class Holder: pass
    h = Holder(); h.loc = threading.local(); h.me = h  # a cycle that holds a local
def reader(out):
    for _ in range(200):
        garbage()
        gc.set_threshold(1)  # the next allocation collects: inside the read, unguarded
        out.append(_progress.thread_frame(main) if sys.argv[1] == "ours" else
                   sys._current_frames().get(main))
        gc.set_threshold(700)
out = []
t = threading.Thread(target=reader, args=(out,), daemon=True)
t.start(); t.join(20)
print("frames", sum(f is not None for f in out), "gc", gc.isenabled())
"""


def test_reading_the_main_threads_frame_survives_a_collection_freeing_a_local() -> None:
    """A collection inside ``sys._current_frames()`` that frees a ``threading.local``
    deadlocks CPython < 3.12 with the GIL held (every rank of a 3-rank job froze in
    ``init_process_group``); ``thread_frame`` reads with the collector off. The child has
    its own deadline: a frozen interpreter cannot end itself (with ``"raw"`` in place of
    ``"ours"`` the child freezes on 3.11)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _FRAME_READER, "ours"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["frames", "200", "gc", "True"]


def _stat(task_id: int, name: str, utime: int, stime: int) -> str:
    """A ``/proc`` ``stat`` line: state ``S``, ``utime`` and ``stime`` CPU ticks."""
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 5
    return f"{task_id} ({name}) " + " ".join(fields) + "\n"


def _task(root: Any, tid: int, name: str, rchar: int, wchar: int, utime: int, stime: int) -> None:
    d = root / str(tid)
    d.mkdir()
    (d / "comm").write_text(name + "\n")
    (d / "io").write_text(f"rchar: {rchar}\nwchar: {wchar}\nsyscr: 1\nread_bytes: 999\n")
    (d / "stat").write_text(_stat(tid, name, utime, stime))


def test_the_data_plane_counts_gloo_threads_only(tmp_path: Any) -> None:
    """Bytes and CPU ticks of gloo's threads, summed; the main thread's and the watchdog's
    (heartbeats, a store hosted here) never count; a thread that ended is skipped."""
    _task(tmp_path, 10, "python", 10**9, 10**9, 500, 500)  # the main thread
    _task(tmp_path, 11, "python", 5000, 5000, 7, 7)  # the watchdog
    _task(tmp_path, 12, "gloo_tcp_loop", 300, 200, 4, 1)
    _task(tmp_path, 13, "pt_gloo_runloop", 20, 10, 2, 0)
    (tmp_path / "14").mkdir()  # ended between the listing and the reads
    assert pg.data_plane(str(tmp_path)) == 300 + 200 + 4 + 1 + 20 + 10 + 2
    _task(tmp_path, 15, "pt_gloo_runloop", 1, 0, 0, 0)
    assert pg.data_plane(str(tmp_path)) == 538  # one more byte moved


def _proc(root: Any, pid: int, utime: int, stime: int, kids: dict[int, list[int]]) -> None:
    """A fake ``/proc/<pid>``: its ``stat`` (CPU ticks), its ``schedstat`` (a run-queue
    wait of ``utime`` ms) and, per thread, its children."""
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "stat").write_text(_stat(pid, "python", utime, stime))
    (d / "schedstat").write_text(f"123 {utime * 10**6} 7\n")
    for tid, children in kids.items():
        (d / "task" / str(tid)).mkdir()
        (d / "task" / str(tid) / "children").write_text(" ".join(map(str, children)) + " ")


def test_the_children_reader_sums_live_descendants_to_its_depth(tmp_path: Any) -> None:
    """A rank (pid 1) forked a DataLoader worker (10) from its main thread and a fork
    server (11) from another thread; the server forked two workers (20, 21), one of which
    forked a helper (30). Ticks are 1/100 s here (SC_CLK_TCK)."""
    _proc(tmp_path, 1, 900, 100, {1: [10], 2: [11], 3: []})
    _proc(tmp_path, 10, 150, 50, {10: []})
    _proc(tmp_path, 11, 1, 0, {11: [20, 21, 22]})  # 22 exited before its stat was read
    _proc(tmp_path, 20, 300, 0, {20: []})
    _proc(tmp_path, 21, 0, 100, {21: [30]})
    _proc(tmp_path, 30, 50, 0, {30: []})
    ticks = pg._ticks_per_s
    root = str(tmp_path)

    def cpu_and_wait(ticks_sum: int, utime_ms: int) -> Any:
        return pytest.approx((ticks_sum / ticks, utime_ms / 1000))

    assert pg.read_children("1", root) == cpu_and_wait(200 + 1 + 300 + 100 + 50, 501)
    assert pg.read_children("1", root, depth=2) == cpu_and_wait(200 + 1 + 300 + 100, 451)
    assert pg.read_children("1", root, depth=1) == cpu_and_wait(200 + 1, 151)
    assert pg.read_children("10", root) == (0.0, 0.0)  # no children: nothing, but readable
    assert pg.read_children("99", root) == (-1.0, -1.0)  # no such process
    (tmp_path / "40" / "task" / "40").mkdir(parents=True)  # a kernel without the files
    assert pg.read_children("40", root) == (-1.0, -1.0)
    (tmp_path / "20" / "schedstat").unlink()  # no scheduler statistics: no wait to judge
    for child in ("21", "30"):
        (tmp_path / child / "schedstat").unlink()
    (tmp_path / "10" / "schedstat").unlink()
    (tmp_path / "11" / "schedstat").unlink()
    assert pg.read_children("1", root)[1] == -1.0


def test_the_children_of_this_process_are_read() -> None:
    """The real reader sees a child spinning (its CPU time rises) and stops counting it
    once it has exited."""
    before = pg.read_children()[0]
    assert before >= 0.0
    spin = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\ninput()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30.0
        while pg.read_children()[0] < before + 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pg.read_children()[0] >= before + 0.5
    finally:
        spin.communicate(b"\n", timeout=30)
    assert pg.read_children()[0] < before + 0.5


def test_no_gloo_thread_is_no_data_plane_to_judge(tmp_path: Any) -> None:
    """A process without gloo (NCCL moves its data on the GPU) has nothing to judge by."""
    _task(tmp_path, 10, "python", 1, 1, 1, 1)
    assert pg.data_plane(str(tmp_path)) is None
    assert pg.data_plane(str(tmp_path / "gone")) is None


def test_the_data_plane_of_this_process_moves_with_a_gloo_collective() -> None:
    """The real reader, on this process: an all_reduce between two gloo groups of this
    process (ranks 0 and 1 over loopback, one thread each to form them) moves it by at
    least the bytes sent."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(g is not None for g in groups)
    before = pg.data_plane()
    assert before is not None  # gloo's threads are seen
    works = [g.allreduce([torch.ones(1_000_000)]) for g in groups]
    for work in works:
        work.wait(timedelta(seconds=30))
    after = pg.data_plane()
    groups.clear()  # their threads end with them
    assert after is not None
    assert after - before >= 4_000_000, (before, after)


def test_the_run_queue_wait_of_a_spinning_thread_is_read() -> None:
    """The real reader of schedstat, on this process: a thread's wait for a CPU is a
    count of seconds that never goes back (the starved-but-running signal reads it)."""
    tid = threading.get_native_id()
    first = pg.read_waited(tid)
    assert first >= 0.0
    x = 0
    for i in range(200_000):
        x += i
    assert pg.read_waited(tid) >= first
    assert pg.read_waited(tid, "/nonexistent/schedstat") == -1.0
