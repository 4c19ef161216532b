"""Qwen3.5 / Qwen3.6 (GGUF architectures `qwen35` and `qwen35moe`): the forward pass, written against backend ops.

A stack of decoder layers, three Gated DeltaNet layers then one gated full-attention layer, repeated:

    h = embed_tokens(ids)
    for each decoder layer:   h += mixer(input_layernorm(h));  h += mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

where the mixer is `GatedDeltaNet` (linear attention with a decaying, delta-rule-updated fp32 state per
value head, after a short causal convolution) or `GatedAttention` (softmax attention with q/k RMSNorm,
partial NeoX RoPE and a sigmoid output gate), and the mlp a SwiGLU `MLP` (dense) or the MoE block of
`moe.py` (qwen35moe: routed experts and a gated shared expert). Names follow transformers' `modeling_qwen3_5.py`; the
GGUF names are in `GGUF_NAMES`. The mixer's own maths (the gated delta rule, the short convolution) are the
family's named ops in `ops.py`, which a backend may run as kernels; `self.ops` is the backend with them
bound. The target side of speculative decoding (the drafter's feature capture, tree verification, commit)
is `verify.SpeculativeTarget`, which `Qwen35Model` inherits.

What llama.cpp's converter baked into the GGUF, and what that means here:
- zero-centred RMSNorm weights are stored with the 1 added: every norm is a plain `x_normed * w`;
- `ssm_a` holds `-exp(A_log)`, so the decay is `g = ssm_a * softplus(a + dt_bias)`;
- when there are more value heads than key heads, V heads are reordered from grouped to tiled (value head
  `h` reads key head `h % num_k_heads`) consistently in every tensor, which is exactly the mapping of the
  family's gated-delta-rule ops (`ops.py`), so the GGUF tensors are used as they are;
- `attn_q` keeps transformers' per-head interleave `[q_h | gate_h]`.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any, ClassVar

import attrs
import torch

from lucebox_core.decoder_model import DecoderModel, mlp_after_residual
from lucebox_core.device_map import SplitKVCache, hand_over
from lucebox_core.kv import KVCache, KVLayerShape, attention_position, observe_query, write_rows
from lucebox_core.split_step import run_split_decode_step
from lucebox_core.static_step import StaticInputs, StaticStep, run_decode_step

from . import prefill
from .layout import Qwen35Config
from .memory import MemoryEstimate, estimate_memory, tensor_bytes, weights_of
from .verify import GDN_REPLAY_SWITCH, ReplayedRecurrence, SpeculativeTarget

ARCHITECTURE = "qwen35"
# `<|MASK|>`-like slot of the Qwen3.5/3.6 vocabulary that z-lab's DFlash drafters were trained with.
QWEN35_MASK_TOKEN_ID = 248070

# transformers name -> GGUF tensor name; `{i}` is the layer index.
GGUF_NAMES: dict[str, str] = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",  # absent when tied to embed_tokens
    "layers.{i}.input_layernorm": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj": "blk.{i}.ffn_down.weight",
    # gated full attention
    "layers.{i}.self_attn.q_proj": "blk.{i}.attn_q.weight",  # per head: [query | output gate]
    "layers.{i}.self_attn.k_proj": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm.weight",
    # Gated DeltaNet
    "layers.{i}.linear_attn.in_proj_qkv": "blk.{i}.attn_qkv.weight",
    "layers.{i}.linear_attn.in_proj_z": "blk.{i}.attn_gate.weight",
    "layers.{i}.linear_attn.in_proj_b": "blk.{i}.ssm_beta.weight",
    "layers.{i}.linear_attn.in_proj_a": "blk.{i}.ssm_alpha.weight",
    "layers.{i}.linear_attn.conv1d": "blk.{i}.ssm_conv1d.weight",
    "layers.{i}.linear_attn.A_log": "blk.{i}.ssm_a",  # stored as -exp(A_log)
    "layers.{i}.linear_attn.dt_bias": "blk.{i}.ssm_dt.bias",
    "layers.{i}.linear_attn.norm": "blk.{i}.ssm_norm.weight",
    "layers.{i}.linear_attn.out_proj": "blk.{i}.ssm_out.weight",
}

Weight = Any  # a QuantTensor (weights stay in their GGUF type) or a torch tensor


# -- mixers -------------------------------------------------------------------------------------------------


@attrs.define
class GatedDeltaNetState:
    """What one Gated DeltaNet layer carries between calls for one sequence. Both tensors are updated in
    place (a recorded decode step holds their addresses): copy them to keep an old state."""

    conv: torch.Tensor  # [1, conv_kernel - 1, conv_dim]: the last inputs of the short convolution
    recurrent: torch.Tensor  # [1, num_v_heads, head_k_dim, head_v_dim], fp32


@attrs.define
class GatedDeltaNet:
    """Linear attention with the gated delta rule (transformers' `Qwen3_5GatedDeltaNet`)."""

    ops: Any
    in_proj_qkv: Weight  # [2 * key_dim + value_dim, hidden]: q, k, v channels, convolved together
    in_proj_z: Weight  # [value_dim, hidden]: the output gate
    in_proj_b: Weight  # [num_v_heads, hidden]: beta, the write strength
    in_proj_a: Weight  # [num_v_heads, hidden]: the decay input
    conv1d: torch.Tensor  # [conv_dim, conv_kernel]
    ssm_a: torch.Tensor  # [num_v_heads] fp32, = -exp(A_log)
    dt_bias: torch.Tensor  # [num_v_heads] fp32
    norm: torch.Tensor  # [head_v_dim]: plain RMSNorm weight of the gated output norm
    out_proj: Weight  # [hidden, value_dim]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    eps: float
    chunk_size: int = 64
    # The input projections fused by the backend (`ops.fuse_rows`), each one launch: rows [qkv | z] and
    # [b | a]. None where the backend keeps them apart (or their GGUF types differ).
    in_proj_qkvz: Weight | None = None
    in_proj_ba: Weight | None = None

    def new_state(self, device: torch.device, dtype: torch.dtype) -> GatedDeltaNetState:
        conv_dim, kernel = self.conv1d.shape
        return GatedDeltaNetState(
            conv=torch.zeros(1, kernel - 1, conv_dim, device=device, dtype=dtype),
            recurrent=torch.zeros(1, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=device),
        )

    def fuse_projections(self) -> None:
        """Let the backend merge the input projections that share an input into fewer, larger products."""
        self.in_proj_qkvz = self.ops.fuse_rows([self.in_proj_qkv, self.in_proj_z])
        self.in_proj_ba = self.ops.fuse_rows([self.in_proj_b, self.in_proj_a])

    def unused_weights(self) -> tuple[str, ...]:
        """Fields whose weights a fused one replaces (never read, so never on the device)."""
        return (("in_proj_qkv", "in_proj_z") if self.in_proj_qkvz is not None else ()) + (
            ("in_proj_b", "in_proj_a") if self.in_proj_ba is not None else ())

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections of `x` `[B, T, hidden]`: the conv channels (q, k, v), z, b and a."""
        ops = self.ops
        if self.in_proj_qkvz is not None:
            conv_dim = self.conv1d.shape[0]
            mixed_qkv, z = ops.linear(x, self.in_proj_qkvz).split([conv_dim, self.in_proj_z.shape[0]], dim=-1)
        else:
            mixed_qkv, z = ops.linear(x, self.in_proj_qkv), ops.linear(x, self.in_proj_z)
        if self.in_proj_ba is not None:
            b, a = ops.linear(x, self.in_proj_ba).split([self.num_v_heads, self.num_v_heads], dim=-1)
        else:
            b, a = ops.linear(x, self.in_proj_b), ops.linear(x, self.in_proj_a)
        return mixed_qkv, z, b, a

    def __call__(self, x: torch.Tensor, state: GatedDeltaNetState, count: torch.Tensor | None = None) -> torch.Tensor:
        """`count` (`[1]` on the device; a recorded prefill piece, `prefill.py`): only the first `count` tokens are
        real, the rest padding that must leave the states as the real tokens do."""
        ops = self.ops
        batch, tokens, _ = x.shape
        key_dim = self.num_k_heads * self.head_k_dim
        if tokens == 1 and count is None:  # decode: one op, which a backend may run as one launch
            return ops.gated_delta_net_decode_(x, self, state)
        mixed_qkv, z, b, a = self._project(x)
        z = z.reshape(batch, tokens, self.num_v_heads, self.head_v_dim)
        conv_out = ops.causal_conv1d_silu_(mixed_qkv, self.conv1d, state.conv)  # the conv state in place
        if count is not None:  # the kernel kept the last K-1 inputs, padding included: the last real ones instead
            kept = state.conv.shape[1]
            state.conv.copy_(mixed_qkv.index_select(1, count - kept + torch.arange(kept, device=count.device)))
        query, key, value = conv_out.split([key_dim, key_dim, conv_out.shape[-1] - 2 * key_dim], dim=-1)
        query = ops.l2norm(query.reshape(batch, tokens, self.num_k_heads, self.head_k_dim))
        key = ops.l2norm(key.reshape(batch, tokens, self.num_k_heads, self.head_k_dim))
        value = value.reshape(batch, tokens, self.num_v_heads, self.head_v_dim)
        # g: the log of the per-token decay of the state, <= 0, fp32; beta = sigmoid(b). One launch on CUDA.
        g, beta = ops.gdn_gates(a, b, self.ssm_a, self.dt_bias)
        if count is not None:  # a padding token neither decays the state (g = 0) nor writes to it (beta = 0)
            real = (torch.arange(tokens, device=count.device) < count)[None, :, None]
            g, beta = g * real, beta * real
        core = ops.gated_delta_rule_chunked_(  # the recurrent state in place
            query, key, value, g, beta, state.recurrent, chunk_size=self.chunk_size
        )
        # Gated RMSNorm, norm before gate: rmsnorm(core) * w * silu(z), per value head.
        core = ops.gated_rms_norm(core, z, self.norm, self.eps)
        return ops.linear(core.reshape(batch, tokens, -1), self.out_proj)

    def decode_token(self, x: torch.Tensor, state: GatedDeltaNetState) -> torch.Tensor:
        """One token `x` `[B, 1, hidden]` through the fused one-token ops, the states updated in place (the
        reference of `gated_delta_net_decode_`)."""
        ops = self.ops
        batch = x.shape[0]
        mixed_qkv, z, b, a = self._project(x)
        z = z.reshape(batch, 1, self.num_v_heads, self.head_v_dim)
        mixed = ops.conv_silu_update_(mixed_qkv[:, 0], self.conv1d, state.conv)
        core = ops.gated_delta_decode_(mixed, a[:, 0], b[:, 0], self.ssm_a, self.dt_bias, state.recurrent,
                                       self.num_k_heads, self.head_k_dim)
        core = ops.gated_rms_norm(core, z, self.norm, self.eps)
        return ops.linear(core.reshape(batch, 1, -1), self.out_proj)

    def verify_tree(
        self, x: torch.Tensor, state: GatedDeltaNetState, parents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | ReplayedRecurrence]:
        """Run the nodes of a candidate tree `x` `[1, N, hidden]`, each from its parent's state, leaving
        `state` untouched (`parents` `[N]`, `TreeIndex.parents` on the device, so the pass can be recorded
        as a CUDA graph). Returns the output `[1, N, hidden]` and, per node, the conv state `[N, K-1, C]`
        and the recurrent state `[N, H_v, D_k, D_v]` after that node; unless `LUCEBOX_GDN_REPLAY=0`, in place
        of the recurrent states, the steps' inputs, from which the commit replays its path.

        Node `i`'s convolution window is the inputs along its own ancestry (then the committed conv
        state), and its recurrent step starts from its parent's state (the root's from `state`): the
        per-node form of the one-token decode kernels, so a committed path equals plain decoding.
        """
        ops = self.ops
        _, nodes, _ = x.shape

        mixed_qkv, z, b, a = self._project(x)
        # [1, N, C]: the nodes as the tokens of one sequence, convolved along their own ancestry.
        conv_out, node_conv = ops.conv_silu_tree(mixed_qkv, self.conv1d, state.conv, parents)
        # Each node steps from its parent's state (the root from the committed one).
        if os.environ.get(GDN_REPLAY_SWITCH, "1") != "0":  # the commit replays its path: keep the steps' inputs
            core, _ = ops.gated_delta_tree_reloaded(conv_out, a, b, self.ssm_a, self.dt_bias, state.recurrent, parents,
                                                    self.num_k_heads, self.head_k_dim)
            node_state = ReplayedRecurrence(self, conv_out, a, b)
        else:
            core, node_state = ops.gated_delta_tree(conv_out, a, b, self.ssm_a, self.dt_bias, state.recurrent,
                                                    parents, self.num_k_heads, self.head_k_dim)
        core = ops.gated_rms_norm(core, z.reshape(1, nodes, self.num_v_heads, self.head_v_dim), self.norm, self.eps)
        return ops.linear(core.reshape(1, nodes, -1), self.out_proj), node_conv, node_state


@attrs.define
class GatedAttention:
    """Softmax attention with an output gate (transformers' `Qwen3_5Attention`)."""

    ops: Any
    layer_index: int
    q_proj: Weight  # [num_heads * 2 * head_dim, hidden], per head [query | gate]
    k_proj: Weight  # [num_kv_heads * head_dim, hidden]
    v_proj: Weight  # [num_kv_heads * head_dim, hidden]
    o_proj: Weight  # [hidden, num_heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int  # only the first rope_dim dims of each head rotate
    rope_theta: float
    eps: float

    # The projections fused by the backend (`ops.fuse_rows`): rows [q | k | v] or [q | k]; None: apart.
    in_proj: Weight | None = None
    in_proj_parts: int = 0

    def fuse_projections(self) -> None:
        """Let the backend merge q, k and v (or q and k, when v's GGUF type differs) into one product."""
        for parts in ((self.q_proj, self.k_proj, self.v_proj), (self.q_proj, self.k_proj)):
            fused = self.ops.fuse_rows(list(parts))
            if fused is not None:
                self.in_proj, self.in_proj_parts = fused, len(parts)
                return

    def unused_weights(self) -> tuple[str, ...]:
        return ("q_proj", "k_proj", "v_proj")[: self.in_proj_parts] if self.in_proj is not None else ()

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        ops = self.ops
        batch, tokens, _ = x.shape
        if self.in_proj is not None:
            sizes = [w.shape[0] for w in (self.q_proj, self.k_proj, self.v_proj)[: self.in_proj_parts]]
            projected = ops.linear(x, self.in_proj).split(sizes, dim=-1)
            query_and_gate, key = projected[0], projected[1]
            value = projected[2] if self.in_proj_parts == 3 else ops.linear(x, self.v_proj)
        else:
            query_and_gate, key, value = (ops.linear(x, w) for w in (self.q_proj, self.k_proj, self.v_proj))
        query_and_gate = query_and_gate.reshape(batch, tokens, self.num_heads, 2 * self.head_dim)
        query, gate = query_and_gate[..., : self.head_dim], query_and_gate[..., self.head_dim :]
        key = key.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        # Text-only mRoPE (equal t/h/w positions) is plain 1-D RoPE.
        query, key = ops.qk_norm_rope(query, key, self.q_norm, self.k_norm, positions, self.rope_dim,
                                      self.rope_theta, self.eps)
        return query, gate, key, value

    def _output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        batch, tokens = out.shape[:2]
        out = self.ops.sigmoid_mul(out, gate.reshape(out.shape))
        return self.ops.linear(out.reshape(batch, tokens, -1), self.o_proj)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, past: int) -> torch.Tensor:
        """`past`: positions the cache held before this forward call; query `i` sees keys `0 .. past + i`."""
        query, gate, key, value = self._project(x, positions)
        observe_query(kv, self.layer_index, query)
        all_keys, all_values = kv.append(self.layer_index, key[0], value[0])
        # The rows before this pass's own: `past` for a full cache, the resident ones for a bounded pool.
        out = self.ops.attention(
            query, all_keys[None].to(query.dtype), all_values[None].to(query.dtype),
            scale=self.head_dim**-0.5, causal_offset=all_keys.shape[0] - key.shape[1],
        )
        return self._output(out, gate)

    def decode_static(self, x: torch.Tensor, position: torch.Tensor, kv: KVCache, window: int) -> torch.Tensor:
        """One token `x` `[1, 1, hidden]` at the device position `position` `[1]`: its K/V written there,
        attention over the first `window` positions masked past it. No host value but `window`. One op, which a
        backend may run as one launch."""
        return self.ops.gated_attention_decode_(x, self, kv, position, window)

    def decode_unfused(self, x: torch.Tensor, position: torch.Tensor, kv: KVCache, window: int) -> torch.Tensor:
        """`decode_static` op by op (the reference of `gated_attention_decode_`)."""
        query, gate, key, value = self._project(x, position)
        observe_query(kv, self.layer_index, query)
        write_rows(kv, self.ops, self.layer_index, position, key[0], value[0])
        # As stored: a Q8_0 window goes to the attention op undecoded (its kernel decodes in registers).
        keys, values = kv.gather(self.layer_index, window)
        out = self.ops.decode_attention(query, keys, values, attention_position(kv, position),
                                        scale=self.head_dim**-0.5)
        return self._output(out, gate)

    def verify_tree(
        self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tree nodes `x` `[1, N, hidden]` attend to the whole cache plus the nodes `visible` `[N, N]` lets
        them see (their ancestors and themselves); the cache is not written. Returns the output and the
        nodes' K and V rows (as the cache will read them back), for `commit` to keep the accepted ones."""
        query, gate, key, value = self._project(x, positions)
        past_keys, past_values = kv.read(self.layer_index)
        # Through the cache's storage type and back: a quantized cache must give the nodes the K/V that
        # plain decoding would read, or the verified logits would differ from decoding the accepted path.
        key_rows, value_rows = kv.as_stored(key[0], value[0])
        all_keys = torch.cat([past_keys, key_rows])[None].to(query.dtype)
        all_values = torch.cat([past_values, value_rows])[None].to(query.dtype)
        mask = torch.cat([torch.ones(len(visible), past_keys.shape[0], dtype=torch.bool, device=visible.device),
                          visible], dim=1)
        out = self.ops.attention(query, all_keys, all_values, scale=self.head_dim**-0.5, mask=mask)
        return self._output(out, gate), key_rows, value_rows

    def verify_static(self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, kv: KVCache,
                      window: int, visible: torch.Tensor) -> torch.Tensor:
        """Tree nodes `x` `[1, N, hidden]` at device `positions` `[N]`: their K/V written at positions
        `start .. start + N - 1` (`start` `[1]`, the committed length; insertion order), attention over
        the first `window` positions with each node seeing the committed ones and its `visible` ancestors.
        No host value but `window` and N: what a CUDA graph records. `commit` moves the accepted rows."""
        query, gate, key, value = self._project(x, positions)
        write_rows(kv, self.ops, self.layer_index, start + torch.arange(x.shape[1], device=start.device), key[0],
                   value[0])
        # As stored, as the decode step reads them: a Q8_0 window is decoded by the attention op.
        keys, values = kv.gather(self.layer_index, window)
        out = self.ops.tree_attention(query, keys, values, attention_position(kv, start), visible,
                                      scale=self.head_dim**-0.5)
        return self._output(out, gate)


@attrs.define
class MLP:
    """SwiGLU: `down_proj(silu(gate_proj(x)) * up_proj(x))`."""

    swiglu: ClassVar[bool] = True  # `decoder_model.mlp_after_residual` may run it as one op with the add + norm

    ops: Any
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight
    gate_up_proj: Weight | None = None  # rows [gate | up], fused by the backend (`ops.fuse_rows`)

    def fuse_projections(self) -> None:
        self.gate_up_proj = self.ops.fuse_rows([self.gate_proj, self.up_proj])

    def unused_weights(self) -> tuple[str, ...]:
        return ("gate_proj", "up_proj") if self.gate_up_proj is not None else ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if self.gate_up_proj is not None:
            gate, up = ops.linear(x, self.gate_up_proj).split([self.gate_proj.shape[0], self.up_proj.shape[0]], -1)
        else:
            gate, up = ops.linear(x, self.gate_proj), ops.linear(x, self.up_proj)
        return ops.linear(ops.silu_mul(gate, up), self.down_proj)


@attrs.define
class DecoderLayer:
    index: int
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    mlp: Any  # `MLP` (dense), or `moe.SparseMoeBlock` (qwen35moe): called alike, `mlp(x)`
    linear_attn: GatedDeltaNet | None = None
    self_attn: GatedAttention | None = None

    @property
    def is_linear(self) -> bool:
        return self.linear_attn is not None


# -- per-sequence state ----------------------------------------------------------------------------------


@attrs.define
class Qwen35State:
    """Everything one sequence carries between forward calls.

    `kv` holds K/V of the full-attention layers; `linear` the conv and recurrent state of each Gated
    DeltaNet layer (overwritten by every call: snapshot it before a speculative pass). `captured` is
    filled with the hidden states of the layers a forward call was asked to capture.
    """

    kv: KVCache  # made by the model's KV policy
    linear: dict[int, GatedDeltaNetState]
    length: int = 0  # tokens seen
    captured: dict[int, torch.Tensor] = attrs.Factory(dict)
    # The drafter's feature ring (`Qwen35Model.enable_capture`): row `pos % capacity` holds the outputs
    # of `capture_layers`, concatenated, for committed position `pos`.
    capture_layers: tuple[int, ...] = ()
    features: torch.Tensor | None = None
    # The static decode step (its input buffers and recordings, one per KV window), made on the first
    # `decode_step`; the static verify pass's apart, so that a verify pass that cannot be recorded leaves
    # decoding graphed.
    decode: StaticStep | None = None
    verify: StaticStep | None = None
    prefill: StaticStep | None = None  # the recorded prefill pieces (`prefill.py`), one per (bucket, KV window)


# -- the model -------------------------------------------------------------------------------------------


class Qwen35Model(SpeculativeTarget, DecoderModel):
    reads_bounded_kv = True  # kvflash: causal offsets from `append`, static windows masked at `attention_position`

    def __init__(self, config: Qwen35Config, ops: Any, embed_tokens: Weight, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: Weight, *, device_map: Any = None, part_ops: list[Any] | None = None,
                 **options: Any) -> None:
        """`ops`: the backend with the family's ops bound (`QWEN35_OPS.bind(backend)`); `options` as
        `DecoderModel`'s (the KV policy whose caches the attention layers use, KV types, source).
        `device_map` (a `DeviceMap`) with `part_ops` (the bound ops of each part): the layers split into
        parts, each layer's weights, KV and recurrent state on its part's device; `ops` is the first part's
        (the embedding), `part_ops[-1]` the last's (the final norm, the head and the drafter's feature ring)."""
        super().__init__(config, ops, embed_tokens, layers, norm, lm_head, **options)
        self.vocab_size = int(embed_tokens.shape[0])
        self.device_map = device_map if device_map is not None and device_map.is_split else None
        self.part_ops = list(part_ops) if self.device_map is not None else [ops]
        self.head_ops = self.part_ops[-1]
        # Each part's layers, in order: a split model's static steps record a graph per part.
        self.part_layers = [[layer for layer in layers if self._layer_part(layer) == part]
                            for part in range(len(self.part_ops))]
        if self.device_map is not None:
            self.tied_embeddings = False  # the head holds its own copy on the last part's device
            # Static steps wherever a part records graphs (a CPU part among GPU ones runs its part eagerly).
            self.decode_graphs = any(part.graphs_enabled() for part in self.part_ops)
        self.failed_parts: set[int] = set()  # parts whose recording failed (they run eagerly): for /props
        # Prefill pieces of up to `static_step.MAX_RECORDED_PIECE` tokens as recorded steps (`prefill.py`) wherever
        # the decode step records graphs on one device.
        self.recorded_prefill = self.decode_graphs and self.device_map is None

    @property
    def split_steps(self) -> bool:
        """Whether the static decode step and verify pass run as one step per part (`split_step`)."""
        return self.device_map is not None

    def step_mode(self) -> str:
        """How a decode step runs, for /props and the log: "graph" (one recording), "graph per part" (a
        split model: a recording per part, handed over between replays; "..., eager on part 1 (cpu)" names
        parts without graphs or whose recording failed), "eager per part" or "eager"."""
        if not self.decode_graphs:
            return "eager" if self.device_map is None else "eager per part"
        if self.device_map is None:
            return "graph"
        eager = [f"part {part} ({self.device_map.devices[part]})" for part, ops in enumerate(self.part_ops)
                 if not ops.graphs_enabled() or part in self.failed_parts]
        return "graph per part" if not eager else f"graph per part, eager on {', '.join(eager)}"

    def _layer_part(self, layer: DecoderLayer) -> int:
        return 0 if self.device_map is None else self.device_map.layer_part(layer.index)

    def _layer_ops(self, layer: DecoderLayer) -> Any:
        return self.part_ops[self._layer_part(layer)]

    def _local(self, layer: DecoderLayer, tensor: torch.Tensor) -> torch.Tensor:
        """A small per-pass input (positions, a tree's parents or mask) on `layer`'s device."""
        if self.device_map is None:
            return tensor
        return tensor.to(self._layer_ops(layer).device, non_blocking=True)

    @property
    def feature_device(self) -> torch.device:
        """Where the drafter's feature ring lives: with the head, where the last captured layers are."""
        return torch.device(self.head_ops.device)

    def __repr__(self) -> str:
        linear = sum(layer.is_linear for layer in self.layers)
        return (
            f"Qwen35Model({self.source or 'in memory'}: {len(self.layers)} layers "
            f"({linear} Gated DeltaNet, {len(self.layers) - linear} attention), vocab {self.vocab_size})"
        )

    def new_state(self, max_tokens: int | None = None) -> Qwen35State:
        """A fresh sequence that can hold `max_tokens` positions (default: the model's context length)."""
        max_tokens = self.context_length if max_tokens is None else max_tokens
        dtype = self.ops.dtype
        return Qwen35State(
            kv=self._new_kv(max_tokens),
            linear={
                layer.index: layer.linear_attn.new_state(self._layer_ops(layer).device, dtype)
                for layer in self.layers
                if layer.linear_attn is not None
            },
        )

    def _new_kv(self, max_tokens: int) -> KVCache:
        shapes = self.kv_layer_shapes()
        make = lambda layers, device: self.kv_policy.create(  # noqa: E731
            layers, max_tokens, dtype=self.ops.dtype, device=device, k_type=self.cache_type_k,
            v_type=self.cache_type_v)
        if self.device_map is None:
            return make(shapes, self.ops.device)
        parts = {index: self.device_map.layer_part(index) for index in shapes}
        caches = {part: make({i: shapes[i] for i in shapes if parts[i] == part}, self.part_ops[part].device)
                  for part in sorted(set(parts.values()))}
        return SplitKVCache(caches, parts)

    def reset_state(self, state: Qwen35State) -> None:
        """Empty `state` for a new sequence, keeping its buffers and recordings (the engine reuses finished
        sequences' states, so a new request replays the decode and verify graphs recorded on them): no
        position is held, the Gated DeltaNet conv and recurrent states are zero, nothing is captured."""
        state.kv.rollback(0)
        for linear in state.linear.values():
            linear.conv.zero_()
            linear.recurrent.zero_()
        state.length = 0
        state.captured = {}
        if state.features is not None:
            state.features.zero_()

    def recurrent_state_tensors(self, state: Qwen35State) -> dict[str, torch.Tensor]:
        """The Gated DeltaNet layers' conv and recurrent state (the prefix cache snapshots them)."""
        tensors = {}
        for index, linear in state.linear.items():
            tensors[f"{index}.conv"], tensors[f"{index}.recurrent"] = linear.conv, linear.recurrent
        return tensors

    def kv_layer_shapes(self) -> dict[int, KVLayerShape]:
        return {
            layer.index: KVLayerShape(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.head_dim)
            for layer in self.layers
            if layer.self_attn is not None
        }

    def estimate_memory(self, ctx_size: int) -> MemoryEstimate:
        """Device memory of this model (its weights as loaded) and one sequence of `ctx_size` positions."""
        weights = [self.embed_tokens, self.norm, *([] if self.tied_embeddings else [self.lm_head])]
        for layer in self.layers:
            weights += list(weights_of(layer))
        return estimate_memory(
            self.config, ctx_size, weight_bytes=sum(tensor_bytes(w) for w in weights),
            cache_type_k=self.cache_type_k, cache_type_v=self.cache_type_v, activation_dtype=self.ops.dtype,
        )

    def forward(
        self,
        state: Qwen35State,
        token_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        capture: Collection[int] = (),
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run `token_ids` `[T]` after what `state` holds; return logits `[T, vocab]` (`[1, vocab]` with
        `last_only`) and advance the state.

        `positions` `[T]` default to `state.length + arange(T)`. A multi-token call (prefill, verification)
        uses the chunked Gated DeltaNet, a one-token call the recurrent one. `capture`: layer indices whose
        output hidden states (`[T, hidden]`, i.e. transformers' `hidden_states[i + 1]`) are stored in
        `state.captured`, for drafters that read the target's features.
        """
        ops = self.ops
        token_ids = token_ids.reshape(-1)
        if self.decode_graphs and token_ids.shape[0] == 1 and positions is None and not capture:
            return self.decode_step(state, token_ids)
        if last_only and positions is None and not capture and prefill.takes(self, state, token_ids.shape[0]):
            return prefill.prefill_piece(self, state, token_ids)
        token_ids = token_ids.to(ops.device)
        tokens = token_ids.shape[0]
        if positions is None:
            positions = torch.arange(state.length, state.length + tokens, device=ops.device)
        state.kv.ensure_room(tokens)
        past = state.kv.length  # read once: each attention layer appends to the cache as the pass goes
        state.captured = {}

        taps = []

        def mix(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                return layer.linear_attn(x, state.linear[layer.index])
            return layer.self_attn(x, self._local(layer, positions), state.kv, past)

        def tap(layer: DecoderLayer, output: torch.Tensor) -> None:
            if layer.index in capture:
                state.captured[layer.index] = output[0]
            if layer.index in state.capture_layers:
                taps.append(output[0])

        wanted = set(capture) | set(state.capture_layers)
        hidden = self._run_layers(ops.embedding(token_ids, self.embed_tokens)[None], mix, tap, wanted,
                                  last_only=last_only)
        if state.features is not None:
            self._store_features(state, state.length, self._concat_taps(state, taps))
        state.length += tokens
        return self.head_ops.linear(hidden, self.lm_head)[0]

    def _run_layers(
        self,
        hidden: torch.Tensor,
        mix: Any,
        tap: Any = None,
        tapped: Collection[int] = (),
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """The decoder stack from embeddings `[1, T, hidden]` to the final-normed hidden states.

        `mix(layer, x)` runs a layer's mixer (the forward, decode and verify passes differ only there);
        `tap(layer, output)` receives the output of each layer in `tapped`. Each residual add is fused
        with the norm that follows it (`ops.add_rms_norm`), so the MLP's output is added at the next
        layer's input norm (or the final norm).
        """
        pending = None  # the last MLP output, not yet added to the residual stream
        for part, layers in enumerate(self.part_layers):
            if part > 0:
                # A part boundary: the residual stream and the pending MLP output go to the next part's
                # device (a peer copy between GPUs; a copy even where both parts share a device).
                device = self.part_ops[part].device
                hidden, pending = hand_over(hidden, device), hand_over(pending, device)
            hidden, pending = self._run_part_layers(layers, hidden, pending, mix, tap, tapped)
        if last_only:
            hidden, pending = hidden[:, -1:], pending[:, -1:]
        return self._final_norm(hidden, pending)

    def _run_part_layers(self, layers: list[DecoderLayer], hidden: torch.Tensor, pending: torch.Tensor | None,
                         mix: Any, tap: Any, tapped: Collection[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`layers` (one part's, all on one device) over the residual stream `hidden` and the MLP output not
        yet added to it (`pending`, None before the first layer); returns both after the last of them."""
        eps = self.config.eps
        # A decode step's `mix` may also run a layer's input add + norm with its mixer, as one op (None where not).
        after_residual = getattr(mix, "after_residual", None)
        for layer in layers:
            ops = self._layer_ops(layer)
            if pending is None:
                mixed = mix(layer, ops.rms_norm(hidden, layer.input_layernorm, eps))
            elif after_residual is not None and (fused := after_residual(layer, pending, hidden, eps)) is not None:
                mixed, hidden = fused
            else:
                x, hidden = ops.add_rms_norm(pending, hidden, layer.input_layernorm, eps)
                mixed = mix(layer, x)
            pending, hidden = mlp_after_residual(ops, layer.mlp, mixed, hidden, layer.post_attention_layernorm, eps)
            if layer.index in tapped:
                tap(layer, hidden + pending)
        return hidden, pending

    def _final_norm(self, hidden: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        normed, _ = self.head_ops.add_rms_norm(pending, hidden, self.norm, self.config.eps)
        return normed

    __call__ = forward

    # -- the static decode step ------------------------------------------------------------------------

    def decode_step(self, state: Qwen35State, token: int | torch.Tensor, *, graphs: bool | None = None,
                    sampler: Any = None) -> Any:
        """Feed one token at position `state.length` through the static-shape step; return logits `[1, vocab]`
        and advance the state, exactly as `forward` does for one token.

        The step reads the token and its position from fixed device buffers, writes K/V at that position
        (attention reads a fixed window of the cache, masked on the device), updates the Gated DeltaNet
        state in place and leaves the logits in a buffer of its own, so with `graphs` (default: where the
        backend records graphs) each window size is recorded once per sequence and then replayed. With a
        `sampler` (a `device_sampling.RecordedDraw`) the step ends with drawing the next token and returns
        `(logits, token)` (see `static_step.run_decode_step`).
        """
        if self.split_steps:
            return run_split_decode_step(self, state, token, self._static_part_step, graphs=graphs, sampler=sampler)
        return run_decode_step(self, state, token, self._static_step, graphs=graphs, sampler=sampler)

    def _static_step(self, state: Qwen35State, inputs: StaticInputs, window: int) -> torch.Tensor:
        """The decode step as a function of its static inputs and `window` alone (what a graph records). Without
        taps for a drafter the layers are one op (`decode_layers_`), which a backend may run as one launch."""
        taps: list[torch.Tensor] = []
        if state.features is not None:
            hidden = self.static_layers(state, inputs.embedded, inputs.position, window,
                                        lambda layer, output: taps.append(output[0]), state.capture_layers)
        else:
            hidden = self.ops.decode_layers_(self, state, inputs.embedded, inputs.position, window)
        self._ring_features(state, inputs, taps)
        return self.head_ops.linear(hidden, self.lm_head)[0]

    def static_layers(self, state: Qwen35State, embedded: torch.Tensor, position: torch.Tensor, window: int,
                      tap: Any = None, tapped: Collection[int] = ()) -> torch.Tensor:
        """A static decode step's layers, from the embedding to the final-normed hidden state (`tap` and `tapped`
        as `_run_layers`'); `position` the token's on the first part's device."""

        def mix(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                return layer.linear_attn(x, state.linear[layer.index])
            return layer.self_attn.decode_static(x, self._local(layer, position), state.kv, window)

        mix.after_residual = self._after_residual(state, window, lambda layer: self._local(layer, position))
        return self._run_layers(embedded, mix, tap, tapped)

    @staticmethod
    def _after_residual(state: Qwen35State, window: int, position_of: Any) -> Any:
        """A decode step's input add + norm and mixer of a layer as one op, which a backend may run as one launch
        (`add_rms_norm_gated_delta_net_`, `add_rms_norm_gated_attention_`): `(layer, pending, hidden, eps) -> (the
        mixer's output, hidden + pending)`. `position_of(layer)`: the token's device position on the layer's
        device; `window`: the attention's."""

        def after_residual(layer: DecoderLayer, pending: torch.Tensor, hidden: torch.Tensor, eps: float) -> Any:
            if pending.shape[-2] != 1:
                return None
            mixer, attention = layer.linear_attn, layer.self_attn
            if mixer is not None:
                return mixer.ops.add_rms_norm_gated_delta_net_(pending, hidden, layer.input_layernorm, eps, mixer,
                                                               state.linear[layer.index])
            return attention.ops.add_rms_norm_gated_attention_(pending, hidden, layer.input_layernorm, eps,
                                                               attention, state.kv, position_of(layer), window)

        return after_residual

    def _ring_features(self, state: Qwen35State, inputs: StaticInputs, taps: list[torch.Tensor]) -> None:
        if state.features is not None:
            # The drafter's features of this position, into the ring at a device index (a graph records it):
            # plain decoding of a speculative sequence stays on this step, the one verification matches.
            slot = inputs.position.to(state.features.device) % state.features.shape[0]
            state.features.index_copy_(0, slot, self._concat_taps(state, taps).to(state.features.dtype))

    def _static_part_step(self, state: Qwen35State, part: int, inputs: StaticInputs,
                          window: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Part `part` of a split model's decode step, as a function of that part's static inputs and `window`
        (what a graph on the part's device records): the first part starts from the embedding, a later one
        from the residual stream and pending MLP output handed over into its buffers. A part hands on those
        and its layers' taps for the drafter (`tap.<layer>`); the last adds the final norm, the head and the
        feature ring, and returns the logits."""

        def mix(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                return layer.linear_attn(x, state.linear[layer.index])
            return layer.self_attn.decode_static(x, inputs.position, state.kv, window)

        mix.after_residual = self._after_residual(state, window, lambda layer: inputs.position)
        tapped = state.capture_layers if state.features is not None else ()
        handed, hidden, pending = self._static_part_layers(part, inputs, mix, tapped)
        if part < len(self.part_layers) - 1:
            return handed, None
        self._ring_features(state, inputs, self._gathered_taps(inputs, handed, tapped))
        return {}, self.head_ops.linear(self._final_norm(hidden, pending), self.lm_head)[0]

    def _static_part_layers(self, part: int, inputs: StaticInputs, mix: Any,
                            tapped: Collection[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """One part's layers in a static step: (what it hands over, the residual stream, the pending MLP
        output)."""
        taps: dict[str, torch.Tensor] = {}
        hidden, pending = (inputs.embedded, None) if part == 0 else (inputs.hidden, inputs.pending)
        hidden, pending = self._run_part_layers(self.part_layers[part], hidden, pending, mix,
                                                lambda layer, output: taps.__setitem__(f"tap.{layer.index}", output),
                                                tapped)
        return {"hidden": hidden, "pending": pending, **taps}, hidden, pending

    @staticmethod
    def _gathered_taps(inputs: StaticInputs, handed: dict[str, torch.Tensor],
                       tapped: Collection[int]) -> list[torch.Tensor]:
        """The taps of every part in layer order (earlier parts' from the inputs handed over; `[T, hidden]`)."""
        return [(handed[f"tap.{i}"] if f"tap.{i}" in handed else getattr(inputs, f"tap.{i}"))[0]
                for i in sorted(tapped)]

    # -- the target side of speculative decoding ------------------------------------------------------

    @property
    def draft_mask_token_id(self) -> int:
        """The token DFlash drafters fill a block with: Qwen3.5/3.6's `<|MASK|>` slot (a control token)."""
        return QWEN35_MASK_TOKEN_ID

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head alone, `[..., hidden] -> [..., vocab]`: no final norm (a drafter applies its own).
        A drafter on another device hands its hidden states over to the head's."""
        return self.head_ops.linear(hidden.to(self.head_ops.device, self.head_ops.dtype, non_blocking=True), self.lm_head)
