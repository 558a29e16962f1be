"""Ranks of tests/test_field_mp.py: the store on rank 0, long single-rank work, stuck ranks."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from datetime import timedelta
from typing import Any

import resilient_ddp as rd
from resilient_ddp.runtime import _runtime

from ._workers import CHILD_DUMP_AFTER_S, error_summary

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}


def _rank0_hosts_the_store(port: int) -> None:
    """Rendezvous as ``mp.spawn`` with MASTER_ADDR/MASTER_PORT or ``srun`` do: rank 0
    hosts the store on ``port``, and the launcher's store is not used."""
    os.environ.pop("RESILIENT_DDP_STORE", None)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "0"
    os.environ["MASTER_PORT"] = str(port)


def section_wait(rank: int, overrun: bool, port: int) -> Any:
    """Rank 0 works alone in a section with a budget past the op timeout; the others wait
    for it in a barrier."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    _rank0_hosts_the_store(port)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAST))
    t0 = time.monotonic()
    try:
        if rank == 0:
            with rd.section("checkpoint save", budget=timedelta(seconds=4)):
                time.sleep(30 if overrun else 3)
        rd.barrier()
        return {"ok": True, "elapsed": time.monotonic() - t0}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)
    finally:
        rd.destroy_process_group()


def stuck(rank: int, culprit: int, where: str, port: int) -> Any:
    """``culprit`` stops taking part: asleep in Python (``sleep``), or where no exception
    reaches it (``c``: the verdict's signal is blocked, as in a long C call)."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    _rank0_hosts_the_store(port)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAST))
    rd.barrier()
    t0 = time.monotonic()
    try:
        if rank == culprit:
            with rd.phase("data"):
                if where == "c":
                    assert _runtime.TELL_SIGNAL is not None
                    signal.pthread_sigmask(signal.SIG_BLOCK, [_runtime.TELL_SIGNAL])
                time.sleep(30)
            return {"ok": "slept through"}
        rd.barrier()
        return {"ok": "no error"}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)


def raise_first(rank: int, port: int) -> Any:
    """Rank 0, which hosts the store, raises in user code and exits at once."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    _rank0_hosts_the_store(port)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAST))
    rd.barrier()
    if rank == 0:
        raise ValueError("rank 0 fails in user code")
    t0 = time.monotonic()
    try:
        time.sleep(0.3)  # rank 0 is gone from the data plane by now
        rd.barrier()
        return {"ok": "no error"}
    except rd.ResilientDDPError as e:
        return error_summary(e, t0)


def missing_rank(rank: int, timeout_s: float, port: int) -> Any:
    """``world_size`` names one rank more than was started; ``timeout=`` bounds init."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    _rank0_hosts_the_store(port)
    world = int(os.environ["WORLD_SIZE"]) + 1
    t0 = time.monotonic()
    try:
        rd.init_process_group("gloo", world_size=world, timeout=timedelta(seconds=timeout_s))
    except rd.PreflightError as e:
        return {**error_summary(e, t0), "problems": list(e.problems)}
    rd.destroy_process_group()
    return {"ok": "initialised"}


def healthy_exit(rank: int, port: int) -> Any:
    """Every rank finishes together; how long each one's destroy_process_group takes."""
    faulthandler.dump_traceback_later(CHILD_DUMP_AFTER_S, exit=True)
    _rank0_hosts_the_store(port)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**FAST))
    for _ in range(3):
        rd.barrier()
    t0 = time.monotonic()
    rd.destroy_process_group()
    return {"destroy_s": time.monotonic() - t0}
