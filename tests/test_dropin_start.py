"""Start-up as users' existing scripts write it (issue 30, item 7).

PyTorch's DDP tutorial sets ``os.environ["MASTER_PORT"] = "12355"`` (and MASTER_ADDR) in the
script. Under ``rd.spawn`` (here) or torchrun (tests/test_torchrun_mp.py), every rank then
connects to a port where no one listens: start-up must name that line within seconds, not
wait out ``init_timeout`` and blame rank 0. The same port set again must still work.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _dropin_start_workers as w

WORLD = 3
DEADLINE_S = 60.0  # the job's own deadline, under pytest-timeout's 120 s
NAMED_WITHIN_S = 10.0


def _run(port: str | None, start_method: str | None = None) -> dict[int, Any]:
    outcomes = run_ranks(
        w.tutorial_setup,
        WORLD,
        (port,),
        timeout=timedelta(seconds=DEADLINE_S),
        start_method=start_method,
    )
    for o in outcomes:
        assert o.exitcode == 0, format_outcomes(outcomes)
    return {o.rank: o.value for o in outcomes}


# The conftest's fork server (whose /proc/self/environ is the server's, not what rd.spawn
# gave the rank), and fresh interpreters.
@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_a_script_that_sets_another_master_port_is_told_to_remove_the_line(
    start_method: str | None,
) -> None:
    values = _run("12355", start_method)
    for rank, v in values.items():
        assert v.get("type") == "PreflightError", (rank, v)
        assert v["elapsed"] < NAMED_WITHIN_S, (rank, v)
        (problem,) = v["problems"]
        assert problem.startswith("the script sets MASTER_PORT=12355"), problem
        assert "rd.spawn's rendezvous store is at 127.0.0.1:" in problem, problem
        assert "remove os.environ['MASTER_PORT'] = ..." in problem, problem
        assert "is rank 0 running" not in v["message"], v["message"]


def test_a_script_that_sets_the_launchers_own_port_starts() -> None:
    values = _run(None)
    for rank, v in values.items():
        assert v.get("ok") is True, (rank, v)


def test_a_rank_that_trained_with_the_inference_sampler_and_left_is_told_why() -> None:
    """Issue 30, item 8: ``BalancedDistributedSampler`` where a training loop had
    ``DistributedSampler`` ends in "rank 1 left the group"; the error says which samplers
    train."""
    outcomes = run_ranks(w.uneven_training, WORLD, timeout=timedelta(seconds=DEADLINE_S))
    values = {o.rank: o.value for o in outcomes}
    assert values[1] == {"steps": 3}, format_outcomes(outcomes)
    assert values[2] == {"steps": 3}, format_outcomes(outcomes)
    v = values[0]
    assert v is not None, format_outcomes(outcomes)
    assert v.get("type") == "RankFailureError", format_outcomes(outcomes)
    assert v["steps"] == 3, v
    assert "left the group after op #" in v["message"], v["message"]
    assert (
        "HINT: it trained with rd.BalancedDistributedSampler, an inference sampler whose "
        "shards are uneven" in v["message"]
    ), v["message"]
    assert (
        "rd.LockstepBatchSampler, rd.ElasticBatchSampler or torch's DistributedSampler"
        in (v["message"])
    ), v["message"]


@pytest.mark.parametrize(
    ("signum", "what"),
    [(signal.SIGKILL, "RankFailureError"), (signal.SIGSTOP, "CollectiveTimeoutError")],
)
def test_a_rank_killed_in_a_fast_loop_is_named_in_the_step_and_phase_it_died_in(
    signum: int, what: str
) -> None:
    """Issue 30, item 6: in a loop of about 10 ms a step, a rank SIGKILLed right after the
    forward pass of step 99 was reported in step 91 or 97 (its last heartbeat, 0.1 s old).
    On one host the culprit's board gives the step and phase it died (or was stopped) in,
    exactly, and no age. A stopped rank is named when the op timeout runs out, then killed
    by the launcher after the grace period."""
    outcomes = run_ranks(
        w.fast_loop_kill,
        WORLD,
        (int(signum),),
        timeout=timedelta(seconds=DEADLINE_S),
        grace=timedelta(seconds=2),
    )
    if signum == signal.SIGKILL:
        assert outcomes[w.KILL_RANK].exitcode == -signal.SIGKILL, format_outcomes(outcomes)
    for rank in (0, 2):
        v = outcomes[rank].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v.get("type") == what, format_outcomes(outcomes)
        assert v["completed"] == w.KILL_STEP, v
        c = v["culprit"]
        assert (c["rank"], c["step"], c["phase"]) == (w.KILL_RANK, w.KILL_STEP, "forward"), v
        assert c["state_age"] is None, v  # read from its board: what it did when it stopped
        assert f"[step {w.KILL_STEP}, phase 'forward', last op " in v["message"], v["message"]
        assert "as of" not in v["message"], v["message"]
