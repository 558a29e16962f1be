"""Watchdog: one thread per rank that publishes its heartbeat and watches its peers.

Each tick (every ``heartbeat_interval``) it makes two store round trips: it publishes this
rank's state, and reads the event counter, the diagnosis counter and the state of the ranks
it watches (see :func:`watch_targets`: its two ring successors and, on some ranks, every rank
of a next host, so that each host is watched from two others). It declares a watched rank
dead when its heartbeat has not changed for ``heartbeat_timeout``, and a rank on the same
host dead as soon as its process is gone. It fails every pending op when a failure is
reported and, with NCCL, aborts the communicator so that kernels stuck on a dead peer are
released. It never waits on the store for a key that may not exist (that would flood logs
and block shutdown), and stops within one interval when asked.

It is never silent about its own errors. A record it reads that is not one the library
writes (another process may write to the store) is skipped and logged once per kind. A tick
that fails otherwise is logged and retried; after ``_MAX_TICK_ERRORS`` failed ticks in a row
(a tick that succeeds starts the count again) the watchdog stops, and says so: the main
thread gets a :class:`ControlPlaneError` naming the last error at its next op, as when the
store is lost, and the peers are told this rank failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from resilient_ddp.base import _clock, _timings
from resilient_ddp.base._traces import qualname
from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _events
from resilient_ddp.control._board import with_board
from resilient_ddp.control._events import rank_log
from resilient_ddp.errors import ControlPlaneError, Culprit, CulpritRecord
from resilient_ddp.runtime._runtime import Runtime

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")

_MAX_TICK_ERRORS = 5  # consecutive unexpected errors before the watchdog stops
_STRAGGLER_STREAK = 3  # slow checks in a row before a rank is reported as a straggler


def watch_targets(rank: int, world: int, hosts: Mapping[int, str | None]) -> list[int]:
    """The ranks whose heartbeats ``rank`` watches, sorted; never ``rank`` itself.

    Two parts:

    * The rank ring: the next two ranks, ``(rank + 1) % world`` and ``(rank + 2) % world``,
      whatever their host (a rank whose host is unknown is watched this way only).
    * Whole hosts. The distinct known hosts are ordered by the smallest rank on each, and
      each host ``i`` is watched whole by ranks of hosts ``i - 1`` and ``i - 2`` (mod the
      number of hosts): on host ``i``, its first rank watches every rank of host ``i + 1``
      and its second rank every rank of host ``i + 2`` (a host with one rank does both).

    With three hosts or more, every rank of every host is then watched by ranks of two
    distinct other hosts: when any two hosts fail together (two adjacent ones in a rack,
    say), a rank of a surviving host still watches each failed host whole (and names it
    whole, not one rank at a time). With two hosts, the first two ranks of each watch the
    other host whole; with one, only the ring is left (a rank's own host is watched through
    its processes, see ``Watchdog.local_peers``). A rank watches at most ``2 + 2 * m``
    ranks, ``m`` the most ranks on one host, whatever ``world``.

    Args:
        rank: The watching rank.
        world: The number of ranks (``0 .. world - 1``).
        hosts: Each rank's host name (``None``, or absent, when unknown); ranks outside
            ``0 .. world - 1`` are ignored.

    Returns:
        The ranks to watch, sorted and without duplicates.
    """
    watched = {(rank + k) % world for k in (1, 2)}
    members: dict[str, list[int]] = {}  # host -> its ranks; hosts in order of first rank
    for r in range(world):
        host = hosts.get(r)
        if host is not None:
            members.setdefault(host, []).append(r)
    mine = hosts.get(rank)
    if mine is not None and mine in members:
        order = list(members)
        count, i = len(order), order.index(mine)
        own = members[mine]
        for k, offset in enumerate((1, 2)):
            target = (i + offset) % count
            if target == i:  # two hosts: the second rank watches the other host too
                target = (i + 1) % count
            if target != i and own[k % len(own)] == rank:
                watched.update(members[order[target]])
    watched.discard(rank)
    return sorted(watched)


class Watchdog(threading.Thread):
    """Heartbeat publisher and failure detector for one rank; see the module docstring."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(name=f"resilient_ddp-watchdog-r{runtime.rank}", daemon=True)
        self.rt = runtime
        # Names this runtime's rank (its own: the runtime is not the process's current one
        # yet while it attaches); says each kind of malformed record once per watchdog.
        self._logger = rank_log.of(runtime)
        self.control = self._bounded(runtime.connection("watchdog"))
        self.interval = runtime.config.heartbeat_interval.total_seconds()
        self.hb_timeout = runtime.config.heartbeat_timeout.total_seconds()
        self.busy_timeout = runtime.config.busy_timeout.total_seconds()
        self.blind_limit = _timings.blind_spell_limit(runtime.config)
        self.host_mate_silence = _timings.host_mate_silence(runtime.config)
        self._unheard: set[int] = set()  # silent ranks whose process runs (told once)
        self._stop_event = threading.Event()
        # Pokes (see poke): a SimpleQueue, whose put takes no lock a signal handler could
        # interrupt. An Event's set holds its Condition's lock, which the watchdog thread
        # needs to wait: a SIGTERM handler that interrupted a poke and then waited for a
        # verdict froze the watchdog for the whole wait (mp.spawn's survivor then died by
        # the signal without naming the culprit).
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._generation, self._rank = runtime.generation, runtime.rank
        self._jobs: ctl.JobStore | None = None  # elastic records, over this connection
        # Join requests looked at in this generation (this watchdog's)
        self._joins_known = 0
        self._beat = 0
        self._last_count = 0  # ev/n when last read
        self._lines_seen = 0  # events consumed from ev/log (may run ahead of ev/n)
        self._diag_answered = 0
        self._last_change: dict[int, tuple[int, float]] = {}
        self._last_check = 0.0  # time.monotonic() of the last look at the heartbeats
        self._reconnect = False  # the next tick replaces the connection (see _fell_behind)
        world, rank = runtime.world_size, runtime.rank
        # The ring, and whole hosts: each host is watched from two others (a rack of two
        # hosts that goes together is still noticed within heartbeat_timeout).
        hosts = {r: info.get("host") for r, info in runtime.infos.items()}
        hosts[rank] = runtime.identity["host"]
        self.watched = watch_targets(rank, world, hosts)
        self.local_peers = [r for r in range(world) if r != rank and runtime.is_local(r)]
        self.aborted = False
        self._section_reported = False
        self._section_lock = threading.Lock()
        self._straggler_every = runtime.config.straggler_interval.total_seconds()
        self._next_straggler_check = time.monotonic() + self._straggler_every
        self._slow_streak: dict[int, int] = {}
        # Failed ticks in a row (0 after a tick that succeeds), and the last error logged
        # with its traceback (a repeat of it is logged in one line).
        self.consecutive_errors = 0
        self._last_logged: tuple[type, str] | None = None
        # Why the watchdog stopped by itself (None while it runs, or when it was stopped).
        self.stopped_error: ControlPlaneError | None = None
        # Each watched rank's last well-formed state: a state overwritten with garbage
        # does not hide that rank's silence.
        self._good_states: dict[int, ctl.HeartbeatState] = {}

    @property
    def beats(self) -> int:
        """The heartbeats this watchdog has sent (one a tick): peers count time in them."""
        return self._beat

    def _bounded(self, control: ctl.ControlPlane) -> ctl.ControlPlane:
        """``control`` with its calls bounded by ``heartbeat_timeout``: the calls that
        torch's TCPStore client does time out (a multi_get may). Others block until the
        store answers, and Runtime.failed_for times those stalls (a store that fell behind
        is given store_timeout, one that is gone is not)."""
        control.set_timeout(self.rt.config.heartbeat_timeout)
        return control

    # -- lifecycle ---------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop and wait for it (at most ``timeout`` seconds)."""
        self._stop_event.set()
        self._wake.put(None)
        self.rt.watchdog_stopped()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        self.rt.watchdog_stopped()

    def poke(self) -> None:
        """Run the next tick now instead of at the end of the interval.

        Safe from a signal handler and in one: ``SimpleQueue.put`` is reentrant and takes
        no lock that the interrupted main thread could hold while the handler waits for
        the watchdog (SIGTERM's handler does, for the verdict).
        """
        self._wake.put(None)

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - never silent: the main thread is told
            self._give_up(e, f"because its loop failed ({qualname(type(e))}: {e})", logged=False)

    def _loop(self) -> None:
        self.rt.watchdog_started()
        while not self._stop_event.is_set():
            completed = True
            try:
                self.tick()
            except ControlPlaneError as e:
                if self._stop_event.is_set() or self._lost(e):
                    return
                # The store fell behind: no completed tick, so that the main thread times
                # the stall (Runtime.failed_for).
                completed = False
            except Exception as e:  # noqa: BLE001 - logged, counted, and told when it stops
                if self._tick_failed(e):
                    return
            else:
                if self.consecutive_errors:
                    self._logger.warning(
                        "resilient_ddp watchdog tick succeeds again after %d failed",
                        self.consecutive_errors,
                    )
                    self.consecutive_errors = 0
            # A tick that returned, even with an error, is no stalled store (see
            # Runtime.failed_for): repeated errors are told by _give_up, and accurately.
            if completed and not self._stop_event.is_set():
                self.rt.tick_completed()
            self._sleep_until_poked()

    def _sleep_until_poked(self) -> None:
        """Wait for a poke, at most one interval; the pokes made meanwhile count as one."""
        try:
            self._wake.get(timeout=self.interval)
        except queue.Empty:
            return
        with contextlib.suppress(queue.Empty):
            while True:
                self._wake.get_nowait()

    def _lost(self, e: ControlPlaneError) -> bool:
        """After a tick that raised ``e``: whether the control plane is lost (told, and the
        backend aborted), rather than a store that fell behind."""
        if self.rt.control_plane_error is None:
            if self._fell_behind(e):
                return False
            self._logger.error("%s", e)
            self.rt.on_control_plane_lost(e)
        # else the main thread gave up on the store (store_timeout) and told it
        self._abort_backend()
        return True

    def _fell_behind(self, e: ControlPlaneError) -> bool:
        """Whether a store call that timed out means the store fell behind rather than went
        away: its host still accepts connections. Then the next tick runs over a new
        connection (the old one may yet receive the late answer, which would be read as the
        answer to the next request)."""
        cause = e.__cause__
        probe = self.rt.store_probe
        if probe is None or not isinstance(cause, RuntimeError):
            return False
        text = str(cause).lower()
        if "timeout" not in text and "timed out" not in text:
            return False
        verdict, _ = ctl.probe_store(probe.address)
        if verdict != ctl.PROBE_ANSWERS:
            return False
        self._logger.debug("a store call timed out, its host accepts connections")
        self._reconnect = True
        return True

    def _tick_failed(self, e: Exception) -> bool:
        """Log a failed tick; whether the watchdog must stop (too many in a row)."""
        self.consecutive_errors += 1
        n = self.consecutive_errors
        if self._stop_event.is_set():
            self._logger.debug("watchdog tick failed while stopping", exc_info=e)
            return False
        if (type(e), str(e)) != self._last_logged:
            self._last_logged = (type(e), str(e))
            self._logger.error(
                "resilient_ddp watchdog tick failed (%d in a row; it stops at %d)",
                n,
                _MAX_TICK_ERRORS,
                exc_info=e,
            )
        else:
            self._logger.error(
                "resilient_ddp watchdog tick failed again (%d in a row; it stops at %d): %s: %s",
                n,
                _MAX_TICK_ERRORS,
                qualname(type(e)),
                e,
            )
        if n < _MAX_TICK_ERRORS:
            return False
        self._give_up(e, f"after {n} failed ticks in a row, the last with {qualname(type(e))}: {e}")
        return True

    def _give_up(self, e: BaseException, why: str, *, logged: bool = True) -> None:
        """Stop for good because of ``e``: tell the main thread (a ControlPlaneError at its
        next op, pending ops failed now), the log (once) and the peers."""
        rt = self.rt
        if self._stop_event.is_set():
            # Asked to stop meanwhile (the rank is shutting down): nothing is left to watch.
            self._logger.warning(
                "resilient_ddp watchdog failed while stopping",
                exc_info=None if logged else e,
            )
            return
        host, pid = str(rt.identity.get("host", "?")), int(rt.identity.get("pid", 0))
        what = f"stopped its watchdog {why}"
        error = ControlPlaneError(
            f"the resilient_ddp watchdog of rank {rt.rank} (host {host}) stopped {why}. Failure "
            "detection is off on this rank: it publishes no heartbeat and notices no peer's "
            "failure, so it cannot go on.",
            culprits=[Culprit.of(rt.rank, what, host=host, pid=pid)],
            generation=rt.generation,
        )
        error.__cause__ = e
        self.stopped_error = error
        self._logger.error("%s", error, exc_info=None if logged else e)
        try:
            if rt.control_plane_error is None:  # a lost store, told first, stays the cause
                rt.on_control_plane_lost(error)
            self._tell_peers(e, what)
        finally:
            self._abort_backend()

    def _tell_peers(self, e: BaseException, what: str) -> None:
        """Report this rank failed (best effort): its main thread raises at its next op."""
        rt = self.rt
        try:
            culprit = Culprit.record(
                rt.rank,
                what=what,
                info=rt.identity,
                state=rt.snapshot(self._beat).record(),
                exc_type=qualname(type(e)),
                exc_message=str(e),
            )
            if self.control.claim(rt.rank):
                self._post(ctl.EV_EXCEPTION, rt.rank, culprit)
        except Exception:  # best effort: the peers also see its heartbeat stop
            self._logger.warning("could not report the stopped watchdog", exc_info=True)

    # -- one tick ----------------------------------------------------------------------------
    def tick(self) -> None:
        rt = self.rt
        if self._reconnect:
            self.control = self._bounded(rt.reconnect("watchdog"))
            self._jobs = None
            self._reconnect = False
        self._beat += 1
        # First, before any store round trip: an overrun section is reported with the
        # stack of the main thread while it is still inside the section. (Checked after
        # the round trips, a loaded machine let the section end first, and the stack
        # showed its exit.)
        self._check_section()
        rt.observe_progress()
        self.control.publish_state(rt.rank, self._state())
        n_events, diag, states, joins = self.control.poll(
            self.watched, joins=rt.elastic is not None
        )
        states = self._usable_states(states)
        if n_events != self._last_count:
            # A poster that died between appending its line and bumping ev/n leaves the
            # counter behind the log for good: consume by records, trigger on any change.
            self._last_count = n_events
            # Decoded as read: a record that is not an event was dropped (and counted).
            events = self.control.read_events()
            fresh = events[self._lines_seen :]
            self._lines_seen = len(events)
            before = (len(rt.failures), len(rt.left))
            rt.record_events(fresh)
            if (len(rt.failures), len(rt.left)) != before:
                self._on_failure()
        if diag > self._diag_answered:
            self._diag_answered = diag
            self.control.publish_state(rt.rank, self._state(with_stack=True))
        # Join requests: acknowledged from here, while the step in flight runs, so that
        # the admission can be at the next step boundary (see elastic._grow_decision).
        if rt.elastic is not None and joins > self._joins_known:
            self._acknowledge(joins)
        self._check_heartbeats(states)
        rt.check_told()
        self._check_local_processes()
        if rt.rank == 0 and time.monotonic() >= self._next_straggler_check:
            self._check_stragglers()

    def _acknowledge(self, joins: int) -> None:
        """Acknowledge ``joins`` join requests as this watchdog's generation and rank if one
        of them is still to be admitted (the training thread may be moving to another
        generation: then the next tick looks again). Through the runtime's elastic state
        (``Runtime.start_elastic``), which this layer does not import."""
        rt, el = self.rt, self.rt.elastic
        assert el is not None
        if (rt.generation, rt.rank, len(el.members)) != (
            self._generation,
            self._rank,
            rt.world_size,
        ):
            return  # the generation is changing (members not yet set): the next tick
        if self._jobs is None:
            self._jobs = ctl.JobStore(self.control.root)
        el.acknowledge_pending(rt, self._jobs, self._generation, self._rank, joins)
        self._joins_known = joins

    # -- records written by others ----------------------------------------------------------
    def _usable_states(
        self, states: dict[int, ctl.HeartbeatState]
    ) -> dict[int, ctl.HeartbeatState]:
        """The watched ranks' states, each one the control plane left out (not a heartbeat
        the library publishes: another process wrote it) replaced by that rank's last good
        one, so that its silence goes on being timed."""
        usable = {}
        for r in self.watched:
            s = states.get(r)
            if s is not None:
                usable[r] = self._good_states[r] = s
                continue
            last = self._good_states.get(r)
            if last is not None:
                usable[r] = last
        return usable

    def _state(self, *, with_stack: bool = False) -> ctl.HeartbeatState:
        return dataclasses.replace(
            self.rt.snapshot(self._beat),
            diag=self._diag_answered,
            stack=self.rt.main_stack() if with_stack else None,
        )

    def _check_heartbeats(self, states: dict[int, ctl.HeartbeatState]) -> None:
        now = time.monotonic()
        # A store that fell behind kept this watchdog from looking (its calls did not
        # return) and the peers from publishing alike: silence is counted only while this
        # watchdog could look, or every peer would be declared dead once the store answers.
        blind = now - self._last_check - self.interval if self._last_check else 0.0
        self._last_check = now
        if blind > self.blind_limit:
            self._last_change = {r: (b, t + blind) for r, (b, t) in self._last_change.items()}
        silence: dict[int, float] = {}
        for r, s in states.items():
            self.rt.note_beat(r, s)  # what the diagnosis judges this rank's silence by
            beat = s.beat or 0
            last = self._last_change.get(r)
            if last is None or last[0] != beat:
                self._last_change[r] = (beat, now)
                self._unheard.discard(r)
                continue
            if s.status == "running" and r not in self.rt.left:
                silence[r] = now - last[1]
        stale = {r for r, t in silence.items() if t >= self.hb_timeout}
        # Ranks of a stale rank's host that are nearly as silent went with it (another
        # host only: on this one, a silent rank says nothing about its neighbours).
        hosts = {self.rt.infos.get(r, {}).get("host") for r in stale}
        hosts -= {self.rt.identity["host"]}
        nearly = self.host_mate_silence
        stale |= {
            r
            for r, t in silence.items()
            if t >= nearly and self.rt.infos.get(r, {}).get("host") in hosts
        }
        # Posted together, in one append: a peer must never build its error from the first
        # of a host's ranks before it has read the others.
        found = []
        for r in sorted(stale):
            if silence[r] < self.busy_timeout and self.rt.is_running(r):
                # Its process runs (on this host) but its watchdog does not: a C call that
                # holds the GIL. Busy, not dead: said once, failed only after busy_timeout.
                if r not in self._unheard:
                    self._unheard.add(r)
                    log.warning(
                        "rank %d has sent no heartbeat for %.1f s, but its process is "
                        "running: its watchdog thread cannot run, probably a C call that "
                        "holds the GIL; it is declared dead only if this lasts busy_timeout "
                        "(%.0f s)",
                        r,
                        silence[r],
                        self.busy_timeout,
                    )
                continue
            what = f"stopped sending heartbeats ({silence[r]:.1f} s without one)"
            if self.rt.is_stopped(r):
                what = f"is stopped (SIGSTOP or a debugger): no heartbeat for {silence[r]:.1f} s"
                # Stopped on this host: its board says what it was doing when it stopped.
                states[r] = with_board(states[r], self.rt.infos.get(r))
            found.append((r, what))
            self._last_change[r] = (states[r].beat or 0, float("inf"))  # report once
        if found:
            self._report_all(ctl.EV_UNRESPONSIVE, found, states)

    def _check_section(self) -> None:
        rt = self.rt
        if time.monotonic() <= rt.section_deadline:
            self._section_reported = False
            return
        self.report_section_overrun(rt.section, rt.section_budget)

    def report_section_overrun(self, name: str, budget: float) -> None:
        """Tell every peer this rank overran section ``name`` (once; from either thread)."""
        rt = self.rt
        with self._section_lock:
            if self._section_reported:
                return
            self._section_reported = True
        what = f"overran the {budget:.1f} s budget of section {name!r}"
        state = self._state(with_stack=True)
        culprit = Culprit.record(
            rt.rank, what=what, info=rt.identity, state=state.record(), stack=state.stack
        )
        self._logger.warning("%s", what)
        self._post(ctl.EV_SECTION, rt.rank, culprit)
        self.poke()

    def _check_stragglers(self) -> None:
        """Rank 0: warn (once per episode) about a rank slower than the group median by more
        than the margin on three checks in a row. Never an error."""
        from resilient_ddp.detection._store_diagnosis import straggler_report

        self._next_straggler_check = time.monotonic() + self._straggler_every
        report = straggler_report(self.rt, self.control)
        self.rt.note_straggler_report(report)
        for r in range(self.rt.world_size):
            streak = self._slow_streak.get(r, 0) + 1 if r in report["stragglers"] else 0
            self._slow_streak[r] = streak
            if streak == _STRAGGLER_STREAK:
                _events.record(
                    self.rt,
                    "straggler",
                    straggler=r,
                    compute_ms=round(1000 * report["compute_s"][r], 3),
                    median_ms=round(1000 * report["median_s"], 3),
                )
                log.warning(
                    "rank %d is a straggler: median step compute %.1f ms vs %.1f ms for the "
                    "group (more than %d%% slower on %d checks in a row)",
                    r,
                    1000 * report["compute_s"][r],
                    1000 * report["median_s"],
                    round(100 * self.rt.config.straggler_margin),
                    streak,
                )

    def _check_local_processes(self) -> None:
        for r in self.local_peers:
            if r in self.rt.left:
                continue
            if not self.rt.is_gone(r):
                continue
            info = self.rt.infos[r]
            self.local_peers = [p for p in self.local_peers if p != r]
            state = self.control.read_states([r]).get(r)
            if state is not None and state.status == "left":
                continue
            # What it was doing when it died, from its board (its heartbeat may be a few
            # steps behind in a fast loop).
            state = with_board(state, info)
            self._report(ctl.EV_CRASH, r, f"died (process {info['pid']} is gone)", state)

    def _report(self, kind: str, r: int, what: str, state: ctl.HeartbeatState) -> None:
        self._report_all(kind, [(r, what)], {r: state})

    def _report_all(
        self, kind: str, found: list[tuple[int, str]], states: Mapping[int, ctl.HeartbeatState]
    ) -> None:
        """Report each ``(rank, what)`` that no one reported first, in one post."""
        events = []
        for r, what in found:
            if not self.control.claim(r):
                continue  # someone else reported it first
            culprit = Culprit.record(
                r, what=what, info=self.rt.infos.get(r), state=states[r].record()
            )
            self._logger.warning("rank %d %s", r, what)
            events.append(self._event(kind, r, culprit))
        if events:
            self.control.post_events(events)
            self.poke()

    def _event(self, kind: str, rank: int, culprit: CulpritRecord) -> dict[str, Any]:
        return {
            "kind": kind,
            "rank": rank,
            "reporter": self.rt.rank,
            "gen": self.rt.generation,
            "t": _clock.wall(),
            "culprit": culprit,
        }

    def _post(self, kind: str, rank: int, culprit: CulpritRecord) -> None:
        """Post an event about ``rank`` from this thread's own store connection."""
        self.control.post_events([self._event(kind, rank, culprit)])

    # -- on failure --------------------------------------------------------------------------
    def _on_failure(self) -> None:
        # With NCCL, kernels waiting on a dead peer never finish by themselves: abort the
        # communicator. Gloo's abort cannot interrupt a blocked op and leaves the group
        # unusable, so it is left to time out (waiting ops are failed through our
        # futures instead).
        if self.rt.backend == "nccl":
            self._abort_backend()

    def _abort_backend(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        from resilient_ddp.base._backend import abort_group

        abort_group()
