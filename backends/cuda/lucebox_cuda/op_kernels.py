"""The ops `lucebox-cuda` runs as kernels: for each named op, the kernel and its check of what it takes.

Registered by name through the `lucebox_op_kernels` hook (`plugin.py`, `GENERIC_KERNEL_OPS` and `FAMILY_KERNEL_OPS`), the one mechanism by
which a backend offers kernels (`lucebox_core.ops`): the generic ops of `TorchBackend` (products on GGUF
blocks, norms, attention, the fused decode-step compositions) and the Qwen3.5 family's Gated DeltaNet and
convolution ops alike. Each `accepts_<op>` gets the arguments of the op's reference and says whether its
kernel takes them (on this device, floats the kernels read, shapes they handle); where it does not, the
reference runs. Every kernel gives the reference's result (`scripts/cuda_check.py` on the GPU, the Triton
interpreter in the CPU tests).

The first argument of each is `ops`: the `CudaBackend` for a generic op, the family's view of it (which
reads through to the backend) for a family op.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Any

import torch

from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend, add_shared_expert, concat_rows

from . import attention_persistent, catalogue, ffn_persistent, gdn_persistent, megakernel, moe_persistent

# Short Gated DeltaNet prefills (speculative verify chunks, short prompts) take the token-by-token Triton
# kernel: as fast there, and the chunk-scan kernel faulted on a lone 16-token chunk on the H200 (run 3).
SEQUENTIAL_PREFILL_TOKENS = 256
# Rows `linear` still runs on the matrix-vector kernels (in slices of catalogue.MAX_BATCH) rather than the
# tiled prefill product: every speculative verify pass (at most a 64-draft tree plus its root).
VERIFY_ROWS = 2 * catalogue.MAX_BATCH
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _optional(module: str) -> ModuleType | None:
    """`lucebox_cuda.<module>` if Triton imports here, else None (the references then serve)."""
    try:
        return __import__(f"lucebox_cuda.{module}", fromlist=["_"])
    except ImportError:
        return None


triton_ops = functools.cache(lambda: _optional("triton_ops"))
triton_attention = functools.cache(lambda: _optional("triton_attention"))
triton_gdn = functools.cache(lambda: _optional("triton_gdn"))
triton_fused = functools.cache(lambda: _optional("triton_fused"))
triton_moe = functools.cache(lambda: _optional("triton_moe"))
triton_block_sparse = functools.cache(lambda: _optional("triton_block_sparse"))
triton_attention_split = functools.cache(lambda: _optional("triton_attention_split"))
triton_norms = functools.cache(lambda: _optional("triton_norms"))
triton_gdn_glue = functools.cache(lambda: _optional("triton_gdn_glue"))


def _triton_takes(ops: Any, *tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on these tensors: Triton importable, all on the backend's device,
    floats of a kernel dtype (integer tensors such as positions pass)."""
    if triton_ops() is None:
        return False
    device = ops.device
    return all(t.device == device and (t.dtype in FLOATS or not t.is_floating_point()) for t in tensors)


