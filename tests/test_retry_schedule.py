"""The retry schedule: attempts counted from the first, pauses as documented."""

from __future__ import annotations

import pytest
import tenacity

import resilient_ddp as rd
from resilient_ddp.ops.collectives import _retries, _TransientError


def _redos(policy: rd.RetryPolicy | tenacity.Retrying, budget_s: float = 60.0) -> tuple[int, list]:
    pauses: list[float] = []
    controller = _retries(policy, budget_s)
    controller.sleep = pauses.append  # never really sleep
    redos = 0

    def drive() -> None:
        nonlocal redos
        for attempt in controller:
            with attempt:
                redos += 1
                raise _TransientError("every rank arrived, no progress")

    with pytest.raises(tenacity.RetryError):
        drive()
    return redos, pauses


def test_retry_policy_counts_the_first_attempt_and_doubles_the_pause() -> None:
    redos, pauses = _redos(rd.RetryPolicy(attempts=4, backoff=0.1, max_backoff=0.3))
    assert redos == 3  # 4 attempts in all
    # Before attempt k + 1: min(backoff * 2**(k - 1), max_backoff); the pause before the
    # second attempt (k = 1) is taken outside tenacity.
    assert pauses == [0.2, 0.3]


def test_users_tenacity_stop_counts_the_first_attempt() -> None:
    policy = tenacity.Retrying(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_fixed(0.05))
    redos, pauses = _redos(policy)
    assert redos == 2
    assert pauses == [0.05]


def test_only_transient_failures_are_retried() -> None:
    controller = _retries(rd.RetryPolicy(attempts=5), 60.0)
    controller.sleep = lambda _s: None
    calls = 0

    def drive() -> None:
        nonlocal calls
        for attempt in controller:
            with attempt:
                calls += 1
                raise rd.RankFailureError("a peer died: not retried")

    with pytest.raises(rd.RankFailureError):
        drive()
    assert calls == 1
