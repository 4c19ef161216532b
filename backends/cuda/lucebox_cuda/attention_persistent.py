"""A decode step's gated attention (Qwen3.5's full-attention layers) as one persistent launch.

`gated_attention_decode_` (the qwen35 family's op: one token through a `GatedAttention` from its normed input to
its output, its K/V row stored in the cache) is seven or eight kernels on this backend: the q | k | v products, the
q/k norm + RoPE, the K/V store, the split attention and its merge, the gate and the output product. Qwen3.5-0.8B
runs 6 such layers a token, each kernel a few microseconds that pays a launch, a ramp and a drain. Here they are
four phases of `kernels/attention_persistent.cu` with three grid-wide barriers (the barrier, counter and grid
sizing of `ffn_persistent`): issue #17's megakernel, its third piece.

Off by default until measured on a GPU: `LUCEBOX_PERSISTENT_ATTENTION=1` turns it on for one token at a time in a
decode step without a drafter (`static_step.decode_only_kernels`); a verify pass, a prefill and a speculative
sequence keep the unfused kernels. The products are the `mma` kernel's arithmetic and the norms, rotation and gate
round where the Triton kernels round, but the scores' dot products and the softmax's sums add in another order,
and cos / sin are CUDA's: near-tie equal to the unfused step, not bit-equal.

The key loop is SIMT (a warp a key, every query head of the group against it), not the split kernel's tensor-core
tiles: it takes windows up to `MAX_WINDOW` rows, where the step is launch- and not attention-bound.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lucebox_core.static_step import decode_only_kernels

from . import catalogue, ffn_persistent
from .nvrtc import Float, Int, Pointer

ENV_SWITCH = "LUCEBOX_PERSISTENT_ATTENTION"
TILE = 16
HEAD_DIM = 256  # the kernel's, every Qwen3.5 / 3.6 size's
WARPS = 4  # spans of keys a phase-2 unit takes, one a warp
MAX_GROUP = 8  # query heads a KV head: the kernel keeps a lane's accumulator of each in registers
MIN_SPAN = 16  # keys a warp walks at least
MAX_WINDOW = 8192
MAX_PARTIALS = 1024  # spans of keys a query head's merge takes (the kernel's shared weights)


def blocks_per_sm(group: int) -> int:
    """Blocks an SM gets: one less than the kernel's launch bounds ask it to hold (3 up to 4 query heads a KV
    head, 2 past that), a margin for the grid barrier."""
    return 2 if group <= 4 else 1
ACTIVATIONS, NORM_WEIGHTS = ffn_persistent.ACTIVATIONS, ffn_persistent.NORM_WEIGHTS


def enabled() -> bool:
    """Whether `LUCEBOX_PERSISTENT_ATTENTION` asks for the persistent attention (read at each call, for an A/B)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def _rows(attention: Any) -> dict[str, tuple[Any, int]]:
    """The four products as (GGUF weight, first row in it): the fused weight where the backend fused q | k | v or
    q | k (`in_proj`), else the separate ones."""
    q_rows, k_rows = attention.q_proj.shape[0], attention.k_proj.shape[0]
    rows = {"q": (attention.q_proj, 0), "k": (attention.k_proj, 0), "v": (attention.v_proj, 0),
            "o": (attention.o_proj, 0)}
    if attention.in_proj is not None:
        rows["q"], rows["k"] = (attention.in_proj, 0), (attention.in_proj, q_rows)
        if attention.in_proj_parts == 3:
            rows["v"] = (attention.in_proj, q_rows + k_rows)
    return rows


def formats(attention: Any, hidden: int) -> tuple[str, str, str] | None:
    """(q | k format, v format, o format) where the kernel takes the weights, else None: q and k of one format (a
    fused weight holds one; Q4_K_M files give v its own on some layers)."""
    rows = _rows(attention)
    qk = {ffn_persistent.mma_format(rows[part][0], hidden) for part in ("q", "k")}
    v = ffn_persistent.mma_format(rows["v"][0], hidden)
    o = ffn_persistent.mma_format(attention.o_proj, attention.num_heads * attention.head_dim)
    if len(qk) != 1 or None in qk or v is None or o is None:
        return None
    return qk.pop(), v, o


