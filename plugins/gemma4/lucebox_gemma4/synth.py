"""Random-weight gemma4 GGUF files with llama.cpp's exact layout and metadata, and DFlash drafters for them.

Weights look like a fresh initialisation: matrices zero-mean with std 0.02 (random quantized blocks of the
file's types, never encoded from floats), norms in [0.9, 1.1], the per-layer output scale in [0.5, 1],
router scales near 1, the full layers' `rope_freqs` as llama.cpp's converter writes them. The vocabulary is
the real Gemma-4 tokenizer (262,144 tokens with its control tokens), the chat template Gemma-4-31B-it's.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from lucebox_core import gguf_out
from lucebox_core.errors import LuceboxError
from lucebox_core.filetypes import file_type
from lucebox_core.gguf_out import TensorPlan
from lucebox_core.ggufio import GGUFFile
from lucebox_core.specs import SYNTHESIZED_TYPES
from lucebox_core.speculative.dflash import DraftConfig, default_target_layers
from lucebox_core.speculative.draft_writer import write_random_draft
from lucebox_core.synthetic import write_random_model
from lucebox_core.vocab import Vocab, from_gguf

from . import layout
from .model import GEMMA4_MASK_TOKEN_ID

TYPES = SYNTHESIZED_TYPES
DRAFT_ARCH = "gemma4-dflash-draft"


def packaged_vocab_path() -> Path:
    return Path(str(resources.files("lucebox_gemma4") / "data" / "ggml-vocab-gemma-4.gguf"))


def packaged_chat_template() -> str:
    return (resources.files("lucebox_gemma4") / "data" / "gemma4-chat-template.jinja").read_text(encoding="utf-8")


def synthetic_vocab(vocab_path: str | Path | None, size: int) -> Vocab:
    """The real Gemma-4 vocabulary (or `vocab_path`'s), cut or padded with control tokens to `size`, with the
    Gemma-4-31B-it chat template."""
    vocab = from_gguf(vocab_path or packaged_vocab_path())
    if len(vocab) > size:  # a tiny test model with a smaller table: keep the first ids (the control tokens)
        del vocab.tokens[size:], vocab.token_types[size:]
        if vocab.scores is not None:
            del vocab.scores[size:]
        vocab.merges = []
    vocab.pad_to(size)
    vocab.keys["tokenizer.chat_template"] = (packaged_chat_template(), GGUFValueType.STRING, None)
    return vocab


def tensor_plans(cfg: layout.Gemma4Config, type: str) -> list[TensorPlan]:
    """The tensors of a `type` file of `cfg`, in file order, with their ggml types."""
    return gguf_out.tensor_plans(layout.tensor_shapes(cfg), type, n_layer=cfg.n_layer, tied_output=cfg.tied_output)


def _small_tensor_rule(cfg: layout.Gemma4Config):
    def small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        n = int(np.prod(shape))
        if name == "rope_freqs.weight":
            return layout.rope_freq_factors(cfg)
        if name.endswith(("_norm.weight", "norm_1.weight", "norm_2.weight", "ffn_gate_inp.scale")):
            return rng.uniform(0.9, 1.1, n)
        if name.endswith("layer_output_scale.weight"):
            return rng.uniform(0.5, 1.0, n)
        if name.endswith("ffn_down_exps.scale"):
            return rng.uniform(0.5, 1.5, n)
        if name.endswith("ffn_gate_inp.weight"):
            return rng.normal(0.0, 0.02, n)
        raise ValueError(f"no synthetic rule for small tensor {name}")

    return small_tensor


def write(path: str | Path, *, size: str = "tiny", type: str = "f32", seed: int = 0,
          vocab: str | Path | None = None) -> Path:
    """Write a random-weight gemma4 GGUF of `size` (tiny, tiny-moe, 26b-a4b, 31b) and `type` to `path`."""
    try:
        cfg = layout.size(size)
        file_type(type, TYPES)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    tokens = synthetic_vocab(vocab, cfg.vocab)

    def add_metadata(writer) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_random_model(path, tensor_plans(cfg, type), arch=layout.ARCH, title="Gemma-4", size=size, type=type,
                              seed=seed, small_tensor=_small_tensor_rule(cfg), add_metadata=add_metadata)


# -- DFlash drafters -------------------------------------------------------------------------------


def draft_config(target: layout.Gemma4Config, size: str) -> DraftConfig:
    """A drafter for `target`: `full` has z-lab's Gemma-4 drafters' shape (5 layers, 4 sliding (window 2048)
    then 1 full, 128-dim heads, FFN 2x hidden for the 26B-A4B / 31B, 6 captured layers); `tiny` two layers."""
    hidden = target.hidden
    if size == "tiny":
        return DraftConfig(
            architecture=DRAFT_ARCH, n_layer=2, hidden=hidden, ffn=2 * hidden, n_head=4, n_head_kv=2, head_dim=64,
            eps=target.eps, rope_theta=1e6, block_size=16,
            target_layer_ids=default_target_layers(target.n_layer, min(3, target.n_layer)),
            mask_token_id=GEMMA4_MASK_TOKEN_ID, vocab=target.vocab, sliding_window=8,
            sliding_window_pattern=(True, False),
        )
    if size == "full":
        n_head = 64 if hidden >= 4096 else 32
        return DraftConfig(
            architecture=DRAFT_ARCH, n_layer=5, hidden=hidden, ffn=2 * hidden, n_head=n_head, n_head_kv=8,
            head_dim=128, eps=target.eps, rope_theta=1e6, block_size=16,
            target_layer_ids=default_target_layers(target.n_layer, 6), mask_token_id=GEMMA4_MASK_TOKEN_ID,
            vocab=target.vocab, sliding_window=2048, sliding_window_pattern=(True, True, True, True, False),
        )
    raise LuceboxError(f"unknown {DRAFT_ARCH} size {size!r}; choose one of tiny, full")


def _target_config(target: str | Path) -> layout.Gemma4Config:
    target_file = GGUFFile(target)
    metadata = {key: target_file.get(key) for key in target_file.keys()
                if not key.startswith("tokenizer.") or key == "tokenizer.ggml.tokens"}
    return layout.Gemma4Config.from_gguf_metadata(metadata, tensor_names=target_file.tensors, source=str(target))


def write_draft(path: str | Path, *, size: str = "tiny", type: str = "f32", seed: int = 0,
                vocab: str | Path | None = None, target: str | Path | None = None) -> Path:
    """Write a random DFlash drafter (Lucebox's `gemma4-dflash-draft` layout) for the gemma4 GGUF `target`."""
    if target is None:
        raise LuceboxError(f"--arch {DRAFT_ARCH} needs --target FILE: the gemma4 GGUF the drafter is for")
    cfg = draft_config(_target_config(target), size)
    return write_random_draft(path, cfg, type=type, seed=seed, size=size,
                              name=f"DFlash draft {size} RANDOM WEIGHTS (synthetic, seed {seed}) for {Path(target).name}")
