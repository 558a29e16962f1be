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


def _compile(session: nox.Session) -> None:
    """Write the bytecode of the package and the tests (``__pycache__``, ignored by git).

    The suite starts about 400 fresh interpreters (ranks under torchrun, a framework's
    launcher or ``mp.spawn``, the docs' samples), and each imports the package and a test
    module. Where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's machines), none of
    them writes the bytecode it compiled, so each compiled them again: 0.1 s of CPU a
    process. They read the bytecode written here (pip wrote the installed packages')."""
    session.run("python", "-m", "compileall", "-q", "src", "tests", silent=True)


@nox.session(python=None)
def tests(session: nox.Session) -> None:
    """Run the whole test suite (gloo on CPU), the fault matrix included. Extra arguments
    go to pytest (e.g. ``--skip-slow`` to leave out the longest tests, ``--rank-start
    spawn`` to start every rank as a fresh interpreter instead of a fork-server child)."""
    # numpy is not a dependency, but without it `import torch` warns and
    # filterwarnings=error turns that warning into an error.
    # The frameworks' extras: tests/test_frameworks_mp.py runs their real packages.
    session.install(*CONSTRAINTS, "-e", f".[test,{FRAMEWORKS}]", "numpy")
    _compile(session)
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
    session.install(*CONSTRAINTS, "-e", f".[test,{FRAMEWORKS}]", "numpy")
    _compile(session)
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
