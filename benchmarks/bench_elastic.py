"""Elastic training (``on_failure="shrink"``): recovery, rejoin and healthy-step overhead.

Three measurements, each in its own launch:

* **recovery**: 4 gloo ranks on CPU train a small MLP (``rd.ResilientDDP``,
  ``rd.ElasticBatchSampler``) under ``rd.testing.run_ranks(..., restarts=N)``. One
  fault at a time, each once the previous replacement joined and the world is whole
  again: a rank other than rank 0 fails after its forward pass, either killed by SIGKILL
  (``kill``) or raising an exception that ends its process (``raise``); kinds alternate.
  The time is from the fault (the culprit's clock just before it kills itself or raises)
  to the moment the *last* survivor completed its first step on the new generation
  (forward, backward, ``optimizer.step()``; its clock, the same host). It is split, on
  that survivor, into detection (fault to the start of the library's recovery: the shrink
  event's ``t`` minus its ``recovery_s``), the library's own ``recovery_s`` (start of
  recovery to the new generation ready) and the rest of the step.
* **rejoin**: the same, with an MLP of ~10 M parameters (float32, SGD with momentum: the
  joiner receives the weights and the momentum), and what is timed is the replacement:
  from the joiner's request to join (``requested_t`` of its ``admitted`` event, posted in
  ``rd.init_process_group`` once its start-up is done) to its first completed step. Its
  process start (spawn, ``import torch``, building the model) and that start-up come
  before and are reported apart, as is the members' ``admission_s`` (their join event). No
  process's committed step count may ever go back (in either run).
* **overhead**: 2 ranks, one process group initialised with the same elastic config;
  ``bench_ddp_step``'s interleaved rounds time plain DDP, DDP with torch's Python
  ``allreduce_hook`` and ``ResilientDDP`` (which is elastic in such a group). The ratio is
  the median over rounds of the per-round ratio of median step times.

Bounds (the issue's): recovery at most 1 s (median over trials, per fault kind); rejoin at
most 0.5 s for a 10 M parameter model (median); survivors lose no step; healthy step with
``on_failure="shrink"`` at most 1.03x plain DDP for 10 M parameters.

Usage::

    python benchmarks/bench_elastic.py             # 5 trials per kind and 5 rejoins, ~5 min
    python benchmarks/bench_elastic.py --quick     # smoke test: 1 trial each, 1 M models, ~1.5 min
    python benchmarks/bench_elastic.py --parts rejoin --trials 2

The full run writes ``benchmarks/results/elastic.json``; ``--quick`` writes under
``benchmarks/results/quick/``.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_collectives import _display, _loadavg, machine_info, result_header
from bench_ddp_step import MODELS, _measure, _mlp  # the step-time rounds and their models
from bench_ddp_step import TARGET as OVERHEAD_BOUND
from bench_detection import COMPUTE_S, SIMULATED_ERROR, _Events, _read_events

import resilient_ddp as rd
from resilient_ddp.testing import format_outcomes, kill_self, run_ranks

NAME = "elastic"
TITLE = "Elastic training: recovery, rejoin and step overhead"
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"

PARTS = ("recovery", "rejoin", "overhead")
KINDS = ("kill", "raise")
WORLD_SIZE = 4
OVERHEAD_WORLD_SIZE = 2  # 2 ranks on 2 cores; 4 would oversubscribe them
TRIALS = 5  # per fault kind, and rejoins
QUICK_TRIALS = 1
RECOVERY_BOUND_S = 1.0
REJOIN_BOUND_S = 0.5
REJOIN_MIN_PARAMS = 10_000_000  # the rejoin bound is for a model of this size
# Every part uses this config (the heartbeat as in tests/test_elastic_mp.py; timeouts
# generous for a loaded 2-core machine: they bound hangs, which are not measured here).
CONFIG: dict[str, Any] = {
    "on_failure": "shrink",
    "min_world_size": 2,
    "heartbeat_interval_s": 0.1,
    "heartbeat_timeout_s": 10.0,
    "op_timeout_s": 30.0,
}
FIRST_FAULT_STEP = 10  # warm-up steps before the first fault
GAP_STEPS = 5  # steps at full size after a join before the next fault (or the end)
CULPRITS = (1, 2, 3)  # the current rank that fails, in turn (never rank 0)
N_SAMPLES = 200_000  # sampler indices: epochs far longer than a run (no epoch-end effects)
DATA_ROWS = 1024  # distinct input rows; index i reads row i % DATA_ROWS
# (label, width, layers, batch per rank, compute sleep per step); see bench_ddp_step._mlp.
RECOVERY_MODEL = ("MLP 0.1 M", 256, 2, 8, COMPUTE_S)
REJOIN_MODEL = (MODELS[1][0], MODELS[1][1], MODELS[1][2], 32, 0.0)  # 10 M parameters
QUICK_REJOIN_MODEL = (MODELS[0][0], MODELS[0][1], MODELS[0][2], 32, 0.0)  # 1 M parameters


# -- one rank (runs in its own process) ---------------------------------------------------------
def _config(op_timeout_s: float | None = None) -> rd.ResilienceConfig:
    return rd.ResilienceConfig(
        on_failure="shrink",
        min_world_size=CONFIG["min_world_size"],
        heartbeat_interval=timedelta(seconds=CONFIG["heartbeat_interval_s"]),
        heartbeat_timeout=timedelta(seconds=CONFIG["heartbeat_timeout_s"]),
        op_timeout=timedelta(seconds=op_timeout_s or CONFIG["op_timeout_s"]),
    )


def _process_start() -> float | None:
    """This process's start as a ``time.time()`` value (Linux; 10 ms resolution)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat[stat.rfind(")") + 2 :].split()[19])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _losses(history: list[tuple[int, int]]) -> int:
    """Ranks lost so far in the job (the world-size history is sent to joiners)."""
    return sum(max(0, a[1] - b[1]) for a, b in itertools.pairwise(history))


