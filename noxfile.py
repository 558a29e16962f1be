"""Nox sessions: ``tests`` (gloo on CPU), ``lint``, ``mypy``, ``docs``, ``benchmarks``,
``bench_ray`` (Ray Data beside our inference; benchmark only), ``demo``.

Every install passes ``-c constraints/ci.txt``. That file pins torch to the local 2.13.0
CPU wheel, and an unpinned torch would pull several GB of CUDA wheels. Sessions use the
interpreter that runs nox, so no particular ``pythonX.Y`` has to be on PATH.
"""

from __future__ import annotations

import time
from pathlib import Path

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "mypy"]

CONSTRAINTS = ("-c", "constraints/ci.txt")
ROOT = Path(__file__).resolve().parent
LINT_PATHS = ("src", "tests", "benchmarks", "noxfile.py")
# The extras of the framework integrations (pyproject.toml).
FRAMEWORKS = "lightning,accelerate,transformers"


# What nearly every process of the suite imports, in two interpreters side by side (torch
# and what it loads for DDP; the rest): its bytecode is written once, up front.
_WARM_IMPORTS = (
    "import torch, torch._dynamo, resilient_ddp",
    "import sympy, numpy, pytest, xdist, hypothesis, pydantic, tenacity",
)
_WARM = (
    "import subprocess, sys; "
    f"ps = [subprocess.Popen([sys.executable, '-c', c]) for c in {_WARM_IMPORTS!r}]; "
    "sys.exit(max(p.wait() for p in ps))"
)

# Writes the .pth file: a line that puts tests/_startup on sys.path, one that imports it.
_SUITE_GC_PTH = (
    "import pathlib, sys, sysconfig; "
    "pathlib.Path(sysconfig.get_paths()['purelib'], 'resilient_ddp_suite_gc.pth')"
    ".write_text(sys.argv[1] + '\\nimport _suite_gc\\n')"
)


def _install_for_tests(session: nox.Session) -> None:
    """Install the package with the test and framework extras, and have bytecode written.

    pip byte-compiles every module it installs, on one core (about 28 CPU-s: transformers,
    torch and sympy hold 7,000 files), though the suite imports a fraction of them; here
    it does not (``--no-compile``: the install took 14-34 s instead of 42-68 s, measured
    side by side). Instead the suite's processes write the bytecode of what they import,
    once: the session clears ``PYTHONDONTWRITEBYTECODE`` (set on this project's machines),
    or each of the ~400 fresh interpreters the suite starts (ranks under torchrun, a
    framework's launcher or ``mp.spawn``, the docs' samples) would compile torch again,
    about 7 CPU-s each. Two interpreters side by side first import what nearly all of
    them import (``_WARM``: 6 s, against 10 s for one), so that the three pytest workers
    do not all compile it at once; the package's and the tests' own modules are compiled
    as before.
    """
    # numpy is not a dependency, but without it `import torch` warns and
    # filterwarnings=error turns that warning into an error.
    # The frameworks' extras: tests/test_frameworks_mp.py runs their real packages.
    session.install(*CONSTRAINTS, "--no-compile", "-e", f".[test,{FRAMEWORKS}]", "numpy")
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: Python writes bytecode again
    # Every interpreter of the session freezes the collector's view of torch once it is
    # imported (tests/_startup/_suite_gc.py says why): a .pth file in the virtualenv.
    session.run("python", "-c", _SUITE_GC_PTH, str(ROOT / "tests" / "_startup"), silent=True)
    session.run("python", "-c", _WARM, silent=True)
    session.run("python", "-m", "compileall", "-q", "src", "tests", silent=True)


