"""``python -m resilient_ddp doctor``: standalone runs end to end, a broken environment under a
fake torchrun, and the report logic (hints, verdict, exit codes) on real preflight sentences."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import resilient_ddp as rd
from resilient_ddp.group.preflight import check_environment, compare
from resilient_ddp.tools import _doctor

# Variables that would change the mode or the rendezvous of the child: a test process may
# itself run under torchrun or rd.spawn, or with a resilient_ddp setting exported.
_RENDEZVOUS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _RENDEZVOUS
        and not k.startswith(("RESILIENT_DDP_", "TORCHELASTIC_"))
        and k != "PYTEST_CURRENT_TEST"
    }
    env.update(extra)
    return env


def _doctor_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_ddp", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env=env if env is not None else _clean_env(),
    )
    return proc.returncode, proc.stdout, proc.stderr


_BROKEN_ADDR = {
    "MASTER_ADDR": "no-such-host.invalid",
    "MASTER_PORT": "29500",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}


# -- end to end ----------------------------------------------------------------------------
def test_standalone_json_reports_two_healthy_ranks() -> None:
    code, out, err = _doctor_cli("--nproc", "2", "--quick", "--json")
    assert code == 0, out + err
    doc = json.loads(out)  # stdout is one JSON document and nothing else
    assert {"ok", "problems", "ranks", "all_reduce", "skew", "hints"} <= doc.keys()
    assert doc["ok"] is True, doc
    assert doc["problems"] == [], doc
    assert doc["mode"] == "standalone"
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert len({r["pid"] for r in doc["ranks"]}) == 2
    assert all(r["torch"] and r["python"] and r["host"] for r in doc["ranks"])
    assert [row["bytes"] for row in doc["all_reduce"]] == list(_doctor.QUICK_SIZES)
    for row in doc["all_reduce"]:
        assert row["latency_us"] > 0, row
        assert row["busbw_gbps"] > 0, row  # W = 2: busbw equals algbw
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"], rel=1e-3, abs=1e-4)
        assert len(row["per_rank_latency_us"]) == 2
    skew = doc["skew"]
    assert len(skew["times_ms"]) == 2
    assert all(t > 0 for t in skew["times_ms"])
    assert skew["ratio"] >= 1.0
    assert {skew["slowest_rank"], skew["fastest_rank"]} <= {0, 1}
    # A busy machine may make the ranks uneven: that is a warning, never a failure.
    assert all("step-time skew" in w for w in doc["warnings"]), doc


def test_standalone_text_report_has_every_section() -> None:
    code, out, err = _doctor_cli("--nproc", "2", "--quick")
    assert code == 0, out + err
    for section in (
        "doctor: gloo, standalone, 2 local ranks",
        "Ranks (preflight facts)",
        "all_reduce (slowest rank's median of 5",
        "Step-time skew",
        "slowest/fastest:",
        "Verdict: OK",
    ):
        assert section in out, out
    for size in ("4 B", "64 KiB", "1 MiB"):
        assert size in out, out


def test_unresolvable_master_addr_under_torchrun_names_it_and_the_fix() -> None:
    code, out, err = _doctor_cli(env=_clean_env(**_BROKEN_ADDR))
    assert code == _doctor.EXIT_PREFLIGHT, out + err
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in out, out
    assert "HINT (master_addr): Set MASTER_ADDR to rank 0's host name or IP address" in out
    assert "getent hosts no-such-host.invalid" in out
    assert "Verdict: FAILED at start-up (exit 2)" in out


def test_unresolvable_master_addr_json() -> None:
    code, out, err = _doctor_cli("--json", env=_clean_env(**_BROKEN_ADDR))
    assert code == _doctor.EXIT_PREFLIGHT, out + err
    doc = json.loads(out)
    assert doc["ok"] is False
    assert doc["mode"] == "torchrun"
    assert any("MASTER_ADDR" in p for p in doc["problems"]), doc
    assert [h["kind"] for h in doc["hints"]] == ["master_addr"]
    assert doc["all_reduce"] == []
    assert doc["skew"] is None


# Rank 1 dies by SIGKILL at the start of the step-time probe. The patch is made at the top
# level of the script, so the spawned ranks (which import the parent's main module as
# ``__mp_main__``) get it too.
_KILL_RANK_1 = """
import os, signal, sys
from resilient_ddp.tools import _doctor

_probe_skew = _doctor._probe_skew


def _dying_probe_skew(opts, device, ranks):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _probe_skew(opts, device, ranks)


_doctor._probe_skew = _dying_probe_skew

if __name__ == "__main__":
    from resilient_ddp.__main__ import main

    sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_dying_during_the_probe_is_named_with_exit_3(tmp_path: Path) -> None:
    script = tmp_path / "doctor_kill.py"
    script.write_text(_KILL_RANK_1, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script), "doctor", "--nproc", "2", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env=_clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == _doctor.EXIT_PROBE, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False
    assert doc["failed_ranks"] == [1], doc
    assert any(
        "during the step-time probe on rank 0, naming rank(s) [1]" in p for p in doc["problems"]
    ), doc
    assert "rank 1 was killed by SIGKILL before the probe finished" in doc["problems"], doc
    assert len(doc["all_reduce"]) == len(_doctor.QUICK_SIZES)  # what finished is kept
    assert [h["kind"] for h in doc["hints"]] == ["probe_failure"]


# -- the report logic, on the sentences preflight really writes ---------------------------
def _kinds(problems: list[str]) -> list[str]:
    return [h["kind"] for h in _doctor.hints(problems)]


