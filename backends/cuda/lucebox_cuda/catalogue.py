"""The catalogue of kernels: which `.cu` file holds each, how an instantiation is named and written.

Every kernel is a template instantiated by a macro line appended to its source (`LUCEBOX_MATVEC(q4_k,
bf16, 1)` defines `matvec_q4_k_bf16_1`), so a process compiles only the instantiations it uses, each its
own small cached program. Pure Python: usable without a GPU (the compile tests use it).

Two matrix-vector kernels: `matvec.cu` (CUDA cores, one warp per output row, every format) and
`matvec_mma.cu` (tensor cores, 16 output rows per block of 4 warps, the K-quants). `matvec_kernel`
picks one and says how to launch it.
"""

from __future__ import annotations

import attrs
import torch
from gguf.constants import GGMLQuantizationType as T

from .nvrtc import KernelProgram

# GGUF weight formats with a decoder in gguf_blocks.cuh, and the multiple their rows must be of.
WEIGHT_FORMATS: dict[T, str] = {
    T.Q4_K: "q4_k",
    T.Q5_K: "q5_k",
    T.Q6_K: "q6_k",
    T.Q8_0: "q8_0",
    T.F16: "f16",
    T.BF16: "bf16",
    T.F32: "f32",
}
ROW_MULTIPLE: dict[str, int] = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "q8_0": 32, "f16": 8, "bf16": 8, "f32": 8}

# Activation dtypes the kernels read and write (they compute in fp32 whatever the storage).
ACTIVATIONS: dict[torch.dtype, str] = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Activation-row counts the matrix-vector kernel is built for; a batch uses the smallest that holds it.
# Up to 8 every count has its own kernel (decode and short drafts waste nothing); beyond, a few steps.
BATCH_SIZES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MAX_BATCH = BATCH_SIZES[-1]

MATVEC_WARPS = 4  # LUCEBOX_MATVEC_WARPS in matvec.cu: one output row per warp

# The tensor-core kernel: formats it decodes, rows per block (the mma's M), threads per block
# (LUCEBOX_MMA_WARPS in matvec_mma.cu), and the largest batch tile per activation (fp32 activations take
# three bf16 columns each, so fewer rows fit the same registers).
MMA_FORMATS: tuple[str, ...] = ("q4_k", "q5_k", "q6_k")
MMA_ROWS_PER_BLOCK = 16
MMA_MAX_BATCH: dict[str, int] = {"bf16": 64, "f16": 64, "f32": 8}
# Variant -> (name prefix, warps per block): "mma8" splits each row over 8 warps instead of 4.
MMA_VARIANTS: dict[str, tuple[str, int]] = {"mma": ("matvec_mma", 4), "mma8": ("matvec_mma8", 8)}
MATVEC_VARIANTS = (*MMA_VARIANTS, "simt")
# Where the 8-warp kernel was measured faster (H200, docs/results/2026-11-30-h200-cuda-matvec-v2.md):
# Q4_K/Q5_K with at most 4 activation rows and 8192 to 65536 output rows (17408 x 5120: 26.9 us against
# 28.7 at batch 1, 30.4 against 41.4 at batch 4), where the 4-warp grid ends in a part-empty wave. Q6_K,
# larger batches, few row groups (5120 rows) and the many-wave output head lose with it.
MMA8_FORMATS = ("q4_k", "q5_k")
MMA8_MAX_BATCH = 4
MMA8_OUT_FEATURES = range(8192, 65537)


def batch_tile(rows: int) -> int:
    """The kernel batch size that serves `rows` activation rows (1 <= rows <= MAX_BATCH)."""
    for size in BATCH_SIZES:
        if size >= rows:
            return size
    raise ValueError(f"{rows} activation rows exceed the matrix-vector kernel's maximum of {MAX_BATCH}")


def matvec(weight_format: str, activation: str, batch: int) -> tuple[KernelProgram, str]:
    name = f"matvec_{weight_format}_{activation}_{batch}"
    return KernelProgram("matvec.cu", [f"LUCEBOX_MATVEC({weight_format}, {activation}, {batch})"]), name


