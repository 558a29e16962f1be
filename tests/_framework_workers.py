"""The training scripts of the framework tests (tests/test_frameworks_mp.py): one small job
per framework, written as its users write it, with the library's one or two lines.

``python -m tests._framework_workers FRAMEWORK OUT_DIR FAULT [MODE]`` (from the project's root)

* ``FRAMEWORK``: ``lightning`` (``L.Trainer(strategy="resilient_ddp")``, the registered
  name) and ``fabric`` (``L.Fabric(strategy=ResilientDDPStrategy())``, with a torchmetrics
  metric synced in every step): started as one process, Lightning starts the other ranks
  and rank 0 hosts the store; or under torchrun, whose agent hosts the store, as are
  ``accelerate`` (``rd.make_resilient(accelerator.prepare(model))``) and ``transformers``
  (the ``Trainer`` with ``ResilientTrainerCallback``).
* ``FAULT``: ``none``, or ``kill`` / ``raise`` / ``hang`` on rank
  :data:`~tests._launcher_workers.CULPRIT` in its forward pass of step
  :data:`~tests._launcher_workers.FAULT_STEP` (a forward pre-hook on the inner model).
* ``MODE``: ``resilient`` (default) or ``plain`` (the framework's own DDP, for the
  loss-curve comparison).

Every rank writes, as the launcher matrix's script does, a start record, a result record
(the error it got) and, for the culprit, a fault record; with ``FAULT=none``, each rank
writes the loss of every step to ``losses{rank}.json``. The framework's collectives are
exercised in the step: the loss is synced across ranks for logging (Lightning's
``self.log(..., sync_dist=True)``, torchmetrics' ``compute()`` and ``fabric.all_reduce``,
``accelerator.reduce``; the Trainer logs every step), before the backward pass, so a
survivor of a fault meets it there first.
"""

from __future__ import annotations

import faulthandler
import gc
import itertools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._launcher_workers import (
    CULPRIT,
    DUMP_AFTER_S,
    FAULT_STEP,
    STEPS,
    WORLD,
    _error_record,
    _inject,
    _redirect_output,
    _start_time,
)
from tests._workers import write_json

BATCH = 4
LR = 0.05
# Benchmarks (benchmarks/bench_frameworks.py) run the same scripts longer, on a wider model
# and fewer ranks; the tests use the defaults.
STEPS = int(os.environ.get("RD_FW_STEPS", STEPS))
WORLD = int(os.environ.get("RD_FW_WORLD", WORLD))
WIDTH = int(os.environ.get("RD_FW_WIDTH", "32"))
# time.perf_counter() at the start of each training forward pass on this rank.
STEP_STARTS: list[float] = []


