"""Distributed inference on real gloo ranks: gather to rank 0, state sharing, the whole loop.

Bounds as for every collective (issue 2): a crash is known on every rank within 2 s, a
stall within the op timeout + 2 s, a divergence within 2 s.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _inference_workers as w

DEADLINE = timedelta(seconds=45)


def _values(
    fn: Any, world: int, *args: Any, ranks: list[int] | None = None, grace: float = 10.0
) -> dict[int, Any]:
    outcomes = run_ranks(fn, world, args, timeout=DEADLINE, grace=timedelta(seconds=grace))
    report = format_outcomes(outcomes)
    for r in ranks if ranks is not None else range(world):
        assert outcomes[r].exitcode == 0, report
    return {r: outcomes[r].value for r in (ranks if ranks is not None else range(world))}


def test_gather_uneven_counts_shapes_and_objects_reach_rank0_only_in_order() -> None:
    values = _values(w.gather_healthy, 3, 3, w.N_ITEMS)
    rank0 = values[0]
    assert rank0["tensors_ok"], "tensors with indices: not the dataset, in order"
    assert rank0["objects_ok"], "objects without indices: not every rank's, in rank order"
    assert rank0["rows_ok"]
    assert rank0["row_storage"] == 3 * 4, "a row arrived with its whole batch's storage"
    assert rank0["nothing"] == [0, 2]
    assert values[1] == {"all_none": True}
    assert values[2] == {"all_none": True}


@pytest.mark.parametrize(
    ("kind", "culprits"),
    [
        ("dtype", [1]),
        ("objects", [1]),
        ("no_indices", [1]),
        ("duplicate", [0, 1]),
        ("missing", [1]),
        ("other_op", [1]),
    ],
)
def test_gather_mismatch_is_the_same_error_on_every_rank(kind: str, culprits: list[int]) -> None:
    values = _values(w.gather_fault, 3, kind, 1)
    for r, v in values.items():
        assert isinstance(v, dict), (r, v)
        assert v["type"] == "CollectiveMismatchError", (r, v)
        assert v["ranks"] == culprits, (r, v["message"])
        assert v["elapsed"] < 2.0, (r, v["elapsed"])
    message = values[0]["message"]
    if kind == "dtype":
        assert "tensor float64" in message
        assert "tensor float32" in message
    if kind == "duplicate":
        assert "sent more than once" in message
    if kind == "missing":
        assert "outside range(9)" in message
        assert "missing: [5]" in message


def test_gather_entry_a_sender_cannot_pickle_is_named_on_every_rank() -> None:
    outcomes = run_ranks(w.gather_fault, 3, ("unpicklable", 1), timeout=DEADLINE)
    assert outcomes[1].exitcode == 1, format_outcomes(outcomes)
    assert outcomes[1].exc_type in ("PicklingError", "AttributeError"), outcomes[1].exc_type
    for r in (0, 2):
        v = outcomes[r].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v["type"] == "CollectiveMismatchError", v
        assert v["ranks"] == [1]
        assert v["elapsed"] < 2.0


def test_gather_entry_rank0_cannot_unpickle_is_named_on_every_rank() -> None:
    values = _values(w.gather_fault, 3, "fails_to_load", 2)
    for v in values.values():
        assert v["type"] == "CollectiveMismatchError", v
        assert v["ranks"] == [2]
        assert "LookupError: no such class on rank 0" in v["message"]
        assert v["elapsed"] < 2.0


def test_gather_rank_that_never_calls_is_named_with_its_stack() -> None:
    values = _values(w.gather_fault, 3, "late", 2, ranks=[0, 1], grace=2.0)
    for v in values.values():
        assert v["type"] == "CollectiveTimeoutError", v
        assert v["ranks"] == [2], v["message"]
        assert v["elapsed"] < w.FAST["op_timeout"] + 2.0
        assert "slow_data_loader" in v["stacks"][0]


def test_gather_rank_killed_mid_stream_is_named_within_2s() -> None:
    outcomes = run_ranks(
        w.gather_fault, 3, ("kill_mid_stream", 2), timeout=DEADLINE, grace=timedelta(seconds=10)
    )
    assert outcomes[2].exitcode == -9, format_outcomes(outcomes)
    for r in (0, 1):
        v = outcomes[r].value
        assert outcomes[r].exitcode == 0, format_outcomes(outcomes)
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [2], v["message"]
        assert v["elapsed"] < 2.0


def test_gather_memory_of_a_sending_rank_stays_near_its_own_data() -> None:
    mib, chunk_mib = 96, 4
    # Cold ranks: a fork of the fork server starts from the server's heap and peak RSS,
    # which blur a peak measured in MiB (37 MiB against a 24 MiB bound, once in CI).
    # The peak is VmHWM reset before the call (peak_rss_mib): ru_maxrss survives exec, and
    # ranks spawned by a 682 MiB pytest showed no growth at all (CI, once).
    outcomes = run_ranks(
        w.gather_memory, 3, (mib, chunk_mib, "ours"), timeout=DEADLINE, start_method="spawn"
    )
    assert all(o.exitcode == 0 for o in outcomes), format_outcomes(outcomes)
    got = {o.rank: o.value for o in outcomes}
    assert got[0]["items"] == 3 * mib * 256, got  # every row reached rank 0
    # Rank 1 holds 96 MiB of rows; sending them costs one 4 MiB piece and one row's pickle
    # (+4 MiB measured on a quiet machine); the list-based all_gather_object holds twice
    # the data. The resident peak also moves with malloc's caching and reclaimed code pages
    # (+14 MiB once in CI), so it bounds a copy of the data; the piece is bounded exactly
    # by test_inference_unit's Python heap measure.
    for r in (1, 2):
        grew = got[r]["grew"]
        assert grew < mib / 2, f"rank {r}'s peak grew by {grew:.1f} MiB sending {mib} MiB"
    # Rank 0 holds everyone's: at least the other two ranks' data.
    assert got[0]["grew"] > 1.5 * mib, got


def test_broadcast_state_dict_gives_every_rank_the_same_bits() -> None:
    # 1000-byte chunks: tensors span chunk boundaries, and some chunks hold several.
    values = _values(w.share_state, 3, 1000)
    assert values[0] == {"same": True, "is_sent": True}
    assert values[1] == values[2] == {"same": True, "is_sent": False}


def test_load_and_broadcast_reads_on_one_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save(w.state(), path)
    values = _values(w.load_shared, 3, str(path))
    assert all(v == {"same": True} for v in values.values()), values


def test_load_and_broadcast_missing_file_is_named_on_every_rank(tmp_path: Path) -> None:
    values = _values(w.load_shared, 3, str(tmp_path / "missing.pt"))
    assert values[1]["type"] == "FileNotFoundError"
    for r in (0, 2):
        v = values[r]
        assert v["type"] == "RankFailureError", v
        assert v["ranks"] == [1]
        assert v["exc_type"] == "FileNotFoundError"
        assert v["elapsed"] < 2.0


def test_broadcast_state_dict_source_that_cannot_pickle_is_named() -> None:
    outcomes = run_ranks(w.share_fault, 3, ("sparse",), timeout=DEADLINE)
    assert outcomes[0].value["type"] == "ConfigError", format_outcomes(outcomes)
    assert "dense tensors only" in outcomes[0].value["message"]
    for r in (1, 2):
        v = outcomes[r].value
        assert v["type"] == "CollectiveMismatchError", v
        assert v["ranks"] == [0]
        assert v["elapsed"] < 2.0


def test_broadcast_state_dict_source_killed_is_named() -> None:
    outcomes = run_ranks(w.share_fault, 3, ("dies",), timeout=DEADLINE)
    for r in (1, 2):
        v = outcomes[r].value
        assert v["type"] == "RankFailureError", format_outcomes(outcomes)
        assert v["ranks"] == [0]
        assert v["elapsed"] < 2.0


def test_send_state_dict_reaches_its_receivers_only() -> None:
    values = _values(w.send_state, 3, "ok")
    assert values[0] == {"got": True, "after": 3.0}  # the sender gets its own dict back
    assert values[1] == {"got": "none", "after": 3.0}
    assert values[2] == {"got": True, "after": 3.0}


def test_send_state_dict_names_a_receiver_that_died() -> None:
    outcomes = run_ranks(w.send_state, 3, ("dies",), timeout=DEADLINE)
    v = outcomes[0].value
    assert v["type"] == "RankFailureError", format_outcomes(outcomes)
    assert v["ranks"] == [2]
    assert v["elapsed"] < 2.0


def test_distributed_inference_matches_one_process_exactly() -> None:
    values = _values(w.inference, 3, w.N_ITEMS, None)
    rank0 = values[0]
    assert rank0["n"] == w.N_ITEMS
    assert rank0["in_order"]
    assert rank0["accuracy"] == rank0["ref_accuracy"]
    assert rank0["max_diff"] < 1e-5
    # Ranks ran different numbers of forwards through one ResilientDDP model, which DDP's
    # per-forward buffer broadcast would have paired up wrongly.
    batches = {values[r]["batches"] for r in range(3)}
    assert len(batches) > 1, values
    assert values[1]["none"]
    assert values[2]["none"]
    calls = rank0["calls"]
    assert calls[-1] == (w.N_ITEMS, w.N_ITEMS)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls)), calls


def test_distributed_inference_failure_in_fn_is_named_on_every_rank() -> None:
    # on_rank_failure="raise": the behaviour before issue 28 (redo is tested in
    # test_inference_pool_mp.py).
    outcomes = run_ranks(w.inference, 3, (w.N_ITEMS, 2, 0.0, "raise"), timeout=DEADLINE)
    assert outcomes[2].exc_type == "ValueError", format_outcomes(outcomes)
    for r in (0, 1):
        v = outcomes[r].value
        assert v["type"] == "RankFailureError", format_outcomes(outcomes)
        assert v["ranks"] == [2]
        assert v["exc_type"] == "ValueError"
        assert v["elapsed"] < 2.0


def test_gather_survives_a_receiver_slower_than_one_wait_slice() -> None:
    values = _values(w.gather_slow_receiver, 3, 0.4)
    assert values == {0: True, 1: None, 2: None}


def test_distributed_inference_waits_for_a_slow_rank_that_makes_progress() -> None:
    # Rank 2 needs about 10 x 0.5 s, far beyond the 1.5 s op timeout, but finishes a batch
    # every 0.5 s: the others wait for it instead of timing out. (on_rank_failure="raise":
    # planned shares; with pulled chunks a slow rank simply takes fewer, see
    # test_inference_pool_mp.py.)
    values = _values(w.inference, 3, w.N_ITEMS, None, 0.5, "raise")
    assert values[0]["n"] == w.N_ITEMS
    assert values[0]["in_order"]
    # Rank 0's progress bar saw the other ranks' items while rank 2 was still going.
    shares = {r: values[r]["items"] for r in range(3)}
    seen = [done for done, _ in values[0]["calls"]]
    assert any(shares[0] < done < w.N_ITEMS for done in seen), (shares, seen)


def test_distributed_inference_names_a_stuck_rank_with_its_stack() -> None:
    outcomes = run_ranks(
        w.inference,
        3,
        (w.N_ITEMS, None, 30.0, "raise"),
        timeout=DEADLINE,
        grace=timedelta(seconds=2),
    )
    for r in (0, 1):
        v = outcomes[r].value
        assert isinstance(v, dict), format_outcomes(outcomes)
        assert v["type"] == "CollectiveTimeoutError", v
        assert v["ranks"] == [2], (r, v["message"])
        assert "slow_data_loader" in v["stacks"][0]
        assert "phase 'inference'" in v["message"]
        assert v["elapsed"] < w.FAST["op_timeout"] + 2.0
