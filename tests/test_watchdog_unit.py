"""The watchdog's own errors, in one process: its tick and loop run against a real in-process
store (``HashStore``, and a ``TCPStore`` the watchdog reaches over its own connection) with
rank 0 watching a rank 1 that only this test writes for. Also the pattern of who watches
whom (``watch_targets``), on layouts of up to 1024 ranks, with no process at all.

No test sleeps and hopes: a loop test waits for the watchdog thread to end (``join`` with a
deadline), and the injected errors poke it so that each tick follows the last at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from types import FrameType
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.config import ResilienceConfig
from resilient_ddp.control import _control as ctl
from resilient_ddp.control._control import event_problem
from resilient_ddp.control._events import plain_log
from resilient_ddp.detection import watchdog
from resilient_ddp.detection.watchdog import Watchdog, watch_targets
from resilient_ddp.errors import (
    CollectiveTimeoutError,
    ControlPlaneError,
    Culprit,
    RankFailureError,
)
from resilient_ddp.runtime import _runtime
from resilient_ddp.runtime._runtime import PendingOp, Runtime

_JOIN_S = 30.0  # deadline for a watchdog thread that must end by itself (ends in < 1 s)


@pytest.fixture(autouse=True)
def _no_exit_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recorded failure arms the process's exit guard (sys.exit replaced, os._exit at
    # exit): right for a rank, wrong for the test process.
    monkeypatch.setattr(_runtime, "arm_exit_guard", lambda: None)


@pytest.fixture(params=["hash", "tcp"])
def store(request: pytest.FixtureRequest) -> Iterator[dist.Store]:
    if request.param == "hash":
        yield dist.HashStore()
    else:
        yield ctl.serve_store("127.0.0.1")


def _runtime_for(store: dist.Store) -> tuple[Runtime, Watchdog, ctl.ControlPlane]:
    """Rank 0 of 2, attached to ``store``; rank 1 (on another host) is played by the test
    through the returned control plane."""
    config = ResilienceConfig(
        heartbeat_interval=timedelta(milliseconds=20),
        heartbeat_timeout=timedelta(seconds=30),
        straggler_interval=timedelta(hours=1),
    )
    rt = Runtime(rank=0, world_size=2, backend="gloo", control_root=store, config=config)
    peer = {"rank": 1, "host": "peer-host", "pid": 1, "start": None, "boot": "", "pidns": ""}
    rt.infos = {0: dict(rt.identity), 1: peer}
    rt.control.init_counters()
    rt.control.publish_state(0, rt.snapshot(0))
    other = ctl.ControlPlane(store, 0)
    other.publish_state(1, ctl.HeartbeatState(rank=1, beat=1, status="running", t=time.time()))
    wd = Watchdog(rt)
    rt.watchdog = wd
    assert wd.watched == [1]
    return rt, wd, other


def _pending(rt: Runtime, name: str = "all_reduce") -> PendingOp:
    """An op the main thread waits on, as a collective registers it."""
    p = PendingOp(name, rt.begin_op(name))
    rt.register(p)
    return p


def _run_until_it_ends(wd: Watchdog) -> None:
    wd.start()
    try:
        wd.join(_JOIN_S)
        assert not wd.is_alive(), "the watchdog thread did not end"
    finally:
        wd.stop(5.0)


def _crash(rank: int, reporter: int) -> dict[str, Any]:
    return {
        "kind": ctl.EV_CRASH,
        "rank": rank,
        "reporter": reporter,
        "gen": 0,
        "t": time.time(),
        "culprit": Culprit.record(rank, "died (process 1 is gone)"),
    }


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# -- generic errors --------------------------------------------------------------------------
def test_consecutive_errors_stop_the_watchdog_and_the_main_thread_gets_a_typed_error(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="resilient_ddp")
    rt, wd, other = _runtime_for(store)
    calls = 0

    def broken() -> None:  # the last step of every tick fails, with a bug's error
        nonlocal calls
        calls += 1
        wd.poke()
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(rt, "check_told", broken)
    p = _pending(rt)  # the main thread is inside a collective
    _run_until_it_ends(wd)

    assert calls == watchdog._MAX_TICK_ERRORS
    assert p.event.is_set(), "the op in flight was not failed"
    err = rt.control_plane_error
    assert isinstance(err, ControlPlaneError)
    assert err is wd.stopped_error
    message = str(err)
    assert "watchdog of rank 0" in message
    assert f"after {watchdog._MAX_TICK_ERRORS} failed ticks in a row" in message
    assert "ZeroDivisionError: boom" in message
    assert "Failure detection is off on this rank" in message
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert err.ranks == (0,)

    # The main thread raises it at its next op, like any verdict.
    rt.end_op()
    with pytest.raises(ControlPlaneError, match="ZeroDivisionError: boom") as info:
        rt.begin_op("broadcast")
    assert info.value.__cause__ is err

    # Logged once (and the first failed tick with its traceback, repeats in one line).
    assert len(_messages(caplog, "stopped after")) == 1
    assert len([r for r in caplog.records if r.exc_info]) == 1
    assert len(_messages(caplog, "tick failed again")) == watchdog._MAX_TICK_ERRORS - 1

    # The peers are told which rank failed and why.
    events = other.read_events()
    assert [(e.kind, e.rank) for e in events] == [(ctl.EV_EXCEPTION, 0)]
    culprit = events[0].culprit
    assert culprit is not None
    assert "stopped its watchdog" in culprit.what
    assert culprit.exc_type == "ZeroDivisionError"


def test_a_signal_handler_that_interrupts_a_poke_still_gets_its_ticks(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's handler pokes the watchdog and waits for its verdict, on the main thread,
    which it may have interrupted inside a poke (the main thread pokes every 20 ms while it
    waits for a verdict itself). At whatever line of ``poke`` the handler runs, the
    watchdog keeps ticking: a poke that held a lock the watchdog needs in order to wait
    (an Event's) froze it until the handler gave up, and mp.spawn's survivor died by the
    signal without naming the culprit (full run, once)."""
    rt, wd, _ = _runtime_for(store)
    ticks = 0
    completed = rt.tick_completed

    def counted() -> None:
        nonlocal ticks
        ticks += 1
        completed()

    monkeypatch.setattr(rt, "tick_completed", counted)
    waits: list[bool] = []  # per simulated handler: did two ticks come within 5 s?

    def handler() -> None:  # what _on_sigterm does: poke, then wait for the watchdog
        before = ticks
        wd.poke()
        end = time.monotonic() + 5.0
        while ticks < before + 2 and time.monotonic() < end:
            time.sleep(0.002)
        waits.append(ticks >= before + 2)

    def in_poke(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            handler()  # a signal is handled between two lines: here, at every one
        return in_poke

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        # Every line run under poke (its own, and those of what it calls), and no other.
        caller = frame
        while caller is not None:
            if caller.f_code is Watchdog.poke.__code__:
                return in_poke
            caller = caller.f_back  # type: ignore[assignment]
        return None

    wd.start()
    try:
        sys.settrace(tracer)
        try:
            wd.poke()
        finally:
            sys.settrace(None)
    finally:
        wd.stop(5.0)
    assert waits, "no line of poke was run under the tracer"
    assert all(waits), f"the watchdog stopped ticking under {waits.count(False)} handler(s)"


def test_sigterm_inside_the_runtimes_lock_is_handled_again_once_it_is_released(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher's SIGTERM that interrupts the main thread inside the runtime's lock must
    not wait there for the watchdog's verdict (the watchdog needs that lock to record it):
    the handler returns at once and has the signal sent again."""
    from resilient_ddp.runtime import _process_hooks

    rt, _, _ = _runtime_for(store)
    again: list[int] = []
    monkeypatch.setattr(_process_hooks, "_deliver_again", again.append)
    monkeypatch.setattr(rt, "await_verdict", lambda s: pytest.fail("waited in the lock"))
    _runtime.set_current(rt)
    try:
        with rt.lock:
            _process_hooks._on_sigterm(signal.SIGTERM, None)
    finally:
        _runtime.set_current(None)
    assert again == [signal.SIGTERM]
    assert not _process_hooks._owned(rt.lock)  # and the check tells the lock is free now


def test_transient_errors_that_recover_never_stop_the_watchdog(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, wd, _ = _runtime_for(store)
    runs = watchdog._MAX_TICK_ERRORS  # failed ticks then one that succeeds, per run
    last = 3 * runs + 1
    calls = 0
    streaks: list[int] = []

    def flaky() -> None:  # MAX-1 failed ticks, one good, three times; then stop
        nonlocal calls
        calls += 1
        streaks.append(wd.consecutive_errors)
        wd.poke()
        if calls == last:
            wd.stop()  # from the watchdog's own thread: does not wait for itself
            return
        if calls % runs:
            raise ValueError("transient")

    monkeypatch.setattr(rt, "check_told", flaky)
    _run_until_it_ends(wd)

    assert calls == last
    assert max(streaks) == watchdog._MAX_TICK_ERRORS - 1
    assert streaks[runs] == 0, "a tick that succeeded did not reset the count"
    assert rt.control_plane_error is None
    assert wd.stopped_error is None
    assert wd.consecutive_errors == 0


def test_a_failure_outside_the_tick_is_told_too(store: dist.Store) -> None:
    rt, wd, _ = _runtime_for(store)

    class BrokenQueue(queue.SimpleQueue[None]):
        def get(self, block: bool = True, timeout: float | None = None) -> None:
            raise RuntimeError("loop bug")

    wd._wake = BrokenQueue()
    _run_until_it_ends(wd)

    err = rt.control_plane_error
    assert isinstance(err, ControlPlaneError)
    assert "its loop failed (RuntimeError: loop bug)" in str(err)
    assert "Failure detection is off" in str(err)


def test_a_lost_store_is_still_told_as_a_lost_store(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, wd, _ = _runtime_for(store)
    lost = ControlPlaneError("The control-plane store is unreachable (test)")

    def unreachable(*args: Any) -> None:
        raise lost

    monkeypatch.setattr(wd.control, "publish_state", unreachable)
    _run_until_it_ends(wd)
    assert rt.control_plane_error is lost
    assert wd.stopped_error is None


# -- records another process wrote ------------------------------------------------------------
def test_malformed_events_are_skipped_and_later_events_still_arrive(
    store: dist.Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="resilient_ddp")
    monkeypatch.setattr(ctl, "_rejected", {})  # counted from here
    plain_log.forget()  # and logged: an earlier test may have warned for this family
    rt, wd, other = _runtime_for(store)
    append = getattr(other.store, "append")  # noqa: B009 - missing from torch's stubs
    wd.tick()
    p = _pending(rt)

    append("ev/log", "this is not JSON\n")
    append("ev/log", '{"kind":"crash"}\n[1,2]\n{"kind":"crash","rank":1,"reporter":1}\n')
    other.store.add("ev/n", 4)
    wd.tick()  # raises nothing
    assert rt.failures == []
    assert not p.event.is_set()

    other.post_events([_crash(1, reporter=1)])
    append("ev/log", '{"kind":"timeout","reporter":1,"op":"x","seq":"y","waited":1}\n')
    other.store.add("ev/n", 1)
    wd.tick()
    assert [(e.kind, e.rank) for e in rt.failures] == [(ctl.EV_CRASH, 1)]
    assert p.event.is_set(), "the op in flight was not failed"
    err = rt.build_error(p.name, p.seq)
    assert isinstance(err, RankFailureError)
    assert err.ranks == (1,)

    # Later valid events keep arriving. The five malformed lines (not JSON, no reporter,
    # not an object, no culprit, a seq that is not a number) were dropped as they were
    # read, each counted, and logged once.
    other.post_events([{**_crash(1, reporter=1), "kind": ctl.EV_LEFT, "final_seq": 0}])
    wd.tick()
    assert 1 in rt.left
    assert ctl.rejected_records() == {"ev/log": 5}
    assert len(_messages(caplog, "ignored a record under 'g0/ev/log'")) == 1
    assert wd.consecutive_errors == 0


def test_malformed_states_are_skipped_and_a_silent_rank_is_still_found(
    store: dist.Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="resilient_ddp")
    rt, wd, other = _runtime_for(store)
    wd.tick()  # rank 1's beat 1 is seen

    other.store.set("state/1", "garbage")  # not JSON: the control plane leaves it out
    wd.tick()
    before = sum(ctl.rejected_records().values())
    bad = ctl.HeartbeatState(rank=1, beat="many", status="running")  # type: ignore[arg-type]
    other.publish_state(1, bad)
    wd.tick()
    bad = ctl.HeartbeatState(rank=1, beat=1, status=["running"])  # type: ignore[arg-type]
    other.publish_state(1, bad)
    wd.tick()
    # The last two were left out as the control plane read them, and counted.
    assert sum(ctl.rejected_records().values()) - before == 2
    assert rt.failures == []

    # Its last good beat is a minute old: it is reported, though its state is garbage.
    beat, _ = wd._last_change[1]
    wd._last_change[1] = (beat, time.monotonic() - 60.0)
    other.store.set("state/1", "garbage")
    wd.tick()  # posts the report
    wd.tick()  # reads it back
    assert [(e.kind, e.rank) for e in rt.failures] == [(ctl.EV_UNRESPONSIVE, 1)]


# -- this rank's heartbeat --------------------------------------------------------------------
#: The keys of a heartbeat record, in the order the watchdog has always written them: a
#: reader of another version reads the records of this one.
_HEARTBEAT_KEYS = [
    *("rank", "host", "pid", "beat", "gen", "seq", "op", "in_op", "step", "phase", "section"),
    *("section_left", "status", "compute_s", "progress", "idle", "moving", "where", "inside"),
    *("raised", "t", "diag"),
]


def test_a_published_heartbeat_keeps_its_keys_and_reads_back_equal_and_frozen(
    store: dist.Store,
) -> None:
    rt, wd, other = _runtime_for(store)
    assert list(wd._state().record()) == _HEARTBEAT_KEYS
    answer = wd._state(with_stack=True)  # its answer to a diagnosis request
    assert list(answer.record()) == [*_HEARTBEAT_KEYS, "stack"]
    assert list(rt.snapshot(-1).record()) == _HEARTBEAT_KEYS[:-1]  # its last, by its runtime
    rt.control.publish_state(0, answer)
    read = other.read_states([0])[0]
    assert read == answer
    assert ctl.decode_state(answer.record(), "g0/state/0") == answer
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.status = "left"  # type: ignore[misc]


_CRASH = {"kind": "crash", "rank": 1, "reporter": 0}
_TIMEOUT = {"kind": "timeout", "reporter": 0, "op": "x", "seq": 1, "waited": 1.0}


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        ("text", "a str, not an object"),
        ({"rank": 1}, "no 'kind'"),
        ({"kind": "crash", "rank": 1, "culprit": {"rank": 1}}, "no 'reporter'"),
        (_CRASH, "no 'culprit'"),
        ({**_CRASH, "culprit": {}}, "no 'rank'"),
        ({**_CRASH, "rank": "1", "culprit": {"rank": 1}}, "'rank' is str"),
        (
            {**_CRASH, "kind": "left", "final_seq": "3", "culprit": {"rank": 1}},
            "'final_seq' is str",
        ),
        ({**_TIMEOUT, "seq": None}, "'seq' is NoneType"),
        ({**_TIMEOUT, "culprits": [3]}, "a culprit that is not an object"),
        ({**_TIMEOUT, "culprits": [{"rank": 1, "step": "s"}]}, "'step' is str"),
    ],
)
def test_event_problem_names_what_is_wrong(event: Any, problem: str) -> None:
    assert event_problem(event) == problem


def test_event_problem_accepts_what_the_library_posts() -> None:
    culprit = Culprit.record(1, "x", state={"seq": 3, "step": 2, "t": time.time()})
    assert event_problem(_crash(1, reporter=0)) == ""
    timeout = {"kind": "timeout", "reporter": 0, "op": "all_reduce", "seq": 4, "waited": 2.5}
    assert event_problem({**timeout, "culprits": [culprit], "cls": "timeout"}) == ""
    left = {"kind": "left", "rank": 1, "reporter": 1, "final_seq": 3, "culprit": culprit}
    assert event_problem({**left, "secondary": False}) == ""


def test_an_event_is_decoded_into_the_fields_its_readers_use() -> None:
    culprit = Culprit.record(1, "x", state={"seq": 3, "step": 2}, blame="NEVER_ARRIVED")
    timeout = {"kind": "timeout", "reporter": 0, "op": "all_reduce", "seq": 4, "waited": 2}
    ev = ctl.FailureEvent.decode({**timeout, "culprits": [culprit], "gen": 2, "t": 5})
    # A diagnosis's own keys (blame) stay on the wire: the culprit keeps its fields.
    assert ev == ctl.FailureEvent(
        "timeout",
        0,
        culprits=(Culprit(1, what="x", seq=3, step=2),),
        op="all_reduce",
        seq=4,
        waited=2.0,
        gen=2,
        t=5.0,
    )
    assert ev.ranks == (1,)
    left = {"kind": "left", "rank": 1, "reporter": 1, "final_seq": 3, "culprit": culprit}
    ev = ctl.FailureEvent.decode({**left, "secondary": True})
    assert (ev.rank, ev.ranks, ev.final_seq, ev.secondary) == (1, (1,), 3, True)
    assert ev.culprit == Culprit(1, what="x", seq=3, step=2)
    assert (ev.gen, ev.t, ev.cls, ev.seq) == (-1, 0.0, "timeout", -1)  # not said: defaults
    with pytest.raises(ValueError, match="no 'culprit'"):
        ctl.FailureEvent.decode(_CRASH)


def test_the_log_is_read_as_typed_events_and_what_the_library_posts_is_kept() -> None:
    poster = ctl.ControlPlane(dist.HashStore(), 0)
    reader = ctl.ControlPlane(poster.root, 0)
    posted = [_crash(1, reporter=0), {"kind": "crash", "rank": 2, "reporter": 0}]
    poster.post_events(posted)
    events = reader.read_events()
    assert [(e.kind, e.rank, e.reporter) for e in events] == [(ctl.EV_CRASH, 1, 0)]
    assert events[0].culprit == Culprit.from_record(posted[0]["culprit"])
    assert reader.read_events() is events  # decoded once: the same list grows


# -- who watches whom ------------------------------------------------------------------------
def _contiguous(*sizes: int) -> dict[int, str | None]:
    """Ranks laid out host after host (as torchrun does): ``sizes[i]`` ranks on host i."""
    hosts: dict[int, str | None] = {}
    for i, n in enumerate(sizes):
        hosts.update({len(hosts) + k: f"node-{i}" for k in range(n)})
    return hosts


def _round_robin(n_hosts: int, per_host: int) -> dict[int, str | None]:
    """Rank r on host r % n_hosts."""
    return {r: f"node-{r % n_hosts}" for r in range(n_hosts * per_host)}


_LAYOUTS = {
    "16 on 2x8": _contiguous(8, 8),
    "64 on 8x8": _contiguous(*[8] * 8),
    "1024 on 128x8": _contiguous(*[8] * 128),
    "uneven 3,5,8,1": _contiguous(3, 5, 8, 1),
    "uneven 2,1,3,1,2": _contiguous(2, 1, 3, 1, 2),
    "3 hosts of 1": _contiguous(1, 1, 1),
    "10 hosts of 1": _contiguous(*[1] * 10),
    "1 host": _contiguous(4),
    "1 rank": _contiguous(1),
    "2 hosts, 1 rank on one": _contiguous(5, 1),
    "round robin 4x3": _round_robin(4, 3),
    "round robin 6x8": _round_robin(6, 8),
}


def _watchers(hosts: Mapping[int, str | None]) -> tuple[dict[int, list[int]], dict[int, set[int]]]:
    """Each rank's watched ranks, and each rank's watchers (the world: up to the last rank
    in ``hosts``)."""
    world = max(hosts) + 1
    watched = {r: watch_targets(r, world, hosts) for r in range(world)}
    watchers: dict[int, set[int]] = {r: set() for r in range(world)}
    for r, targets in watched.items():
        for t in targets:
            watchers[t].add(r)
    return watched, watchers


def _by_host(hosts: Mapping[int, str | None]) -> dict[str, set[int]]:
    """Each known host's ranks, hosts in order of their smallest rank."""
    members: dict[str, set[int]] = {}
    for r in sorted(hosts):
        host = hosts[r]
        if host is not None:
            members.setdefault(host, set()).add(r)
    return members


@pytest.mark.parametrize("hosts", _LAYOUTS.values(), ids=_LAYOUTS.keys())
def test_every_rank_is_watched_by_another_and_none_watches_itself(
    hosts: dict[int, str | None],
) -> None:
    watched, watchers = _watchers(hosts)
    most = max(len(m) for m in _by_host(hosts).values())
    for r, targets in watched.items():
        assert r not in targets
        assert targets == sorted(set(targets))
        assert len(targets) <= 2 + 2 * most, f"rank {r} watches {len(targets)} ranks"
    if len(hosts) > 1:
        assert [r for r, w in watchers.items() if not w] == []


@pytest.mark.parametrize("hosts", _LAYOUTS.values(), ids=_LAYOUTS.keys())
def test_two_hosts_failing_together_leave_every_failed_rank_watched(
    hosts: dict[int, str | None],
) -> None:
    members = _by_host(hosts)
    if len(members) < 3:
        pytest.skip("needs 3 hosts or more")
    _, watchers = _watchers(hosts)
    names = list(members)
    adjacent = list(zip(names, names[1:] + names[:1], strict=True))
    # Adjacent in the ordering (a rack), then, stronger, any two.
    for a, b in adjacent + list(itertools.combinations(names, 2)):
        dead = members[a] | members[b]
        blind = sorted(r for r in dead if not watchers[r] - dead)
        assert blind == [], f"hosts {a} and {b} fail: no survivor watches ranks {blind}"


@pytest.mark.parametrize("hosts", _LAYOUTS.values(), ids=_LAYOUTS.keys())
def test_each_host_is_watched_whole_from_two_other_hosts(hosts: dict[int, str | None]) -> None:
    members = _by_host(hosts)
    if len(members) < 3:
        pytest.skip("needs 3 hosts or more")
    watched, _ = _watchers(hosts)
    for host, ranks in members.items():
        whole = {hosts[r] for r, targets in watched.items() if ranks <= set(targets)}
        assert len(whole - {host}) >= 2, f"{host} is watched whole from {whole}"


def test_with_one_host_only_the_ring_is_watched() -> None:
    hosts = _contiguous(5)
    assert [watch_targets(r, 5, hosts) for r in range(5)] == [
        [1, 2],
        [2, 3],
        [3, 4],
        [0, 4],
        [0, 1],
    ]
    assert watch_targets(0, 1, {0: "node-0"}) == []
    assert watch_targets(0, 2, {0: "node-0", 1: "node-0"}) == [1]


def test_with_two_hosts_two_ranks_of_each_watch_the_other_whole() -> None:
    hosts = _contiguous(4, 4)
    watched, _ = _watchers(hosts)
    a, b = {0, 1, 2, 3}, {4, 5, 6, 7}
    for host, other in ((a, b), (b, a)):
        whole = [r for r in sorted(host) if other <= set(watched[r])]
        assert len(whole) >= 2, f"{sorted(other)} is watched whole by {whole} only"
    # As before this pattern: a two-host job of two ranks each watches the same ranks.
    two = _contiguous(2, 2)
    assert [watch_targets(r, 4, two) for r in range(4)] == [[1, 2, 3], [2, 3], [0, 1, 3], [0, 1]]


def test_ranks_of_unknown_hosts_are_watched_by_the_ring() -> None:
    hosts = _contiguous(*[4] * 4)
    for r in (5, 6, 11):
        hosts[r] = None
    del hosts[12]  # no identity at all
    watched, watchers = _watchers(hosts)
    assert [r for r, w in watchers.items() if not w] == []
    assert watched[5] == [6, 7]  # an unknown host watches the ring only
    for r in (5, 6, 11, 12):
        assert {(r - 1) % 16, (r - 2) % 16} <= watchers[r]
    # The other ranks still have two other hosts watching them whole.
    known = _by_host(hosts)
    for host, ranks in known.items():
        whole = {hosts[r] for r, targets in watched.items() if ranks <= set(targets)}
        assert len(whole - {host, None}) >= 2


def test_the_watchdog_watches_what_watch_targets_says(store: dist.Store) -> None:
    """Rank 4 of 12, on the second of three hosts of 4 ranks: its own host is read from its
    identity, the others' from the identities they published."""
    config = ResilienceConfig(heartbeat_interval=timedelta(milliseconds=20))
    rt = Runtime(rank=4, world_size=12, backend="gloo", control_root=store, config=config)
    mine = rt.identity["host"]
    hosts = {r: (mine if 4 <= r < 8 else f"other-{r // 4}") for r in range(12)}
    rt.infos = {r: {"rank": r, "host": h, "pid": 1} for r, h in hosts.items()}
    rt.infos[4] = dict(rt.identity)
    wd = Watchdog(rt)
    assert wd.watched == watch_targets(4, 12, hosts)
    assert wd.watched == [5, 6, 8, 9, 10, 11]  # the ring, and the whole next host


def test_a_rank_that_raised_in_the_op_the_peers_gave_up_on_is_not_told_again(
    store: dist.Store,
) -> None:
    """Rank 1 gave up on rank 0 in op #2 while rank 0 gave up on rank 1 there (they issued
    different collectives): rank 0 raised already, and must not be told again, from
    wherever it is next (destroy_process_group, say). Stuck before a later op, it is."""
    rt, _, _ = _runtime_for(store)
    culprit = {"rank": 0, "host": "h", "what": "issued a different collective"}
    on_op = {"kind": "timeout", "reporter": 1, "op": "all_reduce", "waited": 1.7}

    def verdict(seq: int) -> RankFailureError | None:
        ev = ctl.FailureEvent.decode({**on_op, "seq": seq, "culprits": [culprit], "gen": 0})
        return rt._verdict_on_me(ev)

    rt.begin_op("broadcast")
    rt.begin_op("broadcast")  # op #2
    assert isinstance(verdict(2), CollectiveTimeoutError)  # it has not raised: stuck there
    rt.mark_raised()
    assert verdict(2) is None
    assert verdict(1) is None
    told = verdict(3)  # the peers wait in op #3, which it never reached
    assert isinstance(told, CollectiveTimeoutError)
    assert "is stuck: rank 1 gave up on all_reduce#3" in str(told)


class _VerdictMidCall:
    """A store whose every call first has the runtime tell the main thread its verdict (as
    the watchdog does when the peers gave up on it), then answers: the signal handler
    raises inside the store call, as when a SIGCONTed rank reads the store."""

    def __init__(self, store: dist.Store, rt: Runtime, verdict: RankFailureError) -> None:
        self._store, self._rt, self._verdict = store, rt, verdict

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            self._rt.tell_main(self._verdict)  # pthread_kill runs the handler before it returns
            return method(*args)

        return call


@pytest.mark.skipif(_runtime.TELL_SIGNAL is None, reason="no real-time signals here")
@pytest.mark.parametrize("call", ["read_states", "wait_attached", "read_verdict"])
def test_a_verdict_told_in_the_middle_of_a_store_call_is_raised_as_it_is(
    store: dist.Store, call: str
) -> None:
    """The peers' verdict reaches the main thread wherever it is, a store call included: it
    must come out as it is, never as a lost store (a ControlPlaneError that names nobody,
    seen in CI when a SIGSTOPped inference rank was resumed), nor be swallowed as a key
    that did not appear."""
    from resilient_ddp.runtime import _process_hooks

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")
    rt, _, _ = _runtime_for(store)
    rt.main_thread_ident = threading.get_ident()
    verdict = RankFailureError(
        "rank 0: rank 1 reported that it is stopped", culprits=[Culprit.of(0, "is stopped")]
    )
    plane = rt.control
    plane.store = _VerdictMidCall(plane.store, rt, verdict)  # type: ignore[assignment]
    calls = {
        "read_states": lambda: plane.read_states([0, 1]),
        "wait_attached": lambda: plane.wait_attached(2, timedelta(seconds=5)),
        "read_verdict": lambda: plane.read_verdict(1, 0, timedelta(seconds=5)),
    }
    _process_hooks.install_hooks()
    _runtime.set_current(rt)
    try:
        with pytest.raises(RankFailureError) as caught:
            calls[call]()
    finally:
        _runtime.set_current(None)
        _process_hooks.uninstall_hooks()
    assert caught.value is verdict
    assert rt.told_delivered