def _cache_refusal(x: torch.Tensor, attention: Any, kv: Any, window: int) -> str | None:
    """Why the kernel cannot read and write this cache (None: it can): plain rows at slot = position, of the
    activations' type, and a policy that neither maps positions (KVFlash's pool) nor watches queries."""
    if getattr(kv, "attention_position", None) is not None or getattr(kv, "observe_query", None) is not None:
        return f"KV policy {type(kv).__name__} (maps positions or watches queries)"
    lend = getattr(kv, "plain_rows", None)
    buffers = None if lend is None else lend(attention.layer_index)
    if buffers is None:
        return f"KV cache {type(kv).__name__} without plain rows (a quantized or paged cache)"
    keys, values, ring = buffers
    shape = (attention.num_kv_heads, HEAD_DIM)
    for name, rows in (("keys", keys), ("values", values)):
        if rows.dtype != x.dtype or tuple(rows.shape[1:]) != shape or not rows.is_contiguous():
            return (f"cache {name} {rows.dtype} {tuple(rows.shape)} "
                    f"(contiguous [rows, {shape[0]}, {HEAD_DIM}] of {x.dtype})")
    if ring:
        return f"a sliding layer's ring of {ring} slots"
    if not 1 <= window <= min(MAX_WINDOW, keys.shape[0]):
        return f"window {window} (1 to {min(MAX_WINDOW, keys.shape[0])} rows)"
    return None


def refusal(x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor, window: int) -> str | None:
    """Why the kernel cannot take this layer, token and cache, wherever they are (None: it can)."""
    hidden = x.shape[-1]
    if x.numel() != hidden:
        return f"{x.numel() // max(hidden, 1)} tokens (one at a time)"
    if x.dtype not in ACTIVATIONS:
        return f"activations {x.dtype} (bf16 or f16)"
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    if attention.head_dim != HEAD_DIM:
        return f"head dim {attention.head_dim} (the kernel's {HEAD_DIM})"
    if kv_heads < 1 or heads % kv_heads or not 1 <= heads // kv_heads <= MAX_GROUP:
        return f"{heads} query heads over {kv_heads} KV heads (1 to {MAX_GROUP} a KV head)"
    rot_dim = attention.rope_dim
    if rot_dim < 2 or rot_dim % 2 or rot_dim > HEAD_DIM:
        return f"rope dims {rot_dim} (even, at most {HEAD_DIM})"
    room = catalogue.ATTENTION_PERSISTENT_STAGE_VALUES
    if hidden % 256 or hidden > room or heads * HEAD_DIM > room:
        return f"hidden {hidden} / query channels {heads * HEAD_DIM} (whole 256-value blocks, at most {room})"
    for name in ("q_norm", "k_norm"):
        norm = getattr(attention, name)
        if norm.dtype not in (torch.float32, x.dtype) or norm.numel() != HEAD_DIM or not norm.is_contiguous():
            return f"{name} weight {norm.dtype} {tuple(norm.shape)} (fp32 or the activations' type)"
    if attention.q_norm.dtype != attention.k_norm.dtype:
        return f"q_norm {attention.q_norm.dtype} beside k_norm {attention.k_norm.dtype} (one type)"
    if position.numel() != 1 or position.dtype != torch.int64:
        return f"position {position.dtype} {tuple(position.shape)} (one int64)"
    if formats(attention, hidden) is None:
        return "products not of tensor-core K-quant formats (q and k of one)"
    rows = _rows(attention)
    wanted = {"q": 2 * heads * HEAD_DIM, "k": kv_heads * HEAD_DIM, "v": kv_heads * HEAD_DIM, "o": hidden}
    for part, (weight, first) in rows.items():
        if weight.shape[0] < first + wanted[part]:
            return f"{part} rows {weight.shape[0] - first} from row {first} of {weight.name!r} (wants {wanted[part]})"
    if attention.o_proj.shape[0] != hidden:
        return f"o rows {attention.o_proj.shape[0]} (the hidden size {hidden})"
    return _cache_refusal(x, attention, kv, window)


def residual_refusal(x: torch.Tensor, residual: torch.Tensor, input_norm: torch.Tensor, attention: Any) -> str | None:
    """Why the kernel cannot take the layer's input add + norm with the attention (None: it can): the first phase's
    (`ffn_persistent.token_refusal`), and an input norm weight of the q/k norms' type (one template type)."""
    reason = ffn_persistent.token_refusal(x, residual, input_norm)
    if reason is None and input_norm.dtype != attention.q_norm.dtype:
        return f"input norm {input_norm.dtype} beside the q/k norms' {attention.q_norm.dtype} (one type)"
    return reason


def _inv_freq(ops: Any, rot_dim: int, theta: float, *, make: bool) -> torch.Tensor | None:
    """RoPE's inverse frequencies on the backend's device, by the unfused op's torch expression (so the angles
    agree), made once with `make` (never during a graph capture), else None until made."""
    from .triton_fused import rope_inv_freq

    made = ops.__dict__.setdefault("_attention_inv_freq", {})
    key = (rot_dim, float(theta))
    if key not in made and make:
        made[key] = rope_inv_freq(rot_dim, theta, ops.device)
    return made.get(key)


