"""Resilient DDP for the Lightning ``Trainer``.

Usage (one of)::

    import lightning as L
    from resilient_ddp.integrations.lightning import ResilientDDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=ResilientDDPStrategy())
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="resilient_ddp")  # registered name

The strategy is Lightning's ``DDPStrategy`` with three changes: the process group is
created by :func:`resilient_ddp.init_process_group` (a checked, bounded rendezvous; the
store host stays up until its peers have read a failure), the model is wrapped in
:class:`~resilient_ddp.ResilientDDP`, and torch's blocking collectives are bounded (see
:func:`~resilient_ddp.bound_torch_collectives`), so that ``self.log(..., sync_dist=True)``,
``trainer.strategy.barrier()`` and torchmetrics' syncs end with the library's error too.
It works under Lightning's own launcher (``devices=N``; rank 0 hosts the store) and under
torchrun. Settings come from ``resilience=`` and the ``RESILIENT_DDP_*`` variables.

Importing this module imports Lightning (the ``lightning`` package) and registers the names
``"resilient_ddp"`` (ranks started as processes, like ``"ddp"``) and
``"resilient_ddp_spawn"`` (like ``"ddp_spawn"``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from resilient_ddp.config import ResilienceConfig
from resilient_ddp.integrations._common import init_group, refuse_shrink, register, wrap
from resilient_ddp.training.ddp import ResilientDDP

__all__ = ["ResilientDDPStrategy"]


class ResilientDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose model is a :class:`~resilient_ddp.ResilientDDP`.

    Args:
        resilience: The library's budgets and policies (fields given win over the
            ``RESILIENT_DDP_*`` variables, which fill in the rest).
        **kwargs: ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``,
            ``start_method``, ``ddp_comm_hook``, ...) and DDP's (``find_unused_parameters``,
            ``static_graph``, ``gradient_as_bucket_view``, ...).

    A rank that fails makes every other rank raise the library's typed error
    (:class:`~resilient_ddp.RankFailureError`, naming it) out of ``trainer.fit``; Lightning
    then runs its own exception handling (callbacks' ``on_exception``, loggers) and
    re-raises it.

    Raises:
        ConfigError: ``on_failure="shrink"`` (not supported under Lightning; see the docs).
    """

    strategy_name = "resilient_ddp"

    def __init__(self, *, resilience: ResilienceConfig | None = None, **kwargs: Any) -> None:
        refuse_shrink(resilience)
        super().__init__(**kwargs)
        self._resilience = resilience

    def setup_distributed(self) -> None:
        """Create the process group through the library, then let Lightning go on (it
        finds the group already made)."""
        self.set_world_ranks()
        init_group(self)
        super().setup_distributed()

    def _setup_model(self, model: nn.Module) -> ResilientDDP:
        """Wrap the model in :class:`~resilient_ddp.ResilientDDP` (DDP's arguments as
        Lightning passes them)."""
        return wrap(model, self.determine_ddp_device_ids(), self._resilience, self._ddp_kwargs)


register(StrategyRegistry, ResilientDDPStrategy)
