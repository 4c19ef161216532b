"""Building a `Qwen35Model` from a GGUF (`qwen35`, or `qwen35moe` with its MoE FFN): every tensor checked against
the layout, weights kept in their GGUF types, the projections that share an input stacked where the backend
gains from it."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.ggufio import MetadataView
from lucebox_core.loading import KV_OPTIONS, SPLIT_OPTIONS, LayoutTensors, start_family_load
from lucebox_core.quants import QuantTensor

from .layout import MOE_ARCH, Qwen35Config, tensor_shapes
from .layout_moe import Qwen35MoeConfig
from .model import ARCHITECTURE, GGUF_NAMES, MLP, DecoderLayer, GatedAttention, GatedDeltaNet, Qwen35Model, Weight
from .moe import MOE_GGUF_NAMES, SparseMoeBlock
from .ops import QWEN35_OPS

_OPTIONS = KV_OPTIONS | SPLIT_OPTIONS | {"gdn_chunk_size"}


def load(gguf_file: Any, backend: Any = None, **options: Any) -> Qwen35Model:
    """Build a `Qwen35Model` from a GGUF (a `GGUFFile` or a path) on `backend` (default: torch on the CPU).

    Options: `kv_policy` (a `KVPolicy`; default the built-in `full`), `cache_type_k` / `cache_type_v` (KV
    storage types, `f32`, `f16`, `bf16` or `q8_0`, each independently, as the policy stores them; default
    `kv_dtype`, a torch dtype, else the backend's dtype), `gdn_chunk_size` (64); `device_map` (a
    `DeviceMap` that splits the layers into parts) with `part_backends` (a backend per part): each layer's
    weights on its part's backend, the embedding on the first part's, the final norm and head on the last's.
    """
    return _load(gguf_file, backend, options, family="qwen35", architecture=ARCHITECTURE, config_class=Qwen35Config)


def load_moe(gguf_file: Any, backend: Any = None, **options: Any) -> Qwen35Model:
    """Build a `Qwen35Model` with the MoE FFN from a `qwen35moe` GGUF; the options are `load`'s."""
    return _load(gguf_file, backend, options, family="qwen35moe", architecture=MOE_ARCH, config_class=Qwen35MoeConfig)


def _load(gguf_file: Any, backend: Any, options: dict[str, Any], *, family: str, architecture: str,
          config_class: type[Qwen35Config]) -> Qwen35Model:
    # Bad options and cache types fail before any weight is read.
    start = start_family_load(gguf_file, backend, options, family=family, architecture=architecture,
                              known_options=_OPTIONS)
    gguf_file = start.gguf
    config = config_class.from_gguf_metadata(
        MetadataView(gguf_file), tensor_names=gguf_file.tensors, source=str(gguf_file.path)
    )
    ops = QWEN35_OPS.bind(start.backend)  # the backend's ops and the family's own, each on a kernel where one takes it
    src = LayoutTensors(gguf_file, tensor_shapes(config), GGUF_NAMES | MOE_GGUF_NAMES, ops, family=family)
    chunk_size = int(options.get("gdn_chunk_size", 64))
    device_map = options.get("device_map")
    part_srcs = [src]
    if device_map is not None:
        if len(device_map.layer_parts) != config.n_layer:
            from lucebox_core.device_map import SPLIT_FLAG

            raise LuceboxError(f"{SPLIT_FLAG}: the map places {len(device_map.layer_parts)} layers; "
                               f"{gguf_file.path} has {config.n_layer}")
        bound = {}  # one bound op set per backend: parts on one device share its weight uploads
        for backend in options["part_backends"]:
            if id(backend) not in bound:
                bound[id(backend)] = ops if backend is start.backend else QWEN35_OPS.bind(backend)
        part_srcs = [LayoutTensors(gguf_file, tensor_shapes(config), GGUF_NAMES | MOE_GGUF_NAMES,
                                   bound[id(backend)], family=family) for backend in options["part_backends"]]
    head_src = part_srcs[-1]

    embed_tokens = src.weight("embed_tokens")
    # A split model's head is the last part's: a tied head is read again for that part's device.
    lm_head = head_src.weight("embed_tokens" if config.tied_output else "lm_head")
    if config.tied_output and head_src is src:
        lm_head = embed_tokens
    layers = []
    for i in range(config.n_layer):
        src = part_srcs[device_map.layer_part(i)] if device_map is not None else part_srcs[0]
        layer = DecoderLayer(
            index=i,
            input_layernorm=src.vector("layers.{i}.input_layernorm", i),
            post_attention_layernorm=src.vector("layers.{i}.post_attention_layernorm", i),
            mlp=_load_moe(src, config, i) if isinstance(config, Qwen35MoeConfig) else _load_mlp(src, "mlp.", i),
        )
        if config.is_recurrent(i):
            layer.linear_attn = _load_gated_delta_net(src, config, i, chunk_size)
        else:
            layer.self_attn = _load_gated_attention(src, config, i)
        for part in (layer.mlp, layer.linear_attn, layer.self_attn):
            if part is not None:
                part.fuse_projections()
        layers.append(layer)

    return Qwen35Model(
        config, ops, embed_tokens, layers, norm=head_src.vector("norm"), lm_head=lm_head, **start.kv,
        source=str(gguf_file.path), device_map=device_map, part_ops=[s.ops for s in part_srcs],
    )


