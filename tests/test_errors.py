"""The exception tree: types, attributes, and survival across process boundaries."""

from __future__ import annotations

import pickle
import time
from typing import TypeVar

import pytest

import resilient_ddp as rd
from resilient_ddp.errors import Culprit, decode_culprit, error_head, failure_message

T = TypeVar("T")


def _roundtrip(obj: T) -> T:
    """Pickle and unpickle, as rd.spawn does to send a rank's error to the launcher."""
    copy: T = pickle.loads(pickle.dumps(obj))  # noqa: S301 - our own bytes
    return copy


def _culprit() -> rd.Culprit:
    return rd.Culprit(
        rank=2,
        host="h2",
        pid=42,
        what="raised ValueError",
        op="all_reduce",
        seq=7,
        step=3,
        phase="backward",
        exc_type="ValueError",
        exc_message="boom",
        traceback='  File "t.py", line 1, in f',
    )


def test_tree() -> None:
    assert issubclass(rd.CollectiveTimeoutError, rd.RankFailureError)
    assert issubclass(rd.CollectiveTimeoutError, TimeoutError)
    assert issubclass(rd.ControlPlaneError, rd.RankFailureError)
    assert issubclass(rd.ConfigError, ValueError)
    for cls in (
        rd.RankFailureError,
        rd.CollectiveMismatchError,
        rd.PreflightError,
        rd.RetryBudgetExhaustedError,
        rd.SpawnError,
        rd.ConfigError,
    ):
        assert issubclass(cls, rd.ResilientDDPError)


def test_rank_failure_attributes_and_pickle() -> None:
    err = rd.CollectiveTimeoutError("msg", culprits=[_culprit()], op="all_reduce", seq=7)
    copy = _roundtrip(err)
    assert type(copy) is rd.CollectiveTimeoutError
    assert copy.ranks == (2,)
    assert copy.hosts == ("h2",)
    assert (copy.op, copy.seq, copy.generation) == ("all_reduce", 7, 0)
    assert (copy.exc_type, copy.exc_message) == ("ValueError", "boom")
    assert "line 1" in (copy.traceback or "")


def test_describe_names_what_the_culprit_was_doing() -> None:
    text = _culprit().describe()
    assert "rank 2 (host h2, pid 42) raised ValueError" in text
    assert "step 3" in text
    assert "phase 'backward'" in text
    assert "last op all_reduce#7" in text
    assert "ValueError: boom" in text


def test_mismatch_and_preflight_pickle() -> None:
    mm = rd.CollectiveMismatchError("m", table={1: {"shape": "(5,)"}}, ranks=[1], op="x", seq=3)
    assert _roundtrip(mm).table == {1: {"shape": "(5,)"}}
    pf = rd.PreflightError("p", problems=["rank 1: x"], table={0: {"torch": "2.13"}})
    copy = _roundtrip(pf)
    assert copy.problems == ("rank 1: x",)
    assert copy.table == {0: {"torch": "2.13"}}


def test_retry_budget_keeps_last_attempt() -> None:
    last = rd.CollectiveTimeoutError("late")
    err = rd.RetryBudgetExhaustedError("gave up", attempts=3, last_attempt=last)
    assert err.attempts == 3
    assert err.last_attempt is last
    with pytest.raises(rd.CollectiveTimeoutError) as info:
        err.reraise()
    assert info.value is last


def test_a_lost_store_in_the_elastic_protocol_is_a_control_plane_error() -> None:
    import torch.distributed as dist

    from resilient_ddp.training.elastic import _typed_store_errors

    @_typed_store_errors("recovery")
    def step() -> None:
        raise dist.DistNetworkError("Broken pipe")

    with pytest.raises(rd.ControlPlaneError, match="during elastic recovery") as info:
        step()
    assert isinstance(info.value.__cause__, dist.DistNetworkError)


