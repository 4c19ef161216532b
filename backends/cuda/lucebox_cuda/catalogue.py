"""The catalogue of kernels: which `.cu` file holds each, how an instantiation is named and written.

Every kernel is a template instantiated by a macro line appended to its source (`LUCEBOX_MATVEC(q4_k,
bf16, 1)` defines `matvec_q4_k_bf16_1`), so a process compiles only the instantiations it uses, each its
own small cached program. Pure Python: usable without a GPU (the compile tests use it).

Three matrix-vector kernels: `matvec.cu` (CUDA cores, one warp per output row, every format),
`matvec_mma.cu` (tensor cores, 16 output rows per block of 4 or 8 warps, register prefetch, the K-quants)
and `matvec_pipe.cu` (the same tensor-core math with the weight streamed through shared memory by
cp.async, parameterized by warps, pipeline depth, row groups per warp and K-slices). `matvec_kernel` picks
one (`default_variant`: a measured table, else a rule) and says how to launch it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Sequence

import attrs
import torch
from gguf.constants import GGMLQuantizationType as T

from .matvec_table import MATVEC_TUNED
from .nvrtc import KernelProgram

# GGUF weight formats with a decoder in gguf_blocks.cuh, and the multiple their rows must be of.
WEIGHT_FORMATS: dict[T, str] = {
    T.Q4_K: "q4_k",
    T.Q5_K: "q5_k",
    T.Q6_K: "q6_k",
    T.Q8_0: "q8_0",
    T.Q5_0: "q5_0",
    T.F16: "f16",
    T.BF16: "bf16",
    T.F32: "f32",
}
ROW_MULTIPLE: dict[str, int] = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "q8_0": 32, "q5_0": 32, "f16": 8, "bf16": 8, "f32": 8}

# Activation dtypes the kernels read and write (they compute in fp32 whatever the storage).
ACTIVATIONS: dict[torch.dtype, str] = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Activation-row counts the matrix-vector kernel is built for; a batch uses the smallest that holds it.
# Up to 8 every count has its own kernel (decode and short drafts waste nothing); beyond, a few steps.
BATCH_SIZES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MAX_BATCH = BATCH_SIZES[-1]

MATVEC_WARPS = 4  # LUCEBOX_MATVEC_WARPS in matvec.cu: one output row per warp

# The tensor-core kernels: formats they decode, rows per block of the register-prefetch kernel (the mma's
# M), and the largest batch tile per activation (fp32 activations take three bf16 columns each, so fewer
# rows fit the same registers).
MMA_FORMATS: tuple[str, ...] = ("q4_k", "q5_k", "q6_k")
MMA_ROWS_PER_BLOCK = 16
MMA_MAX_BATCH: dict[str, int] = {"bf16": 64, "f16": 64, "f32": 8}
# Register-prefetch variants (matvec_mma.cu) -> (name prefix, warps per block, row tiles of 16 per block):
# "mma8" splits each row over 8 warps instead of 4; "mma_r2" gives a block of 4 warps two row tiles, so each
# activation fragment it loads serves twice the weights (the small-batch verify products are bound by
# re-reading the activations once per block). Same warps, same bits: "mma_r2" and "mma" agree exactly.
# "mma_pp" is "mma" with two register sets used in turn (no register moves a block, more registers): same bits.
MMA_VARIANTS: dict[str, tuple[str, int, int]] = {
    "mma": ("matvec_mma", 4, 1), "mma8": ("matvec_mma8", 8, 1), "mma_r2": ("matvec_mma_r2", 4, 2),
    "mma_pp": ("matvec_mma_pp", 4, 1),
}
# Shapes the sweep has not timed (H200 sweeps of the 27B shapes, 2026-11-30 session 4): the 4-warp,
# one-slice class (`arithmetic_class`), which was fastest or within ~5% at batch 1 and fastest at the
# verify batches on every large shape, with its measured best variant per batch range: (largest batch
# tile, variant). Products of few rows (the 96-row GDN gates, 1024-row K/V) with long rows take 8 warps and
# 4 K-slices at every batch: their handful of row groups fills the GPU only when split along K.
UNMEASURED_RULE: dict[str, tuple[tuple[int, str], ...]] = {
    "q4_k": ((1, "mma"), (8, "mma_r2"), (16, "pipe_w4_d4_m2_k1"), (64, "mma_r2")),
    "q5_k": ((1, "mma"), (8, "mma_r2"), (16, "pipe_w4_d4_m2_k1"), (64, "mma_r2")),
    "q6_k": ((1, "pipe_w4_d3_m1_k1"), (16, "pipe_w4_d4_m1_k1"), (24, "mma"), (64, "mma_r2")),
}
FEW_ROWS = 4096
FEW_ROWS_VARIANT = "pipe_w8_d3_m1_k4"
FEW_ROWS_MIN_IN = 4096  # K-slices of at least 4 GGUF blocks (measured with 20-block rows; shorter ones untimed)
# "pipe" is the default streamed variant (matvec_pipe.cu) for the shape; explicit ones are named by
# `PipeVariant.name`, e.g. "pipe_w4_d4_m1_k2".
MATVEC_VARIANTS = ("pipe", *MMA_VARIANTS, "simt")

# -- the streamed (cp.async) tensor-core kernel, matvec_pipe.cu ---------------------------------------

# Bytes one row's GGUF block takes in the shared-memory ring: whole 16-byte chunks, and for Q6_K's
# 2-byte-aligned 210-byte blocks an over-fetch from the 16-byte boundary below (up to 14 bytes before).
PIPE_ROW_STRIDE: dict[str, int] = {"q4_k": 144, "q5_k": 176, "q6_k": 224}
PIPE_MAX_SLICES = 8
# Shared memory a launch may use without the opt-in attribute, and what portable defaults stay within
# (sm_86/89/120 allow 99 KiB a block; sm_90 227 KiB).
STATIC_SHARED_LIMIT = 48 * 1024
PORTABLE_SHARED_LIMIT = 99 * 1024


@attrs.frozen
class PipeVariant:
    """One configuration of matvec_pipe.cu: warps per block, ring stages per warp, 16-row groups per warp
    (compile-time) and K-slices (the grid's y, run-time: one compiled kernel serves every slice count)."""

    warps: int
    depth: int
    row_groups: int = 1
    slices: int = 1

    @property
    def name(self) -> str:
        return f"pipe_w{self.warps}_d{self.depth}_m{self.row_groups}_k{self.slices}"

    @classmethod
    def parse(cls, name: str) -> PipeVariant | None:
        """The variant named `name` ("pipe_w4_d4_m1_k2"), or None if `name` is not of that form."""
        match = re.fullmatch(r"pipe_w(\d+)_d(\d+)_m(\d+)_k(\d+)", name)
        if match is None:
            return None
        warps, depth, row_groups, slices = map(int, match.groups())
        if warps not in (1, 2, 4, 8, 16) or not 2 <= depth <= 16 or row_groups not in (1, 2):
            raise ValueError(f"unsupported pipe variant {name!r}")
        if not 1 <= slices <= PIPE_MAX_SLICES:
            raise ValueError(f"pipe variant {name!r}: slices must be 1..{PIPE_MAX_SLICES}")
        return cls(warps, depth, row_groups, slices)

    def rows_per_block(self) -> int:
        return 16 * self.row_groups

    def kernel_name(self, weight_format: str, activation: str, batch: int) -> str:
        return f"matvec_pipe_w{self.warps}_d{self.depth}_m{self.row_groups}_{weight_format}_{activation}_{batch}"

    def shared_bytes(self, weight_format: str, activation: str, batch: int) -> int:
        """Dynamic shared memory of a launch: PipeShape::SHARED_BYTES in matvec_pipe.cu."""
        tiles = -(-batch * (3 if activation == "f32" else 1) // 8)
        rows = self.rows_per_block()
        ring = self.warps * self.depth * rows * PIPE_ROW_STRIDE[weight_format]
        partial = self.warps * rows * (8 * tiles + 1) * 4
        return max(ring, partial)


# The variants the sweep (scripts/matvec_sweep.py) compares; each runs with 1, 2 and 4 K-slices too.
PIPE_SWEEP_CONFIGS: tuple[tuple[int, int, int], ...] = (  # (warps, depth, row groups)
    (4, 3, 1), (4, 4, 1), (4, 6, 1), (8, 3, 1), (8, 4, 1), (2, 8, 1), (4, 4, 2),
)
# Two row groups per warp double the accumulators: only up to this batch tile (beyond it they spill).
PIPE_MAX_BATCH_TWO_GROUPS = 16


def arithmetic_class(variant: str) -> tuple:
    """Variants of one class compute every output with the same instructions in the same order, so they
    give the same bits. Tensor-core kernels: a row's GGUF blocks are split between W warps (warp w takes
    blocks w, w + W, ... of its K-slice), each block's products are the same mma steps with the same
    scale-and-min epilogue, and the warps' then the slices' partial sums are added in order; how many
    rows a block holds, how deep the weight is prefetched or through which memory are not part of it. So
    the class is (warps, K-slices): `mma`, `mma_r2` and `pipe_w4_*_k1` agree, as do `mma8` and
    `pipe_w8_*_k1` (`scripts/matvec_probe.py invariance` checks this on the GPU)."""
    if variant == "simt":
        return ("simt",)
    if variant in MMA_VARIANTS:
        return ("mma", MMA_VARIANTS[variant][1], 1)
    pipe = PipeVariant.parse(variant)
    if pipe is None:
        raise ValueError(f"unknown matvec variant {variant!r}")
    return ("mma", pipe.warps, pipe.slices)


def default_variant(weight_format: str, activation: str, rows: int, out_features: int, in_features: int) -> str:
    """The variant a product uses by default: the fastest measured for the shape and batch within one
    arithmetic class per shape, never across classes.

    Within a class every variant computes each activation row's product with the same instructions in
    the same order whatever the batch (`scripts/matvec_probe.py invariance` checks this bit for bit on the
    GPU), so a token gets the same logits in a one-token decode step and in a 16-64-row speculative
    verify pass: what makes speculative decoding reproduce plain greedy decoding on the GPU even at
    near-ties (and `--force-accept` hold). The class is that of the shape's batch-1 entry of MATVEC_TUNED
    (chosen by the sweep for decode and verify time together); the variant is the shape's entry for the
    measured batch nearest this one (in ratio, within 2x) that exists at this batch, else the rule for
    unmeasured shapes if it falls in the class, else the nearest entry, else the batch-1 entry (two-row-
    group streamed kernels, built only up to batch 16, in their one-group form beyond). CUDA-core
    winners of tiny shapes are replaced by a tensor-core kernel (a CUDA-core product of a 16-64-row verify
    costs several times a tensor-core one, at ~1 us more per decode step). Unmeasured shapes: the rule of
    UNMEASURED_RULE. Activations with no tensor-core kernel at MAX_BATCH rows (fp32 beyond 8) take the
    CUDA-core kernel at every batch, for the same reason."""
    if not has_mma_kernel(weight_format, activation, MAX_BATCH):
        return "simt"
    tile = batch_tile(rows)
    anchor = MATVEC_TUNED.get((weight_format, 1, out_features, in_features))
    if anchor is None or anchor == "simt":
        return _unmeasured_variant(weight_format, tile, out_features, in_features)
    anchor_class = arithmetic_class(anchor)
    measured = sorted(
        (abs(math.log(batch / tile)), -batch, variant)
        for (fmt, batch, out, inn), variant in MATVEC_TUNED.items()
        if (fmt, out, inn) == (weight_format, out_features, in_features)
        and arithmetic_class(variant) == anchor_class and _variant_exists(variant, tile))
    if measured and measured[0][0] <= math.log(2):
        return measured[0][2]
    ruled = _unmeasured_variant(weight_format, tile, out_features, in_features)  # no timing near this batch
    if arithmetic_class(ruled) == anchor_class and _variant_exists(ruled, tile):
        return ruled
    if measured:
        return measured[0][2]
    pipe = PipeVariant.parse(anchor)
    return attrs.evolve(pipe, row_groups=1).name if pipe is not None and pipe.row_groups > 1 else anchor


def _unmeasured_variant(weight_format: str, tile: int, out_features: int, in_features: int) -> str:
    """The rule for shapes the sweep has not timed: UNMEASURED_RULE's variant for the batch tile, one
    arithmetic class per format and size at every batch."""
    if out_features < FEW_ROWS and in_features >= FEW_ROWS_MIN_IN:
        return FEW_ROWS_VARIANT
    for largest_tile, variant in UNMEASURED_RULE[weight_format]:
        if tile <= largest_tile:
            return variant
    raise ValueError(f"batch tile {tile} beyond the rule's last entry")


def _variant_exists(variant: str, tile: int) -> bool:
    """Whether a tensor-core variant is built for this batch tile (two row groups per warp only up to 16)."""
    pipe = PipeVariant.parse(variant)
    return pipe is None or pipe.row_groups == 1 or tile <= PIPE_MAX_BATCH_TWO_GROUPS


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
    prefix, _, _ = MMA_VARIANTS[variant]
    macro = "LUCEBOX_" + prefix.upper()
    name = f"{prefix}_{weight_format}_{activation}_{batch}"
    return KernelProgram("matvec_mma.cu", [f"{macro}({weight_format}, {activation}, {batch})"]), name


# The tiled-layout kernel (matvec_tiled.cu, weights `tiled_weights` holds tiled): the `mma` class (4 warps, one
# K-slice), one GGUF block in flight ahead; one row tile a block at batch 1, two beyond (measured fastest, H100).
def matvec_tiled(weight_format: str, activation: str, batch: int,
                 given: bool = False) -> tuple[KernelProgram, str, int, GivenSums | None]:
    """(program, kernel name, rows a thread block, its sums kernel or None) of the tiled kernel for `batch` activation
    rows (<= its tile), in its given-sums form from GIVEN_SUMS_MIN_TILE rows where `given`."""
    tile, row_tiles = batch_tile(batch), 1 if batch == 1 else 2
    sums = given_sums(weight_format, activation, tile) if given and tile >= GIVEN_SUMS_MIN_TILE else None
    kind = "_S" if sums else ""
    line = f"LUCEBOX_MATVEC_TILED{kind}({weight_format}, {activation}, {tile}, 4, {row_tiles}, 1, 0)"
    name = f"matvec_tiled{kind.lower()}_w4_r{row_tiles}_a1_o0_{weight_format}_{activation}_{tile}"
    return KernelProgram("matvec_tiled.cu", [line]), name, 16 * row_tiles, sums


# The same class read through a ring of DEPTH tiles a warp filled by bulk copies (matvec_tiled.cu's
# LUCEBOX_MATVEC_BULK; sm_90 and later). Its dynamic shared memory: 4 warps x DEPTH tiles.
def matvec_bulk(weight_format: str, activation: str, batch: int, depth: int) -> tuple[KernelProgram, str, int]:
    """(program, kernel name, dynamic shared bytes) of the bulk-copy tiled kernel for `batch` rows (<= its tile)."""
    tile = batch_tile(batch)
    line = f"LUCEBOX_MATVEC_BULK({weight_format}, {activation}, {tile}, {depth})"
    shared = 4 * depth * 16 * {"q4_k": 144, "q5_k": 176, "q6_k": 210}[weight_format]
    return KernelProgram("matvec_tiled.cu", [line]), f"matvec_bulk_d{depth}_{weight_format}_{activation}_{tile}", shared


def matvec_pipe(weight_format: str, activation: str, batch: int, pipe: PipeVariant) -> tuple[KernelProgram, str]:
    line = (f"LUCEBOX_MATVEC_PIPE({weight_format}, {activation}, {batch}, {pipe.warps}, {pipe.depth}, "
            f"{pipe.row_groups})")
    return KernelProgram("matvec_pipe.cu", [line]), pipe.kernel_name(weight_format, activation, batch)


# Given sums (matvec_mma_body.cuh's `given_sums`; the backend asks for them only with LUCEBOX_GIVEN_SUMS=1): from this
# batch tile the tensor-core products take the activations' sub-block sums from a small kernel run once a product
# (`GivenSums`) instead of an all-ones mma in every row group: the same bits, a third to a half fewer mma steps.
GIVEN_SUMS_MIN_TILE = 12
GIVEN_SUMS_VARIANTS = {"mma": "matvec_mma_s", "mma_r2": "matvec_mma_r2_s"}  # and every streamed variant
SUMS_GROUPS: dict[str, int] = {"q4_k": 8, "q5_k": 8, "q6_k": 16}  # sub-block groups a GGUF block (scale steps)


@attrs.frozen
class GivenSums:
    """The sums kernel of a product with given sums: launch it on (x, sums, cols, batch) with `grid(cols)` blocks of
    128 threads into a float scratch of `floats(cols)`, then the product with the scratch as its last argument."""

    program: KernelProgram
    name: str
    weight_format: str
    tiles: int

    def floats(self, cols: int) -> int:
        return cols // 256 * SUMS_GROUPS[self.weight_format] * self.tiles * 8

    def grid(self, cols: int) -> int:
        return -(-(cols // 256 * SUMS_GROUPS[self.weight_format]) // 4)


def given_sums(weight_format: str, activation: str, tile: int) -> GivenSums:
    tiles = -(-tile * (3 if activation == "f32" else 1) // 8)
    program = KernelProgram("matvec_mma.cu", [f"LUCEBOX_MATVEC_SUMS({weight_format}, {activation}, {tile})"])
    return GivenSums(program, f"matvec_sums_{weight_format}_{activation}_{tile}", weight_format, tiles)


@attrs.frozen
class MatvecLaunch:
    """One matrix-vector kernel and its launch shape: grid (x, and `slices` along y), block, dynamic shared
    memory. `slices > 1` (split-K) needs the extra arguments of matvec_pipe.cu: a float scratch of
    `slices * rows * out_features` and `grid` zeroed u32 counters (which the kernel leaves zeroed). `sums`: the
    kernel takes given sums (one more argument, last), written by that kernel just before."""

    program: KernelProgram
    name: str
    grid: int
    block: int
    variant: str
    slices: int = 1
    shared_bytes: int = 0
    sums: GivenSums | None = None

    @property
    def streamed(self) -> bool:
        """Whether this is a matvec_pipe.cu kernel (it takes the partials and counters arguments)."""
        return self.program.file == "matvec_pipe.cu"


def has_mma_kernel(weight_format: str, activation: str, rows: int) -> bool:
    return weight_format in MMA_FORMATS and batch_tile(rows) <= MMA_MAX_BATCH[activation]


def matvec_kernel(weight_format: str, activation: str, rows: int, out_features: int,
                  variant: str | None = None, *, in_features: int | None = None,
                  max_shared_bytes: int = PORTABLE_SHARED_LIMIT, given: bool = False) -> MatvecLaunch:
    """`matvec_launch`, in its given-sums form (`with_given_sums`) where `given` and the batch tile call for it."""
    launch = matvec_launch(weight_format, activation, rows, out_features, variant, in_features=in_features,
                           max_shared_bytes=max_shared_bytes)
    return with_given_sums(launch, weight_format, activation, rows) if given else launch


def with_given_sums(launch: MatvecLaunch, weight_format: str, activation: str, rows: int) -> MatvecLaunch:
    """The same product taking given sums, from GIVEN_SUMS_MIN_TILE rows, for the variants that have the form."""
    tile = batch_tile(rows)
    if tile < GIVEN_SUMS_MIN_TILE or (launch.variant not in GIVEN_SUMS_VARIANTS and not launch.streamed):
        return launch
    line = launch.program.instantiations[0]
    if launch.streamed:
        program = KernelProgram(launch.program.file, [line.replace("LUCEBOX_MATVEC_PIPE(", "LUCEBOX_MATVEC_PIPE_S(")])
        name = launch.name.replace("matvec_pipe_", "matvec_pipe_s_", 1)
    else:
        prefix = GIVEN_SUMS_VARIANTS[launch.variant]
        line = f"LUCEBOX_{prefix.upper()}({weight_format}, {activation}, {tile})"
        program = KernelProgram(launch.program.file, [line])
        name = f"{prefix}_{weight_format}_{activation}_{tile}"
    return attrs.evolve(launch, program=program, name=name, sums=given_sums(weight_format, activation, tile))


def matvec_launch(weight_format: str, activation: str, rows: int, out_features: int,
                  variant: str | None = None, *, in_features: int | None = None,
                  max_shared_bytes: int = PORTABLE_SHARED_LIMIT) -> MatvecLaunch:
    """The kernel for `rows` activation rows times a weight of `out_features` rows (`in_features` columns:
    the default's K-split depends on it): the default for the shape, or `variant` when given (one of
    MATVEC_VARIANTS or a `PipeVariant.name`; the check and sweep scripts time them all). A streamed variant
    needing more shared memory than `max_shared_bytes` (the device's opt-in limit) is refused when asked
    for, and the default falls back to fewer stages, then to the register-prefetch kernel."""
    tile = batch_tile(rows)
    in_features = in_features if in_features is not None else 4096
    asked = variant
    if variant is None or variant == "pipe":
        variant = default_variant(weight_format, activation, rows, out_features, in_features)
        if asked == "pipe" and has_mma_kernel(weight_format, activation, MAX_BATCH):
            # The streamed form of the shape's class (its batch-1 default's), so that "pipe" too gives every
            # batch the same bits (activations with no tensor-core kernel at every batch keep the default).
            anchor = default_variant(weight_format, activation, 1, out_features, in_features)
            pipe = PipeVariant.parse(anchor)
            if pipe is None:
                pipe = PipeVariant(MMA_VARIANTS[anchor][1] if anchor in MMA_VARIANTS else 4, 4, 1, 1)
            variant = attrs.evolve(pipe, row_groups=1).name
    pipe = PipeVariant.parse(variant)
    if pipe is not None:
        if not has_mma_kernel(weight_format, activation, rows):
            raise ValueError(f"no tensor-core matvec for {weight_format} x {activation} at {rows} rows")
        if pipe.row_groups > 1 and tile > PIPE_MAX_BATCH_TWO_GROUPS:
            raise ValueError(f"{variant}: two row groups per warp only up to batch {PIPE_MAX_BATCH_TWO_GROUPS}")
        while pipe.shared_bytes(weight_format, activation, tile) > max_shared_bytes:
            if asked is not None and asked != "pipe":
                raise ValueError(f"{variant} needs {pipe.shared_bytes(weight_format, activation, tile)} bytes of "
                                 f"shared memory; this device allows {max_shared_bytes}")
            if pipe.depth <= 2:  # the register-prefetch kernel of the same class where there is one
                variant = "mma8" if (pipe.warps, pipe.slices) == (8, 1) else "mma"
                pipe = None
                break
            pipe = attrs.evolve(pipe, depth=pipe.depth - 1)
            variant = pipe.name
    if pipe is not None:
        program, name = matvec_pipe(weight_format, activation, tile, pipe)
        grid = -(-out_features // pipe.rows_per_block())
        return MatvecLaunch(program, name, grid, 32 * pipe.warps, variant, pipe.slices,
                            pipe.shared_bytes(weight_format, activation, tile))
    if variant in MMA_VARIANTS:
        if not has_mma_kernel(weight_format, activation, rows):
            raise ValueError(f"no tensor-core matvec for {weight_format} x {activation} at {rows} rows")
        _, warps, row_tiles = MMA_VARIANTS[variant]
        program, name = matvec_mma(weight_format, activation, tile, variant)
        rows_per_block = MMA_ROWS_PER_BLOCK * row_tiles
        return MatvecLaunch(program, name, -(-out_features // rows_per_block), 32 * warps, variant)
    if variant != "simt":
        raise ValueError(f"matvec variant must be one of {MATVEC_VARIANTS} or a pipe variant, not {variant!r}")
    program, name = matvec(weight_format, activation, tile)
    return MatvecLaunch(program, name, -(-out_features // MATVEC_WARPS), 32 * MATVEC_WARPS, variant)


def pipe_compile_check_lines() -> list[str]:
    """Instantiations of matvec_pipe.cu for the compile check: every format x activation at batch 1 in the
    default shape, the other block shapes of the sweep once, and the register extremes (largest batch tile
    per activation, two row groups at their largest batch)."""
    formats, acts = MMA_FORMATS, list(ACTIVATIONS.values())
    lines = [f"LUCEBOX_MATVEC_PIPE({f}, {a}, 1, 4, 4, 1)" for f in formats for a in acts]
    lines += [f"LUCEBOX_MATVEC_PIPE(q6_k, bf16, 1, {w}, {d}, 1)" for w, d in ((8, 3), (2, 8))]
    lines += [f"LUCEBOX_MATVEC_PIPE({f}, bf16, {MMA_MAX_BATCH['bf16']}, 4, 4, 1)" for f in ("q4_k", "q6_k")]
    lines += [f"LUCEBOX_MATVEC_PIPE(q5_k, f32, {MMA_MAX_BATCH['f32']}, 4, 4, 1)",
              f"LUCEBOX_MATVEC_PIPE(q4_k, bf16, {PIPE_MAX_BATCH_TWO_GROUPS}, 4, 4, 2)"]
    lines += [f"LUCEBOX_MATVEC_PIPE_S({f}, bf16, {GIVEN_SUMS_MIN_TILE}, 4, 4, 2)" for f in formats]  # given sums
    lines += [f"LUCEBOX_MATVEC_PIPE_S(q6_k, bf16, {MMA_MAX_BATCH['bf16']}, 8, 3, 1)"]
    return lines


def dequant(weight_format: str, activation: str) -> tuple[KernelProgram, str]:
    name = f"dequant_{weight_format}_{activation}"
    return KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT({weight_format}, {activation})"]), name


def dequant_rows(weight_format: str, activation: str) -> tuple[KernelProgram, str]:
    """The rows named by device ids decoded (the embedding lookup; see dequant.cu)."""
    name = f"dequant_rows_{weight_format}_{activation}"
    return KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT_ROWS({weight_format}, {activation})"]), name


def untile_rows(at_ids: bool = False) -> tuple[KernelProgram, str]:
    """Rows of a weight held tiled back in GGUF's bytes (a prefill's dequant reads them; see dequant.cu); `at_ids`:
    the rows a device tensor of ids names (an embedding lookup)."""
    return KernelProgram("dequant.cu", ["LUCEBOX_UNTILE_ROWS()"]), "untile_rows_at" if at_ids else "untile_rows"


def moe_matvec(weight_format: str, activation: str) -> tuple[KernelProgram, str]:
    name = f"moe_matvec_{weight_format}_{activation}"
    return KernelProgram("moe_matvec.cu", [f"LUCEBOX_MOE_MATVEC({weight_format}, {activation})"]), name


# The expert products (`expert_matvec`, `expert_matvec_pair`): "simt" is moe_matvec.cu (CUDA cores, every
# format); "mma<W>" moe_matvec_mma.cu (tensor cores, K-quants, W warps per 16 rows). LUCEBOX_MOE_MATVEC picks
# one for every shape ("simt", "mma1".."mma8"; the benchmark scripts set it), else `moe_matvec_variant`'s rule.
MOE_MMA_WARPS: tuple[int, ...] = (1, 2, 4, 8)
MOE_MATVEC_VARIANTS = ("simt", *(f"mma{w}" for w in MOE_MMA_WARPS))


@attrs.frozen
class MoeMatvecLaunch:
    program: KernelProgram
    name: str
    threads: int  # per block
    rows_per_block: int  # the grid's x is ceil(rows / rows_per_block); y the pairs; z the stacks (pair kernels)


def moe_matvec_variant(weight_format: str, cols: int, tensor_cores: bool = True) -> str:
    """The expert-product kernel for a stack of `cols`-column rows: tensor cores for the K-quants, with as many
    warps per 16 rows as the row has GGUF blocks, up to 4 (a 512-column row: 2; a 2048-column one: 4, two
    blocks each, the second prefetched during the first's math); CUDA cores for the other formats, and for a
    backend without `mma.sync` (`tensor_cores` False: HIP)."""
    asked = os.environ.get("LUCEBOX_MOE_MATVEC", "").strip()
    if not tensor_cores:
        return "simt"
    if asked:
        if asked not in MOE_MATVEC_VARIANTS:
            raise ValueError(f"LUCEBOX_MOE_MATVEC must be one of {', '.join(MOE_MATVEC_VARIANTS)}, not {asked!r}")
        if asked == "simt" or weight_format in MMA_FORMATS:
            return asked
    if weight_format not in MMA_FORMATS:
        return "simt"
    return f"mma{min(4, max(1, cols // 256))}"


MOE_MATVEC_KINDS = ("", "paged", "pair", "pair_paged", "swiglu", "paged_swiglu")
# The SwiGLU kinds (the down product computing silu(gate) * up itself, moe_matvec_mma.cu): tensor-core variants
# and 16-bit activations only, rows of at most this many values (the kernel's shared row).
MOE_SWIGLU_MAX_COLS = 4096


def moe_swiglu_kernel(weight_format: str, activation: str, cols: int, *, tensor_cores: bool = True) -> bool:
    """Whether a SwiGLU kind exists for this down product: a tensor-core variant, 16-bit activations, a row the
    kernel's shared memory holds."""
    return (activation in ("bf16", "f16") and cols <= MOE_SWIGLU_MAX_COLS
            and moe_matvec_variant(weight_format, cols, tensor_cores) != "simt")


def moe_matvec_kernel(weight_format: str, activation: str, cols: int, kind: str = "", *,
                      tensor_cores: bool = True) -> MoeMatvecLaunch:
    """The expert-product kernel of `kind` (one of MOE_MATVEC_KINDS) for the shape."""
    if kind not in MOE_MATVEC_KINDS:
        raise ValueError(f"moe_matvec kind must be one of {', '.join(map(repr, MOE_MATVEC_KINDS))}, not {kind!r}")
    variant = moe_matvec_variant(weight_format, cols, tensor_cores)
    macro_kind = f"_{kind.upper()}" if kind else ""
    if kind.endswith("swiglu") and not moe_swiglu_kernel(weight_format, activation, cols, tensor_cores=tensor_cores):
        raise ValueError(f"no {kind} expert kernel for {weight_format} x {activation} rows of {cols} (see "
                         "moe_swiglu_kernel)")
    if variant == "simt":
        name = "_".join(part for part in ("moe_matvec", kind, weight_format, activation) if part)
        program = KernelProgram("moe_matvec.cu", [f"LUCEBOX_MOE_MATVEC{macro_kind}({weight_format}, {activation})"])
        return MoeMatvecLaunch(program, name, 32 * MATVEC_WARPS, MATVEC_WARPS)
    warps = int(variant[3:])
    name = "_".join(part for part in (f"moe_matvec_mma{warps}", kind, weight_format, activation) if part)
    program = KernelProgram("moe_matvec_mma.cu",
                            [f"LUCEBOX_MOE_MATVEC_MMA{macro_kind}({weight_format}, {activation}, {warps})"])
    return MoeMatvecLaunch(program, name, 32 * warps, MMA_ROWS_PER_BLOCK)


# The persistent FFN block (ffn_persistent.cu): 16-bit activations (its staged vectors are counted in them), at
# most this many values in the hidden and the intermediate size, each a multiple of the row tile (16).
FFN_PERSISTENT_ACTIVATIONS: tuple[str, ...] = ("bf16", "f16")
FFN_PERSISTENT_MAX_VALUES = 18432
FFN_PERSISTENT_THREADS = 128


def ffn_persistent(gate_up_format: str, down_format: str, activation: str, norm: str,
                   row_tiles: int = 1) -> tuple[KernelProgram, str]:
    """The persistent SwiGLU block for these formats (gate | up fused, down), activation and norm-weight types, with
    16-row tiles or (`row_tiles` 2) 32-row ones."""
    prefix, macro = ("ffn_persistent", "LUCEBOX_FFN_PERSISTENT") if row_tiles == 1 else (
        "ffn_persistent_r2", "LUCEBOX_FFN_PERSISTENT_R2")
    name = f"{prefix}_{gate_up_format}_{down_format}_{activation}_{norm}"
    line = f"{macro}({gate_up_format}, {down_format}, {activation}, {norm})"
    return KernelProgram("ffn_persistent.cu", [line]), name


# The persistent MoE block (moe_persistent.cu): rows it stages (the hidden size; the chosen and shared experts'
# intermediate rows together), experts a router may have, experts a token may take.
MOE_PERSISTENT_STAGE_VALUES = 8192
MOE_PERSISTENT_MAX_EXPERTS = 512
MOE_PERSISTENT_MAX_TOP_K = 16
MOE_PERSISTENT_THREADS = 128


def moe_persistent(gate_format: str, down_format: str, activation: str, norm: str, *,
                   sigmoid: bool) -> tuple[KernelProgram, str]:
    """The persistent MoE block for these formats (gate and up stacks, down stack), activation and norm-weight
    types: `sigmoid` a sigmoid router with a selection bias and an ungated shared expert (Laguna's), else a softmax
    router and a shared expert behind a sigmoid gate (Qwen3.5-MoE's). The program defines both kinds."""
    suffix = "sn" if sigmoid else "xg"
    name = f"moe_persistent_{gate_format}_{down_format}_{activation}_{norm}_{suffix}"
    line = f"LUCEBOX_MOE_PERSISTENT({gate_format}, {down_format}, {activation}, {norm})"
    return KernelProgram("moe_persistent.cu", [line]), name


# The persistent Gated DeltaNet mixer (gdn_persistent.cu): values it stages (the hidden size; the value channels).
GDN_PERSISTENT_STAGE_VALUES = 8192
GDN_PERSISTENT_THREADS = 128


def gdn_persistent(qkv_format: str, rest_format: str, activation: str, norm: str) -> tuple[KernelProgram, str]:
    """The persistent Gated DeltaNet mixer for these formats (the qkv rows; z, b, a and the output product),
    activation and gated-norm weight types."""
    name = f"gdn_persistent_{qkv_format}_{rest_format}_{activation}_{norm}"
    line = f"LUCEBOX_GDN_PERSISTENT({qkv_format}, {rest_format}, {activation}, {norm})"
    return KernelProgram("gdn_persistent.cu", [line]), name


# The persistent gated attention (attention_persistent.cu): values it stages (the hidden size; the query channels).
ATTENTION_PERSISTENT_STAGE_VALUES = 8192
ATTENTION_PERSISTENT_THREADS = 128


def attention_persistent(qk_format: str, v_format: str, o_format: str, activation: str, norm: str,
                         group: int) -> tuple[KernelProgram, str]:
    """The persistent gated attention for these formats (q | k rows, v rows, the output product), activation and
    q/k norm weight types, and query heads a KV head."""
    name = f"attention_persistent_{qk_format}_{v_format}_{o_format}_{activation}_{norm}_g{group}"
    line = f"LUCEBOX_ATTENTION_PERSISTENT({qk_format}, {v_format}, {o_format}, {activation}, {norm}, {group})"
    return KernelProgram("attention_persistent.cu", [line]), name


# The Qwen3.5 megakernel (qwen35_megakernel.cu): values it stages (hidden, value / query channels, intermediate).
MEGAKERNEL_STAGE_VALUES = 8192
MEGAKERNEL_THREADS = 128


def qwen35_megakernel(gdn: Sequence[tuple[str, str]], attention: Sequence[tuple[str, str, str]],
                      ffn: Sequence[tuple[str, str]], activation: str, norm: str,
                      group: int) -> tuple[KernelProgram, str]:
    """The megakernel of one model: the Gated DeltaNet bodies for `gdn`'s (qkv, other products') formats, the
    attention bodies for `attention`'s (q | k, v, o), the MLP bodies for `ffn`'s (gate | up, down), each list's
    index a layer's variant; the activation and norm-weight types and the query heads a KV head. The kernel's name
    is a digest of the lists (a model's formats, not its weights: models of one layout share the program)."""
    lists = {
        "MEGA_GDN_CASES": " ".join(f"MEGA_GDN_CASE({i}, {q}, {r})" for i, (q, r) in enumerate(gdn)),
        "MEGA_ATTENTION_CASES": " ".join(f"MEGA_ATTENTION_CASE({i}, {qk}, {v}, {o})"
                                         for i, (qk, v, o) in enumerate(attention)),
        "MEGA_FFN_CASES": " ".join(f"MEGA_FFN_CASE({i}, {g}, {d})" for i, (g, d) in enumerate(ffn)),
    }
    digest = hashlib.sha256(repr(sorted(lists.items())).encode()).hexdigest()[:12]
    name = f"qwen35_megakernel_{activation}_{norm}_g{group}_{digest}"
    lines = [f"#define {macro} {cases}" for macro, cases in lists.items()]
    lines += ['#include "qwen35_megakernel_body.cuh"', f"LUCEBOX_QWEN35_MEGAKERNEL({name}, {activation}, {norm}, {group})"]
    return KernelProgram("qwen35_megakernel.cu", lines), name


def rms_norm(activation: str, weight: str) -> tuple[KernelProgram, str]:
    name = f"rms_norm_{activation}_{weight}"
    return KernelProgram("rms_norm.cu", [f"LUCEBOX_RMS_NORM({activation}, {weight})"]), name


def _every_value_in_every_place() -> list[tuple[str, str, str, str]]:
    """(format, format, activation, norm output) rows for the fused kernels' compile checks: each K-quant format in
    each weight place and each activation with each output type (f32 or its own), in four rows. The template
    parameters select independent code (weight decoding, fragment loads, stores), so the full product (36 rows, 72
    kernels for moe_persistent.cu: ~165 s an architecture on CI's cores) would compile the same code again."""
    formats = MMA_FORMATS
    pairs = [(a, n) for a in FFN_PERSISTENT_ACTIVATIONS for n in ("f32", a)]
    return [(formats[i % len(formats)], formats[(i + 1) % len(formats)], a, n) for i, (a, n) in enumerate(pairs)]


def compile_check_programs() -> dict[str, KernelProgram]:
    """For each `.cu` file, one program instantiating the variants a compile check needs: every weight
    format with every activation type, and every format again at a mid and the largest batch (the
    register-pressure extreme) for one activation type (the batch is an unrolling count, not a type). The fused
    kernels of several weights take each value in each place once (`_every_value_in_every_place`)."""
    formats, acts = list(WEIGHT_FORMATS.values()), list(ACTIVATIONS.values())
    matvec_lines = [f"LUCEBOX_MATVEC({f}, {a}, 1)" for f in formats for a in acts]
    matvec_lines += [f"LUCEBOX_MATVEC({f}, bf16, {b})" for f in formats for b in (8, MAX_BATCH)]
    mma_lines = [f"LUCEBOX_MATVEC_MMA({f}, {a}, 1)" for f in MMA_FORMATS for a in acts]
    mma_lines += [f"LUCEBOX_MATVEC_MMA({f}, {a}, {MMA_MAX_BATCH[a]})" for f in MMA_FORMATS for a in ("bf16", "f32")]
    mma_lines += [f"LUCEBOX_MATVEC_MMA8({f}, bf16, 1)" for f in MMA_FORMATS]
    mma_lines += ["LUCEBOX_MATVEC_MMA_BOUNDED(matvec_mma_b5, 4, 1, 5, q4_k, bf16, 1)",  # the probe's candidates
                  "LUCEBOX_MATVEC_MMA_PP(q4_k, bf16, 1)",
                  "LUCEBOX_MATVEC_MMA_PP_BOUNDED(matvec_mma_pp_b4, 4, q6_k, bf16, 1)"]
    mma_lines += [f"LUCEBOX_MATVEC_MMA_R2({f}, {a}, {b})" for f in MMA_FORMATS for a, b in
                  (("bf16", 1), ("bf16", 24), ("bf16", MAX_BATCH), ("f32", MMA_MAX_BATCH["f32"]))]
    # Given sums (`with_given_sums`): each format's sums at the smallest tile that takes them and the largest.
    mma_lines += [f"LUCEBOX_MATVEC_{k}({f}, {a}, {b})" for k in ("MMA_S", "MMA_R2_S", "SUMS") for f in MMA_FORMATS
                  for a, b in (("bf16", GIVEN_SUMS_MIN_TILE), ("bf16", MAX_BATCH), ("f32", MMA_MAX_BATCH["f32"]))]
    places = _every_value_in_every_place()
    return {
        "matvec_pipe.cu": KernelProgram("matvec_pipe.cu", pipe_compile_check_lines()),
        "matvec.cu": KernelProgram("matvec.cu", matvec_lines),
        "matvec_mma.cu": KernelProgram("matvec_mma.cu", mma_lines),
        # What the backend launches (`matvec_tiled`: one row tile at batch 1, two beyond, fp32 at its largest
        # tile) for each format and activation; the probe's other options (warps, blocks ahead, order, warp
        # units) once each.
        "matvec_tiled.cu": KernelProgram("matvec_tiled.cu", [
            f"LUCEBOX_MATVEC_TILED({f}, {a}, {b}, 4, {r}, 1, 0)" for f in MMA_FORMATS
            for a, b, r in (("bf16", 1, 1), ("f16", 1, 1), ("bf16", MAX_BATCH, 2), ("f32", MMA_MAX_BATCH["f32"], 2))]
            + ["LUCEBOX_MATVEC_TILED(q5_k, f16, 1, 8, 1, 2, 1)", "LUCEBOX_MATVEC_TILED(q6_k, bf16, 1, 4, 1, 3, 1)",
               "LUCEBOX_MATVEC_TILED_BOUNDED(q6_k, bf16, 1, 4, 1, 1, 0, 5)",
               "LUCEBOX_MATVEC_TILED_UNITS(q4_k, bf16, 1, 4, 3, 0)",
               f"LUCEBOX_MATVEC_TILED_UNITS(q6_k, bf16, {MAX_BATCH}, 4, 2, 0)"]
            + [f"LUCEBOX_MATVEC_TILED_S({f}, bf16, {b}, 4, 2, 1, 0)" for f in MMA_FORMATS
               for b in (GIVEN_SUMS_MIN_TILE, MAX_BATCH)]
            + [f"LUCEBOX_MATVEC_BULK({f}, bf16, {b}, 4)" for f in MMA_FORMATS for b in (1, MAX_BATCH)]
            + ["LUCEBOX_MATVEC_BULK(q4_k, f32, 8, 6)"]),
        "dequant.cu": KernelProgram("dequant.cu", [f"LUCEBOX_DEQUANT{kind}({f}, {a})" for kind in ("", "_ROWS")
                                                   for f in formats for a in acts] + ["LUCEBOX_UNTILE_ROWS()"]),
        "moe_matvec.cu": KernelProgram("moe_matvec.cu", [f"LUCEBOX_MOE_MATVEC{kind}({f}, {a})"
                                                         for kind in ("", "_PAGED", "_PAIR", "_PAIR_PAGED")
                                                         for f in formats for a in acts]),
        "rms_norm.cu": KernelProgram("rms_norm.cu", [f"LUCEBOX_RMS_NORM({a}, {w})" for a in acts for w in acts]),
        "moe_persistent.cu": KernelProgram("moe_persistent.cu", [
            f"LUCEBOX_MOE_PERSISTENT({g}, {d}, {a}, {n})" for g, d, a, n in places]),
        "ffn_persistent.cu": KernelProgram("ffn_persistent.cu", [
            f"LUCEBOX_FFN_PERSISTENT({g}, {d}, {a}, {n})" for g, d, a, n in places]
            + [f"LUCEBOX_FFN_PERSISTENT_R2({f}, {f}, {a}, f32)" for f, _, a, _ in places[:3]]),
        "gdn_persistent.cu": KernelProgram("gdn_persistent.cu", [
            f"LUCEBOX_GDN_PERSISTENT({q}, {r}, {a}, {n})" for q, r, a, n in places]),
        # Each format in each place once, and Qwen3.5's group sizes (the kernel's registers grow with them).
        "attention_persistent.cu": KernelProgram("attention_persistent.cu", [
            f"LUCEBOX_ATTENTION_PERSISTENT({f}, {o}, {MMA_FORMATS[(MMA_FORMATS.index(o) + 1) % 3]}, {a}, {n}, 4)"
            for f, o, a, n in places[:3]]
            + [f"LUCEBOX_ATTENTION_PERSISTENT(q4_k, q6_k, q4_k, {a}, {n}, {g})" for g, (_, _, a, n) in
               zip((1, 6, 8), places[1:])]),
        # A Q4_K_M 0.8B's lists (Q6_K on some layers' qkv, v and down products), with Q5_K in each place once.
        "qwen35_megakernel.cu": qwen35_megakernel([("q6_k", "q4_k"), ("q4_k", "q5_k")],
                                                  [("q4_k", "q4_k", "q4_k"), ("q5_k", "q6_k", "q4_k")],
                                                  [("q4_k", "q4_k"), ("q5_k", "q6_k")], "bf16", "f32", 4)[0],
        "moe_matvec_mma.cu": KernelProgram("moe_matvec_mma.cu", [
            f"LUCEBOX_MOE_MATVEC_MMA{kind}({f}, {a}, {w})" for kind in ("", "_PAGED", "_PAIR", "_PAIR_PAGED")
            for f in MMA_FORMATS for a in acts for w in ((2, 4) if (f, a) == ("q4_k", "bf16") else (4,))]
            + [f"LUCEBOX_MOE_MATVEC_MMA{kind}({f}, {a}, {w})" for kind in ("_SWIGLU", "_PAGED_SWIGLU")
               for f in MMA_FORMATS for a in ("bf16", "f16") for w in ((2, 4) if (f, a) == ("q4_k", "bf16") else (4,))]
            + [f"LUCEBOX_MOE_MATVEC_MMA(q6_k, f32, {w})" for w in (1, 8)]),
    }
