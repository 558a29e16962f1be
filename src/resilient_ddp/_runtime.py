"""Per-process runtime: who this rank is, which ops are pending, and what has failed.

One :class:`Runtime` exists per process between :func:`resilient_ddp.init_process_group`
and :func:`resilient_ddp.destroy_process_group`. The main thread only writes plain
attributes on the healthy path (op name, sequence number, step, phase); the watchdog thread
publishes them and feeds failure reports back through :meth:`Runtime.record_events`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import mmap
import multiprocessing
import os
import secrets
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import _clock, _events, _progress, _timings
from . import _control as ctl
from . import _diagnosis as dg
from .config import ResilienceConfig, duration_seconds
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    ControlPlaneError,
    Culprit,
    RankFailureError,
    ResilientDDPError,
    error_head,
    failure_message,
)

if TYPE_CHECKING:  # the runtime's features; they import this module
    from .elastic import Elastic
    from .watchdog import Watchdog

__all__ = ["add_failure_listener"]

log = logging.getLogger("resilient_ddp")
_events.install_rank_filter()  # every record of the logger says which rank wrote it

# The phase a rank shows in its heartbeat while it recovers from a failure (elastic.py).
RECOVERY_PHASE = "recovery"
# The section a joiner is in from its admission to its first collective.
JOIN_STARTUP_SECTION = "start-up after joining"
# Verdicts worded from the diagnosing rank's side (the majority rule): never shared.
_RELATIVE_BLAMES = frozenset({dg.Blame.DIVERGED.name, dg.Blame.THIS_RANK_DIVERGED.name})

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_THREADING_FILE = os.path.abspath(threading.__file__)
_MULTIPROCESSING_DIR = os.path.dirname(os.path.abspath(multiprocessing.__file__))
# Errors a rank raises because of someone else: reporting them would name the wrong culprit.
_SECONDARY = (RankFailureError, CollectiveMismatchError, ControlPlaneError)

# Exit code of a rank whose peers gave up on it while its main thread was stuck where no
# exception can reach it (C code): it cannot raise, so it exits with this code instead.
# 75 is EX_TEMPFAIL of sysexits.h: a failure that a restart may cure.
UNRESPONSIVE_EXIT_CODE = 75
# Sent by the watchdog to the main thread to make it raise the peers' verdict: a real-time
# signal, because SIGUSR1/SIGUSR2 are taken by schedulers' conventions (SLURM, Lightning).
TELL_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None


class _StoreProbe:
    """Probes the control-plane store's address (:func:`_control.probe_store`) from a
    short-lived thread of its own, at most once per ``every`` seconds, while the
    watchdog's store calls do not complete; the main thread reads the latest result and
    never blocks on it."""

    def __init__(self, address: tuple[str, int], every: float) -> None:
        self.address = address
        self.every = every
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # (time.monotonic() when the probe started, verdict, why)
        self._result: tuple[float, str, str] | None = None

    def latest(self, since: float) -> tuple[str, str] | None:
        """The verdict of the newest probe started after ``since`` (None if none finished
        yet); starts a probe if none runs and the last one is older than ``every``."""
        with self._lock:
            res = self._result
            running = self._thread is not None and self._thread.is_alive()
            if not running and (res is None or time.monotonic() - res[0] >= self.every):
                self._thread = threading.Thread(
                    target=self._run, name="resilient_ddp-store-probe", daemon=True
                )
                self._thread.start()
        if res is None or res[0] < since:
            return None
        return res[1], res[2]

    def _run(self) -> None:
        started = time.monotonic()
        verdict, why = ctl.probe_store(self.address)
        with self._lock:
            self._result = (started, verdict, why)


class PendingOp:
    """One collective in flight, completed by the backend or failed by the watchdog.

    Blocking callers wait on :attr:`event`; asynchronous callers (DDP's comm hook) pass a
    ``future`` that is completed with the backend's value or failed with our error.
    """

    __slots__ = (
        "backend_error",
        "done",
        "event",
        "failed",
        "future",
        "hold",
        "name",
        "result_fn",
        "seq",
        "settled",
    )

    def __init__(
        self,
        name: str,
        seq: int,
        *,
        future: torch.futures.Future[Any] | None = None,
        result_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self.name = name
        self.seq = seq
        self.event = threading.Event()
        self.backend_error: BaseException | None = None
        self.done = False
        self.future = future
        self.result_fn = result_fn
        self.settled = threading.Lock()
        # fail_future failed the async future (a completion of the backend after it is
        # not delivered: the waiting thread must raise, see Op.wait_pending).
        self.failed = False
        # Elastic training settles the future itself after recovery (a redone reduction):
        # failures only wake the waiting thread.
        self.hold = False

    def attach(self, work: Any) -> None:
        """Complete this op when the backend ``work`` completes."""
        self.attach_future(work.get_future())

    def attach_future(self, fut: torch.futures.Future[Any]) -> None:
        """Complete this op when ``fut`` (e.g. a user comm hook's future) completes."""
        fut.add_done_callback(self._on_backend_done)

    def _on_backend_done(self, fut: torch.futures.Future[Any]) -> None:
        value: Any = None
        try:
            value = fut.value()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            # Kept without its traceback: when the backend failed the work before the op
            # was tracked, this runs inside attach_future, and the traceback's frames (and
            # their callers': the comm hook's, which holds the work) would stay alive with
            # this op, in a cycle with it (see errors.forget_frames).
            self.backend_error = e.with_traceback(None)
        self.done = True
        if self.backend_error is not None and self.future is not None and not self.hold:
            # The waiting thread explains it with a typed error; this only keeps a consumer
            # that never reaches that thread (DDP's own finalize) from waiting forever.
            self.fail_future(self.backend_error)
        self.event.set()
        ok = self.future is not None and self.backend_error is None
        if ok and self.settled.acquire(blocking=False):
            assert self.future is not None
            self.future.set_result(self.result_fn(value) if self.result_fn else value)

    def fail_future(self, error: BaseException) -> None:
        """Fail the async future (once); blocking waiters are woken through :attr:`event`."""
        if self.future is not None and not self.hold and self.settled.acquire(blocking=False):
            self.failed = True
            self.future.set_exception(error)
        self.event.set()


class Runtime:
    """The process's view of the job; see the module docstring."""

    def __init__(  # noqa: PLR0915 - one statement per field of the job's view
        self,
        *,
        rank: int,
        world_size: int,
        backend: str,
        control_root: dist.Store,
        config: ResilienceConfig,
        generation: int = 0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.config = config
        self.generation = generation
        self.control_root = control_root
        self.control = ctl.ControlPlane(control_root, generation)
        self.identity = ctl.my_identity(rank)
        # Whether this process hosts the store (rank 0 under env:// or mp.spawn): its exit
        # would take the control plane away from the peers still reading the verdict.
        port = ctl.store_port(control_root)
        self.hosts_store = port is not None and ctl.serves_port(port)
        self.identity["hosts_store"] = self.hosts_store
        self.infos: dict[int, dict[str, Any]] = {}
        main = threading.main_thread()
        self.main_thread_ident = main.ident
        # Busy or stuck: when the main thread's progress signals last moved (sampled by the
        # watchdog at each tick, published as "idle"), and how long this rank's ops
        # usually wait (the stuck window follows them).
        self.liveness = _progress.Tracker(
            _progress.sampler(main.ident or 0, main.native_id or 0, _is_internal, _is_ours)
        )
        self.waits = _progress.WaitHistory()
        self._op_t0 = 0.0  # time.monotonic() when the current op (or DDP pass) began
        self._sampled_in_op = False  # the last progress sample was taken inside an op
        # Healthy-path state, written by the main thread, read by the watchdog; step,
        # phase and in_op (with op and op_seq) also go to this process's board at once.
        self._board = process_board()
        if self._board is not None:
            self.identity["board"] = self._board.path
        self.seq = 0
        self.op = ""
        self.op_seq = -1
        self._in_op = False
        self._step = -1
        self._phase = ""
        self.section = ""
        self.section_deadline = float("inf")  # time.monotonic() when the section's budget ends
        self.section_budget = 0.0
        self.starting_up = False  # a joiner between its admission and its first collective
        self.status = "running"
        self.compute_s = 0.0  # median local compute time of recent steps (ResilientDDP)
        # distributed_inference: [call number, items done so far]
        self.progress: list[int] | None = None
        self.inference_calls = 0
        self.local_forward = 0  # > 0: ResilientDDP forwards skip DDP's sync (inference)
        self.thread_errors: list[str] = []
        # Failure state.
        # Reentrant: a signal handler (SIGTERM, the peers' verdict) runs in the main thread
        # and may interrupt it while it holds the lock.
        self.lock = threading.RLock()
        self.pending: set[PendingOp] = set()
        self.failures: list[ctl.FailureEvent] = []
        self.left: dict[int, ctl.FailureEvent] = {}
        self.control_plane_error: ControlPlaneError | None = None
        # Backend works that never completed. Dropping the last reference to a gloo work or
        # group runs ~ProcessGroupGloo, which joins worker threads blocked on a stopped peer
        # until the backend's own timeout; so they are kept alive until the process exits.
        self.stuck: list[Any] = []
        self.mismatches = 0
        # Diagnosis rounds this rank ran or read, by (generation, seq) (see diagnose).
        self.diagnosis_rounds: dict[tuple[int, int], int] = {}
        self.last_straggler_report: dict[str, Any] = {}
        self.raised = False  # this rank raised a failure error: its departure is a consequence
        # The failure listeners were called for the current failure (see notify_failure).
        self.failure_notified = False
        self.event_path: str | None = None  # this process's event file (see _events)
        # The peers' verdict on this rank, raised in its main thread (see tell_main).
        self.told_error: RankFailureError | None = None
        self.told_at = 0.0  # time.monotonic() when the main thread was signalled
        self.told_delivered = False
        self.lingering = False  # the store host waits for its peers before exiting
        self.watchdog: Watchdog | None = None
        # Each peer's heartbeat as this process saw it, on this process's monotonic clock:
        # (generation, rank) -> (beat, when this beat was first seen, when the rank was
        # first seen). Peers are judged by these, never by the wall-clock "t" they publish
        # (another host's clock may be ahead or behind).
        self._beats_seen: dict[tuple[int, int], tuple[Any, float, float]] = {}
        self._beats_lock = threading.Lock()
        self._connections: dict[str, dist.Store] = {}
        self.elastic: Elastic | None = None  # with on_failure="shrink"
        # time.monotonic() of the watchdog's last completed tick (0: no watchdog yet); a
        # tick that does not complete within stall_s means the store stopped answering.
        self.watchdog_tick = 0.0
        self.stall_s = _timings.store_stall_limit(config)
        # A store that stalls but whose host accepts connections has fallen behind: it is
        # given store_timeout before the control plane is declared lost (see failed_for).
        self.store_timeout_s = _timings.store_lost_limit(config)
        address = ctl.store_address(control_root)
        every = config.heartbeat_interval.total_seconds()
        self.store_probe = _StoreProbe(address, every) if address is not None else None
        self.stall_warned = 0.0  # the watchdog_tick of the stall last warned about
        # The backend timeout the default group was created with (None: torch's default);
        # a rebuilt generation gets it back after its short rendezvous timeout.
        self.backend_timeout: timedelta | None = None

    # -- the board: step, phase and op, exact for a peer on this host ------------------------
    # A heartbeat carries them too, but only as of its last publication (a store round
    # trip, at most a few times per heartbeat_interval). Each change is written here at
    # once (a few hundred ns), so that a peer or launcher on this host that finds this
    # process dead, or stopped, reads what it was doing when it stopped (see read_board).
    _board: _Board | None = None

    @property
    def step(self) -> int:
        """The training step this rank is in (-1 before the first; see ResilientDDP)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self._post_board()

    @property
    def phase(self) -> str:
        """The phase within the step (``"forward"``, ``"backward"``, ``"data"``, ...)."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self._post_board()

    @property
    def in_op(self) -> bool:
        """Whether this rank is inside a collective (``op``, ``op_seq``)."""
        return self._in_op

    @in_op.setter
    def in_op(self, value: bool) -> None:
        self._in_op = value
        self._post_board()

    def _post_board(self) -> None:
        board = self._board
        if board is not None:
            board.write(self._step, self.op_seq, self.op, self._phase, self._in_op)

    def elastic_state(self) -> Elastic:
        """This rank's elastic state, for code that runs only under elastic training.

        Raises:
            RuntimeError: The job does not train elastically (a bug of the caller).
        """
        if self.elastic is None:
            raise RuntimeError("resilient_ddp: elastic state asked for without on_failure='shrink'")
        return self.elastic

    def connection(self, purpose: str) -> ctl.ControlPlane:
        """The current generation's control plane over a connection of its own for
        ``purpose`` (``"watchdog"``, ``"progress"``): a thread that polls the store while
        the main thread uses it must not queue behind the main thread's calls.

        One connection per purpose, made on first use and kept for the life of the
        process, whatever the generation: a new connection to a TCPStore sometimes takes
        about 5 s, because the client looks the store's address up in reverse DNS and a
        resolver that drops the query costs its 5 s retry (strace on torch 2.13). Measured
        with plain torch, 4 processes on 2 loaded cores: 10-15 of 100 fresh connections
        per process took 5.0 s, against none of 400 calls on a kept one. A watchdog with
        a new connection per generation reported the control plane lost in 3 of 4 runs of
        the 20-fault elastic matrix; with the connection kept, 0 of 17.
        """
        root = self._connections.get(purpose)
        if root is None:
            root = self._connections[purpose] = self.control.clone().root
        return ctl.ControlPlane(root, self.generation)

    def reconnect(self, purpose: str) -> ctl.ControlPlane:
        """Like :meth:`connection`, over a new connection that replaces the kept one (after
        a call timed out on it, its late answer may still arrive).

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        self._connections.pop(purpose, None)
        try:
            return self.connection(purpose)
        except (RuntimeError, OSError) as e:
            raise ControlPlaneError(
                f"The control-plane store did not take a new connection ({type(e).__name__}: {e})."
            ) from e

    @property
    def _logger(self) -> _events.RankLog:
        """The library's logger for this rank's lines (``rank N: ...``, N this runtime's
        rank): also before the runtime is the process's current one (while it attaches),
        and for an inference guest's."""
        return _events.rank_log.of(self)

    # -- changes asked for by other modules --------------------------------------------------
    # Only this class writes its fields (tests/test_runtime_owner.py scans for writes from
    # outside): each change another module makes is one of these named operations.
    def start_watchdog(
        self, infos: dict[int, dict[str, Any]], make: Callable[[Runtime], Watchdog]
    ) -> None:
        """Keep every rank's attach record ``infos``, then start the watchdog thread that
        ``make`` builds for this runtime (``make`` may read ``infos``). Does not block."""
        self.infos = infos
        self.watchdog = make(self)
        self.watchdog.start()

    def stop_watchdog(self) -> None:
        """Stop the watchdog thread, if there is one, and forget it.

        Blocks until the thread ends, at most ``watchdog_stop_wait`` seconds (then it is
        forgotten anyway; a daemon thread, it ends with its next tick).
        """
        if self.watchdog is not None:
            self.watchdog.stop(timeout=_timings.watchdog_stop_wait(self.config))
            self.watchdog = None

    def watchdog_started(self) -> None:
        """The watchdog thread began its loop: the store's stall clock starts now."""
        self.watchdog_tick = time.monotonic()

    def watchdog_stopped(self) -> None:
        """The watchdog thread stops: a stopped watchdog is not a stalled store."""
        self.watchdog_tick = 0.0

    def note_straggler_report(self, report: dict[str, Any]) -> None:
        """Keep the latest straggler report (rank 0's watchdog; see straggler_report)."""
        self.last_straggler_report = report

    def start_elastic(self, elastic: Elastic) -> None:
        """Give this runtime its elastic state (``on_failure="shrink"``)."""
        self.elastic = elastic

    def enter_generation(self, generation: int, rank: int, world_size: int) -> None:
        """This process is now ``rank`` of ``world_size`` in generation ``generation``
        (its group was just formed): its control plane is that generation's, the failures
        known of the previous one are forgotten, and it runs."""
        self.rank, self.world_size = rank, world_size
        self.identity["rank"] = rank
        self.generation = generation
        self.control = ctl.ControlPlane(self.control_root, generation)
        with self.lock:
            self.failures.clear()
            self.left.clear()
        self.status = "running"

    def restart_op_numbering(self) -> None:
        """Op sequence numbers start again at 0 (a new generation), and so does the last
        op a heartbeat shows (none)."""
        self.seq = 0
        self.op, self.op_seq = "", -1

    def clear_raised(self, *, notify_again: bool) -> None:
        """This rank recovered from the failure it raised (elastic training goes on):
        its departure would no longer be a consequence of one. With ``notify_again``, the
        next failure calls the failure listeners again (see notify_failure)."""
        self.raised = False
        if notify_again:
            self.failure_notified = False

    def keep_stuck(self, work: Any) -> None:
        """Keep a backend ``work`` (or future) that never completed, or failed, for good:
        its destructor can block on a stopped peer or abort on a dead one (see ``stuck``)."""
        self.stuck.append(work)

    def take_stuck(self) -> list[Any]:
        """The works kept by :meth:`keep_stuck`, handed over (to retire with their group)
        and no longer kept here."""
        works = list(self.stuck)
        self.stuck.clear()
        return works

    def count_mismatch(self) -> int:
        """Count one more collective mismatch found on this rank; the count so far."""
        self.mismatches += 1
        return self.mismatches

    def set_compute_time(self, seconds: float) -> None:
        """The median local compute time of recent steps, in seconds (published in the
        heartbeat for the straggler report)."""
        self.compute_s = seconds

    def event_file(self, template: str) -> str:
        """This process's event log file: ``template`` with ``{rank}`` replaced by the
        rank of its first event, kept for the life of the process (elastic training may
        renumber the ranks)."""
        if self.event_path is None:
            self.event_path = template.replace("{rank}", str(self.rank))
        return self.event_path

    def begin_inference_call(self) -> None:
        """Count one more ``distributed_inference`` call (every rank counts its calls
        alike, so the count names the call on every rank)."""
        self.inference_calls += 1

    def set_inference_calls(self, calls: int) -> None:
        """The ``distributed_inference`` calls counted so far are ``calls`` (a guest takes
        the count of the job it helps)."""
        self.inference_calls = calls

    def set_inference_progress(self, call: int, done: int) -> None:
        """Call number ``call`` of ``distributed_inference`` has ``done`` items done by
        this rank (published in the heartbeat)."""
        self.progress = [call, done]

    def end_inference_progress(self) -> None:
        """No ``distributed_inference`` call is under way any more."""
        self.progress = None

    def enter_local_forward(self) -> None:
        """From now until the matching :meth:`leave_local_forward`, ``ResilientDDP``
        forwards run the wrapped module alone (inference; nestable)."""
        self.local_forward += 1

    def leave_local_forward(self) -> None:
        """Ends the matching :meth:`enter_local_forward`."""
        self.local_forward -= 1

    # -- healthy path ------------------------------------------------------------------------
    def begin_op(self, name: str) -> int:
        """Assign the next sequence number to op ``name`` and raise if it cannot succeed."""
        if self.starting_up:
            self.end_startup()
        self.seq += 1
        seq = self.seq
        self.op, self.op_seq = name, seq
        self.raise_if_failed(name, seq)
        if not self._in_op:
            self._op_t0 = time.monotonic()
        self.in_op = True
        return seq

    def end_op(self) -> None:
        if self._in_op and not self.failures and not self.left:
            # A completed op's wait, learned per kind of op (see stuck_window).
            self.waits.add(self.op, time.monotonic() - self._op_t0)
        self.in_op = False

    def observe_progress(self) -> None:
        """Sample the main thread's progress signals (the watchdog, once per tick). Time
        spent waiting inside a collective is not idleness: it restarts the count."""
        self.liveness.observe(baseline=self._sampled_in_op)
        self._sampled_in_op = self._in_op
        if self._in_op:
            self.liveness.restart()

    def stuck_window(self, name: str) -> float:
        """Seconds without progress after which a rank late to op ``name`` is stuck: the
        config's base window, or longer where this kind of op usually waits longer."""
        cfg = self.config
        return _timings.op_stuck_window(cfg, self.waits.window(name, cfg.base_stuck_window))

    def register(self, p: PendingOp) -> None:
        with self.lock:
            self.pending.add(p)
        # A failure recorded between begin_op and register must still reach this op.
        if self.failed_for(p.seq):
            self._fail_pending(p)

    def unregister(self, p: PendingOp) -> None:
        with self.lock:
            self.pending.discard(p)

    def snapshot(self, beat: int) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.identity["host"],
            "pid": self.identity["pid"],
            "beat": beat,
            "gen": self.generation,
            "seq": self.op_seq,
            "op": self.op,
            "in_op": self.in_op,
            "step": self.step,
            "phase": self.phase,
            "section": self.section,
            # Seconds left in the section's budget: peers keep waiting for a rank that is
            # busy within a declared budget (a checkpoint save) instead of failing it.
            "section_left": self.section_left(),
            "status": self.status,
            "compute_s": self.compute_s,
            "progress": self.progress,
            # Seconds since the main thread's progress signals last moved (its own
            # monotonic clock), which moved then, and where it is: busy or stuck.
            "idle": round(self.liveness.idle(), 2),
            "moving": list(self.liveness.moving),
            "where": self.liveness.last.where if self.liveness.last is not None else "",
            "inside": self.liveness.last.inside if self.liveness.last is not None else False,
            "raised": self.raised,
            # For people reading the state: peers never compare it with their own clock.
            "t": _clock.wall(),
        }

    def note_beat(self, rank: int, state: dict[str, Any]) -> float:
        """Note that this process sees ``state`` (rank ``rank``'s published state) now.

        Returns:
            When this process first saw that heartbeat (its ``beat``), on its monotonic
            clock (:func:`_clock.monotonic`). Never blocks (a lock held for a dict update).
        """
        beat, now, key = state.get("beat"), _clock.monotonic(), (self.generation, rank)
        with self._beats_lock:
            seen = self._beats_seen.get(key)
            if seen is None or seen[0] != beat:
                first = now if seen is None else seen[2]
                self._beats_seen[key] = (beat, now, first)
                return now
            return seen[1]

    def beat_age(self, rank: int) -> float:
        """Seconds (this process's monotonic clock) since this process saw rank ``rank``'s
        heartbeat change, or first saw it if it has not changed since; 0.0 if never seen."""
        seen = self._beats_seen.get((self.generation, rank))
        return 0.0 if seen is None else _clock.monotonic() - seen[1]

    def begin_startup(self) -> None:
        """A joiner was just admitted: until its first collective it is in the section
        :data:`JOIN_STARTUP_SECTION`, whose budget (``join_startup_timeout``) the members
        wait out in the step that admitted it, past ``op_timeout``."""
        budget = self.config.join_startup_timeout.total_seconds()
        self.section = JOIN_STARTUP_SECTION
        self.section_deadline, self.section_budget = time.monotonic() + budget, budget
        self.starting_up = True

    def end_startup(self) -> None:
        """The joiner's first collective: its start-up section ends."""
        self.starting_up = False
        if self.section == JOIN_STARTUP_SECTION:
            self.section, self.section_deadline, self.section_budget = "", float("inf"), 0.0

    def section_left(self) -> float | None:
        """Seconds left in the budget of the section this rank is in (None: no budget)."""
        if self.section_deadline == float("inf"):
            return None
        return round(max(0.0, self.section_deadline - time.monotonic()), 3)

    # -- failure bookkeeping ------------------------------------------------------------------
    def failed_for(self, seq: int) -> bool:
        """Whether op ``seq`` cannot complete because of a recorded failure."""
        if self.failures or self.control_plane_error is not None:
            return True
        if self.store_stalled() and self._store_lost():
            return True
        return any(ev.final_seq < seq for ev in self.left.values())

    def store_answering(self) -> bool:
        """Whether the watchdog completed a tick within two heartbeat intervals and a
        second (or there is no watchdog): a store call from the main thread (a diagnosis)
        is then unlikely to block on a store that stopped answering, which torch's TCPStore
        client does not bound."""
        if not self.watchdog_tick:
            return True
        recent = _timings.store_answering_window(self.config)
        return time.monotonic() - self.watchdog_tick <= recent

    def store_stalled(self) -> bool:
        """Whether the watchdog has not completed a tick for longer than a peer may stay
        silent: its store calls do not return (torch's TCPStore client does not bound
        them), because the store fell behind, or its host or the network to it is gone."""
        return bool(self.watchdog_tick) and time.monotonic() - self.watchdog_tick > self.stall_s

    def _store_lost(self) -> bool:
        """With the store stalled: whether to declare the control plane lost now (and do).

        A fresh TCP connection to the store's address tells the cases apart without
        blocking this thread (:class:`_StoreProbe`). Refused, or no answer: the store's
        process is gone, or its host or the network to it: lost now. Accepted: the store
        has fallen behind (overloaded, or its process stopped): training goes on, failure
        detection waits, and the control plane is lost only after ``store_timeout``.
        Without an address to probe (a FileStore), lost now.
        """
        silent = time.monotonic() - self.watchdog_tick
        where = f"rank {self.rank} (host {self.identity['host']})"
        if self.store_probe is None:
            why = "the network to its host is down, or that host hangs"
        elif silent > self.store_timeout_s:
            why = (
                "its host accepts connections, but the store has not answered for longer "
                f"than store_timeout ({self.store_timeout_s:.1f} s): it has fallen behind "
                "for good, or its process is stopped or hangs"
            )
        else:
            got = self.store_probe.latest(since=self.watchdog_tick)
            if got is None:
                return False  # the probe is under way (at most ctl.PROBE_TIMEOUT_S)
            verdict, detail = got
            if verdict == ctl.PROBE_ANSWERS:
                self._warn_stall(silent)
                return False
            host, port = self.store_probe.address
            if verdict == ctl.PROBE_REFUSED:
                why = f"a new connection to {host}:{port} was refused ({detail}): the process "
                why += "hosting the store has exited"
            else:
                why = f"a new connection to {host}:{port} got no answer ({detail}): its host "
                why += "is down, or the network to it is cut"
        self.on_control_plane_lost(
            ControlPlaneError(
                f"The control-plane store has not answered {where} for {silent:.1f} s: {why}."
            )
        )
        return True

    def _warn_stall(self, silent: float) -> None:
        if self.stall_warned == self.watchdog_tick:
            return
        self.stall_warned = self.watchdog_tick
        self._logger.warning(
            "the control-plane store has not answered for %.1f s, but its host "
            "accepts connections: it has fallen behind (overloaded, or its process is "
            "stopped). Training goes on and failure detection waits; the control plane is "
            "declared lost if it does not answer within store_timeout (%.1f s)",
            silent,
            self.store_timeout_s,
        )

    def tick_completed(self) -> None:
        """The watchdog completed a tick (its store calls returned)."""
        now = time.monotonic()
        if self.stall_warned and self.stall_warned == self.watchdog_tick:
            self._logger.warning(
                "the control-plane store answers again, after %.1f s",
                now - self.watchdog_tick,
            )
            self.stall_warned = 0.0
        self.watchdog_tick = now

    def raise_if_failed(self, name: str, seq: int) -> None:
        if self.failed_for(seq):
            raise self.build_error(name, seq)

    def record_events(self, events: Sequence[ctl.FailureEvent]) -> None:
        """Take failure reports read from the store (decoded by
        :meth:`ControlPlane.read_events <._control.ControlPlane.read_events>`) and wake the
        ops they doom."""
        woke = doomed = False
        with self.lock:
            for ev in events:
                kind = ev.kind
                if kind == ctl.EV_LEFT:
                    if ev.rank != self.rank:
                        self.left[ev.rank] = ev
                        doomed = True
                    continue
                if ev.secondary:
                    continue
                if kind == ctl.EV_TIMEOUT and ev.reporter == self.rank:
                    continue  # this rank raised it already
                if kind == ctl.EV_EXCEPTION and ev.rank == self.rank:
                    continue  # this rank is dying of it
                # Reports by this rank about others, and reports about this rank (declared
                # dead while stopped, say), both doom its pending ops.
                self.failures.append(ev)
                woke = True
        if woke:
            arm_exit_guard()  # a departure alone does not: it may be the job's normal end
        woke = woke or doomed
        with self.lock:
            pending = list(self.pending)
        if woke:
            for p in pending:
                if self.failed_for(p.seq):
                    self._fail_pending(p)
        for ev in events:
            verdict = self._verdict_on_me(ev)
            if verdict is not None:
                self.tell_main(verdict)
                break

    # -- the rank the peers gave up on --------------------------------------------------------
    def _verdict_on_me(self, ev: ctl.FailureEvent) -> RankFailureError | None:
        """The error this rank must raise because of ``ev``, a peer's verdict that names
        it (its timeout blamed this rank, or it declared this rank dead), or None."""
        kind, me = ev.kind, self.rank
        # A section overrun is reported by the rank itself (its watchdog), and the peers
        # fail on it: its main thread must stop too, wherever it is stuck.
        if (ev.reporter == me and kind != ctl.EV_SECTION) or ev.secondary:
            return None
        mine: Culprit | None = None
        if kind == ctl.EV_TIMEOUT:
            mine = next((c for c in ev.culprits if c.rank == me), None)
        elif kind in (ctl.EV_UNRESPONSIVE, ctl.EV_SECTION) and ev.rank == me:
            mine = ev.culprit
        if mine is None:
            return None
        culprit = dataclasses.replace(mine, step=self.step, phase=self.phase, section=self.section)
        where = f" [step {self.step}, phase {self.phase!r}]" if self.step >= 0 else ""
        if kind == ctl.EV_TIMEOUT:
            message = (
                f"rank {me} (host {self.identity['host']}) is stuck: rank {ev.reporter} gave "
                f"up on {ev.op}#{ev.seq} after {ev.waited:.1f} s waiting for it "
                f"({mine.what}), and every peer raised. Raised here, in the main "
                f"thread, from wherever it was{where}."
            )
            return CollectiveTimeoutError(
                message,
                culprits=[culprit],
                op=ev.op,
                seq=ev.seq,
                generation=self.generation,
            )
        what = mine.what
        who = "its watchdog" if ev.reporter == me else f"rank {ev.reporter}"
        message = (
            f"rank {me} (host {self.identity['host']}): {who} reported that it {what}, and "
            f"every peer raised. Raised here, in the main thread{where}."
        )
        cls = CollectiveTimeoutError if kind == ctl.EV_SECTION else RankFailureError
        return cls(message, culprits=[culprit], generation=self.generation)

    def tell_main(self, error: RankFailureError) -> None:
        """Make the main thread raise ``error`` (the peers gave up on this rank) from
        wherever it is: a signal interrupts a sleep or a blocking read, and its handler
        raises. An op in flight raises by itself; elastic training (``on_failure="shrink"``)
        handles the rank through its own recovery.

        If the main thread does not raise within :meth:`tell_grace`, the watchdog ends the
        process (see :meth:`check_told`).
        """
        if self.told_error is not None or self.elastic is not None or self.in_op:
            return
        if not _tell_installed or TELL_SIGNAL is None or self.main_thread_ident is None:
            return
        self.told_error = error
        self.told_at = time.monotonic()
        self._logger.error("%s", error)
        signal.pthread_kill(self.main_thread_ident, TELL_SIGNAL)

    def tell_grace(self) -> float:
        """Seconds the main thread gets to raise the verdict before the process ends."""
        return _timings.tell_grace(self.config)

    def check_told(self) -> None:
        """Called by the watchdog each tick: end the process if the main thread was told
        and did not raise (stuck in C code, where no exception reaches it)."""
        if self.told_error is None or self.told_delivered:
            return
        if time.monotonic() - self.told_at < self.tell_grace():
            return
        stack = self.main_stack()
        self._logger.critical(
            "the peers gave up on this rank and its main thread did not respond "
            "within %.1f s (stuck in C code?); exiting with code %d. Main thread:\n%s",
            self.tell_grace(),
            UNRESPONSIVE_EXIT_CODE,
            stack,
        )
        self.status = "failed"
        with contextlib.suppress(ControlPlaneError):
            self.control.publish_state(self.rank, self.snapshot(-1))
        self.linger()
        logging.shutdown()
        sys.stderr.flush()
        os._exit(UNRESPONSIVE_EXIT_CODE)

    # -- the store host's exit -----------------------------------------------------------------
    def linger(self) -> None:
        """If this process hosts the store, keep it serving until every peer is done with
        it: left or failed, its process gone, or stopped; at most ``heartbeat_timeout``.

        A rank that hosts the store and exits first (it raised first, or finished first)
        would otherwise take the control plane away from peers still reading the verdict:
        they would report a lost store instead of the culprit. A healthy end costs only
        the time until the last peer leaves.
        """
        if not self.hosts_store or self.world_size < 2:  # noqa: PLR2004 - alone: no peer
            return
        self.lingering = True
        try:
            self._linger()
        finally:
            self.lingering = False

    def _linger(self) -> None:
        start = _clock.monotonic()
        end = start + self.config.heartbeat_timeout.total_seconds()
        waiting = [r for r in range(self.world_size) if r != self.rank]
        control = ctl.ControlPlane(self.control_root, self.generation)
        control.set_timeout(timedelta(seconds=2))
        while waiting and _clock.monotonic() < end:
            try:
                states = control.read_states(waiting)
            except ControlPlaneError:
                return  # the server itself failed: nothing to keep serving
            waiting = [r for r in waiting if not self._done_with_store(r, states.get(r, {}))]
            if waiting:
                _clock.sleep(0.05)
        waited = _clock.monotonic() - start
        if waiting:
            self._logger.warning(
                "hosts the store and exits after %.1f s although rank(s) %s are still "
                "running: they lose the control plane",
                waited,
                waiting,
            )
        elif waited > 1.0:
            self._logger.info("kept the store up %.1f s for the peers", waited)

    def _done_with_store(self, rank: int, state: dict[str, Any]) -> bool:
        if state.get("status") in ("left", "failed"):
            return True
        with self.lock:
            dead = any(
                ev.rank == rank and ev.kind in (ctl.EV_CRASH, ctl.EV_UNRESPONSIVE)
                for ev in self.failures
            )
        if dead:
            return True
        return self.is_gone(rank) or self.is_stopped(rank)

    def await_verdict(self, seconds: float) -> bool:
        """Wait (at most ``seconds``) until a failure is known, the watchdog ticking at
        once; whether one is."""
        end = time.monotonic() + seconds
        while not (self.failures or self.left or self.control_plane_error):
            if time.monotonic() >= end or self.watchdog is None:
                break
            self.watchdog.poke()
            time.sleep(0.02)
        return bool(self.failures or self.left or self.control_plane_error)

    def on_control_plane_lost(self, error: ControlPlaneError) -> None:
        with self.lock:
            self.control_plane_error = error
            pending = list(self.pending)
        for p in pending:
            self._fail_pending(p)

    def _fail_pending(self, p: PendingOp) -> None:
        if p.future is not None and not p.hold:
            # The watchdog's thread: the listeners run where the error is raised.
            p.fail_future(self.build_error(p.name, p.seq, notify=False))
        else:
            p.event.set()

    def culprits_for(self, seq: int) -> tuple[type[RankFailureError], list[Culprit]]:
        """The error class and culprits explaining why op ``seq`` cannot complete."""
        cls: type[RankFailureError] = RankFailureError
        found: dict[int, Culprit] = {}
        for i, ev in enumerate(self.failures):
            if ev.kind == ctl.EV_TIMEOUT:
                if i == 0 and ev.cls == "timeout":
                    cls = CollectiveTimeoutError
                for c in ev.culprits:
                    found.setdefault(c.rank, c)
            elif ev.culprit is not None:
                found.setdefault(ev.rank, ev.culprit)
        # Ranks that left before this op: named when they left on their own; a rank that
        # left because of a failure reported above is a consequence, not a cause.
        gone = [(r, ev) for r, ev in sorted(self.left.items()) if ev.final_seq < seq]
        for r, ev in gone:
            if not ev.secondary and ev.culprit is not None:
                found.setdefault(r, ev.culprit)
        if not found:
            for r, ev in gone:
                if ev.culprit is not None:
                    found.setdefault(r, ev.culprit)
        return cls, list(found.values())

    def mark_raised(self) -> None:
        """This rank raises a failure error: its later departure is a consequence, and the
        process must not run gloo's destructors at exit (see :func:`arm_exit_guard`)."""
        self.raised = True
        arm_exit_guard()

    def notify_failure(self, error: RankFailureError) -> RankFailureError:
        """Call the failure listeners (:func:`add_failure_listener`) with ``error``, once
        per failure on this rank: for the first typed error this rank meets for it, on the
        thread about to raise it. Elastic training starts over after each recovery.

        Returns:
            ``error``, for ``raise rt.notify_failure(RankFailureError(...))``.
        """
        if self.failure_notified:
            return error
        self.failure_notified = True
        lines = str(error).splitlines()
        _events.record(
            self,
            "failure",
            error=type(error).__name__,
            ranks=list(error.ranks),
            op=error.op,
            seq=error.seq,
            message=lines[0] if lines else "",
        )
        for fn in list(_failure_listeners.values()):
            try:
                fn(error)
            except Exception:
                self._logger.exception("a failure listener raised; going on")
        return error

    def build_error(
        self, name: str, seq: int, *, head: str | None = None, notify: bool = True
    ) -> RankFailureError:
        """The typed error explaining why op ``seq`` cannot complete (marks this rank as
        failed by consequence, so that its later departure names no one). ``head`` replaces
        the first words of the message (which say what could not complete). With ``notify``
        (the caller raises it), the failure listeners are called with it first."""
        err = self._build_error(name, seq, head=head)
        return self.notify_failure(err) if notify else err

    def _build_error(self, name: str, seq: int, *, head: str | None = None) -> RankFailureError:
        self.mark_raised()
        if self.control_plane_error is not None and not self.failures:
            # Fatal: nothing can be coordinated any more. The ranks on other hosts are cut off
            # from this one as well (the store is on one of them, or the network is down).
            far = self.unreachable_ranks()
            named = f"; unreachable rank(s) on other hosts: {[c.rank for c in far]}" if far else ""
            host = self.store_host_culprit()
            if host is not None:
                far = [host, *[c for c in far if c.rank != host.rank]]
                named = f"; rank {host.rank} hosted the store and {host.what}" + named
            where = error_head(name, self.rank, seq=seq, host=self.identity["host"])
            err = ControlPlaneError(
                f"{where} cannot complete: {self.control_plane_error}{named}"
                + "".join("\n" + c.describe() for c in far),
                culprits=far,
                op=name,
                seq=seq,
                generation=self.generation,
            )
            err.__cause__ = self.control_plane_error
            return err
        self._await_host_mates()
        cls, culprits = self.culprits_for(seq)
        first = self.failures[0] if self.failures else None
        if head is None:
            where = error_head(name, self.rank, seq=seq, generation=self.generation)
            head = f"{where} cannot complete"
        if first is not None and first.kind == ctl.EV_TIMEOUT and first.reporter != self.rank:
            verb = "timed out" if first.cls == "timeout" else "failed"
            head += (
                f": rank {first.reporter} {verb} in {first.op}#{first.seq} after "
                f"{first.waited:.1f} s"
            )
        message = failure_message(head, culprits, named="failed")
        return cls(message, culprits=culprits, op=name, seq=seq, generation=self.generation)

    def _await_host_mates(self) -> None:
        """A rank of another host went silent: that host's other ranks usually went with
        it, and their reports may still be on their way (posted by another rank's
        watchdog, read at this one's next tick). Wait up to two heartbeat intervals for
        them, so that the error names the whole host at once."""
        with self.lock:
            silent = {ev.rank for ev in self.failures if ev.kind == ctl.EV_UNRESPONSIVE}
        hosts = {self.infos.get(r, {}).get("host") for r in silent} - {self.identity["host"]}
        if not hosts or self.watchdog is None:
            return
        mates = {r for r, info in self.infos.items() if info.get("host") in hosts}
        end = time.monotonic() + _timings.host_mates_wait(self.config)
        self.watchdog.poke()
        while time.monotonic() < end:
            with self.lock:
                named = {ev.rank for ev in self.failures if ev.kind != ctl.EV_TIMEOUT}
            if mates <= named:
                return
            time.sleep(0.02)

    # -- reporting ---------------------------------------------------------------------------
    def post(self, event: dict[str, Any]) -> None:
        event.setdefault("reporter", self.rank)
        event.setdefault("gen", self.generation)
        event.setdefault("t", _clock.wall())
        self.control.post_event(event)

    def report_exception(
        self, exc: BaseException, tb: TracebackType | None = None, *, thread: str | None = None
    ) -> None:
        """Post this rank's own uncaught exception before the process dies."""
        if self.status != "running" or self.control_plane_error is not None:
            return
        if _is_backend_error(exc) and not self.failures and self.watchdog is not None:
            # A raw torch.distributed error in user code is usually a peer's death seen
            # first: give the watchdog a moment to learn of it before blaming this rank.
            self.watchdog.poke()
            end = time.monotonic() + _timings.watchdog_verdict_wait(self.config)
            while time.monotonic() < end and not self.failures and not self.left:
                time.sleep(0.02)
        secondary = isinstance(exc, _SECONDARY) or bool(self.failures) or bool(self.left)
        culprit = Culprit.record(
            self.rank,
            what=f"raised {qualname(type(exc))}" + (f" in thread {thread!r}" if thread else ""),
            info=self.identity,
            state=self.snapshot(0),
            exc_type=qualname(type(exc)),
            exc_message=str(exc),
            traceback=format_tb_summary(tb or exc.__traceback__, self.config.stack_depth),
        )
        try:
            if secondary or self.control.claim(self.rank):
                self.post(
                    {
                        "kind": ctl.EV_EXCEPTION,
                        "rank": self.rank,
                        "secondary": secondary,
                        "culprit": culprit,
                    }
                )
        except ControlPlaneError:
            pass  # dying anyway; the launcher or the peers' watchdogs will notice
        self.status = "failed"

    def report_left(self) -> None:
        """Tell the peers this rank leaves after its last op (clean shutdown)."""
        if self.status == "left":
            return
        if self.control_plane_error is not None or self.store_stalled():
            # The store does not answer: a call could block until it does (torch's TCPStore
            # client does not bound its calls).
            self.status = "left"
            return
        secondary = bool(self.failures) or self.raised or self.status == "failed"
        culprit = Culprit.record(
            self.rank,
            what=f"left the group after op #{self.op_seq} ({self.op or 'none'})"
            + _sampler_hint(self),
            info=self.identity,
            state=self.snapshot(0),
        )
        self.status = "left"
        try:
            # The watchdog stops next: publish the final state ourselves, so that a peer's
            # diagnosis does not wait for an answer from a rank that is gone.
            self.control.publish_state(self.rank, self.snapshot(-1))
            self.control.claim(self.rank)
            self.post(
                {
                    "kind": ctl.EV_LEFT,
                    "rank": self.rank,
                    "final_seq": self.op_seq,
                    "secondary": secondary,
                    "culprit": culprit,
                }
            )
        except ControlPlaneError:
            pass

    # -- diagnosis ---------------------------------------------------------------------------
    def main_stack(self) -> str:
        """Format the innermost frames of this process's main thread."""
        if self.main_thread_ident is None:
            return ""
        frame = _progress.thread_frame(self.main_thread_ident)
        text = format_stack(frame, self.config.stack_depth) if frame is not None else ""
        if self.thread_errors:
            text += "\n" + "\n".join(self.thread_errors[-3:])
        return text

    def diagnose(self, control: ctl.ControlPlane, name: str, seq: int) -> list[dict[str, Any]]:
        """Find the ranks that keep op ``seq`` from completing, asking each for its stack.

        One rank diagnoses each round (the first of the ranks waiting in ``seq`` whose
        attempt timed out: they all time out at about the same moment); the others wait for
        its verdict on the store and take it as theirs. So a stuck rank costs O(W) store
        requests in all, not every survivor reading every state (O(W^2)). A rank diagnoses
        itself when no verdict comes (its diagnoser died), when the verdict is older than
        ``heartbeat_timeout`` (this rank came late), was cut short by a failure, or found
        ranks that issued another collective (the majority rule is relative to each rank).

        Blocks at most the diagnosis window (``config.diagnosis_timeout``, at least two
        heartbeat intervals), twice that in a double fault.

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        key = (control.generation, seq)
        self.diagnosis_rounds[key] = k = self.diagnosis_rounds.get(key, 0) + 1
        if control.claim_diagnosis(seq, k):
            verdict: dict[str, Any] = {"by": self.rank, "t": _clock.wall(), "shared": False}
            try:
                culprits = self._diagnose_here(control, name, seq)
                # Its age is judged by the heartbeats this rank sent since (see below).
                verdict["beat"] = self.watchdog.beats if self.watchdog is not None else None
                divergent = any(c.get("blame") in _RELATIVE_BLAMES for c in culprits)
                verdict.update(culprits=culprits, shared=not divergent and not self.failed_for(seq))
                return culprits
            finally:
                with contextlib.suppress(ControlPlaneError):
                    control.publish_verdict(seq, k, verdict)
        wait = _timings.shared_verdict_wait(self.config)
        shared = control.read_verdict(seq, k, timedelta(seconds=wait))
        if (
            shared is None
            or not shared.get("shared")
            or not isinstance(shared.get("culprits"), list)
            or self._verdict_stale(control, shared)
        ):
            return self._diagnose_here(control, name, seq)
        self._logger.debug("%s#%d: rank %s's diagnosis", name, seq, shared.get("by"))
        return [c for c in shared["culprits"] if isinstance(c, dict)]

    def _verdict_stale(self, control: ctl.ControlPlane, verdict: dict[str, Any]) -> bool:
        """Whether a peer's shared verdict is older than ``heartbeat_timeout`` (this rank
        came late): its author sent that many heartbeats since it published it. Counted in
        the author's heartbeats, never by comparing the author's clock with this one's."""
        by, beat = verdict.get("by"), verdict.get("beat")
        if not isinstance(by, int) or isinstance(beat, bool) or not isinstance(beat, int):
            return True
        now = control.read_states([by]).get(by, {}).get("beat")
        if isinstance(now, bool) or not isinstance(now, int):
            return True
        interval = self.config.heartbeat_interval.total_seconds()
        return (now - beat) * interval > self.config.heartbeat_timeout.total_seconds()

    def _diagnosis_window(self) -> float:
        return _timings.diagnosis_window(self.config)

    def _diagnose_here(
        self, control: ctl.ControlPlane, name: str, seq: int
    ) -> list[dict[str, Any]]:
        """:meth:`diagnose`, by this rank: reads every other rank's state once, then those
        that have not answered every 50 ms."""
        others = [r for r in range(self.world_size) if r != self.rank]
        request = control.request_diagnosis()
        deadline = _clock.monotonic() + self._diagnosis_window()
        answers: dict[int, dict[str, Any]] = {}
        seen_at: dict[int, float] = {}  # when (monotonic) this process saw each answer
        states = control.read_states(others)
        while True:
            for r, st in states.items():
                seen = self.note_beat(r, st)
                # Keep the first answer: the next heartbeat republishes it without the stack.
                if r not in answers and (
                    st.get("diag", 0) >= request or st.get("status") != "running"
                ):
                    answers[r] = st
                    seen_at[r] = seen
            if len(answers) == len(others) or self.failed_for(seq):
                break
            if _clock.monotonic() >= deadline:
                break
            _clock.sleep(0.05)
            # Only the ranks that have not answered: with every survivor of a stuck rank
            # diagnosing at once, re-reading all W states each round made W^2 reads a round.
            states.update(control.read_states([r for r in others if r not in answers]))
        culprits: list[dict[str, Any]] = []
        verdicts: dict[int, dg.Verdict] = {}
        ops: dict[int, str] = {}  # what the others issued at seq, for the majority rule
        hb_timeout = self.config.heartbeat_timeout.total_seconds()
        for r in others:
            answered = r in answers
            s = beat = answers.get(r, states.get(r, {}))
            info = self.infos.get(r, {})
            stopped = not answered and self.is_stopped(r)
            running = not answered and not stopped and self.is_running(r)
            if stopped:
                # Stopped on this host: its board has what it was doing when it stopped.
                s = with_board(beat, info)
            if s.get("seq") == seq:
                ops[r] = str(s.get("op"))
            # How long it has been silent, by this process's clock: since this process saw
            # its heartbeat change (its wall-clock "t" may come from a clock that is off).
            silent_s = self.beat_age(r)
            verdict = dg.what_blocks(
                s,
                answered=answered,
                stopped=stopped,
                running=running,
                name=name,
                seq=seq,
                # what_blocks ages the heartbeat by its "t": give it this process's age.
                now=_number(beat.get("t")) + silent_s,
                recovery_phase=RECOVERY_PHASE,
            )
            if verdict is not None:
                verdicts[r] = verdict
                fresh = bool(beat) and silent_s < hb_timeout  # no state at all: not fresh
                seen = seen_at[r] if r in seen_at else self.note_beat(r, beat)
                extra = _culprit_extra(beat, s, silent_s, seen)
                culprits.append(
                    Culprit.record(
                        r,
                        what=verdict.what,
                        blame=verdict.blame.name,
                        info=info,
                        state=s,
                        stack=s.get("stack"),
                        # A process on this host that exists and is not stopped counts
                        # as alive even with a stale heartbeat (it may have just left a
                        # C call that held the GIL): whether it is dead is the watchdog's
                        # verdict, within heartbeat_timeout (see _check_heartbeats).
                        alive=answered
                        or running
                        or (not stopped and (fresh or (self.is_local(r) and not self.is_gone(r)))),
                        **extra,
                    )
                )
        # Ranks that issued another collective at seq: the minority is to blame, which may
        # be this rank itself (each side sees the other as different).
        ruling = dg.majority_rule(self.rank, name, seq, verdicts, ops)
        if isinstance(ruling, dg.Verdict):
            me = Culprit.record(
                self.rank,
                what=ruling.what,
                blame=ruling.blame.name,
                info=self.identity,
                state=self.snapshot(0),
                alive=True,
            )
            return [me]
        # Name root causes only (see dg.root_causes): ranked by blame, never by text.
        kept = [c for c in culprits if c["rank"] in ruling]
        named = dg.root_causes({c["rank"]: verdicts[c["rank"]] for c in kept})
        return [c for c in kept if c["rank"] in named]

    def is_stopped(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host and its process is stopped (SIGSTOP, a
        debugger): then it cannot answer, though its heartbeat is not yet stale."""
        pid = int(self.infos.get(rank, {}).get("pid", 0))
        return self.is_local(rank) and ctl.process_state(pid) == "T"

    def is_running(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host and its main thread is running or waiting on
        the disk (Linux state R or D): working, even if its watchdog does not answer."""
        pid = int(self.infos.get(rank, {}).get("pid", 0))
        return self.is_local(rank) and ctl.process_state(pid) in ("R", "D")

    def is_gone(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host and its process has ended (or is a zombie)."""
        info = self.infos.get(rank, {})
        return self.is_local(rank) and not ctl.same_process_alive(
            int(info.get("pid", 0)), info.get("start")
        )

    def culprit(self, rank: int, what: str) -> Culprit:
        """``rank`` as a culprit that ``what`` describes, with the host and pid it
        published at start-up."""
        return Culprit.of(rank, what, info=self.infos.get(rank))

    def store_host_culprit(self) -> Culprit | None:
        """With the control plane lost: the rank that hosted the store, if one did, and
        what became of it as far as this host can see."""
        for r, info in sorted(self.infos.items()):
            if r == self.rank or not info.get("hosts_store"):
                continue
            pid = int(info.get("pid", 0))
            if self.is_gone(r):
                what = f"died (process {pid} is gone)"
            elif self.is_stopped(r):
                what = "is stopped (SIGSTOP or a debugger)"
            else:
                what = "stopped answering"
            return self.culprit(r, what)
        return None

    def unreachable_ranks(self) -> list[Culprit]:
        """With the control plane lost: the ranks on other hosts than this one, as culprits
        (from the identities read at start-up)."""
        me = self.identity["host"]
        return [
            self.culprit(r, f"unreachable from host {me} (the control-plane store does not answer)")
            for r, info in sorted(self.infos.items())
            if r != self.rank and info.get("host") != me
        ]

    def is_local(self, rank: int) -> bool:
        """Whether this process can see ``rank``'s process: same host (hostname and boot
        id) and same PID namespace (containers with host networking share the first two,
        not the last)."""
        info = self.infos.get(rank)
        return bool(
            info
            and info.get("boot") == self.identity["boot"]
            and info.get("host") == self.identity["host"]
            and info.get("pidns", "") == self.identity.get("pidns", "")
            and info.get("start") is not None
        )


# -- the board --------------------------------------------------------------------------------
_BOARD_PREFIX = "resilient_ddp-board-"
_BOARD_GC_AGE_S = 120.0  # a dead process's board older than this is removed by the next one
_TEXT = 63  # bytes of the phase and of the op name kept on the board


class _Board:
    """This process's step, phase and last op in a small file in shared memory
    (``/dev/shm`` where it exists), rewritten in place at every change.

    The training thread writes one packed record per change (about 0.5 us: no system
    call, no store round trip); the page outlives the process, so a peer or the launcher
    on the same host that finds the process gone (SIGKILL, the OOM killer) or stopped reads
    exactly what it was doing. The record starts and ends with the same counter: a reader
    that finds them different (a write cut short) ignores the record.
    """

    RECORD = struct.Struct(f"<QqqdB{_TEXT}s{_TEXT}sQ")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._map = mmap.mmap(fd, self.RECORD.size)
        self._count = 0
        self._pid = os.getpid()

    @classmethod
    def create(cls) -> _Board | None:
        """A new board for this process (``None`` where no file can be made)."""
        folder = board_folder()
        path = os.path.join(folder, f"{_BOARD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, cls.RECORD.size)
            board = cls(path, fd)
        except (OSError, ValueError):
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        _collect_boards(folder)
        return board

    def write(self, step: int, seq: int, op: str, phase: str, in_op: bool) -> None:
        """Record the current state (the training thread, at every change)."""
        if os.getpid() != self._pid:
            return  # a forked child (a data loader worker) is not this rank
        self._count += 1
        try:  # noqa: SIM105 - on every change: contextlib.suppress would double the cost
            self.RECORD.pack_into(
                self._map,
                0,
                self._count,
                step,
                seq,
                time.time(),
                in_op,
                phase.encode(errors="replace")[:_TEXT],
                op.encode(errors="replace")[:_TEXT],
                self._count,
            )
        except (ValueError, TypeError):
            pass  # closed at exit (atexit) while a thread still runs: nothing to tell

    def close(self) -> None:
        """Remove the board (this process ends)."""
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(OSError, ValueError):
            self._map.close()
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_process_board: list[_Board | None] = []  # created on first use; one for the process


def process_board() -> _Board | None:
    """This process's board, created on first use (``None`` where none can be made)."""
    if not _process_board or (
        _process_board[0] is not None and _process_board[0]._pid != os.getpid()
    ):
        _process_board[:] = [_Board.create()]
        board = _process_board[0]
        if board is not None:
            atexit.register(board.close)
    return _process_board[0]


def board_folder() -> str:
    """Where boards are: ``/dev/shm`` (memory, on Linux), else the temporary folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _collect_boards(folder: str) -> None:
    """Remove the boards of processes killed long ago (a SIGKILLed rank cannot remove its
    own; its peers read it first, within seconds)."""
    now = time.time()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_BOARD_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_BOARD_PREFIX) :].split("-", 1)[0]
        path = os.path.join(folder, name)
        try:
            if not pid.isdigit() or ctl.process_state(int(pid)) is not None:
                continue
            if now - os.stat(path).st_mtime > _BOARD_GC_AGE_S:
                os.unlink(path)
        except OSError:
            continue


def remove_boards(pids: Iterator[int] | Sequence[int]) -> None:
    """Remove the boards of the processes ``pids`` (a launcher, once they ended)."""
    folder = board_folder()
    wanted = {str(pid) for pid in pids}
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(_BOARD_PREFIX) and name[len(_BOARD_PREFIX) :].split("-")[0] in wanted:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def read_board(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """The step, phase and op that the process of ``info`` (a rank's published identity)
    last wrote to its board: ``{"step", "seq", "op", "phase", "in_op", "t"}``, or ``None``
    when it has no board on this host or the record is unreadable."""
    path = (info or {}).get("board")
    if not isinstance(path, str) or not os.path.basename(path).startswith(_BOARD_PREFIX):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(_Board.RECORD.size)
        first, step, seq, t, in_op, phase, op, last = _Board.RECORD.unpack(raw)
    except (OSError, struct.error):
        return None
    if first != last or first == 0:
        return None
    return {
        "step": step,
        "seq": seq,
        "op": op.rstrip(b"\0").decode(errors="replace"),
        "phase": phase.rstrip(b"\0").decode(errors="replace"),
        "in_op": bool(in_op),
        "t": t,
    }


def with_board(state: dict[str, Any] | None, info: dict[str, Any] | None) -> dict[str, Any]:
    """``state`` (a rank's last heartbeat, maybe ``None``) with the step, phase and op of
    its board when this host can read it: for a process that is gone or stopped, what it
    was doing when it stopped, not as of its last heartbeat.

    The board holds the process's latest state whenever it was written (its ``t`` is the
    time of the last change, which may be older than the heartbeat's, published since
    without a change). The result's ``t`` is now: nothing newer can have happened in a
    process that no longer runs, so a report shows no age (``state_age``); ``board``
    marks it.
    """
    merged = dict(state or {})
    board = read_board(info)
    if board is not None:
        merged.update(
            step=board["step"],
            seq=board["seq"],
            op=board["op"],
            phase=board["phase"],
            in_op=board["in_op"],
            t=time.time(),
            board=True,
        )
    return merged


# -- formatting helpers -----------------------------------------------------------------------
def _sampler_hint(rt: Runtime) -> str:
    """A hint for the peers of ``rt``'s rank, which leaves its group: when it trained (a
    ``ResilientDDP`` step ran) and iterated a ``BalancedDistributedSampler``, the inference
    sampler, whose shards are uneven, is the likely reason it ran out of batches first.
    ``""`` otherwise."""
    from . import sampler

    if not sampler.balanced_iterated() or rt.step < 0 or rt.local_forward:
        return ""
    return (
        "; HINT: it trained with rd.BalancedDistributedSampler, an inference sampler whose "
        "shards are uneven; to give every rank the same number of steps, train with "
        "rd.LockstepBatchSampler, rd.ElasticBatchSampler or torch's DistributedSampler"
    )


def qualname(cls: type) -> str:
    """``module.Class`` (bare for builtins and ``__main__``), as reports name types."""
    mod = cls.__module__
    return cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"


# Modules of ours that run user-facing code (the demo, test helpers): never elided.
_USER_FACING = ("_demo.py", "testing.py")


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path == _THREADING_FILE:
        return True
    return _is_ours(path)


def _is_ours(filename: str) -> bool:
    """Whether ``filename`` is one of the library's modules (not a user-facing one)."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR) and not path.endswith(_USER_FACING)


def format_stack(frame: FrameType, depth: int) -> str:
    """Innermost ``depth`` frames of ``frame``, our own and threading's waits elided."""
    # Launcher frames (multiprocessing, our spawn wrapper) tell the reader nothing.
    frames = [
        f
        for f in traceback.extract_stack(frame)
        if f.filename != "<string>"
        and not os.path.abspath(f.filename).startswith(_MULTIPROCESSING_DIR)
        and not os.path.abspath(f.filename).endswith(os.path.join("resilient_ddp", "launch.py"))
    ]
    inside = ""
    while frames and _is_internal(frames[-1].filename):
        inside = f"  (inside resilient_ddp: {frames[-1].name})"
        frames.pop()
    text = "".join(traceback.format_list(frames[-depth:])).rstrip("\n")
    return text + ("\n" + inside if inside else "")


def format_tb_summary(tb: TracebackType | None, depth: int) -> str:
    if tb is None:
        return ""
    frames = traceback.extract_tb(tb)
    return "".join(traceback.format_list(frames[-depth:])).rstrip("\n")


# -- failure listeners --------------------------------------------------------------------------
# An OrderedDict: RemovableHandle keeps a weak reference to it (a plain dict has none).
_failure_listeners: OrderedDict[int, Callable[[RankFailureError], object]] = OrderedDict()


def add_failure_listener(fn: Callable[[RankFailureError], object]) -> RemovableHandle:
    """Call ``fn(error)`` on this rank when it meets a failure, before the error is raised.

    ``error`` is the library's typed error (:class:`RankFailureError` or a subclass) naming
    the culprit(s) in ``error.ranks``. ``fn`` is called once per failure, on the thread
    that raises it (the training loop's), before the error leaves the library: with
    ``on_failure="raise"`` before the rank raises it; with ``on_failure="shrink"`` before
    the survivors recover (and again for the next failure). The model and the optimizer
    still hold the state of the last completed step, the same on every survivor: the
    place for alerting, metrics and an emergency checkpoint. Collectives fail at once
    there (the group failed); an exception of ``fn`` is logged and does not hide the
    failure. Listeners are process-wide and may be added before or after
    :func:`init_process_group`.

    Args:
        fn: Called with the typed error; its return value is ignored.

    Returns:
        A handle whose ``remove()`` takes the listener off again.
    """
    handle = RemovableHandle(_failure_listeners)
    _failure_listeners[handle.id] = fn
    return handle


# -- the process-wide runtime and its hooks -------------------------------------------------
_runtime: Runtime | None = None
_hooks_installed = False
_prev_excepthook: Callable[..., Any] | None = None
_prev_thread_hook: Callable[..., Any] | None = None


def current() -> Runtime | None:
    return _runtime


def _identity() -> tuple[int, int] | None:
    """The current runtime's ``(rank, generation)``: what the layers below it (the event
    log's rank filter, torchrun's error file) know of this process, through
    :func:`._events.set_identity`."""
    rt = _runtime
    return None if rt is None else (rt.rank, rt.generation)


_events.set_identity(_identity)


#: Attaches a runtime to torch's default group on first use: set by ``process_group`` (the
#: layer that owns the group's life) when it is imported, so that the operations below it
#: find their runtime without importing it.
_attach: Callable[[ResilienceConfig | None], Runtime] | None = None


def set_attach(attach: Callable[[ResilienceConfig | None], Runtime]) -> None:
    global _attach
    _attach = attach


def ensure_runtime(config: ResilienceConfig | None = None) -> Runtime:
    """The current runtime, attaching to torch's default group on first use.

    Blocks while attaching (at most ``config.init_timeout``).

    Raises:
        ConfigError: No process group (or this process is a guest of an inference call).
        PreflightError: Some rank did not attach in time.
    """
    rt = _runtime
    if rt is None:
        if _attach is None:  # pragma: no cover - process_group is imported with the package
            raise ConfigError(
                "No process group: call resilient_ddp.init_process_group() on every rank first."
            )
        rt = _attach(config)
    return rt


def set_current(rt: Runtime | None) -> None:
    global _runtime
    _runtime = rt


# The main thread is in the excepthook: the process dies of an uncaught exception, which it
# is reporting (to the peers, to torchrun's error file, on stderr). A launcher's SIGTERM
# then must not raise another error into the hook (which would end it before the error
# file is written: seen as torchrun's bare "To enable traceback" for that rank).
_dying = False


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    global _dying
    _dying = True
    rt = _runtime
    if rt is not None:
        _report_dying(rt, exc, tb, to_peers=not issubclass(exc_type, KeyboardInterrupt))
    assert _prev_excepthook is not None
    _prev_excepthook(exc_type, exc, tb)
    if rt is not None and (rt.stuck or rt.failures):
        # Python joins the non-daemon threads, then the guard ends the process (code 1).
        arm_exit_guard()


def _report_dying(
    rt: Runtime, exc: BaseException, tb: TracebackType | None, *, to_peers: bool = True
) -> None:
    """The exception this rank dies of: to the peers, and to torchrun's error file (its
    root-cause summary shows what this rank saw)."""
    if to_peers:
        rt.report_exception(exc, tb)
    from ._torchelastic import record_error_file

    record_error_file(exc)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    rt = _runtime
    if rt is not None and args.exc_value is not None:
        name = args.thread.name if args.thread is not None else "?"
        rt.thread_errors.append(
            f"note: thread {name!r} died with {qualname(args.exc_type)}: {args.exc_value}"
        )
    assert _prev_thread_hook is not None
    _prev_thread_hook(args)


def hard_exit(code: int) -> None:
    """Exit now with ``code``, after atexit handlers, without the interpreter's shutdown.

    For a process that knows its exit code (an ``rd.spawn`` rank, see ``launch._finish``)
    after a failure: gloo's worker threads would keep the interpreter from exiting until
    the process group's own timeout, or abort it. Non-daemon threads are not waited for:
    join them first.
    """
    try:
        atexit.unregister(_exit_guard)
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _is_backend_error(exc: BaseException) -> bool:
    if isinstance(exc, ResilientDDPError):
        return False  # ours are DistErrors too (drop-in), but never a backend's
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(os.sep + os.path.join("torch", "distributed") + os.sep in f.filename for f in frames)


_guard_armed = False
# How long the exit guard waits for the copy of this process that finishes the
# interpreter's exit (about 0.1 s measured); past it, the copy is killed (see _exit_guard).
_FINISHER_WAIT_S = 30.0
# Exit code when the guard cannot learn the interpreter's own: never a false success.
_UNKNOWN_EXIT_CODE = 1


def _normalise_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints it and exits 1


def _exit_guard() -> None:
    """End a process that saw a failure with the exit code the interpreter chose, without
    the interpreter's teardown. Runs first among the atexit handlers (registered last).

    Python has joined the non-daemon threads by now. The code the interpreter will exit
    with (0, 1 after an uncaught exception, ``n`` for ``sys.exit(n)`` or
    ``raise SystemExit(n)``, SIGINT after Ctrl-C) is in its C stack only: no Python code
    can read it. Its teardown cannot run here: gloo objects of a failed group block on a
    stopped peer or abort the process, and a thread that returns from the backend while
    the interpreter finalizes aborts it (``terminate called without an active
    exception``: an op fails exactly when the peers exit). So the other handlers run
    first (every thread can still take the GIL), then the process forks: the copy has no
    other thread; it keeps every object alive and skips the C++ static destructors
    (:func:`_keep_everything`), so its finalization destructs nothing, and it exits with
    the interpreter's own code. This process then ends the same way, by ``os._exit``.
    Without ``fork`` (it failed) this process finishes the exit itself, kept the same
    way: the code is still the interpreter's, but a thread may still abort it.
    """
    atexit.unregister(_exit_guard)
    if threading.current_thread() is not threading.main_thread() or (
        sys._getframe().f_back is not None
    ):
        return  # run by atexit._run_exitfuncs() from Python code: not the process's end
    atexit._run_exitfuncs()
    import faulthandler
    import warnings

    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or absent stream must not stop it
            stream.flush()
    # Its watchdog thread is not copied: the copy's finalization would wait for it forever.
    faulthandler.cancel_dump_traceback_later()
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # else the copy's status is discarded
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
    except OSError:
        pid = 0
    if pid == 0:
        _keep_everything()
        return  # the interpreter's exit goes on, and ends with its own code
    _end_like(pid)


def _keep_everything() -> None:
    """Let the interpreter's finalization destruct nothing.

    Every module, and every object a module refers to, gets a reference that is never
    dropped (everything reachable stays alive); the garbage collector ignores every object
    that exists (``gc.freeze``); and ``exit()`` calls ``_exit`` with its status before the
    C and C++ exit handlers (static destructors of libraries whose threads were not copied).
    """
    import ctypes
    import gc

    kept: list[Any] = []
    for module in list(sys.modules.values()):
        kept.append(module)
        with contextlib.suppress(TypeError):
            kept.extend(vars(module).values())
    gc.freeze()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
    libc = ctypes.CDLL(None)
    on_exit = getattr(libc, "on_exit", None)  # glibc
    if on_exit is not None:
        # exit(status) calls it as _exit(status, NULL); _exit reads its one argument.
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)


def _end_like(pid: int) -> NoReturn:
    """Wait for the process ``pid`` (see :func:`_exit_guard`), then end as it ended: the
    same exit code, or killed by the same signal."""
    deadline = time.monotonic() + _FINISHER_WAIT_S
    status: int | None = None
    why = f"did not finish within {_FINISHER_WAIT_S:.0f} s"
    while status is None and time.monotonic() < deadline:
        try:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            else:
                time.sleep(0.005)
        except ChildProcessError:
            why = "ended, but its status was taken by someone else"
            break
        except BaseException:  # noqa: BLE001 - a signal handler raised; the end goes on
            continue
    if status is None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"resilient_ddp: the process finishing the interpreter's exit {why}; "
                f"exiting with code {_UNKNOWN_EXIT_CODE}\n"
            )
            sys.stderr.flush()
        os._exit(_UNKNOWN_EXIT_CODE)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(Exception):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def arm_exit_guard() -> None:
    """After a failure, end the process without the interpreter's teardown, with the exit
    code the interpreter chose (see :func:`_exit_guard`).

    Gloo objects of a failed group, destructed at interpreter exit, block on a stopped peer
    or throw on a dead one (SIGABRT), whatever the program did meanwhile.
    """
    global _guard_armed
    if _guard_armed:
        return
    _guard_armed = True
    atexit.register(_exit_guard)


