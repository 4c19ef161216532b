"""Convert a transformers Qwen3.5 / Qwen3.6 checkpoint folder to a qwen35 GGUF (dense) or a qwen35moe one (MoE).

Follows llama.cpp's converter (`conversion/qwen.py`, `Qwen3_5TextModel`) so the result loads in
llama.cpp and in Lucebox alike:

- zero-centred RMSNorm weights are stored as `1 + w` (every norm but `linear_attn.norm`);
- `A_log` becomes `ssm_a = -exp(A_log)`, `dt_bias` becomes `ssm_dt.bias`, the conv kernel
  `[C, 1, K]` is squeezed to `[C, K]`;
- `q_proj` keeps its per-head `[q | gate]` interleave;
- with fewer GDN key heads than value heads, value heads move from HF's grouped order to the tiled
  order (`layout.reorder_v_heads`) in the V rows of `attn_qkv`, `attn_gate`, `ssm_beta`,
  `ssm_alpha`, `ssm_a`, `ssm_dt.bias`, the conv's V channels and the columns of `ssm_out`.

In a MoE checkpoint the per-expert `mlp.experts.{e}.{gate,up,down}_proj` are stacked into
`ffn_{gate,up,down}_exps`, the router `mlp.gate` is `ffn_gate_inp`, the shared expert `ffn_*_shexp` and its
gate `mlp.shared_expert_gate` (`[1, hidden]`) the vector `ffn_gate_inp_shexp`.

Transforms run in float32 (llama.cpp runs them in the checkpoint dtype, so for bf16 checkpoints its
`1 + w` is rounded to bf16 where ours is not). Vision (`model.visual.*`) and MTP (`mtp.*`) weights
are skipped. Tensors are read, transformed and written one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox_core.checkpoint import (Checkpoint, TensorSource, Transform, check_output_type, check_sources,
                                     converted_data, encoded_bytes, identity, read_hf_config, write_converted)
from lucebox_core.errors import LuceboxError
from lucebox_core.gguf_out import TensorPlan
from lucebox_core.specs import CONVERTED_TYPES

from . import layout
from . import vocab as vocab_source
from .layout_moe import Qwen35MoeConfig
from .synth import tensor_plans

TYPES = CONVERTED_TYPES
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_EXPERT_PARTS = ("gate", "up", "down")
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return w + 1.0


def _sources(cfg: layout.Qwen35Config, prefix: str) -> dict[str, TensorSource]:
    """The HF source of every GGUF tensor of `cfg`, with llama.cpp's transforms."""
    k_heads, v_heads, d = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state

    def v_rows(width: int) -> Transform:
        return lambda w: layout.reorder_v_heads(w, 0, k_heads, v_heads, width)

    def qkv(w: torch.Tensor) -> torch.Tensor:
        qk = 2 * cfg.gdn_key_dim
        return torch.cat([w[:qk], layout.reorder_v_heads(w[qk:], 0, k_heads, v_heads, d)], dim=0)

    def conv(w: torch.Tensor) -> torch.Tensor:
        return qkv(w.reshape(w.shape[0], w.shape[-1]))

    def ssm_a(w: torch.Tensor) -> torch.Tensor:
        return v_rows(1)(-torch.exp(w))

    def out_columns(w: torch.Tensor) -> torch.Tensor:
        return layout.reorder_v_heads(w, 1, k_heads, v_heads, d)

    shapes = layout.tensor_shapes(cfg)
    sources: dict[str, TensorSource] = {}

    def add(name: str, key: str, transform: Transform = identity, hf_shape: tuple[int, ...] | None = None) -> None:
        sources[name] = TensorSource(key, hf_shape or shapes[name], transform)

    add("token_embd.weight", prefix + "embed_tokens.weight")
    for il in range(cfg.n_layer):
        blk, hf = f"blk.{il}.", f"{prefix}layers.{il}."
        add(blk + "attn_norm.weight", hf + "input_layernorm.weight", _plus_one)
        add(blk + "post_attention_norm.weight", hf + "post_attention_layernorm.weight", _plus_one)
        if cfg.is_recurrent(il):
            la = hf + "linear_attn."
            add(blk + "attn_qkv.weight", la + "in_proj_qkv.weight", qkv)
            add(blk + "attn_gate.weight", la + "in_proj_z.weight", v_rows(d))
            add(blk + "ssm_conv1d.weight", la + "conv1d.weight", conv, (cfg.gdn_conv_dim, 1, cfg.ssm_d_conv))
            add(blk + "ssm_dt.bias", la + "dt_bias", v_rows(1))
            add(blk + "ssm_a", la + "A_log", ssm_a)
            add(blk + "ssm_beta.weight", la + "in_proj_b.weight", v_rows(1))
            add(blk + "ssm_alpha.weight", la + "in_proj_a.weight", v_rows(1))
            add(blk + "ssm_norm.weight", la + "norm.weight")  # plain `w`, not zero-centred
            add(blk + "ssm_out.weight", la + "out_proj.weight", out_columns)
        else:
            sa = hf + "self_attn."
            add(blk + "attn_q.weight", sa + "q_proj.weight")
            add(blk + "attn_k.weight", sa + "k_proj.weight")
            add(blk + "attn_v.weight", sa + "v_proj.weight")
            add(blk + "attn_output.weight", sa + "o_proj.weight")
            add(blk + "attn_q_norm.weight", sa + "q_norm.weight", _plus_one)
            add(blk + "attn_k_norm.weight", sa + "k_norm.weight", _plus_one)
        if isinstance(cfg, Qwen35MoeConfig):
            add(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight")
            add(blk + "ffn_gate_inp_shexp.weight", hf + "mlp.shared_expert_gate.weight", lambda w: w.reshape(-1),
                (1, cfg.hidden))
            for part in _EXPERT_PARTS:
                add(blk + f"ffn_{part}_shexp.weight", hf + f"mlp.shared_expert.{part}_proj.weight")
        else:
            for part in _EXPERT_PARTS:
                add(blk + f"ffn_{part}.weight", hf + f"mlp.{part}_proj.weight")
    add("output_norm.weight", prefix + "norm.weight", _plus_one)
    if not cfg.tied_output:
        add("output.weight", "lm_head.weight")
    return sources


def _expert_stacks(cfg: layout.Qwen35Config, prefix: str) -> dict[str, list[TensorSource]]:
    """Each expert stack's per-expert sources, in expert order (none for a dense model)."""
    if not isinstance(cfg, Qwen35MoeConfig):
        return {}
    shapes = layout.tensor_shapes(cfg)
    stacks: dict[str, list[TensorSource]] = {}
    for il in range(cfg.n_layer):
        for part in _EXPERT_PARTS:
            name = f"blk.{il}.ffn_{part}_exps.weight"
            stacks[name] = [TensorSource(f"{prefix}layers.{il}.mlp.experts.{e}.{part}_proj.weight", shapes[name][1:],
                                         identity) for e in range(cfg.n_expert)]
    return stacks


def _read_config(hf_dir: Path, model_types: tuple[str, ...], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    config, text = read_hf_config(hf_dir, model_types, what)
    text_type = model_types[-1]  # the text model's type: `qwen3_5_text` or `qwen3_5_moe_text`
    if text is not config and text.get("model_type", text_type) != text_type:
        raise LuceboxError(
            f"{hf_dir / 'config.json'}: text_config.model_type {text.get('model_type')!r} is not {text_type}"
        )
    return config, text


def convert(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the dense checkpoint in `hf_dir` to a `type` (f32, f16, bf16, q8_0) qwen35 GGUF at `path`.

    The vocabulary comes from `vocab` (a GGUF to copy `tokenizer.*` keys from) when given, else
    from the folder's `tokenizer.json`; it is padded with `[PAD{i}]` tokens to the model's size.
    """
    return _convert(Path(hf_dir), path, type=type, vocab=vocab, model_types=MODEL_TYPES, what="a dense Qwen3.5",
                    config_class=layout.Qwen35Config)


def convert_moe(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the MoE checkpoint in `hf_dir` (`Qwen3_5MoeForCausalLM`) to a qwen35moe GGUF; the rest as `convert`."""
    return _convert(Path(hf_dir), path, type=type, vocab=vocab, model_types=MOE_MODEL_TYPES,
                    what="a Qwen3.5 MoE", config_class=Qwen35MoeConfig)


def _convert(hf_dir: Path, path: str | Path, *, type: str, vocab: str | Path | None, model_types: tuple[str, ...],
             what: str, config_class: type[layout.Qwen35Config]) -> Path:
    check_output_type(type, TYPES)
    config, text = _read_config(hf_dir, model_types, what)
    checkpoint = Checkpoint(hf_dir)
    prefix = checkpoint.text_prefix(hf_dir)
    try:
        cfg = config_class.from_hf_config(text, tied_output="lm_head.weight" not in checkpoint)
    except ValueError as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: {exc}") from None

    tokens = _vocabulary(hf_dir, vocab)
    try:
        tokens.pad_to(cfg.vocab)
    except ValueError as exc:
        raise LuceboxError(f"{vocab or hf_dir / 'tokenizer.json'}: {exc} (vocab_size {cfg.vocab})") from None

    sources = _sources(cfg, prefix)
    stacks = _expert_stacks(cfg, prefix)
    expert_sources = {f"{name}[{e}]": source for name, parts in stacks.items() for e, source in enumerate(parts)}
    check_sources(checkpoint, sources | expert_sources, prefix, hf_dir, family=cfg.arch, skipped=_SKIPPED_PREFIXES)
    plans = tensor_plans(cfg, type)
    converted = converted_data(checkpoint, sources)

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        if plan.name in stacks:  # one expert stack: the experts read one by one, stacked in float32
            stacked = torch.stack([checkpoint.tensor(s.key).to(torch.float32) for s in stacks[plan.name]])
            yield encoded_bytes(stacked.reshape(plan.shape), plan.ggml_type)
        else:
            yield from converted(plan)

    def add_metadata(writer: Any) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_converted(path, hf_dir, config, arch=cfg.arch, type=type, tensors=plans, data=data,
                           add_metadata=add_metadata)


def _vocabulary(hf_dir: Path, vocab: str | Path | None) -> vocab_source.Vocab:
    if vocab is not None:
        return vocab_source.from_gguf(vocab)
    found = vocab_source.from_hf_folder(hf_dir)
    if found is None:
        raise LuceboxError(
            f"{hf_dir}: no tokenizer.json; pass a vocabulary GGUF (--vocab FILE) to copy the tokenizer from"
        )
    return found
