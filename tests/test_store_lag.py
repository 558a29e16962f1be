"""A control-plane store that falls behind is not a lost one.

The store lives in a process of its own, as torchrun's agent store or a standalone store
does, and 3 plain processes train with ``ResilientDDP`` (``RESILIENT_DDP_STORE`` names the
store; the process group meets through a file). The store's process is then stopped with
SIGSTOP, which is what a store that falls behind looks like from the ranks (its requests
queue, nothing answers), but its host still accepts connections:

- resumed after twice ``heartbeat_timeout``: training goes on through the stall, nobody
  raises, and every rank logs that the store fell behind and answers again;
- never resumed: every rank raises ``ControlPlaneError`` after ``store_timeout``;
- killed instead: every rank raises ``ControlPlaneError`` at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ._procs import wait_for

WORLD = 3
HEARTBEAT_TIMEOUT_S = 2.0
# Stopped for good: lost after this. Resumed: a store_timeout well past the stall, since the
# first tick after the stall may need a new connection (a second or more on 2 loaded cores).
STORE_TIMEOUT_S = 5.0
RESUMED_STORE_TIMEOUT_S = 12.0
STEPS = 150
STALL_S = 2 * HEARTBEAT_TIMEOUT_S

_STORE = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""

_RANK = """
import json, sys, time, torch, resilient_ddp as rd
from datetime import timedelta
from pathlib import Path
rank, world, out, steps = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
cfg = rd.ResilienceConfig(
    heartbeat_interval=timedelta(seconds=0.2),
    heartbeat_timeout=timedelta(seconds=float(sys.argv[5])),
    store_timeout=timedelta(seconds=float(sys.argv[6])),
    op_timeout=timedelta(seconds=20),
)
rd.init_process_group("gloo", init_method=f"file://{out / 'pg'}", rank=rank, world_size=world,
                      config=cfg)
model = rd.ResilientDDP(torch.nn.Linear(4, 1))
step = 0
try:
    for step in range(1, steps + 1):
        model(torch.ones(8, 4)).sum().backward()
        (out / f".step{rank}").write_text(str(step))
        (out / f".step{rank}").replace(out / f"step{rank}")  # never read half written
        time.sleep(0.05)
    res = {"done": rd.all_reduce(torch.ones(1)).item(), "steps": step}
except rd.ResilientDDPError as e:
    res = {"type": type(e).__name__, "message": str(e)[:800], "t": time.time(), "steps": step}
finally:
    rd.destroy_process_group()
print("RESULT " + json.dumps(res), flush=True)
"""


def _steps(out: Path) -> list[int]:
    """Each rank's last step (0 before its first); a rank replaces its file whole, so a
    read never finds it empty (CI once read a file being rewritten: "0 steps")."""
    found = []
    for r in range(WORLD):
        p = out / f"step{r}"
        text = p.read_text() if p.exists() else ""
        found.append(int(text) if text.strip() else 0)
    return found


def _run(tmp_path: Path, fault: str) -> tuple[dict[int, Any], str, dict[str, float]]:
    """Start the store and the ranks, apply ``fault`` to the store once every rank trains,
    and return each rank's result, their output and when things happened."""
    store = subprocess.Popen([sys.executable, "-c", _STORE], stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None
    port = int(store.stdout.readline())
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = {**os.environ, "RESILIENT_DDP_STORE": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    env.pop("RESILIENT_DDP_JOB_ID", None)
    store_timeout = RESUMED_STORE_TIMEOUT_S if fault == "resume" else STORE_TIMEOUT_S
    args = [str(WORLD), str(tmp_path), str(STEPS), str(HEARTBEAT_TIMEOUT_S), str(store_timeout)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(WORLD)
    ]
    times: dict[str, float] = {}
    try:
        assert wait_for(lambda: min(_steps(tmp_path)) >= 20, 60), _steps(tmp_path)
        times["fault"] = time.time()
        times["steps_before"] = max(_steps(tmp_path))
        if fault == "kill":
            store.kill()
        else:
            store.send_signal(signal.SIGSTOP)
        if fault == "resume":
            time.sleep(STALL_S)
            times["steps_during"] = min(_steps(tmp_path)) - times["steps_before"]
            store.send_signal(signal.SIGCONT)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()  # a stopped process too
                p.wait()
        store.stdout.close()
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode})\n{o}"
        for r, (p, o) in enumerate(zip(procs, outs, strict=True))
    )
    results = {}
    for r, (p, o) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, report
        lines = [x for x in o.splitlines() if x.startswith("RESULT ")]
        assert lines, report
        results[r] = json.loads(lines[-1][len("RESULT ") :])
    return results, report, times


def test_a_store_that_falls_behind_and_catches_up_stops_nothing(tmp_path: Path) -> None:
    results, report, times = _run(tmp_path, "resume")
    for r in range(WORLD):
        assert results[r] == {"done": float(WORLD), "steps": STEPS}, report
    assert times["steps_during"] >= 10, (times, report)  # training went on meanwhile
    assert report.count("it has fallen behind") == WORLD, report
    assert report.count("the control-plane store answers again") == WORLD, report


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_store_that_never_answers_again_is_lost(fault: str, tmp_path: Path) -> None:
    results, report, times = _run(tmp_path, fault)
    for r in range(WORLD):
        v = results[r]
        assert v.get("type") == "ControlPlaneError", report
        after = v["t"] - times["fault"]
        if fault == "stop":
            # Not before store_timeout (it may only be behind), and soon after it.
            assert STORE_TIMEOUT_S - 0.5 < after < STORE_TIMEOUT_S + 3.0, (after, report)
            assert "fallen behind for good" in v["message"], report
        else:
            assert after < 2.0, (after, report)
        assert v["steps"] < STEPS, report
