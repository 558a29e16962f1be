"""torch's own DDP test cases, run with ResilientDDP in place of DistributedDataParallel.

The cases come from the torch wheel's ``torch/testing/_internal/distributed/distributed_test.py``
(``DistributedTest._DistTestBase``, torch 2.13). ``CASES`` is every one of them that builds
a DDP model (or, for the first, reads DDP's settings) and runs on gloo with CPU tensors:
each passes with plain DDP on two ranks (``test_each_case_passes_with_ddp``, marked
slow), and each must pass with ResilientDDP. Two of them (the
``test_DistributedDataParallelCPU`` pair) ``torch.save`` the whole wrapper and load it back.
No case passes with DDP and fails with ResilientDDP, so none is left out for that.

Left out: the module's 91 other cases that build a DDP model (in their own body or in a
helper they call). All of them are gated on GPUs: ``skip_if_lt_x_gpu(2)`` (or 4),
``skip_if_no_gpu``; seven are also disabled on Linux or everywhere by torch
(``unittest.skipIf(IS_LINUX, ...)``, ``unittest.skip``). Those that look CPU-capable by
name (``test_post_localSGD_optimizer_*``, ``test_ddp_uneven_input*``,
``test_ddp_join_*``, ``test_ddp_buffer_hook_*``, ``test_ddp_sync_module_states``,
``test_static_graph_multi_forward``, ``test_stateless_api_with_ddp``,
``test_ddp_compile_static_graph``, ``test_ddp_sink_noclone``, ...) are gated too, and
their bodies put the model on ``cuda`` (``.cuda()``, ``device_ids=[self.rank]``). On a
CPU-only machine each one skips before it builds a model, with DDP and with ResilientDDP
alike. ``SKIPPED_ON_CPU`` lists them by the reason torch gives; the plain-DDP launch runs
them after ``CASES``, and ``test_other_ddp_cases_skip_on_cpu`` checks that each still
skips that way (one that runs after a torch upgrade belongs in ``CASES`` if it passes
with both). The four ``test_ddp_update_process_group_*`` and the three
``test_ddp_hook_with_optimizer_parity_*`` are not tests in torch 2.13: their source sits
inside a string literal (commented out, 4 GPUs needed anyway).

All cases run one after the other in the same two ranks (see tests/_torch_ddp_suite.py):
starting a rank and importing torch's test module takes several seconds, which one launch
per case would pay again each time.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

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
# torch's other DDP cases, by the reason each skips on a machine without GPUs (see the
# module docstring).
SKIPPED_ON_CPU: dict[str, tuple[str, ...]] = {
    "Need at least 2 CUDA devices": (
        "test_compute_bucket_assignment_by_size_sparse_error_without_logger",
        "test_ddp_apply_optim_in_backward",
        "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false",
        "test_ddp_apply_optim_in_backward_ignored_params",
        "test_ddp_broadcast_buffer",
        "test_ddp_broadcast_buffer_via_hook",
        "test_ddp_broadcast_buffers_deprecation_warning",
        "test_ddp_bucket_cap_mb_list",
        "test_ddp_buffer_hook_allreduce",
        "test_ddp_buffer_hook_allreduce_return_future",
        "test_ddp_build_debug_param_to_name_mapping",
        "test_ddp_build_debug_param_to_name_mapping_requires_grad",
        "test_ddp_comm_hook_logging",
        "test_ddp_compile_static_graph",
        "test_ddp_control_flow_different_across_ranks",
        "test_ddp_control_flow_same_across_ranks",
        "test_ddp_device",
        "test_ddp_device_mesh_initialization",
        "test_ddp_forward_backward_hook",
        "test_ddp_grad_div_uneven_inputs",
        "test_ddp_hook_parity_allreduce",
        "test_ddp_hook_parity_allreduce_process_group",
        "test_ddp_hook_parity_post_localSGD",
        "test_ddp_hook_parity_powerSGD",
        "test_ddp_hook_pickling_powerSGD",
        "test_ddp_ignore_params_arg",
        "test_ddp_inference",
        "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
        "test_ddp_join_model_equivalence",
        "test_ddp_join_respects_forward_sync_buffers_false",
        "test_ddp_model_diff_num_params_across_ranks",
        "test_ddp_multiple_nested_unused_params_err_ignore_params",
        "test_ddp_multiple_nested_unused_params_error",
        "test_ddp_namedtuple",
        "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none",
        "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none",
        "test_ddp_native_mixed_precision_ignored_params",
        "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none",
        "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none",
        "test_ddp_new_tensor_in_fwd",
        "test_ddp_new_tensor_in_fwd_static_graph",
        "test_ddp_profiling_torch_profiler",
        "test_ddp_python_error_logged",
        "test_ddp_remove_autograd_hooks",
        "test_ddp_returns_tensor_with_no_grad",
        "test_ddp_shared_grad_acc_unused_params",
        "test_ddp_sink_noclone",
        "test_ddp_static_graph_nested_types",
        "test_ddp_sync_bn_training_vs_eval",
        "test_ddp_sync_module_states",
        "test_ddp_uneven_input_exception",
        "test_ddp_uneven_input_join_disable",
        "test_ddp_uneven_inputs",
        "test_ddp_uneven_inputs_stop_iteration_sync_bn",
        "test_ddp_unused_params_rebuild_buckets_exception",
        "test_ddp_zero_output_features",
        "test_detect_ddp_is_actually_static",
        "test_different_graph_across_ranks",
        "test_get_data_parallel_params",
        "test_invalid_static_graph",
        "test_output_unused_in_loss_dict_module",
        "test_output_unused_in_loss_tuple_module",
        "test_post_localSGD_optimizer_parity",
        "test_post_localSGD_optimizer_parity_grad_is_view",
        "test_post_localSGD_optimizer_step_reload",
        "test_skip_all_reduce_unused_parameters",
        "test_stateless_api_with_ddp",
        "test_static_graph_multi_forward",
        "test_sync_bn_logged",
        "test_undefined_grad_parity_unused_parameters",
        "test_verify_model_across_rank_with_logger",
        "test_verify_model_across_rank_without_logger",
    ),
    "CUDA is not available.": (
        "test_DistributedDataParallel_SyncBatchNorm",
        "test_DistributedDataParallel_SyncBatchNorm_2D_Input",
        "test_DistributedDataParallel_SyncBatchNorm_Channels_Last",
        "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value",
        "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient",
        "test_DistributedDataParallel_SyncBatchNorm_No_Affine",
        "test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process",
        "test_DistributedDataParallel_SyncBatchNorm_half",
        "test_DistributedDataParallel_with_amp_and_grad_is_view",
        "test_ddp_logging_data_gpu",
    ),
    "Need at least 4 CUDA devices": (
        "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
        "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    ),
    "https://github.com/pytorch/pytorch/issues/76428": (
        "test_DistributedDataParallel_non_default_stream",
    ),
    "https://github.com/pytorch/pytorch/issues/77317": ("test_DistributedDataParallel",),
    "https://github.com/pytorch/pytorch/issues/77342": ("test_ddp_profiling_autograd_profiler",),
    "https://github.com/pytorch/pytorch/issues/137765": ("test_ddp_profiling_execution_trace",),
    "https://github.com/pytorch/pytorch/issues/85012": (
        "test_compute_bucket_assignment_by_size_sparse_error_with_logger",
    ),
    "https://github.com/pytorch/pytorch/issues/162676": ("test_ddp_model_diff_shape_across_ranks",),
    "https://github.com/pytorch/pytorch/issues/102751": ("test_ddp_has_finalized",),
}
# Reads DDP-related environment variables and logs them; it builds no model.
NO_MODEL = {"test_dump_DDP_relevant_env_vars"}
# Run after CASES in the plain-DDP launch, where each skips in a few milliseconds; with
# GPUs they would run instead, and they are not this module's cases.
ON_CPU = not torch.cuda.is_available()
SKIPPING = [case for cases in SKIPPED_ON_CPU.values() for case in cases] if ON_CPU else []
WORLD = 2
# The whole run's hard deadline, under pytest-timeout's 120 s (which also covers this
# module fixture's setup): about 15-20 s per launch on a loaded 2-core machine when all
# is well.
DEADLINE = timedelta(seconds=95)
# After a rank fails, its peer may sit in a collective of the same case: it gets longer
# than the case's backend timeout to raise there by itself (and send its traceback).
GRACE = suite.CASE_TIMEOUT + timedelta(seconds=5)


def _run(tmp_path: Path, cases: list[str], *, substitute: bool) -> list[RankOutcome]:
    # The directories that torch's TestDistBackend.setUp makes for its file-based barrier.
    for sub in ("barrier", "test_dir", "init_dir"):
        (tmp_path / sub).mkdir()
    return run_ranks(
        suite.run_cases,
        WORLD,
        (WORLD, str(tmp_path), cases, substitute),
        timeout=DEADLINE,
        grace=GRACE,
    )


@pytest.fixture(scope="module")
def with_resilient_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[RankOutcome]:
    return _run(tmp_path_factory.mktemp("resilient"), CASES, substitute=True)


@pytest.fixture(scope="module")
def with_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[RankOutcome]:
    return _run(tmp_path_factory.mktemp("ddp"), CASES + SKIPPING, substitute=False)


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


@pytest.mark.slow
@pytest.mark.skipif(not ON_CPU, reason="with GPUs these cases run or skip for other reasons")
@pytest.mark.parametrize(
    ("case", "reason"),
    [(case, reason) for reason, cases in SKIPPED_ON_CPU.items() for case in cases],
)
def test_other_ddp_cases_skip_on_cpu(case: str, reason: str, with_ddp: list[RankOutcome]) -> None:
    report = format_outcomes(with_ddp)
    for o in with_ddp:
        assert o.ok, f"rank {o.rank} did not get through the cases:\n{report}"
        outcome = o.value["outcomes"][case]
        assert outcome == f"skipped: {reason}", (
            f"rank {o.rank}: {case}: {outcome!r}, not skipped as on torch 2.13 "
            "(if it passes with DDP and with ResilientDDP, move it to CASES)"
        )
