"""A matrix-vector table from a tiled_probe.py run: for each shape and batch it timed, the fastest variant of the class.

    python3 scripts/probe_tuned_table.py PROBE.json TABLE.json
    LUCEBOX_MATVEC_TUNED=TABLE.json python3 scripts/verify_profile.py MODEL.gguf ...

For every probe row (a shape and a batch), the fastest of the catalogue's default and the row-major variants the probe
timed (`mma`, `mma_r2`, `mma8`) that share the default's arithmetic class (so decode and verify keep one class and the
same bits), where it is not the default, becomes an entry of `tuned_table`: the file `matvec_table.TUNED_TABLE_ENV` lays
over the built-in table. What a retune would give, measured in the same call as the table it would replace.
"""

from __future__ import annotations

import argparse
import json


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", help="a tiled_probe.py --json file")
    parser.add_argument("table", help="the table to write (matvec_sweep.py's `tuned_table` form)")
    args = parser.parse_args()
    with open(args.probe) as f:
        chosen = overrides(json.load(f))
    with open(args.table, "w") as f:
        json.dump({"tuned_table": [[*key, variant] for key, variant in sorted(chosen.items())]}, f, indent=1)
    for key, variant in sorted(chosen.items()):
        print("tuned", *key, variant, flush=True)


if __name__ == "__main__":
    main()
