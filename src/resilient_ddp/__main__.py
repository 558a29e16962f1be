"""Command line: ``python -m resilient_ddp demo|doctor`` (also the ``resilient-ddp`` script)."""

from __future__ import annotations

import argparse
import sys

from resilient_ddp.tools import _demo, _doctor


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="resilient-ddp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train on local gloo ranks, inject a fault, show what every rank saw "
        "(--elastic: the others go on and a replacement joins)",
        description=_demo.__doc__,
    )
    _demo.add_arguments(demo)
    doctor = sub.add_parser(
        "doctor",
        help="check start-up, all_reduce latency/bandwidth and step-time skew; suggest fixes",
        description=_doctor.__doc__,
    )
    _doctor.add_arguments(doctor)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo.run(args)
    if args.command == "doctor":
        return _doctor.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
