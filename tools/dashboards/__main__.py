"""`python -m tools.dashboards [--check]`: see tools/dashboards/__init__.py."""

from __future__ import annotations

import argparse
import sys

from tools.dashboards import problems, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dashboards",
                                     description="Write the Grafana dashboards' JSON files.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed file differs from the generated one")
    args = parser.parse_args(argv)
    if not args.check:
        for path in write():
            print(f"wrote {path}")
        return 0
    found = problems()
    for line in found:
        print(f"docker/grafana/dashboards/{line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
