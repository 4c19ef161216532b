"""The tiled weight layout of matvec_tiled.cu (`lucebox_cuda.tiled_weights`), on the CPU.

What a lane of the tiled kernel loads from a tile is emulated from the kernel's source (`TileLayout<W>::load`) and
compared with what the row-major kernel's lane loads from GGUF's blocks (`MmaQ4K::load`, `MmaQ5K::load`,
`MmaQ6K::load` in mma_formats.cuh): equal for every lane, so both kernels multiply the same quants. The GPU test
(test_tiled_gpu.py) then holds the kernels' outputs to the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from lucebox_core.quants import QuantTensor
from lucebox_cuda import catalogue, ffn_persistent, tiled_weights
from lucebox_cuda.tiled_weights import BLOCK_BYTES, tile_rows, tiles_weight, untile_rows

FORMATS = tuple(BLOCK_BYTES)


def random_rows(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, cols // 256 * BLOCK_BYTES[fmt]), generator=gen, dtype=torch.uint8)


def u32(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset: offset + 4], "little")


def row_major_lane(fmt: str, block: bytes, t: int) -> dict:
    """The fields of `W::Raw` lane t loads from one row's GGUF block (mma_formats.cuh)."""
    if fmt == "q4_k":
        return {"head": block[:16], "qs": [block[16 + 32 * c + 8 * t: 24 + 32 * c + 8 * t] for c in range(4)]}
    if fmt == "q5_k":
        return {"head": block[:16], "qh": block[16 + 8 * t: 24 + 8 * t],
                "qs": [block[48 + 32 * c + 8 * t: 56 + 32 * c + 8 * t] for c in range(4)]}
    words = {"ql_a": [], "ql_b": [], "qh": []}
    for h in range(2):
        for i in range(2):
            b = 16 * i + 4 * t
            words["ql_a"].append(u32(block, 64 * h + b))
            words["ql_b"].append(u32(block, 64 * h + 32 + b))
            words["qh"].append(u32(block, 128 + 32 * h + b))
    return {**words, "sc": [u32(block, 192 + 4 * k) for k in range(4)], "d": block[208:210]}


