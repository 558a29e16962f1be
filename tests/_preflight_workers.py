"""Rank functions for the start-up tests: each breaks the rendezvous in one way."""

from __future__ import annotations

import faulthandler
import os
import time
from typing import Any

import resilient_ddp as rd
import resilient_ddp.group.preflight as preflight_module

from ._workers import CHILD_DUMP_AFTER_S, error_summary, write_json

BUDGET_S = 3.0  # init_timeout of these tests: how long ranks wait for the missing
LATE_BUDGET_S = 15.0  # ... and when rank 0 starts MASTER_DELAY_S late on purpose
MASTER_DELAY_S = 3.0


def start(rank: int, scenario: str, port: int) -> Any:
    """``init_process_group`` after breaking ``scenario`` on some rank; returns the error
    summary (or ``"ok"``) and how long init took."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    budget = LATE_BUDGET_S if scenario == "late_master" else BUDGET_S
    cfg = rd.ResilienceConfig(init_timeout=budget, heartbeat_interval=0.2, op_timeout=5)
    if scenario == "wrong_address" and rank == 1:
        os.environ["MASTER_ADDR"] = "no-such-host.invalid"
    if scenario == "world_too_large":
        os.environ["WORLD_SIZE"] = "4"
    if scenario == "missing_rank" and rank == 2:
        return {"skipped": True}
    if scenario in ("torch_version", "hosted_torch_version") and rank == 1:
        versions = preflight_module._versions
        preflight_module._versions = lambda: {**versions(), "torch": "2.99.0"}  # type: ignore[assignment]
    if scenario == "same_gpu" and rank in (0, 1):
        preflight_module._device = lambda backend, env: {  # type: ignore[assignment]
            "device": "cuda:0",
            "gpu": "GPU-1234",
            "gpu_free_gib": "70.0",
        }
    if scenario in ("port_in_use", "late_master", "hosted_torch_version"):
        # Rank 0 hosts the store itself, as without torchrun's agent.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        os.environ["MASTER_PORT"] = str(port)
    if scenario == "late_master" and rank == 0:
        time.sleep(MASTER_DELAY_S)
    t0 = time.monotonic()
    try:
        rd.init_process_group("gloo", config=cfg)
        rd.barrier()
        return {"ok": True, "elapsed": time.monotonic() - t0}
    except rd.ResilientDDPError as e:
        return {**error_summary(e, t0), "problems": list(getattr(e, "problems", ()))}
    finally:
        if rd.is_initialized():
            rd.destroy_process_group()


def restart_main() -> None:
    """Under ``torchrun --max-restarts``: rank 1 fails in every attempt but the last, after
    the group is up; each attempt must rendezvous again on the same agent store."""
    import sys

    out_dir, last = sys.argv[1], int(sys.argv[2])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    t0 = time.monotonic()
    rd.init_process_group("gloo", config=rd.ResilienceConfig(init_timeout=20, op_timeout=5))
    value = rd.all_reduce(torch_ones()).tolist()
    record = {"attempt": attempt, "init_s": time.monotonic() - t0, "value": value}
    write_json(os.path.join(out_dir, f"attempt{attempt}-rank{rank}.json"), record)
    if rank == 1 and attempt < last:
        raise SystemExit(f"rank 1 fails attempt {attempt} on purpose")
    rd.barrier()
    rd.destroy_process_group()


def torch_ones() -> Any:
    import torch

    return torch.ones(2)


def two_host_main() -> None:
    """One rank of the two-"host" job (see test_multihost_netns): trains until the link
    between the hosts is cut, then records the error it got and when."""
    import sys

    import torch
    from torch import nn

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    cfg = rd.ResilienceConfig(heartbeat_interval=0.2, heartbeat_timeout=3, op_timeout=20)
    rd.init_process_group("gloo", config=cfg)
    torch.manual_seed(0)
    model = rd.ResilientDDP(nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    step = 0
    record: dict[str, Any] = {"rank": rank, "host": os.uname().nodename, "pid": os.getpid()}
    t0 = time.monotonic()
    try:
        while True:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            with open(os.path.join(out_dir, f"progress{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(0.02)
    except rd.ResilientDDPError as e:
        record.update(error_summary(e, t0))
        record["raised_at"] = time.time()
        record["step"] = step
    write_json(os.path.join(out_dir, f"result{rank}.json"), record)
    rd.destroy_process_group()
