"""What the Lightning and Fabric strategies share: the library's process group and the
model wrapper, built where Lightning builds torch's."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from torch import nn

from resilient_ddp import _runtime
from resilient_ddp.config import ResilienceConfig, resolve
from resilient_ddp.ddp import ResilientDDP
from resilient_ddp.errors import ConfigError
from resilient_ddp.process_group import init_process_group
from resilient_ddp.torch_collectives import bound_torch_collectives


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


def init_group(
    backend: str,
    rank: int,
    world_size: int,
    main_address: str,
    main_port: int,
    timeout: timedelta | None,
    resilience: ResilienceConfig | None,
    device_id: Any,
) -> None:
    """Create the default process group through the library (MASTER_ADDR and
    MASTER_PORT already set by the framework): its rendezvous is checked and bounded, the
    store host (rank 0) binds one address and stays until its peers have read a failure,
    and failure detection starts at once. Attaches if the group already exists."""
    # What Lightning's own _init_dist_connection sets before torch's env:// rendezvous.
    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        config=resilience,
        device_id=device_id,
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
    model = ResilientDDP(module, device_ids=device_ids, resilience=resilience, **ddp_kwargs)
    bound_torch_collectives()
    return model
