"""The control plane as the world grows: W virtual ranks running the library's real
watchdog code (heartbeats, the watch ring, failure reports, their propagation) against
one real TCPStore, the data plane left out.

Each virtual rank is a ``Runtime`` with its own ``Watchdog`` thread and store connection,
as in a real rank; ``PROCESSES`` worker processes hold ``W / PROCESSES`` of them each, and
the store lives in a process of its own that does nothing else, so its CPU is measured
alone. Virtual ranks are placed ``PER_HOST`` to a virtual host: the pid checks a rank
makes on the peers of its own host are off (co-located virtual ranks share a pid), so
every failure is found the cross-host way, by a heartbeat that stops changing.

Per W:

1. **Healthy path** (``HEALTHY_S`` seconds): store requests per second (counted at the
   clients, in ``ControlPlane._call``), bytes read and written, the store process's CPU
   (``/proc/<pid>/stat``), and the heartbeats achieved against the nominal
   ``W / heartbeat_interval`` per second (a store or clients that cannot keep up show
   here first).
2. **A stuck rank**: every virtual rank but one enters the same collective, the one stays
   outside any; all the others time out at the same moment and run the real diagnosis
   (``_store_diagnosis.diagnose``, one thread and connection each). Measured: the time until each
   has a verdict, how many name the stuck rank, how many diagnoses ran (one is the goal:
   the others read its verdict), and the store requests and bytes per rank beyond the
   healthy path's.
3. **A dead rank**: one virtual rank's watchdog stops (its heartbeat freezes, as a killed
   host's does). Measured: the time to the first report (its ring predecessor, after
   ``heartbeat_timeout``), then the time from that report until every other virtual rank
   has it recorded (``Runtime.failures``), and the store bytes read per rank meanwhile.
4. **A rack** (W >= 32, 4 virtual hosts): every rank of two adjacent virtual hosts
   freezes at once; the time until each of them is reported.
5. **A shrink** (last: the ranks that failed in the trials before are not candidates): one
   more virtual rank is killed (its watchdog stops and a peer of its virtual host reports
   it dead, as the pid check does). Each other virtual rank, once its watchdog has
   recorded the report (when a real rank's collective fails), runs the library's real
   agreement (``elastic._agree``, a thread and its own connection each, with
   ``on_failure="shrink"``'s proposal: the data plane and the rebuild of the group are left
   out). Measured: the time from the report until each rank has the decision, how many
   ranks agree on it, how many read the round's whole proposal log (one is the goal: the
   others wait for its decider's decision), the bytes each rank read from the decision
   key (the lost ranks, not the members: each derives those from its own member list),
   and each rank's store requests and bytes.

What a simulation on 2 cores can say: the store's load, in requests and bytes, and how
it grows with W are the library's, whatever the machine; the CPU a TCPStore needs per
request is this machine's. What it cannot say: the network (all of it is loopback), and
the clients' CPU, which here share 2 cores with the store, while in a job each rank has
its own.

Usage::

    python benchmarks/bench_control_plane.py                 # W = 16 .. 1024, ~6 minutes
    python benchmarks/bench_control_plane.py --worlds 4096   # one W
    python benchmarks/bench_control_plane.py --quick         # W = 16 and 64, short phases
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_collectives import _loadavg, result_header, write_result  # noqa: E402 - one for all

NAME = "control_plane"
TITLE = "The control plane as the world grows (simulated ranks, one TCPStore)"
DEFAULT_OUT = HERE / "results" / f"{NAME}.json"
QUICK_OUT = HERE / "results" / "quick" / f"{NAME}.json"
WORLDS = (16, 64, 256, 1024)
QUICK_WORLDS = (16, 64)
PROCESSES = 2  # worker processes holding the virtual ranks (the machine has 2 cores)
PER_HOST = 8  # virtual ranks per virtual host
INTERVAL_S = 0.5  # heartbeat_interval: the library's default
TIMEOUT_S = 3.0  # heartbeat_timeout (default 15 s): shorter, so that a trial is short
HEALTHY_S = 10.0
QUICK_HEALTHY_S = 3.0
SPREAD_CAP_S = 30.0  # a report not everywhere after this long counts as not propagated
SHRINK_STEP = 100  # the steps every virtual rank has committed when the shrink trial starts


def _config() -> Any:
    import resilient_ddp as rd

    return rd.ResilienceConfig(
        heartbeat_interval=timedelta(seconds=INTERVAL_S),
        heartbeat_timeout=timedelta(seconds=TIMEOUT_S),
        # Rank 0's straggler check reads every state: not part of the path measured.
        straggler_interval=timedelta(hours=1),
    )


# -- the store process --------------------------------------------------------------------------
def serve(port_q: Any, stop: Any) -> None:
    """Host the store (loopback) until ``stop`` is set; do nothing else."""
    from resilient_ddp.control import _control as ctl

    store = ctl.serve_store("127.0.0.1")
    port_q.put((os.getpid(), store.port))
    stop.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- a worker process: its share of the virtual ranks -------------------------------------------
class _Counts:
    """Store requests and bytes, per thread name, counted in ``ControlPlane._call``: per
    thread ``[requests, bytes read, bytes written, shrink logs read, their bytes, shrink
    decisions read, their bytes]``."""

    def __init__(self) -> None:
        self.by_thread: dict[str, list[int]] = collections.defaultdict(lambda: [0] * 7)
        self.lock = threading.Lock()

    def total(self) -> list[int]:
        with self.lock:
            rows = list(self.by_thread.values())
        return [sum(r[i] for r in rows) for i in range(3)]


def _is_decision(key: str) -> bool:
    """Whether ``key`` is a decision slot of a shrink round: ``rec/g<N>/r<k>/d`` or
    ``rec/g<N>/r<k>/d/<i>``."""
    parts = key.split("/")
    return len(parts) in (4, 5) and parts[0] == "rec" and parts[3] == "d"


def _count_calls(counts: _Counts) -> None:
    from resilient_ddp.control import _control as ctl

    original = ctl.ControlPlane._call

    def counting(fn: Any, *args: Any) -> Any:
        result = original(fn, *args)
        name = getattr(fn, "__name__", "")
        if name == "set_timeout":
            return result  # local to the client
        got = put = logs = decisions = 0
        if name == "get":
            got = len(result)
            key = str(args[0])
            # A whole proposal log of a shrink round (rec/g<N>/r<k>/log), or one of its
            # decision slots (rec/g<N>/r<k>/d, .../d/<i>).
            logs = int(key.startswith("rec/") and key.endswith("/log"))
            decisions = int(_is_decision(key))
        elif name == "multi_get":
            got = sum(len(v) for v in result)
        elif name in ("set", "append", "compare_set") and len(args) >= 2:
            put = len(args[-1])
        with counts.lock:
            row = counts.by_thread[threading.current_thread().name]
            row[0] += 1
            row[1] += got
            row[2] += put
            row[3] += logs
            row[4] += got * logs
            row[5] += decisions
            row[6] += got * decisions
        return result

    ctl.ControlPlane._call = staticmethod(counting)  # type: ignore[method-assign]


def worker(port: int, ranks: list[int], world: int, cmd_q: Any, out_q: Any) -> None:
    """Start virtual ranks ``ranks`` of ``world``, then answer the parent's commands."""
    import torch.distributed as dist

    from resilient_ddp.control import _control as ctl
    from resilient_ddp.detection.watchdog import Watchdog
    from resilient_ddp.runtime import _runtime
    from resilient_ddp.runtime._runtime import Runtime

    _runtime.arm_exit_guard = lambda: None  # a recorded failure must not end this process
    ctl.serves_port = lambda port: False  # type: ignore[assignment] - no rank hosts it
    counts = _Counts()
    _count_calls(counts)
    cfg = _config()
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    root = ctl.root_prefix(base, "bench", "secret")
    rts: dict[int, Any] = {}
    # Called after a virtual rank's watchdog records events (the shrink trial's trigger).
    listeners: dict[int, Any] = {}
    for r in ranks:
        rt = Runtime(rank=r, world_size=world, backend="gloo", control_root=root, config=cfg)
        # Another (virtual) host's process for the pid checks: none made.
        rt.identity.update(host=f"vh{r // PER_HOST}", start=None, hosts_store=False)
        rt.control.publish_info(r, rt.identity)
        rts[r] = rt
    if 0 in rts:
        rts[0].control.init_counters()
    for rt in rts.values():
        rt.control.publish_state(rt.rank, rt.snapshot(0))
    base.add("bench/ready", len(ranks))
    while int(base.add("bench/ready", 0)) < world:
        time.sleep(0.05)
    first = next(iter(rts.values()))
    infos = first.control.read_infos(list(range(world)))
    detected: dict[int, float] = {}
    for rt in rts.values():
        rt.infos = infos
        record = rt.record_events

        def wrapped(events: Any, rt: Any = rt, record: Any = record) -> None:
            record(events)
            if rt.failures and rt.rank not in detected:
                detected[rt.rank] = time.time()
            listener = listeners.get(rt.rank)
            if listener is not None:
                listener()

        rt.record_events = wrapped
        rt.watchdog = Watchdog(rt)  # connects: seconds for many ranks
        rt.connection("main")  # the main thread's own, as a real rank has (stuck trial)
    # Every process's watchdogs start together: a peer whose heartbeats begin seconds
    # later would look dead.
    base.add("bench/armed", len(ranks))
    while int(base.add("bench/armed", 0)) < world:
        time.sleep(0.01)
    for rt in rts.values():
        rt.control.publish_state(rt.rank, rt.snapshot(0))
        rt.watchdog.start()
    out_q.put(("started", os.getpid(), len(ranks)))
    _commands(cmd_q, out_q, base, rts, world, counts, detected, listeners)


