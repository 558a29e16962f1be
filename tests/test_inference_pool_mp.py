"""Issue 28 on real gloo ranks: distributed inference that finishes.

3 ranks, 160 items in 20 chunks of 8, ``fn`` sleeps 2 ms an item. One non-zero rank is
killed, breaks (``fn`` raises on every item it runs from then on), hangs (blocked on a lock:
no CPU, no stack change) or is stopped (SIGSTOP) at 10 %, 50 % and 90 % of the work (by
item index: the culprit's first batch holding an item past the point; the other ranks hold
such batches until it fired, so the fault always happens). Rank 0 must return every
item's result exactly once, in dataset order, equal to a one-process run; the work redone
must be at most the failed rank's leased chunk; the failure must be reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _pool_workers as w
from ._matrix import kill_named

DEADLINE = timedelta(seconds=60)
GRACE = timedelta(seconds=30)
SCRIPT = Path(w.__file__).resolve()
ROOT = SCRIPT.parent.parent


def _run(fn: Any, world: int, *args: Any) -> list[Any]:
    return run_ranks(fn, world, args, timeout=DEADLINE, grace=GRACE)


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9], ids=["10%", "50%", "90%"])
@pytest.mark.parametrize("kind", ["kill", "raise", "hang", "stop"])
def test_a_failed_ranks_work_is_redone_and_every_result_arrives_once(
    kind: str, frac: float, tmp_path: Path
) -> None:
    # Past the point, at least 3 chunks: the culprit must find one while ranks 0 and 2
    # hold theirs until it fired.
    at = min(int(frac * w.N), w.N - 3 * w.CHUNK)
    outcomes = _run(w.pool_fault, 3, kind, 1, at, str(tmp_path / "fired"))
    report = format_outcomes(outcomes)
    assert (tmp_path / "fired").exists(), f"the fault never fired\n{report}"
    v = outcomes[0].value
    assert outcomes[0].exitcode == 0, report
    assert isinstance(v, dict), report
    assert "ok" in v, report
    # Every item exactly once, in dataset order, as one process computes it.
    assert v["ok"], (v["bad"], report)
    assert v["n"] == w.N
    s = v["summary"]
    assert s["items_done"] == w.N
    assert s["poison"] == []
    assert sum(s["per_rank"].values()) == w.N
    assert outcomes[2].exitcode == 0, report
    assert outcomes[2].value == {"none": True, "elapsed": outcomes[2].value["elapsed"]}
    if kind == "raise":
        # A broken rank stays up: each item it ran from then on went back alone, once.
        assert s["failed_ranks"] == {}
        assert s["redone"], s
        assert all(r["rank"] == 1 and r["items"] == 1 for r in s["redone"]), s["redone"]
        assert all("raised ValueError on rank 1" in r["why"] for r in s["redone"]), s
        items = [int(r["why"].split()[1]) for r in s["redone"]]
        assert len(items) == len(set(items)), "an item was given back twice"
        assert min(items) >= at
        return
    # Rank 1 is named, and only its leased chunk went back (a ticket drawn but not yet
    # recorded when it failed may add one orphan, redone under rank -1).
    assert list(s["failed_ranks"]) == [1], s
    assert 1 <= len(s["redone"]) <= 2, s["redone"]
    assert all(r["rank"] in (1, -1) for r in s["redone"]), s["redone"]
    assert sum(r["items"] for r in s["redone"]) <= 2 * w.CHUNK
    assert any("rank 1" in m for m in v["warnings"]), v["warnings"]
    why = s["failed_ranks"][1]
    if kind == "kill":
        assert outcomes[1].exitcode == -9, report
        assert "died" in why, why
    elif kind == "hang":
        assert "hung" in why, why
        # The hung rank was told and raised in its main thread, naming itself.
        assert outcomes[1].value["type"] == "RankFailureError", report
        assert outcomes[1].value["ranks"] == [1]
    else:
        assert "stopped" in why, why
        # Resumed by rank 0 (SIGCONT) after the end, it raised; it added nothing (exactly once).
        assert outcomes[1].value["type"] == "RankFailureError", report


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("poison", ("ValueError", f"item {w.POISON} is poison")),
        ("poison_load", ("OSError", f"sample {w.POISON} is corrupt")),
        ("poison_load_workers", ("OSError", f"sample {w.POISON} is corrupt")),
    ],
    ids=["fn", "dataset", "dataset-in-loader-workers"],
)
def test_a_poison_item_is_reported_not_retried_forever(kind: str, error: tuple[str, str]) -> None:
    outcomes = _run(w.pool_fault, 3, kind, -1, 0)
    report = format_outcomes(outcomes)
    v = outcomes[0].value
    assert isinstance(v, dict), report
    assert v["type"] == "ItemFailureError", report
    ((index, exc_type, message, ranks),) = v["failures"]
    assert (index, exc_type, message) == (w.POISON, *error)
    assert sorted(set(ranks)) == sorted(ranks), ranks
    assert len(ranks) == 2, ranks  # max_item_failures=2 different ranks
    assert v["results"]["ok"], v["results"]  # every other result kept
    assert v["poison_none"]
    assert v["summary"]["poison"][0][0] == w.POISON
    assert sum(1 for r in v["summary"]["redone"] if "raised" in r["why"]) == 1


def test_on_rank_failure_raise_keeps_every_rank_raising() -> None:
    outcomes = _run(w.pool_fault, 3, "kill", 1, w.N // 2, "", w.N, "raise")
    report = format_outcomes(outcomes)
    assert outcomes[1].exitcode == -9, report
    for r in (0, 2):
        v = outcomes[r].value
        assert isinstance(v, dict), report
        assert v["type"] == "RankFailureError", report
        assert v["ranks"] == [1], v["message"]


def test_iter_inference_streams_in_dataset_order_on_rank0_only() -> None:
    outcomes = _run(w.stream, 3, w.N)
    report = format_outcomes(outcomes)
    assert all(o.exitcode == 0 for o in outcomes), report
    assert outcomes[0].value["indices_in_order"], report
    assert outcomes[0].value["ok"], report
    assert outcomes[1].value == outcomes[2].value == {"count": 0}


def test_rank0_breaking_out_of_iter_inference_ends_the_call_everywhere() -> None:
    outcomes = _run(w.stream, 3, w.N, 10)
    report = format_outcomes(outcomes)
    assert all(o.exitcode == 0 for o in outcomes), report
    assert outcomes[0].value == {"count": 10, "first": list(range(10))}, report
    assert outcomes[1].value == outcomes[2].value == {"count": 0, "first": []}


def test_a_job_killed_whole_resumes_on_its_output_dir_with_another_world_size(
    tmp_path: Path,
) -> None:
    out = str(tmp_path / "results")
    kill_at = w.N // 2  # every rank dies at its first batch past half the items
    first = _run(w.resume_job, 3, out, kill_at)
    assert all(o.exitcode != 0 or o.value is None or "type" in o.value for o in first)
    written = sorted(int(n[6:12]) for n in os.listdir(out) if n.startswith("chunk-"))
    at_chunk = kill_at // w.CHUNK
    # Every chunk before the kill point was written, each once.
    assert set(range(at_chunk)) <= set(written), (written, format_outcomes(first))
    assert len(written) == len(set(written))
    assert len(written) < w.N // w.CHUNK, "the first job was not stopped"
    assert any(o.exitcode == -9 for o in first), format_outcomes(first)
    second = _run(w.resume_job, 2, out, None)
    report = format_outcomes(second)
    assert all(o.exitcode == 0 for o in second), report
    v = second[0].value
    assert v["ok"], v
    s = v["summary"]
    assert s["resumed"] == w.CHUNK * len(written)
    # Only what was not written runs again: at most the chunks in flight when the job
    # died (one per rank) beyond the kill point.
    n_chunks = w.N // w.CHUNK
    assert s["chunks"] == n_chunks - len(written)
    assert n_chunks - len(written) <= (n_chunks - at_chunk), written
    assert s["chunks_redone"] == 0


# -- other launchers -------------------------------------------------------------------------
def _base_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_DDP", "TORCHELASTIC"))
    }


def _read(out: Path, name: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads((out / name).read_text()))
    except (OSError, ValueError):
        return None


def _logs(out: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(out.glob("*.txt"))
    )


@pytest.mark.torchrun
def test_torchrun_restart_resumes_from_the_output_dir(tmp_path: Path) -> None:
    """torchrun's agent stops the whole group when a worker dies, and restarts it
    (--max-restarts 1): attempt 1 resumes from the chunk files of attempt 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--max-restarts", "1", "--monitor-interval", "0.2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-conf", "is_host=0", str(SCRIPT), str(out), "kill",
    ]  # fmt: skip
    with (out / "torchrun.txt").open("w") as log:
        proc = subprocess.Popen(
            cmd, env={**_base_env(), "POOL_OUTPUT_DIR": "1"}, cwd=ROOT, stdout=log, stderr=log
        )
        try:
            rc: int | None = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_named(tmp_path)
            proc.wait()
    report = _logs(out)
    assert rc == 0, report
    assert (out / "fired").exists(), report
    v = _read(out, "result1-0.json")
    assert v is not None, report
    assert v["ok"], v
    assert v["summary"]["resumed"] >= w.N // 2 - 3 * w.CHUNK, v["summary"]
    assert v["summary"]["items_done"] == w.N