@nox.session(python=None)
def tests(session: nox.Session) -> None:
    """Run the whole test suite (gloo on CPU), the fault matrix included. Extra arguments
    go to pytest (e.g. ``--skip-slow`` to leave out the longest tests, ``--rank-start
    spawn`` to start every rank as a fresh interpreter instead of a fork-server child)."""
    _install_for_tests(session)
    # Three workers, a test file at a time each (module fixtures stay whole; the docs' sample
    # runner starts its samples once), in collection order: tests/conftest.py puts the
    # long files first (LONGEST_FILES), which xdist's default reordering (by number of
    # tests) would undo. Three on a 2-core machine: with two, both cores sat idle for 250 of
    # the 1,340 CPU-s a run had (both workers' tests waiting on a timeout at once); with
    # three, 35-50 CPU-s, and the run took 660-670 s instead of 744 s (same machine, same
    # hour). ``-- -n 0`` runs everything in one process.
    session.run(
        "pytest", "-n", "3", "--dist", "loadfile", "--no-loadscope-reorder", *session.posargs
    )


@nox.session(python=None)
def stress(session: nox.Session) -> None:
    """Run the multi-process fault tests many times under extra CPU load (default: 20
    runs, one busy-looping process); any failure is a bug. Arguments go to
    ``tests/stress_campaign.py``, e.g. ``-- --runs 5 --hogs 2 -- -k kill``."""
    _install_for_tests(session)
    session.run("python", "tests/stress_campaign.py", *session.posargs)


@nox.session(python=None)
def lint(session: nox.Session) -> None:
    """Run ruff's linter and check the formatting."""
    session.install(*CONSTRAINTS, "ruff")
    # ruff reports a missing path as an error; benchmarks/ may not exist yet.
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=None)
def mypy(session: nox.Session) -> None:
    """Type-check the package with ``mypy --strict``."""
    # With the frameworks, so that the integrations are checked against their types.
    session.install(*CONSTRAINTS, "-e", f".[{FRAMEWORKS}]", "mypy")
    session.run("mypy", "--strict", "src")


@nox.session(python=None)
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/; any mkdocs warning fails the build.

    Every code sample of the pages is run or checked by ``tests/test_docs.py`` (part of
    ``nox -s tests``; alone: ``nox -s tests -- tests/test_docs.py``).
    """
    session.install(*CONSTRAINTS, "-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=None)
def benchmarks(session: nox.Session) -> None:
    """Run every benchmark and regenerate docs/benchmarks.md and the figures in docs/img/.

    About 12 minutes on a 2-core machine; run nothing else meanwhile. Extra arguments go to
    ``benchmarks/run_all.py``: ``-- --quick`` (smoke test, written under
    benchmarks/results/quick/), ``-- --docs-only`` (render the page and redraw the figures
    from the recorded results), ``-- --only detection``.
    """
    started = time.time()  # the recorded wall time includes the install below
    # numpy: see `tests`; matplotlib (the `bench` extra) draws the figures.
    # test and the frameworks: bench_frameworks.py runs the framework tests' scripts.
    session.install(*CONSTRAINTS, "-e", f".[bench,test,{FRAMEWORKS}]", "numpy")
    session.run("python", "benchmarks/run_all.py", "--started", f"{started:.3f}", *session.posargs)


@nox.session(python=None)
def bench_ray(session: nox.Session) -> None:
    """Run ``benchmarks/bench_inference.py`` with Ray Data beside it (part (d), Ray's side).

    ``ray[data]`` is a benchmark-only dependency: no other session and no CI run installs
    it. The constraints keep torch at the local CPU wheel. Extra arguments go to the
    benchmark, e.g. ``-- --quick`` or ``-- --only ray``.
    """
    session.install(*CONSTRAINTS, "-e", ".[bench]", "numpy", "ray[data]==2.60.0")
    session.run("python", "benchmarks/bench_inference.py", *session.posargs)


@nox.session(python=None)
def demo(session: nox.Session) -> None:
    """Run ``python -m resilient_ddp demo``; extra arguments are passed on to it."""
    # numpy: see `tests`. Without it, the demo's first line would be torch's NumPy warning.
    session.install(*CONSTRAINTS, "-e", ".", "numpy")
    # The demo exits 1 when the training it shows failed, which is the point of injecting a
    # fault; for this session that is success. 2 and above are real errors.
    session.run("python", "-m", "resilient_ddp", "demo", *session.posargs, success_codes=[0, 1])