def takes(ops: Any, x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor, window: int,
          residual: torch.Tensor | None = None, input_norm: torch.Tensor | None = None) -> bool:
    """Whether the persistent kernel runs this call: switched on, inside a decode step that may take decode-only
    kernels, a CUDA build of torch, operands it takes (`refusal`, and `residual_refusal` with a residual) on the
    backend's CUDA device, the barrier's counter and the inverse frequencies made (never inside a graph capture)."""
    if not enabled() or not decode_only_kernels() or getattr(torch.version, "hip", None):
        return False
    ops = getattr(ops, "backend", ops)  # a family op gets the family's view: the counter is the backend's
    if refusal(x, attention, kv, position, window) is not None:
        return False
    if residual is not None and residual_refusal(x, residual, input_norm, attention) is not None:
        return False
    keys, values, _ = kv.plain_rows(attention.layer_index)
    tensors = (x, attention.q_norm, attention.k_norm, position, keys, values,
               *((residual, input_norm) if residual is not None else ()))
    if x.device.type != "cuda" or any(t.device != ops.device for t in tensors):
        return False
    make = not torch.cuda.is_current_stream_capturing()
    return (ffn_persistent.counter(ops, make=make) is not None
            and _inv_freq(ops, attention.rope_dim, attention.rope_theta, make=make) is not None)


def partition(window: int, kv_heads: int, units: int) -> tuple[int, int]:
    """(keys a warp walks, units a KV head) for a window: about `units` phase-2 units in all (the grid), each
    `WARPS` spans of at least `MIN_SPAN` keys. A function of the window, so a recorded step replays one launch."""
    per_head = max(1, units // kv_heads)
    span = max(MIN_SPAN, -(-window // (WARPS * per_head)))
    return span, -(-window // (WARPS * span))


def run(ops: Any, x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor, window: int, *,
        residual: torch.Tensor | None = None, input_norm: torch.Tensor | None = None, input_eps: float = 0.0,
        trace: dict[str, torch.Tensor] | None = None) -> Any:
    """The persistent attention for a call `takes` accepted, the token's K/V stored at `position`: the output
    `[1, 1, hidden]` of the normed input `x`; with a `residual`, `(the output, residual + x)` of `rms_norm(residual +
    x) * input_norm` (the layer's input add + norm in the same launch). `trace` (a check's): filled with the
    launch's products (q | gate rows, k rows, v rows) and core (the gated attention, before the output product)."""
    ops = getattr(ops, "backend", ops)  # a family op gets the family's view: the counter is the backend's
    hidden = x.shape[-1]
    qk_format, v_format, o_format = formats(attention, hidden)
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    program, name = catalogue.attention_persistent(qk_format, v_format, o_format, ACTIVATIONS[x.dtype],
                                                   NORM_WEIGHTS[attention.q_norm.dtype], heads // kv_heads)
    q_rows, kv_rows = 2 * heads * HEAD_DIM, kv_heads * HEAD_DIM
    tiles = max((q_rows + 2 * kv_rows) // TILE, heads, hidden // TILE)
    grid = ffn_persistent.grid_size(ops, program, name, tiles, per_sm=blocks_per_sm(heads // kv_heads),
                                    threads=catalogue.ATTENTION_PERSISTENT_THREADS)
    span, spans = partition(window, kv_heads, grid)
    x = x.contiguous()
    products = torch.empty(q_rows + 2 * kv_rows, dtype=x.dtype, device=ops.device)
    partial_max = torch.empty(heads * spans * WARPS, dtype=torch.float32, device=ops.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty(heads * spans * WARPS, HEAD_DIM, dtype=torch.float32, device=ops.device)
    core = torch.empty(heads * HEAD_DIM, dtype=x.dtype, device=ops.device)
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty_like(residual)
    rows = _rows(attention)
    keys, values, _ = kv.plain_rows(attention.layer_index)
    ops._launch((program, name), grid, catalogue.ATTENTION_PERSISTENT_THREADS, Pointer(x.data_ptr()),
                Pointer(residual.data_ptr() if residual is not None else 0),
                Pointer(input_norm.data_ptr() if residual is not None else 0),
                Pointer(summed.data_ptr() if summed is not None else 0),
                *(ffn_persistent.row_pointer(ops, *rows[part]) for part in ("q", "k", "v", "o")),
                Pointer(attention.q_norm.data_ptr()), Pointer(attention.k_norm.data_ptr()),
                Pointer(_inv_freq(ops, attention.rope_dim, attention.rope_theta, make=False).data_ptr()),
                Pointer(position.data_ptr()), Pointer(keys.data_ptr()), Pointer(values.data_ptr()),
                Pointer(products.data_ptr()), Pointer(partial_max.data_ptr()), Pointer(partial_sum.data_ptr()),
                Pointer(partial_acc.data_ptr()), Pointer(core.data_ptr()), Pointer(out.data_ptr()),
                Pointer(ffn_persistent.counter(ops, make=False).data_ptr()), Int(hidden), Int(kv_heads),
                Int(attention.rope_dim), Int(span), Int(spans), Float(HEAD_DIM ** -0.5), Float(attention.eps),
                Float(input_eps))
    if trace is not None:
        trace.update(products=products, core=core)
    return out if summed is None else (out, summed)
