"""The launcher's bookkeeping without processes: what it kills and how it reports it."""

from __future__ import annotations

from typing import Any

import pytest

from resilient_ddp.errors import RankOutcome
from resilient_ddp.testing import format_outcomes
from resilient_ddp.tools import launch


class _Proc:
    """A process stand-in: alive until ``alive`` is set False or it is killed, and how
    often the launcher killed it."""

    _pids = iter(range(10_000, 20_000))

    def __init__(self, state: str = "S") -> None:
        self.alive = True
        self.kills = 0
        self.pid = next(self._pids)
        self.state = state  # what /proc says: S sleeping, T stopped

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.kills += 1
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        pass


class _Jobs:
    def __init__(self, members: list[int]) -> None:
        self.record = {"members": members}

    def members(self) -> dict[str, Any]:
        return self.record


def _job(procs: list[_Proc], members: list[int]) -> Any:
    job = object.__new__(launch._Job)
    job.procs = procs
    job.uids = list(range(len(procs)))
    job.ever_member = set(range(len(procs)))
    job.evicted_at = {}
    job.killed = set()
    job.jobs = _Jobs(members)
    return job


def _proc_states(monkeypatch: pytest.MonkeyPatch, procs: list[_Proc]) -> None:
    by_pid = {p.pid: p for p in procs}
    monkeypatch.setattr(launch.ctl, "process_state", lambda pid: by_pid[pid].state)


def test_an_evicted_process_that_ends_by_itself_within_the_grace_is_not_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 died by SIGKILL, but the kernel still tears it down (it looks alive) when the
    launcher reads the members the survivors agreed on without it: it is not killed, and
    so keeps its own exit code. Rank 3, hung, is killed once the grace has passed."""
    now = [100.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: now[0])
    procs = [_Proc() for _ in range(4)]
    _proc_states(monkeypatch, procs)
    job = _job(procs, members=[0, 1])
    job._remove_evicted()
    assert [p.kills for p in procs] == [0, 0, 0, 0]
    now[0] += launch._EVICT_GRACE_S / 2
    procs[2].alive = False  # its teardown ended
    job._remove_evicted()
    assert [p.kills for p in procs] == [0, 0, 0, 0]
    now[0] += launch._EVICT_GRACE_S / 2
    job._remove_evicted()
    assert [p.kills for p in procs] == [0, 0, 0, 1]
    assert job.killed == {3}
    job._remove_evicted()  # nothing is killed twice
    assert [p.kills for p in procs] == [0, 0, 0, 1]


def test_an_evicted_process_that_is_stopped_is_killed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopped process (SIGSTOP) cannot end by itself: no grace for it."""
    monkeypatch.setattr(launch.time, "monotonic", lambda: 100.0)
    procs = [_Proc(), _Proc(), _Proc(state="T"), _Proc(state="S")]
    _proc_states(monkeypatch, procs)
    job = _job(procs, members=[0, 1])
    job._remove_evicted()
    assert [p.kills for p in procs] == [0, 0, 1, 0]
    assert job.killed == {2}


def test_the_launchers_take_seconds_or_timedeltas_and_refuse_the_rest() -> None:
    from datetime import timedelta

    from resilient_ddp.errors import ConfigError

    for bad in ({"timeout": -1}, {"grace": "5"}, {"timeout": timedelta(0)}):
        with pytest.raises(ConfigError):
            launch.launch(print, 1, **bad)  # type: ignore[arg-type]


def test_members_that_stay_are_never_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: now[0])
    procs = [_Proc() for _ in range(3)]
    _proc_states(monkeypatch, procs)
    job = _job(procs, members=[0, 1, 2])
    for _ in range(3):
        job._remove_evicted()
        now[0] += launch._EVICT_GRACE_S
    assert [p.kills for p in procs] == [0, 0, 0]
    assert job.killed == set()


def test_format_outcomes_lists_the_processes_a_slot_had_before() -> None:
    earlier = (
        RankOutcome(1, -9),
        RankOutcome(1, 1, exc_type="ValueError", exc_message="x", traceback="Trace\n  boom"),
    )
    text = format_outcomes(
        [RankOutcome(0, 0, value=5), RankOutcome(1, 0, value=6, previous=earlier)]
    )
    assert "--- rank 1: exitcode=0 value=6" in text
    assert "rank 1, process 1 of 3: exitcode=-9" in text
    assert "rank 1, process 2 of 3: exitcode=1 raised ValueError" in text
    assert "    Trace\n      boom" in text


def test_peak_rss_follows_this_process_from_a_reset() -> None:
    from resilient_ddp.testing import peak_rss_mib

    before = peak_rss_mib(reset=True)
    block = bytearray(64 << 20)  # 64 MiB, touched: resident
    for i in range(0, len(block), 4096):
        block[i] = 1
    grew = peak_rss_mib() - before
    del block
    assert 60 < grew < 200, grew
