"""The README's main job: ``python -m resilient_ddp demo``, end to end with 4 ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _demo(*args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_ddp", "demo", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _rows(out: str) -> dict[int, str]:
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\d)\s{2}(\S.*)$", line)
        if m:
            rows[int(m.group(1))] = m.group(2)
    return rows


def _progress(out: str) -> list[int]:
    """The step numbers of rank 0's progress lines."""
    return [int(m) for m in re.findall(r"^  step +(\d+)  loss ", out, flags=re.MULTILINE)]


@pytest.mark.parametrize(
    ("fault", "error"), [("kill", "RankFailureError"), ("hang", "CollectiveTimeoutError")]
)
def test_demo_names_the_culprit_on_every_survivor(fault: str, error: str) -> None:
    code, out = _demo("--fault", fault, "--rank", "1", "--step", "3", "--op-timeout", "2")
    assert code == 1, out
    rows = _rows(out)
    assert set(rows) == {0, 1, 2, 3}, out
    for r in (0, 2, 3):
        fields = rows[r].split()
        assert fields[0] == error, out
        assert fields[1] == "1", out  # named exactly rank 1
    if fault == "hang":
        assert "time.sleep(3600)" in out  # the culprit's stack is shown
    # One step numbering: the step the demo injects at is the one the culprit's line names
    # (it failed before its forward pass), and the progress lines count the same way.
    assert re.search(r"fault: rank 1 .* at step 3\n", out), out
    assert re.search(r"rank 1 \(host .*\[step 3, phase 'data'", out), out
    assert _progress(out) == [0, 1, 2], out


def test_demo_without_fault_finishes_and_exits_zero() -> None:
    code, out = _demo("--fault", "none", "--steps", "4")
    assert code == 0, out
    assert all("finished 4 steps" in row for row in _rows(out).values()), out
    assert _progress(out) == [0, 1, 2, 3], out


def test_elastic_demo_goes_on_and_admits_a_replacement() -> None:
    code, out = _demo("--elastic")
    assert code == 0, out
    assert "world size  4 -> 3 -> 4 " in out, out
    assert re.search(r"failure     rank 2 died \(process \d+ is gone\) at step 20\n", out), out
    assert re.search(r"join        rank 2's replacement \(pid \d+\) joined at step \d+", out), out
    assert re.search(r"state       identical on all 4 ranks", out), out
    # Each of the 3 survivors logs one line as it goes on, and one as the replacement joins.
    assert out.count("failed at step 20; going on with 3 rank(s) (was 4)") == 3, out
    assert out.count("4 rank(s) now (was 3)") == 3, out
    assert "Training completed on every rank." in out, out
