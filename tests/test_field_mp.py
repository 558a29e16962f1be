"""Where users run jobs: rank 0 hosts the store (``mp.spawn`` with MASTER_ADDR/MASTER_PORT,
``srun`` with ``env://``), long single-rank work, and the rank the peers gave up on.

Ranks start through ``run_ranks`` but rendezvous as those launchers do: rank 0 hosts the
TCPStore itself on a port taken from ``TCPStore(port=0)`` in the parent (released just
before the ranks start), and the launcher's own store is not used.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.runtime import _runtime
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _field_workers as w

DEADLINE = timedelta(seconds=60)


def _free_port() -> int:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(store.port)
    del store  # the server closes; rank 0 binds the port next
    return port


def _run(fn: Any, world: int, *args: Any) -> list[Any]:
    return run_ranks(
        fn, world, (*args, _free_port()), timeout=DEADLINE, grace=timedelta(seconds=15)
    )


def test_a_rank_busy_in_its_section_budget_is_waited_for() -> None:
    # The section (4 s) outlasts the peers' op timeout (1.5 s): they wait, nobody fails.
    outcomes = _run(w.section_wait, 3, False)
    report = format_outcomes(outcomes)
    for o in outcomes:
        assert o.exitcode == 0, report
        assert o.value["ok"] is True, report
    assert all(o.value["elapsed"] > 2.5 for o in outcomes[1:]), report


def test_a_rank_that_overruns_its_section_is_named_and_stops() -> None:
    outcomes = _run(w.section_wait, 3, True)
    report = format_outcomes(outcomes)
    for o in outcomes:
        assert o.exitcode == 0, report
        assert "CollectiveTimeoutError" in o.value["mro"] or o.value["type"] == "RankFailureError"
        assert o.value["ranks"] == [0], report
        # The budget is 4 s; the rank asleep for 30 s is stopped too.
        assert o.value["elapsed"] < 4 + 3, report


@pytest.mark.parametrize(("culprit", "where"), [(0, "sleep"), (1, "c")])
def test_the_stuck_rank_is_told(culprit: int, where: str) -> None:
    outcomes = _run(w.stuck, 3, culprit, where)
    report = format_outcomes(outcomes)
    for o in outcomes:
        if o.rank == culprit and where == "c":
            # Its main thread cannot raise: it says so and exits with the distinct code.
            assert o.exitcode == _runtime.UNRESPONSIVE_EXIT_CODE, report
            continue
        assert o.exitcode == 0, report
        assert "CollectiveTimeoutError" in o.value["mro"], report
        assert o.value["ranks"] == [culprit], report
        if o.rank == culprit:
            assert "is stuck" in o.value["message"], report
        # op timeout 1.5 s, then the verdict reaches the stuck rank within a tick.
        assert o.value["elapsed"] < 1.5 + 3, report


def test_survivors_name_the_store_host_that_raised_first() -> None:
    # Rank 0 hosts the store and exits as soon as it raised; it keeps serving until the
    # others have read its exception (they used to read "store unreachable").
    for _ in range(3):
        outcomes = _run(w.raise_first, 3)
        report = format_outcomes(outcomes)
        assert outcomes[0].exitcode == 1, report
        assert "ValueError" in (outcomes[0].traceback or ""), report
        for o in outcomes[1:]:
            assert o.exitcode == 0, report
            assert o.value["type"] == "RankFailureError", report
            assert o.value["ranks"] == [0], report
            assert o.value["exc_type"] == "ValueError", report
            assert o.value["elapsed"] < 3, report


def test_init_timeout_bounds_the_rendezvous_and_every_rank_gets_the_verdict() -> None:
    outcomes = _run(w.missing_rank, 3, 4.0)
    report = format_outcomes(outcomes)
    for o in outcomes:
        assert o.exitcode == 0, report
        assert o.value["type"] == "PreflightError", report
        assert any("[3] never arrived" in p for p in o.value["problems"]), report
        assert o.value["elapsed"] < 4.0 + 3, report  # timeout=, not init_timeout (300 s)


def test_a_healthy_exit_is_not_slowed_by_the_store_host() -> None:
    outcomes = _run(w.healthy_exit, 3)
    report = format_outcomes(outcomes)
    assert all(o.exitcode == 0 for o in outcomes), report
    # docs/benchmarks.md quotes these (pytest -s shows them).
    print(
        "destroy_process_group seconds per rank:",
        [round(o.value["destroy_s"], 3) for o in outcomes],
    )
    # Rank 0 waits only for the others' departure, which comes at once here.
    assert outcomes[0].value["destroy_s"] < 2.0, report