def test_every_environment_problem_gets_a_hint() -> None:
    _, problems = check_environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"})
    assert problems, problems
    assert _kinds(problems) == ["environment"]
    _, problems = check_environment(
        {"MASTER_ADDR": "", "MASTER_PORT": "1", "RANK": "3", "WORLD_SIZE": "2"}
    )
    assert _kinds(problems) == ["master_addr", "environment"]


def test_fact_problems_get_hints() -> None:
    base = {"python": "3.11", "torch": "2.13.0", "cuda": "", "nccl": "", "backend": "gloo"}
    table: dict[int, dict[str, str]] = {
        0: {**base, "host": "a", "gpu": "GPU-1"},
        1: {**base, "host": "a", "gpu": "GPU-1", "torch": "2.99.0"},
    }
    problems = compare(table, 2)
    assert _kinds(problems) == ["version_mismatch", "shared_gpu"], problems
    hint = _doctor.hints(problems)[0]["hint"]
    assert "same Python, torch, CUDA and NCCL" in hint


@pytest.mark.parametrize(
    ("problem", "kind", "fragment"),
    [
        (
            "MASTER_PORT 29500 already in use on rank 0's host",
            "port_in_use",
            "ss -ltnp 'sport = :29500'",
        ),
        ("store 10.0.0.1:29500 unreachable from rank 3", "store_unreachable", "nc -zv"),
        ("rank(s) [2, 3] never arrived; WORLD_SIZE=4, arrived: 0 (a)", "missing_ranks", "nnodes"),
        ("rank 2 never attached", "missing_ranks", "WORLD_SIZE must equal"),
        ("rank 1: backend nccl not available: no (no CUDA device visible)", "backend", "gloo"),
        (
            "rank 0 (host vm): LOCAL_RANK=0 but cuda:0 (only 0 visible): fewer GPUs than "
            "processes on this host",
            "too_few_gpus",
            "nproc-per-node",
        ),
        ("something nobody expected", "other", "Troubleshooting"),
    ],
)
def test_hint_per_problem_kind(problem: str, kind: str, fragment: str) -> None:
    (hint,) = _doctor.hints([problem])
    assert hint["kind"] == kind
    assert fragment in hint["hint"]


def _opts(**over: Any) -> dict[str, Any]:
    opts = {
        "backend": "gloo",
        "quick": True,
        "init_timeout": 5.0,
        "op_timeout": 5.0,
        "skew_threshold": 1.5,
        "strict": False,
        "mode": "standalone",
    }
    return {**opts, **over}


def _healthy(ratio: float, **over: Any) -> dict[str, Any]:
    report = _doctor._new_report(_opts(**over), 0)
    report["world_size"] = 2
    report["ranks"] = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}]
    report["all_reduce"] = [
        {"bytes": 4, "size": "4 B", "repeats": 5, "latency_us": 50.0, "algbw_gbps": 0.0001,
         "busbw_gbps": 0.0001, "per_rank_latency_us": [50.0, 49.0]},
    ]  # fmt: skip
    report["skew"] = {
        "loop": "l",
        "times_ms": [10.0, 10.0 * ratio],
        "hosts": ["a", "b"],
        "slowest_rank": 1,
        "fastest_rank": 0,
        "ratio": ratio,
        "threshold": 1.5,
    }
    return _doctor._finish(report)


def test_skew_above_threshold_warns_and_exits_zero_unless_strict() -> None:
    calm = _healthy(1.1)
    assert (calm["ok"], calm["exit_code"], calm["warnings"], calm["hints"]) == (True, 0, [], [])
    skewed = _healthy(2.0)
    assert skewed["ok"] is True
    assert skewed["exit_code"] == 0
    assert "rank 1 (host b) took 20.0 ms" in skewed["warnings"][0]
    assert [h["kind"] for h in skewed["hints"]] == ["skew"]
    text = _doctor.format_report(skewed, "x")
    assert "Verdict: OK with warnings" in text
    assert "HINT (skew)" in text
    strict = _healthy(2.0, strict=True)
    assert (strict["ok"], strict["exit_code"]) == (False, _doctor.EXIT_WARNING)
    assert "Verdict: WARNING (exit 1)" in _doctor.format_report(strict, "x")


def test_spawn_error_with_preflight_and_crash_outcomes() -> None:
    pf = rd.PreflightError(
        "x", problems=["torch versions differ: 2.13 on rank(s) [0]; 2.99 on rank(s) [1]"]
    )
    error = rd.SpawnError(
        "failed",
        outcomes=[
            rd.RankOutcome(0, 1, None, "resilient_ddp.PreflightError", "x", "tb", pf),
            rd.RankOutcome(1, -9),
        ],
    )
    report = _doctor._from_spawn_error(error, _opts())
    assert report["exit_code"] == _doctor.EXIT_PREFLIGHT
    assert report["problems"][0].startswith("torch versions differ")
    assert "rank 1 was killed by SIGKILL before the probe finished" in report["problems"][1]
    assert report["failed_ranks"] == [1]
    assert [h["kind"] for h in report["hints"]] == ["version_mismatch", "probe_failure"]


def test_mode_detection() -> None:
    given = argparse.Namespace(nproc=2)
    absent = argparse.Namespace(nproc=None)
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    assert _doctor.under_torchrun(absent, env)
    assert not _doctor.under_torchrun(given, env)
    assert not _doctor.under_torchrun(absent, {})
