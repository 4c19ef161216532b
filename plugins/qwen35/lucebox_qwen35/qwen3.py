"""Qwen3 (GGUF architecture `qwen3`, dense; e.g. Qwen3-0.6B, PFlash's prefill scorer): the forward pass and its
loader, written against backend ops.

    h = embed_tokens(ids)
    for each decoder layer:
        x = input_layernorm(h)
        h = h + o_proj(attention(rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x))), v_proj(x)))
        x = post_attention_layernorm(h)
        h = h + down_proj(silu(gate_proj(x)) * up_proj(x))
    logits = lm_head(norm(h))

Attention is grouped-query (query head h reads KV head h // (heads / kv heads)), q_norm and k_norm are plain
RMSNorms over each head (`x * w`), RoPE is NeoX style over the whole head (base 1e6 for 0.6B), scale
1/sqrt(head_dim). Nothing is gated, nothing slides, the embedding is not scaled. Names follow transformers'
`modeling_qwen3.py`; GGUF names are in `GGUF_NAMES`. The SwiGLU block is the qwen35 family's `MLP`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from lucebox_core.decoder_model import DecoderModel
from lucebox_core.ggufio import MetadataView
from lucebox_core.kv import KVCache, KVLayerShape, attention_position, observe_query, write_rows
from lucebox_core.loading import LayoutTensors, start_family_load
from lucebox_core.static_step import StaticInputs, StaticStep

from .layout_qwen3 import ARCH, Qwen3Config, tensor_shapes
from .model import MLP
from .ops import QWEN35_OPS

ARCHITECTURE = ARCH

# transformers name -> GGUF tensor name; `{i}` is the layer index.
GGUF_NAMES: dict[str, str] = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",  # absent when tied to embed_tokens
    "layers.{i}.input_layernorm": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.post_attention_layernorm": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj": "blk.{i}.ffn_down.weight",
}

Weight = Any  # a QuantTensor (weights stay in their GGUF type) or a torch tensor


@attrs.define
class Qwen3Attention:
    """transformers' `Qwen3Attention`: GQA with per-head q/k RMSNorm and full NeoX RoPE."""

    ops: Any
    layer_index: int
    q_proj: Weight  # [num_heads * head_dim, hidden]
    k_proj: Weight  # [num_kv_heads * head_dim, hidden]
    v_proj: Weight  # [num_kv_heads * head_dim, hidden]
    o_proj: Weight  # [hidden, num_heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    # q, k and v stacked by the backend (`ops.fuse_rows`) into one product; None where it keeps them apart.
    qkv_proj: Weight | None = None

    def fuse_projections(self) -> None:
        self.qkv_proj = self.ops.fuse_rows([self.q_proj, self.k_proj, self.v_proj])

    @property
    def kv_shape(self) -> KVLayerShape:
        return KVLayerShape(self.num_kv_heads, self.head_dim, self.head_dim)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, T, H, D]`, k and v `[B, T, Hkv, D]` of `x` `[B, T, hidden]` at `positions` `[T]`."""
        ops = self.ops
        batch, tokens, _ = x.shape
        if self.qkv_proj is not None:
            sizes = [w.shape[0] for w in (self.q_proj, self.k_proj, self.v_proj)]
            query, key, value = ops.linear(x, self.qkv_proj).split(sizes, dim=-1)
        else:
            query, key, value = (ops.linear(x, w) for w in (self.q_proj, self.k_proj, self.v_proj))
        query = query.reshape(batch, tokens, self.num_heads, self.head_dim)
        key = key.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        query, key = ops.qk_norm_rope(query, key, self.q_norm, self.k_norm, positions, self.head_dim,
                                      self.rope_theta, self.eps)
        return query, key, value

    def output(self, out: torch.Tensor) -> torch.Tensor:
        batch, tokens = out.shape[:2]
        return self.ops.linear(out.reshape(batch, tokens, -1), self.o_proj)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, past: int) -> torch.Tensor:
        """Eager: `x` at positions `past ..`; K/V appended to the cache, query `i` sees keys `0 .. past + i`."""
        query, key, value = self.project(x, positions)
        observe_query(kv, self.layer_index, query)
        keys, values = kv.append(self.layer_index, key[0], value[0])
        # The rows before this pass's own: `past` for a full cache, the resident ones for a bounded pool.
        out = self.ops.attention(query, keys[None].to(query.dtype), values[None].to(query.dtype), scale=self.scale,
                                 causal_offset=keys.shape[0] - key.shape[1])
        return self.output(out)

    def decode_static(self, x: torch.Tensor, position: torch.Tensor, kv: KVCache, window: int) -> torch.Tensor:
        """One token at the device position `position` `[1]`: K/V written there, attention over the first
        `window` rows of the cache masked past it (no host value but `window`: what a graph records)."""
        query, key, value = self.project(x, position)
        observe_query(kv, self.layer_index, query)
        write_rows(kv, self.ops, self.layer_index, position, key[0], value[0])
        keys, values = kv.gather(self.layer_index, window)  # as stored: a Q8_0 window is decoded by the op
        return self.output(self.ops.decode_attention(query, keys, values, attention_position(kv, position),
                                                     scale=self.scale))


@attrs.define
class Qwen3DecoderLayer:
    index: int
    self_attn: Qwen3Attention
    mlp: MLP
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor


@attrs.define
class Qwen3State:
    """What one sequence carries between forward calls: its K/V, its length and its static decode step."""

    kv: KVCache
    length: int = 0
    captured: dict[int, torch.Tensor] = attrs.Factory(dict)
    features: torch.Tensor | None = None  # no drafter feature ring (no Qwen3 drafter)
    decode: StaticStep | None = None


class Qwen3Model(DecoderModel):
    state_class = Qwen3State
    reads_bounded_kv = True  # kvflash: causal offsets from `append`, static windows masked at `attention_position`

    def __repr__(self) -> str:
        c = self.config
        return (f"Qwen3Model({self.source or 'in memory'}: {len(self.layers)} layers, {c.n_head} heads over "
                f"{c.n_head_kv} KV heads of {c.head_dim}, vocab {self.vocab_size}"
                f"{', tied head' if self.tied_embeddings else ''})")

    def forward(self, state: Qwen3State, token_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                capture: Any = (), last_only: bool = False) -> torch.Tensor:
        """Run `token_ids` `[T]` after what `state` holds; return logits `[T, vocab]` (`[1, vocab]` with
        `last_only`) and advance the state. `capture`: layers whose outputs go to `state.captured`
        (transformers' `hidden_states[i + 1]`, `[T, hidden]`)."""
        ops = self.ops
        token_ids = token_ids.reshape(-1)
        if self.decode_graphs and token_ids.shape[0] == 1 and positions is None and not capture:
            return self.decode_step(state, token_ids)
        tokens = token_ids.shape[0]
        if positions is None:
            positions = torch.arange(state.length, state.length + tokens, device=ops.device)
        state.kv.ensure_room(tokens)
        past = state.kv.length  # read once: each layer appends to the cache as the pass goes
        state.captured = {}

        def tap(layer: Qwen3DecoderLayer, output: torch.Tensor) -> None:
            if layer.index in capture:
                state.captured[layer.index] = output[0]

        hidden = self._run_layers(self.embed(token_ids)[None],
                                  lambda layer, x: layer.self_attn(x, positions, state.kv, past), tap,
                                  last_only=last_only)
        state.length += tokens
        return ops.linear(hidden, self.lm_head)[0]

    __call__ = forward

    def tail_attention(self, token_ids: torch.Tensor, lookahead: int, *,
                       sparse: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """PFlash's scorer inputs from one pass over `token_ids` `[S]` (no sequence state): per layer, the
        post-RoPE queries of the last `lookahead` tokens `[H, T, D]` and every token's keys `[H_kv, S, D]` (see
        `lucebox_core.pflash`). `sparse`: a `block_sparse.BlockSparseConfig`; a prompt longer than two of its
        blocks then runs FlashPrefill's block-sparse attention (`ops.block_sparse_attention`) instead of dense."""
        ops = self.ops
        ids = token_ids.reshape(-1).to(ops.device)
        length = ids.shape[0]
        if not 0 < lookahead <= length:
            raise ValueError(f"cannot score the last {lookahead} of {length} tokens")
        positions = torch.arange(length, device=ops.device)
        queries: dict[int, torch.Tensor] = {}
        keys: dict[int, torch.Tensor] = {}
        block_sparse = sparse is not None and length > 2 * sparse.block

        def attend(layer: Qwen3DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            attn = layer.self_attn
            query, key, value = attn.project(x, positions)
            queries[layer.index] = query[0, -lookahead:].transpose(0, 1)
            keys[layer.index] = key[0].transpose(0, 1)
            if block_sparse:
                out = ops.block_sparse_attention(query[0], key[0], value[0], config=sparse, scale=attn.scale)[None]
            else:
                out = ops.attention(query, key, value, scale=attn.scale, causal_offset=0)
            return attn.output(out)

        self._run_layers(self.embed(ids)[None], attend, last_only=True)
        return [queries[layer.index] for layer in self.layers], [keys[layer.index] for layer in self.layers]

    # -- the static decode step ------------------------------------------------------------------------

    def _static_step(self, state: Qwen3State, inputs: StaticInputs, window: int) -> torch.Tensor:
        hidden = self._run_layers(
            inputs.embedded, lambda layer, x: layer.self_attn.decode_static(x, inputs.position, state.kv, window))
        return self.ops.linear(hidden, self.lm_head)[0]


# -- loading -----------------------------------------------------------------------------------------------


def load(gguf_file: Any, backend: Any = None, **options: Any) -> Qwen3Model:
    """Build a `Qwen3Model` from a `qwen3` GGUF (a `GGUFFile` or a path) on `backend` (default: torch on the CPU).

    Every tensor is checked against the layout the metadata describes (a missing or mis-shaped one is a
    GGUFError naming the file and the tensor); weights stay in their GGUF types. Options: `kv_policy` (default
    the built-in `full`), `cache_type_k` / `cache_type_v` (KV storage types, each independently; default
    `kv_dtype`, else the backend's dtype).
    """
    start = start_family_load(gguf_file, backend, options, family="qwen3", architecture=ARCHITECTURE)
    gguf_file = start.gguf
    config = Qwen3Config.from_gguf_metadata(MetadataView(gguf_file), tensor_names=gguf_file.tensors,
                                            source=str(gguf_file.path))
    ops = QWEN35_OPS.bind(start.backend)
    src = LayoutTensors(gguf_file, tensor_shapes(config), GGUF_NAMES, ops, family="qwen3")
    embed_tokens = src.weight("embed_tokens")
    lm_head = embed_tokens if config.tied_output else src.weight("lm_head")
    layers = []
    for i in range(config.n_layer):
        a, m = "layers.{i}.self_attn.", "layers.{i}.mlp."
        attention = Qwen3Attention(
            ops, layer_index=i, q_proj=src.weight(a + "q_proj", i), k_proj=src.weight(a + "k_proj", i),
            v_proj=src.weight(a + "v_proj", i), o_proj=src.weight(a + "o_proj", i), q_norm=src.vector(a + "q_norm", i),
            k_norm=src.vector(a + "k_norm", i), num_heads=config.n_head, num_kv_heads=config.n_head_kv,
            head_dim=config.head_dim, rope_theta=config.rope_theta, eps=config.eps,
        )
        mlp = MLP(ops, *(src.weight(m + f"{part}_proj", i) for part in ("gate", "up", "down")))
        attention.fuse_projections()
        mlp.fuse_projections()
        layers.append(Qwen3DecoderLayer(
            index=i, self_attn=attention, mlp=mlp, input_layernorm=src.vector("layers.{i}.input_layernorm", i),
            post_attention_layernorm=src.vector("layers.{i}.post_attention_layernorm", i)))
    return Qwen3Model(config, ops, embed_tokens, layers, norm=src.vector("norm"), lm_head=lm_head, **start.kv,
                      source=str(gguf_file.path))