def _rows_indexable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can index these as rows: last dim contiguous, leading dims one stride."""
    fused = triton_fused()
    return fused is not None and all(t.stride(-1) == 1 and fused._mergeable(t) for t in tensors)


# -- weights and products (the NVRTC kernels) --------------------------------------------------------------


def accepts_fuse_rows(ops: Any, weights: list[Any]) -> bool:
    return all(ops.kernel_format(torch.empty(0, w.shape[-1], dtype=ops.dtype, device=ops.device), w) for w in weights)


def fuse_rows(ops: Any, weights: list[Any]) -> Any:
    """Projections of one input stacked into one weight on this GPU (one matvec launch instead of several,
    and a larger grid); the parts are never uploaded."""
    return concat_rows(weights, ops.device)


def accepts_linear(ops: Any, x: torch.Tensor, weight: Any) -> bool:
    return ops.kernel_format(x, weight) is not None


def linear(ops: Any, x: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
    """Few rows (decode, verify) on the matrix-vector kernels, which read each weight byte once; more
    (prefill) through tiles dequantized into a scratch buffer and cuBLAS."""
    weight_format = ops.kernel_format(x, weight)
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    x2 = x.reshape(rows, in_features)
    if rows == 0:
        out = x2.new_empty(0, out_features)
    elif rows <= catalogue.MAX_BATCH:
        out = ops.matvec(x2, weight, weight_format)
    elif rows <= VERIFY_ROWS:
        # A speculative verify pass larger than one kernel batch (a 65-node tree): matvec kernels in
        # slices, which compute each row as the decode step does (tiled dequant + cuBLAS would not).
        out = x2.new_empty(rows, out_features)
        for start in range(0, rows, catalogue.MAX_BATCH):
            stop = min(start + catalogue.MAX_BATCH, rows)
            ops.matvec(x2[start:stop], weight, weight_format, out=out[start:stop])
    else:
        out = ops.tiled_linear(x2, weight, weight_format)
    return out.reshape(*x.shape[:-1], out_features)


def accepts_embedding(ops: Any, ids: torch.Tensor, weight: Any) -> bool:
    return isinstance(weight, QuantTensor)


def embedding(ops: Any, ids: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
    """Decode only the rows looked up: one dequant kernel reading the ids on the device (the torch decoder of
    the weight's format, over the gathered bytes, was ~25 small launches and 0.9 ms of host time a decode
    step on the H200's host, paid before every step); formats or row lengths without a kernel take that path."""
    weight_format = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
    whole_pieces = weight_format is not None and weight.shape[-1] % catalogue.ROW_MULTIPLE[weight_format] == 0
    if whole_pieces and len(weight.shape) == 2 and ops.dtype in catalogue.ACTIVATIONS and hasattr(ops, "lookup_rows"):
        return ops.lookup_rows(weight, ids)
    return ops.device_weight(weight).lookup_rows(ids.to(ops.device), ops.dtype)


def accepts_rms_norm(ops: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     out: torch.Tensor | None = None) -> bool:
    return (x.device == ops.device and x.dtype in catalogue.ACTIVATIONS and weight.dtype in catalogue.ACTIVATIONS
            and weight.numel() == x.shape[-1] and x.numel() > 0)


def rms_norm(ops: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    return ops.rms_norm_kernel(x, weight, eps, out=out)


# -- attention (lucebox_cuda.triton_attention) ------------------------------------------------------------


def _cache_attention(ops: Any, kernel: Any, reference: Any, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Run an attention kernel over a KV window; a quantized window (Q8_0, Q4_0, TQ3_0) whose kernel does not
    build here falls back to the reference (with one warning), as the newest kernel might."""
    backend = getattr(ops, "backend", ops)
    quantized = k.dtype == torch.uint8 or v.dtype == torch.uint8
    if quantized and backend.__dict__.get("_q8_attention_failure"):
        return reference()
    try:
        return kernel()
    except Exception as exc:  # noqa: BLE001 -- first used eagerly (a graph's warm-up), so this is safe
        if not quantized or torch.cuda.is_current_stream_capturing():
            raise
        backend.__dict__["_q8_attention_failure"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"quantized cache attention kernel unavailable, decoding the window instead: {exc}",
                      RuntimeWarning, stacklevel=3)
        return reference()


def _window(*windows: torch.Tensor) -> bool:
    """KV windows the kernels read: values or Q8_0 rows `[W, Hkv, dim]`, Q4_0 / TQ3_0 blocks `[W, Hkv, B, bytes]`."""
    return all(t.dim() == 3 or (t.dim() == 4 and t.dtype == torch.uint8) for t in windows)


def accepts_decode_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                             *, scale: float) -> bool:
    return (triton_attention() is not None and _triton_takes(ops, q, k, v, position) and _window(k, v)
            and q.shape[2] % k.shape[1] == 0)


def decode_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *,
                     scale: float) -> torch.Tensor:
    """As a one-node tree verification: the decode step and a speculative verify pass share one kernel and
    one key partition, so a verified token gets the bits the decode step gives it. A quantized window (Q8_0,
    Q4_0, TQ3_0 blocks) is decoded in registers."""
    return _cache_attention(ops, lambda: triton_attention().decode_attention(q, k, v, position, scale=scale),
                            lambda: TorchBackend.decode_attention(ops, q, k, v, position, scale=scale), k, v)


def accepts_tree_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                           visible: torch.Tensor, *, scale: float, node_k: torch.Tensor | None = None,
                           node_v: torch.Tensor | None = None, ring: int = 0) -> bool:
    nodes = () if node_k is None or node_v is None else (node_k, node_v)
    return (triton_attention() is not None and _triton_takes(ops, q, k, v, position, visible, *nodes)
            and q.dim() == 4 and _window(k, v) and q.shape[2] % k.shape[1] == 0)


def tree_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                   visible: torch.Tensor, *, scale: float, node_k: torch.Tensor | None = None,
                   node_v: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """Each node over its own path, split over the rows in the decode step's fixed partition
    (flash-decoding for N nodes); a quantized window is decoded in registers; node rows apart from the cache
    and a sliding layer's ring as the reference takes them."""
    extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
    return _cache_attention(ops, lambda: triton_attention().tree_attention(q, k, v, position, visible, scale=scale,
                                                                           **extra),
                            lambda: TorchBackend.tree_attention(ops, q, k, v, position, visible, scale=scale,
                                                                **extra), k, v)


def accepts_block_sparse_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: Any = None,
                                   mask: torch.Tensor | None = None, scale: float | None = None) -> bool:
    from lucebox_core.block_sparse import BlockSparseConfig

    module = triton_block_sparse()
    tensors = (q, k, v) + (() if mask is None else (mask,))
    return (module is not None and _triton_takes(ops, *tensors)
            and module.kernel_takes(q, k, v, config or BlockSparseConfig()))


def block_sparse_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: Any = None,
                           mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The selection in torch (block mean-K and scores are small products), the attention over the kept
    blocks in Triton: one program per (query block, head) walks its kept key blocks, unmasked below the
    diagonal."""
    return triton_block_sparse().block_sparse_attention(q, k, v, config, mask, scale=scale)


def accepts_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      causal_offset: int | torch.Tensor | None = None, mask: torch.Tensor | None = None) -> bool:
    on_device = isinstance(causal_offset, torch.Tensor)  # read by the kernel; never compared on the host
    tensors = (q, k, v) + (() if mask is None else (mask,)) + ((causal_offset,) if on_device else ())
    return (triton_attention() is not None and _triton_takes(ops, *tensors) and q.dim() == k.dim() == v.dim() == 4
            and q.shape[2] % k.shape[2] == 0 and k.shape[1] > 0
            and (causal_offset is None or on_device or causal_offset >= 0))


def attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
              causal_offset: int | torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A FlashAttention-2 forward in Triton (GQA, causal offset, bool mask): the reference materialises
    every score (14 GB for a 4096-token chunk at depth 32K). A short chunk over a long cache, whose plain
    grid would leave most SMs idle, has its keys cut into spans (`triton_attention_split`), decided by the
    shapes alone (a recorded prefill's: its KV window's)."""
    split = triton_attention_split()
    splits = split.key_splits(q, k, has_mask=mask is not None) if split is not None else 1
    if splits > 1:
        return split.attention(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, splits=splits)
    return triton_attention().attention(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask)


# -- the fused decode-step compositions (lucebox_cuda.triton_fused) ---------------------------------------


def accepts_add_rms_norm(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return _triton_takes(ops, x, residual, weight) and x.shape == residual.shape and _rows_indexable(x, residual)


def add_rms_norm(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return triton_fused().add_rms_norm(x, residual, weight, eps)


def accepts_add_rms_norm_swiglu(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                gate_up: Any, down: Any) -> bool:
    return ffn_persistent.takes(ops, x, residual, weight, gate_up, down)


def add_rms_norm_swiglu(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        gate_up: QuantTensor, down: QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's add + norm and SwiGLU MLP in one persistent launch (`ffn_persistent`, LUCEBOX_PERSISTENT_FFN=1)."""
    return ffn_persistent.run(ops, x, residual, weight, eps, gate_up, down)


def accepts_add_rms_norm_moe(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             block: Any) -> bool:
    return moe_persistent.takes(ops, x, residual, weight, block)


def add_rms_norm_moe(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     block: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's add + norm and MoE block in one persistent launch (`moe_persistent`, LUCEBOX_PERSISTENT_MOE=1)."""
    return moe_persistent.run(ops, x, residual, weight, eps, block)


def accepts_gated_delta_net_decode_(ops: Any, x: torch.Tensor, mixer: Any, state: Any) -> bool:
    return gdn_persistent.takes(ops, x, mixer, state)


def gated_delta_net_decode_(ops: Any, x: torch.Tensor, mixer: Any, state: Any) -> torch.Tensor:
    """One token's Gated DeltaNet mixer in one persistent launch (`gdn_persistent`, LUCEBOX_PERSISTENT_GDN=1)."""
    return gdn_persistent.run(ops, x, mixer, state)


def accepts_add_rms_norm_gated_delta_net_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                          eps: float, mixer: Any, state: Any) -> bool:
    return gdn_persistent.takes(ops, x, mixer, state, residual, weight)


def add_rms_norm_gated_delta_net_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  mixer: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's input add + norm and its Gated DeltaNet mixer in one persistent launch (LUCEBOX_PERSISTENT_GDN=1)."""
    return gdn_persistent.run(ops, x, mixer, state, residual=residual, input_norm=weight, input_eps=eps)


def accepts_gated_attention_decode_(ops: Any, x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor,
                                    window: int) -> bool:
    return attention_persistent.takes(ops, x, attention, kv, position, window)


def gated_attention_decode_(ops: Any, x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor,
                            window: int) -> torch.Tensor:
    """One token's gated attention in one persistent launch (`attention_persistent`, LUCEBOX_PERSISTENT_ATTENTION=1)."""
    return attention_persistent.run(ops, x, attention, kv, position, window)


def accepts_add_rms_norm_gated_attention_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                          eps: float, attention: Any, kv: Any, position: torch.Tensor,
                                          window: int) -> bool:
    return attention_persistent.takes(ops, x, attention, kv, position, window, residual, weight)


def add_rms_norm_gated_attention_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  attention: Any, kv: Any, position: torch.Tensor,
                                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's input add + norm and its gated attention in one persistent launch
    (LUCEBOX_PERSISTENT_ATTENTION=1)."""
    return attention_persistent.run(ops, x, attention, kv, position, window, residual=residual, input_norm=weight,
                                    input_eps=eps)


# A Qwen3.5 decode step's whole decoder stack in one persistent launch (`megakernel`, LUCEBOX_MEGAKERNEL=1).
accepts_decode_layers_, decode_layers_ = megakernel.takes, megakernel.run


def accepts_silu_mul(ops: Any, gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (_triton_takes(ops, gate, up) and gate.shape == up.shape and gate.dtype == up.dtype
            and _rows_indexable(gate, up))


def silu_mul(ops: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return triton_fused().silu_mul(gate, up)


def accepts_write_kv_rows(ops: Any, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ring: int,
                          k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_triton_takes(ops, keys, values, positions, k, v) and keys.dim() == values.dim() == k.dim() == v.dim() == 3
            and keys.is_contiguous() and values.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
            and keys.shape[1:] == k.shape[1:] and values.shape[1:] == v.shape[1:] and k.shape[:2] == v.shape[:2]
            and positions.numel() == k.shape[0] and not positions.is_floating_point())


def write_kv_rows(ops: Any, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ring: int,
                  k: torch.Tensor, v: torch.Tensor) -> None:
    triton_ops().write_kv_rows(keys, values, positions, ring, k, v)


def accepts_sigmoid_mul(ops: Any, x: torch.Tensor, gate: torch.Tensor) -> bool:
    return _triton_takes(ops, x, gate) and x.shape == gate.shape and x.dtype == gate.dtype and _rows_indexable(x, gate)


def sigmoid_mul(ops: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return triton_fused().sigmoid_mul(x, gate)


def accepts_add_sigmoid_gated(ops: Any, base: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> bool:
    return (_triton_takes(ops, base, x, gate) and base.shape == x.shape and base.dtype == x.dtype == gate.dtype
            and base.dim() >= 1 and gate.shape == (*base.shape[:-1], 1))


def add_sigmoid_gated(ops: Any, base: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return triton_fused().add_sigmoid_gated(base, x, gate)


def accepts_l2norm(ops: Any, x: torch.Tensor, eps: float = 1e-6) -> bool:
    return (triton_norms() is not None and _triton_takes(ops, x) and x.is_floating_point() and x.numel() > 0
            and x.shape[-1] <= 8192)


def l2norm(ops: Any, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One kernel instead of the reference's seven launches (each prefill of a Gated DeltaNet layer runs two)."""
    return triton_norms().l2norm(x, eps)


def accepts_gated_rms_norm(ops: Any, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return _triton_takes(ops, x, z, weight) and x.shape == z.shape and x.dtype == z.dtype and _rows_indexable(x, z)


def gated_rms_norm(ops: Any, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return triton_fused().gated_rms_norm(x, z, weight, eps)


def accepts_qk_norm_rope(ops: Any, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         positions: torch.Tensor, rot_dim: int, theta: float, eps: float) -> bool:
    return (_triton_takes(ops, query, key, q_norm, k_norm, positions) and query.shape[0] == 1
            and query.stride(-1) == 1 and key.stride(-1) == 1)


def qk_norm_rope(ops: Any, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 positions: torch.Tensor, rot_dim: int, theta: float, eps: float):
    return triton_fused().qk_norm_rope(query, key, q_norm, k_norm, positions, rot_dim, theta, eps,
                                       inv_freq=ops.rope_inv_freq(rot_dim, theta))


# -- the Qwen3.5 family's Gated DeltaNet and convolution ops (lucebox_qwen35.ops) ---------------------------


def accepts_gated_delta_rule_recurrent(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                       beta: torch.Tensor, state: torch.Tensor | None, scale: float | None = None) -> bool:
    tensors = (q, k, v, g, beta) + (() if state is None else (state,))
    return q.shape[1] == 1 and v.shape[2] % k.shape[2] == 0 and _triton_takes(ops, *tensors)


def gated_delta_rule_recurrent(ops: Any, q, k, v, g, beta, state, scale=None):
    """One token (decode) as one Triton kernel; more tokens are not accepted and take the reference."""
    return triton_ops().gated_delta_rule_step(q, k, v, g, beta, state, scale)


def accepts_causal_conv1d_step(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> bool:
    return _triton_takes(ops, x, weight, state)


def causal_conv1d_step(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    return triton_ops().causal_conv1d_step(x, weight, state)


def accepts_conv_silu_update_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> bool:
    return _triton_takes(ops, x, weight, state) and state.dtype == x.dtype


def conv_silu_update_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    out, _ = triton_ops().causal_conv1d_step(x, weight, state, activation="silu", new_state=state)
    return out


def accepts_gated_delta_decode_(ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
                                dt_bias: torch.Tensor, state: torch.Tensor, num_k_heads: int, head_k_dim: int) -> bool:
    return (_triton_takes(ops, mixed, a, b, ssm_a, dt_bias, state) and state.is_contiguous()
            and state.dtype == torch.float32 and all(t.stride(-1) == 1 for t in (mixed, a, b)))


def gated_delta_decode_(ops: Any, mixed, a, b, ssm_a, dt_bias, state, num_k_heads, head_k_dim):
    return triton_fused().gated_delta_decode_(mixed, a, b, ssm_a, dt_bias, state, num_k_heads, head_k_dim)


def accepts_gated_delta_tree(ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
                             dt_bias: torch.Tensor, state: torch.Tensor, parents: torch.Tensor, num_k_heads: int,
                             head_k_dim: int) -> bool:
    return (_triton_takes(ops, mixed, a, b, ssm_a, dt_bias, state, parents) and mixed.shape[0] == 1
            and state.is_contiguous() and state.dtype == torch.float32
            and all(t.stride(-1) == 1 for t in (mixed, a, b)))


def gated_delta_tree(ops: Any, mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim):
    """One Triton kernel walking the nodes (parents read on the device)."""
    return triton_fused().gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim)


def accepts_gated_delta_tree_reloaded(ops: Any, mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads,
                                      head_k_dim) -> bool:
    return accepts_gated_delta_tree(ops, mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim)


def gated_delta_tree_reloaded(ops: Any, mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim):
    return triton_fused().gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim,
                                           all_states=False)


accepts_gated_delta_path_ = accepts_gated_delta_tree  # the same arguments (a path in place of the parents)


def gated_delta_path_(ops: Any, mixed, a, b, ssm_a, dt_bias, state, path, num_k_heads, head_k_dim):
    triton_fused().gated_delta_path_(mixed, a, b, ssm_a, dt_bias, state, path, num_k_heads, head_k_dim)


def accepts_gdn_gates(ops: Any, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor) -> bool:
    glue = triton_gdn_glue()
    heads = a.shape[-1]
    return (glue is not None and _triton_takes(ops, a, b, ssm_a, dt_bias) and a.shape == b.shape and a.numel() > 0
            and a.is_floating_point() and b.is_floating_point() and 0 < heads <= glue.MAX_GATE_HEADS
            and ssm_a.numel() == dt_bias.numel() == heads and ssm_a.dtype == dt_bias.dtype == torch.float32)


def gdn_gates(ops: Any, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor):
    """One launch for both gates (the reference's cast, add, softplus, product and sigmoid are five)."""
    return triton_gdn_glue().gdn_gates(a, b, ssm_a, dt_bias)


def accepts_gated_delta_rule_chunked(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, state: torch.Tensor | None, chunk_size: int = 64,
                                     scale: float | None = None) -> bool:
    tensors = (q, k, v, g, beta) + (() if state is None else (state,))
    gdn = triton_gdn()
    return (gdn is not None and v.shape[2] % k.shape[2] == 0 and chunk_size in gdn.CHUNK_SIZES
            and _triton_takes(ops, *tensors))


def _delta_prefill(q, k, v, g, beta, state, chunk_size, scale, new_state):
    if q.shape[1] <= SEQUENTIAL_PREFILL_TOKENS:
        return triton_gdn().gated_delta_rule_sequential(q, k, v, g, beta, state, scale, new_state=new_state)
    return triton_gdn().gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size, scale, new_state=new_state)


def gated_delta_rule_chunked(ops: Any, q, k, v, g, beta, state, chunk_size=64, scale=None):
    """Two Triton kernels (chunk inverses, then the chunk scan); short runs token by token."""
    return _delta_prefill(q, k, v, g, beta, state, chunk_size, scale, None)


def accepts_gated_delta_rule_chunked_(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, chunk_size: int = 64,
                                      scale: float | None = None) -> bool:
    return (state is not None and state.dtype == torch.float32 and state.is_contiguous()
            and accepts_gated_delta_rule_chunked(ops, q, k, v, g, beta, state, chunk_size, scale))


def gated_delta_rule_chunked_(ops: Any, q, k, v, g, beta, state, chunk_size=64, scale=None) -> torch.Tensor:
    """The scan writes the new state over the old (each program owns its state tile), saving the copy."""
    out, _ = _delta_prefill(q, k, v, g, beta, state, chunk_size, scale, state)
    return out


def accepts_gated_delta_rule_tree(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
                                  scale: float | None = None) -> bool:
    return (triton_gdn() is not None and q.shape[0] == 1 and v.shape[2] % k.shape[2] == 0
            and _triton_takes(ops, q, k, v, g, beta, state, parents))


def gated_delta_rule_tree(ops: Any, q, k, v, g, beta, state, parents, scale=None):
    """One Triton launch walking the nodes (parents read on the device), so a verify pass can be recorded."""
    return triton_gdn().gated_delta_rule_tree(q, k, v, g, beta, state, parents, scale)


def accepts_causal_conv1d(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> bool:
    return triton_gdn() is not None and weight.shape[1] >= 2 and _triton_takes(ops, x, weight, state)


def causal_conv1d(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    return triton_gdn().causal_conv1d(x, weight, state)


def accepts_causal_conv1d_silu_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> bool:
    return (accepts_causal_conv1d(ops, x, weight, state) and state.dtype == x.dtype and state.is_contiguous()
            and weight.shape[1] - 1 <= triton_gdn().CONV_BLOCK_TOKENS)


def causal_conv1d_silu_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One launch for the reference's three (convolution, the state's copy, SiLU): SiLU applied as the tree
    and step kernels apply it, the new state written over the old one in the kernel."""
    y, _ = triton_gdn().causal_conv1d(x, weight, state, activation="silu", new_state=state)
    return y


def accepts_causal_conv1d_tree(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                               parents: torch.Tensor) -> bool:
    return (triton_gdn() is not None and weight.shape[1] >= 2 and x.shape[0] == 1
            and _triton_takes(ops, x, weight, state, parents))


def causal_conv1d_tree(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor):
    """Each node's ancestry walked on the device (sums in fp32, as the decode step's convolution kernel)."""
    return triton_gdn().causal_conv1d_tree(x, weight, state, parents)


def accepts_conv_silu_tree(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                           parents: torch.Tensor) -> bool:
    return accepts_causal_conv1d_tree(ops, x, weight, state, parents) and state.dtype == x.dtype


def conv_silu_tree(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor):
    """The tree convolution with SiLU in the same kernel, reduced and activated as the decode step's
    `conv_silu_update_` kernel: a verified node's Gated DeltaNet input is the decode step's to the bit."""
    return triton_gdn().causal_conv1d_tree(x, weight, state, parents, activation="silu")



# -- mixture-of-experts products (Gemma-4's own `moe_experts`; the core's generic `moe_experts_swiglu`; both
# over Spark's paged stacks too) --

# Routed (token, expert) pairs up to which the experts run on the pair kernel (each pair reads its expert's
# blocks: decode and speculative verify, which must share the decode step's kernel to get its bits); beyond
# (prefill), the grouped GEMM over every pair at once (`lucebox_cuda.triton_moe`), or without Triton each hit
# expert once over its tokens.
EXPERT_PAIR_LIMIT = 8 * VERIFY_ROWS


def _expert_stack(ops: Any, weight: Any) -> bool:
    return (isinstance(weight, QuantTensor) and len(weight.shape) == 3
            and weight.ggml_type in catalogue.WEIGHT_FORMATS)


def accepts_moe_experts(ops: Any, x: torch.Tensor, gate_up_exps: Any, down_exps: Any, weights: torch.Tensor,
                        ids: torch.Tensor) -> bool:
    return (x.device == ops.device and x.dtype in catalogue.ACTIVATIONS and ids.device == ops.device
            and _expert_stack(ops, gate_up_exps) and _expert_stack(ops, down_exps))


def moe_experts(ops: Any, x: torch.Tensor, gate_up_exps: QuantTensor, down_exps: QuantTensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """`sum_k weights[t, k] * down_e(gelu_tanh(gate_e(x_t)) * up_e(x_t))`, `e = ids[t, k]`. Few pairs (decode,
    verify): one kernel per product over every pair, reading only the chosen experts' GGUF blocks, ids read on
    the device (no host sync: the decode step stays one graph). Many (prefill): each stack decoded once into
    the backend's scratch buffer and a grouped GEMM over the pairs sorted by expert (`_moe_grouped`), still
    without a host sync; without Triton, each expert any token chose once, on its tokens (`_moe_by_expert`)."""
    if ids.numel() > EXPERT_PAIR_LIMIT:
        if triton_moe() is not None and _dense_decodable(gate_up_exps) and _dense_decodable(down_exps):
            return _moe_grouped(ops, x, gate_up_exps, down_exps, weights, ids)
        return _moe_by_expert(ops, x, gate_up_exps, down_exps, weights, ids)
    return _geglu_pairs(ops, x, gate_up_exps, down_exps, weights, ids, down_exps.shape[2])


def _geglu_pairs(ops: Any, x: torch.Tensor, gate_up: Any, down: Any, weights: torch.Tensor, ids: torch.Tensor,
                 inter: int) -> torch.Tensor:
    """The GeGLU experts' pair path: the fused `[gate | up]` product, the activation, the down product and the
    weighted sum, over whole stacks or Spark's paged ones alike (`expert_matvec` reads either): the one
    arithmetic, so the paged op gets the stacked op's bits."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    products = ops.expert_matvec(x, gate_up, flat, top_k)  # [T * k, 2I]
    act = ops.gelu_tanh_mul(products[:, :inter], products[:, inter:])
    return _combine(ops.expert_matvec(act, down, flat, 1), weights, x.dtype)  # down: [T * k, hidden]


def _combine(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`sum_k weights[t, k] * pairs[t * top_k + k]`: each token's routed products `[T * k, hidden]` weighted,
    in fp32."""
    if triton_moe() is not None:
        return triton_moe().combine_pairs(pairs, weights)
    tokens, top_k = weights.shape
    return (pairs.float().reshape(tokens, top_k, -1) * weights[..., None]).sum(1).to(dtype)


def _expert_view(ops: Any, stack: QuantTensor, expert: int) -> QuantTensor:
    """Expert `expert` of a stack as its own 2-D weight: a view of the stack's device bytes, made once."""
    views = ops.__dict__.setdefault("_expert_views", {})
    key = (id(stack), expert)
    if key not in views:
        data = ops.device_weight(stack).data
        size = data.numel() // stack.shape[0]
        views[key] = (stack, QuantTensor(f"{stack.name}[{expert}]", stack.ggml_type, stack.shape[1:],
                                         data[expert * size : (expert + 1) * size]))
    return views[key][1]


def _moe_by_expert(ops: Any, x, gate_up_exps, down_exps, weights, ids, up_exps=None, activation=None) -> torch.Tensor:
    """Each expert any token chose, once, on its tokens (a host sync: prefill only). The first products are
    one fused `[gate | up]` stack (Gemma-4, GeGLU), or a gate and an up stack (`up_exps`, with `activation`)."""
    inter = down_exps.shape[2]
    activation = activation or ops.gelu_tanh_mul
    out = torch.zeros(x.shape[0], down_exps.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():  # a host sync: prefill is not recorded
        token, slot = torch.where(ids == expert)
        rows = x[token]
        if up_exps is None:
            gate_up = ops.linear(rows, _expert_view(ops, gate_up_exps, expert))
            act = activation(gate_up[:, :inter], gate_up[:, inter:])
        else:
            act = activation(ops.linear(rows, _expert_view(ops, gate_up_exps, expert)),
                             ops.linear(rows, _expert_view(ops, up_exps, expert)))
        y = ops.linear(act, _expert_view(ops, down_exps, expert))
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def accepts_moe_experts_swiglu(ops: Any, x: torch.Tensor, gate_exps: Any, up_exps: Any, down_exps: Any,
                               weights: torch.Tensor, ids: torch.Tensor, shared: Any = None,
                               shared_logit: torch.Tensor | None = None) -> bool:
    return accepts_moe_experts(ops, x, gate_exps, down_exps, weights, ids) and _expert_stack(ops, up_exps)


def moe_experts_swiglu(ops: Any, x: torch.Tensor, gate_exps: QuantTensor, up_exps: QuantTensor,
                       down_exps: QuantTensor, weights: torch.Tensor, ids: torch.Tensor, shared: Any = None,
                       shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over separate gate and up stacks (the core's
    generic op: Laguna's and Qwen3.5-MoE's experts). Few pairs: the same expert products as
    `moe_experts`, reading only the chosen experts' blocks, ids on the device; many (prefill): the grouped
    product as `moe_experts`' (gate and up decoded side by side), or without Triton each chosen expert on its
    tokens."""
    if ids.numel() > EXPERT_PAIR_LIMIT:
        stacks = (gate_exps, up_exps, down_exps)
        if (triton_moe() is not None and all(_dense_decodable(stack) for stack in stacks)
                and gate_exps.shape == up_exps.shape):
            try:
                routed = _moe_grouped_swiglu(ops, x, gate_exps, up_exps, down_exps, weights, ids)
                return add_shared_expert(ops, routed, x, shared, shared_logit)
            except torch.OutOfMemoryError:
                # The decoded stacks (1 GiB a Laguna-XS.2 layer) and the per-pair rows did not fit beside the
                # model: this chunk runs expert by expert, which needs no scratch (slower, same result).
                _warn_grouped_memory()
        routed = _moe_by_expert(ops, x, gate_exps, down_exps, weights, ids, up_exps=up_exps, activation=ops.silu_mul)
        return add_shared_expert(ops, routed, x, shared, shared_logit)
    return _swiglu_pairs(ops, x, gate_exps, up_exps, down_exps, weights, ids, shared, shared_logit)


def _foldable(ops: Any, x: torch.Tensor, stacks: tuple[Any, Any, Any], shared: Any) -> bool:
    """Whether the shared expert can ride in the routed experts' launches (`expert_matvec`'s extra pairs)."""
    if shared is None or triton_moe() is None or not hasattr(ops, "takes_extra_expert"):
        return False
    parts = (getattr(shared, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    return all(ops.takes_extra_expert(stack, part, x.dtype) for stack, part in zip(stacks, parts))


def _swiglu_pairs(ops: Any, x: torch.Tensor, gate: Any, up: Any, down: Any, weights: torch.Tensor,
                  ids: torch.Tensor, shared: Any = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU experts' pair path over whole stacks or Spark's paged ones alike (see `_geglu_pairs`). A shared
    expert of the experts' format and shape is folded in: its gate, up and down as one more pair a token in
    the same three launches and its row summed by the combine (Laguna-XS.2: 4 launches and ~13 us a layer
    fewer on the H200); else it runs apart and is added (`add_shared_expert`)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    if _foldable(ops, x, (gate, up, down), shared):
        tokens, routed = x.shape[0], flat.numel()
        fold = {"extra_pairs": tokens, "extra_x": 0}
        products = ops.expert_matvec_pair(x, gate, up, flat, top_k, extra=(shared.gate_proj, shared.up_proj), **fold)
        if products is None:
            products = (ops.expert_matvec(x, gate, flat, top_k, extra=shared.gate_proj, **fold),
                        ops.expert_matvec(x, up, flat, top_k, extra=shared.up_proj, **fold))
        rows = _swiglu_down(ops, products, down, flat, extra=shared.down_proj, extra_pairs=tokens,
                            extra_x=routed)  # [T * k + T, hidden]: the shared rows last
        return triton_moe().combine_pairs(rows, weights, shared=True, shared_logit=shared_logit)
    return add_shared_expert(ops, _routed_pairs(ops, x, gate, up, down, weights, flat, top_k), x, shared, shared_logit)


def _routed_pairs(ops: Any, x: torch.Tensor, gate: Any, up: Any, down: Any, weights: torch.Tensor,
                  flat: torch.Tensor, top_k: int) -> torch.Tensor:
    # Gate and up in one launch where they pair (same format and shape): the same bits as two launches.
    products = ops.expert_matvec_pair(x, gate, up, flat, top_k) if hasattr(ops, "expert_matvec_pair") else None
    if products is None:
        products = ops.expert_matvec(x, gate, flat, top_k), ops.expert_matvec(x, up, flat, top_k)
    return _combine(_swiglu_down(ops, products, down, flat), weights, x.dtype)  # down: [T * k, hidden]


def _swiglu_down(ops: Any, products: tuple[torch.Tensor, torch.Tensor], down: Any, flat: torch.Tensor,
                 **extra: Any) -> torch.Tensor:
    """The down product of the SwiGLU pairs: the kernel computing `silu(gate) * up` itself where the backend takes
    it (`takes_swiglu`: one launch fewer, every pair path alike), else `silu_mul` and then the product."""
    gate, up = products
    if getattr(ops, "takes_swiglu", None) is not None and ops.takes_swiglu(down, gate.dtype):
        return ops.expert_matvec(gate, down, flat, 1, up=up, **extra)
    return ops.expert_matvec(ops.silu_mul(gate, up), down, flat, 1, **extra)


def _paged_stack(ops: Any, pages: Any) -> bool:
    """Spark's paged stack (`lucebox_core.spark.ExpertPages`) as the paged kernel reads it: slots on this device
    in a kernel format, the table on this device, the host copy in pinned memory (device-readable)."""
    pool, host, where = (getattr(pages, name, None) for name in ("pool", "host", "where"))
    return (_expert_stack(ops, pool) and isinstance(host, torch.Tensor) and host.device.type == "cpu"
            and getattr(pages, "pinned", False) and host.is_contiguous() and host.data_ptr() % 16 == 0
            and isinstance(where, torch.Tensor) and where.device == ops.device and where.dtype == torch.long)


def accepts_moe_experts_swiglu_paged(ops: Any, x: torch.Tensor, gate: Any, up: Any, down: Any,
                                     weights: torch.Tensor, ids: torch.Tensor, shared: Any = None,
                                     shared_logit: torch.Tensor | None = None) -> bool:
    return (x.device == ops.device and x.dtype in catalogue.ACTIVATIONS and ids.device == ops.device
            and ids.numel() <= EXPERT_PAIR_LIMIT and all(_paged_stack(ops, p) for p in (gate, up, down)))


def moe_experts_swiglu_paged(ops: Any, x: torch.Tensor, gate: Any, up: Any, down: Any, weights: torch.Tensor,
                             ids: torch.Tensor, shared: Any = None, shared_logit: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """`moe_experts_swiglu` over Spark's paged stacks for few pairs (decode, verify): the same three expert
    products and combine, each expert's blocks read from its device slot or, not resident, straight from
    pinned host memory (the paged moe_matvec kernel). No host value depends on the ids or the residency
    table: the decode step and the verify pass stay one recorded graph while experts move between replays.
    The shared expert (always on the device) is folded in as in the stacked op."""
    return _swiglu_pairs(ops, x, gate, up, down, weights, ids, shared, shared_logit)


def accepts_moe_experts_paged(ops: Any, x: torch.Tensor, gate_up: Any, down: Any, weights: torch.Tensor,
                              ids: torch.Tensor) -> bool:
    return (x.device == ops.device and x.dtype in catalogue.ACTIVATIONS and ids.device == ops.device
            and ids.numel() <= EXPERT_PAIR_LIMIT and _paged_stack(ops, gate_up) and _paged_stack(ops, down))


def moe_experts_paged(ops: Any, x: torch.Tensor, gate_up: Any, down: Any, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """`moe_experts` (GeGLU over a fused `[gate | up]` stack) over Spark's paged stacks for few pairs (decode,
    verify): the stacked op's pair path, each expert's blocks read from its device slot or, not resident,
    straight from pinned host memory (the paged moe_matvec kernel); no host value depends on the ids or the
    table, so the step stays one recorded graph while experts move between replays."""
    return _geglu_pairs(ops, x, gate_up, down, weights, ids, down.pool.shape[2])


def _dense_decodable(stack: QuantTensor) -> bool:
    """Whether the dequant kernel decodes the stack's rows whole (its pieces are 8 or more values)."""
    return stack.shape[2] % catalogue.ROW_MULTIPLE[catalogue.WEIGHT_FORMATS[stack.ggml_type]] == 0


def _moe_grouped(ops: Any, x, gate_up_exps, down_exps, weights, ids) -> torch.Tensor:
    """The prefill path: each stack decoded whole into the backend's one scratch buffer in x's dtype right
    before its grouped product; the down stack overwrites the gate_up stack only after the gate_up product
    (both queued on one stream) has read it. Four launches and a few small sorts, no host sync."""
    grouped = triton_moe()
    schedule = grouped.Schedule.build(ids, gate_up_exps.shape[0])
    act = grouped.gate_up_geglu(x, ops.dequantize_experts(gate_up_exps, x.dtype), ids.shape[1], schedule)
    return grouped.down_weighted_sum(act, ops.dequantize_experts(down_exps, x.dtype), weights, schedule)


@functools.cache
def _warn_grouped_memory() -> None:
    warnings.warn("the grouped MoE prefill product did not fit in GPU memory: prefill runs expert by expert "
                  "(slower); a smaller -ub/--ubatch-size or context leaves it room", stacklevel=3)


def _moe_grouped_swiglu(ops: Any, x, gate_exps, up_exps, down_exps, weights, ids) -> torch.Tensor:
    """`_moe_grouped` for SwiGLU experts: the gate and up stacks decoded side by side in the scratch buffer (a
    Laguna-XS.2 or Qwen3.5-35B-A3B layer's: 1 GiB in bf16), the down stack over them after their product."""
    grouped = triton_moe()
    schedule = grouped.Schedule.build(ids, gate_exps.shape[0])
    gate, up = ops.dequantize_expert_stacks([gate_exps, up_exps], x.dtype)
    act = grouped.gate_up_swiglu(x, gate, up, ids.shape[1], schedule)
    return grouped.down_weighted_sum(act, ops.dequantize_experts(down_exps, x.dtype), weights, schedule)
