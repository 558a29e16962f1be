"""Start-up on real processes: each misconfiguration is reported within the init budget,
on every rank that is up, naming the problem and the rank."""

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

from resilient_ddp.base import _clock
from resilient_ddp.control._control import PreflightKeys
from resilient_ddp.errors import PreflightError
from resilient_ddp.group import preflight
from resilient_ddp.group.preflight import Environment, check_environment
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _preflight_workers as w
from ._counting_store import CountingStore
from ._fake_runtime import backoff_waits

DEADLINE = timedelta(seconds=40)


def _run(scenario: str, port: int = 0) -> dict[int, Any]:
    outcomes = run_ranks(w.start, 3, (scenario, port), timeout=DEADLINE)
    for o in outcomes:
        assert o.exitcode == 0, format_outcomes(outcomes)
    return {o.rank: o.value for o in outcomes}


def _preflight_error(v: Any) -> dict[str, Any]:
    assert isinstance(v, dict), v
    assert v.get("type") == "PreflightError", v
    assert v["elapsed"] < w.BUDGET_S + 2.0, v
    return v


def test_healthy_start() -> None:
    values = _run("healthy")
    assert all(v["ok"] for v in values.values()), values


def test_wrong_master_address_is_named_at_once_and_the_rank_is_missing_elsewhere() -> None:
    values = _run("wrong_address")
    own = _preflight_error(values[1])
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in own["message"]
    assert own["elapsed"] < 1.0
    for r in (0, 2):
        v = _preflight_error(values[r])
        assert "rank(s) [1] never arrived" in v["problems"][0], v


@pytest.mark.parametrize(
    ("scenario", "missing"), [("missing_rank", "[2]"), ("world_too_large", "[3]")]
)
def test_ranks_that_never_arrive_are_named_with_the_hosts_that_did(
    scenario: str, missing: str
) -> None:
    values = _run(scenario)
    up = [0, 1] if scenario == "missing_rank" else [0, 1, 2]
    for r in up:
        v = _preflight_error(values[r])
        assert f"rank(s) {missing} never arrived" in v["problems"][0], v
        assert "Arrived: 0 (" in v["message"]


def test_torch_version_mismatch_is_one_error_on_every_rank() -> None:
    values = _run("torch_version")
    for value in values.values():
        v = _preflight_error(value)
        assert any(
            "torch versions differ" in p and "2.99.0 on rank(s) [1]" in p for p in v["problems"]
        ), v
        assert v["table"][1]["torch"] == "2.99.0"


def test_a_store_host_that_finds_a_problem_serves_until_the_others_read_it() -> None:
    # Rank 0 hosts the store and compares the facts: it exits only once ranks 1 and 2 read
    # its verdict, so they raise the version problem, not a lost store.
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe
    values = _run("hosted_torch_version", port)
    for r, value in values.items():
        v = _preflight_error(value)
        assert f"(rank {r} reports)" in v["message"], v
        assert any("2.99.0 on rank(s) [1]" in p for p in v["problems"]), v
        assert v["table"][1]["torch"] == "2.99.0"


def test_two_ranks_on_one_gpu_are_named() -> None:
    values = _run("same_gpu")
    for value in values.values():
        v = _preflight_error(value)
        assert any("ranks [0, 1] share one GPU (GPU-1234)" in p for p in v["problems"]), v


def test_master_port_in_use_is_named_as_such() -> None:
    # The port of a store that is listening (torch's own, in this process).
    busy = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    values = _run("port_in_use", busy.port)
    v = _preflight_error(values[0])
    assert f"MASTER_PORT {busy.port} is already in use" in v["message"], v
    for r in (1, 2):
        assert "rank(s) [0] never arrived" in _preflight_error(values[r])["problems"][0]


def test_workers_wait_for_a_master_that_starts_late() -> None:
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe  # frees the port for rank 0, which starts 3 s after the others
    values = _run("late_master", port)
    for r, v in values.items():
        assert v.get("ok"), (r, v)
    # Rank 1 waited for rank 0 (retrying), then succeeded well within the budget.
    assert w.MASTER_DELAY_S - 1.0 < values[1]["elapsed"] < w.LATE_BUDGET_S


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
        (
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "2"},
            "MASTER_PORT='x' is not an integer",
        ),
        (
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000", "RANK": "0", "WORLD_SIZE": "2"},
            "MASTER_PORT=70000 should be in [1, 65535]",
        ),
        (
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "2"},
            "RANK=2 should be in [0, 1]",
        ),
        (
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"},
            "RANK is not set",
        ),
        (
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
                "RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "3",
                "LOCAL_WORLD_SIZE": "2",
            },
            "LOCAL_RANK=3 should be in [0, 1]",
        ),
    ],
)
def test_environment_problems_name_the_variable(environ: dict[str, str], said: str) -> None:
    env, problems = check_environment(environ)
    assert env is None
    assert any(said in p for p in problems), problems


