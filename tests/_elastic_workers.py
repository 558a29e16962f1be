"""Workers for the elastic-training tests (``on_failure="shrink"``)."""

from __future__ import annotations

import faulthandler
import hashlib
import itertools
import json
import os
import random
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd
from resilient_ddp.testing import kill_self, stop_self

from ._workers import write_json

N_SAMPLES = 96
BATCH = 2
MIN_EPOCHS = 12  # about 140 steps at 4 ranks: enough for the loss to halve


def fault_plan(seed: int, n_faults: int, kinds: list[str], world: int = 4) -> list[dict[str, Any]]:
    """``n_faults`` seeded faults, one at a time: each hits a random current member (its
    replacement's member id follows the launcher's numbering) once the previous one was
    recovered from and its replacement joined; "*mid" kinds strike 0-20 ms into the step,
    mostly inside the gradient all-reduce."""
    rng = random.Random(seed)
    alive = list(range(world))
    faults = []
    for i in range(n_faults):
        uid = rng.choice(alive)
        faults.append(
            {
                "uid": uid,
                "step": 5 + 3 * i,
                "kind": rng.choice(kinds),
                "delay": rng.uniform(0.0, 0.02),
                "full": world,
                "after": i,
            }
        )
        alive[alive.index(uid)] = world + i
    return faults


