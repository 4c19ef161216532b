"""Laguna (GGUF architecture `laguna`, Poolside Laguna-XS.2): the forward pass, written against backend ops.

    h = embed_tokens(ids)
    for each decoder layer:
        x = input_layernorm(h)
        h = h + o_proj(attention(q, k, v) * softplus(g_proj(x)) per head)
        x = post_attention_layernorm(h)
        h = h + (mlp(x) if a leading dense layer else 2.5 * routed_experts(x) + shared_expert(x))
    logits = lm_head(norm(h))

Attention: per-layer query head counts (XS.2: 48 on full layers, 64 on sliding ones), 8 KV heads of 128,
q_norm and k_norm per head, scale 1/sqrt(128). Layer i is full attention iff i % 4 == 0: YaRN RoPE (base 5e5)
on the first 64 dims of each head, those dims (only) multiplied by YaRN's attention factor 0.1 ln 32 + 1;
the other layers slide over 512 positions with plain RoPE (base 1e4) on the whole head. The MoE router is a
sigmoid over the experts; `exp_probs_b` only biases which 8 are chosen; the chosen scores are renormalised
to sum 1. Names follow transformers' `modeling_laguna.py`; GGUF names are in `GGUF_NAMES`.

Sliding layers' K/V live in a ring of `window` rows (`KVLayerShape.window`), full layers' in full.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from lucebox_core.decoder_model import DecoderModel
from lucebox_core.kv import KVCache, KVLayerShape, window_start, write_rows
from lucebox_core.moe_routing import SIGMOID, MoERouting
from lucebox_core.spark import SWIGLU_EXPERTS, ExpertLayout, run_experts
from lucebox_core.static_step import StaticInputs, StaticStep


ARCHITECTURE = "laguna"

GGUF_NAMES: dict[str, str] = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "layers.{i}.input_layernorm": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.self_attn.g_proj": "blk.{i}.attn_gate.weight",
    "layers.{i}.post_attention_layernorm": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj": "blk.{i}.ffn_down.weight",
    "layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.mlp.gate.e_score_correction_bias": "blk.{i}.exp_probs_b.bias",
    "layers.{i}.mlp.experts.gate_proj": "blk.{i}.ffn_gate_exps.weight",
    "layers.{i}.mlp.experts.up_proj": "blk.{i}.ffn_up_exps.weight",
    "layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    "layers.{i}.mlp.shared_experts.gate_proj": "blk.{i}.ffn_gate_shexp.weight",
    "layers.{i}.mlp.shared_experts.up_proj": "blk.{i}.ffn_up_shexp.weight",
    "layers.{i}.mlp.shared_experts.down_proj": "blk.{i}.ffn_down_shexp.weight",
}

Weight = Any  # a QuantTensor (weights stay in their GGUF type) or a torch tensor


@attrs.define
class LagunaAttention:
    """transformers' `LagunaAttention` for one layer (sliding or full)."""

    ops: Any
    layer_index: int
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight
    g_proj: Weight  # [heads, hidden]: one gate per head
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor  # [rotated dims / 2] fp32
    attention_factor: float  # YaRN's scale of the rotated dims (1 on sliding layers)
    sliding_window: int  # 0 for full layers
    eps: float
    # The projections fused by the backend (`ops.fuse_rows`): rows [q | k | v | g], [q | k | v] or [q | k] (a
    # part of another GGUF type stays apart); None: all apart.
    in_proj: Weight | None = None
    in_proj_parts: int = 0

    def fuse_projections(self) -> None:
        """Let the backend merge the projections of the layer's input into one product (one launch)."""
        parts = (self.q_proj, self.k_proj, self.v_proj, self.g_proj)
        for count in (4, 3, 2):
            fused = self.ops.fuse_rows(list(parts[:count]))
            if fused is not None:
                self.in_proj, self.in_proj_parts = fused, count
                return

    @property
    def kv_shape(self) -> KVLayerShape:
        return KVLayerShape(self.num_kv_heads, self.head_dim, self.head_dim, window=self.sliding_window)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q `[B, T, H, D]`, k and v `[B, T, Hkv, D]` and the gate `[B, T, H]` of `x` at `positions` `[T]`."""
        ops = self.ops
        batch, tokens, _ = x.shape
        parts = [self.q_proj, self.k_proj, self.v_proj, self.g_proj]
        if self.in_proj is not None:
            projected = list(ops.linear(x, self.in_proj).split([w.shape[0] for w in parts[: self.in_proj_parts]], -1))
        else:
            projected = []
        projected += [ops.linear(x, w) for w in parts[len(projected) :]]
        query = projected[0].reshape(batch, tokens, self.num_heads, self.head_dim)
        key = projected[1].reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        value = projected[2].reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        gate = projected[3]
        query, key = ops.qk_norm_rope_scaled(query, key, self.q_norm, self.k_norm, positions, self.inv_freq,
                                             self.attention_factor, self.eps)
        return query, key, value, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        batch, tokens = out.shape[:2]
        gated = self.ops.softplus_head_gate(out, gate)
        return self.ops.linear(gated.reshape(batch, tokens, -1), self.o_proj)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, past: int) -> torch.Tensor:
        """Eager: `x` at positions `past ..`; K/V appended to the cache, attention over what each query sees."""
        query, key, value, gate = self.project(x, positions)
        first = window_start(self.kv_shape, past)
        keys, values = kv.append(self.layer_index, key[0], value[0])
        keys, values = keys[None].to(query.dtype), values[None].to(query.dtype)
        if not self.sliding_window:
            return self.output(self.ops.attention(query, keys, values, scale=self.scale, causal_offset=past), gate)
        key_positions = torch.arange(first, first + keys.shape[1], device=x.device)
        age = positions[:, None] - key_positions[None, :]
        visible = (age >= 0) & (age < self.sliding_window)  # key seen iff 0 <= q - k < window
        return self.output(self.ops.attention(query, keys, values, scale=self.scale, mask=visible), gate)

    def decode_static(self, x: torch.Tensor, position: torch.Tensor, kv: KVCache, window: int,
                      one_node: torch.Tensor) -> torch.Tensor:
        """One token at the device position `position` `[1]`: K/V written there, then the generic
        `tree_attention` with one node over a fixed window of the cache (a sliding layer's ring: its slots),
        the node's rows passed beside the cache, as Gemma-4's decode step does; its output gated in the same
        op (`gated_tree_attention`)."""
        query, key, value, gate = self.project(x, position)
        write_rows(kv, self.ops, self.layer_index, position, key[0], value[0])
        keys, values = kv.gather(self.layer_index, window)
        node_k, node_v = kv.as_stored(key[0], value[0])
        gated = self.ops.gated_tree_attention(query, keys, values, position, one_node, gate, scale=self.scale,
                                              node_k=node_k, node_v=node_v, ring=self.sliding_window or 0)
        return self.ops.linear(gated.reshape(1, 1, -1), self.o_proj)


@attrs.define
class LagunaMLP:
    """A SwiGLU block: the leading dense layers' MLP and each MoE layer's shared expert."""

    swiglu: ClassVar[bool] = True  # `decoder_model.mlp_after_residual` may run it as one op with the add + norm

    ops: Any
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight
    gate_up_proj: Weight | None = None  # rows [gate | up], fused by the backend (`ops.fuse_rows`)

    def fuse_projections(self) -> None:
        self.gate_up_proj = self.ops.fuse_rows([self.gate_proj, self.up_proj])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if self.gate_up_proj is not None:
            gate, up = ops.linear(x, self.gate_up_proj).split([self.gate_proj.shape[0], self.up_proj.shape[0]], -1)
        else:
            gate, up = ops.linear(x, self.gate_proj), ops.linear(x, self.up_proj)
        return ops.linear(ops.silu_mul(gate, up), self.down_proj)


@attrs.define
class LagunaMoE:
    """transformers' `LagunaSparseMoeBlock`: sigmoid router with a selection bias, top-k SwiGLU experts whose
    renormalised sum is scaled, and one always-on shared expert."""

    ops: Any
    router: Weight  # [E, hidden]
    selection_bias: torch.Tensor  # [E] fp32 (`e_score_correction_bias`)
    gate_exps: Weight  # [E, I, hidden]
    up_exps: Weight  # [E, I, hidden]
    down_exps: Weight  # [E, hidden, I]
    shared_expert: LagunaMLP
    top_k: int
    routed_scale: float
    offload: Any = None  # Spark's `OffloadedExperts` for this layer's stacks (`spark.attach_spark`), or None
    expert_layout: ClassVar[ExpertLayout] = SWIGLU_EXPERTS  # its stacks and ops, as Spark reads them

    def routing(self) -> MoERouting | None:
        """This block as data, for a backend that runs it as one kernel (`lucebox_core.moe_routing`); None with
        Spark's paged stacks, or before the backend fused the shared expert's gate and up rows."""
        shared = self.shared_expert
        if self.offload is not None or shared.gate_up_proj is None:
            return None
        return MoERouting(SIGMOID, self.router, self.top_k, self.gate_exps, self.up_exps, self.down_exps,
                          shared.gate_up_proj, shared.down_proj, selection_bias=self.selection_bias,
                          scale=self.routed_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = ops.sigmoid_route(flat, self.router, self.selection_bias, self.top_k, self.routed_scale)
        # The shared expert goes into the op, which adds it (a backend may run it in the experts' launches).
        return run_experts(ops, self, flat, weights, ids, shared=self.shared_expert).reshape(x.shape)


@attrs.define
class LagunaDecoderLayer:
    index: int
    self_attn: LagunaAttention
    mlp: LagunaMLP | LagunaMoE
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor


@attrs.define
class LagunaState:
    """What one sequence carries between forward calls: its K/V (sliding layers in rings), its length and
    its static decode step."""

    kv: KVCache
    length: int = 0
    captured: dict[int, torch.Tensor] = attrs.Factory(dict)
    features: torch.Tensor | None = None  # no drafter feature ring (no Laguna drafter yet)
    decode: StaticStep | None = None


class LagunaModel(DecoderModel):
    state_class = LagunaState

    def __repr__(self) -> str:
        full = sum(1 for layer in self.layers if not layer.self_attn.sliding_window)
        return (f"LagunaModel({self.source or 'in memory'}: {len(self.layers)} layers ({len(self.layers) - full} "
                f"sliding, {full} full), {self.config.n_expert} experts top-{self.config.n_expert_used}, "
                f"vocab {self.vocab_size})")

    def forward(self, state: LagunaState, token_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                capture: Any = (), last_only: bool = False) -> torch.Tensor:
        """Run `token_ids` `[T]` after what `state` holds; return logits `[T, vocab]` (`[1, vocab]` with
        `last_only`) and advance the state. `capture`: layers whose outputs go to `state.captured`."""
        ops = self.ops
        token_ids = token_ids.reshape(-1)
        if self.decode_graphs and token_ids.shape[0] == 1 and positions is None and not capture:
            return self.decode_step(state, token_ids)
        tokens = token_ids.shape[0]
        if positions is None:
            positions = torch.arange(state.length, state.length + tokens, device=ops.device)
        state.kv.ensure_room(tokens)
        past = state.kv.length
        state.captured = {}

        def tap(layer: LagunaDecoderLayer, output: torch.Tensor) -> None:
            if layer.index in capture:
                state.captured[layer.index] = output[0]

        hidden = self._run_layers(self.embed(token_ids)[None],
                                  lambda layer, x: layer.self_attn(x, positions, state.kv, past), tap,
                                  last_only=last_only)
        state.length += tokens
        return ops.linear(hidden, self.lm_head)[0]

    __call__ = forward

    # -- the static decode step ------------------------------------------------------------------------

    def _static_step(self, state: LagunaState, inputs: StaticInputs, window: int) -> torch.Tensor:
        one_node = torch.ones(1, 1, dtype=torch.bool, device=inputs.position.device)
        hidden = self._run_layers(
            inputs.embedded,
            lambda layer, x: layer.self_attn.decode_static(x, inputs.position, state.kv, window, one_node))
        return self.ops.linear(hidden, self.lm_head)[0]
