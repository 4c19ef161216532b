"""Given sums on a GPU: products of 12 rows or more take their activations' sub-block sums from a kernel run once a
product (`catalogue.with_given_sums`) instead of an all-ones mma in every row group. The sums are that same mma on the
same fragments, so each product must keep its bits: equal to the same variant computing them itself, and, a row at a
time, to the batch-1 decode product (the class rule that makes a verify node reproduce the decode step), eager and
replayed in a CUDA graph, and where a capture comes before the scratch exists (the plain kernel then).
"""

from __future__ import annotations

import pytest
import torch

from lucebox_core.quants import QuantTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COLS = 2560  # 10 GGUF blocks a row: uneven over 4 warps, and 5 per slice with 2 K-slices
ROWS = 1000  # 62.5 row groups: the last one padded


def weight(fmt: str, seed: int) -> QuantTensor:
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from lucebox_core.kquants import random_blocks

    kind = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}[fmt]
    if fmt == "q5_k":
        raw = np.random.default_rng(seed).integers(0, 256, (ROWS * COLS // 256, 176), dtype=np.uint8)
        raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    else:
        raw = random_blocks(kind, ROWS * COLS, 0.05, np.random.default_rng(seed))
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    return QuantTensor(f"given_sums_{fmt}", kind, (ROWS, COLS), data)


@pytest.fixture()
def plain_and_given(monkeypatch):
    """One CUDA backend, row-major weights, and two ways to run a product on it: the sums computed in every row group,
    and given."""
    from lucebox_cuda import backend as module
    from lucebox_cuda import tiled_weights

    monkeypatch.setenv(tiled_weights.ENV_SWITCH, "0")

    def product(backend, on: bool):
        def run(x, w, variant=None):
            monkeypatch.setattr(module, "_GIVEN_SUMS", on)
            return backend.matvec(x, w, variant=variant)
        return run

    made = module.CudaBackend(dtype=torch.bfloat16)
    return product(made, False), product(made, True), made


# (format, activation, rows, variants): each format at the smallest tile that takes given sums and at a 3-tile one
# (23 rows: a padded column), the largest tile once, f16 once; streamed with two row groups and with 2 K-slices.
CASES = [(fmt, torch.bfloat16, rows, ("mma", "mma_r2", two_groups, "pipe_w8_d3_m1_k2"))
         for fmt, two_groups in (("q4_k", "pipe_w4_d4_m2_k1"), ("q5_k", "pipe_w4_d4_m2_k1"),
                                 ("q6_k", "pipe_w4_d3_m2_k1"))  # (Q6_K's 4-deep two-group ring: over 99 KiB)
         for rows in (12, 16)]
CASES += [(fmt, torch.bfloat16, 23, ("mma", "mma_r2", "pipe_w4_d4_m1_k1")) for fmt in ("q4_k", "q6_k")]
CASES += [("q4_k", torch.bfloat16, 64, ("mma_r2",)), ("q6_k", torch.float16, 24, ("mma", "mma_r2"))]


@pytest.mark.parametrize("fmt, dtype, rows, variants", CASES)
def test_given_sums_keep_every_products_bits(plain_and_given, fmt, dtype, rows, variants):
    from lucebox_cuda import catalogue

    plain, given, backend = plain_and_given
    w = weight(fmt, seed=3)
    generator = torch.Generator(device="cuda").manual_seed(7 + rows)
    x = torch.randn(rows, COLS, device="cuda", generator=generator).to(dtype)
    for variant in variants:
        launch = catalogue.matvec_kernel(fmt, catalogue.ACTIVATIONS[dtype], rows, ROWS, variant, in_features=COLS,
                                         given=True)
        assert launch.sums is not None and "_s_" in launch.name, (variant, launch.name)
        expected, got = plain(x, w, variant), given(x, w, variant)
        assert torch.equal(expected.view(torch.int16), got.view(torch.int16)), (fmt, rows, variant)
    # A row at a time, the decode product of the shape's class (4 warps, one slice: `mma`) gives the same bits.
    one = torch.cat([plain(x[r:r + 1], w, "mma") for r in range(rows)])
    assert torch.equal(one.view(torch.int16), given(x, w, variants[0]).view(torch.int16)), (fmt, rows)


def test_given_sums_replay_in_a_graph_and_a_capture_without_the_scratch_takes_the_plain_kernel(plain_and_given,
                                                                                                 monkeypatch):
    plain, given, backend = plain_and_given
    w = weight("q4_k", seed=5)
    generator = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(16, COLS, device="cuda", generator=generator).to(torch.bfloat16)
    from lucebox_cuda import backend as module

    fresh = module.CudaBackend(dtype=torch.bfloat16)  # no product yet: no scratch when the capture starts
    fresh.device_weight(w)  # the upload is no part of a capture
    for made in (backend, fresh):
        if made is backend:
            given(x, w, "mma")  # eager first: the scratch is made outside the capture
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        monkeypatch.setattr(module, "_GIVEN_SUMS", True)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = made.matvec(x, w, variant="mma")
        state = made.__dict__["_matvec_state"]
        assert (state.get("sums") is not None) == (made is backend)
        for seed in (1, 2):
            x.copy_(torch.randn(16, COLS, device="cuda", generator=generator.manual_seed(seed)).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), plain(x, w, "mma").view(torch.int16))


def test_a_weight_held_tiled_keeps_its_bits_with_given_sums(plain_and_given, monkeypatch):
    """Q6_K is held tiled by default: its verify products (matvec_tiled.cu, two row tiles a block) take given sums
    too, and each row still gets the row-major batch-1 product's bits."""
    from lucebox_cuda import tiled_weights

    plain, given, backend = plain_and_given
    rows_major = weight("q6_k", seed=9)
    plain(torch.zeros(1, COLS, device="cuda", dtype=torch.bfloat16), rows_major)  # decided row-major (fixture's "0")
    monkeypatch.setenv(tiled_weights.ENV_SWITCH, "1")
    tiled = QuantTensor("given_sums_tiled", rows_major.ggml_type, rows_major.shape, rows_major.data.clone())
    assert backend.holds_tiled(tiled)
    generator = torch.Generator(device="cuda").manual_seed(13)
    for rows in (12, 24, 40):
        x = torch.randn(rows, COLS, device="cuda", generator=generator).to(torch.bfloat16)
        expected, got = plain(x, tiled), given(x, tiled)
        assert torch.equal(expected.view(torch.int16), got.view(torch.int16)), rows
        one = torch.cat([plain(x[r:r + 1], rows_major, "mma") for r in range(rows)])
        assert torch.equal(one.view(torch.int16), got.view(torch.int16)), rows
