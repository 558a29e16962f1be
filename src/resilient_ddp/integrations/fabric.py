"""Resilient DDP for Lightning ``Fabric``.

Usage (one of)::

    import lightning as L
    from resilient_ddp.integrations.fabric import ResilientDDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=ResilientDDPStrategy())
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy="resilient_ddp")  # registered name

As :mod:`resilient_ddp.integrations.lightning`, for Fabric: the process group comes from
:func:`resilient_ddp.init_process_group`, ``fabric.setup(model, optimizer)`` wraps the
model in :class:`~resilient_ddp.ResilientDDP`, and torch's blocking collectives (those
behind ``fabric.all_reduce``, ``fabric.barrier``, ``fabric.all_gather``) are bounded.
Importing this module imports Lightning and registers ``"resilient_ddp"`` and
``"resilient_ddp_spawn"`` in Fabric's strategy registry.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import nn

from resilient_ddp.config import ResilienceConfig
from resilient_ddp.integrations._common import init_group, refuse_shrink, register, wrap
from resilient_ddp.training.ddp import ResilientDDP

__all__ = ["ResilientDDPStrategy"]


class ResilientDDPStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` whose modules are :class:`~resilient_ddp.ResilientDDP`.

    Args:
        resilience: The library's budgets and policies (fields given win over the
            ``RESILIENT_DDP_*`` variables).
        **kwargs: ``DDPStrategy``'s arguments and DDP's.

    Raises:
        ConfigError: ``on_failure="shrink"`` (not supported under Fabric).
    """

    def __init__(self, *, resilience: ResilienceConfig | None = None, **kwargs: Any) -> None:
        refuse_shrink(resilience)
        super().__init__(**kwargs)
        self._resilience = resilience

    def _setup_distributed(self) -> None:
        """Create the process group through the library, then let Fabric go on."""
        self._set_world_ranks()
        init_group(self)
        super()._setup_distributed()

    def setup_module(self, module: nn.Module) -> ResilientDDP:
        """Wrap ``module`` in :class:`~resilient_ddp.ResilientDDP`."""
        return wrap(module, self._determine_ddp_device_ids(), self._resilience, self._ddp_kwargs)


register(STRATEGY_REGISTRY, ResilientDDPStrategy)
