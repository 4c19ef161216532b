"""Prefill products on tensor cores straight from Q4_K blocks: no dequantized copy of the weight in memory.

`CudaBackend.tiled_linear` decodes a weight's rows into a bf16 scratch tile and hands it to cuBLAS: every
prefill call writes and reads back the whole dequantized model (the 27B: 16 GB of Q4_K_M become 54 GB of bf16
a call). For a short chunk that round trip is most of the GPU time (the H200, session 14: 30 ms of a 256-token
call's 75 ms were the dequant kernels). Here each program decodes one super-block (256 values) of BLOCK_N
weight rows in registers per step of K and feeds it to `tl.dot` with BLOCK_M activation rows: the weight
bytes are read once per M tile, never written back.

Q4_K, 144 bytes per 256 values (ggml's layout): fp16 `d` and `dmin`, 12 bytes of eight 6-bit scales and
mins, 128 bytes of 4-bit values. Value j of sub-block s (32 values each) is nibble `s % 2` (low first) of byte
`16 + 32 * (s // 2) + j`; its weight is `d * scale_s * q - dmin * min_s`. Scales and mins 0-3 are the low 6
bits of bytes 4-7 and 8-11; 4-7 keep their low 4 bits in bytes 12-15 (scale low nibble, min high nibble) and
their top 2 bits in the top bits of bytes 4-7 (scales) and 8-11 (mins).

The weight values are rounded to the activation dtype before the product, as the dequantized tile is, and
accumulated in fp32: the same products as the tiled path up to the order of the additions.

Off by default until measured on a GPU: `LUCEBOX_FUSED_PREFILL=1` makes `tiled_linear` use it for Q4_K
weights. `scripts/quant_matmul_check.py` checks it against the dequantized product and times both on a GPU
at the 27B's shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_ops import _device_scope

Q4_K_BLOCK_VALUES = 256
Q4_K_BLOCK_BYTES = 144


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Not tuned: 64 activation rows by 64 weight rows of a super-block a step (the decoded tile in registers,
# 32 KiB of bf16). The check script times it against the dequantized path.
DEFAULT_CONFIG = MatmulConfig(64, 64, 4, 2)


@triton.jit
def _q4_k_matmul_kernel(
    x_ptr, w_ptr, out_ptr, rows, out_features,
    stride_xm, stride_om,
    BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * w[n, k], w the Q4_K rows of `w_ptr` (`BLOCKS` blocks of 144 bytes a row:
    a compile-time trip count, which Triton 3.6's interpreter needs and a model has few of)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = n < out_features
    k = tl.arange(0, 256)
    sub = tl.arange(0, 8)
    j = tl.arange(0, 32)
    # Byte of value j of sub-block s, and its nibble's shift: [8, 32].
    q_byte = 16 + 32 * (sub[:, None] // 2) + j[None, :]
    q_shift = 4 * (sub[:, None] % 2)
    row_base = n.to(tl.int64) * (BLOCKS * 144)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(0, BLOCKS):
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xm + block * 256 + k[None, :],
                    mask=m_ok[:, None], other=0.0)
        base = row_base + block * 144  # [BLOCK_N]
        # d and dmin: fp16 from their two bytes each (little-endian).
        d_bits = (tl.load(w_ptr + base, mask=n_ok, other=0).to(tl.uint16)
                  | (tl.load(w_ptr + base + 1, mask=n_ok, other=0).to(tl.uint16) << 8))
        dmin_bits = (tl.load(w_ptr + base + 2, mask=n_ok, other=0).to(tl.uint16)
                     | (tl.load(w_ptr + base + 3, mask=n_ok, other=0).to(tl.uint16) << 8))
        d = d_bits.to(tl.float16, bitcast=True).to(tl.float32)
        dmin = dmin_bits.to(tl.float16, bitcast=True).to(tl.float32)
        # The 6-bit scale and min of each sub-block: [BLOCK_N, 8].
        a = tl.load(w_ptr + base[:, None] + 4 + sub[None, :], mask=n_ok[:, None], other=0).to(tl.int32)  # bytes 4..11
        b = tl.load(w_ptr + base[:, None] + 8 + sub[None, :], mask=n_ok[:, None], other=0).to(tl.int32)  # bytes 8..15
        c = tl.load(w_ptr + base[:, None] + sub[None, :], mask=n_ok[:, None] & (sub[None, :] >= 4),
                    other=0).to(tl.int32)  # bytes 4..7 for sub-blocks 4..7
        low = sub[None, :] < 4
        scale = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4)).to(tl.float32)
        minimum = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
        scale = d[:, None] * scale
        minimum = dmin[:, None] * minimum
        packed = tl.load(w_ptr + base[:, None, None] + q_byte[None, :, :], mask=n_ok[:, None, None], other=0)
        q = ((packed.to(tl.int32) >> q_shift[None, :, :]) & 15).to(tl.float32)  # [BLOCK_N, 8, 32]
        w = scale[:, :, None] * q - minimum[:, :, None]
        w = tl.reshape(w, (BLOCK_N, 256)).to(x_ptr.dtype.element_ty)
        if UPCAST_DOT:  # the interpreter multiplies bf16 operands as integers: the same values as fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def q4_k_matmul(x: torch.Tensor, data: torch.Tensor, out_features: int,
                config: MatmulConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """`x @ W.T` for x `[M, K]` (bf16 or fp16, K a multiple of 256) and W the Q4_K matrix `[out_features, K]`
    whose raw bytes are `data` (uint8, `out_features * K / 256 * 144`, on x's device)."""
    rows, in_features = x.shape
    if in_features % Q4_K_BLOCK_VALUES or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q4_k_matmul takes bf16/fp16 activations with K a multiple of 256, not {x.dtype} K={in_features}")
    blocks = in_features // Q4_K_BLOCK_VALUES
    if data.dtype != torch.uint8 or data.numel() != out_features * blocks * Q4_K_BLOCK_BYTES:
        raise ValueError(f"q4_k_matmul: {data.numel()} bytes of {data.dtype} are not a Q4_K [{out_features}, "
                         f"{in_features}] matrix ({out_features * blocks * Q4_K_BLOCK_BYTES} bytes)")
    x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(out_features, config.block_n))
    with _device_scope(x):
        _q4_k_matmul_kernel[grid](
            x, data, out, rows, out_features, x.stride(0), out.stride(0),
            BLOCKS=blocks, BLOCK_M=config.block_m, BLOCK_N=config.block_n, UPCAST_DOT=not x.is_cuda,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out