def _commands(
    cmd_q: Any,
    out_q: Any,
    base: Any,
    rts: dict[int, Any],
    world: int,
    counts: _Counts,
    detected: dict[int, float],
    listeners: dict[int, Any],
) -> None:
    """Answer the parent's commands until it sends None, then stop the virtual ranks."""
    for cmd, arg in iter(cmd_q.get, None):
        if cmd == "stuck":
            out_q.put(("stuck", os.getpid(), _stuck(base, rts, world, arg, counts)))
        elif cmd == "shrink":
            out_q.put(("shrink", os.getpid(), _shrink(base, rts, world, arg, counts, listeners)))
        elif cmd == "kill" and arg in rts:
            t = time.time()
            rts[arg].watchdog.stop(timeout=5.0)
            out_q.put(("killed", arg, t))
        elif cmd == "kill_many":
            # Every watchdog of the list freezes at once, as two hosts losing power do.
            mine = [rts[r].watchdog for r in arg if r in rts]
            t = time.time()
            for w in mine:
                w._stop_event.set()
                w._wake.set()
            for w in mine:
                w.join(5.0)
            out_q.put(("killed_many", os.getpid(), t))
        elif cmd == "report":
            out_q.put(("report", os.getpid(), _report(rts, counts, detected)))
    for rt in rts.values():
        rt.watchdog.stop(timeout=1.0)
    base.add("bench/done", 1)


