"""The demo behind ``python -m resilient_ddp demo``: train on local gloo ranks, inject a
fault, and show what every rank saw and how fast it knew. With ``--elastic`` the ranks
train with ``on_failure="shrink"``: the survivors go on without the failed rank, a
replacement process joins, and the run ends with a summary.

Steps are numbered as ResilientDDP numbers them (see its "Steps"): from 0, step ``N``
being the one that runs after ``N`` completed steps. ``--step``, the progress lines, the
culprit's ``[step N, ...]`` in the errors and the ``--elastic`` summary all use that number.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    import resilient_ddp as rd
    from resilient_ddp.errors import RankOutcome

FAULTS = ("kill", "raise", "hang", "stop", "none")
WHAT = {
    "kill": "killed with SIGKILL (like the OOM killer)",
    "raise": "raises an exception",
    "hang": "hangs in its data loader",
    "stop": "is frozen with SIGSTOP",
    "none": "",
}
# --step and --steps without --elastic, and with it.
DEFAULT_STEP = (5, 20)
DEFAULT_STEPS = (12, 70)
ELASTIC_SAMPLES = 512  # the data set of --elastic, shared by all ranks
ELASTIC_BATCH = 8  # samples per rank and step
OUTCOMES = {"redo": "redone over the survivors", "skip": "skipped", "continue": "kept"}
MAX_STEPS_FACTOR = 3  # --elastic trains this many times --steps at most, waiting for a join
MIN_ELASTIC_NPROC = 3  # a survivor alone is below min_world_size=2
ELASTIC_FAULTS = ("kill", "raise", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the demo's options to a parser.

    Args:
        p: The ``demo`` subcommand's parser.
    """
    p.add_argument("--nproc", type=int, default=4, help="number of local gloo ranks (4)")
    p.add_argument(
        "--fault",
        choices=FAULTS,
        default="kill",
        help="what to inject (kill); kill, raise or none with --elastic",
    )
    p.add_argument("--rank", type=int, default=2, help="the rank that fails (2)")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help=f"the step in which it fails, counted from 0 ({DEFAULT_STEP[0]}; "
        f"{DEFAULT_STEP[1]} with --elastic)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps ({DEFAULT_STEPS[0]}; {DEFAULT_STEPS[1]} with --elastic)",
    )
    p.add_argument(
        "--op-timeout", type=float, default=3.0, help="seconds before a stall is diagnosed (3)"
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help='train with on_failure="shrink" and spawn(restarts=1): the others go on and a '
        "replacement joins",
    )


# -- shared by both demos --------------------------------------------------------------------
def _config(args: dict[str, Any], **extra: Any) -> rd.ResilienceConfig:
    import resilient_ddp as rd

    return rd.ResilienceConfig(
        op_timeout=timedelta(seconds=args["op_timeout"]),
        heartbeat_interval=timedelta(milliseconds=250),
        heartbeat_timeout=timedelta(seconds=5),
        **extra,
    )


