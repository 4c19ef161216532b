"""Gemma-4 (GGUF architecture `gemma4`): the forward pass of the 31B (dense) and 26B-A4B (MoE) layouts,
written against backend ops.

    h = embed_tokens(ids) * sqrt(hidden)
    for each decoder layer:
        h = h + post_attention_layernorm(self_attn(input_layernorm(h)))
        m = mlp(pre_feedforward_layernorm(h))                        # GeGLU (tanh GELU)
        if MoE:  m = post_feedforward_layernorm_1(m)
                   + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))
        h = (h + post_feedforward_layernorm(m)) * layer_scalar
    logits = softcap(lm_head(norm(h)), 30)

Attention: q, k and v each RMS-normed per head (v without a weight), scale 1.0; sliding layers (window
1024, 256-dim heads) NeoX RoPE with base 1e4, full layers (512-dim heads, their own KV head count) RoPE
base 1e6 on their first pairs only (`rope_freqs`); on full layers without `attn_v` V is the raw K
projection (before k_norm and RoPE). The router reads the residual `h` (not the normed input). Names follow
transformers' `modeling_gemma4.py`; GGUF names are in `GGUF_NAMES`. Norms are plain `x_normed * w` (Gemma-4
has no `1 + w`; llama.cpp stores them unshifted). The embedding scale is `sqrt(hidden)` in fp32, as llama.cpp
applies it (transformers rounds it to the weights' dtype first: 73.5 for the 31B in bf16).

Sliding layers' K/V live in a ring of `window` rows (`KVLayerShape.window`), full layers' in full.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, ClassVar

import attrs
import torch

from lucebox_core.decoder_model import DecoderModel
from lucebox_core.kv import KVCache, KVLayerShape, window_start, write_rows
from lucebox_core.spark import ExpertLayout, run_experts
from lucebox_core.static_step import StaticInputs, StaticStep

from .layout import Gemma4Config
from .verify import Gemma4SpeculativeTarget

ARCHITECTURE = "gemma4"
GEMMA4_MASK_TOKEN_ID = 4  # `<mask>`: what DFlash drafters for Gemma-4 fill a block with

GGUF_NAMES: dict[str, str] = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",  # absent when tied to embed_tokens
    "rope_freqs": "rope_freqs.weight",  # per-pair frequency divisors of the full layers
    "layers.{i}.input_layernorm": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj": "blk.{i}.attn_v.weight",  # sliding layers only (k_eq_v)
    "layers.{i}.self_attn.o_proj": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.post_attention_layernorm": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.pre_feedforward_layernorm": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj": "blk.{i}.ffn_down.weight",
    "layers.{i}.post_feedforward_layernorm": "blk.{i}.post_ffw_norm.weight",
    "layers.{i}.layer_scalar": "blk.{i}.layer_output_scale.weight",
    # the MoE block (26B-A4B)
    "layers.{i}.router.proj": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.router.scale": "blk.{i}.ffn_gate_inp.scale",
    "layers.{i}.router.per_expert_scale": "blk.{i}.ffn_down_exps.scale",
    "layers.{i}.experts.gate_up_proj": "blk.{i}.ffn_gate_up_exps.weight",
    "layers.{i}.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    "layers.{i}.pre_feedforward_layernorm_2": "blk.{i}.pre_ffw_norm_2.weight",
    "layers.{i}.post_feedforward_layernorm_1": "blk.{i}.post_ffw_norm_1.weight",
    "layers.{i}.post_feedforward_layernorm_2": "blk.{i}.post_ffw_norm_2.weight",
}

Weight = Any  # a QuantTensor (weights stay in their GGUF type) or a torch tensor


@attrs.define
class Gemma4Attention:
    """transformers' `Gemma4TextAttention` for one layer (sliding or full)."""

    ops: Any
    layer_index: int
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight | None  # None: V is the raw K projection
    o_proj: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    v_norm: torch.Tensor  # ones: v_norm has no weight
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor  # [head_dim / 2] fp32
    sliding_window: int  # 0 for full layers
    eps: float
    # The projections fused by the backend (`ops.fuse_rows`): rows [q | k | v], [q | k] (full layers, or v
    # of another GGUF type); None: apart.
    in_proj: Weight | None = None
    in_proj_parts: int = 0

    def fuse_projections(self) -> None:
        """Let the backend merge the projections of the one input into one product."""
        parts = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
        for count in range(len(parts), 1, -1):
            fused = self.ops.fuse_rows(parts[:count])
            if fused is not None:
                self.in_proj, self.in_proj_parts = fused, count
                return

    def unused_weights(self) -> tuple[str, ...]:
        return ("q_proj", "k_proj", "v_proj")[: self.in_proj_parts] if self.in_proj is not None else ()

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The q, k and v products of `x` (v None where V is the raw K), fused where the backend fused them."""
        ops = self.ops
        if self.in_proj is None:
            return (ops.linear(x, self.q_proj), ops.linear(x, self.k_proj),
                    None if self.v_proj is None else ops.linear(x, self.v_proj))
        weights = [self.q_proj, self.k_proj, self.v_proj]
        outputs = list(ops.linear(x, self.in_proj).split([w.shape[0] for w in weights[: self.in_proj_parts]], -1))
        if self.in_proj_parts == 2:
            outputs.append(None if self.v_proj is None else ops.linear(x, self.v_proj))
        return outputs[0], outputs[1], outputs[2]

    @property
    def kv_shape(self) -> KVLayerShape:
        return KVLayerShape(self.num_kv_heads, self.head_dim, self.head_dim, window=self.sliding_window)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, T, H, D]`, k and v `[B, T, Hkv, D]` of `x` `[B, T, hidden]` at `positions` `[T]`."""
        ops = self.ops
        batch, tokens, _ = x.shape
        query, raw_key, value = self._projections(x)
        query = query.reshape(batch, tokens, self.num_heads, self.head_dim)
        raw_key = raw_key.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        value = raw_key if value is None else value.reshape(raw_key.shape)
        return ops.qkv_norm_rope(query, raw_key, value, self.q_norm, self.k_norm, self.v_norm, positions,
                                 self.inv_freq, self.eps)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        batch, tokens = out.shape[:2]
        return self.ops.linear(out.reshape(batch, tokens, -1), self.o_proj)

    def visibility(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """bool `[Tq, Tk]`: causal, and within the window on a sliding layer (key seen iff q - k < window)."""
        age = query_positions[:, None] - key_positions[None, :]
        visible = age >= 0
        if self.sliding_window:
            visible &= age < self.sliding_window
        return visible

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, past: int) -> torch.Tensor:
        """Eager: `x` at positions `past ..`; K/V appended to the cache, attention over what each query sees."""
        query, key, value = self.project(x, positions)
        first = window_start(self.kv_shape, past)
        keys, values = kv.append(self.layer_index, key[0], value[0])
        keys, values = keys[None].to(query.dtype), values[None].to(query.dtype)
        if not self.sliding_window:  # every earlier position: the causal rule alone, no mask to read
            return self.output(self.ops.attention(query, keys, values, scale=1.0, causal_offset=past))
        key_positions = torch.arange(first, first + keys.shape[1], device=x.device)
        out = self.ops.attention(query, keys, values, scale=1.0, mask=self.visibility(positions, key_positions))
        return self.output(out)

    def decode_static(self, x: torch.Tensor, position: torch.Tensor, kv: KVCache, window: int,
                      one_node: torch.Tensor) -> torch.Tensor:
        """One token at the device position `position` `[1]`: K/V written there, attention over a fixed window
        of the cache (a sliding layer's ring: its slots). It runs as the verify pass's tree attention with one
        node (`one_node`: `[[True]]`) whose rows are passed beside the cache, so that a verified node gets
        this step's bits (see `verify.py`)."""
        query, key, value = self.project(x, position)
        write_rows(kv, self.ops, self.layer_index, position, key[0], value[0])
        keys, values = kv.gather(self.layer_index, window)
        node_k, node_v = kv.as_stored(key[0], value[0])
        return self.output(self.tree_attention(query, keys, values, position, one_node, node_k, node_v))

    def tree_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                       visible: torch.Tensor, node_k: torch.Tensor, node_v: torch.Tensor) -> torch.Tensor:
        """Nodes (`visible` `[N, N]`, at `start` + depth) over the cache's committed rows (a sliding layer's
        ring, each node seeing its window) and their paths, the nodes' rows apart: the decode step and the
        verify pass share it."""
        return self.ops.tree_attention(query, keys, values, start, visible, scale=1.0, node_k=node_k,
                                       node_v=node_v, ring=self.sliding_window or 0)


