"""A training job with ``on_failure="shrink"`` and no secret, as a user runs it under
torchrun or an env:// launcher (rank 0 hosting the store), with an attacker beside it
(tests/test_hostile_default.py, issue 29):

    hostile_train.py OUT_DIR [gate] [kill]

Rank 0 writes the store's port to ``OUT_DIR/port`` (where the attacker learns the address
it would otherwise scan for). With ``gate`` every rank waits for ``OUT_DIR/gate`` before
``rd.init_process_group()`` (the attacker plants its start-up records first). With
``kill`` rank :data:`KILLED` SIGKILLs itself at the first step after the attacker is done.

The loop trains ``nn.Linear(8, 1)`` on batches that depend on (step, rank) only. Rank 0
writes ``OUT_DIR/ready`` at step :data:`READY_STEP` (the attacker starts its attacks on the
running job then); every step the ranks agree (one ``rd.all_reduce``) whether
``OUT_DIR/attacked`` exists (the attacker is done), and they stop :data:`TAIL` steps after
that. So the number of steps varies from run to run but is the same on every rank, and the
weights after it are those of :func:`expected_state` when nothing got in. Each rank ends
with ``rd.all_gather_object`` of a small record (the object collective the attacker would
poison) and writes ``OUT_DIR/final<rank>.json``: its state, steps, step times, what
``resilience_stats`` says, or the error it raised.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd

READY_STEP = 20
TAIL = 20
MAX_STEPS = 3000  # about 40 s at the pace below: the attacker never finished
PACE_S = 0.01  # between steps, so that the attacker's seconds are a few hundred steps
LR = 0.02
MOMENTUM = 0.9
GATE_WAIT_S = 60.0
KILLED = 2  # with "kill": SIGKILLed at the first step after the attacker is done


def config() -> rd.ResilienceConfig:
    """Short budgets, as the elastic tests use."""
    return rd.ResilienceConfig(
        on_failure="shrink",
        min_world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        heartbeat_timeout=timedelta(seconds=2),
        op_timeout=timedelta(seconds=6),
        init_timeout=timedelta(seconds=30),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def new_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = rd.ResilientDDP(nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def expected_state(steps: int, world: int = 3) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of ``world`` ranks and nobody else, in one
    process (DDP's gradient is the mean of the ranks' gradients)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        losses = [
            nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(world))
        ]
        (sum(losses) / world).backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def wait_file(path: Path, seconds: float) -> None:
    """Wait for ``path`` to exist, at most ``seconds`` (then raise)."""
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def train(
    out: Path, rank: int, model: Any, opt: torch.optim.Optimizer, *, joined: bool = False
) -> dict[str, Any]:
    """The loop (see the module docstring), from the job's current step; returns this
    rank's record. Also run by an attacker that got admitted (``joined``: the members
    admitted it in the forward pass of their step, after that step's flag)."""
    step = int(model.resilience_stats["step"])
    flag_step: int | None = None
    times: list[float] = []
    while flag_step is None or step < flag_step + TAIL:
        if step >= MAX_STEPS:
            raise RuntimeError(f"the attacker did not finish within {MAX_STEPS} steps")
        if rank == 0 and step == READY_STEP:
            (out / "ready").touch()
        if not joined:
            flag = torch.tensor([1.0 if (out / "attacked").exists() else 0.0])
            rd.all_reduce(flag)
            if flag_step is None and flag.item() > 0:
                flag_step = step
        joined = False
        if rank == KILLED and flag_step is not None and "kill" in sys.argv[2:]:
            os.kill(os.getpid(), signal.SIGKILL)  # the real kill of item 6
        t0 = time.perf_counter()
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        step += 1
        time.sleep(PACE_S)
    stats = model.resilience_stats
    before = times[2:READY_STEP]  # the first steps warm up
    after = times[-TAIL:]
    return {
        "rank": rank,
        "steps": step,
        "flag_step": flag_step,
        "world_size": stats["world_size"],
        "joins": stats["joins"],
        "failures": stats["failures"],
        "events": stats["events"],
        "step_s_before": statistics.median(before),
        "step_s_after": statistics.median(after),
        "state": {k: v.tolist() for k, v in model.module.state_dict().items()},
    }


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(80, exit=True)
    record: dict[str, Any] = {"rank": rank}
    try:
        if rank == 0:
            tmp = out / "port.tmp"
            tmp.write_text(os.environ["MASTER_PORT"])
            tmp.replace(out / "port")
        if "gate" in sys.argv[2:]:
            wait_file(out / "gate", GATE_WAIT_S)
        rd.init_process_group("gloo", config=config())
        model, opt = new_model()
        record.update(train(out, rank, model, opt))
        gathered = rd.all_gather_object({"rank": rank, "steps": record["steps"]})
        record["gathered"] = [g.get("rank") if isinstance(g, dict) else repr(g) for g in gathered]
        rd.destroy_process_group()
    except BaseException as e:
        record["error"] = {
            "type": type(e).__name__,
            "message": str(e),
            "traceback": traceback.format_exc(),
            "rank_failure": isinstance(e, rd.RankFailureError),
            "ranks": list(getattr(e, "ranks", [])),
        }
        raise
    finally:
        (out / f"final{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
