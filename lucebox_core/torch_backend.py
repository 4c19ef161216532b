"""The pure-torch reference backend: every op a model family needs, written for clarity, on any torch device.

This file is the op contract. A fast backend (CUDA, HIP) implements the same methods with the same
signatures and is tested against these on random inputs; model code is written once against them.

Conventions shared by every op:

- Sequence tensors are batch-first and token-major: `[B, T, H, D]` (batch, tokens, heads, head dim), as in
  flash-attention and flash-linear-attention. Models that serve one sequence pass `B = 1`.
- Activations are in the backend's compute `dtype`; each op computes in fp32 internally where precision
  matters (norms, softmax, RoPE angles, Gated DeltaNet) and returns the input's dtype.
- Recurrent Gated DeltaNet state is always fp32, `[B, H_v, D_k, D_v]`.
- Ops are functional: they return new state instead of mutating what they are given, so a caller can keep
  the old state for speculative rollback. The exceptions end in `_` and update a state in place: the
  fused one-token ops of the decode step, which a CUDA graph replays over fixed buffers.
- Weights are either torch tensors or `lucebox_core.quants.QuantTensor`s (raw GGUF blocks, dequantized on
  the fly), in torch order: `[out_features, in_features]` for matrices.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

Weight = Any  # torch.Tensor or lucebox_core.quants.QuantTensor

# Uncached matrices bigger than this are dequantized a block of rows at a time, so a 1 GB output head never
# needs a second 1 GB transient buffer.
STREAM_BLOCK_BYTES = 64 * 1024 * 1024


def concat_rows(weights: list[Weight], device: torch.device | str | None = None) -> Weight | None:
    """The rows of `weights` stacked into one weight, on `device` (default: where the first is), or None
    when they cannot share one: GGUF weights of different types or row lengths, dense ones of different
    dtypes, or a mix. GGUF rows are whole blocks, so stacking raw bytes stacks rows."""
    from .quants import QuantTensor

    first = weights[0]
    if len(weights) < 2 or any(len(w.shape) != 2 or w.shape[1] != first.shape[1] for w in weights):
        return None
    device = torch.device(device) if device is not None else first.data.device if isinstance(
        first, QuantTensor) else first.device
    if all(isinstance(w, QuantTensor) and w.ggml_type == first.ggml_type for w in weights):
        data = torch.empty(sum(w.nbytes for w in weights), dtype=torch.uint8, device=device)
        offset = 0
        for w in weights:  # straight from each source (a file map) into the one buffer: no host copy
            data[offset : offset + w.nbytes].copy_(w.data)
            offset += w.nbytes
        rows = sum(w.shape[0] for w in weights)
        return QuantTensor("+".join(w.name for w in weights), first.ggml_type, (rows, first.shape[1]), data)
    if all(isinstance(w, torch.Tensor) and w.dtype == first.dtype for w in weights):
        return torch.cat([w.to(device) for w in weights])
    return None


def _default_cache_budget(device: torch.device) -> int:
    """Half of the memory the device has: leaves room for activations, KV and everything else."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 4 * 1024**3


