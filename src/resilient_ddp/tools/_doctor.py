"""The health check behind ``python -m resilient_ddp doctor``: start-up preflight, an
all_reduce probe (latency and bus bandwidth per size) and per-rank step-time skew.

Runs standalone (``--nproc N`` local ranks launched with ``rd.spawn``) or under torchrun
(every process runs the checks, rank 0 prints). Exit codes: 0 healthy (skew above the
threshold is a warning, or exit 1 with ``--strict``), 2 start-up failed (preflight), 3 a
rank failed or stalled during the probe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resilient_ddp.errors import SpawnError

EXIT_OK = 0
EXIT_WARNING = 1  # only with --strict: a warning (step-time skew) turns into a failure
EXIT_PREFLIGHT = 2
EXIT_PROBE = 3

KIB = 1024
MIB = 1024 * KIB
SIZES = (4, 64 * KIB, MIB, 16 * MIB)
QUICK_SIZES = (4, 64 * KIB, MIB)
REPEATS, QUICK_REPEATS = 20, 5
WARMUP = 2
# The step-time loop: ``LOOP_ITERS`` matmuls of ``n x n`` (CPU) or ``GPU_N x GPU_N`` (GPU),
# timed ``SKEW_REPEATS`` times on every rank; each rank's median is compared.
CPU_N, GPU_N = 256, 4096
LOOP_ITERS, QUICK_LOOP_ITERS = 100, 30
SKEW_REPEATS, QUICK_SKEW_REPEATS = 5, 3

# Columns of the ranks table (the preflight facts), in the order shown.
_FACT_COLUMNS = (
    "host",
    "pid",
    "local_rank",
    "python",
    "torch",
    "cuda",
    "nccl",
    "backend",
    "device",
    "host_free_gib",
    "gpu_free_gib",
)

# (kind, pattern matched against a problem sentence, what to do). First match wins per
# problem; every kind is shown once. ``{port}`` and ``{addr}`` are filled from the problem.
_HINT_RULES: tuple[tuple[str, str, str], ...] = (
    (
        "port_in_use",
        r"MASTER_PORT (?P<port>\d+) already in use",
        "Another process holds port {port} on rank 0's host (another job, or a previous run "
        "still exiting). Find it with `ss -ltnp 'sport = :{port}'`, or pick a free port: "
        "torchrun --master-port P (or MASTER_PORT=P).",
    ),
    (
        "master_addr",
        r"MASTER_ADDR(='(?P<addr>[^']*)')?",
        "Set MASTER_ADDR to rank 0's host name or IP address as every node sees it "
        "(torchrun --master-addr, or --rdzv-endpoint HOST:PORT with --rdzv-backend c10d). "
        "Check it on each node with `getent hosts {addr}`; on one machine use 127.0.0.1.",
    ),
    (
        "store_unreachable",
        r"store \S+ unreachable",
        "Rank 0 (or torchrun's agent) hosts the rendezvous store at MASTER_ADDR:MASTER_PORT. "
        "Check that rank 0's node started, that MASTER_ADDR is its address as seen from the "
        "failing node, and that the port is open between nodes (`nc -zv ADDR PORT` from that "
        "node; firewall, security group).",
    ),
    (
        "missing_ranks",
        r"never arrived|never attached",
        "WORLD_SIZE must equal nnodes x nproc-per-node, and every node must be started with "
        "the same --nnodes, --rdzv-id and endpoint, within --init-timeout of each other. A "
        "rank that crashed at import time never arrives either: read its log.",
    ),
    (
        "environment",
        r"\b(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_PORT|TORCHELASTIC_RESTART_COUNT)"
        r"\b.*(is not set|is not an integer|should be in)",
        "Launch with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
        "MASTER_PORT), or run `resilient-ddp doctor --nproc N` standalone. When set by hand: "
        "0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, 1 <= MASTER_PORT <= 65535.",
    ),
    (
        "version_mismatch",
        r"versions differ",
        "Install the same Python, torch, CUDA and NCCL on every node (one container image or "
        'one lock file). Compare with `python -c "import torch; print(torch.__version__, '
        'torch.version.cuda, torch.cuda.nccl.version())"` on each node.',
    ),
    (
        "shared_gpu",
        r"share one GPU",
        "Give each process its own GPU: call torch.cuda.set_device(int(os.environ"
        "['LOCAL_RANK'])) before init, keep --nproc-per-node at most the number of GPUs, and "
        "do not give every process the same CUDA_VISIBLE_DEVICES.",
    ),
    (
        "too_few_gpus",
        r"fewer GPUs than processes",
        "Start at most as many processes per node as it has GPUs (torchrun --nproc-per-node), "
        "and check what this process sees (`nvidia-smi -L`, CUDA_VISIBLE_DEVICES). On a "
        "CPU-only node use --backend gloo.",
    ),
    (
        "backend",
        r"backend \S+ not available|--backend nccl",
        "nccl needs a CUDA build of torch and a visible GPU: use --backend gloo on CPU-only "
        "nodes, or install torch's CUDA build (check `torch.cuda.is_available()`).",
    ),
    (
        "probe_failure",
        r"during the (all_reduce|step-time) probe|before the probe finished",
        "Start-up worked but a collective then failed or stalled: read the named rank's error "
        "(and its own log). Across nodes, check that the ranks' data-plane addresses reach each "
        "other on every port (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the network "
        "interface; NCCL_DEBUG=INFO shows NCCL's choice), and that no rank ran out of memory.",
    ),
    (
        "skew",
        r"step-time skew",
        "The slowest rank runs the same compute loop that much longer, and a synchronous job "
        "runs at the slowest rank's pace. Look for other processes on its host (`top`, "
        "`nvidia-smi`), CPU frequency or thermal throttling, uneven OMP_NUM_THREADS, or a GPU "
        "shared with another job.",
    ),
)
_FALLBACK_HINT = (
    "other",
    "",
    "See the Troubleshooting page of the documentation for this message.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` options to ``p``."""
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run standalone with N local ranks (default 2; without it, under torchrun, "
        "every process is one rank)",
    )
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend (gloo)"
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer, smaller probes (up to 1 MiB, 5 repeats)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument(
        "--init-timeout",
        type=float,
        default=60.0,
        help="seconds for start-up: rendezvous and preflight (60)",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=30.0,
        help="seconds before a stalled collective is diagnosed (30)",
    )
    p.add_argument(
        "--skew-threshold",
        type=float,
        default=1.5,
        help="warn when the slowest rank's step time exceeds the fastest's by this ratio (1.5)",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 instead of 0 when there is a warning"
    )


