"""Per-process runtime: who this rank is, which ops are pending, and what has failed.

One :class:`Runtime` exists per process between :func:`resilient_ddp.init_process_group`
and :func:`resilient_ddp.destroy_process_group`. The main thread only writes plain
attributes on the healthy path (op name, sequence number, step, phase); the watchdog thread
publishes them and feeds failure reports back through :meth:`Runtime.record_events`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from resilient_ddp.base import _clock, _timings
from resilient_ddp.base._traces import (
    _is_backend_error,
    _is_internal,
    _is_ours,
    format_stack,
    format_tb_summary,
    qualname,
)
from resilient_ddp.config import ResilienceConfig, duration_seconds
from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _events
from resilient_ddp.control._board import _Board, process_board
from resilient_ddp.detection import _progress
from resilient_ddp.errors import (
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
from resilient_ddp.runtime._exit_guard import arm_exit_guard

if TYPE_CHECKING:  # the runtime's features; they import this module
    from resilient_ddp.detection.watchdog import Watchdog
    from resilient_ddp.training.elastic import Elastic

__all__ = ["add_failure_listener"]

log = logging.getLogger("resilient_ddp")
_events.install_rank_filter()  # every record of the logger says which rank wrote it

# The phase a rank shows in its heartbeat while it recovers from a failure (elastic.py).
RECOVERY_PHASE = "recovery"
# The section a joiner is in from its admission to its first collective.
JOIN_STARTUP_SECTION = "start-up after joining"

# Errors a rank raises because of someone else: reporting them would name the wrong culprit.
_SECONDARY = (RankFailureError, CollectiveMismatchError, ControlPlaneError)

# Exit code of a rank whose peers gave up on it while its main thread was stuck where no
# exception can reach it (C code): it cannot raise, so it exits with this code instead.
# 75 is EX_TEMPFAIL of sysexits.h: a failure that a restart may cure.
UNRESPONSIVE_EXIT_CODE = 75
# Sent by the watchdog to the main thread to make it raise the peers' verdict: a real-time
# signal, because SIGUSR1/SIGUSR2 are taken by schedulers' conventions (SLURM, Lightning).
TELL_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None


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
    """The process's view of the job; see the module docstring.

    Runtimes are made by the two constructors below, one per way a process takes part in a
    job (the only calls of ``Runtime(...)``, checked by ``tests/test_runtime_owner``):
    :meth:`of_group` for a rank of a process group (a replacement joining an elastic job
    included), :meth:`of_guest` for a process lending a hand to one inference call.
    """

    @classmethod
    def of_group(
        cls,
        *,
        rank: int,
        world_size: int,
        backend: str,
        control_root: dist.Store,
        config: ResilienceConfig,
        elastic: Elastic | None = None,
    ) -> Runtime:
        """A rank of a job's process group: of generation 0 (``process_group`` then joins
        the control plane, starts the watchdog and makes it the process's current one),
        or, with ``elastic``, a replacement admitted as ``rank`` of ``world_size`` before
        the generation it enters is formed (generation -1), with its elastic state."""
        if elastic is None:
            return cls(rank, world_size, backend, control_root, config)
        rt = cls(rank, world_size, backend, control_root, config, generation=-1)
        rt.start_elastic(elastic)
        return rt

    @classmethod
    def of_guest(
        cls,
        *,
        worker: int,
        world_size: int,
        backend: str,
        control_root: dist.Store,
        config: ResilienceConfig,
        generation: int,
        inference_calls: int,
    ) -> Runtime:
        """A guest's runtime for one ``distributed_inference`` call of a job of
        ``world_size`` ranks: worker number ``worker`` (``world_size`` and up), no group,
        no watchdog, never the process's current one; ``inference_calls`` is the job's
        count of calls before this one."""
        rt = cls(worker, world_size, backend, control_root, config, generation=generation)
        rt.inference_calls = inference_calls
        return rt

    def __init__(  # noqa: PLR0915 - one statement per field of the job's view
        self,
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
        self.store_probe = ctl.StoreProbe(address, every) if address is not None else None
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
        except ResilientDDPError:
            raise  # the peers' verdict on this rank (tell_main), never a store failure
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

    def note_thread_died(self, note: str) -> None:
        """Keep ``note`` (a thread of this process died of an exception) for the reports."""
        self.thread_errors.append(note)

    def take_told_error(self) -> RankFailureError | None:
        """The peers' verdict on this rank, to raise in the main thread, once: None if there
        is none or it was taken already. A rank that raises it has raised a failure."""
        if self.told_error is None or self.told_delivered:
            return None
        self.told_delivered = True
        self.mark_raised()
        return self.told_error

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

    def snapshot(self, beat: int) -> ctl.HeartbeatState:
        """This rank's heartbeat now, as its watchdog publishes it (beat ``beat``)."""
        last, progress = self.liveness.last, self.progress  # each read once: set elsewhere
        return ctl.HeartbeatState(
            rank=self.rank,
            host=self.identity["host"],
            pid=self.identity["pid"],
            beat=beat,
            gen=self.generation,
            seq=self.op_seq,
            op=self.op,
            in_op=self.in_op,
            step=self.step,
            phase=self.phase,
            section=self.section,
            # Seconds left in the section's budget: peers keep waiting for a rank that is
            # busy within a declared budget (a checkpoint save) instead of failing it.
            section_left=self.section_left(),
            status=self.status,
            compute_s=self.compute_s,
            progress=None if progress is None else tuple(progress),
            # Seconds since the main thread's progress signals last moved (its own
            # monotonic clock), which moved then, and where it is: busy or stuck.
            idle=round(self.liveness.idle(), 2),
            moving=tuple(self.liveness.moving),
            where=last.where if last is not None else "",
            inside=last.inside if last is not None else False,
            raised=self.raised,
            # For people reading the state: peers never compare it with their own clock.
            t=_clock.wall(),
        )

    def note_beat(self, rank: int, state: ctl.HeartbeatState) -> float:
        """Note that this process sees ``state`` (rank ``rank``'s published state) now.

        Returns:
            When this process first saw that heartbeat (its ``beat``), on its monotonic
            clock (:func:`_clock.monotonic`). Never blocks (a lock held for a dict update).
        """
        beat, now, key = state.beat, _clock.monotonic(), (self.generation, rank)
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
        blocking this thread (:class:`._control.StoreProbe`). Refused, or no answer: the store's
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
            if self.raised and self.seq >= ev.seq:
                # This rank raised a failure in that op or a later one: it was never stuck
                # before it (both gave up on each other, as after a divergence), and its
                # main thread knows already.
                return None
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
        if not _tell_ready or TELL_SIGNAL is None or self.main_thread_ident is None:
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
            waiting = [r for r in waiting if not self._done_with_store(r, states.get(r))]
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

    def _done_with_store(self, rank: int, state: ctl.HeartbeatState | None) -> bool:
        if state is not None and state.status in ("left", "failed"):
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
            state=self.snapshot(0).record(),
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
            state=self.snapshot(0).record(),
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

    def diagnosis_window(self) -> float:
        """Seconds a diagnosing rank waits for its peers' answers (see
        :func:`._store_diagnosis.diagnose`)."""
        return _timings.diagnosis_window(self.config)

    def next_diagnosis_round(self, key: tuple[int, int]) -> int:
        """Count one more diagnosis round of op ``key`` (generation, seq) run or read by
        this rank, and return its number (1 for the first)."""
        self.diagnosis_rounds[key] = k = self.diagnosis_rounds.get(key, 0) + 1
        return k

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


