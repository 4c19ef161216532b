"""Building a `Gemma4Model` from a GGUF: every tensor checked against the layout, weights kept in their GGUF
types, the dense MLP's gate and up rows stacked where the backend gains from it."""

from __future__ import annotations

from typing import Any

import torch

from lucebox_core.ggufio import MetadataView
from lucebox_core.loading import LayoutTensors, start_family_load

from .layout import Gemma4Config, tensor_shapes
from .model import ARCHITECTURE, GGUF_NAMES, Gemma4Attention, Gemma4DecoderLayer, Gemma4MLP, Gemma4Model, Gemma4MoE
from .ops import GEMMA4_OPS


def load(gguf_file: Any, backend: Any = None, **options: Any) -> Gemma4Model:
    """Build a `Gemma4Model` from a GGUF (a `GGUFFile` or a path) on `backend` (default: torch on the CPU).

    Options: `kv_policy` (default the built-in `full`), `cache_type_k` / `cache_type_v` (KV storage types, each
    independently; default `kv_dtype`, else the backend's dtype).
    """
    start = start_family_load(gguf_file, backend, options, family="gemma4", architecture=ARCHITECTURE)
    gguf_file = start.gguf
    config = Gemma4Config.from_gguf_metadata(MetadataView(gguf_file), tensor_names=gguf_file.tensors,
                                             source=str(gguf_file.path))
    ops = GEMMA4_OPS.bind(start.backend)
    src = LayoutTensors(gguf_file, tensor_shapes(config), GGUF_NAMES, ops, family="gemma4")
    inv_freq_full, inv_freq_swa = _inverse_frequencies(src, config, ops.device)
    ones = {dim: torch.ones(dim, dtype=ops.dtype, device=ops.device) for dim in {config.head_dim, config.head_dim_swa}}

    embed_tokens = src.weight("embed_tokens")
    lm_head = embed_tokens if config.tied_output else src.weight("lm_head")
    layers = []
    for i in range(config.n_layer):
        kv_heads, head_dim = config.layer_heads(i)
        sliding = config.is_sliding(i)
        a = "layers.{i}.self_attn."
        attention = Gemma4Attention(
            ops, layer_index=i, q_proj=src.weight(a + "q_proj", i), k_proj=src.weight(a + "k_proj", i),
            v_proj=src.weight(a + "v_proj", i) if config.has_v_proj(i) else None, o_proj=src.weight(a + "o_proj", i),
            q_norm=src.vector(a + "q_norm", i), k_norm=src.vector(a + "k_norm", i), v_norm=ones[head_dim],
            num_heads=config.n_head, num_kv_heads=kv_heads, head_dim=head_dim,
            inv_freq=inv_freq_swa if sliding else inv_freq_full, sliding_window=config.sliding_window if sliding else 0,
            eps=config.eps,
        )
        attention.fuse_projections()
        mlp = Gemma4MLP(ops, gate_proj=src.weight("layers.{i}.mlp.gate_proj", i),
                        up_proj=src.weight("layers.{i}.mlp.up_proj", i),
                        down_proj=src.weight("layers.{i}.mlp.down_proj", i))
        mlp.fuse_projections()
        layer = Gemma4DecoderLayer(
            index=i, self_attn=attention, mlp=mlp,
            input_layernorm=src.vector("layers.{i}.input_layernorm", i),
            post_attention_layernorm=src.vector("layers.{i}.post_attention_layernorm", i),
            pre_feedforward_layernorm=src.vector("layers.{i}.pre_feedforward_layernorm", i),
            post_feedforward_layernorm=src.vector("layers.{i}.post_feedforward_layernorm", i),
            layer_scalar=src.vector("layers.{i}.layer_scalar", i),
        )
        if config.is_moe:
            layer.moe = Gemma4MoE(
                ops, proj=src.weight("layers.{i}.router.proj", i), scale=src.vector("layers.{i}.router.scale", i),
                per_expert_scale=src.vector("layers.{i}.router.per_expert_scale", i, dtype=torch.float32),
                gate_up_proj=src.weight("layers.{i}.experts.gate_up_proj", i),
                down_proj=src.weight("layers.{i}.experts.down_proj", i),
                pre_feedforward_layernorm_2=src.vector("layers.{i}.pre_feedforward_layernorm_2", i),
                post_feedforward_layernorm_1=src.vector("layers.{i}.post_feedforward_layernorm_1", i),
                post_feedforward_layernorm_2=src.vector("layers.{i}.post_feedforward_layernorm_2", i),
                top_k=config.n_expert_used, eps=config.eps,
            )
        layers.append(layer)
    return Gemma4Model(config, ops, embed_tokens, layers, norm=src.vector("norm"), lm_head=lm_head, **start.kv,
                       source=str(gguf_file.path))


def _inverse_frequencies(src: LayoutTensors, config: Gemma4Config, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE frequencies per pair of a full head (base^(-2j/D) divided by llama.cpp's `rope_freqs` factors) and
    of a sliding head (base^(-2j/D) over the rotated dims, 0 past them)."""
    factors = src.vector("rope_freqs", dtype=torch.float32).to(device)
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device) / config.head_dim
    full = 1.0 / (config.rope_theta ** exponents) / factors
    rotated = config.rope_dim_swa or config.head_dim_swa
    exponents = torch.arange(0, config.head_dim_swa, 2, dtype=torch.float32, device=device) / rotated
    swa = 1.0 / (config.rope_theta_swa ** exponents)
    swa[rotated // 2:] = 0.0
    return full, swa
