"""The suite's start-up hook (tests/_startup/_suite_gc.py, loaded by ``nox -s tests``):
it freezes the collector's view once torch is imported, never later, and leaves what is
made afterwards to the collector (the transformers integration finds the DDP wrapper
among ``gc.get_objects()``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STARTUP = Path(__file__).resolve().parent / "_startup"

_PROBE = f"""
import gc, sys
sys.path.insert(0, {str(STARTUP)!r})
import _suite_gc
assert gc.get_freeze_count() == 0, "frozen before torch"
import torch
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
import torch._dynamo  # DDP's constructor imports it, while the wrapper being built exists
# (Frozen objects that reference counting frees leave the count: it may only fall.)
assert gc.get_freeze_count() <= frozen, "frozen again after torch._dynamo"
made = torch.nn.Linear(2, 2)
assert any(o is made for o in gc.get_objects()), "an object made afterwards is frozen"
print("ok", frozen)
"""


def test_torch_is_frozen_once_at_import_and_nothing_made_later() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok "), done.stdout
