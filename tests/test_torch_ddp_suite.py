"""torch's own DDP test cases, run with ResilientDDP in place of DistributedDataParallel.

The cases come from the torch wheel's ``torch/testing/_internal/distributed/distributed_test.py``
(``DistributedTest._DistTestBase``, torch 2.13). ``CASES`` is every one of them that builds
a DDP model (or, for the first, reads DDP's settings) and runs on gloo with CPU tensors:
each passes with plain DDP on two ranks (``test_each_case_passes_with_ddp``, marked
slow), and each must pass with ResilientDDP. Two of them (the
``test_DistributedDataParallelCPU`` pair) ``torch.save`` the whole wrapper and load it back.

Left out: the module's other DDP cases all need GPUs (``skip_if_no_gpu``,
``skip_if_lt_x_gpu``) or are disabled on Linux by torch itself; on this CPU-only machine
they only skip, with DDP and with ResilientDDP alike.

All cases run one after the other in the same two ranks (see tests/_torch_ddp_suite.py):
starting a rank and importing torch's test module takes several seconds, which one launch
per case would pay twelve times.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from resilient_ddp.errors import RankOutcome
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _torch_ddp_suite as suite

CASES = [
    "test_dump_DDP_relevant_env_vars",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]
# Reads DDP-related environment variables and logs them; it builds no model.
NO_MODEL = {"test_dump_DDP_relevant_env_vars"}
WORLD = 2
# The whole run's hard deadline, under pytest-timeout's 120 s (which also covers this
# module fixture's setup): about 25-30 s on a loaded 2-core machine when all is well.
DEADLINE = timedelta(seconds=95)
# After a rank fails, its peer may sit in a collective of the same case: it gets longer
# than the case's backend timeout to raise there by itself (and send its traceback).
GRACE = suite.CASE_TIMEOUT + timedelta(seconds=5)


def _run(tmp_path: Path, *, substitute: bool) -> list[RankOutcome]:
    # The directories that torch's TestDistBackend.setUp makes for its file-based barrier.
    for sub in ("barrier", "test_dir", "init_dir"):
        (tmp_path / sub).mkdir()
    return run_ranks(
        suite.run_cases,
        WORLD,
        (WORLD, str(tmp_path), CASES, substitute),
        timeout=DEADLINE,
        grace=GRACE,
    )


@pytest.fixture(scope="module")
def with_resilient_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[RankOutcome]:
    return _run(tmp_path_factory.mktemp("resilient"), substitute=True)


@pytest.fixture(scope="module")
def with_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[RankOutcome]:
    return _run(tmp_path_factory.mktemp("ddp"), substitute=False)


def _assert_passed(outcomes: list[RankOutcome], case: str) -> None:
    report = format_outcomes(outcomes)
    for o in outcomes:
        assert o.ok, f"rank {o.rank} did not get through the cases:\n{report}"
        assert o.value["outcomes"][case] == "passed", f"rank {o.rank}: {case}\n{report}"


@pytest.mark.parametrize("case", CASES)
def test_each_case_passes_with_resilient_ddp(
    case: str, with_resilient_ddp: list[RankOutcome]
) -> None:
    _assert_passed(with_resilient_ddp, case)
    if case not in NO_MODEL:
        for o in with_resilient_ddp:
            assert o.value["built"].get(case, 0) >= 1, (o.rank, o.value["built"])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_case_passes_with_ddp(case: str, with_ddp: list[RankOutcome]) -> None:
    _assert_passed(with_ddp, case)
    for o in with_ddp:
        assert o.value["built"] == {}, o.value["built"]
