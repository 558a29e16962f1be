"""rd.make_resilient (taking over a DDP that a framework built) and
rd.bound_torch_collectives (torch.distributed's own collectives, bounded), with real gloo
ranks. Workers: tests/_adopt_workers.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import resilient_ddp as rd

from . import _adopt_workers as a
from .test_ddp_mp import FAST, _values


@pytest.fixture(autouse=True)
def torch_collectives_untouched() -> Iterator[None]:
    """bound_torch_collectives patches the process it runs in: only the ranks may call it.
    Should this process ever be patched, it is restored before failing the test."""
    c10d = dist.distributed_c10d
    yield
    patched = [n for n in a.TORCH_OPS if getattr(dist, n) is not getattr(c10d, n)]
    if patched:
        rd.bound_torch_collectives(False)
        for name in patched:
            setattr(dist, name, getattr(c10d, name))
        pytest.fail(f"torch.distributed was left patched in the test process: {patched}")


# -- parity with DDP --------------------------------------------------------------------------
def test_made_resilient_before_training_trains_like_ddp() -> None:
    values = _values(a.parity, 3, "before", 0, ranks=[0, 1, 2])
    for r, v in values.items():
        assert v["returned_self"] is True, (r, v)
        assert v["isinstance"] is True, (r, v)
        assert v["twice_returned_self"] is True, (r, v)
        assert v["type"] == "ResilientDDP", (r, v)
        assert v["same"], (r, v)
        assert v["moved"], (r, v)


@pytest.mark.parametrize(
    ("mode", "at"),
    [
        ("mid_step", 0),  # between the first forward and its backward
        ("mid_step", 2),  # the same after two plain DDP steps (buckets already rebuilt)
        ("between", 2),  # between steps, after two plain DDP steps
    ],
)
def test_made_resilient_during_training_trains_like_ddp(mode: str, at: int) -> None:
    values = _values(a.parity, 3, mode, at, ranks=[0, 1, 2])
    for r, v in values.items():
        assert v["type"] == "ResilientDDP", (r, v)
        assert v["same"], (r, v)
        assert v["moved"], (r, v)
        if mode == "mid_step":
            # The backward of the forward pass that plain DDP ran went through the
            # library's bucket ops and was waited for at its end (the step was counted).
            assert v["bucket_ops"] >= 1, (r, v)
            assert v["steps_after_backward"] == 1, (r, v)


# -- faults -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where",
    [
        "forward",  # made resilient before training; the culprit dies in its forward pass
        "mid_step",  # made resilient between forward and backward; dies in the reduction
        "mid_step_known",  # the same, its death known before the backward starts
    ],
)
def test_a_rank_killed_after_make_resilient_is_named(where: str) -> None:
    culprit, survivors = 2, [0, 1]
    values = _values(a.fault, 3, where, culprit, FAST, ranks=survivors)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert v["type"] == "RankFailureError", (r, v)
        assert v["ranks"] == [culprit], v["message"]
        assert v["step"] == a.FAULT_STEP, (r, v)
        assert v["model_type"] == "ResilientDDP", (r, v)
        assert v["elapsed"] < 2.0, (r, v)


# -- refusals ---------------------------------------------------------------------------------
def test_make_resilient_refuses_with_a_hint() -> None:
    values = _values(a.refusals, 2, ranks=[0, 1])
    cases = ("subclass", "not_ddp", "python_hook", "builtin_hook", "shrink", "in_backward")
    for r, v in values.items():
        assert v["in_backward_ran"], (r, v)
        for case in cases:
            row = v[case]
            assert row["type"] == "ConfigError", (r, case, row)
            assert "HINT" in row["message"], (r, case, row["message"])
            assert row["unchanged"], (r, case, row)
        assert "FrameworkDDP" in v["subclass"]["message"], v["subclass"]
        assert "Sequential" in v["not_ddp"]["message"], v["not_ddp"]
        assert "communication hook" in v["python_hook"]["message"], v["python_hook"]
        assert "communication hook" in v["builtin_hook"]["message"], v["builtin_hook"]
        assert "shrink" in v["shrink"]["message"], v["shrink"]
        assert "backward" in v["in_backward"]["message"], v["in_backward"]
        assert v["all_reduce_after"] == 2.0, (r, v)
        assert v["adopted_after"] is True, (r, v)


# -- bound_torch_collectives ------------------------------------------------------------------
def _expected_torch_ops(rank: int, world: int) -> dict[str, Any]:
    """What ``_call_torch_ops`` gives on ``rank``, computed by hand: (return, result)."""
    return {
        "all_reduce": (None, [float(sum(r + 1 for r in range(world)))] * 3),
        "broadcast": (None, [2.0] * 3),
        "barrier": (None, None),
        "all_gather": (None, [[float(r)] * 2 for r in range(world)]),
        "all_gather_into_tensor": (None, [10.0 * r for r in range(world) for _ in range(2)]),
        "reduce_scatter_tensor": (
            None,
            [float(sum(2 * rank + i + r for r in range(world))) for i in range(2)],
        ),
        "all_gather_single": (None, [10.0 * r for r in range(world) for _ in range(2)]),
        "reduce_scatter_single": (
            None,
            [float(sum(2 * rank + i + r for r in range(world))) for i in range(2)],
        ),
        "all_reduce_coalesced": (None, [[float(sum(range(world)))] * 2, [float(world)]]),
        "all_gather_object": (None, [{"rank": r, "tag": "x" * r} for r in range(world)]),
        "broadcast_object_list": (None, [{"from": 1, "payload": [1, 2, 3]}, "tail"]),
    }


def test_bound_torch_collectives_give_torchs_results() -> None:
    world = 3
    values = _values(a.torch_ops_healthy, world, FAST, ranks=[0, 1, 2])
    ops = list(a.TORCH_OPS)
    for r, v in values.items():
        assert v["identical_before"] == ops, (r, v)
        assert v["replaced"] == ops, (r, v)
        assert v["second_call_kept"], (r, v)
        expected = _expected_torch_ops(r, world)
        assert v["bounded"] == expected, (r, v["bounded"])
        assert v["native"] == expected, (r, v["native"])
        assert v["bounded_ops"] >= len(ops), (r, v)  # every call was one of the library's
        assert v["async_is_work"], (r, v)
        assert v["async_value"] == [6.0] * 3, (r, v)
        assert v["async_ops"] == 0, (r, v)  # async_op=True went to torch unchanged
        assert v["restored"] == ops, (r, v)
        assert v["restored_all_reduce"] is True, (r, v)
        assert v["rebounded"] == ops, (r, v)
        assert v["rebounded_value"] == 3.0, (r, v)


def test_bound_torch_all_reduce_names_a_hung_rank() -> None:
    culprit, survivors = 2, [0, 1]
    values = _values(a.torch_ops_fault, 3, "hang", culprit, FAST, ranks=survivors)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert v["type"] == "CollectiveTimeoutError", (r, v)
        assert "RankFailureError" in v["mro"], (r, v)
        assert v["ranks"] == [culprit], v["message"]
        assert v["op"] == "torch.distributed.all_reduce", (r, v)
        assert "time.sleep" in v["message"], v["message"]  # where the hung rank was
        assert v["elapsed"] < FAST["op_timeout"] + 2.0, (r, v)


def test_bound_torch_barrier_names_a_killed_rank_and_later_ops_fail_at_once() -> None:
    culprit, survivors = 2, [0, 1]
    values = _values(a.torch_ops_fault, 3, "kill", culprit, FAST, ranks=survivors)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert "RankFailureError" in v["mro"], (r, v)
        assert v["ranks"] == [culprit], v["message"]
        assert v["op"] == "torch.distributed.barrier", (r, v)
        assert v["elapsed"] < 2.0, (r, v)
        later = v["later"]
        assert isinstance(later, dict), (r, later)
        assert "RankFailureError" in later["mro"], (r, later)
        assert later["ranks"] == [culprit], later["message"]
        assert later["op"] == "torch.distributed.all_reduce", (r, later)
        assert later["elapsed"] < 0.5, (r, later)
