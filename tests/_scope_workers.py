"""Workers for the optimizer-scope tests: the library's optimizer hooks act only on the
optimizers over a ``ResilientDDP``'s parameters, never on an unrelated one (issue 17)."""

from __future__ import annotations

import copy
import faulthandler
import gc
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import resilient_ddp as rd
from resilient_ddp.runtime import _runtime
from resilient_ddp.testing import kill_self
from resilient_ddp.training import elastic

# The step at which the victim dies, with every survivor inside that step's reduction.
SKIP_AT = 3
STEPS = 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _batch(rank: int, step: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * salt + 10 * rank + step)
    x = torch.randn(4, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _disc_step(disc: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One step of the local "discriminator": its own data, backward and optimizer."""
    x, y = _batch(rank, step, salt=2)
    loss = ((disc(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def skip_leaves_other_optimizers(rank: int, out_dir: str) -> dict[str, Any]:
    """Elastic training on 3 ranks with a local discriminator (an ``nn.Linear`` with its own
    SGD and backward each step) beside the model. Rank 2 dies at step ``SKIP_AT`` once
    ranks 0 and 1 are inside that step's gradient reduction: with
    ``gradient_as_bucket_view=True`` the survivors have no local gradients to redo it
    with, so ``decide_shrink`` skips it. The discriminator must follow, bitwise, the
    trajectory of a copy trained on the same data before the library started (no hooks
    act without a runtime), with its gradients intact at every step."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(40, exit=True)
    # The reference: the discriminator trained alone, before any runtime exists.
    torch.manual_seed(5)
    disc = nn.Linear(4, 1)
    ref = copy.deepcopy(disc)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    reference = []
    for step in range(STEPS):
        _disc_step(ref, ref_opt, rank, step)
        ref_opt.zero_grad()
        reference.append(_params(ref))

    cfg = rd.ResilienceConfig(
        on_failure="shrink",
        min_world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        heartbeat_timeout=timedelta(seconds=2),
        op_timeout=timedelta(seconds=4),
    )
    rd.init_process_group("gloo", config=cfg)
    model = rd.ResilientDDP(_model(), gradient_as_bucket_view=True)
    # The model's optimizer also steps a parameter outside the model (a learned output
    # scale): it is in scope as a whole, so a skipped step leaves that one alone too.
    scale = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.05, momentum=0.9)
    disc_opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    out: dict[str, Any] = {"disc_same": [], "disc_grads": [], "model_moved": [], "scale_moved": []}
    for step in range(STEPS):
        x, y = _batch(rank, step, salt=1)
        before, scale_before = _params(model), scale.detach().clone()
        loss = ((model(x) * scale - y) ** 2).mean()
        if step == SKIP_AT:
            if rank == 2:
                # Wait until both survivors are past their forward, about to reduce.
                end = time.monotonic() + 20
                while time.monotonic() < end and not all(
                    os.path.exists(os.path.join(out_dir, f"ready{r}")) for r in (0, 1)
                ):
                    time.sleep(0.01)
                time.sleep(0.3)
                kill_self()
            with open(os.path.join(out_dir, f"ready{rank}"), "w"):
                pass
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["model_moved"].append(not _same(before, _params(model)))
        out["scale_moved"].append(not torch.equal(scale_before, scale.detach()))
        _disc_step(disc, disc_opt, rank, step)
        out["disc_grads"].append(all(p.grad is not None for p in disc.parameters()))
        disc_opt.zero_grad()
        out["disc_same"].append(_same(_params(disc), reference[step]))
    rt = _runtime.current()
    assert rt is not None
    assert rt.elastic is not None
    tracked = elastic.live(rt.elastic.optimizers)
    out["tracked"] = ["model" if o is opt else "disc" if o is disc_opt else "?" for o in tracked]
    out["shipped_optim"] = len(model._rd_snapshot()["optim"])
    stats = model.resilience_stats
    out["outcomes"] = [e["outcome"] for e in stats["events"] if e["kind"] == "shrink"]
    out["skipped_steps"] = stats["skipped_steps"]
    out["world_size"] = stats["world_size"]
    rd.destroy_process_group()
    return out


def phases_follow_the_models_optimizer(rank: int) -> dict[str, Any]:
    """Without elasticity: record the phase inside and after ``step()`` of an unrelated
    optimizer and of the model's, and the published step count around them; then check
    that the scope follows ``add_param_group`` and models that come and go."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(40, exit=True)
    rd.init_process_group(
        "gloo",
        config=rd.ResilienceConfig(
            heartbeat_interval=timedelta(milliseconds=100),
            heartbeat_timeout=timedelta(seconds=2),
            op_timeout=timedelta(seconds=4),
        ),
    )
    rt = _runtime.current()
    assert rt is not None
    model = rd.ResilientDDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    other = nn.Linear(4, 1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05)
    inside: list[tuple[str, str]] = []

    def spy(name: str) -> Any:
        def hook(o: Any, args: Any, kwargs: Any) -> None:
            inside.append((name, rt.phase))

        return hook

    opt.register_step_pre_hook(spy("model"))
    other_opt.register_step_pre_hook(spy("other"))

    def other_step(tag: str) -> None:
        x, y = _batch(rank, 0, salt=3)
        ((other(x) - y) ** 2).mean().backward()
        before = (rt.phase, rt.step)
        other_opt.step()
        other_opt.zero_grad()
        out[tag] = {"before": before, "after": (rt.phase, rt.step)}

    out: dict[str, Any] = {}
    for step in range(2):
        x, y = _batch(rank, step, salt=1)
        ((model(x) - y) ** 2).mean().backward()
        other_step(f"other_after_backward{step}")
        before = (rt.phase, rt.step)
        opt.step()
        opt.zero_grad()
        out[f"model{step}"] = {"before": before, "after": (rt.phase, rt.step)}
        other_step(f"other_in_data{step}")
    out["inside"] = inside

    out["scopes"] = _scopes(rt, model)
    rd.destroy_process_group()
    return out


def _scopes(rt: Any, model: rd.ResilientDDP) -> dict[str, str]:
    """The phase seen right after a step of optimizers whose scope changes: "data" when it
    was in scope, else the "probe" phase around it."""
    # add_param_group with a model parameter brings an optimizer into scope.
    probe = nn.Linear(4, 1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.05)
    scopes: dict[str, str] = {}

    def phase_of_step(o: torch.optim.Optimizer, params: Any) -> str:
        with rd.phase("probe"):
            for p in params:
                p.grad = torch.zeros_like(p)
            o.step()
            o.zero_grad()
            return rt.phase

    scopes["probe"] = phase_of_step(probe_opt, probe.parameters())
    probe_opt.add_param_group({"params": [model.module[2].bias]})
    scopes["probe+model"] = phase_of_step(probe_opt, [*probe.parameters(), model.module[2].bias])
    # An optimizer over a module's parameters, stepped before the module is wrapped: out
    # of scope; in scope once a ResilientDDP wraps it, and out again when that one goes.
    second = _model()
    second_opt = torch.optim.SGD(second.parameters(), lr=0.0)
    scopes["second_unwrapped"] = phase_of_step(second_opt, second.parameters())
    wrapped = rd.ResilientDDP(second)
    scopes["second_wrapped"] = phase_of_step(second_opt, second.parameters())
    del wrapped
    gc.collect()
    scopes["second_unwrapped_again"] = phase_of_step(second_opt, second.parameters())
    return scopes
