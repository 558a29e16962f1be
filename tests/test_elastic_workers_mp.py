"""Elastic training through ``ElasticDataLoader`` with ``num_workers=2``,
``prefetch_factor=2`` and ``persistent_workers=True`` (issue 17): batches prefetched for a
group that no longer holds are dropped and planned again; the checks are those of
tests/test_elastic_mp.py (one state per committed step on every rank, exactly-once data
per epoch, a falling loss, the world whole again)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from resilient_ddp.errors import ConfigError
from resilient_ddp.testing import format_outcomes, kill_self, run_ranks
from resilient_ddp.training import elastic_sampler as es
from resilient_ddp.training.elastic_sampler import (
    ElasticBatchSampler,
    ElasticDataLoader,
    ElasticDistributedSampler,
)

from . import _elastic_loader_workers as lw
from .test_elastic_mp import _check_job


def _run(
    out_dir: Path, faults: list[dict[str, Any]], epochs: int, seconds: int, start: str | None = None
) -> Any:
    """The job of 4 ranks; ``start``: how each rank's loader starts its workers (see
    ``_elastic_loader_workers.train``; ``None``: the rank's own start method)."""
    return run_ranks(
        lw.train,
        4,
        (str(out_dir), faults, epochs, {}, 0.01, start),
        timeout=timedelta(seconds=seconds),
        restarts=len(faults),
    )


def _plan(seed: int, n_faults: int, kinds: list[str]) -> list[dict[str, Any]]:
    """``n_faults`` seeded faults one after another (as ``fault_plan`` of
    _elastic_workers), each at a random current member, its kind drawn from ``kinds``."""
    rng = random.Random(seed)
    alive, faults = list(range(4)), []
    for i in range(n_faults):
        uid = rng.choice(alive)
        faults.append(
            {
                "uid": uid,
                "step": 5 + 3 * i,
                "kind": rng.choice(kinds),
                "delay": rng.uniform(0.0, 0.02),
                "full": 4,
                "after": i,
            }
        )
        alive[alive.index(uid)] = 4 + i
    return faults


def _check(outcomes: Any, out_dir: Path, faults: list[dict[str, Any]]) -> dict[str, Any]:
    survivor = _check_job(outcomes, out_dir, faults)
    # The mechanism was exercised: batches planned ahead for a group that changed reached
    # the loop and were dropped.
    stale = sum(o.value["stale_batches"] for o in outcomes)
    assert stale > 0, format_outcomes(outcomes)
    return survivor


def test_prefetching_workers_through_a_kill_a_raise_and_a_fault_mid_prefetch(
    tmp_path: Path,
) -> None:
    """Three faults one after another: SIGKILL 0-20 ms into a step, SIGKILL while the
    sampler plans a prefetched batch, and an exception there; each time a replacement
    joins. The workers start as the rank's own start method has them (the test harness's
    fork server: each a new interpreter), the case of ``rd.spawn`` and Python 3.14."""
    kinds = ["killmid", "killfetch", "raisefetch"]
    faults = [{**f, "kind": kinds[i]} for i, f in enumerate(_plan(5, 3, kinds))]
    _check(_run(tmp_path, faults, 200, 100), tmp_path, faults)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_prefetching_workers_fault_matrix_twenty_seeded_faults(kind: str, tmp_path: Path) -> None:
    """The issue's proof: 20 seeded faults of one kind per run (kill before the forward,
    0-20 ms into the step, or while a prefetched batch is planned; raise before the
    forward or there), 4 ranks with 2 prefetching persistent workers each.

    The workers are forks of their rank (DataLoader's default under torchrun): started by
    the harness's fork server, the 48 workers of a run would each import torch afresh,
    which made most of its time (about 100 s against 15 s on 2 cores). Workers that a fork
    server starts are covered by the three-fault test above and by
    ``test_workers_end_with_a_killed_rank``."""
    kinds = {"kill": ["kill", "killmid", "killfetch"], "raise": ["raise", "raisefetch"]}[kind]
    faults = _plan(17 + len(kind), 20, kinds)
    _check(_run(tmp_path, faults, 400, 540, start="fork"), tmp_path, faults)