_tell_installed = False
_prev_signal_handlers: dict[int, Any] = {}
_prev_exit: Callable[..., Any] | None = None


def _on_tell(signum: int, frame: FrameType | None) -> None:
    """Raise the peers' verdict on this rank in the main thread (see Runtime.tell_main)."""
    rt = _runtime
    if rt is not None:
        _raise_told(rt)


def _raise_told(rt: Runtime) -> None:
    """Raise the peers' verdict on this rank, once, if the watchdog has one for it."""
    if rt.told_error is None or rt.told_delivered:
        return
    rt.told_delivered = True
    rt.mark_raised()
    raise rt.told_error


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """A launcher ends the job (``mp.spawn`` and torchrun send SIGTERM to the others as
    soon as one rank fails): raise the failure this rank knows of, naming the culprit,
    instead of dying silently. Without a known failure, die by the signal as before."""
    rt = _runtime
    if _dying:
        return  # reporting the exception it dies of; the exit follows (see _dying)
    if rt is not None:
        if rt.lingering:
            return  # the store host serves the verdict to the last peers (bounded), then exits
        if isinstance(sys.exc_info()[1], ResilientDDPError):
            # The main thread is handling one of our errors already (an ``except`` block:
            # the user's, or mp.spawn's that reports it and exits): let it finish.
            return
        _raise_told(rt)
        # The watchdog learns of a death within a tick; let it tick now. (``rt.raised`` may
        # already be set: the watchdog builds the error it fails a pending op with.)
        grace = _timings.watchdog_verdict_wait(rt.config)
        if rt.status == "running" and rt.await_verdict(grace):
            name = signal.Signals(signum).name
            head = (
                f"rank {rt.rank} (host {rt.identity['host']}) was ended by {name} from its "
                f"launcher (in {rt.op or 'no collective'}"
                f"{f', step {rt.step}' if rt.step >= 0 else ''})"
            )
            raise rt.build_error(rt.op or "(no op)", max(rt.op_seq, 0), head=head)
        if rt.hosts_store and (rt.failures or rt.raised):
            return  # on its way out: it keeps the store up for the peers (linger), bounded
    signal.signal(signum, _prev_signal_handlers.get(signum, signal.SIG_DFL))
    os.kill(os.getpid(), signum)


