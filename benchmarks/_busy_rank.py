"""One rank of benchmarks/bench_busy.py under torchrun or a plain env:// launcher.

``python benchmarks/_busy_rank.py OUT_DIR WORKER ARGS_JSON``: reads its rank from ``RANK``
(as torchrun and srun set it), runs ``tests._busy_workers.<WORKER>(rank, *ARGS)`` and writes
its return value to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import _busy_workers


def main() -> None:
    out, worker, args = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    value = getattr(_busy_workers, worker)(rank, *args)
    (out / f"rank{rank}.json").write_text(json.dumps(value), encoding="utf-8")


if __name__ == "__main__":
    main()
