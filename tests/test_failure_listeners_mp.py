"""rd.add_failure_listener: called once on every rank that meets a failure, with the typed
error, before it is raised (raise mode) or before the survivors recover (shrink mode); the
emergency-checkpoint recipe, with rank 0 itself the culprit, and a fresh job resuming from
that checkpoint bit for bit."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import resilient_ddp as rd
from resilient_ddp.runtime import _runtime
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _listener_workers as w

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}


def _run(fn: Any, world: int, *args: Any, ranks: list[int]) -> dict[int, Any]:
    outcomes = run_ranks(
        fn, world, args, timeout=timedelta(seconds=45), grace=timedelta(seconds=10)
    )
    report = format_outcomes(outcomes)
    for r in ranks:
        assert outcomes[r].exitcode == 0, report
    return {r: outcomes[r].value for r in ranks}


def test_an_emergency_checkpoint_saved_when_rank_0_fails_resumes_bitwise(tmp_path: Path) -> None:
    path = str(tmp_path / "emergency.pt")
    survivors = _run(w.emergency_checkpoint, 3, 0, path, FAST, ranks=[1, 2])
    hashes = set()
    for r, v in survivors.items():
        assert v["raised"] == "RankFailureError", (r, v)
        assert v["ranks"] == [0], (r, v)
        # Once, with the error it raised, on the training thread, before the raise: the
        # state then is the one the rank holds after catching the error.
        assert len(v["calls"]) == 1, (r, v["calls"])
        call = v["calls"][0]
        assert call["type"] == "RankFailureError", call
        assert call["ranks"] == [0], call
        assert call["main_thread"], call
        assert call["hash"] == v["hash_after"], (r, v)
        assert v["step"] == w.FAULT_STEP, (r, v)
        hashes.add(v["hash_after"])
    assert len(hashes) == 1, survivors  # the survivors agree
    assert Path(path).exists()  # saved by rank 1, the lowest survivor
    resumed = _run(w.resume, 2, path, ranks=[0, 1])
    (saved,) = hashes
    for r, v in resumed.items():
        assert v["loaded"] == saved, (r, v)  # bit for bit the survivors' state
        assert v["step"] == w.FAULT_STEP, (r, v)


def test_under_shrink_the_listener_runs_once_per_failure_before_recovery(
    tmp_path: Path,
) -> None:
    culprit = 2
    event_log = str(tmp_path / "events-{rank}.jsonl")
    values = _run(w.shrink_listener, 4, culprit, event_log, ranks=[0, 1, 3])
    for r, v in values.items():
        # The JSON-lines event file of this rank (its rank when the job started): the
        # failure, then the shrink, each a record with the job, rank and generation.
        lines = (tmp_path / f"events-{r}.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        assert [e["kind"] for e in events] == ["failure", "shrink"], events
        failure, shrink = events
        assert failure["ranks"] == [culprit], failure
        assert failure["rank"] == r, failure
        assert failure["generation"] == 0, failure
        assert shrink["world_size_before"] == 4, shrink
        assert shrink["world_size"] == 3, shrink
        assert shrink["outcome"] in {"redo", "skip", "continue"}, shrink
        assert [c["rank"] for c in shrink["culprits"]] == [culprit], shrink
        assert shrink["rank"] == v["rank_after"], shrink
        assert failure["job"] == shrink["job"], events
        assert failure["job"], failure
        # Log records carry the rank (the shrink's warning, written after the recovery).
        assert v["log_ranks"], v
        assert v["log_ranks"][-1] == v["rank_after"], v
        assert v["world"] == 3, (r, v)
        assert v["failures"] == 1, (r, v)
        assert len(v["calls"]) == 1, (r, v["calls"])
        call = v["calls"][0]
        assert "RankFailureError" in call["type"], call
        assert call["ranks"] == [culprit], call
        assert call["world"] == 4, call  # before the recovery formed the smaller world


def test_a_listener_handle_removes_it() -> None:
    def fn(error: rd.RankFailureError) -> None:
        pass

    handle = rd.add_failure_listener(fn)
    assert fn in _runtime._failure_listeners.values()
    handle.remove()
    assert fn not in _runtime._failure_listeners.values()


def test_log_records_say_which_rank_wrote_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_ddp"):
        logging.getLogger("resilient_ddp").warning("no process group here")
    assert caplog.records[-1].rank == "-"  # type: ignore[attr-defined]


def test_a_world_size_listener_rescales_the_learning_rate_on_every_process() -> None:
    """Member 2 of 4 dies at step 5 and a replacement joins: the survivors see the shrink
    (4 -> 3) and the admission (3 -> 4), the joiner the admission; each sets the learning
    rate from the change before the next step, so every process trains every step with
    the same rate (0.75 of the base while 3 train) and ends in the same state."""
    outcomes = run_ranks(w.world_size_listener, 4, (), timeout=timedelta(seconds=60), restarts=1)
    report = format_outcomes(outcomes)
    finals = [o.value for o in outcomes if o.exitcode == 0 and o.value]
    assert len(finals) == 4, report
    assert [o.rank for o in outcomes if o.previous] == [2], report
    for v in finals:
        kinds = [(c["reason"], c["old_world_size"], c["new_world_size"]) for c in v["changes"]]
        if v["joiner"]:
            assert kinds == [("join", 3, 4)], (v["uid"], v["changes"])
        else:
            assert kinds == [("shrink", 4, 3), ("join", 3, 4)], (v["uid"], v["changes"])
        assert all(c["initial_world_size"] == 4 for c in v["changes"]), v["changes"]
        for step, world, lr in v["seen"]:
            assert lr == w.BASE_LR * world / 4, (v["uid"], step, world, lr)
        assert v["lr"] == w.BASE_LR, v
    assert len({v["hash"] for v in finals}) == 1, [v["hash"] for v in finals]