def _rank() -> int:
    """This process's global rank before the framework set up (single node): torchrun
    sets RANK, Lightning's launcher LOCAL_RANK for the ranks it starts; rank 0 has none."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * WORLD, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def _arm_fault(module: nn.Module, rank: int, fault: str, out: Path) -> None:
    """Time each training forward pass of ``module`` (:data:`STEP_STARTS`), and make rank
    CULPRIT fail in its forward pass of step FAULT_STEP."""
    armed = fault != "none" and rank == CULPRIT

    def hook(_module: nn.Module, _args: Any) -> None:
        if module.training:
            if armed and len(STEP_STARTS) == FAULT_STEP:
                _inject(fault, out, FAULT_STEP)
            STEP_STARTS.append(time.perf_counter())

    module.register_forward_pre_hook(hook)


# -- Lightning Trainer -------------------------------------------------------------------------
def lightning(out: Path, fault: str, mode: str) -> list[float]:
    import lightning as L  # noqa: N812 - as Lightning's docs write it

    strategy: Any = "ddp"
    if mode == "resilient":
        import resilient_ddp.integrations.lightning  # noqa: F401 - registers "resilient_ddp"

        strategy = "resilient_ddp"
    losses: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    _arm_fault(module.net, trainer.global_rank, fault, out)
    trainer.fit(module, DataLoader(_dataset(), batch_size=BATCH))
    return losses


# -- Lightning Fabric --------------------------------------------------------------------------
def fabric(out: Path, fault: str, mode: str) -> list[float]:
    import lightning as L  # noqa: N812 - as Lightning's docs write it

    strategy: Any = "ddp"
    if mode == "resilient":
        from resilient_ddp.integrations.fabric import ResilientDDPStrategy

        strategy = ResilientDDPStrategy()
    from torchmetrics import MeanMetric

    f = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    f.launch()
    net = _model()
    _arm_fault(net, f.global_rank, fault, out)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt = f.setup(net, opt)
    loader = f.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    mean_loss = MeanMetric()  # torchmetrics syncs it across ranks in compute()
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        mean_loss.update(loss.detach())
        mean_loss.compute()
        losses.append(float(f.all_reduce(loss.detach(), reduce_op="mean")))
        opt.zero_grad()
        f.backward(loss)
        opt.step()
    return losses


# -- Accelerate (under torchrun) ---------------------------------------------------------------
def accelerate(out: Path, fault: str, mode: str) -> list[float]:
    from accelerate import Accelerator

    import resilient_ddp as rd

    accelerator = Accelerator(cpu=True)
    net = _model()
    _arm_fault(net, accelerator.process_index, fault, out)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loader = DataLoader(_dataset(), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    if mode == "resilient":
        model = rd.make_resilient(model)
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
    accelerator.wait_for_everyone()
    return losses


# -- Hugging Face Trainer (under torchrun) -----------------------------------------------------
def transformers(out: Path, fault: str, mode: str) -> list[float]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    net = GPT2LMHeadModel(config)
    _arm_fault(net, _rank(), fault, out)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (STEPS * BATCH * WORLD, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    callbacks: list[Any] = [Losses()]
    if mode == "resilient":
        from resilient_ddp.integrations.transformers import ResilientTrainerCallback

        callbacks.append(ResilientTrainerCallback())
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    Trainer(model=net, args=args, train_dataset=data, callbacks=callbacks).train()
    return losses


FRAMEWORKS = {
    "lightning": lightning,
    "fabric": fabric,
    "accelerate": accelerate,
    "transformers": transformers,
}


def registry() -> dict[str, Any]:
    """What the registered names give, and what ``on_failure="shrink"`` gives, in code and
    from the environment (run in a process of its own: importing Lightning changes the
    process's environment)."""
    import lightning as L  # noqa: N812 - as Lightning's docs write it

    import resilient_ddp as rd
    from resilient_ddp.integrations import fabric as rd_fabric
    from resilient_ddp.integrations import lightning as rd_lightning

    found: dict[str, Any] = {}
    for name in ("resilient_ddp", "resilient_ddp_spawn"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        f = L.Fabric(accelerator="cpu", devices=2, strategy=name)
        found[name] = {
            "trainer": type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__,
            "trainer_start": trainer.strategy._start_method,
            "fabric": type(f.strategy).__module__ + "." + type(f.strategy).__name__,
            "fabric_start": f.strategy._start_method,
        }
    shrink = rd.ResilienceConfig(on_failure="shrink")
    for label, make in (
        ("lightning", lambda: rd_lightning.ResilientDDPStrategy(resilience=shrink)),
        ("fabric", lambda: rd_fabric.ResilientDDPStrategy(resilience=shrink)),
    ):
        try:
            make()
            found[f"{label}_shrink"] = "accepted"
        except rd.ConfigError as e:
            found[f"{label}_shrink"] = str(e)
    os.environ["RESILIENT_DDP_ON_FAILURE"] = "shrink"
    try:
        rd_lightning.ResilientDDPStrategy()
        found["env_shrink"] = "accepted"
    except rd.ConfigError as e:
        found["env_shrink"] = str(e)
    return found


def main() -> None:
    framework, out_dir, fault = sys.argv[1], sys.argv[2], sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "resilient"
    out = Path(out_dir)
    rank = _rank()
    _redirect_output(out_dir, rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    write_json(
        out / f"start{rank}.json",
        {"rank": rank, "pid": os.getpid(), "start_time": _start_time(), "t": time.time()},
    )
    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)
    try:
        losses = FRAMEWORKS[framework](out, fault, mode)
    except BaseException as e:
        write_json(out / f"result{rank}.json", _error_record(rank, "train", e))
        raise
    steps_s = [b - a for a, b in itertools.pairwise(STEP_STARTS)]
    write_json(out / f"losses{rank}.json", {"losses": losses, "step_s": steps_s})
    write_json(out / f"result{rank}.json", {"rank": rank, "stage": "done", "type": None})
    if mode == "plain":
        # The interpreter's exit skips its last garbage collections, as the library's ranks'
        # does (about a second of CPU a process with Lightning or transformers loaded).
        gc.collect()
        gc.freeze()


if __name__ == "__main__":
    main()
