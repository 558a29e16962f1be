"""Functions run inside the ranks of tests/test_make_resilient_mp.py.

``rd.make_resilient`` takes over a ``DistributedDataParallel`` that something else built;
``rd.bound_torch_collectives`` bounds ``torch.distributed``'s own collectives. The latter
patches the ``torch.distributed`` namespace of the process it runs in, so it is only ever
called here, inside the ranks, and undone in a ``finally``.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import resilient_ddp as rd
from resilient_ddp.testing import kill_self

from ._ddp_workers import FAULT_STEP, FaultLayer, _init, _train, batches, make_model
from ._workers import error_summary

# What rd.bound_torch_collectives must replace, and what the tests call through it.
TORCH_OPS = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "all_gather_object",
    "broadcast_object_list",
)


# -- parity --------------------------------------------------------------------------------
def parity(rank: int, mode: str, at: int) -> dict[str, Any]:
    """Train a plain DDP, and a DDP made resilient (``mode``: ``before`` training,
    ``mid_step``: after the forward pass of step ``at``, before its backward, ``between``:
    before step ``at``), on the same data; report whether they agree bitwise."""
    _init()
    data = batches(rank, 6)
    reference = _train(DistributedDataParallel(make_model()), data)
    model = DistributedDataParallel(make_model())
    out: dict[str, Any] = {}
    if mode == "before":
        out["returned_self"] = rd.make_resilient(model) is model
        out["isinstance"] = isinstance(model, rd.ResilientDDP)
        out["twice_returned_self"] = rd.make_resilient(model) is model
        out["type"] = type(model).__name__
        ours = _train(model, data)
    else:
        ours = _train_adopting(model, data, mode, at, out)
    out["same"] = len(ours) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(ours, reference, strict=True)
    )
    # The models must really have trained (parity of untouched weights proves nothing).
    out["moved"] = not torch.equal(ours[0], make_model().state_dict()["0.weight"])
    rd.destroy_process_group()
    return out


def _train_adopting(
    model: DistributedDataParallel, data: Any, mode: str, at: int, out: dict[str, Any]
) -> list[torch.Tensor]:
    """``_train`` (no accumulation) with ``rd.make_resilient`` called at step ``at``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(data):
        if mode == "between" and i == at:
            rd.make_resilient(model)
        loss = ((model(x) - y) ** 2).mean()
        if mode == "mid_step" and i == at:
            rd.make_resilient(model)
            rt = rd.runtime._runtime.current()
            assert rt is not None
            seq = rt.seq
            loss.backward()
            # The buckets went through the library's ops, and the pass was waited for
            # at its end (that wait is what counts the step).
            out["bucket_ops"] = rt.seq - seq
            out["steps_after_backward"] = model.resilience_stats["step"]
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    out["type"] = type(model).__name__
    return [t.detach().clone() for t in model.state_dict().values()]


# -- faults after make_resilient ------------------------------------------------------------
def fault(rank: int, where: str, culprit: int, cfg: dict[str, Any]) -> Any:
    """Train a DDP made resilient; the culprit is killed at step FAULT_STEP.

    ``where="forward"``: made resilient before training, killed in its forward pass.
    The other cases run plain DDP steps, then at FAULT_STEP make the model resilient
    between the forward and backward passes; the culprit dies right after that, before
    its backward: ``"mid_step"`` once every survivor's backward has issued its first bucket
    reduction, ``"mid_step_known"`` before, the survivors starting their backward only once
    they know of the death. Survivors report the error and how long after the step (or,
    mid-step, the backward) began it came.
    """
    _init(cfg)
    layer = FaultLayer()
    if rank == culprit and where == "forward":
        layer.kind, layer.where = "kill", "forward"
    model = DistributedDataParallel(make_model(fault=layer))
    if where == "forward":
        rd.make_resilient(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.monotonic()
    try:
        for step, (x, y) in enumerate(batches(rank, FAULT_STEP + 3)):
            layer.step = step
            t0 = time.monotonic()
            loss = ((model(x) - y) ** 2).mean()
            if where != "forward" and step == FAULT_STEP:
                _adopt_then_kill(model, rank, where, culprit)
                t0 = time.monotonic()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except rd.ResilientDDPError as e:
        out = error_summary(e, t0)
        out["step"] = layer.step
        out["model_type"] = type(model).__name__
        return out
    finally:
        rd.destroy_process_group()
    return "no error"


def _adopt_then_kill(model: Any, rank: int, where: str, culprit: int) -> None:
    """Make ``model`` resilient (every rank), then kill the culprit: after the survivors'
    backward issued its first reduction (``mid_step``: their comm hook says so), or before
    their backward (``mid_step_known``: they wait until their runtime knows)."""
    rt = rd.runtime._runtime.current()
    assert rt is not None
    store = rt.control_root
    survivors = [r for r in range(dist.get_world_size()) if r != culprit]
    rd.make_resilient(model)
    if where == "mid_step":
        # No annotations: DDP checks a hook's with inspect, and under `from __future__
        # import annotations` they are strings, which it refuses (ValueError).
        def signal_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            # Called by the library's hook once the bucket's op began.
            store.set(f"test/reducing{rank}", "1")
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, signal_then_allreduce)
        if rank == culprit:
            store.wait([f"test/reducing{r}" for r in survivors], timedelta(seconds=20))
            kill_self()
    else:
        if rank == culprit:
            kill_self()
        deadline = time.monotonic() + 10.0
        while not rt.failed_for(rt.seq + 1) and time.monotonic() < deadline:
            time.sleep(0.02)


