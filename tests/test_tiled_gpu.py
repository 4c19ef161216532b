"""The tiled-layout matrix-vector kernel (matvec_tiled.cu) and the weights the CUDA backend holds tiled, on a GPU.

The tiled kernel is the `mma` kernel's arithmetic (4 warps a row group, warp w takes GGUF blocks w, w+4, ...) over
the same bytes in another order, so its outputs must equal the row-major `mma` kernel's to the bit at every batch, for
one row tile a block, two, and warp units. A weight held tiled must give a verify row the decode step's bits, and its
rows read back (prefill, embedding lookup) must be the row-major path's exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from lucebox_core.errors import LuceboxError
from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TYPES = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
ROWS, COLS = 1000, 1536  # 62.5 row groups: the last one padded


@pytest.fixture(scope="module")
def backend():
    from lucebox_cuda.backend import CudaBackend

    return CudaBackend(dtype=torch.bfloat16)


def weight_rows(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, row bytes] of valid random blocks (Q5_K: random bytes with small positive d and dmin)."""
    if fmt == "q5_k":
        raw = np.random.default_rng(seed).integers(0, 256, (rows * cols // 256, 176), dtype=np.uint8)
        raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    else:
        raw = random_blocks(TYPES[fmt], rows * cols, 0.05, np.random.default_rng(seed))
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1).copy())


def row_major(fmt: str, raw: torch.Tensor, monkeypatch) -> QuantTensor:
    """A QuantTensor the backend keeps in GGUF's rows (decided with the switch off, once for the weight)."""
    from lucebox_cuda import tiled_weights

    weight = QuantTensor("row_major", TYPES[fmt], (raw.shape[0], COLS), raw.reshape(-1).clone())
    monkeypatch.setenv(tiled_weights.ENV_SWITCH, "0")
    return weight


# (activation, batch tile, kernel kind, row tiles); one program a format holds them all (a compile is seconds).
CASES = [("bf16", 1, "block", 1), ("bf16", 1, "units", 1), ("bf16", 24, "block", 1), ("bf16", 24, "block", 2),
         ("bf16", 24, "units", 1), ("bf16", 64, "block", 2), ("f32", 3, "block", 2), ("f32", 8, "units", 1)]


def program(fmt: str):
    from lucebox_cuda.nvrtc import KernelProgram

    lines = [f"LUCEBOX_MATVEC_TILED_UNITS({fmt}, {act}, {tile}, 4, 2, 0)" if kind == "units" else
             f"LUCEBOX_MATVEC_TILED({fmt}, {act}, {tile}, 4, {row_tiles}, 3, 0)" for act, tile, kind, row_tiles in CASES]
    return KernelProgram("matvec_tiled.cu", lines)


