"""resilient_ddp: fault-tolerant DistributedDataParallel and distributed inference.

Every public name is importable from here; the submodules are implementation detail.
"""

from __future__ import annotations

# First: refuses a torch outside the supported range before anything uses its internals.
from resilient_ddp.base import _compat  # noqa: F401 - checks the torch version at import
from resilient_ddp.config import ResilienceConfig, RetryPolicy, get_config, set_config
from resilient_ddp.detection._progress import progress
from resilient_ddp.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    ControlPlaneError,
    Culprit,
    ItemFailureError,
    PreflightError,
    RankFailureError,
    RankOutcome,
    ResilientDDPError,
    RetryBudgetExhaustedError,
    SpawnError,
)
from resilient_ddp.group.process_group import (
    destroy_process_group,
    init_process_group,
    is_initialized,
)
from resilient_ddp.inference.gather import gather_to_rank0
from resilient_ddp.inference.inference import (
    InferenceItemFailure,
    InferenceSummary,
    distributed_inference,
    iter_inference,
    last_inference_summary,
    load_inference_results,
)
from resilient_ddp.inference.sampler import BalancedDistributedSampler, LockstepBatchSampler
from resilient_ddp.ops.checkpoint import broadcast_state_dict, load_and_broadcast
from resilient_ddp.ops.collectives import (
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
)
from resilient_ddp.ops.torch_collectives import bound_torch_collectives
from resilient_ddp.runtime._runtime import add_failure_listener, phase, section
from resilient_ddp.tools.launch import spawn
from resilient_ddp.training.ddp import ResilientDDP, make_resilient
from resilient_ddp.training.elastic import (
    ElasticParticipant,
    WorldSizeChange,
    add_world_size_listener,
    register_elastic_participant,
)
from resilient_ddp.training.elastic_sampler import (
    ElasticBatchSampler,
    ElasticDataLoader,
    ElasticDistributedSampler,
)

__version__ = "0.1.0"

__all__ = [
    "BalancedDistributedSampler",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ControlPlaneError",
    "Culprit",
    "ElasticBatchSampler",
    "ElasticDataLoader",
    "ElasticDistributedSampler",
    "ElasticParticipant",
    "InferenceItemFailure",
    "InferenceSummary",
    "ItemFailureError",
    "LockstepBatchSampler",
    "PreflightError",
    "RankFailureError",
    "RankOutcome",
    "ResilienceConfig",
    "ResilientDDP",
    "ResilientDDPError",
    "RetryBudgetExhaustedError",
    "RetryPolicy",
    "SpawnError",
    "WorldSizeChange",
    "__version__",
    "add_failure_listener",
    "add_world_size_listener",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "bound_torch_collectives",
    "broadcast",
    "broadcast_object",
    "broadcast_state_dict",
    "destroy_process_group",
    "distributed_inference",
    "gather_to_rank0",
    "get_config",
    "init_process_group",
    "is_initialized",
    "iter_inference",
    "last_inference_summary",
    "load_and_broadcast",
    "load_inference_results",
    "make_resilient",
    "phase",
    "progress",
    "register_elastic_participant",
    "section",
    "set_config",
    "spawn",
]

# Show public names as resilient_ddp.X (in reprs, docs and tracebacks), as httpx does.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or callable(_obj):
        _obj.__module__ = __name__
del _name, _obj
