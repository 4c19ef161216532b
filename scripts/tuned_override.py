"""Run a script with the matrix-vector choices a tiled_probe.py run measured fastest, within each shape's class.

    python3 scripts/tuned_override.py PROBE.json [--print] -- SCRIPT.py [ARGS...]

For every probe row (a shape and a batch), the fastest of the catalogue's default and the row-major variants the probe
timed (`mma`, `mma_r2`, `mma8`) that share the default's arithmetic class (so decode and verify keep one class and the
same bits) replaces the shape's `catalogue.MATVEC_TUNED` entry at that batch, in this process only; then SCRIPT runs as
`__main__`. What a retune of the table would give, measured in the same call as the table it would replace.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys


def overrides(rows: list[dict]) -> dict[tuple[str, int, int, int], str]:
    from lucebox_cuda import catalogue

    chosen = {}
    for row in rows:
        default = row["default_variant"]
        timed = {default: row["default_us"]}
        for variant in ("mma", "mma_r2", "mma8"):
            if f"{variant}_us" in row and catalogue.arithmetic_class(variant) == catalogue.arithmetic_class(default):
                timed[variant] = row[f"{variant}_us"]
        best = min(timed, key=timed.get)
        if best != default:
            chosen[(row["format"], row["batch"], row["out"], row["in"])] = best
    return chosen


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", help="a tiled_probe.py --json file")
    parser.add_argument("--print", action="store_true", help="print the replaced entries")
    args = parser.parse_args(sys.argv[1:split])
    script = sys.argv[split + 1:]
    if not script:
        raise SystemExit("no script to run after --")
    with open(args.probe) as f:
        chosen = overrides(json.load(f))
    from lucebox_cuda import catalogue

    catalogue.MATVEC_TUNED.update(chosen)
    if args.print:
        for key, variant in sorted(chosen.items()):
            print("tuned override", key, variant, flush=True)
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
