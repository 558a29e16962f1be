"""The test harness itself: ranks forked from the fork server start as fresh processes."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks


def _inspect(rank: int) -> dict[str, Any]:
    import resilient_ddp as rd
    from resilient_ddp.runtime import _runtime

    sockets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            sockets.append(link)
    return {
        "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")),
        "sockets": sockets,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "runtime": _runtime.current() is not None,
        "initialized": rd.is_initialized(),
        "pid": os.getpid(),
    }


def test_ranks_start_as_fresh_processes() -> None:
    outcomes = run_ranks(_inspect, 2, timeout=timedelta(seconds=60), start_method="forkserver")
    report = format_outcomes(outcomes)
    fresh = run_ranks(_inspect, 1, timeout=timedelta(seconds=60), start_method="spawn")[0].value
    for o in outcomes:
        assert o.exitcode == 0, report
        v = o.value
        # One Python thread, and no more native threads than a freshly spawned rank has:
        # nothing inherited from the server.
        assert v["threads"] == 1, report
        assert v["native_threads"] <= fresh["native_threads"], (fresh, report)
        # The pipe to the parent is not a socket; no store connection is inherited.
        assert v["sockets"] == [], report
        assert v["sigterm_default"], report
        assert not v["runtime"], report
        assert not v["initialized"], report
    assert outcomes[0].value["pid"] != outcomes[1].value["pid"]


def _read_env(rank: int) -> str | None:
    return os.environ.get("RD_HARNESS_PROBE")


def test_ranks_see_the_parents_environment_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set after the fork server started: a child forked from it must still see it, as a
    # spawned child would (an operator's RESILIENT_DDP_* variables reach the ranks).
    run_ranks(
        _inspect, 1, timeout=timedelta(seconds=60), start_method="forkserver"
    )  # the server is up by now
    monkeypatch.setenv("RD_HARNESS_PROBE", "set-late")
    outcomes = run_ranks(_read_env, 2, timeout=timedelta(seconds=60), start_method="forkserver")
    assert [o.value for o in outcomes] == ["set-late", "set-late"], format_outcomes(outcomes)


def test_the_longest_files_listed_for_scheduling_exist() -> None:
    """conftest's LONGEST_FILES (started first by ``nox -s tests``) names test files that
    exist: a renamed file would silently lose its place."""
    from pathlib import Path

    from .conftest import LONGEST_FILES

    here = Path(__file__).resolve().parent
    missing = [name for name in LONGEST_FILES if not (here / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