def _free_port() -> int:
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(probe.port)
    del probe
    return port


def test_env_launch_with_rank0_hosting_the_store_survives_a_killed_rank(tmp_path: Path) -> None:
    """Three plain processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as srun starts them):
    rank 0 hosts the store; rank 1 is killed at half the work; ranks 0 and 2 finish."""
    for attempt in range(3):  # the port was free a moment ago; another process may take it
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        port = _free_port()
        procs = []
        for rank in range(3):
            env = {
                **_base_env(),
                "RANK": str(rank),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with (out / f"log{rank}.txt").open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), str(out), "kill"],
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=log,
                    )
                )
        deadline = time.monotonic() + 60
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        report = _logs(out)
        if "already in use" in report and attempt < 2:
            continue
        assert codes[1] == -9, (codes, report)
        assert codes[0] == 0, (codes, report)
        assert codes[2] == 0, (codes, report)
        v = _read(out, "result0-0.json")
        assert v is not None, report
        assert v["ok"], v
        assert list(v["summary"]["failed_ranks"]) == ["1"], v["summary"]
        assert len(v["summary"]["redone"]) <= 2, v["summary"]
        assert _read(out, "result0-2.json") == {"none": True}
        return


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_rank0_the_collector_failing_is_named_by_the_survivors(kind: str, tmp_path: Path) -> None:
    outcomes = _run(w.pool_fault, 3, kind, 0, w.N // 2, str(tmp_path / "fired"))
    report = format_outcomes(outcomes)
    if kind == "kill":
        assert outcomes[0].exitcode == -9, report
    else:
        # Hung in fn: its own collector judged it, and its main thread raised.
        v0 = outcomes[0].value
        assert isinstance(v0, dict), report
        assert v0["type"] == "RankFailureError", report
        assert v0["ranks"] == [0], v0["message"]
        assert "hung in distributed_inference" in v0["message"]
    for r in (1, 2):
        v = outcomes[r].value
        assert isinstance(v, dict), report
        assert v["type"] == "RankFailureError", report
        assert 0 in v["ranks"], v["message"]
        assert "rank 0 collects the results and failed" in v["message"], v["message"]


def test_one_rank_alone_runs_everything() -> None:
    outcomes = _run(w.stream, 1, 30)
    report = format_outcomes(outcomes)
    assert outcomes[0].exitcode == 0, report
    assert outcomes[0].value["indices_in_order"], report
    assert outcomes[0].value["ok"], report


def test_a_rank_with_another_dataset_is_told_and_the_others_finish() -> None:
    outcomes = _run(w.pool_fault, 3, "mismatch", 2, 0)
    report = format_outcomes(outcomes)
    v2 = outcomes[2].value
    assert isinstance(v2, dict), report
    assert v2["type"] == "ConfigError", report
    assert "rank 0 planned another call" in v2["message"]
    v = outcomes[0].value
    assert v["ok"], report
    assert 2 not in v["summary"]["per_rank"], v["summary"]


def test_results_over_the_stores_value_limit_arrive_whole() -> None:
    # 3 ranks, 120 items of 256 KiB in chunks of 40: each delivery is about 10 MiB, over
    # the 8 MiB a libuv TCPStore accepts as one value (it used to drop the connection and
    # every rank raised ControlPlaneError): it travels in parts.
    outcomes = _run(w.big_results, 3, 120, 40)
    report = format_outcomes(outcomes)
    assert all(o.exitcode == 0 for o in outcomes), report
    v = outcomes[0].value
    assert v["n"] == 120, report
    assert v["bad"] == [], report
    assert sum(v["per_rank"].values()) == 120, v
    assert outcomes[1].value == {"none": True}, report
    assert outcomes[2].value == {"none": True}, report


def test_a_replacement_started_by_spawn_helps_with_the_running_call(tmp_path: Path) -> None:
    """``rd.spawn(restarts=1)``: rank 1 dies early; its replacement finds the running call
    (no member admits anyone during inference), pulls chunks beside ranks 0 and 2 without
    joining the group, and ends with code 0; every result arrives once, in order."""
    outcomes = run_ranks(
        w.pool_guest, 3, (str(tmp_path),), timeout=DEADLINE, grace=GRACE, restarts=1
    )
    report = format_outcomes(outcomes)
    assert [o.exitcode for o in outcomes] == [0, 0, 0], report
    assert [p.exitcode for p in outcomes[1].previous] == [-9], report
    v = outcomes[0].value
    assert v["ok"], report
    assert v["n"] == w.N, report
    s = v["summary"]
    helpers = {k: n for k, n in s["per_rank"].items() if k >= 3}
    assert len(helpers) == 1, s["text"]
    assert next(iter(helpers.values())) > 0, s["text"]
    assert sum(s["per_rank"].values()) == w.N, s["text"]  # each item delivered once
    assert list(s["failed_ranks"]) == [1], s["text"]
    assert "(replacement)" in s["text"], s["text"]
    g = outcomes[1].value
    assert g["guest"], report
    assert g["none"], report
    # Anything but inference needs the group, which a helper never joined: said plainly.
    assert "without joining the process group" in g["no_group"], g


def test_a_replacement_that_comes_after_the_call_ended_exits_cleanly(tmp_path: Path) -> None:
    """Rank 1 dies in the last chunks; the call ends before its replacement has started:
    nobody will admit it (the job does not train elastically), so it exits with code 0
    instead of waiting out its join timeout, and the job succeeds."""
    outcomes = run_ranks(
        w.pool_guest, 3, (str(tmp_path), True), timeout=DEADLINE, grace=GRACE, restarts=1
    )
    report = format_outcomes(outcomes)
    assert (tmp_path / "fired").exists(), report
    assert [o.exitcode for o in outcomes] == [0, 0, 0], report
    assert [p.exitcode for p in outcomes[1].previous] == [-9], report
    assert outcomes[1].value is None, report  # it left from init_process_group
    v = outcomes[0].value
    assert v["ok"], report
    assert v["n"] == w.N, report
    assert list(v["summary"]["failed_ranks"]) == [1], v["summary"]["text"]