# -- refusals -----------------------------------------------------------------------------
class FrameworkDDP(DistributedDataParallel):
    """A framework's own subclass of DDP."""


def refusals(rank: int) -> dict[str, Any]:
    """Every case make_resilient must refuse; each reports the error and whether the model
    was left as it was. Then the group and make_resilient still work."""
    _init()
    out: dict[str, Any] = {}

    def attempt(case: str, model: Any, **kwargs: Any) -> None:
        cls = type(model)
        try:
            rd.make_resilient(model, **kwargs)
        except rd.ResilientDDPError as e:
            out[case] = {"type": type(e).__name__, "message": str(e)}
        else:
            out[case] = {"type": None, "message": ""}
        out[case]["unchanged"] = type(model) is cls

    attempt("subclass", FrameworkDDP(make_model()))
    attempt("not_ddp", make_model())
    hooked = DistributedDataParallel(make_model())
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    attempt("python_hook", hooked)
    builtin = DistributedDataParallel(make_model())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    attempt("builtin_hook", builtin)
    shrink = rd.ResilienceConfig(
        on_failure="shrink", heartbeat_interval=0.2, heartbeat_timeout=4.0, op_timeout=5.0
    )
    attempt("shrink", DistributedDataParallel(make_model()), resilience=shrink)

    plain = DistributedDataParallel(make_model())
    x, y = batches(rank, 1)[0]
    output = plain(x)

    def during_backward(grad: torch.Tensor) -> torch.Tensor:
        attempt("in_backward", plain)
        return grad

    output.register_hook(during_backward)
    ((output - y) ** 2).mean().backward()
    out["in_backward_ran"] = "in_backward" in out

    # Nothing was left half-done: the group works, and a fresh DDP is taken over.
    out["all_reduce_after"] = rd.all_reduce(torch.ones(1)).item()
    fresh = DistributedDataParallel(make_model())
    out["adopted_after"] = isinstance(rd.make_resilient(fresh), rd.ResilientDDP)
    rd.destroy_process_group()
    return out


# -- bound_torch_collectives --------------------------------------------------------------
def _call_torch_ops(ns: Any, rank: int, world: int) -> dict[str, Any]:
    """Every op of TORCH_OPS once through namespace ``ns`` (``torch.distributed``, patched or
    not, or ``torch.distributed.distributed_c10d``: torch's own); results as lists."""
    res: dict[str, Any] = {}
    t = torch.full((3,), float(rank + 1))
    res["all_reduce"] = (ns.all_reduce(t), t.tolist())
    t = torch.full((3,), float(rank + 1))
    res["broadcast"] = (ns.broadcast(t, src=1), t.tolist())
    res["barrier"] = (ns.barrier(), None)
    gathered = [torch.empty(2) for _ in range(world)]
    res["all_gather"] = (
        ns.all_gather(gathered, torch.full((2,), float(rank))),
        [g.tolist() for g in gathered],
    )
    with warnings.catch_warnings():
        # torch 2.13 deprecates both names (FutureWarning) in favour of *_single.
        warnings.simplefilter("ignore", FutureWarning)
        flat = torch.empty(2 * world)
        res["all_gather_into_tensor"] = (
            ns.all_gather_into_tensor(flat, torch.full((2,), 10.0 * rank)),
            flat.tolist(),
        )
        part = torch.empty(2)
        res["reduce_scatter_tensor"] = (
            ns.reduce_scatter_tensor(part, torch.arange(2.0 * world) + rank),
            part.tolist(),
        )
    flat = torch.empty(2 * world)
    res["all_gather_single"] = (
        ns.all_gather_single(flat, torch.full((2,), 10.0 * rank)),
        flat.tolist(),
    )
    part = torch.empty(2)
    res["reduce_scatter_single"] = (
        ns.reduce_scatter_single(part, torch.arange(2.0 * world) + rank),
        part.tolist(),
    )
    pair = [torch.full((2,), float(rank)), torch.ones(1)]
    res["all_reduce_coalesced"] = (ns.all_reduce_coalesced(pair), [p.tolist() for p in pair])
    objects: list[Any] = [None] * world
    res["all_gather_object"] = (
        ns.all_gather_object(objects, {"rank": rank, "tag": "x" * rank}),
        objects,
    )
    sent: list[Any] = [{"from": 1, "payload": [1, 2, 3]}, "tail"] if rank == 1 else [None, None]
    res["broadcast_object_list"] = (ns.broadcast_object_list(sent, src=1), sent)
    return res


