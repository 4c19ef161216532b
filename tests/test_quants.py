"""Torch dequantization must match gguf's numpy reference bit for bit, on random blocks."""

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from lucebox_core.errors import GGUFError
from lucebox_core.quants import QuantTensor, block_size, dequantize, type_size

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
# Byte offsets of the fp16 super-scales in each block; all other bytes may be anything.
FP16_SCALE_OFFSETS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_block_bytes(ggml_type: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a tensor of `shape` (torch order) with finite, non-trivial fp16 scales."""
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block_values
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(-3.0, 3.0, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block_values * block_bytes)


def random_float_bytes(ggml_type: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32) * 10.0
    if ggml_type == T.F32:
        raw = values
    elif ggml_type == T.F16:
        raw = values.astype(np.float16)
    else:  # BF16: the top half of each float32
        raw = (values.view(np.uint32) >> 16).astype(np.uint16)
    return raw.view(np.uint8).reshape(*shape[:-1], -1)


def numpy_reference(raw: np.ndarray, ggml_type: T) -> torch.Tensor:
    reference = gguf.quants.dequantize(raw, ggml_type).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(reference))


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks_per_row, leading", [(1, ()), (3, (4,)), (2, (2, 3))])
def test_block_types_match_numpy_bit_exact(ggml_type, blocks_per_row, leading):
    rng = np.random.default_rng(1000 + ggml_type.value + blocks_per_row)
    shape = (*leading, blocks_per_row * block_size(ggml_type))
    raw = random_block_bytes(ggml_type, shape, rng)
    reference = numpy_reference(raw, ggml_type)
    assert reference.abs().max() > 0 and tuple(reference.shape) == shape

    ours = dequantize(torch.from_numpy(raw.reshape(-1)), ggml_type, shape)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("ggml_type", FLOAT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 8)])
def test_float_types_match_numpy_bit_exact(ggml_type, shape):
    rng = np.random.default_rng(7 + ggml_type.value)
    raw = random_float_bytes(ggml_type, shape, rng)
    reference = numpy_reference(raw, ggml_type).reshape(shape)
    assert reference.abs().max() > 0

    ours = dequantize(torch.from_numpy(raw.reshape(-1)), ggml_type, shape)
    assert torch.equal(ours, reference)


def test_f32_result_does_not_alias_the_input_bytes():
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, T.F32, (8,))
    out += 1
    assert torch.equal(dequantize(raw, T.F32, (8,)), torch.arange(8, dtype=torch.float32))


def test_unsupported_type_is_named():
    raw = torch.zeros(type_size(T.Q2_K), dtype=torch.uint8)
    with pytest.raises(GGUFError, match="Q2_K"):
        dequantize(raw, T.Q2_K, (256,))


def test_wrong_byte_count_or_partial_block_is_rejected():
    with pytest.raises(GGUFError, match="needs 68 bytes"):
        dequantize(torch.zeros(67, dtype=torch.uint8), T.Q8_0, (64,))
    with pytest.raises(GGUFError, match="block"):
        dequantize(torch.zeros(34, dtype=torch.uint8), T.Q8_0, (2, 16))


@pytest.fixture
def q4k_tensor():
    shape = (6, 512)
    raw = random_block_bytes(T.Q4_K, shape, np.random.default_rng(3))
    return QuantTensor("token_embd.weight", T.Q4_K, shape, torch.from_numpy(raw.reshape(-1))), raw


def test_quant_tensor_basics(q4k_tensor):
    qt, raw = q4k_tensor
    assert qt.numel == 6 * 512
    assert qt.nbytes == raw.size == 6 * 2 * type_size(T.Q4_K)
    assert qt.to("cpu").data.data_ptr() == qt.data.data_ptr()
    full = qt.dequantize()
    assert torch.equal(full, numpy_reference(raw, T.Q4_K))
    assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(qt.dequantize(torch.float16), full.to(torch.float16))


def test_quant_tensor_rows(q4k_tensor):
    qt, _ = q4k_tensor
    full = qt.dequantize()
    assert torch.equal(qt.dequantize_rows(2, 5), full[2:5])
    assert qt.dequantize_rows(4, 2).shape == (0, 512)
    assert torch.equal(qt.dequantize_rows(-2, 6), full[-2:])
    ids = torch.tensor([[5, 0, 5], [1, 2, 3]])
    looked_up = qt.lookup_rows(ids)
    assert looked_up.shape == (2, 3, 512)
    assert torch.equal(looked_up, full[ids])


def test_quant_tensor_checks_its_bytes():
    with pytest.raises(GGUFError, match="'w'.*needs 68 bytes"):
        QuantTensor("w", T.Q8_0, (64,), torch.zeros(60, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        QuantTensor("w", T.F32, (4,), torch.zeros(4, dtype=torch.float32))


def test_unsupported_quant_tensor_names_tensor_and_type():
    qt = QuantTensor("blk.0.ffn_up.weight", T.Q2_K, (256,), torch.zeros(type_size(T.Q2_K), dtype=torch.uint8))
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight'.*Q2_K"):
        qt.dequantize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_cuda_matches_numpy_bit_exact(ggml_type):
    rng = np.random.default_rng(ggml_type.value)
    shape = (64, 4 * block_size(ggml_type) if ggml_type in BLOCK_TYPES else 96)
    make = random_block_bytes if ggml_type in BLOCK_TYPES else random_float_bytes
    raw = make(ggml_type, shape, rng)
    qt = QuantTensor("w", ggml_type, shape, torch.from_numpy(raw.reshape(-1)))
    ours = qt.dequantize(device="cuda")
    assert ours.device.type == "cuda"
    assert torch.equal(ours.cpu(), numpy_reference(raw, ggml_type).reshape(shape))
    on_gpu = qt.to("cuda")
    ids = torch.tensor([3, 0, 63], device="cuda")
    assert torch.equal(on_gpu.lookup_rows(ids).cpu(), ours.cpu()[ids.cpu()])