def _exit_reporting(code: str | int | None = None) -> NoReturn:
    """``sys.exit`` while the library is attached: a non-zero exit from inside an
    ``except`` block (``torch.multiprocessing.spawn`` does this with the rank's exception,
    and so do many scripts) reports that exception to the peers, as an uncaught one is."""
    rt = _runtime
    exc = sys.exc_info()[1]
    if (
        rt is not None
        and exc is not None
        and _normalise_code(code) != 0
        and not isinstance(exc, (SystemExit, KeyboardInterrupt))
    ):
        _report_dying(rt, exc, exc.__traceback__)
    assert _prev_exit is not None
    _prev_exit(code)
    raise SystemExit(code)  # pragma: no cover - _prev_exit raised already


def _install_signal(signum: int, handler: Callable[[int, FrameType | None], None]) -> bool:
    """Install ``handler`` for ``signum`` unless the program has its own; True if done."""
    current = signal.getsignal(signum)
    if current not in (signal.SIG_DFL, None):
        return False
    _prev_signal_handlers[signum] = current
    signal.signal(signum, handler)
    return True


def install_hooks() -> None:
    """Hook uncaught exceptions, ``sys.exit`` and, in the main thread, SIGTERM and the
    verdict signal, so that every way this rank ends tells the peers, and every way the
    peers end tells this rank."""
    global _hooks_installed, _prev_excepthook, _prev_thread_hook, _tell_installed, _prev_exit
    if _hooks_installed:
        return
    _prev_excepthook, sys.excepthook = sys.excepthook, _excepthook
    _prev_thread_hook, threading.excepthook = threading.excepthook, _thread_hook
    _prev_exit, sys.exit = sys.exit, _exit_reporting
    if threading.current_thread() is threading.main_thread():
        _install_signal(signal.SIGTERM, _on_sigterm)
        if TELL_SIGNAL is not None:
            _tell_installed = _install_signal(TELL_SIGNAL, _on_tell)
    _hooks_installed = True


