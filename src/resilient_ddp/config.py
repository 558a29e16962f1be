"""Configuration: one frozen :class:`ResilienceConfig` holds every budget and policy.

Durations are :class:`datetime.timedelta` (fractional seconds are kept).

Where a value comes from, first match wins, field by field:

1. arguments in code: the fields given to a :class:`ResilienceConfig` passed to
   ``init_process_group(config=...)``, ``ResilientDDP(resilience=...)`` or
   :func:`set_config`;
2. the environment: ``RESILIENT_DDP_<FIELD>`` variables (see :meth:`ResilienceConfig.from_env`),
   so that whoever launches the job (a SLURM script, a torchrun command line, a Kubernetes
   spec) can set budgets without touching the code;
3. the defaults.

The environment is read by :func:`resolve` (and so by :func:`get_config`) when the library
starts up a rank, never at import.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from resilient_ddp.errors import ConfigError

__all__ = ["ResilienceConfig", "RetryPolicy", "get_config", "resolve", "set_config"]

#: A budget or timeout as callers may give it: a timedelta, or seconds as a number
#: (``None``: the default of the call).
Duration = timedelta | float | int | None

_ENV_PREFIX = "RESILIENT_DDP_"
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_SECONDS = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


# c10d reads a timeout that rounds down to 0 ms as "no timeout at all"; keep a margin.
SHORTEST_TIMEOUT = timedelta(milliseconds=2)
# Longer is a mistake (a unit slip: "1e9h"), not a budget: no training job waits a year.
LONGEST_TIMEOUT = timedelta(days=365)
_MS = timedelta(milliseconds=1)


def _positive(name: str, value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError(f"The {name} ({value}) must be positive.")
    if value < SHORTEST_TIMEOUT:
        raise ValueError(f"The {name} ({value}) must be at least 2 ms.")
    if value > LONGEST_TIMEOUT:
        raise ValueError(f"The {name} ({value}) must be at most {LONGEST_TIMEOUT.days} days.")
    return value


def _not_a_duration(name: str, value: Any) -> str:
    return (
        f"The {name} should be a timedelta or a number of seconds, "
        f"got {type(value).__name__} {value!r}."
    )


def _duration_input(name: str, value: Any) -> Any:
    """A config duration as given in code: a timedelta or a real number of seconds, never
    a string or a bool (pydantic would read ``"5"`` as an ISO duration, ``True`` as 1 s)."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(_not_a_duration(name, value))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"The {name} ({value}) must be a finite number of seconds.")
    if abs(value) > LONGEST_TIMEOUT.total_seconds():  # ints beyond a float included
        raise ValueError(f"The {name} ({value} s) must be at most {LONGEST_TIMEOUT.days} days.")
    return value


_DURATION_FIELDS = (
    "op_timeout",
    "op_budget",
    "stuck_window",
    "busy_timeout",
    "heartbeat_interval",
    "heartbeat_timeout",
    "store_timeout",
    "init_timeout",
    "diagnosis_timeout",
    "straggler_interval",
    "join_startup_timeout",
)


def duration_seconds(name: str, value: Any, default: timedelta | None = None) -> float:
    """``value`` (a timedelta, or seconds as a real number) in seconds; ``default`` when
    ``None``.

    Raises:
        ConfigError: ``value`` is of another type (a string, a bool, or ``None`` without a
            default), not a number (NaN), not positive, below 2 ms, or over 365 days
            (``LONGEST_TIMEOUT``; infinities and ints beyond a float included).
    """
    if value is None and default is not None:
        return default.total_seconds()
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond a float's range
            seconds = math.inf
    else:
        raise ConfigError(_not_a_duration(name, value))
    if math.isnan(seconds):
        raise ConfigError(f"The {name} ({value}) is not a number.")
    if seconds <= 0:
        raise ConfigError(f"The {name} ({value}) must be positive.")
    if seconds > LONGEST_TIMEOUT.total_seconds():
        raise ConfigError(
            f"The {name} ({value}) must be finite and at most {LONGEST_TIMEOUT.days} days "
            f"({LONGEST_TIMEOUT.total_seconds():.0f} s)."
        )
    if seconds < SHORTEST_TIMEOUT.total_seconds():
        raise ConfigError(f"The {name} ({value}) must be at least {SHORTEST_TIMEOUT // _MS} ms.")
    return seconds


