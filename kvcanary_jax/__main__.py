"""Command line: ``python -m kvcanary_jax demo`` (the embedded default) or ``python -m kvcanary_jax example``."""

from __future__ import annotations

import argparse
import sys

from kvcanary_jax import example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcanary_jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="write, verify and tamper a chain (the fault-injection demo lands with issue 4)")
    commands.add_parser("example", help="write, verify and tamper one request's chain, printing the report")
    parser.parse_args(argv)
    found = example.run_example()
    return 0 if found > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