# -- hints --------------------------------------------------------------------------------------
def _sampler_hint(rt: Runtime) -> str:
    """A hint for the peers of ``rt``'s rank, which leaves its group: when it trained (a
    ``ResilientDDP`` step ran) and iterated a ``BalancedDistributedSampler``, the inference
    sampler, whose shards are uneven, is the likely reason it ran out of batches first.
    ``""`` otherwise."""
    from resilient_ddp.inference import sampler

    if not sampler.balanced_iterated() or rt.step < 0 or rt.local_forward:
        return ""
    return (
        "; HINT: it trained with rd.BalancedDistributedSampler, an inference sampler whose "
        "shards are uneven; to give every rank the same number of steps, train with "
        "rd.LockstepBatchSampler, rd.ElasticBatchSampler or torch's DistributedSampler"
    )


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


# -- the process-wide runtime ------------------------------------------------------------------
_runtime: Runtime | None = None
# Whether the main thread has the handler of TELL_SIGNAL (installed with the process's
# hooks, see _process_hooks.install_hooks): tell_main signals it only then.
_tell_ready = False


def set_tell_ready(ready: bool) -> None:
    """Say whether the main thread handles :data:`TELL_SIGNAL` (by raising the peers'
    verdict): called by :mod:`._process_hooks` as it installs or removes its handler."""
    global _tell_ready
    _tell_ready = ready


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