# -- single process ----------------------------------------------------------------------------
class _Ids(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_with_persistent_workers(workers: int) -> None:
    sampler = ElasticBatchSampler(50, 4, seed=1)
    extra: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
    loader = ElasticDataLoader(_Ids(), batch_sampler=sampler, num_workers=workers, **extra)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        got = [i for b in loader for i in b.tolist()]
        assert sorted(got) == list(range(50)), epoch
        orders.append(got)
    assert sampler.stale_batches == 0
    assert orders[0] != orders[1]
    # The same order as the sampler iterated directly.
    plain = ElasticBatchSampler(50, 4, seed=1)
    plain.set_epoch(2)
    assert [i for b in plain for i in b] == orders[2]


def test_a_plan_change_drops_the_batches_in_flight_and_plans_them_again() -> None:
    """A step discarded mid-epoch (as after a failure): the batches prefetched under the
    old plan never reach the loop, and the epoch still holds every sample once."""
    sampler = ElasticBatchSampler(50, 4, shuffle=False)
    loader = ElasticDataLoader(
        _Ids(), batch_sampler=sampler, num_workers=2, prefetch_factor=2, persistent_workers=True
    )
    sampler.set_epoch(0)
    got: list[int] = []
    for n, b in enumerate(loader):
        got.extend(b.tolist())
        if n == 3:
            sampler.on_step_discarded()  # this step's fetch is forgotten: taken again
            got = got[:-4]
    assert sorted(got) == list(range(50))
    assert sampler.stale_batches == 4  # num_workers * prefetch_factor


def test_configurations_that_cannot_work_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = ElasticBatchSampler(50, 4)
    with pytest.raises(ConfigError, match="in_order=True"):
        ElasticDataLoader(_Ids(), batch_sampler=sampler, num_workers=2, in_order=False)
    with pytest.raises(ConfigError, match="batch_sampler=ElasticBatchSampler"):
        ElasticDataLoader(_Ids(), batch_sampler=[[0, 1]])  # type: ignore[arg-type]
    # A plain DataLoader with workers under elastic training would train stale batches.
    monkeypatch.setattr(es, "_elastic", lambda: True)
    monkeypatch.setattr(es, "_membership", lambda: (1, 0, [0]))
    with pytest.raises(ConfigError, match="ElasticDataLoader"):
        iter(DataLoader(_Ids(), batch_sampler=sampler, num_workers=2))
    # num_workers=0 stays as it was.
    assert next(iter(DataLoader(_Ids(), batch_sampler=sampler))).tolist() == next(
        iter(ElasticBatchSampler(50, 4))
    )


def test_the_old_name_is_a_deprecated_alias() -> None:
    assert issubclass(ElasticDistributedSampler, ElasticBatchSampler)
    with pytest.warns(FutureWarning, match="use resilient_ddp.ElasticBatchSampler"):
        old = ElasticDistributedSampler(10, 2, shuffle=False)
    assert list(old) == list(ElasticBatchSampler(10, 2, shuffle=False))


def _workers_then_die(start: str, out: str) -> None:
    """Start a persistent ElasticDataLoader's workers (``start`` method), then die by
    SIGKILL as a failed rank does."""
    loader = ElasticDataLoader(
        _Ids(),
        batch_sampler=ElasticBatchSampler(50, 4),
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=start,
        worker_init_fn=functools.partial(_note_worker, out),
    )
    next(iter(loader))
    deadline = time.monotonic() + 30  # the first batch may come before a worker's init
    while len(list(Path(out).glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_self()


def _note_worker(out: str, worker_id: int) -> None:
    """The user's worker_init_fn: leaves the worker's pid in ``out``."""
    Path(out, f"{worker_id}.pid").write_text(str(os.getpid()))


@pytest.mark.parametrize("start", ["forkserver", "fork"])
def test_workers_end_with_a_killed_rank(start: str, tmp_path: Path) -> None:
    """A SIGKILLed rank's persistent workers end at once, also when a fork server started
    them (torch's own check would watch the fork server, which they keep alive: they
    outlived the rank for good). The user's worker_init_fn still runs in each."""
    proc = multiprocessing.get_context("forkserver").Process(
        target=_workers_then_die, args=(start, str(tmp_path))
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    workers = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(workers) == 2  # the user's worker_init_fn ran in each worker
    deadline = time.monotonic() + 2.0  # torch's own check polls every 5 s
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.02)
    assert not alive, f"workers {alive} outlived their killed rank"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
