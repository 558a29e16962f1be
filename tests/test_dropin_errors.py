"""Drop-in error handling (issue 30, item 1): each of our errors is also the exception a
plain-torch program caught at that place, so ``except RuntimeError`` and
``except torch.distributed.DistError`` (and its subclasses) written for torch keep catching.
The multi-process test kills a rank and checks that the survivor's ``except RuntimeError``
around a collective catches the library's :class:`RankFailureError`."""

from __future__ import annotations

import pickle
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
)

import resilient_ddp as rd
from resilient_ddp.testing import format_outcomes, kill_self, run_ranks

DEADLINE = timedelta(seconds=45)  # below pytest-timeout (120 s)
FAST: dict[str, Any] = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 30.0}


def _errors() -> list[BaseException]:
    """One instance of every public error, built as the library builds it."""
    return [
        rd.PreflightError("ranks disagree", problems=["rank 1: torch 2.11"]),
        rd.RankFailureError("rank 2 died", op="all_reduce", seq=3),
        rd.CollectiveTimeoutError("rank 2 is late", op="all_reduce", seq=3),
        rd.ControlPlaneError("the store is gone"),
        rd.CollectiveMismatchError("shapes differ", ranks=[1], op="all_reduce", seq=3),
        rd.RetryBudgetExhaustedError(
            "gave up", attempts=2, last_attempt=rd.CollectiveTimeoutError("late")
        ),
    ]


# What a plain-torch program catches at the place each error is raised.
TORCH_TYPE = {
    rd.PreflightError: dist.DistError,
    rd.RankFailureError: dist.DistBackendError,
    rd.CollectiveTimeoutError: dist.DistBackendError,
    rd.ControlPlaneError: dist.DistStoreError,
    rd.CollectiveMismatchError: dist.DistError,
    rd.RetryBudgetExhaustedError: dist.DistError,
}


def _roundtrip(e: BaseException) -> BaseException:
    copy: BaseException = pickle.loads(pickle.dumps(e))  # noqa: S301 - our own bytes
    return copy


@pytest.mark.parametrize("make", range(len(_errors())), ids=lambda i: type(_errors()[i]).__name__)
@pytest.mark.parametrize("pickled", [False, True], ids=["raised", "pickled"])
def test_each_error_is_caught_by_torchs_types(make: int, pickled: bool) -> None:
    error = _errors()[make]
    if pickled:  # as it comes back from rd.spawn
        error = _roundtrip(error)
        assert type(error) is type(_errors()[make])
    specific = TORCH_TYPE[type(error)]
    for torch_type in (RuntimeError, dist.DistError, specific):
        with pytest.raises(torch_type) as info:
            raise error
        assert info.value is error
        assert isinstance(error, rd.ResilientDDPError)


def test_a_collective_timeout_is_also_a_timeout_error() -> None:
    error = rd.CollectiveTimeoutError("late", op="barrier", seq=1)
    for caught in (TimeoutError, OSError, RuntimeError, dist.DistBackendError, rd.RankFailureError):
        with pytest.raises(caught):
            raise error
    assert str(error) == "late"
    assert error.errno is None  # an OSError with no errno: the message stays as given
    assert isinstance(_roundtrip(error), TimeoutError)


def test_control_plane_error_is_a_store_error_and_a_rank_failure() -> None:
    error = rd.ControlPlaneError("the store is gone")
    assert isinstance(error, dist.DistStoreError)
    assert isinstance(error, dist.DistBackendError)
    assert isinstance(error, rd.RankFailureError)


def test_config_error_stays_a_value_error_only() -> None:
    assert issubclass(rd.ConfigError, ValueError)
    assert not issubclass(rd.ConfigError, RuntimeError)


def test_spawn_error_is_what_torch_multiprocessing_spawn_raises() -> None:
    outcomes = [
        rd.RankOutcome(rank=0, exitcode=0),
        rd.RankOutcome(rank=1, exitcode=None),  # the launcher killed it
        rd.RankOutcome(rank=2, exitcode=1, exc_type="ValueError", exc_message="x"),
    ]
    for error in (rd.SpawnError("2 of 3 failed", outcomes=outcomes),):
        for copy in (error, _roundtrip(error)):
            for caught in (ProcessRaisedException, ProcessExitedException, ProcessException):
                with pytest.raises(caught):
                    raise copy
            assert isinstance(copy, rd.SpawnError)
            assert not isinstance(copy, RuntimeError)  # neither of torch's is one
            assert copy.error_index == 1
            assert copy.exit_code == -9
            assert copy.signal_name == "SIGKILL"
            assert copy.msg == "2 of 3 failed"
            assert copy.failed_ranks == (1, 2)
    raised = rd.SpawnError("x", outcomes=outcomes[2:])
    assert (raised.error_index, raised.exit_code, raised.signal_name) == (2, 1, None)


def test_without_torchs_error_types_the_stand_ins_are_runtime_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resilient_ddp.errors import _torch_error_types

    monkeypatch.delattr(dist, "DistError")
    error, backend, store = _torch_error_types()
    assert error is not RuntimeError
    assert issubclass(error, RuntimeError)
    assert issubclass(backend, error)
    assert issubclass(store, error)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # import fails
    assert issubclass(_torch_error_types()[1], RuntimeError)


def test_our_errors_pass_the_elastic_store_error_wrapper_unchanged() -> None:
    """The elastic protocol rewrites a ``ControlPlaneError`` caused by a store call; one
    caused by another of our errors (now also a ``RuntimeError``) passes as it is."""
    from resilient_ddp.training.elastic import _typed_store_errors

    inner = rd.ControlPlaneError("the watchdog saw the store go")
    outer = rd.ControlPlaneError("all_reduce#3 cannot complete")
    outer.__cause__ = inner

    @_typed_store_errors("recovery")
    def step() -> None:
        raise outer

    with pytest.raises(rd.ControlPlaneError) as info:
        step()
    assert info.value is outer

    @_typed_store_errors("recovery")
    def preflight() -> None:
        raise rd.PreflightError("versions differ")

    with pytest.raises(rd.PreflightError):
        preflight()


# -- a real failure, caught by code written for plain torch -------------------------------------
def survivor_catches_runtime_error(rank: int, culprit: int) -> dict[str, Any]:
    """Rank ``culprit`` dies; the others' ``except RuntimeError`` catches the collective's
    error, as the handler of a plain-torch training script would."""
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAST))
    t = torch.ones(2)
    rd.all_reduce(t)  # healthy: everyone is up
    if rank == culprit:
        kill_self()
    t0 = time.monotonic()
    try:
        rd.all_reduce(t)
    except RuntimeError as e:  # what a plain-torch user writes around a collective
        return {
            "type": type(e).__name__,
            "dist_backend_error": isinstance(e, dist.DistBackendError),
            "ranks": list(getattr(e, "ranks", ())),
            "elapsed": time.monotonic() - t0,
            "message": str(e),
        }
    finally:
        rd.destroy_process_group()
    return {"type": None}


def test_survivors_except_runtime_error_catches_a_rank_failure() -> None:
    outcomes = run_ranks(
        survivor_catches_runtime_error, 3, (2,), timeout=DEADLINE, grace=timedelta(seconds=10)
    )
    report = format_outcomes(outcomes)
    assert outcomes[2].exitcode == -9, report
    for r in (0, 1):
        assert outcomes[r].exitcode == 0, report
        v = outcomes[r].value
        assert v["type"] == "RankFailureError", report
        assert v["dist_backend_error"], v
        assert v["ranks"] == [2], v["message"]
        assert v["elapsed"] < 5.0, v
