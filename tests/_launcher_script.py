"""The launcher matrix's training script as a file, for torchrun and plain processes:
``python tests/_launcher_script.py OUT_DIR FAULT`` (see tests/_launcher_workers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._launcher_workers import script_main

script_main()
