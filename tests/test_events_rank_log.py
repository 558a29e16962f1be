"""The library's one rank-aware logger (issue 27): ``_events.rank_log`` writes ``rank N: ``
in front of a line, N from the identity ``_runtime`` registers (``set_identity``) or from a
runtime in hand (``rank_log.of``); ``warn_once`` says a warning once per key. In one
process, with fake identities: no process group."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from resilient_ddp.config import ResilienceConfig
from resilient_ddp.control import _events
from resilient_ddp.runtime import _runtime
from resilient_ddp.runtime._runtime import Runtime


@pytest.fixture(autouse=True)
def _debug(caplog: pytest.LogCaptureFixture) -> None:
    """Capture the ``resilient_ddp`` logger from DEBUG up."""
    caplog.set_level(logging.DEBUG, logger="resilient_ddp")


@pytest.fixture
def fresh_once() -> Iterator[None]:
    """The module loggers' warn_once memory, emptied before and after."""
    _events.rank_log.forget()
    _events.plain_log.forget()
    yield
    _events.rank_log.forget()
    _events.plain_log.forget()


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_line_names_the_current_rank_read_when_it_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    who: list[tuple[int, int] | None] = [(3, 0)]
    monkeypatch.setattr(_events, "_identity", lambda: who[0])
    _events.rank_log.warning("forming generation %d failed: %s", 2, "boom")
    who[0] = (1, 2)  # renumbered by a shrink
    _events.rank_log.info("kept the store up %.1f s for the peers", 1.25)
    who[0] = None  # no runtime (any more)
    _events.rank_log.error("%s", "100% sure")
    assert _lines(caplog) == [
        "rank 3: forming generation 2 failed: boom",
        "rank 1: kept the store up 1.2 s for the peers",
        "100% sure",
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.ERROR]


def test_of_names_the_runtime_in_hand_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_events, "_identity", lambda: (0, 0))
    owner = SimpleNamespace(rank=5)  # an inference guest's runtime, say
    logger = _events.rank_log.of(owner)
    logger.warning("distributed_inference: item %d raised (%s: %s)", 7, "ValueError", "x")
    owner.rank = 2
    logger.debug("a store call timed out, its host accepts connections")
    assert _lines(caplog) == [
        "rank 5: distributed_inference: item 7 raised (ValueError: x)",
        "rank 2: a store call timed out, its host accepts connections",
    ]


def test_exceptions_and_arguments_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    logger = _events.rank_log.of(SimpleNamespace(rank=1))
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logger.exception("a failure listener raised; going on")
    (record,) = caplog.records
    assert record.getMessage() == "rank 1: a failure listener raised; going on"
    assert record.exc_info is not None
    assert record.exc_info[0] is ZeroDivisionError
    assert record.funcName == "test_exceptions_and_arguments_pass_through"


@pytest.mark.usefixtures("fresh_once")
def test_warn_once_warns_once_per_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_events, "_identity", lambda: (4, 0))
    said = [
        _events.rank_log.warn_once(("malformed", "event"), "skipped a malformed %s", "event"),
        _events.rank_log.warn_once(("malformed", "event"), "skipped a malformed %s", "event"),
        _events.rank_log.warn_once(("malformed", "state"), "skipped a malformed %s", "state"),
        _events.plain_log.warn_once("dropped", "the event log %s is not keeping up", "f"),
        _events.plain_log.warn_once("dropped", "the event log %s is not keeping up", "f"),
    ]
    assert said == [True, False, True, True, False]
    assert _lines(caplog) == [
        "rank 4: skipped a malformed event",
        "rank 4: skipped a malformed state",
        "the event log f is not keeping up",  # plain_log: no rank prefix
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    # The record points at the caller, not at warn_once.
    assert {r.funcName for r in caplog.records} == {"test_warn_once_warns_once_per_key"}


def test_each_logger_made_by_of_remembers_its_own_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = SimpleNamespace(rank=0)
    first, second = _events.rank_log.of(owner), _events.rank_log.of(owner)  # two watchdogs
    assert first.warn_once("k", "once here")
    assert not first.warn_once("k", "once here")
    assert second.warn_once("k", "once here")
    assert _lines(caplog) == ["rank 0: once here"] * 2


def test_the_rank_filter_reads_the_registered_identity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    record = logging.LogRecord("resilient_ddp", logging.INFO, __file__, 1, "m", None, None)
    monkeypatch.setattr(_events, "_identity", lambda: (6, 3))
    assert _events.RankFilter().filter(record)
    assert (record.rank, record.generation) == (6, 3)  # type: ignore[attr-defined]
    monkeypatch.setattr(_events, "_identity", lambda: None)
    assert _events.RankFilter().filter(record)
    assert (record.rank, record.generation) == ("-", "-")  # type: ignore[attr-defined]


def test_the_runtime_registers_its_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ResilienceConfig(heartbeat_timeout=timedelta(seconds=30))
    rt = Runtime(rank=2, world_size=4, backend="gloo", control_root=dist.HashStore(), config=config)
    monkeypatch.setattr(_runtime, "_runtime", None)
    assert _events.identity() is None
    monkeypatch.setattr(_runtime, "_runtime", rt)
    assert _events.identity() == (2, 0)