def _gains(history: list[tuple[int, int]]) -> int:
    return sum(max(0, b[1] - a[1]) for a, b in itertools.pairwise(history))


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e["kind"] == kind), None)


def _inject(kind: str) -> None:
    if kind == "kill":
        kill_self()
    raise RuntimeError(SIMULATED_ERROR)  # uncaught: the process ends as a script would


def _decide(stats: dict[str, Any], spec: dict[str, Any]) -> tuple[bool, str | None]:
    """At a step boundary (the same stats on every member): whether the run is over, and
    the fault this process injects in the coming step, if any.

    One fault at a time: the next once the world is whole again and ``GAP_STEPS`` steps
    passed since it grew; the run ends as long after the last replacement joined."""
    faults = spec["faults"]
    history = stats["world_size_history"]
    lost = _losses(history)
    whole = stats["world_size"] == spec["world_size"]
    settled = whole and stats["step"] - history[-1][0] >= GAP_STEPS
    if stats["step"] >= spec["max_steps"] or (lost >= len(faults) and settled):
        return True, None
    if (
        lost < len(faults)
        and settled
        and stats["step"] >= FIRST_FAULT_STEP
        and dist.get_rank() == CULPRITS[lost % len(CULPRITS)]
    ):
        return False, faults[lost]
    return False, None


