"""Rank functions for tests/test_dropin_ddp.py: ResilientDDP against DDP in the same rank.

DDP checks a comm hook's annotations with ``inspect`` and compares them with the real
types: under ``from __future__ import annotations`` they are strings, so the hooks below
are given their annotations as objects.
"""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import resilient_ddp as rd
from resilient_ddp.testing import kill_self

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 4.0, "op_timeout": 1.5}


class MLP(nn.Module):
    """A model class of the test's own (dynamo compiles user code, not torch's modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _init(cfg: dict[str, Any] | None = None) -> None:
    faulthandler.dump_traceback_later(80, exit=True)
    rd.init_process_group("gloo", config=rd.ResilienceConfig(**(cfg or {})))


def _train(model: nn.Module, data: Any) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _moved(params: list[torch.Tensor]) -> bool:
    return not torch.equal(params[0], next(make_model().parameters()))


def _both(kwargs: dict[str, Any] | None = None) -> tuple[nn.Module, nn.Module]:
    kwargs = kwargs or {}
    return rd.ResilientDDP(make_model(), **kwargs), DistributedDataParallel(make_model(), **kwargs)


def _logged(model: Any) -> dict[str, Any]:
    data = model._get_ddp_logging_data()
    return {k: data.get(k) for k in ("comm_hook", "has_error", "error")}


# -- item 3: the hooks ------------------------------------------------------------------------
def _powersgd_state() -> Any:
    return powerSGD.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )


HOOKS: dict[str, Callable[[nn.Module], None]] = {
    "allreduce": lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook),
    "fp16_compress": lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook),
    "powerSGD": lambda m: m.register_comm_hook(_powersgd_state(), powerSGD.powerSGD_hook),
    "builtin_allreduce": lambda m: m._register_builtin_comm_hook(
        dist.BuiltinCommHookType.ALLREDUCE
    ),
    "builtin_fp16_compress": lambda m: m._register_builtin_comm_hook(
        dist.BuiltinCommHookType.FP16_COMPRESS
    ),
}


def builtin_hooks(rank: int, names: list[str] | None = None) -> dict[str, Any]:
    """Each of torch's hooks on ResilientDDP and on DDP (several buckets): parameters after
    six steps, and what the logging data and ``_comm_hooks`` say."""
    _init()
    data = batches(rank, 6)
    out: dict[str, Any] = {}
    for name, register in HOOKS.items():
        if names is not None and name not in names:
            continue
        # Several buckets, but for PowerSGD: its hooks wait on collectives inside future
        # callbacks, and plain DDP with several buckets hangs there on gloo (as measured).
        m1, m2 = _both({} if "powerSGD" in name else {"bucket_cap_mb": 0.002})
        before = (_logged(m1), _logged(m2))
        register(m1)
        register(m2)
        a, b = _train(m1, data), _train(m2, data)
        out[name] = {
            "same": _same(a, b),
            "moved": _moved(a),
            "logged_before": before,
            "logged": (_logged(m1), _logged(m2)),
            "comm_hooks": (
                [h.__qualname__ for h, _ in m1._comm_hooks],
                [h.__qualname__ for h, _ in m2._comm_hooks],
            ),
        }
    rd.destroy_process_group()
    return out


def bad_bucket_annotation(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def bad_return_annotation(state: object, bucket: dist.GradBucket) -> int:
    raise AssertionError("never called")


def returns_an_int(state, bucket):  # type: ignore[no-untyped-def]  # as DDP allows
    return 1


_FUTURE = torch.futures.Future[torch.Tensor]
bad_bucket_annotation.__annotations__ = {"state": object, "bucket": int, "return": _FUTURE}
bad_return_annotation.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": int,
}


def _attempt(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is what is compared
        return type(e).__name__, str(e)
    return None


INVALID: dict[str, list[Callable[[Any], Any]]] = {
    "not_callable": [lambda m: m.register_comm_hook(None, 42)],
    "bucket_annotation": [lambda m: m.register_comm_hook(None, bad_bucket_annotation)],
    "return_annotation": [lambda m: m.register_comm_hook(None, bad_return_annotation)],
    "bf16": [lambda m: m.register_comm_hook(None, default_hooks.bf16_compress_hook)],
    "twice": [
        lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook),
        lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook),
    ],
    "builtin_twice": [
        lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE),
        lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS),
    ],
    "python_then_builtin": [
        lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook),
        lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE),
    ],
    "builtin_then_python": [
        lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE),
        lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook),
    ],
    "builtin_not_a_type": [lambda m: m._register_builtin_comm_hook("ALLREDUCE")],
    "returns_an_int": [
        lambda m: m.register_comm_hook(None, returns_an_int),
        lambda m: m(torch.ones(2, 8)).sum().backward(),
    ],
}


def invalid_hooks(rank: int) -> dict[str, Any]:
    """Each invalid use of the hook API on ResilientDDP and on DDP: the error of the last
    call (type and message), the logging data and ``_comm_hooks`` after it."""
    _init()
    out: dict[str, Any] = {}
    for name, calls in INVALID.items():
        rows = []
        for model in _both():
            *setup, last = calls
            for call in setup:
                call(model)
            error = _attempt(lambda call=last, model=model: call(model))  # type: ignore[misc]
            rows.append(
                {
                    "error": error,
                    "logged": _logged(model),
                    "comm_hooks": [getattr(h, "__qualname__", h) for h, _ in model._comm_hooks],
                }
            )
        out[name] = rows
    # A failed backward leaves both reducers mid-pass: the group goes with the process.
    rd.barrier()
    return out


# -- item 4: join ------------------------------------------------------------------------------
JOIN_CASES = [
    (divide, hook, how)
    for divide in (False, True)
    for hook in (False, True)
    for how in ("method", "Join")
]


def _join_train(model: nn.Module, data: Any, divide: bool, hook: bool, how: str) -> Any:
    if hook:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if how == "method":
        ctx: Any = model.join(divide_by_initial_world_size=divide)  # type: ignore[operator]
    else:
        ctx = Join([model], divide_by_initial_world_size=divide)  # type: ignore[list-item]
    with ctx:
        _train(model, data)
    # After the context's end: the ranks took the last joiner's model (DDP's final sync).
    return [p.detach().clone() for p in model.parameters()]


def join_numbers(rank: int) -> dict[str, Any]:
    """Uneven inputs (rank r has 3 + 2r batches) under ``model.join()`` and ``Join([model])``,
    with and without ``divide_by_initial_world_size`` and a comm hook: ResilientDDP's
    parameters against DDP's, and DDP's own with and without the divisor (which must
    differ, or the case proves nothing)."""
    _init()
    uneven = batches(rank, 3 + 2 * rank)
    out: dict[str, Any] = {}
    for divide, hook, how in JOIN_CASES:
        a, b = (_join_train(m, uneven, divide, hook, how) for m in _both())
        out[f"{divide}-{hook}-{how}"] = {"same": _same(a, b), "moved": _moved(a), "ddp": b}
    for hook in (False, True):
        with_divisor = out[f"True-{hook}-method"].pop("ddp")
        without = out[f"False-{hook}-method"].pop("ddp")
        out[f"divisor_matters-{hook}"] = not _same(with_divisor, without)
    for row in out.values():
        if isinstance(row, dict):
            row.pop("ddp", None)
    rd.destroy_process_group()
    return out


# -- item 5: torch.compile ---------------------------------------------------------------------
def _compiled_steps(model: nn.Module, data: Any) -> tuple[int, int, list[torch.Tensor]]:
    """Train a compiled ``model``: dynamo's graph breaks and graphs, and the parameters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    params = _train(compiled, data)
    breaks = sum(counters["graph_break"].values())
    graphs = int(counters["stats"]["unique_graphs"])
    return breaks, graphs, params


