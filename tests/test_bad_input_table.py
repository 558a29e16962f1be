"""Bad input gets the library's typed error (issue 29, item 10): every duration, from the
environment, the config or a call's ``timeout=``, rejects NaN, infinities, overflow,
strings, bools and absurd values with ConfigError; a bad ``src``, a module without
parameters and an object one rank cannot pickle fail every rank at once, typed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import resilient_ddp as rd
from resilient_ddp.config import LONGEST_TIMEOUT
from resilient_ddp.ops.collectives import _seconds
from resilient_ddp.testing import format_outcomes, run_ranks

from . import _bad_input_workers as w

DURATION_VARS = ("OP_TIMEOUT", "HEARTBEAT_TIMEOUT", "INIT_TIMEOUT", "BUSY_TIMEOUT", "RETRY_BACKOFF")


@pytest.mark.parametrize("var", DURATION_VARS)
@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("1e20", "at most 365 days"),  # was OverflowError
        ("1e11h", "at most 365 days"),  # was OverflowError
        ("1e400", "at most 365 days"),  # a float's infinity; was OverflowError
        ("1e9h", "at most 365 days"),  # was accepted: 114,000 years
        ("8761h", "at most 365 days"),
        ("nan", "expected a duration"),
        ("inf", "expected a duration"),
        ("-1", "expected a duration"),
        ("", "expected a duration"),
        ("5x", "expected a duration"),
        ("true", "expected a duration"),
    ],
)
def test_a_bad_duration_variable_is_a_config_error_naming_it(var: str, raw: str, says: str) -> None:
    name = f"RESILIENT_DDP_{var}"
    with pytest.raises(rd.ConfigError, match=says) as info:
        rd.ResilienceConfig.from_env({name: raw})
    assert name in str(info.value)


@pytest.mark.parametrize("raw", ["8760h", "30s", "500ms", "2m", "0.5"])
def test_a_sane_duration_variable_is_read(raw: str) -> None:
    cfg = rd.ResilienceConfig.from_env({"RESILIENT_DDP_INIT_TIMEOUT": raw})
    assert timedelta(0) < cfg.init_timeout <= LONGEST_TIMEOUT


@pytest.mark.parametrize("field", ["op_timeout", "busy_timeout", "stuck_window", "op_budget"])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (1e20, "at most 365 days"),
        (10**30, "at most 365 days"),
        (timedelta(days=366), "at most 365 days"),
        (timedelta.max, "at most 365 days"),
        ("5", "timedelta or a number of seconds"),  # pydantic read it as an ISO duration
        ("PT5S", "timedelta or a number of seconds"),
        (True, "timedelta or a number of seconds"),  # was 1 s
        (0, "positive"),
    ],
)
def test_a_bad_duration_in_the_config_is_a_config_error(field: str, value: Any, says: str) -> None:
    with pytest.raises(rd.ConfigError, match=says):
        rd.ResilienceConfig(**{field: value})


@pytest.mark.parametrize("field", ["backoff", "max_backoff"])
@pytest.mark.parametrize("value", [float("nan"), "1", True, timedelta(days=400)])
def test_a_bad_retry_pause_is_a_config_error(field: str, value: Any) -> None:
    with pytest.raises(rd.ConfigError):
        rd.RetryPolicy(**{field: value})


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), 1e300, 10**400, "5", True, timedelta.max, 365 * 86400 + 1],
)
def test_a_bad_timeout_argument_is_a_config_error(value: Any) -> None:
    with pytest.raises(rd.ConfigError):
        _seconds("timeout", value, timedelta(seconds=60))
    # rd.section's budget: checked before the section starts, with or without a runtime
    # (NaN was accepted and never ran out; "5" raised a raw ValueError only by chance).
    with pytest.raises(rd.ConfigError, match="section budget"), rd.section("s", budget=value):
        pytest.fail("the section ran")


def test_bad_arguments_fail_every_rank_at_once_typed() -> None:
    bad_rank = 1
    outcomes = run_ranks(
        w.bad_arguments,
        2,
        (bad_rank,),
        timeout=timedelta(seconds=60),
        grace=timedelta(seconds=10),
    )
    report = format_outcomes(outcomes)
    for r in (0, 1):
        assert outcomes[r].exitcode == 0, report
        v = outcomes[r].value
        for src_case in ("broadcast_src", "broadcast_object_src"):
            got = v[src_case]
            assert got["type"] == "ConfigError", (r, src_case, got)
            assert "expected 0 to 1" in got["message"], got
        for case in ("all_gather_object", "broadcast_object"):
            got = v[case]
            # Every rank, at once (the op timeout is 20 s): not a raw AttributeError on the
            # rank that failed while the other waits.
            assert got["type"] == "CollectiveMismatchError", (r, case, got)
            assert got["ranks"] == [bad_rank], got
            assert "pickle" in got["message"], got
            assert got["elapsed"] < 10.0, got
            if r == bad_rank:
                assert got["cause"] in ("AttributeError", "PicklingError", "TypeError"), got
        got = v["no_params"]
        # Ours, and still caught where DDP's bare RuntimeError was (torch's own DDP test
        # test_DistributedDataParallel_requires_grad asserts RuntimeError).
        assert {"ConfigError", "RuntimeError"} <= set(got["mro"]), got
        assert "requires a gradient" in got["message"], got
        # The group is still usable after each of them.
        for after in ("after_src", "after_gather", "after_broadcast", "after_ddp"):
            assert v[after] == 2.0, (r, after, v[after])