class _Recorder:
    """Logs, after each step, what changed: the committed step, a shrink (this survivor's
    first completed step after it), an admission, a joiner's first completed step."""

    def __init__(self, events: _Events, stats: dict[str, Any], uid: int, joiner: bool) -> None:
        self.events, self.uid = events, uid
        self.losses = _losses(stats["world_size_history"])
        self.gains = _gains(stats["world_size_history"])
        self.last_step = stats["step"]
        self.first_step_due = joiner
        self.joiner_times: dict[str, float | None] = {}

    def after_step(self, before: dict[str, Any], after: dict[str, Any], t_done: float) -> None:
        log = self.events.log
        if after["step"] != self.last_step:
            log("step", step=after["step"], world=after["world_size"], at=t_done)
            self.last_step = after["step"]
        if after["step"] <= before["step"]:
            return  # not committed (a skipped step): not a completed step
        history = after["world_size_history"]
        if _losses(history) > self.losses:
            self.losses = _losses(history)
            shrink = _last(after["events"], "shrink")
            log("recovered", index=self.losses - 1, at=t_done, uid=self.uid, shrink=shrink)
        if _gains(history) > self.gains:
            self.gains = _gains(history)
            join = _last(after["events"], "join")
            log(
                "joined",
                index=self.gains - 1,
                at=t_done,
                uid=self.uid,
                step=after["step"],
                join=join,
            )
        if self.first_step_due:
            self.first_step_due = False
            log(
                "joiner",
                index=_gains(history) - 1,
                uid=self.uid,
                first_step=t_done,
                step=after["step"],
                **self.joiner_times,
            )