def compile_breaks(rank: int) -> dict[str, Any]:
    """Graph breaks of a compiled ResilientDDP and of a compiled DDP (three steps each, and
    ``torch._dynamo.explain``), and their parameters."""
    import warnings

    warnings.filterwarnings("ignore", module="torch._dynamo")
    _init()
    data = batches(rank, 3)
    m1, m2 = _both()
    out: dict[str, Any] = {}
    r_breaks, r_graphs, a = _compiled_steps(m1, data)
    d_breaks, d_graphs, b = _compiled_steps(m2, data)
    out["steps"] = {"rd": (r_breaks, r_graphs), "ddp": (d_breaks, d_graphs)}
    out["same"], out["moved"] = _same(a, b), _moved(a)
    x = data[0][0]
    explained = {}
    for name, model in (("rd", m1), ("ddp", m2)):
        e = torch._dynamo.explain(torch.compile(model, backend="aot_eager"))(x)
        explained[name] = (e.graph_break_count, e.graph_count)
    out["explain"] = explained
    rd.destroy_process_group()
    return out


def compiled_kill(rank: int, culprit: int) -> dict[str, Any]:
    """A compiled ResilientDDP; ``culprit`` is killed before its fourth step.

    No op_timeout in the config: one set there is a hard limit, and on a loaded machine a
    survivor's compile of a step outlasted 1.5 s (the late rank was named instead of the
    killed one). Without it, a compiling rank is busy and waited for; the killed one is
    still named within the bound below (heartbeats, its connections).
    """
    _init({k: v for k, v in FAST.items() if k != "op_timeout"})
    model = torch.compile(rd.ResilientDDP(make_model()), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = 0.0
    try:
        for step, (x, y) in enumerate(batches(rank, 20)):
            if step == 3 and rank == culprit:
                kill_self()
            t0 = time.monotonic()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except rd.RankFailureError as e:
        return {
            "type": type(e).__name__,
            "ranks": list(e.ranks),
            "message": str(e),
            "elapsed": time.monotonic() - t0,
        }
    return {"type": None}
