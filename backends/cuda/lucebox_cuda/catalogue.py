"""The catalogue of kernels: which `.cu` file holds each, how an instantiation is named and written.

Every kernel is a template instantiated by a macro line appended to its source (`LUCEBOX_MATVEC(q4_k,
bf16, 1)` defines `matvec_q4_k_bf16_1`), so a process compiles only the instantiations it uses, each its
own small cached program. Pure Python: usable without a GPU (the compile tests use it).
"""

from __future__ import annotations

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


def batch_tile(rows: int) -> int:
    """The kernel batch size that serves `rows` activation rows (1 <= rows <= MAX_BATCH)."""
    for size in BATCH_SIZES:
        if size >= rows:
            return size
    raise ValueError(f"{rows} activation rows exceed the matrix-vector kernel's maximum of {MAX_BATCH}")


def matvec(weight_format: str, activation: str, batch: int) -> tuple[KernelProgram, str]:
    name = f"matvec_{weight_format}_{activation}_{batch}"
    return KernelProgram("matvec.cu", [f"LUCEBOX_MATVEC({weight_format}, {activation}, {batch})"]), name


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
    return {
        "matvec.cu": KernelProgram("matvec.cu", matvec_lines),
        "dequant.cu": KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT({f}, {a})" for f in formats for a in acts]),
        "rms_norm.cu": KernelProgram("rms_norm.cu", [f"LUCEBOX_RMS_NORM({a}, {w})" for a in acts for w in acts]),
    }
