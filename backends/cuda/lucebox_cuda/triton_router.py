"""An MoE router in one launch for a few tokens: the router's product and the top-k choice together.

The router of Laguna-XS.2 or Qwen3.5-35B-A3B is a `[256, 2048]` fp32 matrix, 2 MiB a layer. Written as two
launches, a matrix-vector product and a top-k kernel, it cost 6.3 us a layer on the H200 (session 20's
profile of Laguna-XS.2: 127 + 117 us over 39 layers), most of it two kernels' ramp-up and drain for little
work. Here each program computes the logits of BLOCK_E experts for one token (the whole hidden row, its
loads all issued before any sum) and stores them; the last program to finish for that token (an atomic
counter per token) reads the token's logits back and chooses, with the same row function as the two-launch
path (`triton_gates.sigmoid_topk_row`, Laguna's sigmoid with a selection bias; `triton_norms.softmax_topk_row`,
Qwen3.5-MoE's softmax), then resets its counter for the next launch or graph replay. Qwen3.5-MoE's shared
expert gate (a one-row product, `ffn_gate_inp_shexp`) rides along as one more row, its logit handed out apart
(`softmax_topk_route_gated`): on the 35B-A3B the router and that gate were four launches a layer, here one.

Exactness: each logit is a fixed-order fp32 sum over the hidden dim, rounded to the activations' dtype as
`ops.linear`'s output is, so a token's routing does not depend on how many tokens share the launch (the
decode step and a verify pass agree). The counters live in one per-device buffer: launches on one device are
ordered by its stream, so no two of these kernels count at once.

Under `TRITON_INTERPRET=1` the programs run one after another and the last one still finds every logit.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from .triton_gates import sigmoid_topk_row
from .triton_norms import softmax_topk_row
from .pdl import triton_options
from .triton_ops import _device_scope, grid_dependency

# Tokens one launch routes: a decode step, and every verify pass (`op_kernels.VERIFY_ROWS`), so that a verified
# node routes with the decode step's arithmetic; a prefill chunk takes the product and top-k apart.
MAX_TOKENS = 128
HIDDEN_BLOCK = 256
ENV_SWITCH = "LUCEBOX_FUSED_ROUTER"  # "0": the two-launch router (a benchmark's A/B)
# Launch shape, measured on the H200 (session 23, `scripts/router_probe.py` and `lucebox bench` tg128): 2 router
# rows a program at 1 warp (128 programs a token for 256 experts, 16 KiB each, spread over most SMs; the last
# program's top-k then reduces within one warp, with no shared-memory rounds) took Laguna-XS.2 from 355.6 to
# 380.8 tok/s against 4 rows at 4 warps (381.8 in the next call); Qwen3.5-35B-A3B gave 355.3 against 340.2, then
# 339.8, within the machine's spread; 4 rows at 1 warp was slower than both shapes. Settings for an A/B (one value a process: the decode step and a verify pass must launch alike,
# since on the GPU the warps can change a logit's summation order and so its last bits):
EXPERTS_PER_PROGRAM = 2
EXPERTS_ENV = "LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM"  # 1, 2, 4 or 8
WARPS_ENV = "LUCEBOX_ROUTER_WARPS"  # 1, 2, 4 or 8
DEFAULT_WARPS = 1

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@triton.jit
def _route_kernel(x_ptr, w_ptr, extra_ptr, gate_w_ptr, gate_out_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
                  experts, stride_x, scale, HIDDEN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_ALL: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, GATE: tl.constexpr,
                  PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < experts
    # GATE: one more row past the experts, the shared expert's gate (`gate_w_ptr`), its logit handed out apart.
    gate_row = rows == experts
    if GATE:
        read_ok = row_ok | gate_row
        row_ptrs = tl.where(gate_row, gate_w_ptr, w_ptr + rows.to(tl.int64) * HIDDEN)
    else:
        read_ok = row_ok
        row_ptrs = w_ptr + rows.to(tl.int64) * HIDDEN
    partial = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for start in tl.static_range(0, HIDDEN, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        w = tl.load(row_ptrs[:, None] + cols[None, :], mask=read_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + token * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        partial += w.to(tl.float32) * x[None, :]
    # Rounded to the activations' dtype, as the product `ops.linear` gives the reference.
    rounded = tl.sum(partial, axis=1).to(x_ptr.dtype.element_ty)
    if GATE:
        tl.store(gate_out_ptr + token + rows * 0, rounded, mask=gate_row)
    row_logits = logits_ptr + token * experts
    tl.store(row_logits + rows, rounded.to(tl.float32), mask=row_ok)
    tl.debug_barrier()  # every thread's logits stored before the counter says so (a release at GPU scope)
    arrived = tl.atomic_add(counter_ptr + token, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:  # the token's last program: all its logits are there
        slots = tl.arange(0, TOP_K)
        if SIGMOID:
            weights, ids = sigmoid_topk_row(row_logits, extra_ptr, experts, scale, TOP_K, BLOCK_ALL)
        else:
            weights, ids = softmax_topk_row(row_logits, extra_ptr, experts, TOP_K, BLOCK_ALL, False)
        tl.store(weights_ptr + token * TOP_K + slots, weights)
        tl.store(ids_ptr + token * TOP_K + slots, ids)
        tl.atomic_xchg(counter_ptr + token, 0)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _power_of_two_setting(name: str, default: int, what: str) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text not in ("1", "2", "4", "8"):
        raise ValueError(f"{name}={text!r}: expected 1, 2, 4 or 8 {what}")
    return int(text)


def warps() -> int:
    """The launch's warps a program: `LUCEBOX_ROUTER_WARPS` (1, 2, 4 or 8), else DEFAULT_WARPS."""
    return _power_of_two_setting(WARPS_ENV, DEFAULT_WARPS, "warps a program")