class TorchBackend:
    """Reference ops in plain torch. Slow but obviously right: the oracle every kernel is tested against.

    `weight_cache_bytes` bounds how much dequantized weight data is kept between calls. Weights are cached
    first come, first kept, with no eviction: a forward pass touches every weight in the same order each
    time, and LRU eviction under that cyclic pattern would miss on every access, whereas keeping a fixed
    subset keeps a fixed hit ratio. `None` means half of the device's memory.
    """

    name = "torch"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_cache_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_cache_bytes = (
            _default_cache_budget(self.device) if weight_cache_bytes is None else int(weight_cache_bytes)
        )
        self._weight_cache: dict[int, tuple[Weight, torch.Tensor]] = {}  # id(weight) -> (weight, dense)
        self._cached_bytes = 0

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r}, dtype={self.dtype})"

    # -- weights ---------------------------------------------------------------------------------------

    @property
    def cached_weight_bytes(self) -> int:
        """Bytes of dequantized weights held by the cache now."""
        return self._cached_bytes

    def clear_weight_cache(self) -> None:
        self._weight_cache.clear()
        self._cached_bytes = 0

    def _cached(self, weight: Weight) -> torch.Tensor | None:
        entry = self._weight_cache.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def _dequantize(self, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight.to(device=self.device, dtype=self.dtype)
        return weight.dequantize(self.dtype, self.device)

    def _dense_size(self, weight: Weight) -> int:
        return math.prod(weight.shape) * torch.finfo(self.dtype).bits // 8

    def dense(self, weight: Weight) -> torch.Tensor:
        """`weight` as a plain tensor in the compute dtype on the device, kept if the cache budget allows.

        A torch tensor already in the right dtype and device is returned as is and costs no budget.
        """
        if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.device == self.device:
            return weight
        cached = self._cached(weight)
        if cached is not None:
            return cached
        tensor = self._dequantize(weight)
        size = tensor.numel() * tensor.element_size()
        if self._cached_bytes + size <= self.weight_cache_bytes:
            # The entry holds `weight` itself so that its id cannot be reused by another object.
            self._weight_cache[id(weight)] = (weight, tensor)
            self._cached_bytes += size
        return tensor

    def _fits_cache(self, weight: Weight) -> bool:
        if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.device == self.device:
            return True
        return self._cached(weight) is not None or self._cached_bytes + self._dense_size(weight) <= self.weight_cache_bytes

    def _rows(self, weight: Weight, start: int, stop: int) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight[start:stop].to(device=self.device, dtype=self.dtype)
        return weight.dequantize_rows(start, stop, self.dtype, self.device)

    # -- matmul and embedding --------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """`x @ weight.T`: x `[..., in]`, weight `[out, in]` -> `[..., out]` (no bias: no target model has one)."""
        if self._fits_cache(weight):
            return F.linear(x, self.dense(weight))
        # Too big for what is left of the budget: stream it through in row blocks.
        out_features, in_features = weight.shape
        rows_per_block = max(1, STREAM_BLOCK_BYTES // (in_features * torch.finfo(self.dtype).bits // 8))
        parts = [
            F.linear(x, self._rows(weight, start, min(start + rows_per_block, out_features)))
            for start in range(0, out_features, rows_per_block)
        ]
        return torch.cat(parts, dim=-1)

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        """Rows `ids` of `weight` `[vocab, dim]` -> `[*ids.shape, dim]`; dequantizes only the rows needed
        unless the whole table is cached already (a tied output head caches it)."""
        ids = ids.to(self.device)
        cached = self.dense(weight) if isinstance(weight, torch.Tensor) else self._cached(weight)
        if cached is not None:
            return F.embedding(ids, cached)
        return weight.lookup_rows(ids, self.dtype)

    # -- pointwise -------------------------------------------------------------------------------------

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    # -- fused ops of the decode step ------------------------------------------------------------------
    # Compositions of the ops above, named so that a fast backend can run each as one kernel (a decode
    # step of a 64-layer model is otherwise thousands of tiny launches). The definitions here fix the
    # roundings: every intermediate the composition rounds to the activation dtype is rounded there.

    def fuse_rows(self, weights: list[Weight]) -> Weight | None:
        """One weight holding the rows of `weights` in order (so several products of the same input are
        one launch), or None where this backend gains nothing from it. The reference keeps them apart:
        its dense products are already one call each, and the results stay bit-identical."""
        return None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual update and the next norm: `(rms_norm(residual + x), residual + x)`."""
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's middle: `silu(gate) * up`."""
        return self.silu(gate) * up

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """An output gate: `x * sigmoid(gate)`."""
        return x * self.sigmoid(gate)

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gated DeltaNet's output norm, norm before gate: `rms_norm(x) * silu(z)` over the last dim."""
        return self.rms_norm(x, weight, eps) * self.silu(z)

    def qk_norm_rope(
        self, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
        positions: torch.Tensor, rot_dim: int, theta: float, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm then NeoX RoPE of queries `[B, T, Hq, D]` and keys `[B, T, Hkv, D]`."""
        query = self.rope_neox(self.rms_norm(query, q_norm, eps), positions, rot_dim, theta)
        key = self.rope_neox(self.rms_norm(key, k_norm, eps), positions, rot_dim, theta)
        return query, key

    def conv_silu_update_(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One token of the causal convolution, then SiLU: x `[B, C]` -> `[B, C]`; `state` `[B, K-1, C]`
        is shifted in place."""
        y, new_state = self.causal_conv1d_step(x, weight, state)
        state.copy_(new_state)
        return self.silu(y)

    def gated_delta_decode_(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
        dt_bias: torch.Tensor, state: torch.Tensor, num_k_heads: int, head_k_dim: int,
    ) -> torch.Tensor:
        """One Gated DeltaNet token from the convolved channels to the core output, the state updated in
        place. `mixed` `[B, C]` (after SiLU: q, k, v channels), `a`, `b` `[B, H_v]` (the decay and write
        projections), `ssm_a` (= -exp(A_log)) and `dt_bias` `[H_v]` fp32, `state` `[B, H_v, D_k, D_v]`
        fp32. Returns o `[B, 1, H_v, D_v]`: q and k L2-normalised, `beta = sigmoid(b)`,
        `g = ssm_a * softplus(a + dt_bias)`, then `gated_delta_rule_recurrent`."""
        batch = mixed.shape[0]
        key_dim = num_k_heads * head_k_dim
        value_heads = state.shape[1]
        query, key, value = mixed[:, None].split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        query = self.l2norm(query.reshape(batch, 1, num_k_heads, head_k_dim))
        key = self.l2norm(key.reshape(batch, 1, num_k_heads, head_k_dim))
        value = value.reshape(batch, 1, value_heads, -1)
        beta = self.sigmoid(b)[:, None]
        g = (ssm_a * self.softplus(a.float() + dt_bias))[:, None]
        out, new_state = self.gated_delta_rule_recurrent(query, key, value, g, beta, state)
        state.copy_(new_state)
        return out

    def gated_delta_tree(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
        state: torch.Tensor, parents: torch.Tensor, num_k_heads: int, head_k_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gated_delta_decode_` for the nodes of a candidate tree, each from its parent's state:
        mixed `[1, N, C]` (after SiLU), a, b `[1, N, H_v]`, state `[1, H_v, D_k, D_v]` fp32 (not modified),
        parents `[N]` -> (o `[1, N, H_v, D_v]`, the fp32 state after every node `[N, H_v, D_k, D_v]`)."""
        nodes = mixed.shape[1]
        key_dim = num_k_heads * head_k_dim
        value_heads = state.shape[1]
        query, key, value = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        query = self.l2norm(query.reshape(1, nodes, num_k_heads, head_k_dim))
        key = self.l2norm(key.reshape(1, nodes, num_k_heads, head_k_dim))
        value = value.reshape(1, nodes, value_heads, -1)
        beta = self.sigmoid(b)
        g = ssm_a * self.softplus(a.float() + dt_bias)
        return self.gated_delta_rule_tree(query, key, value, g, beta, state, parents)

    # -- normalisation ---------------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, computed in fp32.

        GGUF stores Qwen3.5's zero-centred norm weights with the 1 already added, so one op serves both.
        """
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype)

    def l2norm(self, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """`x / sqrt(sum(x^2) + eps)` over the last dim, in fp32 (eps inside the root, as fla does)."""
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)

    # -- positions -------------------------------------------------------------------------------------

    def rope_neox(self, x: torch.Tensor, positions: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
        """Rotary embedding, NeoX style, on the first `rot_dim` dims of each head; the rest pass through.

        x `[B, T, H, D]`, positions `[T]` or `[B, T]` (integers). Dim `i < rot_dim/2` is paired with
        `i + rot_dim/2` and rotated by `position * theta^(-2i/rot_dim)`.
        """
        half = rot_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / rot_dim))
        angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq  # [(B,) T, half]
        if angles.dim() == 2:
            angles = angles[None]
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]  # broadcast over heads
        x32 = x.float()
        first, second, rest = x32[..., :half], x32[..., half:rot_dim], x32[..., rot_dim:]
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
        return rotated.to(x.dtype)

    # -- attention -------------------------------------------------------------------------------------

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal_offset: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax attention with grouped-query heads.

        q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` -> `[B, Tq, Hq, Dv]`. Query head `h`
        reads KV head `h // (Hq / Hkv)` (consecutive groups, as in transformers and ggml).
        `causal_offset=p`: query `i` sits at cache position `p + i` and sees keys `j <= p + i`.
        `mask`: bool `[Tq, Tk]` or `[B, Tq, Tk]`, True where a query may see a key (tree verification).
        Both may be given (they are combined); with neither, every query sees every key. Every query must
        see at least one key.
        """
        batch, q_len, q_heads, _ = q.shape
        k_len, kv_heads = k.shape[1], k.shape[2]
        group = q_heads // kv_heads
        # [B, Hkv, group, Tq, D] against [B, Hkv, 1, Tk, D]: GQA without materialising repeated K and V.
        qh = q.float().transpose(1, 2).reshape(batch, kv_heads, group, q_len, -1)
        kh = k.float().transpose(1, 2)[:, :, None]
        vh = v.float().transpose(1, 2)[:, :, None]
        scores = (qh @ kh.transpose(-1, -2)) * scale  # [B, Hkv, group, Tq, Tk]
        visible = None
        if causal_offset is not None:
            query_pos = torch.arange(q_len, device=q.device)[:, None] + causal_offset
            visible = torch.arange(k_len, device=q.device)[None, :] <= query_pos
        if mask is not None:
            mask = mask.to(device=q.device, dtype=torch.bool)
            visible = mask if visible is None else visible & mask
        if visible is not None:
            if visible.dim() == 3:  # [B, Tq, Tk] -> [B, 1, 1, Tq, Tk]
                visible = visible[:, None, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vh  # [B, Hkv, group, Tq, Dv]
        out = out.reshape(batch, q_heads, q_len, -1).transpose(1, 2)
        return out.to(q.dtype)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """One query token against a fixed-size window of a KV buffer, masked on the device (the static
        decode step that a CUDA graph replays: no host value decides a shape or a mask).

        q `[1, 1, Hq, D]`; k `[N, Hkv, D]`, v `[N, Hkv, Dv]`, the first N rows of the cache (rows past
        `position` may hold anything), each either values or a Q8_0 cache's raw rows (uint8, `D / 32 * 34`
        bytes a head, decoded here; a kernel reads them as stored); `position` `[1]` long, on the device: the query's position, which
        sees keys `0 .. position`. Equals `attention(q, k[None], v[None], scale=scale, causal_offset=p)`.
        The products run in q's dtype, so the window is read once rather than upcast; softmax in fp32.
        """
        from .kv import dequantize_q8_0

        # A Q8_0 cache's raw rows (uint8 `[N, Hkv, D / 32 * 34]`) are decoded to q's dtype first.
        k, v = (dequantize_q8_0(t, q.dtype) if t.dtype == torch.uint8 else t for t in (k, v))
        rows, kv_heads, head_dim = k.shape
        q_heads = q.shape[2]
        # The query heads that share a KV head are the rows of one small matrix product against it.
        queries = q.reshape(kv_heads, q_heads // kv_heads, head_dim)
        keys = k.to(q.dtype).permute(1, 2, 0)  # [Hkv, D, N], a strided view: no copy
        values = v.to(q.dtype).permute(1, 0, 2)  # [Hkv, N, Dv]
        scores = torch.bmm(queries, keys).float() * scale  # [Hkv, group, N]
        unseen = torch.arange(rows, device=k.device) > position.reshape(1)
        probs = torch.softmax(scores.masked_fill(unseen, float("-inf")), dim=-1)
        out = torch.bmm(probs.to(q.dtype), values)  # [Hkv, group, Dv]
        return out.reshape(1, 1, q_heads, -1)

    def tree_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        position: torch.Tensor,
        visible: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """The nodes of a candidate tree against a fixed-size window of a KV buffer (static verification):
        `decode_attention` for N queries.

        q `[1, N, Hq, D]`; k `[W, Hkv, D]`, v `[W, Hkv, Dv]`, the first W rows of the cache, where rows
        `0 .. position-1` hold the committed prefix and rows `position + i` node i's K/V (insertion order);
        `position` `[1]` long on the device; `visible` bool `[N, N]`, True where node n may see node i
        (its ancestors and itself). Node n sees every committed row and the node rows `visible[n]` allows;
        rows from `position + N` on are never seen. Products in q's dtype, softmax in fp32. k and v may be
        a Q8_0 cache's raw rows, as for `decode_attention`.
        """
        from .kv import dequantize_q8_0

        k, v = (dequantize_q8_0(t, q.dtype) if t.dtype == torch.uint8 else t for t in (k, v))
        rows, kv_heads, head_dim = k.shape
        _, nodes, q_heads, _ = q.shape
        group = q_heads // kv_heads
        queries = q[0].reshape(nodes, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, nodes * group, head_dim)
        keys = k.to(q.dtype).permute(1, 2, 0)  # [Hkv, D, W]
        values = v.to(q.dtype).permute(1, 0, 2)  # [Hkv, W, Dv]
        scores = torch.bmm(queries, keys).float() * scale  # [Hkv, N * group, W]
        row = torch.arange(rows, device=k.device)
        start = position.reshape(1)
        node_of_row = row - start  # >= 0 on node rows
        in_tree = (node_of_row >= 0) & (node_of_row < nodes)
        tree_visible = visible.to(k.device)[:, node_of_row.clamp(0, nodes - 1)] & in_tree  # [N, W]
        seen = (row < start)[None, :] | tree_visible  # [N, W]
        seen = seen[:, None, :].expand(nodes, group, rows).reshape(nodes * group, rows)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out = torch.bmm(probs.to(q.dtype), values)  # [Hkv, N * group, Dv]
        return out.reshape(kv_heads, nodes, group, -1).permute(1, 0, 2, 3).reshape(1, nodes, q_heads, -1)

    # -- short convolution -----------------------------------------------------------------------------

    def causal_conv1d(
        self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal convolution over tokens, continuing from `state`. No bias, no activation.

        x `[B, T, C]`, weight `[C, K]`, state `[B, K-1, C]` (the previous K-1 inputs, zeros at the start).
        Returns y `[B, T, C]` with `y[t] = sum_j weight[:, j] * window[t + j]` over the window
        `cat(state, x)`, so `weight[:, K-1]` multiplies the current token; and the new state, the last
        K-1 inputs of that window.
        """
        kernel = weight.shape[1]
        window = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        tokens = x.shape[1]
        w = weight.to(x.dtype)
        y = sum(window[:, j : j + tokens] * w[:, j] for j in range(kernel))
        return y, window[:, tokens:]

    def causal_conv1d_step(
        self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One-token `causal_conv1d` (the decode kernel): x `[B, C]` -> y `[B, C]`, new state `[B, K-1, C]`."""
        window = torch.cat([state.to(x.dtype), x[:, None]], dim=1)  # [B, K, C]
        y = (window * weight.to(x.dtype).t()).sum(dim=1)
        return y, window[:, 1:]

    def causal_conv1d_tree(
        self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_conv1d_step` for the nodes of a candidate tree: x `[1, N, C]`, weight `[C, K]`, state
        `[1, K-1, C]` (the committed inputs), parents `[N]` long (-1 for the root) -> (y `[1, N, C]`, each
        node's conv state `[N, K-1, C]`). Node i's window, oldest first, is the last K rows of the
        committed inputs followed by the inputs along the path root -> i; its state is the window's last
        K-1 rows. The windows are found on the device (no host read of `parents`)."""
        nodes, kernel = x.shape[1], weight.shape[1]
        history = torch.cat([state[0].to(x.dtype), x[0]], dim=0)  # rows 0..K-2 committed, K-1+i node i
        node = torch.arange(nodes, device=x.device)
        state_row = torch.full_like(node, kernel - 2)
        newest_first = []
        for _ in range(kernel):  # walk up the ancestry; past the root, down the committed rows
            in_tree = node >= 0
            newest_first.append(torch.where(in_tree, kernel - 1 + node, state_row))
            state_row = torch.where(in_tree, state_row, state_row - 1)
            node = torch.where(in_tree, parents.to(node.device)[node.clamp(min=0)], node)
        windows = history[torch.stack(newest_first[::-1], dim=1)]  # [N, K, C]
        y = (windows * weight.to(x.dtype).t()).sum(dim=1)  # as causal_conv1d_step
        return y[None], windows[:, 1:]

    def conv_silu_tree(
        self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_conv1d_tree`, then SiLU on y: the tree form of `conv_silu_update_` (a backend fuses the
        two as it fuses the decode step's, with the same arithmetic)."""
        y, node_states = self.causal_conv1d_tree(x, weight, state, parents)
        return self.silu(y), node_states

    # -- Gated DeltaNet --------------------------------------------------------------------------------

    @staticmethod
    def _gdn_inputs(q, k, v, g, beta, state, scale):
        """Shared preparation: broadcast key heads, move heads before tokens, fp32, scale q."""
        batch, _, key_heads, key_dim = k.shape
        value_heads, value_dim = v.shape[-2:]
        if value_heads % key_heads:
            raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
        if value_heads != key_heads:
            # Tiled: value head h reads key head h % H_k (the GGUF order; see the module docstring).
            repeats = value_heads // key_heads
            q, k = q.repeat(1, 1, repeats, 1), k.repeat(1, 1, repeats, 1)
        scale = key_dim**-0.5 if scale is None else scale
        q = q.transpose(1, 2).float() * scale
        k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
        g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
        if state is None:
            state = torch.zeros(batch, value_heads, key_dim, value_dim, device=v.device, dtype=torch.float32)
        return q, k, v, g, beta, state.float()

    def gated_delta_rule_recurrent(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule one token at a time (decode; the definition the chunked form must match).

        q, k `[B, T, H_k, D_k]` (already L2-normalised), v `[B, T, H_v, D_v]`, g (log decay, <= 0) and
        beta `[B, T, H_v]`, state `[B, H_v, D_k, D_v]` fp32 or None for zeros. When H_v > H_k, value head
        `h` uses key head `h % H_k` (tiled, the order a GGUF stores after llama.cpp's converter reorders V
        heads). q is multiplied by `scale` (default `D_k**-0.5`). Per value head and token:

            S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q

        Returns o `[B, T, H_v, D_v]` in v's dtype and the new fp32 state.
        """
        input_dtype = v.dtype
        q, k, v, g, beta, state = self._gdn_inputs(q, k, v, g, beta, state, scale)
        outputs = []
        for t in range(q.shape[2]):
            state = state * g[:, :, t, None, None].exp()
            predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
            update = (v[:, :, t] - predicted) * beta[:, :, t, None]
            state = state + k[:, :, t, :, None] * update[:, :, None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
        out = torch.stack(outputs, dim=1) if outputs else v.transpose(1, 2).clone()
        return out.to(input_dtype), state

    def gated_delta_rule_tree(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        parents: torch.Tensor,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over the nodes of a candidate tree, each node one step from its parent's
        state (speculative verification): the recurrent form with the nodes as tokens, except that node
        `i` starts from the state after node `parents[i]`, the root (parent -1) from `state`.

        q, k `[1, N, H_k, D_k]`, v `[1, N, H_v, D_v]`, g, beta `[1, N, H_v]`, state `[1, H_v, D_k, D_v]`
        fp32 (not modified), parents `[N]` long with `parents[i] < i`. Returns o `[1, N, H_v, D_v]` and
        the fp32 state after every node, `[N, H_v, D_k, D_v]`, so a committed path can keep its last one.
        """
        input_dtype = v.dtype
        q, k, v, g, beta, root_state = self._gdn_inputs(q, k, v, g, beta, state, scale)
        nodes = q.shape[2]
        node_states = torch.empty(nodes, *root_state.shape[1:], device=v.device, dtype=torch.float32)
        outputs = []
        for i, parent in enumerate(parents.tolist()):
            s = (root_state[0] if parent < 0 else node_states[parent]) * g[0, :, i, None, None].exp()
            predicted = torch.einsum("hk,hkv->hv", k[0, :, i], s)
            update = (v[0, :, i] - predicted) * beta[0, :, i, None]
            s = s + k[0, :, i, :, None] * update[:, None, :]
            node_states[i] = s
            outputs.append(torch.einsum("hk,hkv->hv", q[0, :, i], s))
        out = torch.stack(outputs, dim=0)[None] if outputs else v.transpose(1, 2).clone()
        return out.to(input_dtype), node_states

    def gated_delta_rule_chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        chunk_size: int = 64,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over chunks of tokens (prefill): same inputs and results as the recurrent form.

        Within a chunk starting from state S0, let G_t be the cumulative log decay from the chunk start to
        token t and D_ts = exp(G_t - G_s) for s <= t. Unrolling the recurrence gives, for the updates u,
        a unit lower-triangular system (I + A) U = beta*V - beta*exp(G)*K S0 with
        A_ts = beta_t D_ts (k_t . k_s) for s < t, solved once per chunk for both right-hand sides; then
        outputs O = (exp(G)*Q) S0 + ((Q K^T) * D) U and the next state exp(G_last) S0 + (exp(G_last - G) K)^T U.
        Only the short scan over chunks is sequential.
        """
        input_dtype = v.dtype
        q, k, v, g, beta, state = self._gdn_inputs(q, k, v, g, beta, state, scale)
        batch, heads, tokens, _ = k.shape
        value_dim = v.shape[-1]
        # Pad to whole chunks with tokens that change nothing: beta = 0 writes nothing, g = 0 decays nothing.
        pad = (-tokens) % chunk_size
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
        chunks = (tokens + pad) // chunk_size
        q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
        g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))

        log_decay = g.cumsum(-1)  # G_t, [B, H, N, C]
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
        pair_log_decay = log_decay[..., :, None] - log_decay[..., None, :]
        # Mask before exp: above the diagonal G_t - G_s > 0 could overflow.
        pair_decay = pair_log_decay.masked_fill(~causal, float("-inf")).exp()  # D, [B, H, N, C, C]

        key_affinity = (k @ k.transpose(-1, -2)) * pair_decay * beta[..., :, None]
        system = key_affinity.tril(-1) + torch.eye(chunk_size, device=q.device)
        updates_from_values = torch.linalg.solve_triangular(
            system, v * beta[..., None], upper=False, unitriangular=True
        )
        updates_per_state = torch.linalg.solve_triangular(
            system, k * (beta * log_decay.exp())[..., None], upper=False, unitriangular=True
        )
        intra_attention = (q @ k.transpose(-1, -2)) * pair_decay
        decayed_q = q * log_decay.exp()[..., None]
        chunk_log_decay = log_decay[..., -1]  # [B, H, N]
        keys_to_end = k * (chunk_log_decay[..., None] - log_decay).exp()[..., None]

        outputs = torch.empty(batch, heads, chunks, chunk_size, value_dim, device=q.device, dtype=torch.float32)
        for n in range(chunks):
            updates = updates_from_values[:, :, n] - updates_per_state[:, :, n] @ state
            outputs[:, :, n] = decayed_q[:, :, n] @ state + intra_attention[:, :, n] @ updates
            state = state * chunk_log_decay[:, :, n, None, None].exp() + keys_to_end[:, :, n].transpose(-1, -2) @ updates

        out = outputs.reshape(batch, heads, chunks * chunk_size, value_dim)[:, :, :tokens]
        return out.transpose(1, 2).to(input_dtype), state
