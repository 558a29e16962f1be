"""Resilient DDP for the Hugging Face ``Trainer``.

Usage::

    from resilient_ddp.integrations.transformers import ResilientTrainerCallback

    trainer = Trainer(model=model, args=args, ..., callbacks=[ResilientTrainerCallback()])

Run the script under torchrun (``torchrun --nproc-per-node N train.py``) or ``accelerate
launch`` as usual. At the start of every ``trainer.train()`` the callback finds the
``DistributedDataParallel`` that the Trainer (through Accelerate) wrapped the model in and
makes it a :class:`~resilient_ddp.ResilientDDP` in place (:func:`~resilient_ddp.make_resilient`),
which also bounds torch's blocking collectives (the Trainer's loss gathering, barriers).
From then on a failed rank makes every other rank raise the library's typed error out of
``trainer.train()``. Single-process runs are left alone.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

import gc
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from resilient_ddp.config import ResilienceConfig
from resilient_ddp.errors import ConfigError
from resilient_ddp.training.ddp import make_resilient

__all__ = ["ResilientTrainerCallback"]


class ResilientTrainerCallback(TrainerCallback):
    """Make the ``Trainer``'s DDP model a :class:`~resilient_ddp.ResilientDDP` when
    training begins.

    Args:
        resilience: The library's budgets and policies (fields given win over the
            ``RESILIENT_DDP_*`` variables, which fill in the rest).

    Blocks, in ``on_train_begin``, while the ranks compare parameters and environment (at
    most ``op_timeout``).

    Raises:
        ConfigError: From ``on_train_begin``: the Trainer runs distributed, but its model is
            not wrapped in ``DistributedDataParallel`` (FSDP, DeepSpeed, model parallelism:
            not supported), or the configuration asks for ``on_failure="shrink"``.
        PreflightError: Ranks disagree on parameters or environment.
    """

    def __init__(self, resilience: ResilienceConfig | None = None) -> None:
        self.resilience = resilience

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        model = kwargs.get("model")
        ddp = _wrapper_of(model) if isinstance(model, nn.Module) else None
        if ddp is None:
            raise ConfigError(
                "ResilientTrainerCallback: the Trainer runs on "
                f"{dist.get_world_size()} processes but its model is not wrapped in "
                "DistributedDataParallel (FSDP, DeepSpeed and model parallelism are not "
                "supported by resilient_ddp)."
            )
        make_resilient(ddp, resilience=self.resilience)


def _wrapper_of(module: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` whose ``.module`` is ``module``, if one exists.

    The Trainer hands its callbacks the inner model only; the wrapper it trains with lives
    in a local variable of its training loop and in its Accelerator, which callbacks cannot
    reach. The garbage collector's list of objects finds it (a scan of every tracked object:
    tens of milliseconds, once per ``train()`` call).
    """
    found = [
        o for o in gc.get_objects() if isinstance(o, DistributedDataParallel) and o.module is module
    ]
    # One wrapper per model is the rule (a ResilientDDP when an earlier train() call made
    # it one already).
    return found[-1] if found else None