def _net() -> nn.Module:
    """The demo's model, initialised the same way on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )


def _target() -> torch.Tensor:
    """The weights of the linear function that the model learns."""
    import torch

    return torch.randn(32, 1, generator=torch.Generator().manual_seed(7))


def _inject(kind: str, out_dir: str) -> None:
    with open(os.path.join(out_dir, "fault.json"), "w") as f:
        json.dump({"t": time.time(), "pid": os.getpid()}, f)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError("CUDA out of memory (simulated by the demo)")
    if kind == "hang":
        time.sleep(3600)  # a stuck data loader
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def _fault_time(out_dir: str) -> float | None:
    """When the culprit injected the fault (``time.time()``), if it did."""
    path = os.path.join(out_dir, "fault.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return float(json.load(f)["t"])


def _header(args: argparse.Namespace, setup: str, consequence: str = "") -> None:
    import resilient_ddp as rd

    print(f"resilient_ddp {rd.__version__} demo: {args.nproc} gloo ranks, {setup}")
    if args.fault != "none":
        print(f"fault: rank {args.rank} {WHAT[args.fault]} at step {args.step}{consequence}")
    print()


def run(args: argparse.Namespace) -> int:
    """Run the demo that the command line asked for.

    Args:
        args: The options of :func:`add_arguments`.

    Returns:
        The exit code: 0 when training completed (with ``--elastic``) or no fault was
        injected and every rank finished, 1 otherwise, 2 for invalid options.
    """
    if not 0 <= args.rank < args.nproc:
        print(f"--rank should be in [0, {args.nproc - 1}], but given {args.rank}", file=sys.stderr)
        return 2
    args.step = DEFAULT_STEP[args.elastic] if args.step is None else args.step
    args.steps = DEFAULT_STEPS[args.elastic] if args.steps is None else args.steps
    if args.elastic:
        return _run_elastic(args)
    return _run_plain(args)


# -- the default demo: every survivor names the culprit ---------------------------------------
def _worker(rank: int, args: dict[str, Any], out_dir: str) -> dict[str, Any]:
    import torch

    import resilient_ddp as rd

    rd.init_process_group("gloo", config=_config(args))
    model = rd.ResilientDDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x_all, w = torch.randn(512, 32, generator=g), _target()
    y_all = x_all @ w
    culprit = rank == args["rank"] and args["fault"] != "none"
    result: dict[str, Any] = {"rank": rank, "steps": 0}
    try:
        for step in range(args["steps"]):
            if culprit and step == args["step"]:
                _inject(args["fault"], out_dir)
            idx = torch.randint(0, 512, (32,), generator=g)
            loss = ((model(x_all[idx]) - y_all[idx]) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            result["steps"] = step + 1
            if rank == 0:
                print(f"  step {step:>3}  loss {loss.item():8.4f}", flush=True)
            # A step of a real model takes a while. (The heartbeat that a step boundary
            # publishes needs a few ms on an idle machine, tens on a loaded one: with much
            # shorter steps, a rank killed at a step's start may be shown one step behind,
            # with the age of that state.)
            time.sleep(0.1)
    except rd.ResilientDDPError as e:
        result.update(
            {
                "error": type(e).__name__,
                "ranks": list(getattr(e, "ranks", ())),
                "at": time.time(),
                "message": str(e),
            }
        )
    finally:
        rd.destroy_process_group()
    return result


def _run_plain(args: argparse.Namespace) -> int:
    from resilient_ddp.tools.launch import launch

    opts = vars(args).copy()
    _header(args, f"ResilientDDP, {args.steps} steps (0 to {args.steps - 1})")
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.time()
        outcomes = launch(
            _worker, args.nproc, (opts, out_dir),
            timeout=timedelta(seconds=120), grace=timedelta(seconds=3),
        )  # fmt: skip
        fault_t = _fault_time(out_dir)
    print()
    print(f"{'rank':>4}  {'outcome':<28} {'named':<7} {'knew after':>10}  first line of the error")
    ok = True
    for o in outcomes:
        v = o.value if isinstance(o.value, dict) else {}
        if o.exitcode is None:
            outcome, named, after, line = "killed by the launcher", "", "", "(never came back)"
        elif o.exitcode < 0:
            outcome = f"died ({signal.Signals(-o.exitcode).name})"
            named, after, line = "", "", ""
        elif o.exc_type:
            outcome, named, after = f"raised {o.exc_type}", "", ""
            line = (o.exc_message or "").splitlines()[0][:70]
        elif "error" in v:
            outcome = v["error"]
            named = ",".join(map(str, v["ranks"]))
            after = f"{v['at'] - fault_t:.2f} s" if fault_t else ""
            line = v["message"].splitlines()[1 if len(v["message"].splitlines()) > 1 else 0][:70]
        else:
            outcome, named, after, line = f"finished {v.get('steps', '?')} steps", "", "", ""
        ok = ok and o.exitcode == 0 and "error" not in v
        print(f"{o.rank:>4}  {outcome:<28} {named:<7} {after:>10}  {line}")
    first = next(
        (o.value for o in outcomes if isinstance(o.value, dict) and "error" in o.value), None
    )
    if first is not None:
        print(f"\nWhat rank {first['rank']} raised ({first['error']}):")
        print("\n".join("  | " + line for line in first["message"].splitlines()))
    print(f"\ntotal {time.time() - start:.1f} s.", end=" ")
    if args.fault == "none":
        print("No fault injected: every rank finished." if ok else "Something failed.")
    else:
        print(
            "Plain DistributedDataParallel would have left the survivors waiting for the process"
            " group timeout (30 min on gloo) or failing with 'Connection closed by peer'."
        )
    return 0 if ok else 1


# -- --elastic: the survivors go on, a replacement joins -------------------------------------
def _state_hash(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A digest of the parameters, buffers and optimizer state."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    tensors = list(model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:  # their bytes, without numpy (not a dependency)
        h.update(bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def _elastic_worker(rank: int, args: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Train with ``on_failure="shrink"`` until ``args["steps"]`` steps are committed and
    the world is whole again (the replacement joined), at most ``MAX_STEPS_FACTOR`` times as
    long. The first process of slot ``args["rank"]`` injects the fault.

    Args:
        rank: The launcher's slot (a replacement gets the slot of the process it replaces).
        args: The command line's options.
        out_dir: Where the culprit notes when it injected the fault.

    Returns:
        This process's ``resilience_stats``, state digest and losses.
    """
    import torch

    import resilient_ddp as rd

    torch.set_num_threads(1)
    rd.init_process_group("gloo", config=_config(args, on_failure="shrink", min_world_size=2))
    joiner = os.environ.get("RESILIENT_DDP_JOINER") == "1"
    net = _net()
    x_all = torch.randn(ELASTIC_SAMPLES, 32, generator=torch.Generator().manual_seed(1))
    y_all = x_all @ _target() / 4

    def full_loss() -> float:  # over the whole data set, on this process alone
        with torch.no_grad():
            return float(((net(x_all) - y_all) ** 2).mean())

    first_loss = full_loss()  # a joiner's model then receives the job's state
    model = rd.ResilientDDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sampler = rd.ElasticBatchSampler(ELASTIC_SAMPLES, ELASTIC_BATCH, seed=0)
    fault_due = rank == args["rank"] and not joiner and args["fault"] != "none"
    world, epoch, done = model.resilience_stats["world_size"], 0, False
    while not done:
        sampler.set_epoch(epoch)  # a joiner's sampler skips the epochs already done
        epoch += 1
        for ids in sampler:
            # This step's number: the steps the job committed so far.
            step = model.resilience_stats["step"]
            if fault_due and step >= args["step"]:
                fault_due = False
                _inject(args["fault"], out_dir)
            loss = ((model(x_all[ids]) - y_all[ids]) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = model.resilience_stats
            # The same decision on every member: they have the same step and world size.
            done = stats["step"] >= args["steps"] and (
                stats["world_size"] >= args["nproc"]
                or stats["step"] >= MAX_STEPS_FACTOR * args["steps"]
            )
            if stats["rank"] == 0 and (step % 10 == 0 or stats["world_size"] != world or done):
                print(
                    f"  step {step:>3}  {stats['world_size']} ranks  loss {full_loss():.4f}",
                    flush=True,
                )
            world = stats["world_size"]
            if done:
                break
            time.sleep(0.05)  # a step of a real model takes a while
    result = {
        "pid": os.getpid(),
        "joiner": joiner,
        "stats": model.resilience_stats,
        "hash": _state_hash(net, opt),
        "first_loss": first_loss,
        "last_loss": full_loss(),
    }
    rd.destroy_process_group()
    return result


def _run_elastic(args: argparse.Namespace) -> int:
    from resilient_ddp.tools.launch import launch

    if args.nproc < MIN_ELASTIC_NPROC:
        print(f"--elastic needs --nproc {MIN_ELASTIC_NPROC} or more", file=sys.stderr)
        return 2
    if args.fault not in ELASTIC_FAULTS:
        print(f"--elastic takes --fault {', '.join(ELASTIC_FAULTS)}", file=sys.stderr)
        return 2
    _header(
        args,
        f'ResilientDDP with on_failure="shrink", rd.spawn(restarts=1), {args.steps} steps',
        "; the others go on, a replacement joins",
    )
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.time()
        outcomes = launch(
            _elastic_worker, args.nproc, (vars(args).copy(), out_dir),
            timeout=timedelta(seconds=120), grace=timedelta(seconds=3), restarts=1,
        )  # fmt: skip
        fault_t = _fault_time(out_dir)
    print()
    ok = _elastic_summary(args, outcomes, fault_t)
    print(f"\ntotal {time.time() - start:.1f} s.", end=" ")
    print("Training completed on every rank." if ok else "Training did not complete.")
    return 0 if ok else 1


def _elastic_summary(
    args: argparse.Namespace, outcomes: list[RankOutcome], fault_t: float | None
) -> bool:
    """Print the summary of an ``--elastic`` run, from rank 0's ``resilience_stats``.

    Args:
        args: The options.
        outcomes: How each slot's last process ended, as :func:`launch` returns them.
        fault_t: When the fault was injected (``time.time()``), if it was.

    Returns:
        Whether every rank completed the training, all with the same state.
    """
    from resilient_ddp.tools.launch import _describe_outcome

    values = [o.value if o.ok and isinstance(o.value, dict) else None for o in outcomes]
    for o, v in zip(outcomes, values, strict=True):
        if v is None:
            print(f"rank {o.rank}'s last process failed:{_describe_outcome(o).split(':', 1)[1]}")
    done = [v for v in values if v is not None]
    if not done:
        return False
    stats = next((v["stats"] for v in done if v["stats"]["rank"] == 0), done[0]["stats"])
    history = stats["world_size_history"]
    print("summary (rank 0's model.resilience_stats):")
    sizes = " -> ".join(str(w) for _, w in history)
    print(f"  world size  {sizes} (steps {', '.join(str(s) for s, _ in history)})")
    joined = [
        (o.rank, v["pid"]) for o, v in zip(outcomes, values, strict=True) if v and v["joiner"]
    ]
    for e in stats["events"]:
        since = f"{e['t'] - fault_t:.2f} s after " if fault_t else ""
        if e["kind"] == "shrink":
            who = ", ".join(f"rank {c['rank']} {c['what']}" for c in e["culprits"]) or "a rank"
            print(f"  failure     {who} at step {e['step']}")
            print(
                f"              the {e['world_size']} others went on {since and since + 'it '}"
                f"(recovery {e['recovery_s']:.2f} s); step {e['step']} "
                f"{OUTCOMES[e['outcome']]}"
            )
        else:
            who = ", ".join(f"rank {r}'s replacement (pid {pid})" for r, pid in joined)
            print(
                f"  join        {who or 'a replacement'} joined at step {e['step']}"
                f"{since and ', ' + since + 'the fault'} (admission {e['admission_s']:.2f} s)"
            )
    print(
        f"  steps       {stats['step']} committed, {stats['redone_steps']} redone, "
        f"{stats['skipped_steps']} skipped"
    )
    print(
        f"  loss        {done[0]['first_loss']:.4f} -> {done[0]['last_loss']:.4f} "
        "(whole data set, before and after)"
    )
    hashes = sorted({v["hash"] for v in done})
    if len(hashes) == 1:
        print(f"  state       identical on all {len(done)} ranks (model and optimizer {hashes[0]})")
    else:
        print(f"  state       DIFFERS between the ranks: {', '.join(hashes)}")
    return (
        len(done) == args.nproc
        and len(hashes) == 1
        and all(v["stats"]["step"] >= args.steps for v in done)
    )
