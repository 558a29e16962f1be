"""Elastic training (``on_failure="shrink"``) with real gloo processes: faults injected on
purpose, survivors go on, replacements rejoin, state and data stay consistent."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _elastic_workers as w


def _records(out_dir: Path) -> list[list[dict[str, Any]]]:
    return [
        [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted(out_dir.glob("*.jsonl"))
    ]


@pytest.mark.parametrize("kind", ["kill", "raise", "killmid", "stop"])
def test_survivors_go_on_and_a_replacement_rejoins(kind: str, tmp_path: Path) -> None:
    """One rank fails (kill -9 before its forward, raises, is killed from a thread during
    its backward pass, or is frozen with SIGSTOP); the other three go on, a replacement
    joins, and at every committed step every process holds the same state."""
    faults = [{"uid": 2, "kind": kind, "step": 20, "delay": 0.002}]
    outcomes = run_ranks(
        w.train,
        4,
        (str(tmp_path), faults, 30, {}, 0.02),
        timeout=timedelta(seconds=80),
        restarts=1,
    )
    report = format_outcomes(outcomes)
    assert all(o.ok for o in outcomes), report
    assert [o.rank for o in outcomes if o.previous] == [2], report
    finals = [o.value for o in outcomes]
    assert {v["world_size"] for v in finals} == {4}, report
    assert len({v["final_hash"] for v in finals}) == 1, report
    logs_all = _records(tmp_path)
    by_step: dict[int, set[str]] = defaultdict(set)
    logs = [[r for r in log if "hash" in r] for log in logs_all]
    for log in logs:
        for rec in log:
            by_step[rec["step"]].add(rec["hash"])
    diverged = {s: h for s, h in by_step.items() if len(h) > 1}
    assert not diverged, (diverged, report)
    survivor = finals[0]
    shrinks = [e for e in survivor["events"] if e["kind"] == "shrink"]
    joins = [e for e in survivor["events"] if e["kind"] == "join"]
    assert len(shrinks) == 1, survivor
    assert len(joins) == 1, survivor
    e = shrinks[0]
    assert e["outcome"] in {"redo", "skip", "continue"}, e
    assert e["recovery_s"] < 1.0, e
    assert [c["rank"] for c in e["culprits"]] == [2], e
    assert [h[1] for h in survivor["world_size_history"]] == [4, 3, 4], survivor
    # Data: within an epoch no sample is trained twice, and every sample is trained once,
    # except at most the failed rank's last slot (its gradient may have reached the others
    # before it died without writing its log line).
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    dropped: dict[int, int] = {}
    for log in logs_all:
        for rec in log:
            if "epoch_end" in rec:
                e = rec["epoch_end"]
                dropped[e] = max(dropped.get(e, 0), rec["dropped"])
            else:
                per_epoch[rec["epoch"]].update(rec["ids"])
    unlogged = w.BATCH if kind in ("kill", "killmid") else 0
    for epoch, counts in sorted(per_epoch.items()):
        assert max(counts.values()) == 1, (epoch, [i for i, c in counts.items() if c > 1])
        missing = w.N_SAMPLES - len(counts) - dropped[epoch]
        assert 0 <= missing <= unlogged, (epoch, missing, dropped[epoch])
        assert dropped[epoch] < 4, (epoch, dropped[epoch])
    # Training still converges.
    losses = [loss for _, loss in sorted({(r["step"], r["loss"]) for log in logs for r in log})]
    assert sum(losses[-40:]) < 0.5 * sum(losses[:40])


def test_below_min_world_size_every_survivor_raises(tmp_path: Path) -> None:
    faults = [{"uid": 1, "step": 3, "kind": "kill"}]
    outcomes = run_ranks(
        w.train,
        3,
        (str(tmp_path), faults, 2, {"min_world_size": 3}),
        timeout=timedelta(seconds=40),
    )
    report = format_outcomes(outcomes)
    assert outcomes[1].exitcode == -9, report
    for r in (0, 2):
        o = outcomes[r]
        assert o.exc_type == "resilient_ddp.RankFailureError", report
        assert "fewer than min_world_size=3" in (o.exc_message or ""), report
        assert "rank 1" in (o.exc_message or ""), report


def test_a_minority_does_not_go_on_alone(tmp_path: Path) -> None:
    """Two of four ranks stop (silent, not known dead): the other two are half, not a
    majority, so they raise instead of training on as a second group."""
    faults = [
        {"uid": 2, "step": 3, "kind": "stop"},
        {"uid": 3, "step": 3, "kind": "stop"},
    ]
    outcomes = run_ranks(
        w.train,
        4,
        (str(tmp_path), faults, 2, {"min_world_size": 1}),
        timeout=timedelta(seconds=40),
        grace=timedelta(seconds=3),
    )
    report = format_outcomes(outcomes)
    for r in (0, 1):
        o = outcomes[r]
        assert o.exc_type == "resilient_ddp.RankFailureError", report
        assert "a minority does not go on alone" in (o.exc_message or ""), report
