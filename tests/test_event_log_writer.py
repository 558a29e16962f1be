"""The event log is written off the training thread (issue 29, item 7): a file system that
stops answering (a FIFO nobody reads stands in for a hung network mount: ``open`` blocks)
never blocks a rank; lines that find the queue full are dropped, counted and reported."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilient_ddp.control import _events
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _workers as w

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}


def _rt(path: str) -> Any:
    return SimpleNamespace(
        control_root=SimpleNamespace(job_id="job"),
        rank=0,
        identity={"host": "h"},
        generation=0,
        config=SimpleNamespace(event_log=path),
        event_file=lambda template: template.replace("{rank}", "0"),  # Runtime.event_file
    )


@pytest.fixture
def writer() -> Iterator[_events._Writer]:
    """A fresh writer in place of the module's, whose thread is gone afterwards."""
    old, fresh = _events.writer, _events._Writer()
    _events.writer = fresh
    try:
        yield fresh
    finally:
        _events.writer = old
        t = fresh._thread
        if t is not None:
            t.join(timeout=5)
            assert not t.is_alive()


def _drain(fifo: Path, writer: _events._Writer) -> list[dict[str, Any]]:
    """Open the FIFO for reading (unblocking the writer's ``open``) and read until the
    writer has nothing left; the lines read."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    data = b""
    try:
        done, deadline = False, time.monotonic() + 10
        while time.monotonic() < deadline:
            while True:  # what is in the pipe now
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                data += chunk
            if done:
                break
            done = writer.flush(0.05)  # then one more read of what it wrote last
    finally:
        os.close(fd)
    return [json.loads(x) for x in data.decode().splitlines()]


def test_a_blocked_file_costs_a_caller_at_most_one_short_wait(
    tmp_path: Path, writer: _events._Writer
) -> None:
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    rt = _rt(str(fifo))
    t0 = time.monotonic()
    _events.record(rt, "failure", ranks=[1])  # waits WAIT_S, its line never written
    first = time.monotonic() - t0
    t1 = time.monotonic()
    for _ in range(50):
        _events.record(rt, "straggler")  # the writer is stalled: no wait at all
    rest = time.monotonic() - t1
    assert _events.WAIT_S <= first < _events.WAIT_S + 2.0
    assert rest < 1.0, rest  # 50 calls, none waiting WAIT_S (that would be 5 s)
    assert not writer.flush(0.01)  # still blocked
    lines = _drain(fifo, writer)  # nothing lost once it answers, in order
    assert [x["kind"] for x in lines] == ["failure"] + ["straggler"] * 50
    assert writer.dropped == 0


def test_lines_beyond_the_queue_are_dropped_counted_and_reported(
    tmp_path: Path, writer: _events._Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_events, "QUEUE_LINES", 5)
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    rt = _rt(str(fifo))
    for _ in range(20):
        _events.record(rt, "straggler")
    # One taken by the (blocked) writer, 5 queued, the other 14 dropped.
    assert writer.dropped == 14
    lines = _drain(fifo, writer)
    kinds = [x["kind"] for x in lines]
    assert kinds.count("straggler") == 6
    assert {"kind": "events_dropped", "dropped": 14}.items() <= next(
        x for x in lines if x["kind"] == "events_dropped"
    ).items()


def test_events_reach_an_answering_file_in_order(tmp_path: Path, writer: _events._Writer) -> None:
    path = tmp_path / "ev-{rank}.jsonl"
    rt = _rt(str(path))
    threads = [
        threading.Thread(target=lambda i=i: _events.record(rt, "straggler", i=i)) for i in range(8)
    ]
    _events.record(rt, "failure", n=0)  # written before record returns
    assert (tmp_path / "ev-0.jsonl").read_text().count("\n") == 1
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.flush(5)
    lines = [json.loads(x) for x in (tmp_path / "ev-0.jsonl").read_text().splitlines()]
    assert sorted(x.get("i", -1) for x in lines) == [-1, *range(8)]


def test_a_rank_killed_while_the_event_log_hangs_is_named_at_once(tmp_path: Path) -> None:
    for r in range(3):
        os.mkfifo(tmp_path / f"events-{r}.jsonl")
    cfg = {**FAST, "event_log": str(tmp_path / "events-{rank}.jsonl")}
    outcomes = run_ranks(
        w.fault,
        3,
        ("all_reduce", "kill", 2, cfg),
        timeout=timedelta(seconds=45),
        grace=timedelta(seconds=10),
    )
    report = format_outcomes(outcomes)
    for r in (0, 1):
        assert outcomes[r].exitcode == 0, report
        v = outcomes[r].value
        assert isinstance(v, dict), report
        assert v["type"] == "RankFailureError", v["message"]
        assert v["ranks"] == [2], v["message"]
        # As without the log (test_collectives_mp: < 2 s); before, the survivors hung for
        # good in the event write of the failure.
        assert v["elapsed"] < 2.0 + _events.WAIT_S, v
    assert outcomes[2].exitcode == -9
