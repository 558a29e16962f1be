"""The documentation's runnable samples run as written.

Every ```python block of the pages listed here is a complete script (imports, a function
per rank, ``rd.spawn`` under ``if __name__ == "__main__":``); each one runs in a fresh
interpreter and must exit 0, so that the docs cannot drift from the API.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUNNABLE_PAGES = ["inference.md"]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _samples() -> list[tuple[str, str]]:
    found = []
    for page in RUNNABLE_PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        for k, match in enumerate(_FENCE.finditer(text), start=1):
            found.append((f"{page}#{k}", match.group(1)))
    return found


def test_every_runnable_page_has_samples() -> None:
    assert {name.split("#")[0] for name, _ in _samples()} == set(RUNNABLE_PAGES)


@pytest.mark.parametrize(("name", "code"), _samples(), ids=[n for n, _ in _samples()])
def test_doc_sample_runs(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "sample.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