def matvec_mma(weight_format: str, activation: str, batch: int, variant: str = "mma") -> tuple[KernelProgram, str]:
    prefix, _ = MMA_VARIANTS[variant]
    macro = "LUCEBOX_MATVEC_MMA" if variant == "mma" else "LUCEBOX_MATVEC_MMA8"
    name = f"{prefix}_{weight_format}_{activation}_{batch}"
    return KernelProgram("matvec_mma.cu", [f"{macro}({weight_format}, {activation}, {batch})"]), name


@attrs.frozen
class MatvecLaunch:
    """One matrix-vector kernel and its launch shape (1-D grid and block)."""

    program: KernelProgram
    name: str
    grid: int
    block: int
    variant: str


def has_mma_kernel(weight_format: str, activation: str, rows: int) -> bool:
    return weight_format in MMA_FORMATS and batch_tile(rows) <= MMA_MAX_BATCH[activation]


def matvec_kernel(weight_format: str, activation: str, rows: int, out_features: int,
                  variant: str | None = None) -> MatvecLaunch:
    """The kernel for `rows` activation rows times a weight of `out_features` rows: a tensor-core
    one where it exists (or `variant`, one of MATVEC_VARIANTS, when given: the check script times all)."""
    tile = batch_tile(rows)
    if variant is None:
        if not has_mma_kernel(weight_format, activation, rows):
            variant = "simt"
        else:
            eight = (weight_format in MMA8_FORMATS and tile <= MMA8_MAX_BATCH
                     and out_features in MMA8_OUT_FEATURES)
            variant = "mma8" if eight else "mma"
    if variant in MMA_VARIANTS:
        if not has_mma_kernel(weight_format, activation, rows):
            raise ValueError(f"no tensor-core matvec for {weight_format} x {activation} at {rows} rows")
        program, name = matvec_mma(weight_format, activation, tile, variant)
        threads = 32 * MMA_VARIANTS[variant][1]
        return MatvecLaunch(program, name, -(-out_features // MMA_ROWS_PER_BLOCK), threads, variant)
    if variant != "simt":
        raise ValueError(f"matvec variant must be one of {MATVEC_VARIANTS}, not {variant!r}")
    program, name = matvec(weight_format, activation, tile)
    return MatvecLaunch(program, name, -(-out_features // MATVEC_WARPS), 32 * MATVEC_WARPS, variant)


def dequant(weight_format: str, activation: str) -> tuple[KernelProgram, str]:
    name = f"dequant_{weight_format}_{activation}"
    return KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT({weight_format}, {activation})"]), name


def rms_norm(activation: str, weight: str) -> tuple[KernelProgram, str]:
    name = f"rms_norm_{activation}_{weight}"
    return KernelProgram("rms_norm.cu", [f"LUCEBOX_RMS_NORM({activation}, {weight})"]), name


def compile_check_programs() -> dict[str, KernelProgram]:
    """For each `.cu` file, one program instantiating the variants a compile check needs: every weight
    format with every activation type, and every format again at a mid and the largest batch (the
    register-pressure extreme) for one activation type (the batch is an unrolling count, not a type)."""
    formats, acts = list(WEIGHT_FORMATS.values()), list(ACTIVATIONS.values())
    matvec_lines = [f"LUCEBOX_MATVEC({f}, {a}, 1)" for f in formats for a in acts]
    matvec_lines += [f"LUCEBOX_MATVEC({f}, bf16, {b})" for f in formats for b in (8, MAX_BATCH)]
    mma_lines = [f"LUCEBOX_MATVEC_MMA({f}, {a}, 1)" for f in MMA_FORMATS for a in acts]
    mma_lines += [f"LUCEBOX_MATVEC_MMA({f}, {a}, {MMA_MAX_BATCH[a]})" for f in MMA_FORMATS for a in ("bf16", "f32")]
    mma_lines += [f"LUCEBOX_MATVEC_MMA8({f}, bf16, 1)" for f in MMA_FORMATS]
    return {
        "matvec.cu": KernelProgram("matvec.cu", matvec_lines),
        "matvec_mma.cu": KernelProgram("matvec_mma.cu", mma_lines),
        "dequant.cu": KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT({f}, {a})" for f in formats for a in acts]),
        "rms_norm.cu": KernelProgram("rms_norm.cu", [f"LUCEBOX_RMS_NORM({a}, {w})" for a in acts for w in acts]),
    }