# -- what every rank runs ------------------------------------------------------------------
def _rank_main(rank: int | None, opts: dict[str, Any]) -> dict[str, Any]:
    """Init (preflight), probe, and build the report; the same on every rank.

    Args:
        rank: The rank given by ``rd.spawn`` (``None`` under torchrun: read from ``RANK``).
        opts: The command-line options, as a dict.

    Returns:
        The report (see :func:`_new_report`): the full one on every rank when the checks
        ran, else this rank's problems.
    """
    import torch

    import resilient_ddp as rd
    from resilient_ddp.group.preflight import check_environment, local_facts

    backend: str = opts["backend"]
    me = rank if rank is not None else _env_int("RANK")
    report = _new_report(opts, me)
    report["world_size"] = _env_int("WORLD_SIZE")
    cfg = rd.ResilienceConfig(
        init_timeout=timedelta(seconds=opts["init_timeout"]),
        op_timeout=timedelta(seconds=opts["op_timeout"]),
    )
    if backend == "nccl" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        if 0 <= local < torch.cuda.device_count():
            torch.cuda.set_device(local)
    try:
        rd.init_process_group(backend, config=cfg)
    except rd.PreflightError as e:
        report.update(
            exit_code=EXIT_PREFLIGHT,
            problems=list(e.problems) or [_first_line(str(e))],
            ranks=_rows(e.table),
            message=str(e),
        )
        return _finish(report)
    except Exception as e:  # noqa: BLE001 - any start-up failure is reported, not raised
        report.update(
            exit_code=EXIT_PREFLIGHT,
            problems=[f"rank {me}: init_process_group raised {type(e).__name__}: {e}"],
            message=str(e),
        )
        return _finish(report)
    stage = "all_reduce"
    try:
        report["rank"] = me = _dist_rank()
        env, _ = check_environment()
        facts = local_facts(backend, env) if env is not None else {}
        table = rd.all_gather_object(facts)
        report["world_size"] = len(table)
        report["ranks"] = _rows(dict(enumerate(table)))
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        report["all_reduce"] = _probe_all_reduce(opts, device, len(table))
        stage = "step-time"
        report["skew"] = _probe_skew(opts, device, report["ranks"])
    except Exception as e:  # noqa: BLE001 - reported (and told to the peers), not raised
        if isinstance(e, rd.ResilientDDPError):
            ranks = sorted(set(getattr(e, "ranks", ())))
            named = f", naming rank(s) {ranks}" if ranks else ""
        else:  # this rank's own failure
            ranks, named = ([me] if me is not None else []), " (this rank's own error)"
        report.update(
            exit_code=EXIT_PROBE,
            failed_ranks=ranks,
            problems=[
                f"{type(e).__name__} during the {stage} probe on rank {me}{named}: "
                f"{_first_line(str(e))}"
            ],
            message=str(e),
        )
        rd.destroy_process_group()  # with ``e`` in flight: the peers learn of it
        return _finish(report)
    rd.destroy_process_group()
    return _finish(report)


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _probe_all_reduce(opts: Mapping[str, Any], device: Any, world: int) -> list[dict[str, Any]]:
    """Time ``rd.all_reduce`` per size: every rank's median, the slowest rank reported."""
    import torch

    import resilient_ddp as rd

    sizes = QUICK_SIZES if opts["quick"] else SIZES
    repeats = QUICK_REPEATS if opts["quick"] else REPEATS
    medians: list[float] = []
    for size in sizes:
        t = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        rd.barrier()
        for _ in range(WARMUP):
            rd.all_reduce(t)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            rd.all_reduce(t)
            _sync(device)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    everyone: list[list[float]] = rd.all_gather_object(medians)
    rows = []
    factor = 2 * (world - 1) / world
    for k, size in enumerate(sizes):
        seconds = max(m[k] for m in everyone)
        nbytes = max(1, size // 4) * 4
        rows.append(
            {
                "bytes": nbytes,
                "size": _human_size(nbytes),
                "repeats": repeats,
                "latency_us": round(seconds * 1e6, 1),
                "algbw_gbps": _sig(nbytes / seconds / 1e9),
                "busbw_gbps": _sig(factor * nbytes / seconds / 1e9),
                "per_rank_latency_us": [round(m[k] * 1e6, 1) for m in everyone],
            }
        )
    return rows


def _probe_skew(
    opts: Mapping[str, Any], device: Any, ranks: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Time the same compute loop on every rank; compare the medians."""
    import torch

    import resilient_ddp as rd

    iters = QUICK_LOOP_ITERS if opts["quick"] else LOOP_ITERS
    repeats = QUICK_SKEW_REPEATS if opts["quick"] else SKEW_REPEATS
    n = GPU_N if device.type == "cuda" else CPU_N
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device) / n
    out = torch.empty_like(a)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the same work on every rank, whatever the host's cores
    try:
        times = []
        for _ in range(repeats):
            rd.barrier()  # every rank computes at the same time, as in a training step
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.mm(a, b, out=out)
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    per_rank: list[float] = rd.all_gather_object(statistics.median(times))
    slow = max(range(len(per_rank)), key=per_rank.__getitem__)
    fast = min(range(len(per_rank)), key=per_rank.__getitem__)
    hosts = [str(r.get("host", "?")) for r in ranks]
    return {
        "loop": f"{iters} x matmul {n}x{n} on {device.type}, median of {repeats}",
        "times_ms": [round(s * 1e3, 2) for s in per_rank],
        "hosts": hosts,
        "slowest_rank": slow,
        "fastest_rank": fast,
        "ratio": round(per_rank[slow] / per_rank[fast], 3) if per_rank[fast] > 0 else 0.0,
        "threshold": opts["skew_threshold"],
    }


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# -- the report ----------------------------------------------------------------------------
def _new_report(opts: Mapping[str, Any], rank: int | None) -> dict[str, Any]:
    return {
        "ok": False,
        "exit_code": EXIT_OK,
        "mode": opts["mode"],
        "backend": opts["backend"],
        "rank": rank,
        "world_size": None,
        "problems": [],
        "warnings": [],
        "ranks": [],
        "all_reduce": [],
        "skew": None,
        "hints": [],
        "failed_ranks": [],
        "message": "",
        "strict": opts["strict"],
    }


def _rows(table: Mapping[int, Mapping[str, str]]) -> list[dict[str, Any]]:
    return [{"rank": r, **dict(table[r])} for r in sorted(table)]


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    """Derive warnings, hints, the exit code and ``ok`` from what the report holds."""
    skew = report.get("skew")
    warnings: list[str] = [w for w in report["warnings"] if "step-time skew" not in w]
    if skew and skew["ratio"] > skew["threshold"]:
        s, f = skew["slowest_rank"], skew["fastest_rank"]
        warnings.append(
            f"step-time skew {skew['ratio']:.2f} is above {skew['threshold']}: rank {s} "
            f"(host {skew['hosts'][s]}) took {skew['times_ms'][s]} ms, rank {f} "
            f"(host {skew['hosts'][f]}) {skew['times_ms'][f]} ms for the same loop"
        )
    report["warnings"] = warnings
    if not report["problems"] and report["exit_code"] in (EXIT_OK, EXIT_WARNING):
        report["exit_code"] = EXIT_WARNING if warnings and report["strict"] else EXIT_OK
    report["ok"] = report["exit_code"] == EXIT_OK
    report["hints"] = hints(report["problems"] + warnings)
    return report


def hints(problems: Sequence[str]) -> list[dict[str, str]]:
    """What to do, one entry per kind of problem found in ``problems``.

    Args:
        problems: Problem (or warning) sentences, as in ``PreflightError.problems``.

    Returns:
        ``{"kind": ..., "hint": ...}`` per kind, in the order first met.
    """
    out: dict[str, str] = {}
    for problem in problems:
        for kind, pattern, text in (*_HINT_RULES, _FALLBACK_HINT):
            m = re.search(pattern, problem)
            if m is None:
                continue
            if kind not in out:
                fields = {"port": "PORT", "addr": "ADDR"}
                fields.update({k: v for k, v in m.groupdict().items() if v})
                out[kind] = text.format(**fields)
            break
    return [{"kind": k, "hint": v} for k, v in out.items()]


def _merge(reports: Sequence[dict[str, Any]], opts: Mapping[str, Any]) -> dict[str, Any]:
    """One report from the ranks' reports (standalone): rank 0's, plus what others saw."""
    if not reports:
        return _finish(_new_report(opts, None))
    base = dict(next((r for r in reports if r.get("rank") == 0), reports[0]))
    problems = list(base["problems"])
    failed = set(base["failed_ranks"])
    codes = [base["exit_code"]]
    for r in reports:
        codes.append(r["exit_code"])
        failed.update(r["failed_ranks"])
        problems += [p for p in r["problems"] if p not in problems]
        if not base["ranks"] and r["ranks"]:
            base["ranks"] = r["ranks"]
    base["problems"] = problems
    base["failed_ranks"] = sorted(failed)
    # Start-up failures come first: a rank that crashed after a failed preflight is a
    # consequence, not a second cause.
    base["exit_code"] = next((c for c in (EXIT_PREFLIGHT, EXIT_PROBE) if c in codes), codes[0])
    return _finish(base)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (a 4 B all_reduce is ~1e-5 GB/s)."""
    return float(f"{x:.{digits}g}")


def _plural(n: object, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _human_size(nbytes: int) -> str:
    if nbytes >= MIB:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


# -- output --------------------------------------------------------------------------------
def to_json(report: Mapping[str, Any]) -> str:
    """The report as the JSON document that ``--json`` prints."""
    keys = [
        *("ok", "exit_code", "mode", "backend", "world_size", "problems", "warnings"),
        *("ranks", "all_reduce", "skew", "hints", "failed_ranks", "message"),
    ]
    return json.dumps({k: report.get(k) for k in keys}, indent=2)


def format_report(report: Mapping[str, Any], version: str) -> str:
    """The readable report: header, ranks, all_reduce, skew, problems, hints and verdict."""
    world = report.get("world_size") or len(report["ranks"]) or "?"
    mode = (
        f"standalone, {_plural(world, 'local rank')}"
        if report["mode"] == "standalone"
        else f"under torchrun, {_plural(world, 'rank')}"
    )
    lines = [f"resilient_ddp {version} doctor: {report['backend']}, {mode}", ""]
    lines.append("Ranks (preflight facts)")
    if report["ranks"]:
        lines.append(_table(["rank", *_FACT_COLUMNS], [
            [str(r["rank"]), *(str(r.get(c, "")) for c in _FACT_COLUMNS)]
            for r in report["ranks"]
        ]))  # fmt: skip
    else:
        lines.append("    (none: the ranks stopped before exchanging their facts)")
    lines.append("")
    rows = report["all_reduce"]
    lines.append(
        "all_reduce (slowest rank's median"
        + (f" of {rows[0]['repeats']}" if rows else "")
        + "; busbw = 2(W-1)/W x size / time)"
    )
    if rows:
        lines.append(_table(
            ["size", "latency (us)", "algbw (GB/s)", "busbw (GB/s)"],
            [[r["size"], f"{r['latency_us']:.1f}", f"{r['algbw_gbps']:.4g}",
              f"{r['busbw_gbps']:.4g}"] for r in rows],
            right=True,
        ))  # fmt: skip
    else:
        lines.append("    (not run)")
    lines.append("")
    skew = report["skew"]
    lines.append("Step-time skew" + (f" ({skew['loop']})" if skew else ""))
    if skew:
        lines.append(_table(
            ["rank", "host", "time (ms)"],
            [[str(r), h, f"{t:.2f}"]
             for r, (h, t) in enumerate(zip(skew["hosts"], skew["times_ms"], strict=True))],
        ))  # fmt: skip
        lines.append(
            f"    slowest/fastest: {skew['ratio']:.2f} (rank {skew['slowest_rank']} / rank "
            f"{skew['fastest_rank']}); threshold {skew['threshold']}"
        )
    else:
        lines.append("    (not run)")
    lines.append("")
    if report["problems"]:
        lines.append("Problems")
        lines += [f"  - {p}" for p in report["problems"]]
        lines.append("")
    if report["warnings"]:
        lines.append("Warnings")
        lines += [f"  - {w}" for w in report["warnings"]]
        lines.append("")
    if report["exit_code"] == EXIT_PROBE and report.get("message"):
        lines.append(f"What rank {report['rank']} raised:")
        lines += ["  | " + line for line in str(report["message"]).splitlines()]
        lines.append("")
    for h in report["hints"]:
        lines.append(f"HINT ({h['kind']}): {h['hint']}")
    if report["hints"]:
        lines.append("")
    lines.append("Verdict: " + _verdict(report))
    return "\n".join(lines)


def _verdict(report: Mapping[str, Any]) -> str:
    code = report["exit_code"]
    if code == EXIT_PREFLIGHT:
        return f"FAILED at start-up (exit {code}): {len(report['problems'])} problem(s) above."
    if code == EXIT_PROBE:
        return (
            f"FAILED during the probe (exit {code}): rank(s) {report['failed_ranks']} "
            "failed or stalled."
        )
    world = report.get("world_size") or len(report["ranks"])
    rows = report["all_reduce"]
    big = rows[-1] if rows else None
    text = f"{_plural(world, 'rank')} passed the preflight"
    if big:
        text += f"; all_reduce works up to {big['size']} ({big['busbw_gbps']:.4g} GB/s busbw)"
    if report["skew"]:
        text += f"; step-time skew {report['skew']['ratio']:.2f}"
    if report["warnings"]:
        head = f"WARNING (exit {code})" if code else "OK with warnings"
        return f"{head}: {text}; {len(report['warnings'])} warning(s) above."
    return f"OK: {text}."


def _table(header: list[str], rows: list[list[str]], *, right: bool = False) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        just = [c.rjust(w) if right else c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        return ("    " + "  ".join(just)).rstrip()

    return "\n".join(line(r) for r in [header, *rows])


# -- entry point ---------------------------------------------------------------------------
def under_torchrun(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to run as one rank of a torchrun job: ``RANK`` and ``WORLD_SIZE`` are set
    and no ``--nproc`` was given."""
    env = os.environ if environ is None else environ
    return args.nproc is None and "RANK" in env and "WORLD_SIZE" in env


def run(args: argparse.Namespace) -> int:
    """Run the doctor as the command line asked; print the report; return the exit code."""
    import resilient_ddp as rd

    torchrun = under_torchrun(args)
    opts = {
        "backend": args.backend,
        "quick": args.quick,
        "init_timeout": args.init_timeout,
        "op_timeout": args.op_timeout,
        "skew_threshold": args.skew_threshold,
        "strict": args.strict,
        "mode": "torchrun" if torchrun else "standalone",
    }
    if torchrun:
        report = _rank_main(None, opts)
        if report["rank"] not in (0, None):
            if report["exit_code"]:
                for p in report["problems"]:
                    print(f"[doctor rank {report['rank']}] {p}", file=sys.stderr)
            return int(report["exit_code"])
    else:
        report = _standalone(args, opts)
    print(to_json(report) if args.json else format_report(report, rd.__version__), flush=True)
    return int(report["exit_code"])


def _standalone(args: argparse.Namespace, opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    import resilient_ddp as rd
    from resilient_ddp.base import _timings

    nproc = 2 if args.nproc is None else args.nproc
    if nproc < 1:
        report = _new_report(opts, None)
        report.update(exit_code=EXIT_PREFLIGHT, problems=[f"--nproc {nproc} should be >= 1"])
        return _finish(report)
    if args.backend == "nccl" and not torch.cuda.is_available():
        report = _new_report(opts, None)
        report.update(
            exit_code=EXIT_PREFLIGHT,
            problems=["--backend nccl asked for, but no CUDA device is visible to this torch"],
        )
        return _finish(report)
    deadline = timedelta(seconds=_timings.doctor_run_limit(args.init_timeout, args.op_timeout))
    try:
        values = rd.spawn(
            _rank_main, nproc, args=(opts,), timeout=deadline, grace=timedelta(seconds=5)
        )
        return _merge([v for v in values if isinstance(v, dict)], opts)
    except rd.SpawnError as e:
        return _from_spawn_error(e, opts)


def _from_spawn_error(e: SpawnError, opts: dict[str, Any]) -> dict[str, Any]:
    """The report when some rank process raised, died or was killed."""
    reports = [o.value for o in e.outcomes if isinstance(o.value, dict)]
    extra = _new_report(opts, None)
    for o in e.outcomes:
        if o.ok:
            continue
        if o.exc_type and o.exc_type.endswith("PreflightError"):
            problems = list(getattr(o.exception, "problems", ()) or ())
            table = getattr(o.exception, "table", None) or {}
            extra["problems"] += problems or [_first_line(o.exc_message or "")]
            extra["ranks"] = extra["ranks"] or _rows(table)
            extra["exit_code"] = extra["exit_code"] or EXIT_PREFLIGHT
            continue
        if o.exc_type:
            what = f"raised {o.exc_type}: {_first_line(o.exc_message or '')}"
        elif o.exitcode is None:
            what = "did not exit (stuck) and was killed by the launcher"
        elif o.exitcode < 0:
            what = f"was killed by {_signal_name(-o.exitcode)}"
        else:
            what = f"exited with code {o.exitcode}"
        extra["problems"].append(f"rank {o.rank} {what} before the probe finished")
        extra["failed_ranks"].append(o.rank)
        extra["exit_code"] = extra["exit_code"] or EXIT_PROBE
    return _merge([*reports, extra], opts)