def test_a_culprit_is_built_from_what_the_caller_has() -> None:
    info = {"host": "h2", "pid": 42, "boot": "b"}
    state = {"op": "all_reduce", "seq": 7, "step": 3, "phase": "backward", "section": "s"}
    # The JSON form (what goes on the store) keeps extra keys; the culprit drops them.
    record = rd.Culprit.record(2, "hangs", info=info, state=state, blame="LATE")
    assert record == {
        "rank": 2,
        "host": "h2",
        "pid": 42,
        "what": "hangs",
        "op": "all_reduce",
        "seq": 7,
        "step": 3,
        "phase": "backward",
        "section": "s",
        "blame": "LATE",
    }
    c = rd.Culprit.of(2, "hangs", info=info, state=state, blame="LATE")
    assert c == rd.Culprit.from_record(record)
    assert c == rd.Culprit(2, "h2", 42, "hangs", "all_reduce", 7, 3, "backward", "s")
    # Fields given override the state's; nothing known reads as the defaults.
    assert rd.Culprit.of(2, "x", state=state, step=9).step == 9
    assert rd.Culprit.of(2, "x") == rd.Culprit(2, what="x")
    # A state's wall-clock time gives its age.
    assert rd.Culprit.of(2, "x", state={"t": 0.0}).state_age is not None


def test_a_heartbeats_state_has_an_age_and_a_boards_has_none() -> None:
    """A heartbeat's state is as old as its wall-clock ``t``; a board (read from a rank
    that stopped or is gone on this host) is what it was doing when it stopped, shown
    without an age however long the report takes to build."""
    then = time.time() - 5.0
    aged = rd.Culprit.record(1, "died", state={"step": 3, "t": then})
    assert 5.0 <= aged["state_age"] < 60.0, aged
    board = rd.Culprit.record(1, "died", state={"step": 3, "t": then, "board": True})
    assert "state_age" not in board, board
    assert board["step"] == 3, board
    assert rd.Culprit.from_record(board).state_age is None


def test_error_heads_say_op_seq_rank_and_where() -> None:
    assert (
        error_head("all_reduce", 1, seq=3, generation=2) == "all_reduce#3 on rank 1 (generation 2)"
    )
    assert error_head("all_reduce", 1, seq=3, host="h") == "all_reduce#3 on rank 1 (host h)"
    assert error_head("load_and_broadcast", 0, generation=0) == (
        "load_and_broadcast on rank 0 (generation 0)"
    )
    assert error_head("distributed_inference", 4) == "distributed_inference on rank 4"


def test_a_failure_message_names_its_culprits_or_says_none_was_found() -> None:
    c = _culprit()
    assert failure_message("h", [c]) == f"h; culprit rank(s): 2\n{c.describe()}"
    assert failure_message("h", [c, c], named="failed").startswith("h; failed rank(s): 2, 2\n")
    assert failure_message("h", []) == (
        "h; every rank arrived but the data plane did not complete the op (network?)"
    )


@pytest.mark.parametrize(
    ("record", "ok"),
    [
        pytest.param(Culprit.record(1, "died", stack=None, alive=False, idle=2.0), True, id="own"),
        pytest.param({"rank": 1, "what": "late", "unknown": object()}, True, id="extra-kept"),
        pytest.param({"what": "late"}, False, id="no-rank"),
        pytest.param({"rank": "1"}, False, id="rank-str"),
        pytest.param({"rank": True}, False, id="rank-bool"),
        pytest.param({"rank": 1, "alive": 1}, False, id="alive-int"),
        pytest.param({"rank": 1, "moving": "cpu"}, False, id="moving-str"),
        pytest.param({"rank": 1, "stack": 3}, False, id="stack-int"),
        pytest.param(["rank", 1], False, id="not-an-object"),
    ],
)
def test_a_culprit_read_from_the_store_is_taken_only_with_its_fields_types(
    record: object, ok: bool
) -> None:
    assert (decode_culprit(record) is record) is ok
