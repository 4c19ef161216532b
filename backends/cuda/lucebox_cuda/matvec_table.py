"""The measured defaults of the matrix-vector kernels: which variant each exact shape and batch tile takes
(`catalogue.default_variant` reads it, one arithmetic class a shape; `scripts/matvec_sweep.py` and
`scripts/probe_tuned_table.py` write tables of its form), and such a table laid over it where `LUCEBOX_MATVEC_TUNED`
names one."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

# Measured defaults (exact shapes) from scripts/matvec_sweep.py: (format, batch tile, out, in) -> variant,
# every entry of a shape in one arithmetic class (`arithmetic_class`; the sweep's `tuned_table` picks the
# class by batch-1 plus batch-23 time). `default_variant` uses a rule where a shape has no entry.
# Measured on an H200 (scripts/matvec_sweep.py, 2026-11-30 session 4; bf16 activations; the fused 27B decode
# shapes from docs/results/raw/2026-11-30-s4-matvec_sweep_fused.json, the unfused ones from
# 2026-11-30-s4-matvec_sweep_stream.json); the Gemma-4 31B / 26B-A4B shapes (marked) from
# docs/results/raw/2026-12-02-s7-matvec_sweep_gemma4.json (session 7); the Laguna-XS.2 shapes (marked) from
# docs/results/raw/2026-12-03-s15/call3_matvec_sweep.json (session 15, batch 1). The 27B's Q4_K batch-1 entries on
# `mma_pp` from scripts/tiled_probe.py on an H100 (session 29, docs/results/raw/2026-12-06-s29/): gate | up 2,170
# against `mma`'s 2,148 GB/s, down 1,785 / 1,577, attention q | gate 1,784 / 1,644, GDN qkv 1,585 / 1,541 (the
# streamed kernel it replaces); same class, same bits. (The 0.8B's down, 355 / 289, and qkv, 852 / 809, wait for a
# sweep of their verify batches: a batch-1 entry alone would also take their 2-5-row products.)
MATVEC_TUNED: dict[tuple[str, int, int, int], str] = {
    ('q4_k', 1, 48, 5120): 'pipe_w8_d3_m1_k4',
    ('q4_k', 1, 96, 5120): 'pipe_w8_d3_m1_k4',
    ('q4_k', 1, 1024, 5120): 'pipe_w8_d3_m1_k4',
    ('q4_k', 1, 5120, 6144): 'mma',
    ('q4_k', 1, 5120, 17408): 'mma_pp',
    ('q4_k', 1, 6144, 5120): 'mma',
    ('q4_k', 1, 10240, 5120): 'mma_pp',
    ('q4_k', 1, 12288, 5120): 'mma_pp',
    ('q4_k', 1, 13312, 5120): 'mma',
    ('q4_k', 1, 14336, 5120): 'mma',
    ('q4_k', 1, 16384, 5120): 'mma',
    ('q4_k', 1, 17408, 5120): 'mma',
    ('q4_k', 1, 34816, 5120): 'mma_pp',
    ('q4_k', 1, 248320, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 2, 5120, 6144): 'pipe_w4_d3_m1_k1',
    ('q4_k', 2, 5120, 17408): 'mma_r2',
    ('q4_k', 2, 6144, 5120): 'mma',
    ('q4_k', 2, 10240, 5120): 'mma_r2',
    ('q4_k', 2, 14336, 5120): 'mma',
    ('q4_k', 2, 16384, 5120): 'mma_r2',
    ('q4_k', 2, 17408, 5120): 'mma_r2',
    ('q4_k', 2, 34816, 5120): 'mma_r2',
    ('q4_k', 4, 5120, 6144): 'pipe_w4_d3_m1_k1',
    ('q4_k', 4, 5120, 17408): 'mma_r2',
    ('q4_k', 4, 6144, 5120): 'mma',
    ('q4_k', 4, 10240, 5120): 'mma_r2',
    ('q4_k', 4, 14336, 5120): 'mma_r2',
    ('q4_k', 4, 16384, 5120): 'mma_r2',
    ('q4_k', 4, 17408, 5120): 'mma_r2',
    ('q4_k', 4, 34816, 5120): 'mma_r2',
    ('q4_k', 8, 5120, 6144): 'pipe_w4_d3_m1_k1',
    ('q4_k', 8, 5120, 17408): 'mma_r2',
    ('q4_k', 8, 6144, 5120): 'mma_r2',
    ('q4_k', 8, 10240, 5120): 'mma_r2',
    ('q4_k', 8, 14336, 5120): 'pipe_w4_d3_m1_k1',
    ('q4_k', 8, 16384, 5120): 'mma_r2',
    ('q4_k', 8, 17408, 5120): 'mma_r2',
    ('q4_k', 8, 34816, 5120): 'mma_r2',
    ('q4_k', 16, 5120, 6144): 'mma',
    ('q4_k', 16, 5120, 17408): 'pipe_w4_d4_m2_k1',
    ('q4_k', 16, 6144, 5120): 'mma',
    ('q4_k', 16, 10240, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 16, 14336, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 16, 16384, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 16, 17408, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 16, 34816, 5120): 'pipe_w4_d4_m2_k1',
    ('q4_k', 24, 5120, 6144): 'mma',
    ('q4_k', 24, 5120, 17408): 'mma_r2',
    ('q4_k', 24, 6144, 5120): 'mma',
    ('q4_k', 24, 10240, 5120): 'mma_r2',
    ('q4_k', 24, 14336, 5120): 'mma_r2',
    ('q4_k', 24, 16384, 5120): 'mma_r2',
    ('q4_k', 24, 17408, 5120): 'mma_r2',
    ('q4_k', 24, 34816, 5120): 'mma_r2',
    ('q4_k', 64, 5120, 6144): 'mma_r2',
    ('q4_k', 64, 5120, 17408): 'mma_r2',
    ('q4_k', 64, 6144, 5120): 'mma_r2',
    ('q4_k', 64, 10240, 5120): 'mma_r2',
    ('q4_k', 64, 14336, 5120): 'mma_r2',
    ('q4_k', 64, 16384, 5120): 'mma_r2',
    ('q4_k', 64, 17408, 5120): 'mma_r2',
    ('q4_k', 64, 34816, 5120): 'mma_r2',
    ('q6_k', 1, 48, 5120): 'pipe_w8_d4_m1_k4',
    ('q6_k', 1, 1024, 5120): 'pipe_w8_d4_m1_k4',
    ('q6_k', 1, 5120, 6144): 'pipe_w4_d3_m1_k1',
    ('q6_k', 1, 5120, 17408): 'pipe_w4_d3_m1_k1',
    ('q6_k', 1, 6144, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 1, 10240, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 1, 12288, 5120): 'pipe_w8_d4_m1_k1',
    ('q6_k', 1, 17408, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 1, 248320, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 2, 5120, 17408): 'pipe_w4_d3_m1_k1',
    ('q6_k', 2, 10240, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 2, 248320, 5120): 'pipe_w4_d4_m2_k1',
    ('q6_k', 4, 5120, 17408): 'pipe_w4_d3_m1_k1',
    ('q6_k', 4, 10240, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 4, 248320, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 8, 5120, 17408): 'pipe_w4_d4_m2_k1',
    ('q6_k', 8, 10240, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 8, 248320, 5120): 'pipe_w4_d3_m1_k1',
    ('q6_k', 16, 5120, 17408): 'pipe_w4_d4_m1_k1',
    ('q6_k', 16, 10240, 5120): 'pipe_w4_d4_m1_k1',
    ('q6_k', 16, 248320, 5120): 'pipe_w4_d4_m2_k1',
    ('q6_k', 24, 5120, 17408): 'mma',
    ('q6_k', 24, 10240, 5120): 'pipe_w4_d4_m1_k1',
    ('q6_k', 24, 248320, 5120): 'mma_r2',
    ('q6_k', 64, 5120, 17408): 'mma_r2',
    ('q6_k', 64, 10240, 5120): 'mma',
    ('q6_k', 64, 248320, 5120): 'mma_r2',
    ('q4_k', 1, 2816, 4096): 'pipe_w4_d4_m2_k1',  # gemma4
    ('q4_k', 1, 2816, 8192): 'pipe_w4_d4_m1_k2',  # gemma4
    ('q4_k', 1, 4224, 2816): 'mma',  # gemma4
    ('q4_k', 1, 5376, 8192): 'mma',  # gemma4
    ('q4_k', 1, 5376, 16384): 'mma',  # gemma4
    ('q4_k', 1, 5376, 21504): 'mma',  # gemma4
    ('q4_k', 1, 6144, 2816): 'mma',  # gemma4
    ('q4_k', 1, 8192, 2816): 'mma',  # gemma4
    ('q4_k', 1, 9216, 2816): 'mma',  # gemma4
    ('q4_k', 1, 12288, 5376): 'pipe_w4_d4_m2_k1',  # gemma4
    ('q4_k', 1, 16384, 5376): 'mma',  # gemma4
    ('q4_k', 1, 18432, 5376): 'mma',  # gemma4
    ('q4_k', 1, 43008, 5376): 'mma',  # gemma4
    ('q4_k', 24, 2816, 4096): 'mma_r2',  # gemma4
    ('q4_k', 24, 2816, 8192): 'pipe_w4_d3_m1_k2',  # gemma4
    ('q4_k', 24, 4224, 2816): 'mma_r2',  # gemma4
    ('q4_k', 24, 5376, 8192): 'mma',  # gemma4
    ('q4_k', 24, 5376, 16384): 'mma_r2',  # gemma4
    ('q4_k', 24, 5376, 21504): 'mma_r2',  # gemma4
    ('q4_k', 24, 6144, 2816): 'mma',  # gemma4
    ('q4_k', 24, 8192, 2816): 'mma_r2',  # gemma4
    ('q4_k', 24, 9216, 2816): 'mma_r2',  # gemma4
    ('q4_k', 24, 12288, 5376): 'mma_r2',  # gemma4
    ('q4_k', 24, 16384, 5376): 'mma_r2',  # gemma4
    ('q4_k', 24, 18432, 5376): 'mma_r2',  # gemma4
    ('q4_k', 24, 43008, 5376): 'mma_r2',  # gemma4
    ('q6_k', 1, 2048, 2816): 'pipe_w8_d4_m1_k1',  # gemma4
    ('q6_k', 1, 4096, 5376): 'pipe_w4_d3_m1_k1',  # gemma4
    ('q6_k', 1, 5376, 21504): 'pipe_w4_d3_m1_k1',  # gemma4
    ('q6_k', 1, 262144, 2816): 'pipe_w4_d3_m1_k1',  # gemma4
    ('q6_k', 1, 262144, 5376): 'pipe_w4_d3_m1_k1',  # gemma4
    ('q6_k', 24, 2048, 2816): 'pipe_w8_d3_m1_k1',  # gemma4
    ('q6_k', 24, 4096, 5376): 'pipe_w4_d6_m1_k1',  # gemma4
    ('q6_k', 24, 5376, 21504): 'mma',  # gemma4
    ('q6_k', 24, 262144, 2816): 'pipe_w4_d3_m1_k1',  # gemma4
    ('q6_k', 24, 262144, 5376): 'mma_r2',  # gemma4
    ('q4_k', 1, 1024, 2048): 'mma8',  # laguna (its shared expert's [gate | up]; simt won by 0.4 us)
    ('q4_k', 1, 2048, 512): 'mma',  # laguna (simt won by 0.3 us)
    ('q4_k', 1, 2048, 6144): 'mma8',  # laguna
    ('q4_k', 1, 2048, 8192): 'mma8',  # laguna
    ('q4_k', 1, 7168, 2048): 'mma',  # laguna
    ('q4_k', 1, 8240, 2048): 'mma',  # laguna
    ('q4_k', 1, 9216, 2048): 'mma',  # laguna
    ('q4_k', 1, 10304, 2048): 'mma',  # laguna
    ('q4_k', 1, 16384, 2048): 'mma',  # laguna
    ('q6_k', 1, 1024, 2048): 'pipe_w8_d4_m1_k1',  # laguna
    ('q6_k', 1, 2048, 8192): 'pipe_w8_d4_m1_k1',  # laguna
    ('q6_k', 1, 100352, 2048): 'pipe_w4_d3_m1_k1',  # laguna
}
# Session 36 (tiled_probe.py at 2-24 rows, H200, raw/2026-12-06-s36/call3/; an H100 agreed): 16-row Q4_K products 1.03-
# 1.29x faster on `mma` than streamed (same class); 12 rows stay streamed; q | gate's 2 rows took `mma_pp` at 1,197 GB/s
# (`mma_r2`: 1,950). The 27B's 16-node verify: 19.0-19.1 -> 17.0 ms (probe_tuned_table.py, the same call).
MATVEC_TUNED.update({
    **{('q4_k', 12, out, inn): 'pipe_w4_d4_m2_k1' for out, inn in ((5120, 17408), (10240, 5120), (12288, 5120),
                                                                    (34816, 5120))},
    **{('q4_k', 16, out, inn): 'mma' for out, inn in ((5120, 17408), (10240, 5120), (12288, 5120), (34816, 5120))},
    **{('q4_k', batch, 12288, 5120): 'mma_r2' for batch in (2, 4, 8, 24)},
})


# A sweep's own table (`scripts/matvec_sweep.py` writes `tuned_table` into its matvec_sweep.json) laid over
# the measured defaults when this names that file: for timing a GPU or shapes the table has not measured
# yet, before the winners are pasted above.
TUNED_TABLE_ENV = "LUCEBOX_MATVEC_TUNED"


def _load_tuned_override() -> None:
    path = os.environ.get(TUNED_TABLE_ENV)
    if not path:
        return
    try:
        entries = json.loads(Path(path).read_text())["tuned_table"]
        table = {(str(fmt), int(batch), int(out), int(inn)): str(variant) for fmt, batch, out, inn, variant in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{TUNED_TABLE_ENV}={path}: not a matvec sweep result ({exc}); the built-in table stays",
                      RuntimeWarning, stacklevel=2)
        return
    MATVEC_TUNED.update(table)


_load_tuned_override()