@attrs.define
class Gemma4MLP:
    """The dense GeGLU block every layer has."""

    ops: Any
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight
    gate_up_proj: Weight | None = None  # rows [gate | up] fused by the backend

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
        return ops.linear(ops.gelu_tanh_mul(gate, up), self.down_proj)


# The routed GeGLU experts over the fused `[gate | up]` stack and the down stack, as Spark offloads them (the
# router's per-expert scale is in the routing weights, so the experts' ops need nothing more).
GEMMA4_EXPERTS = ExpertLayout(("gate_up_proj", "down_proj"), "moe_experts", "moe_experts_paged")


@attrs.define
class Gemma4MoE:
    """The 26B-A4B's experts beside the dense MLP: router on the residual, top-k GeGLU experts."""

    ops: Any
    proj: Weight  # router [E, hidden]
    scale: torch.Tensor  # [hidden]
    per_expert_scale: torch.Tensor  # [E]
    gate_up_proj: Weight  # [E, 2I, hidden]
    down_proj: Weight  # [E, hidden, I]
    pre_feedforward_layernorm_2: torch.Tensor
    post_feedforward_layernorm_1: torch.Tensor
    post_feedforward_layernorm_2: torch.Tensor
    top_k: int
    eps: float
    offload: Any = None  # Spark's `OffloadedExperts` for this layer's stacks (`spark.attach_spark`), or None
    expert_layout: ClassVar[ExpertLayout] = GEMMA4_EXPERTS

    def __call__(self, residual: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        ops, eps = self.ops, self.eps
        flat = residual.reshape(-1, residual.shape[-1])
        weights, ids = ops.moe_route(flat, self.proj, self.scale, self.per_expert_scale, self.top_k, eps)
        normed = ops.rms_norm(flat, self.pre_feedforward_layernorm_2, eps)
        experts = run_experts(ops, self, normed, weights, ids).reshape(residual.shape)
        return ops.norm_sum(mlp_out, self.post_feedforward_layernorm_1, experts, self.post_feedforward_layernorm_2, eps)


@attrs.define
class Gemma4DecoderLayer:
    index: int
    self_attn: Gemma4Attention
    mlp: Gemma4MLP
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    pre_feedforward_layernorm: torch.Tensor
    post_feedforward_layernorm: torch.Tensor
    layer_scalar: torch.Tensor  # [1]
    moe: Gemma4MoE | None = None


@attrs.define
class Gemma4State:
    """Everything one sequence carries between forward calls: its K/V (sliding layers in rings), its length,
    the drafter's feature ring when speculative decoding is on, and its static decode step."""

    kv: KVCache
    length: int = 0
    captured: dict[int, torch.Tensor] = attrs.Factory(dict)
    capture_layers: tuple[int, ...] = ()
    features: torch.Tensor | None = None
    decode: StaticStep | None = None
    verify: StaticStep | None = None  # the static verify pass (speculative decoding)


class Gemma4Model(Gemma4SpeculativeTarget, DecoderModel):
    state_class = Gemma4State

    def __init__(self, config: Gemma4Config, ops: Any, embed_tokens: Weight, layers: list[Gemma4DecoderLayer],
                 norm: torch.Tensor, lm_head: Weight, **options: Any) -> None:
        """`ops`: the backend with the family's ops bound (`GEMMA4_OPS.bind(backend)`); `options` as
        `DecoderModel`'s (KV policy and types, source)."""
        super().__init__(config, ops, embed_tokens, layers, norm, lm_head, **options)
        self.embed_scale = math.sqrt(config.hidden)
        self.vocab_size = int(embed_tokens.shape[0])

    def __repr__(self) -> str:
        sliding = sum(self.config.sliding)
        kind = f"MoE {self.config.n_expert} experts top-{self.config.n_expert_used}" if self.config.is_moe else "dense"
        return (f"Gemma4Model({self.source or 'in memory'}: {len(self.layers)} layers ({sliding} sliding, "
                f"{len(self.layers) - sliding} full), {kind}, vocab {self.vocab_size})")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings `[T, hidden]` (transformers' `Gemma4TextScaledWordEmbedding`; drafters
        share them)."""
        ids = token_ids.reshape(-1).to(self.ops.device)
        return self.ops.embedding(ids, self.embed_tokens) * self.embed_scale

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head with its soft-cap, `[..., hidden] -> [..., vocab]` (no final norm)."""
        logits = self.ops.linear(hidden, self.lm_head)
        cap = self.config.final_logit_softcap
        return self.ops.softcap(logits, cap) if cap else logits

    @property
    def draft_mask_token_id(self) -> int:
        return GEMMA4_MASK_TOKEN_ID

    def forward(self, state: Gemma4State, token_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                capture: Collection[int] = (), last_only: bool = False) -> torch.Tensor:
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
        taps: list[torch.Tensor] = []

        def tap(layer: Gemma4DecoderLayer, output: torch.Tensor) -> None:
            if layer.index in capture:
                state.captured[layer.index] = output[0]
            if layer.index in state.capture_layers:
                taps.append(output[0])

        hidden = self._run_layers(self.embed(token_ids)[None],
                                  lambda layer, x: layer.self_attn(x, positions, state.kv, past),
                                  tap, set(capture) | set(state.capture_layers), last_only=last_only)
        if state.features is not None:
            self._store_features(state, state.length, self._concat_taps(state, taps))
        state.length += tokens
        return self.output_logits(hidden)[0]

    __call__ = forward

    def _run_layers(self, hidden: torch.Tensor, attend: Any, tap: Any = None, tapped: Collection[int] = (), *,
                    last_only: bool = False) -> torch.Tensor:
        """The decoder stack from embeddings `[1, T, hidden]` to the final-normed hidden states; `attend(layer,
        x)` runs a layer's attention (forward, decode and verify passes differ only there)."""
        ops, eps = self.ops, self.config.eps
        # Each residual step also norms its result for what reads it next (`post_norm_residual`): the MLP's
        # input after attention, the next layer's input (or the final norm) after the MLP.
        normed = ops.rms_norm(hidden, self.layers[0].input_layernorm, eps)
        for i, layer in enumerate(self.layers):
            attended = attend(layer, normed)
            hidden, mlp_in = ops.post_norm_residual(attended, hidden, layer.post_attention_layernorm, eps,
                                                    None, layer.pre_feedforward_layernorm)
            mlp_out = layer.mlp(mlp_in)
            if layer.moe is not None:
                mlp_out = layer.moe(hidden, mlp_out)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, normed = ops.post_norm_residual(mlp_out, hidden, layer.post_feedforward_layernorm, eps,
                                                    layer.layer_scalar, next_norm)
            if layer.index in tapped:
                tap(layer, hidden)
        return normed[:, -1:] if last_only else normed

    # -- the static decode step ------------------------------------------------------------------------

    def _static_step(self, state: Gemma4State, inputs: StaticInputs, window: int) -> torch.Tensor:
        taps: list[torch.Tensor] = []
        tapped = state.capture_layers if state.features is not None else ()
        one_node = torch.ones(1, 1, dtype=torch.bool, device=inputs.position.device)
        hidden = self._run_layers(
            inputs.embedded,
            lambda layer, x: layer.self_attn.decode_static(x, inputs.position, state.kv, window, one_node),
            lambda layer, output: taps.append(output[0]), tapped)
        if state.features is not None:
            slot = inputs.position % state.features.shape[0]
            state.features.index_copy_(0, slot, self._concat_taps(state, taps).to(state.features.dtype))
        return self.output_logits(hidden)[0]