def uninstall_hooks() -> None:
    global _hooks_installed, _tell_installed
    if not _hooks_installed:
        return
    if sys.excepthook is _excepthook and _prev_excepthook is not None:
        sys.excepthook = _prev_excepthook
    if threading.excepthook is _thread_hook and _prev_thread_hook is not None:
        threading.excepthook = _prev_thread_hook
    if sys.exit is _exit_reporting and _prev_exit is not None:
        sys.exit = _prev_exit
    if threading.current_thread() is threading.main_thread():
        for signum, handler in list(_prev_signal_handlers.items()):
            if signal.getsignal(signum) in (_on_sigterm, _on_tell):
                signal.signal(signum, handler)
            del _prev_signal_handlers[signum]
        _tell_installed = False
    _hooks_installed = False


@contextmanager
def section(name: str, budget: timedelta | float | None = None) -> Iterator[None]:
    """Name a part of the program; peers' errors say a rank was in it.

    Args:
        name: Shown in this rank's heartbeat and in any error naming this rank.
        budget: Optional time limit (timedelta or seconds). When it runs out, the watchdog
            reports this rank to every peer (with its main thread's stack): their next
            collective raises :class:`RankFailureError` naming it, and so does this rank's
            when the section ends (unless an exception is already propagating).

    Raises:
        RankFailureError: On exit, if the budget ran out.
    """
    seconds = None if budget is None else duration_seconds("section budget", budget)
    rt = _runtime
    if rt is None:
        yield
        return
    saved = (rt.section, rt.section_deadline, rt.section_budget)
    rt.section = name
    if seconds is not None:
        rt.section_deadline, rt.section_budget = time.monotonic() + seconds, seconds
    overran = False
    try:
        yield
        overran = time.monotonic() > rt.section_deadline
    finally:
        rt.section, rt.section_deadline, rt.section_budget = saved
    if overran:
        if rt.watchdog is not None:
            rt.watchdog.report_section_overrun(name, seconds or 0.0)
        rt.mark_raised()
        culprit = Culprit.of(
            rt.rank,
            f"(this rank) overran the {seconds:.1f} s budget of section {name!r}",
            info=rt.identity,
            step=rt.step,
            section=name,
        )
        raise CollectiveTimeoutError(
            culprit.describe(), culprits=[culprit], op=f"section {name}", generation=rt.generation
        )


