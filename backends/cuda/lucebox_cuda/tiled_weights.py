"""The tiled layout of K-quant weights that `matvec_tiled.cu` reads (see its header for why and the offsets).

A tile is 16 weight rows x one GGUF block (256 values): the same bytes as those 16 blocks, reordered so that each
lane of the warp that multiplies them reads its pieces with 16-byte loads and a warp's loads are contiguous. Rows are
padded with zero rows to a multiple of 16. Tiles follow each other row-group-major (tile (row group G, block b) is the
(G * blocks_per_row + b)-th: a [groups, blocks * tile bytes] tensor) or block-major (the (b * groups + G)-th: a
[blocks, groups * tile bytes] tensor), the kernel's ORDER 0 or 1.
Pure torch (no GPU needed): `tile_rows` on the device tensor at upload, `untile_rows` to get the file's bytes back.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from lucebox_core.quants import QuantTensor

from . import catalogue

ROWS = 16  # a tile's rows: the mma's M
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
TILED_FORMATS = tuple(BLOCK_BYTES)


def block_bytes(fmt: str) -> int:
    """A GGUF block's bytes in a tiled format; a clear error for the others."""
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"no tiled layout for {fmt!r}; tiled formats: {', '.join(TILED_FORMATS)}")
    return BLOCK_BYTES[fmt]