def launch_tiled(backend, tiles, x, out, fmt: str, tile: int, kind: str, row_tiles: int):
    """A tiled kernel (3 blocks ahead, or 2 for warp units: the backend's 1 is in the model paths' tests) into `out`."""
    from lucebox_cuda import catalogue
    from lucebox_cuda.nvrtc import Int, Pointer

    act, batch = catalogue.ACTIVATIONS[x.dtype], x.shape[0]
    args = [Pointer(tiles.data_ptr()), Pointer(x.data_ptr()), Pointer(out.data_ptr()), Int(ROWS), Int(COLS), Int(batch)]
    groups = -(-ROWS // 16)
    if kind == "units":
        columns = 8 * -(-tile * (3 if act == "f32" else 1) // 8)
        partials = torch.empty(groups * 4 * 16 * columns, device="cuda")
        counters = torch.zeros(groups, dtype=torch.int32, device="cuda")
        backend._launch((program(fmt), f"matvec_tiled_units_w4_a2_o0_{fmt}_{act}_{tile}"), groups * 4, 32, *args,
                        Pointer(partials.data_ptr()), Pointer(counters.data_ptr()))
        torch.cuda.synchronize()
        assert int(counters.sum()) == 0  # the last warp of each group reset its counter
        return
    backend._launch((program(fmt), f"matvec_tiled_w4_r{row_tiles}_a3_o0_{fmt}_{act}_{tile}"), -(-groups // row_tiles),
                    128, *args)


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_the_tiled_kernel_gives_the_mma_kernels_bits(backend, monkeypatch, fmt):
    from lucebox_cuda.tiled_weights import tile_rows

    raw = weight_rows(fmt, ROWS, COLS, seed=1)
    weight = row_major(fmt, raw, monkeypatch)
    tiles = tile_rows(raw.cuda(), fmt, ROWS, COLS)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for act, tile, kind, row_tiles in CASES:
        for batch in sorted({tile, max(1, tile - 1)}):  # a full batch tile and one short of it
            x = torch.randn(batch, COLS, device="cuda", generator=gen).to(dtypes[act])
            expected = backend.matvec(x, weight, variant="mma")
            assert torch.isfinite(expected.float()).all() and expected.abs().max() > 0
            out = torch.full_like(expected, float("nan"))
            launch_tiled(backend, tiles, x, out, fmt, tile, kind, row_tiles)
            torch.cuda.synchronize()
            assert torch.equal(out, expected), (fmt, act, batch, kind, row_tiles)


def test_a_weight_held_tiled_gives_every_batch_the_decode_steps_bits(backend, monkeypatch):
    from lucebox_cuda import ffn_persistent

    raw = weight_rows("q6_k", 4096, COLS, seed=3)
    monkeypatch.delenv("LUCEBOX_TILED_WEIGHTS", raising=False)
    tiled = QuantTensor("blk.0.ffn_down.weight", T.Q6_K, (4096, COLS), raw.reshape(-1).clone())
    assert backend.holds_tiled(tiled)
    assert ffn_persistent.mma_format(tiled, COLS) is None  # the persistent kernels read GGUF's rows
    plain = QuantTensor("plain", T.Q6_K, (4096, COLS), raw.reshape(-1).clone())
    monkeypatch.setenv("LUCEBOX_TILED_WEIGHTS", "0")
    assert not backend.holds_tiled(plain) and backend.holds_tiled(tiled)  # decided once a weight
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(23, COLS, device="cuda", generator=gen).to(torch.bfloat16)
    verify = backend.matvec(x, tiled)
    assert torch.equal(verify, backend.matvec(x, plain, variant="mma"))  # the row-major kernel of the same class
    for row in (0, 7, 22):
        assert torch.equal(backend.matvec(x[row: row + 1], tiled)[0], verify[row])
    # fp32 activations: 8 rows a launch, the same class, so row 20 of 23 is its own batch-1 product.
    x32 = x.float()
    assert torch.equal(backend.matvec(x32, tiled)[20], backend.matvec(x32[20:21], tiled)[0])
    with pytest.raises(ValueError, match="held tiled: matvec variant 'mma'"):
        backend.matvec(x, tiled, variant="mma")
    with pytest.raises(LuceboxError, match="'blk.0.ffn_down.weight' is held tiled"):
        backend.device_weight(tiled)


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 6e-3), (torch.float32, 2e-5)])
def test_a_weight_held_tiled_multiplies_as_gguf_decodes_it(backend, monkeypatch, dtype, bound):
    """Against an independent reference: gguf's numpy decoder of the file's bytes, the product in float64."""
    raw = weight_rows("q6_k", 4096, COLS, seed=6)
    monkeypatch.delenv("LUCEBOX_TILED_WEIGHTS", raising=False)
    tiled = QuantTensor("tiled", T.Q6_K, (4096, COLS), raw.reshape(-1).clone())
    assert backend.holds_tiled(tiled)
    dense = torch.from_numpy(gguf_quants.dequantize(raw.numpy(), T.Q6_K)).double().reshape(4096, COLS)
    x = torch.randn(11, COLS, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected = x.to(dtype).double() @ dense.T
    got = backend.matvec(x.to(dtype).cuda(), tiled).double().cpu()
    assert float((got - expected).norm() / expected.norm()) < bound


def test_rows_of_a_weight_held_tiled_read_back_exactly(backend, monkeypatch):
    raw = weight_rows("q6_k", 4100, COLS, seed=5)  # a padded last group
    monkeypatch.delenv("LUCEBOX_TILED_WEIGHTS", raising=False)
    tiled = QuantTensor("tiled", T.Q6_K, (4100, COLS), raw.reshape(-1).clone())
    assert backend.holds_tiled(tiled)
    plain = row_major("q6_k", raw, monkeypatch)
    for start, stop in ((0, 4100), (37, 1000), (4090, 4100)):
        assert torch.equal(backend.dequantize_rows(tiled, start, stop), backend.dequantize_rows(plain, start, stop))
    ids = torch.tensor([[4099, 0, 17], [17, 2048, 5]], device="cuda")
    expected = backend.lookup_rows(plain, ids)
    assert torch.equal(backend.lookup_rows(tiled, ids), expected)
    # Inside a recorded step: the ids are read on the device at replay.
    ids_static = ids.clone()
    out = backend.lookup_rows(tiled, ids_static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.lookup_rows(tiled, ids_static)
    ids_static.copy_(torch.tensor([[1, 2, 3], [4095, 4096, 4097]], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, backend.lookup_rows(plain, ids_static))
    # A prefill product through the tiles equals the row-major one (dequantized rows, then one GEMM).
    x = torch.randn(100, COLS, device="cuda").to(torch.bfloat16)
    assert torch.equal(backend.tiled_linear(x, tiled, "q6_k"), backend.tiled_linear(x, plain, "q6_k"))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_a_prefill_product_in_several_tiles_writes_each_into_its_columns(backend, monkeypatch, fmt):
    """`tiled_linear` with tiles smaller than the weight: cuBLAS writes each tile's product into its column block of
    the output (no copy). Every column block must be that tile's own product, and the whole the float64 product."""
    from lucebox_cuda import backend as backend_module

    rows = 1000
    weight = row_major(fmt, weight_rows(fmt, rows, COLS, 11), monkeypatch)
    x = torch.randn(300, COLS, device="cuda").to(torch.bfloat16)
    tile_rows = 160  # rows of 1536 bf16 values: 6 full tiles and a short one
    monkeypatch.setattr(backend_module, "PREFILL_TILE_BYTES", tile_rows * COLS * 2)
    out = backend.tiled_linear(x, weight, fmt)
    assert out.shape == (300, rows) and out.is_contiguous()
    dense = backend.dequantize_rows(weight, 0, rows, torch.bfloat16)
    for start in range(0, rows, tile_rows):
        stop = min(start + tile_rows, rows)
        assert torch.equal(out[:, start:stop], torch.mm(x, dense[start:stop].t()))
    reference = x.double() @ dense.double().t()
    assert torch.allclose(out.double(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


needs_bulk = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="bulk copies need sm_90 or later")


@needs_bulk
@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_the_bulk_copy_kernel_gives_the_mma_kernels_bits(backend, monkeypatch, fmt):
    """Rows of 6 GGUF blocks (warps of 2 and 1 tiles, the whole walk asked for at once) and of 25 (7 a warp: the ring
    refilled, each stage reused at two parities) at ring depths 2 and 4, full and short batch tiles."""
    from lucebox_cuda import catalogue
    from lucebox_cuda.nvrtc import Int, Pointer
    from lucebox_cuda.tiled_weights import tile_rows

    gen = torch.Generator(device="cuda").manual_seed(7)
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for cols in (COLS, 25 * 256):
        raw = weight_rows(fmt, ROWS, cols, seed=cols)
        weight = QuantTensor("row_major", TYPES[fmt], (ROWS, cols), raw.reshape(-1).clone())
        monkeypatch.setenv("LUCEBOX_TILED_WEIGHTS", "0")
        tiles = tile_rows(raw.cuda(), fmt, ROWS, cols)
        for act, batch, depth in (("bf16", 1, 2), ("bf16", 1, 4), ("bf16", 11, 4), ("bf16", 16, 2), ("f32", 8, 4)):
            x = torch.randn(batch, cols, device="cuda", generator=gen).to(dtypes[act])
            expected = backend.matvec(x, weight, variant="mma")
            assert torch.isfinite(expected.float()).all() and expected.abs().max() > 0
            program, name, shared = catalogue.matvec_bulk(fmt, act, batch, depth)
            backend.ring_kernel(program, name, shared)
            out = torch.full_like(expected, float("nan"))
            backend._launch((program, name), -(-ROWS // 16), 128, Pointer(tiles.data_ptr()), Pointer(x.data_ptr()),
                            Pointer(out.data_ptr()), Int(ROWS), Int(cols), Int(batch), shared_bytes=shared)
            torch.cuda.synchronize()
            assert torch.equal(out, expected), (fmt, cols, act, batch, depth)


@needs_bulk
def test_a_q4_k_weight_held_tiled_for_bulk_copies_gives_decode_and_verify_the_row_major_bits(backend, monkeypatch):
    """The backend's own path: a Q4_K weight held tiled with bulk copies on; batch 1 and 16 take the bulk kernel,
    24 the register ring; every row equals the row-major `mma` kernel's, and the verify row its decode step's."""
    from lucebox_cuda import tiled_weights

    monkeypatch.delenv("LUCEBOX_TILED_WEIGHTS", raising=False)
    monkeypatch.setenv(tiled_weights.BULK_SWITCH, "1")
    raw = weight_rows("q4_k", 4096, COLS, seed=9)
    tiled = QuantTensor("blk.0.ffn_up.weight", T.Q4_K, (4096, COLS), raw.reshape(-1).clone())
    assert backend.holds_tiled(tiled)
    plain = QuantTensor("plain", T.Q4_K, (4096, COLS), raw.reshape(-1).clone())
    monkeypatch.setenv("LUCEBOX_TILED_WEIGHTS", "0")
    gen = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(24, COLS, device="cuda", generator=gen).to(torch.bfloat16)
    for batch in (1, 16, 24):
        assert torch.equal(backend.matvec(x[:batch], tiled), backend.matvec(x[:batch], plain, variant="mma")), batch
    assert torch.equal(backend.matvec(x[5:6], tiled)[0], backend.matvec(x[:16], tiled)[5])


@needs_bulk
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_the_bulk_copy_kernel_keeps_its_bits_under_a_full_gpu(backend, fmt):
    """65,536 rows x 20 GGUF blocks (the 27B head's row length: a stage refilled once a warp) at 16 rows, depth 4,
    every SM busy with several blocks for several waves: where a refill that raced the stage's reads showed."""
    from lucebox_cuda import catalogue
    from lucebox_cuda.nvrtc import Int, Pointer
    from lucebox_cuda.tiled_weights import tile_rows

    rows, cols = 65536, 5120
    distinct = weight_rows(fmt, 2048, cols, seed=11).cuda()
    raw = distinct.repeat(rows // 2048, 1)
    raw[:, 0] ^= (torch.arange(rows, device="cuda") & 1).to(torch.uint8)  # rows not all alike (one low bit)
    weight = QuantTensor("big", TYPES[fmt], (rows, cols), raw.reshape(-1).cpu())
    tiles = tile_rows(raw, fmt, rows, cols)
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(16, cols, device="cuda", generator=gen).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LUCEBOX_TILED_WEIGHTS", "0")
        expected = backend.matvec(x, weight, variant="mma")
    program, name, shared = catalogue.matvec_bulk(fmt, "bf16", 16, 4)
    backend.ring_kernel(program, name, shared)
    for _ in range(5):
        out = torch.full_like(expected, float("nan"))
        backend._launch((program, name), rows // 16, 128, Pointer(tiles.data_ptr()), Pointer(x.data_ptr()),
                        Pointer(out.data_ptr()), Int(rows), Int(cols), Int(16), shared_bytes=shared)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
