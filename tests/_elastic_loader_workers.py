"""Workers for elastic training through ``ElasticDataLoader`` with worker processes,
prefetching and persistent workers (tests/test_elastic_workers_mp.py). The loop, faults
and logs are those of ``_elastic_workers.train``; the ids come from the loaded batches."""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import resilient_ddp as rd
from resilient_ddp.testing import kill_self
from resilient_ddp.training.elastic_sampler import ElasticBatchSampler, ElasticDataLoader

from . import _elastic_workers as w

LOADER = {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True}
# Faults inside the sampler's planning of a batch ahead, while the DataLoader dispatches
# index batches to its workers (the previous step committed, batches are in flight).
FETCH_KINDS = {"killfetch": "kill", "raisefetch": "raise"}


class Indexed(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """The test's samples, each with its index (the log records what was loaded)."""

    def __init__(self) -> None:
        self.x, self.y = w._data()

    def __len__(self) -> int:
        return w.N_SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def _arm_fetch(sampler: ElasticBatchSampler, armed: list[str]) -> None:
    """Fire the fault in ``armed`` (if any) at the sampler's next planning of a batch."""
    original = sampler._fetch_ahead

    def patched() -> Any:
        if armed:
            kind = FETCH_KINDS[armed.pop()]
            if kind == "kill":
                kill_self()
            raise RuntimeError("injected fault while planning a prefetched batch")
        return original()

    sampler._fetch_ahead = patched  # type: ignore[method-assign]


def train(
    rank: int,
    out_dir: str,
    faults: list[dict[str, Any]],
    epochs: int,
    cfg: dict[str, Any],
    pace: float = 0.0,
    start: str | None = None,
) -> dict[str, Any]:
    """``_elastic_workers.train`` over ``ElasticDataLoader(**LOADER)``; fault kinds also
    ``killfetch`` and ``raisefetch`` (in the sampler's planning of a prefetched batch).

    ``start`` is how the loader starts its workers (DataLoader's ``multiprocessing_context``).
    ``None`` keeps this process's start method, which a rank inherits from its launcher:
    under the test harness's fork server each worker is then a new interpreter that
    imports torch (2-5 s for a replacement's two workers on 2 cores). ``"fork"`` copies
    the rank instead (milliseconds), as DataLoader does by default in a rank that torchrun
    started (Linux, Python before 3.14)."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(100, exit=True)
    rd.init_process_group("gloo", config=w._cfg(**cfg))
    el_uid = int(os.environ.get("RESILIENT_DDP_UID", rank))
    model = rd.ResilientDDP(w._model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticBatchSampler(w.N_SAMPLES, w.BATCH, seed=3)
    loader = ElasticDataLoader(
        Indexed(), batch_sampler=sampler, multiprocessing_context=start, **LOADER
    )
    armed: list[str] = []
    _arm_fetch(sampler, armed)
    log_path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
    pending = [f for f in faults if f["uid"] == el_uid]
    full = max((f.get("full", 0) for f in faults), default=0)
    with open(log_path, "a") as log:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for ids_t, x, y in loader:
                ids = ids_t.tolist()
                drawn_from = sampler.epoch
                stats = model.resilience_stats
                before = stats["step"]
                due = [
                    f
                    for f in pending
                    if before >= f["step"]
                    and stats["world_size"] >= f.get("full", 0)
                    and w.faults_seen(stats) >= f.get("after", 0)
                ]
                pending = [f for f in pending if f not in due]
                for f in due:
                    if f["kind"] in FETCH_KINDS:
                        armed.append(f["kind"])
                    elif f["kind"] == "killmid":
                        threading.Timer(f.get("delay", 0.002), kill_self).start()
                    else:
                        w._fault(f["kind"])
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                time.sleep(pace)
                stats = model.resilience_stats
                if stats["step"] > before:
                    log.write(
                        json.dumps(
                            {
                                "step": stats["step"],
                                "epoch": drawn_from,
                                "uid": el_uid,
                                "world": stats["world_size"],
                                "ids": ids,
                                "hash": w.state_hash(model.module, opt),
                                "loss": float(loss.detach()),
                            }
                        )
                        + "\n"
                    )
                    log.flush()
            if epoch < sampler.epoch:
                continue  # a joiner: the job was past this epoch already
            log.write(json.dumps({"epoch_end": epoch, "dropped": sampler.dropped}) + "\n")
            log.flush()
            stats = model.resilience_stats
            if (
                full
                and w.faults_seen(stats) >= len(faults)
                and stats["world_size"] >= full
                and epoch + 1 >= w.MIN_EPOCHS
            ):
                break
    stats = model.resilience_stats
    stats["dropped"] = sampler.dropped
    stats["stale_batches"] = sampler.stale_batches
    stats["final_hash"] = w.state_hash(model.module, opt)
    del loader  # its persistent workers end
    rd.destroy_process_group()
    return stats