def torch_ops_healthy(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed's collectives, bounded: results, routing, async_op, restoring."""
    _init(cfg)
    c10d = dist.distributed_c10d
    world = dist.get_world_size()
    rt = rd.runtime._runtime.current()
    assert rt is not None
    out: dict[str, Any] = {}
    try:
        out["identical_before"] = [n for n in TORCH_OPS if getattr(dist, n) is getattr(c10d, n)]
        rd.bound_torch_collectives()
        replaced = {n: getattr(dist, n) for n in TORCH_OPS}
        rd.bound_torch_collectives()  # a second call changes nothing
        out["replaced"] = [n for n in TORCH_OPS if getattr(dist, n) is not getattr(c10d, n)]
        out["second_call_kept"] = all(getattr(dist, n) is replaced[n] for n in TORCH_OPS)
        seq = rt.seq
        out["bounded"] = _call_torch_ops(dist, rank, world)
        out["bounded_ops"] = rt.seq - seq  # each op went through the library
        out["native"] = _call_torch_ops(c10d, rank, world)
        # async_op=True: torch's own call, which returns its Work; no op of the library.
        seq = rt.seq
        t = torch.full((3,), float(rank + 1))
        work = dist.all_reduce(t, async_op=True)
        out["async_is_work"] = isinstance(work, dist.Work)
        work.wait()
        out["async_value"] = t.tolist()
        out["async_ops"] = rt.seq - seq
        rd.bound_torch_collectives(False)
        out["restored"] = [n for n in TORCH_OPS if getattr(dist, n) is getattr(c10d, n)]
        out["restored_all_reduce"] = dist.all_reduce is c10d.all_reduce
        # Bounding again after restoring works as the first time.
        rd.bound_torch_collectives()
        out["rebounded"] = [n for n in TORCH_OPS if getattr(dist, n) is not getattr(c10d, n)]
        t = torch.ones(1)
        dist.all_reduce(t)
        out["rebounded_value"] = t.item()
    finally:
        rd.bound_torch_collectives(False)
        rd.destroy_process_group()
    return out


def torch_ops_fault(rank: int, kind: str, culprit: int, cfg: dict[str, Any]) -> Any:
    """After one healthy torch.distributed.all_reduce, the culprit hangs outside any
    collective (``kind="hang"``: the others are in ``all_reduce``) or is killed
    (``kind="kill"``: the others are in ``barrier``, then try an ``all_reduce``)."""
    _init(cfg)
    rd.bound_torch_collectives()
    try:
        dist.all_reduce(torch.ones(2))
        if rank == culprit:
            if kind == "kill":
                kill_self()
            time.sleep(cfg["op_timeout"] + 4)
        t0 = time.monotonic()
        try:
            if kind == "kill":
                dist.barrier()
            else:
                dist.all_reduce(torch.ones(2))
        except rd.ResilientDDPError as e:
            out = error_summary(e, t0)
        else:
            return "no error"
        if kind == "kill":
            t1 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(2))
            except rd.ResilientDDPError as e:
                out["later"] = error_summary(e, t1)
            else:
                out["later"] = "no error"
        return out
    finally:
        rd.bound_torch_collectives(False)
        rd.destroy_process_group()