def _report(rts: dict[int, Any], counts: _Counts, detected: dict[int, float]) -> dict[str, Any]:
    return {
        "counts": counts.total(),
        "beats": sum(rt.watchdog._beat for rt in rts.values()),
        "detected": dict(detected),
        "first_report": {
            r: min(ev.t for ev in rt.failures) for r, rt in rts.items() if rt.failures
        },
        "threads": threading.active_count(),
        # The first report naming each failed rank, on any rank of this process.
        "reported": _first_reports(rts),
    }


def _first_reports(rts: dict[int, Any]) -> dict[int, float]:
    from resilient_ddp.control import _control as ctl

    first: dict[int, float] = {}
    for rt in rts.values():
        for ev in list(rt.failures):
            r, t = ev.rank, ev.t
            if ev.kind != ctl.EV_TIMEOUT and (r not in first or t < first[r]):
                first[r] = t
    return first


def _stuck(base: Any, rts: dict[int, Any], world: int, victim: int, counts: _Counts) -> Any:
    """Every virtual rank but ``victim`` enters all_reduce#1; ``victim`` stays outside any
    collective. Once every heartbeat shows it, all of them time out at the same moment and
    run ``_store_diagnosis.diagnose``, each in a thread of its own over its own connection,
    as the real op path does. Returns each one's seconds to its verdict and the ranks it
    names."""
    from resilient_ddp.detection import _store_diagnosis

    for rt in rts.values():
        if rt.rank != victim:
            rt.begin_op("all_reduce")
    time.sleep(2 * INTERVAL_S + 0.1)  # every state published
    before = counts.total()
    base.add("bench/stuck_ready", len(rts))
    while int(base.add("bench/stuck_ready", 0)) < world:
        time.sleep(0.005)
    verdicts: dict[int, tuple[float, list[int]]] = {}
    t0 = time.time()

    def one(rt: Any) -> None:
        culprits = _store_diagnosis.diagnose(rt, rt.connection("main"), "all_reduce", 1)
        verdicts[rt.rank] = (time.time() - t0, sorted(int(c["rank"]) for c in culprits))

    threads = [
        threading.Thread(target=one, args=(rt,), name=f"diagnose-{r}")
        for r, rt in rts.items()
        if r != victim
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = counts.total()
    first = next(iter(rts.values()))
    return {
        "verdicts": verdicts,
        "requests": after[0] - before[0],
        "read_bytes": after[1] - before[1],
        "window_s": time.time() - t0,
        "diagnoses": int(first.control.store.add("diag", 0)),
    }


class _Agreeing:
    """A virtual rank's ``Runtime`` as ``elastic._agree`` uses it, over the rank's own
    ``"main"`` connection (in a process of the virtual ranks, ``control_root`` is one
    connection for all of them; a real rank's main thread has its own)."""

    def __init__(self, rt: Any, root: Any) -> None:
        self._rt = rt
        self.control_root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


def _shrink(  # noqa: PLR0915 - one simulated shrink, step by step
    base: Any,
    rts: dict[int, Any],
    world: int,
    arg: dict[str, Any],
    counts: _Counts,
    listeners: dict[int, Any],
) -> dict[str, Any]:
    """Kill virtual rank ``arg["victim"]`` (if this process holds it: its watchdog stops,
    and a peer of its virtual host reports it dead); every other candidate of this process
    runs ``elastic._agree`` in a thread of its own once its watchdog has recorded the
    report. Returns the report's time, each rank's times of entry and decision and its
    decision, and each agreeing thread's store counts."""
    from types import SimpleNamespace

    from resilient_ddp.control import _control as ctl
    from resilient_ddp.errors import Culprit
    from resilient_ddp.training import elastic

    victim, excluded = int(arg["victim"]), set(arg["excluded"])
    candidates = [r for r in range(world) if r not in excluded]
    survivors = [r for r in candidates if r != victim and r in rts]
    round_key = "rec/g0/r0"
    results: dict[int, Any] = {}
    errors: list[str] = []

    def one(rt: Any, failed: threading.Event) -> None:
        failed.wait(60)  # this rank learns of the failure: its collective fails
        t_in = time.time()
        el = SimpleNamespace(uid=rt.rank, committed=SHRINK_STEP, members=list(range(world)))
        try:
            dec = elastic._agree(
                _Agreeing(rt, rt.connection("main").root),
                el,
                round_key,
                candidates,
                "reduce",
                True,
                (0, world),
            )
        except Exception as e:  # noqa: BLE001 - reported in the row, never silent
            errors.append(f"rank {rt.rank}: {type(e).__name__}: {e}")
            return
        members = list(dec.members) if dec.fail is None else None
        results[rt.rank] = (t_in, time.time(), dec.gen, members)

    threads = []
    for r in survivors:
        rt, failed = rts[r], threading.Event()

        def listener(rt: Any = rt, failed: threading.Event = failed) -> None:
            if any(ev.rank == victim for ev in list(rt.failures)):
                failed.set()

        listeners[r] = listener
        threads.append(threading.Thread(target=one, args=(rt, failed), name=f"shrink-{r}"))
    for t in threads:
        t.start()
    if victim in rts:
        rts[victim].watchdog.stop(timeout=5.0)  # killed: its heartbeat stops
    before, t_before = counts.total(), time.time()
    base.add("bench/shrink_ready", len(rts))
    while int(base.add("bench/shrink_ready", 0)) < world:
        time.sleep(0.005)
    t_report = None
    if victim in rts:
        # A peer on the victim's virtual host reports it, as its pid check would.
        host = victim // PER_HOST
        peer = next(r for r in rts if r != victim and r // PER_HOST == host)
        control = rts[peer].control
        t_report = time.time()
        if control.claim(victim):
            culprit = Culprit.record(
                victim, "died (simulated kill)", info=rts[peer].infos.get(victim)
            )
            event = {"kind": ctl.EV_CRASH, "rank": victim, "reporter": peer, "gen": 0}
            control.post_events([{**event, "t": t_report, "culprit": culprit}])
        rts[peer].watchdog.poke()
    for t in threads:
        t.join(120)
    listeners.clear()
    after = counts.total()
    with counts.lock:
        per_thread = {r: list(counts.by_thread[f"shrink-{r}"]) for r in survivors}
    return {
        "t_report": t_report,
        "results": results,
        "errors": errors,
        "counts": per_thread,
        "requests": after[0] - before[0],
        "read_bytes": after[1] - before[1],
        "window_s": time.time() - t_before,
    }


# -- the parent -----------------------------------------------------------------------------------
def _ask(cmd_qs: list[Any], out_q: Any, cmd: str, arg: Any, reply: str, replies: int) -> list[Any]:
    """Send ``(cmd, arg)`` to every worker; the payloads of the first ``replies`` answers
    of kind ``reply`` (each answer is ``(kind, sender, payload)``)."""
    for q in cmd_qs:
        q.put((cmd, arg))
    got = []
    while len(got) < replies:
        kind, *rest = out_q.get(timeout=120)
        if kind == reply:
            got.append(rest[1])
    return got


def _reports(cmd_qs: list[Any], out_q: Any) -> list[dict[str, Any]]:
    return _ask(cmd_qs, out_q, "report", None, "report", len(cmd_qs))


def _sum(reports: list[dict[str, Any]], i: int) -> int:
    return sum(int(r["counts"][i]) for r in reports)


def _healthy(
    cmd_qs: list[Any], out_q: Any, server_pid: int, world: int, healthy_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The healthy path's figures, and the workers' reports at its end."""
    before, cpu0, t0 = _reports(cmd_qs, out_q), _cpu_s(server_pid), time.monotonic()
    time.sleep(healthy_s)
    after, cpu1, t1 = _reports(cmd_qs, out_q), _cpu_s(server_pid), time.monotonic()
    span = t1 - t0
    requests = _sum(after, 0) - _sum(before, 0)
    beats = sum(r["beats"] for r in after) - sum(r["beats"] for r in before)
    healthy = {
        # Failures recorded by then: a healthy path must have none.
        "false_reports": sum(len(r["detected"]) for r in after),
        "seconds": round(span, 2),
        "requests_per_s": round(requests / span, 1),
        "requests_per_rank_per_s": round(requests / span / world, 3),
        "read_bytes_per_s": round((_sum(after, 1) - _sum(before, 1)) / span),
        "written_bytes_per_s": round((_sum(after, 2) - _sum(before, 2)) / span),
        "store_cpu_fraction": round((cpu1 - cpu0) / span, 3),
        "store_cpu_us_per_request": round((cpu1 - cpu0) / max(requests, 1) * 1e6, 1),
        "beats_achieved_fraction": round(beats / (world * span / INTERVAL_S), 3),
    }
    return healthy, after


def _stuck_trial(
    cmd_qs: list[Any], out_q: Any, world: int, healthy: dict[str, Any]
) -> dict[str, Any]:
    """One virtual rank stuck outside the collective the others wait in: the time until
    every survivor has a verdict naming it, and the store traffic of the diagnosis beyond
    the healthy path's."""
    victim = world // 4 + 1
    got = _ask(cmd_qs, out_q, "stuck", victim, "stuck", len(cmd_qs))
    verdicts = {int(r): v for g in got for r, v in g["verdicts"].items()}
    times = sorted(float(v[0]) for v in verdicts.values())
    right = sum(1 for v in verdicts.values() if list(v[1]) == [victim])
    window = max(float(g["window_s"]) for g in got)
    extra = sum(int(g["requests"]) for g in got) - healthy["requests_per_s"] * window
    extra_read = sum(int(g["read_bytes"]) for g in got) - healthy["read_bytes_per_s"] * window
    return {
        "victim": victim,
        "named_by": right,
        "of": world - 1,
        "verdict_median_s": round(statistics.median(times), 3) if times else None,
        "verdict_max_s": round(times[-1], 3) if times else None,
        "diagnoses": max(int(g["diagnoses"]) for g in got),
        "requests_per_rank": round(extra / world, 2),
        "read_bytes_per_rank": round(extra_read / world),
    }


def _dead(
    cmd_qs: list[Any],
    out_q: Any,
    world: int,
    after: list[dict[str, Any]],
    read_rate: float,
) -> dict[str, Any]:
    """Stop one virtual rank's watchdog (in the middle of a virtual host): how its failure
    is reported and spreads; ``read_rate`` is the healthy path's bytes read per second."""
    victim = world // 2 + 1
    reads0, t_reads0 = _sum(after, 1), time.monotonic()
    # Only the worker holding the victim answers.
    (t_kill,) = _ask(cmd_qs, out_q, "kill", victim, "killed", 1)
    deadline = time.monotonic() + TIMEOUT_S + SPREAD_CAP_S
    while True:
        time.sleep(0.5)
        reps = _reports(cmd_qs, out_q)
        detected = {int(r): t for rep in reps for r, t in rep["detected"].items()}
        if len(detected) >= world - 1 or time.monotonic() > deadline:
            break
    firsts = [t for rep in reps for t in rep["first_report"].values()]
    first = min(firsts) if firsts else None
    latencies = sorted(t - t_kill for r, t in detected.items() if r != victim)
    return {
        "victim": victim,
        "detected_by": len(latencies),
        "of": world - 1,
        "first_report_s": round(first - t_kill, 3) if first else None,
        "spread_median_s": round(statistics.median(latencies) - (first - t_kill), 3)
        if latencies and first
        else None,
        "spread_max_s": round(latencies[-1] - (first - t_kill), 3) if latencies and first else None,
        "all_known_s": round(latencies[-1], 3) if len(latencies) == world - 1 else None,
        # Beyond what the healthy path reads in the same time.
        "read_bytes_per_rank": round(
            (_sum(reps, 1) - reads0 - read_rate * (time.monotonic() - t_reads0)) / world
        ),
        "threads_per_process": max(rep["threads"] for rep in reps),
    }


def _rack(cmd_qs: list[Any], out_q: Any, world: int, dead_victim: int) -> dict[str, Any] | None:
    """Two adjacent virtual hosts fail together (every watchdog on them freezes at once):
    how long until each of their ranks is reported, against ``heartbeat_timeout``. The
    watchers of a host sit on the hosts before it, so a pattern that watches a host only
    from the host before it misses the second host."""
    hosts = world // PER_HOST
    if hosts < 4:  # two failed hosts, the dead trial's, and one more
        return None
    h = (3 * hosts) // 4
    if dead_victim // PER_HOST in (h, h + 1):
        h = 1
    victims = list(range(h * PER_HOST, (h + 2) * PER_HOST))
    t_kill = min(_ask(cmd_qs, out_q, "kill_many", victims, "killed_many", len(cmd_qs)))
    deadline = time.monotonic() + 3 * TIMEOUT_S + SPREAD_CAP_S
    while True:
        time.sleep(0.5)
        reps = _reports(cmd_qs, out_q)
        first: dict[int, float] = {}
        for rep in reps:
            for r, t in rep["reported"].items():
                if int(r) in victims and (int(r) not in first or t < first[int(r)]):
                    first[int(r)] = t
        if len(first) == len(victims) or time.monotonic() > deadline:
            break
    late = sorted(t - t_kill for t in first.values())
    return {
        "hosts": [h, h + 1],
        "victims": len(victims),
        "reported": len(first),
        "first_s": round(late[0], 3) if late else None,
        "last_s": round(late[-1], 3) if len(late) == len(victims) else None,
    }


def _shrink_trial(
    cmd_qs: list[Any], out_q: Any, world: int, excluded: list[int], healthy: dict[str, Any]
) -> dict[str, Any]:
    """One more virtual rank killed, the others agreeing on the next generation without it
    (``excluded``: the ranks that failed in the trials before, not candidates)."""
    victim = next(r for r in range(world // 4 + 2, world) if r not in excluded)
    arg = {"victim": victim, "excluded": excluded}
    got = _ask(cmd_qs, out_q, "shrink", arg, "shrink", len(cmd_qs))
    t_report = next(float(g["t_report"]) for g in got if g["t_report"] is not None)
    results = {int(r): v for g in got for r, v in g["results"].items()}
    errors = [e for g in got for e in g["errors"]]
    counts = [c for g in got for c in g["counts"].values()]
    decided = sorted(float(v[1]) - t_report for v in results.values())
    entered = sorted(float(v[0]) - t_report for v in results.values())
    decisions = collections.Counter(json.dumps([v[2], v[3]]) for v in results.values())
    common, agree = decisions.most_common(1)[0] if decisions else ("[null, []]", 0)
    members = json.loads(common)[1] or []
    readers = [c for c in counts if c[3]]
    survivors = world - len(excluded) - 1
    window = max(float(g["window_s"]) for g in got)
    extra = sum(int(g["requests"]) for g in got) - healthy["requests_per_s"] * window
    extra_read = sum(int(g["read_bytes"]) for g in got) - healthy["read_bytes_per_s"] * window
    return {
        "victim": victim,
        "candidates": world - len(excluded),
        "decided": len(results),
        "of": survivors,
        "errors": errors[:5],
        "agree": agree,
        "members": len(members),
        "victim_removed": victim not in members,
        # From the report: the last survivor to learn of it (and propose), and the
        # decision on each rank; from the last proposal to the last rank's decision.
        "entered_max_s": round(entered[-1], 3) if entered else None,
        "decided_median_s": round(statistics.median(decided), 3) if decided else None,
        "decided_max_s": round(decided[-1], 3) if decided else None,
        "after_last_entry_s": round(decided[-1] - entered[-1], 3) if decided else None,
        "log_readers": len(readers),
        "log_reads": sum(c[3] for c in counts),
        "log_bytes": max((c[4] // max(c[3], 1) for c in readers), default=0),
        # The decision as stored (sealed) and what the survivors read of it, per survivor.
        "decision_bytes": max((c[6] // max(c[5], 1) for c in counts), default=0),
        "decision_read_bytes_per_rank": round(sum(c[6] for c in counts) / max(survivors, 1)),
        # The agreeing threads' own requests and bytes, per survivor ...
        "requests_per_rank": round(sum(c[0] for c in counts) / max(survivors, 1), 2),
        "read_bytes_per_rank": round(sum(c[1] for c in counts) / max(survivors, 1)),
        "max_requests_one_rank": max((c[0] for c in counts), default=0),
        # ... and of every thread (watchdogs poked by the agreement too), per rank, beyond
        # the healthy path's in the same time.
        "all_requests_per_rank": round(extra / world, 2),
        "all_read_bytes_per_rank": round(extra_read / world),
    }


def measure(world: int, healthy_s: float) -> dict[str, Any]:
    """One W: the healthy path, a stuck rank, a dead rank, a rack, then a shrink."""
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(port_q, stop), daemon=True)
    server.start()
    server_pid, port = port_q.get(timeout=60)
    out_q = ctx.Queue()
    shares = [list(range(world))[i::PROCESSES] for i in range(PROCESSES)]
    cmd_qs = [ctx.Queue() for _ in shares]
    procs = [
        ctx.Process(target=worker, args=(port, share, world, q, out_q), daemon=True)
        for share, q in zip(shares, cmd_qs, strict=True)
    ]
    t_start = time.monotonic()
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, *_rest = out_q.get(timeout=600)
            assert kind == "started", kind
        started_s = time.monotonic() - t_start
        time.sleep(2 * INTERVAL_S)  # every watchdog has ticked
        healthy, _ = _healthy(cmd_qs, out_q, server_pid, world, healthy_s)
        stuck = _stuck_trial(cmd_qs, out_q, world, healthy)
        after = _reports(cmd_qs, out_q)
        dead = _dead(cmd_qs, out_q, world, after, healthy["read_bytes_per_s"])
        rack = _rack(cmd_qs, out_q, world, dead["victim"])
        excluded = [dead["victim"]]
        if rack:
            h = rack["hosts"][0]
            excluded += list(range(h * PER_HOST, (h + 2) * PER_HOST))
        shrink = _shrink_trial(cmd_qs, out_q, world, excluded, healthy)
        return {
            "world": world,
            "start_s": round(started_s, 1),
            "healthy": healthy,
            "stuck": stuck,
            "dead": dead,
            **({"rack": rack} if rack else {}),
            "shrink": shrink,
        }
    finally:
        for q in cmd_qs:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (W = 16, 64)")
    parser.add_argument("--worlds", type=int, nargs="+", help=f"the W to run ({WORLDS})")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    args = parser.parse_args(argv)
    worlds = args.worlds or (QUICK_WORLDS if args.quick else WORLDS)
    healthy_s = QUICK_HEALTHY_S if args.quick else HEALTHY_S
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    load_before = _loadavg()
    t0 = time.perf_counter()
    rows = []
    print(TITLE, flush=True)
    for w in worlds:
        row = measure(w, healthy_s)
        print(json.dumps(row), flush=True)
        rows.append(row)
    command = "python benchmarks/bench_control_plane.py" + (" --quick" if args.quick else "")
    if args.worlds:
        command += " --worlds " + " ".join(map(str, args.worlds))
    result = {
        **result_header(NAME, TITLE, command, quick=args.quick, seconds=time.perf_counter() - t0),
        "load_before": load_before,
        "load_after": _loadavg(),
        "plan": {
            "processes": PROCESSES,
            "per_host": PER_HOST,
            "heartbeat_interval_s": INTERVAL_S,
            "heartbeat_timeout_s": TIMEOUT_S,
            "healthy_s": healthy_s,
        },
        "rows": rows,
    }
    write_result(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
