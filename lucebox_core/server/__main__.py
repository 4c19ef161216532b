"""`python -m lucebox_core.server [serve options]`: the same as `lucebox serve`."""

import argparse
import sys

from ..errors import LuceboxError
from .cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lucebox_core.server")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except LuceboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