def _lane_pieces(fmt: str) -> list[tuple[int, int, int]]:
    """(tile offset, row in the group, byte offset in the row's block) of each 4-byte piece a tile holds, in the
    order `matvec_tiled.cu`'s TileLayout reads them (lane L = 4g + t holds rows g and g + 8)."""
    pieces = []
    if fmt in ("q4_k", "q5_k"):
        pieces += [(16 * row + 4 * w, row, 4 * w) for row in range(ROWS) for w in range(4)]  # heads
        quants = 256
        if fmt == "q5_k":  # qh: row g's bytes 8t.. then row g+8's, 16 bytes a lane
            pieces += [(256 + 16 * lane + 8 * half + 4 * w, lane // 4 + 8 * half, 16 + 8 * (lane % 4) + 4 * w)
                       for lane in range(32) for half in range(2) for w in range(2)]
            quants = 768
        first = 16 if fmt == "q4_k" else 48
        pieces += [(quants + 512 * c + 16 * lane + 8 * half + 4 * w, lane // 4 + 8 * half,
                    first + 32 * c + 8 * (lane % 4) + 4 * w)
                   for c in range(4) for lane in range(32) for half in range(2) for w in range(2)]
    else:  # q6_k
        pieces += [(32 + 16 * row + 4 * w, row, 192 + 4 * w) for row in range(ROWS) for w in range(4)]  # scales
        for k in range(6):
            kind = k % 3  # ql_a, ql_b, qh: word [2h + i] at 64h + 16i + 4t (+32), 128 + 32h + 16i + 4t
            for lane in range(32):
                row, t = lane // 4 + (8 if k >= 3 else 0), lane % 4
                for h in range(2):
                    for i in range(2):
                        source = (128 + 32 * h if kind == 2 else 64 * h + 32 * kind) + 16 * i + 4 * t
                        pieces.append((288 + 512 * k + 16 * lane + 4 * (2 * h + i), row, source))
    return pieces


@lru_cache(maxsize=None)
def tile_order(fmt: str) -> np.ndarray:
    """For each byte of a tile, the byte of the 16 rows' blocks ([16, BLOCK_BYTES] flattened) it copies."""
    block = block_bytes(fmt)
    order = np.full(ROWS * block, -1, dtype=np.int64)
    for offset, row, source in _lane_pieces(fmt):
        order[offset: offset + 4] = row * block + source + np.arange(4)
    if fmt == "q6_k":  # each row's d (2 bytes, at 208 of its block) at 2 r
        for row in range(ROWS):
            order[2 * row: 2 * row + 2] = row * block + 208 + np.arange(2)
    if (order < 0).any() or len(np.unique(order)) != order.size:
        raise AssertionError(f"{fmt}: the tile order is not a permutation")  # a layout bug, not bad input
    return order


def tiled_shape(fmt: str, rows: int, cols: int, block_major: bool = False) -> tuple[int, int]:
    """The shape of the tiled copy of a [rows, cols] weight: (row groups, their bytes) or (blocks, their bytes)."""
    if cols % 256:
        raise ValueError(f"{fmt}: {cols} columns is not a multiple of 256")
    groups, blocks, tile = -(-rows // ROWS), cols // 256, ROWS * block_bytes(fmt)
    return (blocks, groups * tile) if block_major else (groups, blocks * tile)


def tile_rows(raw: torch.Tensor, fmt: str, rows: int, cols: int, block_major: bool = False) -> torch.Tensor:
    """The tiled copy (`tiled_shape`, uint8, on raw's device) of a weight's GGUF bytes `raw` (its rows' blocks one
    after another, any shape of rows * cols / 256 * BLOCK_BYTES bytes)."""
    block = block_bytes(fmt)
    groups, blocks = -(-rows // ROWS), cols // 256
    tiled_shape(fmt, rows, cols)
    flat = raw.reshape(-1)
    if flat.numel() != rows * blocks * block or flat.dtype != torch.uint8:
        raise ValueError(f"{fmt} [{rows}, {cols}]: expected {rows * blocks * block} bytes of uint8, got "
                         f"{flat.numel()} of {flat.dtype}")
    padded = torch.zeros(groups * ROWS * blocks * block, dtype=torch.uint8, device=raw.device)
    padded[: flat.numel()] = flat
    # [G, 16, B, block] -> [G, B, 16 * block]: one tile's source bytes together, then reordered.
    slabs = padded.view(groups, ROWS, blocks, block).permute(0, 2, 1, 3).reshape(groups, blocks, ROWS * block)
    order = torch.from_numpy(tile_order(fmt)).to(raw.device)
    tiles = slabs.index_select(2, order)
    if block_major:
        tiles = tiles.transpose(0, 1).contiguous()
    return tiles.reshape(tiled_shape(fmt, rows, cols, block_major))


def untile_rows(tiles: torch.Tensor, fmt: str, rows: int, cols: int, block_major: bool = False) -> torch.Tensor:
    """The GGUF bytes ([rows, cols / 256 * BLOCK_BYTES]) of a tiled copy: `tile_rows`' inverse."""
    block = block_bytes(fmt)
    groups, blocks = -(-rows // ROWS), cols // 256
    shape = tiled_shape(fmt, rows, cols, block_major)
    if tuple(tiles.shape) != shape:
        raise ValueError(f"{fmt} [{rows}, {cols}]: a tiled copy is {list(shape)}, got {list(tiles.shape)}")
    inverse = _positions(fmt, tiles.device).reshape(-1)
    if block_major:
        tiles = tiles.reshape(blocks, groups, ROWS * block).transpose(0, 1)
    slabs = tiles.reshape(groups, blocks, ROWS * block).index_select(2, inverse)
    rows_bytes = slabs.view(groups, blocks, ROWS, block).permute(0, 2, 1, 3).reshape(groups * ROWS, blocks * block)
    return rows_bytes[:rows]


# -- which weights the CUDA backend holds tiled, and reading them back ----------------------------------------------

ENV_SWITCH = "LUCEBOX_TILED_WEIGHTS"  # "0": every weight stays in GGUF's row-major layout (bisecting, sweeps)
# The persistent kernels' switches (their modules' ENV_SWITCH): those kernels read GGUF's rows, so with one of them on
# every weight stays row-major, for the kernel asked for to run.
PERSISTENT_SWITCHES = ("LUCEBOX_PERSISTENT_FFN", "LUCEBOX_PERSISTENT_GDN", "LUCEBOX_PERSISTENT_ATTENTION",
                       "LUCEBOX_PERSISTENT_MOE")
# The megakernel's (`megakernel.ENV_SWITCH`): it reads every layer's weights as GGUF's rows, not the head's, which
# its own kernel runs after it (GGUF's names for the head: the tied embedding or the output weight).
MEGAKERNEL_SWITCH = "LUCEBOX_MEGAKERNEL"
HEAD_NAMES = ("token_embd.weight", "output.weight")
# Formats held tiled by default. Measured (scripts/tiled_probe.py, H100, session 27): Q6_K products 1.16-1.30x faster
# at batch 1 (the 27B's head at the copy bandwidth) and up to 1.28x at 16 rows; Q4_K's large products are 5-25% faster
# row-major at batch 1, so Q4_K stays row-major. Q5_K is untimed.
DEFAULT_FORMATS = ("q6_k",)
# LUCEBOX_BULK_COPIES=1 (sm_90 and later): the products read tiles through bulk copies (matvec_tiled.cu's
# LUCEBOX_MATVEC_BULK), every tiled format is held tiled, and products of up to BULK_MAX_BATCH activation rows take
# that kernel, DEPTH tiles a warp in flight. Off by default: slower than the row-major `mma_pp` on every Q4_K decode
# product of the 27B (H100, session 36: gate | up 1,963 against 2,218 GB/s, down 1,064 against 1,777; the 27B's tg128
# 95.6 against 108.9 tok/s), and than the register ring on its Q6_K ones but the verify rows' down product.
BULK_SWITCH = "LUCEBOX_BULK_COPIES"
BULK_DEPTH_SWITCH = "LUCEBOX_BULK_DEPTH"
BULK_DEPTH = 4
BULK_MAX_BATCH = 16
CHUNK_BYTES = 32 << 20  # the upload tiles this many source bytes at a time: no whole-weight temporary


def bulk_copies(arch: str) -> bool:
    """Whether products of tiled weights on a device of `arch` ("sm_90") read their tiles through bulk copies."""
    return (os.environ.get(BULK_SWITCH, "0") == "1" and arch.startswith("sm_") and arch[3:].isdigit()
            and int(arch[3:]) >= 90)


def bulk_depth() -> int:
    """Tiles a warp has in flight in the bulk-copy kernel: BULK_DEPTH, or LUCEBOX_BULK_DEPTH (2..16)."""
    value = os.environ.get(BULK_DEPTH_SWITCH, "")
    if not value:
        return BULK_DEPTH
    if not value.isdigit() or not 2 <= int(value) <= 16:
        raise ValueError(f"{BULK_DEPTH_SWITCH}={value!r}: expected a whole number of tiles from 2 to 16")
    return int(value)


def tiles_weight(weight: Any, bulk: bool = False) -> bool:
    """Whether the CUDA backend holds `weight` (a QuantTensor) tiled: a 2-D weight of a DEFAULT_FORMATS format whose
    products are of the 4-warp one-slice class (`catalogue.arithmetic_class`; shapes of few rows and long ones take
    8 warps and 4 K-slices and stay row-major), unless LUCEBOX_TILED_WEIGHTS=0 or a persistent kernel is switched on
    (PERSISTENT_SWITCHES; with the megakernel's, the head may still be tiled). `bulk`: the device reads tiles through
    bulk copies (`bulk_copies`), which holds every tiled format tiled. The backend asks once a weight, at its first
    use."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or any(os.environ.get(name) == "1" for name in PERSISTENT_SWITCHES):
        return False
    if not isinstance(weight, QuantTensor) or len(weight.shape) != 2:
        return False
    if os.environ.get(MEGAKERNEL_SWITCH) == "1" and weight.name not in HEAD_NAMES:
        return False
    fmt = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
    rows, cols = weight.shape
    if fmt not in (TILED_FORMATS if bulk else DEFAULT_FORMATS) or cols % 256:
        return False
    return catalogue.arithmetic_class(catalogue.default_variant(fmt, "bf16", 1, rows, cols)) == ("mma", 4, 1)


def upload(weight: Any, device: torch.device) -> torch.Tensor:
    """The tiled copy of `weight` (a QuantTensor) on `device`, row-group-major, made a chunk of row groups at a time."""
    fmt = catalogue.WEIGHT_FORMATS[weight.ggml_type]
    rows, cols = weight.shape
    flat = weight.data.reshape(-1)
    row_bytes = flat.numel() // rows
    out = torch.empty(tiled_shape(fmt, rows, cols), dtype=torch.uint8, device=device)
    step = max(ROWS, CHUNK_BYTES // row_bytes // ROWS * ROWS)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = flat[start * row_bytes: stop * row_bytes].to(device)
        out[start // ROWS: -(-stop // ROWS)] = tile_rows(chunk, fmt, stop - start, cols)
    return out


def row_range_bytes(tiles: torch.Tensor, fmt: str, rows: int, cols: int, start: int, stop: int) -> torch.Tensor:
    """The GGUF bytes ([stop - start, row bytes]) of rows start..stop-1 of a row-group-major tiled copy: the row
    groups that hold them untiled (a reorder inside each tile, no index a byte: a prefill reads whole weights)."""
    groups = -(-rows // ROWS)
    first, last = start // ROWS, -(-stop // ROWS)
    part = tiles.reshape(groups, -1)[first:last]
    return untile_rows(part, fmt, (last - first) * ROWS, cols)[start - first * ROWS: stop - first * ROWS]


@lru_cache(maxsize=None)
def unit_offsets(fmt: str, device: torch.device) -> torch.Tensor:
    """[16, block / 2] int32: where, in 2-byte units inside a tile, unit j of row r's block lies (dequant.cu's
    `untile_rows` reads a tiled weight's rows back through it). Every piece a tile holds is 2 or 4 bytes at an even
    offset, so a unit's two bytes stay together: checked here, once a format."""
    where = torch.from_numpy(np.argsort(tile_order(fmt))).view(ROWS, BLOCK_BYTES[fmt])
    low, high = where[:, 0::2], where[:, 1::2]
    if bool((low % 2).any()) or not torch.equal(high, low + 1):
        raise AssertionError(f"{fmt}'s tile layout splits a 2-byte unit of a block")
    return (low // 2).to(torch.int32).contiguous().to(device)


@lru_cache(maxsize=None)  # made once a device
def _positions(fmt: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.argsort(tile_order(fmt))).view(ROWS, BLOCK_BYTES[fmt]).to(device)