def _load_mlp(src: LayoutTensors, prefix: str, i: int) -> MLP:
    p = "layers.{i}." + prefix
    return MLP(src.ops, *(src.weight(p + f"{part}_proj", i) for part in ("gate", "up", "down")))


def _load_moe(src: LayoutTensors, c: Qwen35MoeConfig, i: int) -> SparseMoeBlock:
    p = "layers.{i}.mlp."
    return SparseMoeBlock(
        src.ops,
        router=src.weight(p + "gate", i),
        gate_exps=src.weight(p + "experts.gate_proj", i),
        up_exps=src.weight(p + "experts.up_proj", i),
        down_exps=src.weight(p + "experts.down_proj", i),
        shared_expert=_load_mlp(src, "mlp.shared_expert.", i),
        shared_expert_gate=_as_one_row(src.weight(p + "shared_expert_gate", i)),
        top_k=c.n_expert_used,
    )


def _as_one_row(vector: Weight) -> Weight:
    """The GGUF's `[hidden]` gate vector as the `[1, hidden]` matrix of a one-output projection (same bytes)."""
    if isinstance(vector, QuantTensor):
        return attrs.evolve(vector, shape=(1, vector.shape[-1]))
    return vector.reshape(1, -1)


def _load_gated_delta_net(src: LayoutTensors, c: Qwen35Config, i: int, chunk_size: int) -> GatedDeltaNet:
    p = "layers.{i}.linear_attn."
    return GatedDeltaNet(
        src.ops,
        in_proj_qkv=src.weight(p + "in_proj_qkv", i),
        in_proj_z=src.weight(p + "in_proj_z", i),
        in_proj_b=src.weight(p + "in_proj_b", i),
        in_proj_a=src.weight(p + "in_proj_a", i),
        conv1d=src.vector(p + "conv1d", i),
        ssm_a=src.vector(p + "A_log", i, dtype=torch.float32),
        dt_bias=src.vector(p + "dt_bias", i, dtype=torch.float32),
        norm=src.vector(p + "norm", i),
        out_proj=src.weight(p + "out_proj", i),
        num_k_heads=c.ssm_n_group,
        num_v_heads=c.ssm_dt_rank,
        head_k_dim=c.ssm_d_state,
        head_v_dim=c.ssm_d_inner // c.ssm_dt_rank,
        eps=c.eps,
        chunk_size=chunk_size,
    )


def _load_gated_attention(src: LayoutTensors, c: Qwen35Config, i: int) -> GatedAttention:
    p = "layers.{i}.self_attn."
    return GatedAttention(
        src.ops,
        layer_index=i,
        q_proj=src.weight(p + "q_proj", i),
        k_proj=src.weight(p + "k_proj", i),
        v_proj=src.weight(p + "v_proj", i),
        o_proj=src.weight(p + "o_proj", i),
        q_norm=src.vector(p + "q_norm", i),
        k_norm=src.vector(p + "k_norm", i),
        num_heads=c.n_head,
        num_kv_heads=c.n_head_kv,
        head_dim=c.head_dim,
        rope_dim=c.rope_dim,
        rope_theta=c.rope_theta,
        eps=c.eps,
    )