class _Model(BaseModel):
    """Frozen model whose validation errors surface as :class:`ConfigError`."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e)) from e


class RetryPolicy(_Model):
    """How a failed collective attempt is retried as a group decision.

    A retry never re-issues a collective on one rank alone: every rank must fail the same
    attempt, agree through the store, and rebuild the group before the op is redone (with
    in-place inputs restored first).

    Attributes:
        attempts: Total attempts, including the first (1 = no retry).
        backoff: Pause before the second attempt; doubles after each attempt.
        max_backoff: Upper bound on the pause between attempts.
    """

    attempts: int = Field(default=1, ge=1, le=100)
    backoff: timedelta = timedelta(milliseconds=100)
    max_backoff: timedelta = timedelta(seconds=2)

    @field_validator("backoff", "max_backoff", mode="before")
    @classmethod
    def _check_duration_type(cls, v: Any, info: Any) -> Any:
        return _duration_input(info.field_name, v)

    @field_validator("backoff", "max_backoff")
    @classmethod
    def _non_negative(cls, v: timedelta, info: Any) -> timedelta:
        if v < timedelta(0):
            raise ValueError(f"The {info.field_name} ({v}) must not be negative.")
        if v > LONGEST_TIMEOUT:
            raise ValueError(
                f"The {info.field_name} ({v}) must be at most {LONGEST_TIMEOUT.days} days."
            )
        return v


class ResilienceConfig(_Model):
    """Every budget and policy of resilient_ddp, validated and immutable.

    Args:
        op_timeout: How long one attempt of a collective may wait before the ranks that have
            not arrived are diagnosed (default 60 s). When set (in code or by
            ``RESILIENT_DDP_OP_TIMEOUT``), it is also a hard limit: a collective waits no
            longer than ``op_budget`` (``op_timeout`` when unset) even for a rank that is
            busy. When left unset, a late rank that makes progress is waited for up to
            ``busy_timeout``.
        op_budget: Total time a collective may take, including waiting longer on a slow but
            alive peer and retries. ``None`` means equal to ``op_timeout``.
        stuck_window: A rank that has not arrived at a collective and whose progress
            signals (its main thread's CPU time, Python stack and I/O, CUDA work,
            :func:`resilient_ddp.progress` calls) did not move for this long is named as
            stuck at once, whatever ``op_timeout`` says. ``None`` (default): six heartbeat
            intervals and at least 3 s, longer for an op whose waits have usually been
            longer (learned per op name while the job runs).
        busy_timeout: How long a collective waits for a late rank whose progress signals
            keep moving (it evaluates, compiles, writes a checkpoint) when ``op_timeout``
            is not set (default 30 min, gloo's own process-group timeout). Its peers log
            what it is doing meanwhile.
        heartbeat_interval: How often each rank's watchdog publishes its heartbeat and reads
            failure reports (default 0.5 s). Failure detection latency is about this.
        heartbeat_timeout: A rank whose heartbeat has not changed for this long is declared
            dead (default 15 s). Covers frozen hosts and SIGSTOP.
        store_timeout: How long the control-plane store may go without answering while its
            host still accepts connections (it has fallen behind, or its process is stopped
            or overloaded) before the control plane is declared lost (default 60 s). A
            store whose process is gone, or whose host cannot be reached, is declared lost
            after ``heartbeat_timeout`` plus two heartbeat intervals instead. Taken as at
            least that.
        init_timeout: Budget for process-group initialisation and rendezvous (default 300 s).
        diagnosis_timeout: How long a rank that timed out waits for the late ranks to report
            where they are (default 1 s).
        validate: Compare op, shape, dtype and sequence number across ranks before every
            collective and raise :class:`CollectiveMismatchError` on a difference.
        retry: Group-decision retry policy for collectives.
        stack_depth: How many innermost frames of a stuck rank's main thread are reported.
        straggler_margin: A rank whose median step compute time exceeds the group median by
            more than this fraction (0.3 = 30 %) on three checks in a row is reported as a
            straggler (a warning on rank 0; never an error).
        straggler_interval: How often rank 0 checks for stragglers (default 10 s).
        on_failure: ``"raise"`` (default): every rank raises the typed error; pair it with
            torchrun's restarts and checkpoints. ``"shrink"``: ``ResilientDDP`` training
            goes on with the survivors (a new generation of the group, state made
            identical, the failed step redone or skipped) and admits replacements.
        min_world_size: With ``on_failure="shrink"``, the fewest ranks training may go on
            with (default 1); below it every survivor raises :class:`RankFailureError`.
        join_startup_timeout: With ``on_failure="shrink"``, how long a process that was
            just admitted may take from its admission (the return of
            ``rd.init_process_group``) to its first collective: building the model and the
            optimizer, starting DataLoader workers, its first forward (default 60 s). The
            members wait for it that long in the step that admitted it, past
            ``op_timeout``; a joiner that overruns it is reported with its stack and
            removed like any failed rank.
        event_log: Path of a JSON-lines file to which each rank appends the job's
            resilience events (failure, shrink, join, straggler), one object per line;
            ``{rank}`` in the path is replaced by the rank of the process's first event
            (a process keeps its file when elastic training renumbers the ranks).
            Default: none.
    """

    op_timeout: timedelta = timedelta(seconds=60)
    op_budget: timedelta | None = None
    stuck_window: timedelta | None = None
    busy_timeout: timedelta = timedelta(minutes=30)
    heartbeat_interval: timedelta = timedelta(milliseconds=500)
    heartbeat_timeout: timedelta = timedelta(seconds=15)
    store_timeout: timedelta = timedelta(seconds=60)
    init_timeout: timedelta = timedelta(seconds=300)
    diagnosis_timeout: timedelta = timedelta(seconds=1)
    validate_collectives: bool = Field(default=False, alias="validate")
    retry: RetryPolicy = RetryPolicy()
    stack_depth: int = Field(default=8, ge=1, le=100)
    straggler_margin: float = Field(default=0.3, ge=0.0)
    straggler_interval: timedelta = timedelta(seconds=10)
    on_failure: Literal["raise", "shrink"] = "raise"
    min_world_size: int = Field(default=1, ge=1)
    join_startup_timeout: timedelta = timedelta(seconds=60)
    event_log: str | None = None

    @field_validator(*_DURATION_FIELDS)
    @classmethod
    def _check_positive(cls, v: timedelta | None, info: Any) -> timedelta | None:
        return None if v is None else _positive(info.field_name, v)

    @field_validator(*_DURATION_FIELDS, mode="before")
    @classmethod
    def _check_duration_type(cls, v: Any, info: Any) -> Any:
        return _duration_input(info.field_name, v)

    @model_validator(mode="after")
    def _check_relations(self) -> ResilienceConfig:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be longer than "
                f"heartbeat_interval ({self.heartbeat_interval})."
            )
        if self.op_budget is not None and self.op_budget < self.op_timeout:
            raise ValueError(
                f"op_budget ({self.op_budget}) must be at least op_timeout ({self.op_timeout})."
            )
        return self

    @property
    def effective_op_budget(self) -> timedelta:
        """``op_budget``, or ``op_timeout`` when no budget was set."""
        return self.op_budget if self.op_budget is not None else self.op_timeout

    @property
    def op_limit_set(self) -> bool:
        """Whether ``op_timeout`` or ``op_budget`` was set (in code or the environment):
        then it is a hard limit of every collective, a busy rank included."""
        return bool({"op_timeout", "op_budget"} & self.model_fields_set)

    def op_bounds(self) -> tuple[timedelta | None, timedelta | None]:
        """``(timeout, budget)`` for an op bounded by this config: its ``op_timeout`` and
        effective op budget when a limit was set (:attr:`op_limit_set`), else
        ``(None, None)``, so that the op follows the runtime's config and waits for a busy
        rank up to ``busy_timeout``."""
        if self.op_limit_set:
            return self.op_timeout, self.effective_op_budget
        return None, None

    @property
    def base_stuck_window(self) -> float:
        """The stuck window before any learning (seconds): ``stuck_window`` if set, else
        six heartbeat intervals and at least 3 s."""
        if self.stuck_window is not None:
            return self.stuck_window.total_seconds()
        return max(3.0, 6 * self.heartbeat_interval.total_seconds())

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> ResilienceConfig:
        """Build a config from ``RESILIENT_DDP_*`` environment variables.

        Each field ``name`` is read from ``RESILIENT_DDP_<NAME>``; retry fields from
        ``RESILIENT_DDP_RETRY_ATTEMPTS``, ``..._RETRY_BACKOFF`` and ``..._RETRY_MAX_BACKOFF``.
        Durations accept a number of seconds (``"0.5"``) or a unit suffix
        (``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``); booleans accept 1/0, true/false, yes/no.

        Args:
            environ: Mapping to read instead of ``os.environ``.
            **overrides: Field values that take precedence over the environment.

        Raises:
            ConfigError: A variable is unknown (a likely typo) or its value is invalid; the
                message names the variable, the value and the rule.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        retry: dict[str, Any] = {}
        known = _env_fields()
        for key, raw in env.items():
            if not key.startswith(_ENV_PREFIX):
                continue
            name = key[len(_ENV_PREFIX) :].lower()
            if name in _IGNORED_ENV:
                continue
            if name not in known:
                raise ConfigError(
                    f"Unknown environment variable {key}={raw!r}; known: "
                    + ", ".join(_ENV_PREFIX + k.upper() for k in sorted(known))
                )
            kind, target = known[name]
            try:
                value = _parse_env(kind, raw)
            except ValueError as e:
                raise ConfigError(f"{key}={raw!r}: {e}") from None
            if target.startswith("retry."):
                retry[target[len("retry.") :]] = value
            else:
                values[target] = value
        given_retry = overrides.get("retry")
        if retry and isinstance(given_retry, RetryPolicy):
            # Field by field here too: what the code set wins, the environment fills in.
            overrides = {
                **overrides,
                "retry": {
                    **retry,
                    **{k: getattr(given_retry, k) for k in given_retry.model_fields_set},
                },
            }
        if retry:
            values["retry"] = retry
        values.update(overrides)
        return cls(**values)


# Variables under the prefix that belong to the launcher/runtime, not to the config.
_IGNORED_ENV = frozenset(
    {"store", "joiner", "uid", "job_id", "secret", "fault", "allow_unsupported_torch"}
    | {"secret_file"}  # the file that holds the job's secret (see _control.operator_secret)
)


def _env_fields() -> dict[str, tuple[str, str]]:
    fields: dict[str, tuple[str, str]] = {}
    for name, info in ResilienceConfig.model_fields.items():
        if name == "retry":
            continue
        public = info.alias or name
        fields[public] = (_kind_of(info.annotation), name)
    for name, info in RetryPolicy.model_fields.items():
        fields[f"retry_{name}"] = (_kind_of(info.annotation), f"retry.{name}")
    return fields


def _kind_of(annotation: Any) -> str:
    text = str(annotation)
    if "timedelta" in text:
        return "duration"
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "int"
    return "str"


def _parse_env(kind: str, raw: str) -> Any:
    if kind == "duration":
        return parse_duration(raw)
    if kind == "bool":
        low = raw.strip().lower()
        if low in {"1", "true", "yes", "on"}:
            return True
        if low in {"0", "false", "no", "off"}:
            return False
        raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected an integer") from None
    return raw


def parse_duration(raw: str) -> timedelta:
    """Parse ``"0.5"``, ``"500ms"``, ``"30s"``, ``"2m"`` or ``"1h"`` into a timedelta.

    Raises:
        ValueError: The text is not a non-negative number with an optional unit, or it is
            longer than ``LONGEST_TIMEOUT`` (365 days; ``1e400`` and ``1e20`` included).
    """
    m = _DURATION_RE.match(raw)
    if not m:
        raise ValueError("expected a duration: seconds as a number, or with a unit ms/s/m/h")
    seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    if not seconds <= LONGEST_TIMEOUT.total_seconds():  # also catches inf ("1e400")
        raise ValueError(f"expected a duration of at most {LONGEST_TIMEOUT.days} days")
    return timedelta(seconds=seconds)


def _format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}={err.get('input')!r}: {msg}" if loc else msg)
    return f"Invalid {e.title}: " + "; ".join(parts)


