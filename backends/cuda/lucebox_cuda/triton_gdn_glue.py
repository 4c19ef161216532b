"""Triton kernels for the small glue of a Gated DeltaNet layer's prefill (the qwen35 family's ops).

Why a module of its own: a 256-token prefill piece of the 27B model is bound by the host (~40 us a launch, 48
Gated DeltaNet layers), so each torch op between the layer's big kernels costs more than its bytes. The
decay and write-strength gates, written as torch ops, are five launches a layer (a cast, an add, softplus,
a product, sigmoid); here they are one. `triton_gdn` (the scans and convolutions) is near the 800-line limit.

- `gdn_gates`: from the `a` and `b` projections `[..., H_v]`, `g = ssm_a * softplus(a + dt_bias)` in fp32
  (the log of the per-token decay, <= 0) and `beta = sigmoid(b)` in b's dtype; one program per block of
  tokens, all heads. The arithmetic of the reference (`lucebox_qwen35.ops.gdn_gates`): the add and product
  in fp32, softplus with torch's threshold, beta rounded once from fp32.

Every wrapper runs under `TRITON_INTERPRET=1` on CPU tensors (tests/test_gdn_glue.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_gates import SOFTPLUS_THRESHOLD, softplus_fp32
from .triton_ops import _device_scope

# Tokens one gates program owns (all of a token's heads: 48 at 27B).
GATES_BLOCK_TOKENS = 16
# Heads the gates kernel holds in a row of registers.
MAX_GATE_HEADS = 1024


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, ssm_a_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b,
                      threshold, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    head_ok = cols < heads
    ok = (rows < tokens)[:, None] & head_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + rows64 * stride_a + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=head_ok, other=0.0)
    ssm_a = tl.load(ssm_a_ptr + cols, mask=head_ok, other=0.0)
    g = ssm_a[None, :] * softplus_fp32(a + dt_bias[None, :], threshold)
    b = tl.load(b_ptr + rows64 * stride_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    beta = tl.sigmoid(b)
    out = rows64 * heads + cols[None, :]
    tl.store(g_ptr + out, g, mask=ok)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=ok)


def _token_rows(x: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    """`x [..., H]` as `[tokens, H]` rows of one stride, last dim contiguous (a view where it can be)."""
    rows = x.reshape(tokens, heads)
    return rows if rows.stride(-1) == 1 or heads == 1 else rows.contiguous()


def gdn_gates(a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The qwen35 family's `gdn_gates` reference (`lucebox_qwen35.ops`): a, b `[..., H_v]` (any float dtype,
    e.g. strided views of one projection's output), ssm_a and dt_bias `[H_v]` fp32 -> (g `[..., H_v]` fp32,
    beta `[..., H_v]` in b's dtype), both new contiguous tensors. One launch."""
    heads = a.shape[-1]
    if (b.shape != a.shape or ssm_a.numel() != heads or dt_bias.numel() != heads or heads > MAX_GATE_HEADS
            or ssm_a.dtype != torch.float32 or dt_bias.dtype != torch.float32):
        raise ValueError(f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, ssm_a {tuple(ssm_a.shape)} "
                         f"{ssm_a.dtype}, dt_bias {tuple(dt_bias.shape)} {dt_bias.dtype}")
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    tokens = a.numel() // max(heads, 1)
    if tokens == 0 or heads == 0:
        return g, beta
    a_rows, b_rows = _token_rows(a, tokens, heads), _token_rows(b, tokens, heads)
    with _device_scope(a):
        _gdn_gates_kernel[(triton.cdiv(tokens, GATES_BLOCK_TOKENS),)](
            a_rows, b_rows, ssm_a.contiguous(), dt_bias.contiguous(), g, beta, tokens, heads,
            a_rows.stride(0), b_rows.stride(0), SOFTPLUS_THRESHOLD,
            BLOCK_T=GATES_BLOCK_TOKENS, BLOCK_H=triton.next_power_of_2(heads))
    return g, beta