def _cfg(**kw: Any) -> rd.ResilienceConfig:
    base: dict[str, Any] = {
        "on_failure": "shrink",
        "min_world_size": 2,
        "heartbeat_interval": timedelta(milliseconds=100),
        "heartbeat_timeout": timedelta(seconds=2),
        "op_timeout": timedelta(seconds=4),
    }
    base.update(kw)
    return rd.ResilienceConfig(**base)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_SAMPLES, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def state_hash(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in model.state_dict().values():
        h.update(t.detach().cpu().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def train(  # noqa: PLR0915 - one loop with its fault points
    rank: int,
    out_dir: str,
    faults: list[dict[str, Any]],
    epochs: int,
    cfg: dict[str, Any],
    pace: float = 0.0,
) -> dict[str, Any]:
    """Train; faults: [{"uid": u, "step": s, "kind": kill|raise|stop|killmid|stopmid|
    die_in_form|die_sending (armed at that step, see _IN_RECOVERY), "at":
    forward|after, "delay": seconds into the step for the *mid kinds, "full": world size,
    "after": ranks lost before}].

    Appends one JSON line per committed step to out_dir/<pid>.jsonl: step, uid, world, ids,
    hash, loss. Returns this rank's final stats."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(100, exit=True)
    rd.init_process_group("gloo", config=_cfg(**cfg))
    _slow_sends(float(os.environ.get("RD_TEST_SLOW_SEND", "0")))
    el_uid = int(os.environ.get("RESILIENT_DDP_UID", rank))
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = rd.ElasticBatchSampler(N_SAMPLES, BATCH, seed=3)
    x_all, y_all = _data()
    log_path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
    # A fault fires at the first step at or after its "step" that this process reaches (a
    # replacement may join a little after it).
    pending = [f for f in faults if f["uid"] == el_uid]
    full = max((f.get("full", 0) for f in faults), default=0)
    with open(log_path, "a") as log:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for ids in sampler:
                # The epoch these ids were drawn from: a rank whose own reduction failed while
                # the others committed the step takes their state over, sampler included,
                # which may have moved on to the next epoch by the time the step is logged.
                drawn_from = sampler.epoch
                stats = model.resilience_stats
                before = stats["step"]
                # "full" and "after": fire only once the world is back to that size and that
                # many ranks were lost before (faults one at a time, each after the previous
                # replacement joined).
                due = [
                    f
                    for f in pending
                    if before >= f["step"]
                    and stats["world_size"] >= f.get("full", 0)
                    and faults_seen(stats) >= f.get("after", 0)
                ]
                pending = [f for f in pending if f not in due]
                after = [f for f in due if f.get("at") == "after"]
                for f in due:
                    if f in after:
                        continue
                    if f["kind"] in _IN_RECOVERY:
                        _arm(f["kind"])
                    elif f["kind"] in ("killmid", "stopmid"):
                        # SIGKILL or SIGSTOP from a thread a random moment into the step:
                        # with the default delays, most likely inside the gradient
                        # all-reduce.
                        act = kill_self if f["kind"] == "killmid" else stop_self
                        threading.Timer(f.get("delay", 0.002), act).start()
                    else:
                        _fault(f["kind"])
                loss = ((model(x_all[ids]) - y_all[ids]) ** 2).mean()
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
                                "hash": state_hash(model.module, opt),
                                "loss": float(loss.detach()),
                            }
                        )
                        + "\n"
                    )
                    log.flush()
                for f in after:
                    _fault(f["kind"])
            if epoch < sampler.epoch:
                continue  # a joiner: the job was past this epoch already
            # The tail of an epoch smaller than the world size is dropped (every rank must
            # take part in every step): logged so that the test can account for it.
            log.write(json.dumps({"epoch_end": epoch, "dropped": sampler.dropped}) + "\n")
            log.flush()
            stats = model.resilience_stats
            if (
                full
                and faults_seen(stats) >= len(faults)
                and stats["world_size"] >= full
                and epoch + 1 >= MIN_EPOCHS
            ):
                # Every fault happened and the world is whole again: the same decision on
                # every member (the history and the epoch end are the same everywhere).
                # Not before MIN_EPOCHS: the test checks that the loss falls, and a
                # replacement forked from the test's fork server joins within a step or two.
                break
    stats = model.resilience_stats
    stats["dropped"] = sampler.dropped
    stats["final_hash"] = state_hash(model.module, opt)
    rd.destroy_process_group()
    return stats


# Faults inside the library's recovery: die when forming the next generation (after the
# decision counted this process in), or when about to send the state as its source.
_IN_RECOVERY = {"die_in_form": "_form", "die_sending": "_send_state"}


def _arm(kind: str) -> None:
    from resilient_ddp.training import elastic

    name = _IN_RECOVERY[kind]
    original = getattr(elastic, name)

    def patched(rt: Any, *args: Any, **kwargs: Any) -> Any:
        if kind == "die_in_form" or args[0] == rt.rank:
            kill_self()
        return original(rt, *args, **kwargs)

    setattr(elastic, name, patched)


def _slow_sends(seconds: float) -> None:
    """The state source of an admission takes ``seconds`` longer to send the state to the
    joiners (as a large state or a slow link would): it waits after the op's validation,
    where the ranks that take no part in the transfer have gone on."""
    from resilient_ddp.ops import checkpoint

    if not seconds:
        return
    original = checkpoint._broadcast

    def patched(o: Any, state: Any, src: int, *args: Any) -> Any:
        if args[-1] is not None and src == o.rt.rank:  # point to point (dsts), the sender
            time.sleep(seconds)
        return original(o, state, src, *args)

    checkpoint._broadcast = patched  # type: ignore[assignment]


def faults_seen(stats: dict[str, Any]) -> int:
    """Ranks lost so far in the job (the world-size history is sent to joiners)."""
    sizes = [w for _, w in stats["world_size_history"]]
    return sum(max(0, a - b) for a, b in itertools.pairwise(sizes))


def _fault(kind: str) -> None:
    if kind == "kill":
        kill_self()
    elif kind == "raise":
        raise RuntimeError("injected fault")
    elif kind == "stop":
        stop_self()
    elif kind == "sleep":
        time.sleep(3600)


def torchrun_main() -> None:
    """Entry point of a rank under real torchrun, and of the replacement the test starts
    by hand (``RESILIENT_DDP_JOINER=1``): ``train`` with the faults of ``argv[2]`` (JSON);
    the final stats go to ``<argv[1]>/final_<pid>.json``."""
    import sys

    out_dir, faults = sys.argv[1], json.loads(sys.argv[2])
    stats = train(int(os.environ.get("RANK", "-1")), out_dir, faults, 200, {}, 0.01)
    write_json(os.path.join(out_dir, f"final_{os.getpid()}.json"), stats)


def lone_joiner(rank: int) -> dict[str, Any]:
    """A joiner (``RESILIENT_DDP_JOINER=1``) on a store where no elastic job runs."""
    os.environ["RESILIENT_DDP_JOINER"] = "1"
    t0 = time.monotonic()
    try:
        rd.init_process_group("gloo", config=_cfg(init_timeout=timedelta(seconds=2)))
    except rd.PreflightError as e:
        return {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"type": None}