_process_config: ResilienceConfig | None = None


def set_config(config: ResilienceConfig | None) -> None:
    """Set the process-wide default config (``None`` restores the built-in defaults).

    The fields given to ``config`` in code take precedence over ``RESILIENT_DDP_*``
    variables; the others still come from the environment (see :func:`resolve`).
    """
    global _process_config
    _process_config = config


def get_config() -> ResilienceConfig:
    """Return the process-wide config: :func:`set_config`'s, completed from the environment.

    Raises:
        ConfigError: A ``RESILIENT_DDP_*`` variable is unknown or its value is invalid.
    """
    return resolve(_process_config)


def resolve(
    config: ResilienceConfig | None, environ: Mapping[str, str] | None = None
) -> ResilienceConfig:
    """The config a rank runs under: the fields set in ``config`` (in code) first, then
    ``RESILIENT_DDP_*`` variables, then the defaults.

    A field counts as set in code when it was passed to the constructor (pydantic's
    ``model_fields_set``), even if its value equals the default.

    Args:
        config: The config given in code, or ``None``.
        environ: Mapping to read instead of ``os.environ``.

    Raises:
        ConfigError: A ``RESILIENT_DDP_*`` variable is unknown (a likely typo) or invalid,
            or the combination is invalid (e.g. the environment's ``heartbeat_interval`` is
            not shorter than the code's ``heartbeat_timeout``).
    """
    env = os.environ if environ is None else environ
    if not any(key.startswith(_ENV_PREFIX) for key in env):
        return config if config is not None else _DEFAULT  # the common case: nothing to merge
    given = {} if config is None else {k: getattr(config, k) for k in config.model_fields_set}
    return ResilienceConfig.from_env(env, **given)


_DEFAULT = ResilienceConfig()
