"""The library's optimizer hooks act only on optimizers over a ``ResilientDDP``'s
parameters (issue 17, "Scope"): an unrelated optimizer in the same process (a local
discriminator, an EMA, a probe) keeps its gradients on a skipped step, is not shipped
with the elastic state, and marks no phase."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _scope_workers as w


def test_a_skipped_step_leaves_an_unrelated_optimizer_alone(tmp_path: Path) -> None:
    outcomes = run_ranks(
        w.skip_leaves_other_optimizers,
        3,
        (str(tmp_path),),
        timeout=timedelta(seconds=40),
        grace=timedelta(seconds=30),
    )
    report = format_outcomes(outcomes)
    assert outcomes[2].exitcode == -9, report
    for o in outcomes[:2]:
        assert o.exitcode == 0, report
        v = o.value
        # The model's step SKIP_AT was discarded on both survivors ...
        assert v["outcomes"] == ["skip"], (v, report)
        assert v["skipped_steps"] == 1, v
        assert v["world_size"] == 2, v
        moved = [s != w.SKIP_AT for s in range(w.STEPS)]
        assert v["model_moved"] == moved, v
        # ... as a whole, the model's optimizer's extra parameter included ...
        assert v["scale_moved"] == moved, v
        # ... while the discriminator stepped as it does with no library at all, its
        # gradients intact at every step.
        assert v["disc_same"] == [True] * w.STEPS, v
        assert v["disc_grads"] == [True] * w.STEPS, v
        # Only the model's optimizer is tracked, and only its state is shipped.
        assert v["tracked"] == ["model"], v
        assert v["shipped_optim"] == 1, v


def test_phases_and_steps_follow_only_the_models_optimizer() -> None:
    outcomes = run_ranks(w.phases_follow_the_models_optimizer, 3, timeout=timedelta(seconds=40))
    report = format_outcomes(outcomes)
    assert all(o.exitcode == 0 for o in outcomes), report
    for o in outcomes:
        v = o.value
        for step in range(2):
            # An unrelated step after the model's backward: the phase stays
            # "after_backward" and the step count (step + 1 completed) is not published.
            assert v[f"other_after_backward{step}"] == {
                "before": ("after_backward", step),
                "after": ("after_backward", step),
            }, v
            # The model's optimizer marks "optimizer" inside, "data" after, and publishes.
            assert v[f"model{step}"] == {
                "before": ("after_backward", step),
                "after": ("data", step + 1),
            }, v
            assert v[f"other_in_data{step}"] == {
                "before": ("data", step + 1),
                "after": ("data", step + 1),
            }, v
        assert (
            v["inside"]
            == [
                ("other", "after_backward"),
                ("model", "optimizer"),
                ("other", "data"),
            ]
            * 2
        ), v
        assert v["scopes"] == {
            "probe": "probe",
            "probe+model": "data",
            "second_unwrapped": "probe",
            "second_wrapped": "data",
            "second_unwrapped_again": "probe",
        }, v
