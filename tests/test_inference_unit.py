"""Single-process parts of distributed inference: splitting results, the progress bar, the
wire format of gathered entries."""

from __future__ import annotations

import pytest
import torch

from resilient_ddp import ConfigError
from resilient_ddp.inference.inference import _Bar, _split
from resilient_ddp.ops._wire import dumps, loads


def test_split_gives_one_result_per_item() -> None:
    out = _split(torch.arange(6).reshape(3, 2), 3)
    assert [t.tolist() for t in out] == [[0, 1], [2, 3], [4, 5]]
    assert _split(["a", "b"], 2) == ["a", "b"]
    rows = _split({"y": torch.tensor([1, 2]), "name": ["p", "q"]}, 2)
    assert [(int(r["y"]), r["name"]) for r in rows] == [(1, "p"), (2, "q")]
    pairs = _split((torch.tensor([5, 6]), ["u", "v"]), 2)
    assert [(int(a), b) for a, b in pairs] == [(5, "u"), (6, "v")]


@pytest.mark.parametrize(
    ("out", "said"),
    [
        (torch.zeros(4, 2), "a tensor of shape (4, 2)"),
        (torch.tensor(1.0), "a tensor of shape ()"),
        (["a"], "a list of 1"),
        (3.5, "a float"),
    ],
)
def test_split_rejects_results_that_are_not_one_per_item(out: object, said: str) -> None:
    with pytest.raises(ConfigError, match="for a batch of 3 item") as info:
        _split(out, 3)
    assert said in str(info.value)
    assert "first dimension 3" in str(info.value)


def test_progress_bar_prints_a_line_per_tenth_without_a_tty(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bar = _Bar(200)
    for done in range(0, 201, 5):
        bar.update(done, 200)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10  # 10 %, 20 %, ..., 100 %
    assert lines[-1].startswith("inference [")
    assert "200/200 items (100%" in lines[-1]


def test_compact_pickling_sends_a_view_without_its_base() -> None:
    batch = torch.randn(1000, 16)
    row = loads(dumps({"row": batch[7], "n": 1}, compact_tensors=True))
    assert torch.equal(row["row"], batch[7])
    assert row["row"].untyped_storage().nbytes() == 16 * 4
    whole = dumps(batch[7])  # torch's own pickling keeps the base
    assert whole.numel() > 1000 * 16 * 4


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.tensor([True, False]),
        torch.randn(3, 2).to(torch.bfloat16),
        torch.randn(4, 3).t(),
        torch.randn(2, dtype=torch.complex64),
    ],
)
def test_compact_pickling_keeps_dtype_shape_and_values(t: torch.Tensor) -> None:
    back = loads(dumps(t, compact_tensors=True))
    assert back.dtype == t.dtype
    assert back.shape == t.shape
    assert torch.equal(back, t)


# Run in a fresh single-threaded interpreter: tracemalloc.stop() can crash CPython 3.11
# while another thread allocates (a rank's gloo thread did, once), and this one has none.
_PIECES_PEAK = """
import sys, tracemalloc
import torch
from resilient_ddp.inference.gather import _pieces
rows = list(torch.randn(int(sys.argv[1]) * 256, 1024).unbind(0))  # 4 KiB rows
chunk = int(sys.argv[2]) << 20
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
for piece in _pieces(rows, torch.arange(len(rows)), chunk):
    pass
print((tracemalloc.get_traced_memory()[1] - before) / (1 << 20))
"""


def test_sending_pieces_holds_one_piece_of_python_memory() -> None:
    """Cutting 48 MiB of rows into 4 MiB pieces holds one piece and one row's pickle at a
    time (the Python heap's exact peak): growing a piece by reallocation held two pieces
    and more, and the list-based all_gather_object holds twice the data."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PIECES_PEAK, "48", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    peak = float(done.stdout.split()[-1])
    assert 4.0 <= peak < 4.5, f"the pieces held {peak:.2f} MiB of Python memory at once"


@pytest.mark.parametrize("with_indices", [False, True])
def test_gather_pieces_stay_within_chunk_bytes_and_parse_back(with_indices: bool) -> None:
    from resilient_ddp.inference.gather import _parse, _pieces

    # Rows of 400 floats (1.6 KB pickled), one of 3000 (larger than a piece), then more rows.
    entries: list[object] = [torch.full((400,), float(i)) for i in range(10)]
    entries.insert(4, torch.arange(3000.0))
    entries.append({"text": "x" * 50})
    idx = torch.arange(100, 100 + len(entries)) if with_indices else None
    got: list[object] = []
    ids: list[torch.Tensor] = []
    sizes = []
    for piece in _pieces(entries, idx, 4000):
        sizes.append(piece.numel())
        part, part_ids = _parse(piece.clone())  # the buffer is reused by the next piece
        got.extend(part)
        if part_ids is not None:
            ids.append(part_ids)
    big = [n for n in sizes if n > 4000]
    assert len(big) == 1, sizes  # the large entry alone, in its own piece
    assert big[0] > 12000, sizes
    assert len(sizes) >= 5, sizes  # two 1.6 KB rows per 4000-byte piece
    assert len(got) == len(entries)
    for a, b in zip(got, entries, strict=True):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert torch.equal(a, b)
        else:
            assert a == b
    if with_indices:
        assert idx is not None
        assert torch.equal(torch.cat(ids), idx)
    else:
        assert ids == []