def straggler_report(rt: Runtime, control: ctl.ControlPlane) -> dict[str, Any]:
    """Every rank's median step compute time and the ranks slower than the group median
    by more than ``config.straggler_margin``. One store round trip."""
    states = control.read_states(list(range(rt.world_size)))
    times = {r: float(s.get("compute_s", 0.0)) for r, s in states.items()}
    measured = sorted(t for t in times.values() if t > 0)
    median = measured[len(measured) // 2] if measured else 0.0
    limit = median * (1 + rt.config.straggler_margin)
    slow = sorted(r for r, t in times.items() if median > 0 and t > limit)
    return {"median_s": median, "compute_s": times, "stragglers": slow}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the phase of the current step (shown to peers when this rank fails)."""
    rt = _runtime
    if rt is None:
        yield
        return
    prev = rt.phase
    rt.phase = name
    try:
        yield
    finally:
        rt.phase = prev


def in_own_wait(inside: object, phase: object) -> bool:
    """Whether a rank whose heartbeat says ``inside`` (its main thread's innermost frame is
    the library's) and ``phase`` waits in one of the library's own bounded waits (a store
    call, elastic recovery, an admission): bounded by the library, so never judged stuck
    by its progress signals."""
    return bool(inside) or phase == RECOVERY_PHASE


def _culprit_extra(
    beat: dict[str, Any], state: dict[str, Any], silent_s: float, seen: float
) -> dict[str, Any]:
    """What a diagnosis adds to a late rank's culprit from its last heartbeat ``beat``
    (``state``: its state as judged), ``silent_s`` seconds old by this process's clock
    and first seen at ``seen`` (this process's monotonic clock)."""
    extra: dict[str, Any] = {}
    if not state.get("board"):
        # Its heartbeat's age by this process's clock (the one Culprit.record would compute
        # compares its wall-clock "t" with this host's). A board (a stopped rank on this
        # host) is read now: Culprit.record's age of it stands.
        extra["state_age"] = round(silent_s, 3)
    idle = beat.get("idle")
    if isinstance(idle, (int, float)) and not isinstance(idle, bool):
        # Busy or stuck (see Op._stuck): seconds since its progress signals last moved,
        # measured by its own clock; what moved; where it is.
        extra["idle"] = float(idle)
        moving = beat.get("moving")
        extra["moving"] = [str(m) for m in moving] if isinstance(moving, list) else []
        extra["where"] = str(beat.get("where", ""))
        # In one of the library's own waits (elastic recovery, an admission): bounded by
        # the library, not judged by progress.
        extra["inside"] = in_own_wait(beat.get("inside"), state.get("phase"))
    if beat.get("section_left") is not None:
        # Seconds left in its section's budget now: what it published with that heartbeat,
        # less the time since this process saw that heartbeat (a relative duration: the
        # peers' clocks are never compared).
        since = _clock.monotonic() - seen
        extra["busy_left"] = max(0.0, _number(beat["section_left"]) - since)
    return extra


def _number(value: Any) -> float:
    """``value`` as a float (a published field), 0.0 if it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if abs(float(value)) < float("inf") else 0.0
