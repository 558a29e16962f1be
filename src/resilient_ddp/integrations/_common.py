"""What the Lightning and Fabric strategies share: the library's process group and the
model wrapper, built where Lightning builds torch's."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from resilient_ddp.config import ResilienceConfig, resolve
from resilient_ddp.errors import ConfigError
from resilient_ddp.group.process_group import init_process_group
from resilient_ddp.ops.torch_collectives import bound_torch_collectives
from resilient_ddp.runtime import _runtime
from resilient_ddp.training.ddp import ResilientDDP


def refuse_shrink(resilience: ResilienceConfig | None) -> None:
    """Refuse ``on_failure="shrink"`` under a framework (given in code or the environment).

    Raises:
        ConfigError: The configuration asks for elastic training.
    """
    config = resolve(resilience) if resilience is not None else resolve(ResilienceConfig())
    if config.on_failure == "shrink":
        raise ConfigError(
            "on_failure='shrink' is not supported under Lightning or Fabric: the framework "
            "keeps its own world size, samplers and loggers, which the library cannot "
            "rebuild after a failure. HINT: use on_failure='raise' (the default) and "
            "restart from a checkpoint (torchrun --max-restarts, or your scheduler)."
        )


def init_group(strategy: Any) -> None:
    """Create the default process group of a Lightning or Fabric DDP ``strategy`` (its
    world ranks already set) through the library, where Lightning would call torch's:
    the rendezvous is checked and bounded, the store host (rank 0) binds one address and
    stays until its peers have read a failure, and failure detection starts at once.
    Lightning then finds the group made and goes on. Attaches if the group exists."""
    env = strategy.cluster_environment
    assert env is not None
    # What Lightning's own _init_dist_connection sets before torch's env:// rendezvous.
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    device = strategy.root_device
    init_process_group(
        strategy._get_process_group_backend(),
        rank=env.global_rank(),
        world_size=env.world_size(),
        timeout=strategy._timeout,
        config=strategy._resilience,
        device_id=device if device.type != "cpu" else None,
    )


def register(registry: Any, strategy: type) -> None:
    """Register ``strategy`` in a Lightning strategy registry as ``"resilient_ddp"`` (ranks
    started as processes, as ``"ddp"``) and ``"resilient_ddp_spawn"`` (as ``"ddp_spawn"``)."""
    for name, start_method in (("resilient_ddp", "popen"), ("resilient_ddp_spawn", "spawn")):
        registry.register(
            name,
            strategy,
            description=f"resilient_ddp's ResilientDDP, start_method={start_method!r}",
            override=True,
            start_method=start_method,
        )


def wrap(
    module: nn.Module,
    device_ids: list[int] | None,
    resilience: ResilienceConfig | None,
    ddp_kwargs: dict[str, Any],
) -> ResilientDDP:
    """The framework's ``DistributedDataParallel(module=..., device_ids=..., **kwargs)``,
    made by the library; torch's blocking collectives are bounded from then on."""
    rt = _runtime.current()
    if rt is not None and rt.elastic is not None:
        refuse_shrink(rt.config)  # set up elsewhere with on_failure="shrink"
    # As Lightning builds DDP on a GPU: on a side stream (torch's CUDA semantics notes).
    side = torch.cuda.Stream() if device_ids is not None else None  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side) if side is not None else nullcontext():
        model = ResilientDDP(module, device_ids=device_ids, resilience=resilience, **ddp_kwargs)
    bound_torch_collectives()
    return model