def fault_worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train under ``on_failure="shrink"``; fail on cue; log what the parent measures.

    Appends JSON lines (``bench_detection._Events``) to ``<dir>/<pid>.jsonl``: ``fault``
    (the culprit, just before it fails), ``recovered`` (a survivor's first completed step
    after a shrink, with the shrink event), ``joined`` (a member's first step after an
    admission, with the join event), ``joiner`` (a replacement's start-up times and its
    first completed step) and ``step`` (the committed step count whenever it changed).
    """
    proc_start = _process_start()
    faulthandler.dump_traceback_later(spec["hard_limit_s"], exit=True)
    torch.set_num_threads(1)
    joiner = os.environ.get("RESILIENT_DDP_JOINER", "") not in ("", "0")
    uid = int(os.environ.get("RESILIENT_DDP_UID", rank))
    events = _Events(os.path.join(spec["dir"], f"{os.getpid()}.jsonl"))
    _, width, layers, batch, compute_s = spec["model"]
    net = _mlp(width, layers)  # built before init: a joiner's wait starts at its request
    data = torch.randn(DATA_ROWS, width, generator=torch.Generator().manual_seed(1))
    init_start = time.time()
    rd.init_process_group("gloo", config=_config())
    init_done = time.time()
    model = rd.ResilientDDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sampler = rd.ElasticBatchSampler(N_SAMPLES, batch, seed=0)
    recorder = _Recorder(events, model.resilience_stats, uid, joiner)
    admitted = _last(model.resilience_stats["events"], "admitted") if joiner else None
    recorder.joiner_times = {
        "proc_start": proc_start,
        "init_start": init_start,
        "requested": admitted["requested_t"] if admitted else None,
        "init_done": init_done,
        "ready": time.time(),
    }
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        done = False
        for ids in sampler:
            stats = model.resilience_stats
            done, fault = _decide(stats, spec)
            if done:
                break
            x = data[torch.as_tensor(ids) % DATA_ROWS]
            time.sleep(compute_s)
            loss = model(x).pow(2).mean()
            if fault is not None:
                rank_now = dist.get_rank()
                lost = _losses(stats["world_size_history"])
                events.log("fault", kind=fault, index=lost, rank=rank_now, step=stats["step"])
                _inject(fault)
            loss.backward()
            opt.step()
            opt.zero_grad()
            recorder.after_step(stats, model.resilience_stats, time.time())
        if done:
            break
    stats = model.resilience_stats
    rd.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return {k: stats[k] for k in ("step", "world_size", "world_size_history", "failures")}


def overhead_worker(rank: int, plan: dict[str, Any]) -> dict[str, Any]:
    """``bench_ddp_step``'s measurement in a group initialised with the elastic config: its
    ``rd`` variant is then an elastic ``ResilientDDP``."""
    torch.set_num_threads(1)
    rd.init_process_group("gloo", config=_config(op_timeout_s=600))
    out = {label: _measure(rank, w, n, plan) for label, w, n in plan["models"]}
    rd.destroy_process_group()
    return out


# -- the parent ---------------------------------------------------------------------------------
def run_faults(
    faults: list[str], model: tuple[Any, ...]
) -> tuple[dict[int, list[dict[str, Any]]], list[str], dict[str, Any]]:
    """One launch of ``WORLD_SIZE`` ranks through ``faults`` (one replacement each).

    Returns:
        Every process's events (by pid), the problems seen (a failed rank, a timeout) and
        rank 0's final stats.
    """
    tmp = Path(tempfile.mkdtemp(prefix="rd-elastic-"))
    per_fault_s = 60 if model[1] >= 1024 else 40
    timeout_s = 90 + per_fault_s * len(faults)
    spec = {
        "dir": str(tmp),
        "faults": faults,
        "model": model,
        "world_size": WORLD_SIZE,
        "max_steps": 100_000,
        "hard_limit_s": timeout_s + 30,
    }
    outcomes = run_ranks(
        fault_worker,
        WORLD_SIZE,
        (spec,),
        timeout=timedelta(seconds=timeout_s),
        restarts=len(faults),
    )
    problems = []
    if not all(o.ok for o in outcomes):
        problems.append("a rank did not end well:\n" + format_outcomes(outcomes))
    replaced = sum(len(o.previous) for o in outcomes)
    if replaced != len(faults):
        problems.append(f"{replaced} process(es) replaced for {len(faults)} fault(s)")
    for o in outcomes:
        for prev in o.previous:
            if prev.exitcode != -9 and prev.exc_type != "RuntimeError":
                problems.append(
                    f"slot {o.rank}: a replaced process ended with exit code {prev.exitcode}, "
                    f"{prev.exc_type}: {prev.exc_message}"
                )
    events = {int(p.stem): _read_events(p) for p in sorted(tmp.glob("*.jsonl"))}
    shutil.rmtree(tmp, ignore_errors=True)
    final = outcomes[0].value if outcomes[0].ok else {}
    return events, problems, final


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _of(events: dict[int, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return [e | {"pid": pid} for pid, evs in events.items() for e in evs if e["event"] == name]


def recovery_trials(events: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per fault: the times from the fault to each survivor's first step after the shrink,
    split on the last survivor into detection, the library's recovery and the rest."""
    recovered = _of(events, "recovered")
    trials = []
    for fault in sorted(_of(events, "fault"), key=lambda e: e["index"]):
        mine = [r for r in recovered if r["index"] == fault["index"]]
        trial: dict[str, Any] = {
            "index": fault["index"],
            "kind": fault["kind"],
            "culprit_rank": fault["rank"],
            "step": fault["step"],
            "survivors": len(mine),
        }
        if mine:
            last = max(mine, key=lambda r: r["at"])
            shrink = last["shrink"] or {}
            start = shrink.get("t", last["at"]) - shrink.get("recovery_s", 0.0)
            trial.update(
                last_s=round(last["at"] - fault["t"], 4),
                first_s=round(min(r["at"] for r in mine) - fault["t"], 4),
                detection_s=round(start - fault["t"], 4),
                recovery_s=shrink.get("recovery_s"),
                finish_s=round(last["at"] - shrink.get("t", last["at"]), 4),
                recovery_s_all=sorted(
                    float((r["shrink"] or {}).get("recovery_s", "nan")) for r in mine
                ),
                outcome=shrink.get("outcome"),
                world_size=shrink.get("world_size"),
                culprits=[c.get("what") for c in shrink.get("culprits", [])],
            )
        trials.append(trial)
    return trials