def tiled_lane(fmt: str, tile: bytes, lane: int) -> tuple[dict, dict]:
    """The fields of rows g and g + 8 (`a`, `b`) lane `lane` loads from a tile (matvec_tiled.cu's TileLayout)."""
    g = lane >> 2
    if fmt in ("q4_k", "q5_k"):
        a, b = {"head": tile[16 * g: 16 * g + 16]}, {"head": tile[16 * (g + 8): 16 * (g + 8) + 16]}
        quants = 256
        if fmt == "q5_k":
            high = tile[256 + 16 * lane: 272 + 16 * lane]
            a["qh"], b["qh"] = high[:8], high[8:]
            quants = 768
        chunks = [tile[quants + 512 * c + 16 * lane: quants + 512 * c + 16 * lane + 16] for c in range(4)]
        a["qs"], b["qs"] = [v[:8] for v in chunks], [v[8:] for v in chunks]
        return a, b
    rows = []
    for row, first in ((g, 0), (g + 8, 3)):
        fields = {"d": tile[2 * row: 2 * row + 2], "sc": [u32(tile, 32 + 16 * row + 4 * k) for k in range(4)]}
        for k, name in enumerate(("ql_a", "ql_b", "qh")):
            offset = 288 + 512 * (first + k) + 16 * lane
            fields[name] = [u32(tile, offset + 4 * w) for w in range(4)]
        rows.append(fields)
    return rows[0], rows[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_lane_loads_from_a_tile_what_it_loads_from_the_rows(fmt):
    cols = 512
    raw = random_rows(fmt, 16, cols, seed=1)
    tiles = tile_rows(raw, fmt, 16, cols)
    block = BLOCK_BYTES[fmt]
    for b in range(cols // 256):
        tile = bytes(tiles[0, b * 16 * block: (b + 1) * 16 * block].tolist())
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            a, second = tiled_lane(fmt, tile, lane)
            assert a == row_major_lane(fmt, bytes(raw[g, b * block: (b + 1) * block].tolist()), t), (b, lane)
            assert second == row_major_lane(fmt, bytes(raw[g + 8, b * block: (b + 1) * block].tolist()), t), (b, lane)


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_untile_gives_the_rows_back(fmt, block_major):
    rows, cols = 37, 768  # not a multiple of 16: the last group is padded
    raw = random_rows(fmt, rows, cols, seed=2)
    tiles = tile_rows(raw, fmt, rows, cols, block_major)
    assert tuple(tiles.shape) == tiled_weights.tiled_shape(fmt, rows, cols, block_major)
    assert torch.equal(untile_rows(tiles, fmt, rows, cols, block_major), raw)
    # The padded rows are zeros; every byte of the weight is in the copy once.
    assert int(tiles.to(torch.int64).sum()) == int(raw.to(torch.int64).sum())


def test_tile_orders_put_the_same_tiles_in_different_places():
    fmt, rows, cols = "q6_k", 48, 768
    raw = random_rows(fmt, rows, cols, seed=3)
    by_group, by_block = tile_rows(raw, fmt, rows, cols), tile_rows(raw, fmt, rows, cols, True)
    tile = 16 * BLOCK_BYTES[fmt]
    # Tile (group 2, block 1): the 2nd tile of group 2's row; block-major, group 2 of block 1's row.
    assert torch.equal(by_group[2, tile: 2 * tile], by_block[1, 2 * tile: 3 * tile])
    assert not torch.equal(by_group, by_block)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_ranges_read_from_the_tiles_are_the_rows(fmt):
    rows, cols = 53, 512
    raw = random_rows(fmt, rows, cols, seed=4)
    tiles = tile_rows(raw, fmt, rows, cols)
    for start, stop in ((0, 53), (0, 16), (5, 6), (17, 48), (31, 53), (52, 53)):
        assert torch.equal(tiled_weights.row_range_bytes(tiles, fmt, rows, cols, start, stop), raw[start:stop])


def _untile_rows_kernel(tiles: torch.Tensor, offsets: torch.Tensor, first_row: int, rows: int, blocks: int,
                        half_block: int, ids: list[int] | None = None) -> torch.Tensor:
    """dequant.cu's `untile_body` (`untile_rows`; with `ids`, `untile_rows_at`), thread by thread in torch: output
    unit u of row r from the tile's unit through the offsets table, the indices computed as the kernel computes them."""
    units = tiles.reshape(-1).view(torch.int16)
    row_units = blocks * half_block
    out = torch.empty(rows, row_units, dtype=torch.int16)
    for r in range(rows):
        row = ids[r] if ids is not None else first_row + r
        group_start = (row >> 4) * blocks * 16 * half_block
        u = torch.arange(row_units)
        b = u // half_block
        out[r] = units[group_start + b * 16 * half_block + offsets[row & 15][u - b * half_block].long()]
    return out.view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_untile_kernels_unit_offsets_give_the_rows_back(fmt):
    """A prefill reads a tiled weight's rows through `untile_rows` (2-byte units through `unit_offsets`): every row
    range, padded last group included, must come back as the file's bytes."""
    rows, cols = 53, 768
    raw = random_rows(fmt, rows, cols, seed=5)
    tiles = tile_rows(raw, fmt, rows, cols)
    offsets = tiled_weights.unit_offsets(fmt, torch.device("cpu"))
    half_block = BLOCK_BYTES[fmt] // 2
    assert offsets.shape == (16, half_block) and offsets.dtype == torch.int32
    # A permutation of a tile's units: each row's units are its own, none read twice.
    assert torch.equal(offsets.reshape(-1).sort().values, torch.arange(16 * half_block, dtype=torch.int32))
    for start, stop in ((0, 53), (5, 6), (17, 48), (31, 53)):
        got = _untile_rows_kernel(tiles, offsets, start, stop - start, cols // 256, half_block)
        assert torch.equal(got, raw[start:stop])
    ids = [0, 52, 17, 17, 31, 16, 5]  # an embedding lookup's rows (`untile_rows_at`): repeats, the padded group
    assert torch.equal(_untile_rows_kernel(tiles, offsets, 0, len(ids), cols // 256, half_block, ids), raw[ids])


def test_bad_shapes_are_refused_by_name():
    raw = random_rows("q6_k", 16, 512)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        tile_rows(raw, "q6_k", 16, 500)
    with pytest.raises(ValueError, match=r"q6_k \[16, 768\]: expected"):
        tile_rows(raw, "q6_k", 16, 768)
    with pytest.raises(ValueError, match="no tiled layout for 'q8_0'"):
        tiled_weights.tile_order("q8_0")
    with pytest.raises(ValueError, match="a tiled copy is"):
        untile_rows(raw, "q6_k", 16, 512)


def quant(ggml_type: T, shape: tuple[int, ...]) -> QuantTensor:
    blocks = int(np.prod(shape)) // 256
    nbytes = blocks * {T.Q6_K: 210, T.Q4_K: 144}[ggml_type]
    return QuantTensor("w", ggml_type, shape, torch.zeros(nbytes, dtype=torch.uint8))


def test_which_weights_are_held_tiled(monkeypatch):
    monkeypatch.delenv(tiled_weights.ENV_SWITCH, raising=False)
    assert tiles_weight(quant(T.Q6_K, (5120, 17408)))  # the 27B's down product: the 4-warp class
    assert tiles_weight(quant(T.Q6_K, (248320, 5120)))  # its head
    assert not tiles_weight(quant(T.Q6_K, (1024, 5120)))  # few long rows: 8 warps, 4 K-slices, row-major
    assert not tiles_weight(quant(T.Q4_K, (17408, 5120)))  # Q4_K: row-major measured faster at batch 1
    assert not tiles_weight(quant(T.Q6_K, (4, 1024, 256)))  # an expert stack
    assert not tiles_weight(torch.zeros(16, 256))
    # The persistent kernels read GGUF's rows: they refuse what the backend holds tiled.
    assert ffn_persistent.mma_format(quant(T.Q6_K, (5120, 17408)), 17408) is None
    monkeypatch.setenv(tiled_weights.ENV_SWITCH, "0")
    assert not tiles_weight(quant(T.Q6_K, (5120, 17408)))
    assert ffn_persistent.mma_format(quant(T.Q6_K, (5120, 17408)), 17408) == "q6_k"


def test_bulk_copies_when_on_hold_every_tiled_format_tiled_on_hopper_and_later(monkeypatch):
    monkeypatch.delenv(tiled_weights.ENV_SWITCH, raising=False)
    monkeypatch.delenv(tiled_weights.BULK_DEPTH_SWITCH, raising=False)
    monkeypatch.delenv(tiled_weights.BULK_SWITCH, raising=False)
    assert not tiled_weights.bulk_copies("sm_90")  # off by default: measured slower (session 36)
    monkeypatch.setenv(tiled_weights.BULK_SWITCH, "1")
    assert [tiled_weights.bulk_copies(a) for a in ("sm_86", "sm_89", "sm_90", "sm_120", "gfx1100")] == [
        False, False, True, True, False]
    assert tiles_weight(quant(T.Q4_K, (17408, 5120)), bulk=True)
    assert not tiles_weight(quant(T.Q4_K, (1024, 5120)), bulk=True)  # 8 warps, 4 K-slices: another class
    # The persistent kernels refuse it wherever some device would hold it tiled.
    assert ffn_persistent.mma_format(quant(T.Q4_K, (17408, 5120)), 5120) is None
    assert tiled_weights.bulk_depth() == tiled_weights.BULK_DEPTH
    monkeypatch.setenv(tiled_weights.BULK_DEPTH_SWITCH, "6")
    assert tiled_weights.bulk_depth() == 6
    for bad in ("1", "17", "four"):
        monkeypatch.setenv(tiled_weights.BULK_DEPTH_SWITCH, bad)
        with pytest.raises(ValueError, match="LUCEBOX_BULK_DEPTH"):
            tiled_weights.bulk_depth()
    monkeypatch.setenv(tiled_weights.BULK_SWITCH, "0")
    assert not tiled_weights.bulk_copies("sm_90")
    program, name, shared = catalogue.matvec_bulk("q6_k", "bf16", 9, 4)
    assert name == "matvec_bulk_d4_q6_k_bf16_12" and shared == 4 * 4 * 16 * 210 and program.file == "matvec_tiled.cu"


@pytest.mark.parametrize("module", ["ffn_persistent", "gdn_persistent", "attention_persistent", "moe_persistent"])
def test_a_persistent_kernel_switched_on_keeps_the_weights_row_major(monkeypatch, module):
    import importlib

    switch = importlib.import_module(f"lucebox_cuda.{module}").ENV_SWITCH
    assert switch in tiled_weights.PERSISTENT_SWITCHES
    monkeypatch.delenv(tiled_weights.ENV_SWITCH, raising=False)
    monkeypatch.setenv(switch, "1")
    assert not tiles_weight(quant(T.Q6_K, (5120, 17408)))
    assert ffn_persistent.mma_format(quant(T.Q6_K, (5120, 17408)), 17408) == "q6_k"


def test_only_the_cuda_backend_holds_weights_tiled():
    from lucebox_cuda.backend import CudaBackend
    from lucebox_hip.backend import HipBackend

    assert CudaBackend.tiles_weights and not HipBackend.tiles_weights  # HIP has no tensor-core kernel


def test_the_upload_tiles_in_chunks_the_same_bytes(monkeypatch):
    rows, cols = 100, 512
    raw = random_rows("q6_k", rows, cols, seed=5)
    weight = QuantTensor("w", T.Q6_K, (rows, cols), raw.reshape(-1).clone())
    monkeypatch.setattr(tiled_weights, "CHUNK_BYTES", 3 * raw.shape[1] * 16)  # 3 groups a chunk: 3 chunks, one short
    assert torch.equal(tiled_weights.upload(weight, torch.device("cpu")), tile_rows(raw, "q6_k", rows, cols))
