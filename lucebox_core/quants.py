"""Dequantization of GGUF tensor data in torch, and the `QuantTensor` that carries raw GGUF bytes.

Every decoder here is pure, vectorised torch, so it runs wherever the bytes live (CPU memory map or a
GPU copy). Each one follows the block layout and the order of float operations of gguf's numpy
reference (`gguf.quants`) so that results are bit-for-bit identical: the fp16 scales are widened to
float32 first, products like `d * scale` are formed in float32, and nothing is fused.
"""

from __future__ import annotations

import math

import attrs
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import GGUFError

T = GGMLQuantizationType


def block_size(ggml_type: GGMLQuantizationType) -> int:
    """How many values one block of `ggml_type` encodes (1 for plain float types)."""
    return _sizes(ggml_type)[0]


def type_size(ggml_type: GGMLQuantizationType) -> int:
    """How many bytes one block of `ggml_type` takes."""
    return _sizes(ggml_type)[1]


def _sizes(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    try:
        return GGML_QUANT_SIZES[T(ggml_type)]
    except (KeyError, ValueError):
        raise GGUFError(f"unknown ggml tensor type {ggml_type!r}") from None


def byte_count(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes taken by a tensor of `shape` (torch order: the last dimension is the GGUF row)."""
    blocks, size = _sizes(ggml_type)
    row = shape[-1] if shape else 1
    if row % blocks:
        raise GGUFError(
            f"a {T(ggml_type).name} row of {row} values is not a whole number of {blocks}-value blocks"
        )
    return math.prod(shape) // blocks * size


# --- decoders: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32 -------------------------


def _fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 at byte `start` of every block, widened to float32, shape (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Split (..., k) bytes into (..., 2, k): low nibbles first, then high nibbles."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _fp16_at(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 16 bytes hold 32 values: value j is the low nibble of byte j, value 16 + j its high nibble.
    d = _fp16_at(blocks, 0)
    q = _nibbles(blocks[:, 2:]).reshape(blocks.shape[0], 32).to(torch.float32) - 8.0
    return d * q


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, 4 bytes of fifth bits (bit j for value j), 16 bytes of nibbles (value j low, value 16 + j high).
    d = _fp16_at(blocks, 0)
    high = blocks[:, 2:6].to(torch.int64)
    bits = (high[:, :, None] >> torch.arange(8, device=blocks.device)) & 1  # [n, 4, 8]: bit j of the word
    fifth = bits.reshape(blocks.shape[0], 32)
    low = _nibbles(blocks[:, 6:]).reshape(blocks.shape[0], 32).to(torch.int64)
    return d * ((low | (fifth << 4)).to(torch.float32) - 16.0)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of eight 6-bit scales and eight 6-bit mins shared by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 keep their
    low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in the spare top
    bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    low_scales, low_mins, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((low_scales & 0x3F, (high & 0x0F) | ((low_scales >> 2) & 0x30)), dim=-1)
    mins = torch.cat((low_mins & 0x3F, (high >> 4) | ((low_mins >> 2) & 0x30)), dim=-1)
    return scales, mins


def _k_sub_block_affine(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-value sub-block multiplier and offset of Q4_K/Q5_K, each (n, 8, 1) float32."""
    d, dmin = _fp16_at(blocks, 0), _fp16_at(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    return (d * scales.to(torch.float32)).unsqueeze(-1), (dmin * mins.to(torch.float32)).unsqueeze(-1)


def _q4_k_low_bits(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> (n, 8, 32) 4-bit values: sub-blocks 2c and 2c+1 are the low and high nibbles of
    bytes 32c..32c+31."""
    return _nibbles(qs.reshape(qs.shape[0], 4, 32)).reshape(qs.shape[0], 8, 32)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_sub_block_affine(blocks)
    q = _q4_k_low_bits(blocks[:, 16:144]).to(torch.float32)
    return (scale * q - offset).reshape(blocks.shape[0], 256)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # The fifth bit of value j in sub-block i is bit i of qh[j].
    scale, offset = _k_sub_block_affine(blocks)
    qh = blocks[:, 16:48]
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    high_bits = (qh.unsqueeze(1) >> shifts) & 0x01
    q = (_q4_k_low_bits(blocks[:, 48:176]) | (high_bits << 4)).to(torch.float32)
    return (scale * q - offset).reshape(blocks.shape[0], 256)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values; in each, 64 bytes of ql give four rows of 32 low nibbles
    # (low of bytes 0-31, low of 32-63, high of 0-31, high of 32-63) and 32 bytes of qh give the
    # matching 2-bit tops at shifts 0, 2, 4, 6.
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)  # no host copy
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    sub_scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _fp16_at(blocks, 208)
    return ((d * sub_scales).unsqueeze(-1) * q).reshape(n, 256)


_BLOCK_DECODERS = {
    T.Q8_0: _dequant_q8_0,
    T.Q4_0: _dequant_q4_0,
    T.Q5_0: _dequant_q5_0,
    T.Q4_K: _dequant_q4_k,
    T.Q5_K: _dequant_q5_k,
    T.Q6_K: _dequant_q6_k,
}
_FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_BLOCK_DECODERS) | frozenset(_FLOAT_TYPES)


def dequantize(data: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode raw GGUF bytes (`uint8`, on any device) into a new float32 tensor of `shape`.

    `shape` is in torch order, i.e. GGUF's `ne` reversed, so the last dimension is the quantized row.
    The result never shares memory with `data` (which may be a read-only file mapping).
    """
    try:
        ggml_type = T(ggml_type)
    except ValueError:
        raise GGUFError(f"unknown ggml tensor type {ggml_type!r}") from None
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(f"tensor type {ggml_type.name} is not supported (supported: {supported})")
    if data.dtype != torch.uint8:
        raise TypeError(f"dequantize expects raw uint8 bytes, got a {data.dtype} tensor")
    shape = tuple(int(dim) for dim in shape)
    expected = byte_count(ggml_type, shape)
    if data.numel() != expected:
        raise GGUFError(
            f"{ggml_type.name} data of shape {shape} needs {expected} bytes, got {data.numel()}"
        )
    flat = data.reshape(-1).contiguous()
    if ggml_type in _FLOAT_TYPES:
        # `.to(float32)` of an F32 view would alias the input; always hand back fresh memory.
        return flat.view(_FLOAT_TYPES[ggml_type]).to(torch.float32, copy=True).reshape(shape)
    blocks = flat.view(-1, type_size(ggml_type))
    return _BLOCK_DECODERS[ggml_type](blocks).reshape(shape)


@attrs.frozen(eq=False)
class QuantTensor:
    """A named GGUF tensor kept as its raw bytes, in any supported type.

    `data` is a flat uint8 tensor, often a zero-copy view on the file's read-only memory map: never
    write to it. `shape` is in torch order (GGUF `ne` reversed).
    """

    name: str
    ggml_type: GGMLQuantizationType = attrs.field(converter=T)
    shape: tuple[int, ...] = attrs.field(converter=lambda dims: tuple(int(d) for d in dims))
    data: torch.Tensor
    # Bytes that change in place (Spark's expert slots): backends must not keep a dequantized copy.
    volatile: bool = False

    def __attrs_post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise TypeError(f"tensor {self.name!r}: data must be a flat uint8 tensor, got {self.data.dtype} "
                            f"of shape {tuple(self.data.shape)}")
        try:
            expected = byte_count(self.ggml_type, self.shape)
        except GGUFError as exc:
            raise GGUFError(f"tensor {self.name!r}: {exc}") from None
        if self.data.numel() != expected:
            raise GGUFError(f"tensor {self.name!r}: {self.ggml_type.name} of shape {self.shape} needs "
                            f"{expected} bytes, got {self.data.numel()}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> QuantTensor:
        """The same raw bytes on `device` (a copy unless they are already there)."""
        return attrs.evolve(self, data=self.data.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor as `dtype`, decoded on `device` (default: where the bytes are).

        Moving the raw bytes first and decoding there keeps host-to-device traffic at the quantized size.
        """
        data = self.data if device is None else self.data.to(device)
        return self._decode(data, self.shape).to(dtype)

    def _row_bytes(self) -> int:
        if len(self.shape) < 2:
            raise ValueError(f"tensor {self.name!r} of shape {self.shape} has no rows to select")
        return self.nbytes // self.shape[0]

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> torch.Tensor:
        """Rows `start:stop` along the first dimension, decoding only their bytes."""
        row_bytes = self._row_bytes()
        start, stop, _ = slice(start, stop).indices(self.shape[0])
        stop = max(stop, start)
        data = self.data[start * row_bytes : stop * row_bytes]
        if device is not None:
            data = data.to(device)
        return self._decode(data, (stop - start, *self.shape[1:])).to(dtype)

    def lookup_rows(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows picked by an integer tensor, as for an embedding lookup: shape `(*indices.shape, *row)`.

        The rows are gathered where the bytes live and the result is returned on `indices.device`.
        """
        row_bytes = self._row_bytes()
        rows = self.data.view(self.shape[0], row_bytes)[indices.reshape(-1).to(self.data.device)]
        values = self._decode(rows.reshape(-1), (rows.shape[0], *self.shape[1:]))
        return values.reshape(*indices.shape, *self.shape[1:]).to(device=indices.device, dtype=dtype)

    def _decode(self, data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        try:
            return dequantize(data, self.ggml_type, shape)
        except GGUFError as exc:
            raise GGUFError(f"tensor {self.name!r}: {exc}") from None
