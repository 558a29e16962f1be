"""Watchdog: one thread per rank that publishes its heartbeat and watches its peers.

Each tick (every ``heartbeat_interval``) it makes two store round trips: it publishes this
rank's state, and reads the event counter, the diagnosis counter and the state of the two
ring successors it watches. It declares a watched rank dead when its heartbeat has not
changed for ``heartbeat_timeout``, and a rank on the same host dead as soon as its process is
gone. It fails every pending op when a failure is reported and, with NCCL, aborts the
communicator so that kernels stuck on a dead peer are released. It never waits on the store
for a key that may not exist (that would flood logs and block shutdown), and stops within
one interval when asked.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from . import _control as ctl
from ._runtime import Runtime
from .errors import ControlPlaneError

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")

_MAX_TICK_ERRORS = 5  # consecutive unexpected errors before the watchdog stops
_STRAGGLER_STREAK = 3  # slow checks in a row before a rank is reported as a straggler


class Watchdog(threading.Thread):
    """Heartbeat publisher and failure detector for one rank; see the module docstring."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(name=f"resilient_ddp-watchdog-r{runtime.rank}", daemon=True)
        self.rt = runtime
        self.control = runtime.connection("watchdog")
        self.interval = runtime.config.heartbeat_interval.total_seconds()
        self.hb_timeout = runtime.config.heartbeat_timeout.total_seconds()
        # A store that stops answering (its host died, or the network to it is cut) must
        # be noticed as fast as a silent peer, not after the store's own (long) timeout.
        self.control.set_timeout(runtime.config.heartbeat_timeout)
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._poking = False  # see poke()
        self._beat = 0
        self._last_count = 0  # ev/n when last read
        self._lines_seen = 0  # events consumed from ev/log (may run ahead of ev/n)
        self._diag_answered = 0
        self._last_change: dict[int, tuple[int, float]] = {}
        world, rank = runtime.world_size, runtime.rank
        ring = {(rank + k) % world for k in (1, 2)} - {rank}
        # With each watched peer, the other ranks of its host: a host that goes (power,
        # network) is then named whole, not one rank at a time.
        mine = runtime.identity["host"]
        hosts = {runtime.infos.get(r, {}).get("host") for r in ring} - {None, mine}
        same_host = {r for r, i in runtime.infos.items() if i.get("host") in hosts}
        self.watched = sorted((ring | same_host) - {rank})
        self.local_peers = [r for r in range(world) if r != rank and runtime.is_local(r)]
        self.aborted = False
        self._section_reported = False
        self._section_lock = threading.Lock()
        self._straggler_every = runtime.config.straggler_interval.total_seconds()
        self._next_straggler_check = time.monotonic() + self._straggler_every
        self._slow_streak: dict[int, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop and wait for it (at most ``timeout`` seconds)."""
        self._stop_event.set()
        self._wake.set()
        self.rt.watchdog_tick = 0.0  # a stopped watchdog is not a stalled store
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        self.rt.watchdog_tick = 0.0

    def poke(self) -> None:
        """Run the next tick now instead of at the end of the interval.

        Safe from a signal handler: a handler (SIGTERM, the peers' verdict) that interrupts
        a poke on the main thread must not set the event again, because the interrupted
        ``Event.set`` holds the event's lock (a deadlock, seen under mp.spawn's SIGTERM).
        A poke already under way sets the flag anyway.
        """
        if self._poking:
            return
        self._poking = True
        try:
            self._wake.set()
        finally:
            self._poking = False

    def run(self) -> None:
        errors = 0
        self.rt.watchdog_tick = time.monotonic()
        while not self._stop_event.is_set():
            try:
                self.tick()
                if not self._stop_event.is_set():
                    self.rt.watchdog_tick = time.monotonic()
                errors = 0
            except ControlPlaneError as e:
                if not self._stop_event.is_set():
                    log.error("rank %d: %s", self.rt.rank, e)
                    self.rt.on_control_plane_lost(e)
                    self._abort_backend()
                return
            except Exception:
                # A silent watchdog would get this live rank declared dead: log and go on.
                errors += 1
                log.exception("rank %d: resilient_ddp watchdog tick failed", self.rt.rank)
                if errors >= _MAX_TICK_ERRORS:
                    log.error("rank %d: watchdog gives up after %d errors", self.rt.rank, errors)
                    return
            self._wake.wait(self.interval)
            self._wake.clear()

    # -- one tick ----------------------------------------------------------------------------
    def tick(self) -> None:
        rt = self.rt
        self._beat += 1
        # First, before any store round trip: an overrun section is reported with the
        # stack of the main thread while it is still inside the section. (Checked after
        # the round trips, a loaded machine let the section end first, and the stack
        # showed its exit.)
        self._check_section()
        self.control.publish_state(rt.rank, self._state())
        n_events, diag, states = self.control.poll(self.watched)
        if n_events != self._last_count:
            # A poster that died between appending its line and bumping ev/n leaves the
            # counter behind the log for good: consume by lines, trigger on any change.
            self._last_count = n_events
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
        if rt.elastic is not None:
            # Join requests: the main thread acknowledges them at its next forward.
            joins = int(self.control.root.add("join/n", 0))
            if joins > rt.elastic.joins_seen:
                rt.elastic.join_seen = True
        self._check_heartbeats(states)
        rt.check_told()
        self._check_local_processes()
        if rt.rank == 0 and time.monotonic() >= self._next_straggler_check:
            self._check_stragglers()

    def _state(self, *, with_stack: bool = False) -> dict[str, Any]:
        state = self.rt.snapshot(self._beat)
        state["diag"] = self._diag_answered
        if with_stack:
            state["stack"] = self.rt.main_stack()
        return state

    def _check_heartbeats(self, states: dict[int, dict[str, Any]]) -> None:
        now = time.monotonic()
        silence: dict[int, float] = {}
        for r, s in states.items():
            beat = int(s.get("beat", 0))
            last = self._last_change.get(r)
            if last is None or last[0] != beat:
                self._last_change[r] = (beat, now)
                continue
            if s.get("status") == "running" and r not in self.rt.left:
                silence[r] = now - last[1]
        stale = {r for r, t in silence.items() if t >= self.hb_timeout}
        # Ranks of a stale rank's host that are nearly as silent went with it (another
        # host only: on this one, a silent rank says nothing about its neighbours).
        hosts = {self.rt.infos.get(r, {}).get("host") for r in stale}
        hosts -= {self.rt.identity["host"]}
        nearly = self.hb_timeout - 2 * self.interval
        stale |= {
            r
            for r, t in silence.items()
            if t >= nearly and self.rt.infos.get(r, {}).get("host") in hosts
        }
        # Posted together, in one append: a peer must never build its error from the first
        # of a host's ranks before it has read the others.
        found = []
        for r in sorted(stale):
            what = f"stopped sending heartbeats ({silence[r]:.1f} s without one)"
            if self.rt.is_stopped(r):
                what = f"is stopped (SIGSTOP or a debugger): no heartbeat for {silence[r]:.1f} s"
            found.append((r, what))
            self._last_change[r] = (int(states[r].get("beat", 0)), float("inf"))  # report once
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
        culprit = ctl.culprit_from(
            rt.rank, what=what, info=rt.identity, state=state, stack=state["stack"]
        )
        log.warning("rank %d: %s", rt.rank, what)
        self._post(ctl.EV_SECTION, rt.rank, culprit)
        self.poke()

    def _check_stragglers(self) -> None:
        """Rank 0: warn (once per episode) about a rank slower than the group median by more
        than the margin on three checks in a row. Never an error."""
        from ._runtime import straggler_report

        self._next_straggler_check = time.monotonic() + self._straggler_every
        report = straggler_report(self.rt, self.control)
        self.rt.last_straggler_report = report
        for r in range(self.rt.world_size):
            streak = self._slow_streak.get(r, 0) + 1 if r in report["stragglers"] else 0
            self._slow_streak[r] = streak
            if streak == _STRAGGLER_STREAK:
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
            state = self.control.read_states([r]).get(r) if self.control.has_state(r) else None
            if state is not None and state.get("status") == "left":
                continue
            self._report(ctl.EV_CRASH, r, f"died (process {info['pid']} is gone)", state)

    def _report(self, kind: str, r: int, what: str, state: dict[str, Any] | None) -> None:
        self._report_all(kind, [(r, what)], {r: state or {}})

    def _report_all(
        self, kind: str, found: list[tuple[int, str]], states: dict[int, dict[str, Any]]
    ) -> None:
        """Report each ``(rank, what)`` that no one reported first, in one post."""
        events = []
        for r, what in found:
            if not self.control.claim(r):
                continue  # someone else reported it first
            culprit = ctl.culprit_from(r, what=what, info=self.rt.infos.get(r), state=states[r])
            log.warning("rank %d: rank %d %s", self.rt.rank, r, what)
            events.append(self._event(kind, r, culprit))
        if events:
            self.control.post_events(events)
            self.poke()

    def _event(self, kind: str, rank: int, culprit: dict[str, Any]) -> dict[str, Any]:
        return {
            "kind": kind,
            "rank": rank,
            "reporter": self.rt.rank,
            "gen": self.rt.generation,
            "t": time.time(),
            "culprit": culprit,
        }

    def _post(self, kind: str, rank: int, culprit: dict[str, Any]) -> None:
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
        from ._backend import abort_group

        abort_group()
