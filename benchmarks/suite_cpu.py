"""Where the test suite's time goes: each test's wall time and the machine's CPU time.

A pytest plugin. Run the suite in one process on an otherwise idle machine, so that the
machine's CPU time during a test is that test's (its ranks, launchers and helpers
included, which the test process's own counters miss)::

    python -m pytest -p benchmarks.suite_cpu -n 0 -q tests
    python benchmarks/suite_cpu.py suite-cpu.tsv      # per file, then the file order

Each test appends ``nodeid<TAB>wall_s<TAB>cpu_s`` to ``$SUITE_CPU_OUT`` (default
``suite-cpu.tsv``). Run as a script on that file, it prints each file's totals and the
order of the long files that the simulation of ``nox -s tests``'s workers (three;
``--workers``) finds shortest (see :func:`simulate`): what ``LONGEST_FILES`` in
tests/conftest.py holds.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Generator, Sequence
from typing import Any

import pytest

_OUT = os.environ.get("SUITE_CPU_OUT", "suite-cpu.tsv")


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    c0, t0 = machine_cpu_s(), time.monotonic()
    yield
    with open(_OUT, "a", encoding="utf-8") as f:
        f.write(f"{item.nodeid}\t{time.monotonic() - t0:.2f}\t{machine_cpu_s() - c0:.2f}\n")


def simulate(
    order: Sequence[str], wall: dict[str, float], cpu: dict[str, float], workers: int = 3
) -> float:
    """The wall time of running the files in ``order`` on ``workers`` workers (each takes
    the next file when it is free) on 2 cores: a file alone needs ``cpu/wall`` cores; files
    that need more than 2 together all slow down in proportion."""
    queue, running, t = list(order), {}, 0.0
    while queue or running:
        while len(running) < workers and queue:
            f = queue.pop(0)
            running[f] = 1.0  # the fraction of the file left
        need = sum(min(2.0, cpu[f] / wall[f]) for f in running if wall[f] > 0)
        rate = min(1.0, 2.0 / need) if need > 0 else 1.0
        dt = max(1e-6, min(left * wall[f] / rate for f, left in running.items()))
        t += dt
        for f in list(running):
            running[f] -= dt * rate / wall[f] if wall[f] > 0 else 1.0
            if running[f] <= 1e-9:
                del running[f]
    return t


def best_order(
    wall: dict[str, float], cpu: dict[str, float], workers: int = 3, tries: int = 20000
) -> list[str]:
    """Swap pairs of files at random (the longest stays first), keeping any swap that
    shortens :func:`simulate`; the files of 8 s or more, in that order."""
    order = sorted(wall, key=lambda f: -wall[f])
    best = simulate(order, wall, cpu, workers)
    rng = random.Random(1)
    for _ in range(tries):
        cand = list(order)
        i, j = rng.sample(range(1, len(cand)), 2)
        cand[i], cand[j] = cand[j], cand[i]
        t = simulate(cand, wall, cpu, workers)
        if t < best:
            order, best = cand, t
    return [f for f in order if wall[f] >= 8.0]


def main(path: str, workers: int) -> None:
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            node, w, c = line.rstrip("\n").split("\t")
            name = node.split("::")[0].rsplit("/", 1)[-1]
            wall[name] = wall.get(name, 0.0) + float(w)
            cpu[name] = cpu.get(name, 0.0) + float(c)
    for name in sorted(wall, key=lambda n: -cpu[n]):
        print(f"{wall[name]:8.1f} s {cpu[name]:8.1f} CPU-s  {name}")
    print(f"{sum(wall.values()):8.1f} s {sum(cpu.values()):8.1f} CPU-s  in all")
    order = best_order(wall, cpu, workers)
    rest = [f for f in wall if f not in order]
    longest = sorted(wall, key=lambda f: -wall[f])
    print(f"simulated, {workers} workers: longest first ", end="")
    print(f"{simulate(longest, wall, cpu, workers):.0f} s, ", end="")
    print(f"this order {simulate(order + rest, wall, cpu, workers):.0f} s:")
    print("\n".join(order))


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Each file's time, and the order of the long files.")
    cli.add_argument("path", nargs="?", default=_OUT, help="the plugin's output (suite-cpu.tsv)")
    cli.add_argument("--workers", type=int, default=3, help="nox -s tests's xdist workers (3)")
    a = cli.parse_args()
    main(a.path, a.workers)
