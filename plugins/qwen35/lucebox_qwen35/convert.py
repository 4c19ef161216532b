"""Convert a transformers Qwen3.5 / Qwen3.6 dense checkpoint folder to a qwen35 GGUF.

Follows llama.cpp's converter (`conversion/qwen.py`, `Qwen3_5TextModel`) so the result loads in
llama.cpp and in Lucebox alike:

- zero-centred RMSNorm weights are stored as `1 + w` (every norm but `linear_attn.norm`);
- `A_log` becomes `ssm_a = -exp(A_log)`, `dt_bias` becomes `ssm_dt.bias`, the conv kernel
  `[C, 1, K]` is squeezed to `[C, K]`;
- `q_proj` keeps its per-head `[q | gate]` interleave;
- with fewer GDN key heads than value heads, value heads move from HF's grouped order to the tiled
  order (`layout.reorder_v_heads`) in the V rows of `attn_qkv`, `attn_gate`, `ssm_beta`,
  `ssm_alpha`, `ssm_a`, `ssm_dt.bias`, the conv's V channels and the columns of `ssm_out`.

Transforms run in float32 (llama.cpp runs them in the checkpoint dtype, so for bf16 checkpoints its
`1 + w` is rounded to bf16 where ours is not). Vision (`model.visual.*`) and MTP (`mtp.*`) weights
are skipped. Tensors are read, transformed and written one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lucebox_core.checkpoint import (Checkpoint, TensorSource, Transform, check_output_type, check_sources,
                                     converted_data, identity, read_hf_config, write_converted)
from lucebox_core.errors import LuceboxError
from lucebox_core.specs import CONVERTED_TYPES

from . import layout
from . import vocab as vocab_source
from .synth import tensor_plans

TYPES = CONVERTED_TYPES
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
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
        add(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight")
        add(blk + "ffn_up.weight", hf + "mlp.up_proj.weight")
        add(blk + "ffn_down.weight", hf + "mlp.down_proj.weight")
    add("output_norm.weight", prefix + "norm.weight", _plus_one)
    if not cfg.tied_output:
        add("output.weight", "lm_head.weight")
    return sources


def _read_config(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    config, text = read_hf_config(hf_dir, MODEL_TYPES, "a dense Qwen3.5")
    if text is not config and text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise LuceboxError(
            f"{hf_dir / 'config.json'}: text_config.model_type {text.get('model_type')!r} is not qwen3_5_text"
        )
    return config, text


def convert(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the checkpoint in `hf_dir` to a `type` (f32, f16, bf16, q8_0) GGUF at `path`.

    The vocabulary comes from `vocab` (a GGUF to copy `tokenizer.*` keys from) when given, else
    from the folder's `tokenizer.json`; it is padded with `[PAD{i}]` tokens to the model's size.
    """
    hf_dir = Path(hf_dir)
    check_output_type(type, TYPES)
    config, text = _read_config(hf_dir)
    checkpoint = Checkpoint(hf_dir)
    prefix = checkpoint.text_prefix(hf_dir)
    try:
        cfg = layout.Qwen35Config.from_hf_config(text, tied_output="lm_head.weight" not in checkpoint)
    except ValueError as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: {exc}") from None

    tokens = _vocabulary(hf_dir, vocab)
    try:
        tokens.pad_to(cfg.vocab)
    except ValueError as exc:
        raise LuceboxError(f"{vocab or hf_dir / 'tokenizer.json'}: {exc} (vocab_size {cfg.vocab})") from None

    sources = _sources(cfg, prefix)
    check_sources(checkpoint, sources, prefix, hf_dir, family="qwen35", skipped=_SKIPPED_PREFIXES)
    plans = tensor_plans(cfg, type)

    def add_metadata(writer: Any) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_converted(path, hf_dir, config, arch=layout.ARCH, type=type, tensors=plans,
                           data=converted_data(checkpoint, sources), add_metadata=add_metadata)


def _vocabulary(hf_dir: Path, vocab: str | Path | None) -> vocab_source.Vocab:
    if vocab is not None:
        return vocab_source.from_gguf(vocab)
    found = vocab_source.from_hf_folder(hf_dir)
    if found is None:
        raise LuceboxError(
            f"{hf_dir}: no tokenizer.json; pass a vocabulary GGUF (--vocab FILE) to copy the tokenizer from"
        )
    return found
