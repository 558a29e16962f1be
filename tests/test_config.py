"""ResilienceConfig: validation, fractional seconds, the environment."""

from __future__ import annotations

from datetime import timedelta

import pytest

import resilient_ddp as rd
from resilient_ddp import ConfigError, ResilienceConfig, RetryPolicy, get_config, set_config
from resilient_ddp.config import resolve


def test_fractional_seconds_are_kept() -> None:
    cfg = rd.ResilienceConfig(op_timeout=0.5, heartbeat_interval=0.25)
    assert cfg.op_timeout == timedelta(milliseconds=500)
    assert cfg.heartbeat_interval == timedelta(milliseconds=250)


def test_defaults_and_effective_budget() -> None:
    cfg = rd.ResilienceConfig()
    assert cfg.validate_collectives is False
    assert cfg.effective_op_budget == cfg.op_timeout
    assert rd.ResilienceConfig(op_timeout=2, op_budget=5).effective_op_budget == timedelta(
        seconds=5
    )


def test_validate_alias_and_frozen() -> None:
    cfg = rd.ResilienceConfig(validate=True)
    assert cfg.validate_collectives is True
    with pytest.raises(Exception, match="frozen"):
        cfg.op_timeout = timedelta(seconds=1)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"op_timeout": -1}, ["op_timeout", "must be positive"]),
        ({"op_timeout": 0.001}, ["op_timeout", "at least 2 ms"]),
        ({"heartbeat_timeout": 0.1}, ["heartbeat_timeout", "heartbeat_interval"]),
        ({"op_timeout": 10, "op_budget": 5}, ["op_budget", "at least op_timeout"]),
        ({"retry": {"attempts": 0}}, ["attempts", "greater than or equal to 1"]),
        ({"nope": 1}, ["nope", "Extra inputs"]),
    ],
)
def test_bad_values_name_field_value_and_rule(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(rd.ConfigError) as info:
        rd.ResilienceConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_from_env_reads_every_kind_of_value() -> None:
    env = {
        "RESILIENT_DDP_OP_TIMEOUT": "250ms",
        "RESILIENT_DDP_OP_BUDGET": "2m",
        "RESILIENT_DDP_HEARTBEAT_INTERVAL": "0.2",
        "RESILIENT_DDP_VALIDATE": "yes",
        "RESILIENT_DDP_RETRY_ATTEMPTS": "3",
        "PATH": "/bin",
    }
    cfg = rd.ResilienceConfig.from_env(env)
    assert cfg.op_timeout == timedelta(milliseconds=250)
    assert cfg.op_budget == timedelta(minutes=2)
    assert cfg.heartbeat_interval == timedelta(milliseconds=200)
    assert cfg.validate_collectives is True
    assert cfg.retry.attempts == 3


def test_from_env_overrides_win() -> None:
    cfg = rd.ResilienceConfig.from_env({"RESILIENT_DDP_OP_TIMEOUT": "5"}, op_timeout=7)
    assert cfg.op_timeout == timedelta(seconds=7)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RESILIENT_DDP_OP_TIMOUT": "1"}, ["Unknown", "RESILIENT_DDP_OP_TIMOUT"]),
        ({"RESILIENT_DDP_OP_TIMEOUT": "soon"}, ["RESILIENT_DDP_OP_TIMEOUT='soon'", "duration"]),
        ({"RESILIENT_DDP_VALIDATE": "maybe"}, ["RESILIENT_DDP_VALIDATE", "boolean"]),
        ({"RESILIENT_DDP_OP_TIMEOUT": "0"}, ["op_timeout", "positive"]),
    ],
)
def test_from_env_errors_name_the_variable(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(rd.ConfigError) as info:
        rd.ResilienceConfig.from_env(env)
    for word in words:
        assert word in str(info.value)


def test_process_wide_config() -> None:
    cfg = rd.ResilienceConfig(op_timeout=3)
    rd.set_config(cfg)
    try:
        assert rd.get_config() is cfg
    finally:
        rd.set_config(None)
    assert rd.get_config() == rd.ResilienceConfig()


def test_resolve_reads_the_environment_by_default() -> None:
    env = {"RESILIENT_DDP_OP_TIMEOUT": "10s", "RESILIENT_DDP_HEARTBEAT_INTERVAL": "0.25"}
    cfg = resolve(None, env)
    assert cfg.op_timeout == timedelta(seconds=10)
    assert cfg.heartbeat_interval == timedelta(milliseconds=250)
    assert cfg.init_timeout == ResilienceConfig().init_timeout  # the default fills the rest


def test_resolve_code_wins_field_by_field_over_the_environment() -> None:
    env = {"RESILIENT_DDP_OP_TIMEOUT": "10s", "RESILIENT_DDP_INIT_TIMEOUT": "7s"}
    # Set in code, even to the default value: the code wins for that field only.
    cfg = resolve(ResilienceConfig(op_timeout=timedelta(seconds=60)), env)
    assert cfg.op_timeout == timedelta(seconds=60)
    assert cfg.init_timeout == timedelta(seconds=7)


def test_resolve_merges_retry_fields() -> None:
    env = {"RESILIENT_DDP_RETRY_BACKOFF": "1s", "RESILIENT_DDP_RETRY_ATTEMPTS": "5"}
    cfg = resolve(ResilienceConfig(retry=RetryPolicy(attempts=2)), env)
    assert cfg.retry.attempts == 2
    assert cfg.retry.backoff == timedelta(seconds=1)


def test_resolve_rejects_a_misspelt_variable() -> None:
    with pytest.raises(ConfigError, match="RESILIENT_DDP_OP_TIMOUT"):
        resolve(None, {"RESILIENT_DDP_OP_TIMOUT": "2s"})


def test_resolve_without_variables_returns_the_given_config() -> None:
    cfg = ResilienceConfig(op_timeout=timedelta(seconds=3))
    assert resolve(cfg, {"PATH": "/bin"}) is cfg
    assert resolve(None, {}) == ResilienceConfig()


def test_get_config_completes_set_config_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RESILIENT_DDP_HEARTBEAT_TIMEOUT", "9s")
    set_config(ResilienceConfig(op_timeout=timedelta(seconds=4)))
    try:
        cfg = get_config()
    finally:
        set_config(None)
    assert cfg.op_timeout == timedelta(seconds=4)
    assert cfg.heartbeat_timeout == timedelta(seconds=9)