def test_a_good_environment_passes() -> None:
    env, problems = check_environment(
        {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    )
    assert problems == []
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank) == (1, 2, 0)


def test_torchrun_restarts_rendezvous_again_every_time(tmp_path: Path) -> None:
    # Plain torch failed to reconnect in 4 of 10 gloo restarts on torchrun's
    # reused rendezvous store. Here every one of 3 restarts must get through init.
    restarts = 3
    script = tmp_path / "train.py"
    root = Path(__file__).resolve().parent.parent
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(root)!r})\n"
        "from tests._preflight_workers import restart_main\nrestart_main()\n"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(restarts), "--monitor-interval", "0.2",
        str(script), str(tmp_path), str(restarts),
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_DDP", "TORCHELASTIC"))
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for attempt in range(restarts + 1):
        for rank in (0, 1):
            record = json.loads((tmp_path / f"attempt{attempt}-rank{rank}.json").read_text())
            assert record["value"] == [2.0, 2.0], record
            assert record["init_s"] < 20, record


# -- the exchange: one counter a poll, whatever the number of ranks --------------------------
def _env(rank: int, world: int) -> Environment:
    return Environment("127.0.0.1", 29500, rank, world, 0, 0, 0, False)


KEYS = PreflightKeys(0)  # attempt 0's start-up keys


def _arrive(store: dist.Store, rank: int) -> None:
    store.set(KEYS.facts(rank), json.dumps({"host": f"h{rank}"}))
    store.add(KEYS.arrived, 1)


def test_the_checker_polls_a_counter_and_reads_the_facts_once_everyone_arrived() -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    _arrive(base, 1)
    seen: list[tuple[str, Any]] = []

    def rank_2_arrives() -> None:
        seen.extend(store.calls)
        _arrive(base, 2)

    # On a fake clock: rank 2 comes 300 ms on, in rank 0's 10th wait (5 ms, growing by 1.5
    # a poll to 50 ms: 103.9 ms in 6 waits, then 50 ms each; the 10th ends at 303.9 ms).
    with _clock.use(_clock.FakeClock()) as clock:
        deadline = clock.monotonic() + 20
        clock.after(0.3, rank_2_arrives)
        got = preflight._exchange(store, _env(0, 3), {"host": "h0"}, deadline)  # type: ignore[arg-type]
    assert clock.waits == pytest.approx(backoff_waits(10))
    # Rank 0's poll: the count (compare_set, which never breaks the connection on a value
    # that is not a number, as add would) and the verdict (one key); no rank's.
    checks = [keys for n, keys in seen if n == "check"]
    assert checks == [[KEYS.verdict()]] * 10, seen
    assert sum(n == "compare_set" for n, _ in seen) == 10 + 1  # + its own arrival
    assert sum(n == "add" for n, _ in seen) == 1  # its own arrival
    assert sorted(got) == [0, 1, 2]
    assert got[2] == {"host": "h2"}
    assert store.count("check", lambda keys: len(keys) == 3) == 1  # all there
    assert store.count("multi_get") == 1


def test_exchange_names_the_missing_rank_at_the_deadline_in_few_requests() -> None:
    base = dist.HashStore()
    store = CountingStore(base)
    world = 64
    for r in range(1, world):
        if r != 37:
            _arrive(base, r)
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match=r"Rank\(s\) \[37\] did not arrive") as e:
        preflight._exchange(store, _env(0, world), {"host": "h0"}, t0 + 0.5)  # type: ignore[arg-type]
    assert "rank(s) [37] never arrived" in e.value.problems[0]
    assert time.monotonic() - t0 < 2.0
    wide = store.count("check", lambda keys: len(keys) > 1)
    assert wide <= 1 + 2 * 6, wide  # halving 64 keys down to the missing one
    assert preflight._unpack(_env(1, world), base.get(KEYS.verdict()))["rank"] == 0


def test_present_halves_the_list_where_a_key_is_missing() -> None:
    have = {f"k{i}" for i in range(100) if i not in (3, 50, 99)}
    asked: list[list[str]] = []

    def check(keys: list[str]) -> bool:
        asked.append(keys)
        return set(keys) <= have

    got = preflight._present(check, [f"k{i}" for i in range(100)])
    assert [i for i, there in enumerate(got) if not there] == [3, 50, 99]
    assert len(asked) < 50
    asked.clear()
    assert preflight._present(check, sorted(have)) == [True] * 97
    assert len(asked) == 1