def recovery_rows(trials: list[dict[str, Any]], kinds: list[str]) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        mine = [t for t in trials if t["kind"] == kind]
        ok = [t for t in mine if "last_s" in t and t["survivors"] == WORLD_SIZE - 1]
        rows.append(
            {
                "kind": kind,
                "trials": len(mine),
                "complete": len(ok),
                "median_s": _med([t["last_s"] for t in ok]),
                "max_s": max((t["last_s"] for t in ok), default=None),
                "median_first_s": _med([t["first_s"] for t in ok]),
                "median_detection_s": _med([t["detection_s"] for t in ok]),
                "median_recovery_s": _med([t["recovery_s"] for t in ok]),
                "median_finish_s": _med([t["finish_s"] for t in ok]),
                "outcomes": sorted({str(t.get("outcome")) for t in ok}),
                "last_s": [t["last_s"] for t in ok],
            }
        )
    return rows


def _step_durations(evs: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(step, world size, seconds since the previous committed step) of one process."""
    steps = [e for e in evs if e["event"] == "step"]
    return [(b["step"], b["world"], b["at"] - a["at"]) for a, b in itertools.pairwise(steps)]


def step_check(events: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Whether any process's committed step count went back or jumped."""
    back, jumps = [], []
    for pid, evs in events.items():
        steps = [e["step"] for e in evs if e["event"] == "step"]
        for a, b in itertools.pairwise(steps):
            if b < a:
                back.append({"pid": pid, "from": a, "to": b})
            elif b > a + 1:
                jumps.append({"pid": pid, "from": a, "to": b})
    return {"processes": len(events), "went_back": back, "jumped": jumps}


def _steps_done(evs: list[dict[str, Any]], t: float) -> int | None:
    """A process's committed step count at time ``t`` (None: no step logged by then)."""
    done = [e["step"] for e in evs if e["event"] == "step" and e["at"] <= t]
    return max(done) if done else None


def rejoin_trials(
    events: dict[int, list[dict[str, Any]]], faults: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per replacement: its start-up, its time from asking to join to its first completed
    step, the members' admission time, and the members' step that admitted it."""
    joined = _of(events, "joined")
    fault_t = {f["index"]: f["t"] for f in faults}
    trials = []
    for j in sorted(_of(events, "joiner"), key=lambda e: e["index"]):
        members = [r for r in joined if r["index"] == j["index"]]
        admission = [
            float(r["join"]["admission_s"])
            for r in members
            if (r["join"] or {}).get("admission_s") is not None
        ]
        # The members' step that admitted the joiner, against their median step at full size.
        stall, typical = [], []
        for r in members:
            durations = _step_durations(events[r["pid"]])
            stall += [d for s, _, d in durations if s == r["step"]]
            typical += [d for s, w, d in durations if w == WORLD_SIZE and s != r["step"]]
        # The joiner is ready once it asked to join (its start-up is done); before that,
        # rd.init_process_group prepares it (imports torch._dynamo) while the members train.
        requested = j.get("requested") or j["init_start"]
        # In steps: how many steps the members completed from the request to the step
        # before the joiner's first, the one in flight when it asked included (ideal: 1).
        waited = waited_seen = None
        acked = [
            float(r["join"]["acked_t"])
            for r in members
            if (r["join"] or {}).get("acked_t") is not None
        ]
        if members:
            timeline = events[members[0]["pid"]]
            if (done := _steps_done(timeline, requested)) is not None:
                waited = j["step"] - 1 - done
        # From the moment the members saw it: each acknowledged it with its committed
        # step count (the step in flight then is the next one), exact where the logged
        # step times come after the optimizer step.
        seen_at = [
            int(r["join"]["acked_step"])
            for r in members
            if (r["join"] or {}).get("acked_step") is not None
        ]
        if seen_at:
            waited_seen = j["step"] - 1 - max(seen_at)
        trial = {
            "index": j["index"],
            "ready_to_first_step_s": round(j["first_step"] - requested, 4),
            "init_to_first_step_s": round(j["first_step"] - j["init_start"], 4),
            "before_request_s": round(requested - j["init_start"], 4),
            "admitted_s": round(j["init_done"] - requested, 4),
            "init_s": round(j["init_done"] - j["init_start"], 4),
            "wrap_s": round(j["ready"] - j["init_done"], 4),
            "first_step_s": round(j["first_step"] - j["ready"], 4),
            "admission_s": max(admission) if admission else None,
            "members": len(members),
            "member_admission_step_s": round(max(stall), 4) if stall else None,
            "member_median_step_s": round(statistics.median(typical), 4) if typical else None,
            "step": j["step"],
            "steps_waited": waited,
            "steps_waited_seen": waited_seen,
            "seen_s": round(max(acked) - requested, 4) if acked else None,
        }
        if j.get("proc_start") is not None:
            trial["process_start_s"] = round(j["init_start"] - j["proc_start"], 3)
            if j["index"] in fault_t:
                trial["replacement_started_s"] = round(j["proc_start"] - fault_t[j["index"]], 3)
        trials.append(trial)
    return trials


def rejoin_row(trials: list[dict[str, Any]], model: tuple[Any, ...]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        return _med([t[key] for t in trials if t.get(key) is not None])

    return {
        "model": model[0],
        "trials": len(trials),
        "median_s": med("ready_to_first_step_s"),
        "median_steps_waited": med("steps_waited"),
        "median_steps_waited_seen": med("steps_waited_seen"),
        "max_steps_waited_seen": max(
            (t["steps_waited_seen"] for t in trials if t.get("steps_waited_seen") is not None),
            default=None,
        ),
        "median_seen_s": med("seen_s"),
        "max_steps_waited": max(
            (t["steps_waited"] for t in trials if t.get("steps_waited") is not None),
            default=None,
        ),
        "max_s": max((t["ready_to_first_step_s"] for t in trials), default=None),
        "median_init_s": med("init_s"),
        "median_init_to_first_step_s": med("init_to_first_step_s"),
        "median_before_request_s": med("before_request_s"),
        "median_admitted_s": med("admitted_s"),
        "median_wrap_s": med("wrap_s"),
        "median_first_step_s": med("first_step_s"),
        "median_admission_s": med("admission_s"),
        "median_member_admission_step_s": med("member_admission_step_s"),
        "median_member_step_s": med("member_median_step_s"),
        "median_process_start_s": med("process_start_s"),
        "median_replacement_started_s": med("replacement_started_s"),
    }


def _params(width: int, layers: int) -> int:
    return layers * (width * width + width)


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    for row in result.get("recovery", {}).get("rows", []):
        n = row["trials"]
        got = row["median_s"]
        measured = (
            "no complete trial"
            if got is None
            else f"median {got:.2f} s over {row['complete']} of {n} trial(s) "
            f"(worst {row['max_s']:.2f} s)"
        )
        targets.append(
            {
                "target": f"Recovery after {row['kind']}: fault to the survivors' first "
                f"completed step at most {RECOVERY_BOUND_S:g} s",
                "met": got is not None and row["complete"] == n and got <= RECOVERY_BOUND_S,
                "measured": measured,
            }
        )
    rejoin = result.get("rejoin")
    if rejoin:
        row = rejoin["row"]
        big = rejoin["params"] >= REJOIN_MIN_PARAMS
        got = row["median_s"]
        faults = len(rejoin["faults"])
        targets.append(
            {
                "target": f"Rejoin: joiner's request to its first completed step at most "
                f"{REJOIN_BOUND_S:g} s ({REJOIN_MIN_PARAMS / 1e6:.0f} M parameters)",
                "met": big
                and got is not None
                and row["trials"] == faults
                and got <= REJOIN_BOUND_S,
                "measured": (
                    "no rejoin"
                    if got is None
                    else f"median {got:.2f} s over {row['trials']} of {faults} rejoin(s) "
                    f"(worst {row['max_s']:.2f} s), {rejoin['params'] / 1e6:.1f} M parameters"
                    + ("" if big else ": too small a model for the bound")
                ),
            }
        )
    if rejoin:
        steps = rejoin["row"].get("max_steps_waited_seen")
        targets.append(
            {
                "target": "Rejoin: the joiner trains from the step after the one in flight "
                "when its request was seen (the members complete 1 step, the one in flight "
                "when the last of them saw the request, before the joiner's first step)",
                "met": steps is not None and steps <= 1,
                "measured": "no rejoin"
                if steps is None
                else f"worst {steps} step(s) from the last member's acknowledgement "
                f"(median {rejoin['row']['median_steps_waited_seen']:g}); from the request "
                f"median {rejoin['row']['median_steps_waited']:g}, worst "
                f"{rejoin['row']['max_steps_waited']}: the request is seen within a "
                "heartbeat interval",
            }
        )
    checks = [result[p]["steps"] for p in ("recovery", "rejoin") if p in result]
    if checks:
        back = sum(len(c["went_back"]) for c in checks)
        jumped = sum(len(c["jumped"]) for c in checks)
        targets.append(
            {
                "target": "Survivors lose no step: no process's committed step count ever "
                "goes back",
                "met": back == 0,
                "measured": f"{back} time(s) back over {sum(c['processes'] for c in checks)} "
                f"process(es) ({jumped} jump(s) forward, taking over a peer's state)",
            }
        )
    big = [r for r in result.get("overhead", {}).get("rows", []) if r["params"] >= 10_000_000]
    if big:
        worst = max(big, key=lambda r: r["ratio"])
        targets.append(
            {
                "target": f"Healthy step with on_failure='shrink' at most {OVERHEAD_BOUND}x "
                "plain DDP (>= 10 M parameters)",
                "met": worst["ratio"] <= OVERHEAD_BOUND,
                "measured": f"worst {worst['ratio']:.3f} ({worst['model']})",
            }
        )
    return targets


def _fmt(x: float | None, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def measure_recovery(trials: int) -> dict[str, Any]:
    faults = [KINDS[i % len(KINDS)] for i in range(trials * len(KINDS))]
    print(
        f"recovery: {WORLD_SIZE} ranks, {RECOVERY_MODEL[0]}, faults {', '.join(faults)}",
        flush=True,
    )
    events, problems, final = run_faults(faults, RECOVERY_MODEL)
    trial_list = recovery_trials(events)
    rows = recovery_rows(trial_list, list(KINDS))
    for t in trial_list:
        print(
            f"  [{t['index'] + 1}/{len(faults)}] {t['kind']:<5} rank {t['culprit_rank']}: "
            f"last survivor's step after {_fmt(t.get('last_s'))} (detection "
            f"{_fmt(t.get('detection_s'))}, recovery_s {_fmt(t.get('recovery_s'))}, "
            f"{t.get('outcome')})",
            flush=True,
        )
    joins = rejoin_trials(events, _of(events, "fault"))
    return {
        "faults": faults,
        "model": RECOVERY_MODEL[0],
        "params": _params(RECOVERY_MODEL[1], RECOVERY_MODEL[2]),
        "rows": rows,
        "trials": trial_list,
        "rejoin_small_model": rejoin_row(joins, RECOVERY_MODEL),
        "steps": step_check(events),
        "world_size_history": final.get("world_size_history"),
        "problems": problems,
    }


def measure_rejoin(trials: int, quick: bool) -> dict[str, Any]:
    model = QUICK_REJOIN_MODEL if quick else REJOIN_MODEL
    faults = ["kill"] * trials
    params = _params(model[1], model[2])
    print(f"rejoin: {WORLD_SIZE} ranks, MLP {params / 1e6:.1f} M, {trials} kill(s)", flush=True)
    events, problems, final = run_faults(faults, model)
    trial_list = rejoin_trials(events, _of(events, "fault"))
    for t in trial_list:
        print(
            f"  [{t['index'] + 1}/{trials}] joiner: request to first step "
            f"{_fmt(t['ready_to_first_step_s'])} (init {_fmt(t['init_s'])}, admission_s "
            f"{_fmt(t['admission_s'])}); process start {_fmt(t.get('process_start_s'))}",
            flush=True,
        )
    return {
        "faults": faults,
        "model": model[0],
        "params": params,
        "batch": model[3],
        "row": rejoin_row(trial_list, model),
        "trials": trial_list,
        "recovery": recovery_rows(recovery_trials(events), ["kill"]),
        "steps": step_check(events),
        "world_size_history": final.get("world_size_history"),
        "problems": problems,
    }


def measure_overhead(quick: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "models": MODELS[:1] if quick else MODELS[:2],
        "batch": 32,
        "warmup": 2 if quick else 5,
        "rounds": 2 if quick else 7,
        "steps": 3 if quick else 5,
    }
    print(f"overhead: {OVERHEAD_WORLD_SIZE} ranks, batch {plan['batch']}", flush=True)
    per_rank = rd.spawn(
        overhead_worker, OVERHEAD_WORLD_SIZE, args=(plan,), timeout=timedelta(minutes=20)
    )
    rows = []
    for label, _, _ in plan["models"]:
        r0 = per_rank[0][label]
        rows.append({"model": label, **r0, "ratio_rank1": per_rank[1][label]["ratio"]})
        print(
            f"  {label:>4}: DDP {r0['ddp_ms']:.1f} ms, DDP+python hook {r0['pyhook_ms']:.1f} ms, "
            f"ResilientDDP (shrink) {r0['rd_ms']:.1f} ms, ratio {r0['ratio']:.3f}",
            flush=True,
        )
    return {**plan, "world_size": OVERHEAD_WORLD_SIZE, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (1 trial, 1 M models)")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument("--trials", type=int, help=f"trials per fault kind and rejoins ({TRIALS})")
    parser.add_argument("--parts", help="comma-separated subset of " + ",".join(PARTS))
    args = parser.parse_args(argv)
    out: Path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    trials = args.trials or (QUICK_TRIALS if args.quick else TRIALS)
    parts = args.parts.split(",") if args.parts else list(PARTS)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s): {', '.join(unknown)}")

    print(f"{TITLE}\nconfig: {CONFIG}", flush=True)
    load_before = _loadavg()
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    if "recovery" in parts:
        result["recovery"] = measure_recovery(trials)
    if "rejoin" in parts:
        result["rejoin"] = measure_rejoin(trials, args.quick)
    if "overhead" in parts:
        result["overhead"] = measure_overhead(args.quick)
    elapsed = time.perf_counter() - t0
    targets = evaluate_targets(result)
    problems = [
        p for part in ("recovery", "rejoin") for p in result.get(part, {}).get("problems", [])
    ]
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    print(f"total {elapsed:.1f} s")

    cmd = ["python", "benchmarks/bench_elastic.py"]
    if args.quick:
        cmd.append("--quick")
    if args.trials:
        cmd += ["--trials", str(args.trials)]
    if args.parts:
        cmd += ["--parts", args.parts]
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": _loadavg()}
    data = {
        **result_header(
            NAME, TITLE, " ".join(cmd), quick=args.quick, seconds=elapsed, machine=machine
        ),
        "setup": {
            "world_size": WORLD_SIZE,
            "config": CONFIG,
            "trials": trials,
            "first_fault_step": FIRST_FAULT_STEP,
            "gap_steps": GAP_STEPS,
            "culprit_ranks": list(CULPRITS),
            "fault_point": "after its forward pass (the other ranks are then in the "
            "gradient all-reduce)",
            "recovery_compute_s": RECOVERY_MODEL[4],
            "recovery_batch": RECOVERY_MODEL[3],
            "optimizer": "SGD(lr=1e-4, momentum=0.9)",
            "torch_threads_per_rank": 1,
        },
        **result,
        "problems": problems,
        "targets": targets,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {_display(out)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
