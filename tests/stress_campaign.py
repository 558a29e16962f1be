"""Run the multi-process fault tests again and again under extra CPU load; report every failure.

The flakiness budget is zero: a test that fails once in twenty runs on a loaded machine is
a bug (fix it, never retry). This script is how the runs are made::

    python3 -m nox -s stress -- --runs 20 --hogs 1
    python tests/stress_campaign.py --runs 3 --hogs 2 --files tests/test_ddp_mp.py -- -k kill

Each run is one pytest process over the fault test files (pytest options after ``--``).
``--hogs N`` busy-loops N extra processes for the whole campaign (``stress --cpu N``; on a
2-core machine one hog takes half of it away from the ranks). The summary gives, per run,
the wall time and the tests that failed, and the junit XML of every run is kept under
``--out``. Exit status: 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The tests that kill, raise, stop, hang and diverge ranks, under every launcher.
FAULT_FILES = (
    "tests/test_busy_mp.py",
    "tests/test_collectives_mp.py",
    "tests/test_ddp_mp.py",
    "tests/test_elastic_mp.py",
    "tests/test_inference_mp.py",
    "tests/test_preflight_mp.py",
    "tests/test_launchers_mp.py",
    "tests/test_field_mp.py",
    "tests/test_exit.py",
)


def _hog() -> None:
    while True:
        pass


def _failures(xml: Path) -> list[str]:
    if not xml.exists():
        return ["(no junit report: pytest itself failed)"]
    out = []
    for case in ET.parse(xml).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname')}::{case.get('name')}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=1, help="busy-looping processes")
    parser.add_argument("--out", type=Path, default=ROOT / "stress-results")
    parser.add_argument(
        "--files", nargs="+", default=list(FAULT_FILES), help="test files (default: all)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    results: list[tuple[int, float, list[str]]] = []
    try:
        for i in range(1, args.runs + 1):
            xml = args.out / f"run{i:02d}.xml"
            xml.unlink(missing_ok=True)
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += [f"--junitxml={xml}", *args.files, *args.pytest_args]
            with open(args.out / f"run{i:02d}.log", "w") as log:
                subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
            took = time.monotonic() - t0
            failed = _failures(xml)
            results.append((i, took, failed))
            status = "ok" if not failed else f"FAILED: {', '.join(failed)}"
            print(f"run {i:2d}/{args.runs}: {took:6.1f} s  {status}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    bad = [r for r in results if r[2]]
    print(
        f"\n{len(results) - len(bad)} of {len(results)} runs passed with {args.hogs} "
        f"busy-looping process(es) beside them; logs and junit XML in {args.out}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
