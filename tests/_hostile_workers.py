"""A hostile client of a job's control-plane store, and ranks that start one beside them.

The attacker is a separate process that reaches the job's store (as anyone who reaches its
port could) but does not know the job's secret: it reads the job id from ``rd/current``
and writes fake failure events, garbage values, a join request and inflated recovery
proposals under the job's namespace for ``seconds`` seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from resilient_ddp.control import _control as ctl

from . import _elastic_workers as w

_CURRENT = ctl.CURRENT_JOB_KEY


def _fake_event(rank: int, kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "rank": rank,
        "host": "attacker",
        "pid": 1,
        "what": "was forged by a hostile client",
        "t": time.time(),
        "seq": 0,
        "op": "all_reduce",
    }


def attack(store_addr: str, seconds: float, out_path: str) -> None:
    """Write forged and garbage records into the job's namespace for ``seconds``."""
    import torch.distributed as dist

    host, _, port = store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    store.wait([_CURRENT], timedelta(seconds=30))
    job = store.get(_CURRENT).decode()
    root = dist.PrefixStore(ctl.job_prefix(job), store)
    writes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for gen in range(4):
            g = f"g{gen}"
            for rank in range(4):
                # Fake failures: plain JSON, and a line with a made-up MAC in front.
                for kind in ("crash", "exception", "unresponsive"):
                    ev = json.dumps(_fake_event(rank, kind))
                    root.append(f"{g}/ev/log", ev + "\n")
                    root.append(f"{g}/ev/log", "0" * 32 + " " + ev + "\n")
                root.append(f"{g}/ev/log", "\x00garbage{{{\n")
                root.add(f"{g}/ev/n", 3)
            # Garbage over a heartbeat (the rank rewrites it at its next beat).
            root.set(f"{g}/state/1", b"\xff\xfe not json")
            # Inflated recovery proposals: rank 1 "committed" a billion steps.
            for r in range(3):
                prop = {"rank": 1, "uid": 1, "committed": 10**9, "where": "reduce", "grads": True}
                root.append(f"rec/g{gen}/r{r}/log", json.dumps(prop) + "\n")
            # Garbage planted in decision slots the job has not used yet.
            for key in (f"grow/g{gen}", f"rec/g{gen}/r1/d", f"rec/g{gen}/r2/d"):
                root.compare_set(key, "", "garbage")
        # A join request without the secret, with its admission forged too.
        req = {"uid": 4242, "host": "attacker", "pid": 1}
        root.append("join/log", json.dumps(req) + "\n")
        root.append("join/log", "junk\n")
        root.add("join/n", 1)
        root.set("join/adm/4242", json.dumps({"gen": 99, "rank": 3, "members": [0, 1, 2, 4242]}))
        root.set("ended", json.dumps({"step": 1, "failed": "forged end"}))
        writes += 1
        time.sleep(0.05)
    with open(out_path, "w") as f:
        json.dump({"writes": writes, "job": job}, f)


def train_beside_attacker(
    rank: int, out_dir: str, faults: list[dict[str, Any]], epochs: int, seconds: float
) -> dict[str, Any]:
    """``_elastic_workers.train``; the first process of rank 0 also starts the attacker,
    without the job's secret in its environment."""
    proc = None
    if rank == 0 and "RESILIENT_DDP_JOINER" not in os.environ:
        env = {k: v for k, v in os.environ.items() if k != "RESILIENT_DDP_SECRET"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests._hostile_workers import attack; "
                "attack(sys.argv[1], float(sys.argv[2]), sys.argv[3])",
                os.environ["RESILIENT_DDP_STORE"],
                str(seconds),
                os.path.join(out_dir, "attacker.json"),
            ],
            env=env,
            cwd=os.getcwd(),
        )
    try:
        stats = w.train(rank, out_dir, faults, epochs, {}, 0.01)
    finally:
        if proc is not None:
            try:
                proc.wait(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if proc is not None:
        stats["attacker_exit"] = proc.returncode
    return stats