def experts_per_program() -> int:
    """Router rows a program computes: `LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM` (1, 2, 4 or 8), else
    EXPERTS_PER_PROGRAM. Fewer rows a program spread the product's loads over more SMs."""
    return _power_of_two_setting(EXPERTS_ENV, EXPERTS_PER_PROGRAM, "router rows a program")


def plain_weight(proj: Any) -> torch.Tensor | None:
    """The router's matrix as a contiguous float tensor `[E, hidden]`: a torch tensor, or a GGUF F32 / F16 /
    BF16 tensor's bytes viewed as such; None for a quantized one (the two-launch path reads those)."""
    from lucebox_core.quants import QuantTensor

    if isinstance(proj, QuantTensor):
        dtype = _FLOAT_TYPES.get(proj.ggml_type.name)
        return None if dtype is None or len(proj.shape) != 2 else proj.data.view(dtype).view(proj.shape)
    if isinstance(proj, torch.Tensor) and proj.dim() == 2 and proj.is_floating_point() and proj.is_contiguous():
        return proj
    return None


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's counters, made on first use outside a graph capture (None during one: its memory would
    belong to the graph)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device)
    return counters


def few(x: torch.Tensor) -> bool:
    """Whether `x` is a few tokens `[T, hidden]` (T <= MAX_TOKENS) with a unit last stride."""
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and x.stride(-1) == 1


def takes(x: torch.Tensor, proj: Any, shared_gate: Any = None) -> bool:
    """Whether `route` takes these: a few tokens `[T, hidden]` with a unit last stride, a float router of that
    width on their device (and a one-row shared gate of its dtype), and the counters made."""
    if not enabled() or not few(x):
        return False
    weight = plain_weight(proj)
    if weight is None or weight.shape[1] != x.shape[1] or weight.device != x.device:
        return False
    if shared_gate is not None:
        gate = plain_weight(shared_gate)
        if gate is None or gate.shape != (1, x.shape[1]) or gate.dtype != weight.dtype or gate.device != x.device:
            return False
    return _counters(x.device) is not None


def route(x: torch.Tensor, proj: Any, top_k: int, *, selection_bias: torch.Tensor | None = None,
          scale: float = 1.0, shared_gate: Any = None) -> tuple[torch.Tensor, ...]:
    """x `[T, hidden]` -> weights `[T, top_k]` fp32 and expert ids `[T, top_k]` long, descending. With
    `selection_bias` `[E]`: Laguna's router (`sigmoid_route`: sigmoid scores, chosen by score + bias,
    renormalised, times `scale`); without: Qwen3.5-MoE's (`softmax_topk_route`: softmax, renormalised).
    `shared_gate` `[1, hidden]`: also the shared expert's gate logit `x . shared_gate` `[T, 1]` in x's dtype
    (Qwen3.5-MoE's), computed as one more row of the router: (weights, ids, logit)."""
    weight = plain_weight(proj)
    tokens, hidden = x.shape
    experts = weight.shape[0]
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=x.device)
    sigmoid = selection_bias is not None
    extra = selection_bias.to(torch.float32).contiguous() if sigmoid else logits  # unread without a bias
    gated = shared_gate is not None
    gate_weight = plain_weight(shared_gate) if gated else weight  # unread without GATE
    gate_logit = torch.empty(tokens, 1, dtype=x.dtype, device=x.device) if gated else x
    rows = experts + gated
    block_e = experts_per_program()
    with _device_scope(x):
        _route_kernel[(tokens, triton.cdiv(rows, block_e))](
            x, weight, extra, gate_weight, gate_logit, logits, _counters(x.device), weights, ids, experts,
            x.stride(0), float(scale), HIDDEN=hidden, BLOCK_E=block_e,
            BLOCK_H=min(HIDDEN_BLOCK, triton.next_power_of_2(hidden)), BLOCK_ALL=triton.next_power_of_2(experts),
            TOP_K=top_k, SIGMOID=sigmoid, GATE=gated, num_warps=warps(), **triton_options(x))
    return (weights, ids, gate_logit) if gated else (weights, ids)
