"""Random-weight DFlash drafters (`qwen35-dflash-draft`) that fit a given qwen35 or qwen35moe target GGUF.

The drafter's hidden size is the target's (it reads the target's embeddings and output head); the
captured layers follow Lucebox's default rule. `full` has the published Qwen3.5-27B drafter's shape
(5 layers, 32/8 heads x 128, FFN 17408 when the target is 27B; scaled to the target's hidden size
otherwise); `tiny` is one or two small layers for tests. Matrices are random blocks of the requested
type (`kquants`), norms F32 near 1, like the target synthesizer's.
"""

from __future__ import annotations

from pathlib import Path

from lucebox_core.errors import LuceboxError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.speculative.dflash import DraftConfig, default_target_layers
from lucebox_core.speculative.draft_writer import TYPES, write_random_draft  # noqa: F401 (TYPES: the plugin's list)

from . import layout
from .layout_moe import Qwen35MoeConfig
from .model import QWEN35_MASK_TOKEN_ID

ARCH = "qwen35-dflash-draft"
SIZES = ("tiny", "full")


def draft_config(target: layout.Qwen35Config, size: str) -> DraftConfig:
    hidden = target.hidden
    if size == "tiny":
        head_dim = 64
        n_head = max(2, min(4, hidden // head_dim))
        return DraftConfig(
            architecture=ARCH, n_layer=2, hidden=hidden, ffn=2 * hidden, n_head=n_head, n_head_kv=max(1, n_head // 2),
            head_dim=head_dim, eps=target.eps, rope_theta=1e6, block_size=16,
            target_layer_ids=default_target_layers(target.n_layer, min(3, target.n_layer)),
            mask_token_id=QWEN35_MASK_TOKEN_ID, vocab=target.vocab,
        )
    if size == "full":
        head_dim = 128
        n_head = 32 if hidden >= 4096 else max(2, hidden // head_dim)
        ffn = 17408 if hidden == 5120 else 3 * hidden + (-3 * hidden) % 256
        return DraftConfig(
            architecture=ARCH, n_layer=5, hidden=hidden, ffn=ffn, n_head=n_head, n_head_kv=max(1, n_head // 4),
            head_dim=head_dim, eps=target.eps, rope_theta=1e6, block_size=16,
            target_layer_ids=default_target_layers(target.n_layer, 5), mask_token_id=QWEN35_MASK_TOKEN_ID,
            vocab=target.vocab,
        )
    raise LuceboxError(f"unknown {ARCH} size {size!r}; choose one of {', '.join(SIZES)}")


def _target_config(target: str | Path) -> layout.Qwen35Config:
    target_file = GGUFFile(target)
    config_class = {layout.ARCH: layout.Qwen35Config, layout.MOE_ARCH: Qwen35MoeConfig}.get(target_file.architecture)
    if config_class is None:
        raise LuceboxError(f"{target}: architecture {target_file.architecture!r} is not a qwen35 or qwen35moe target")
    # Every key but the token arrays' (the vocabulary size comes from `qwen35.vocab_size` or their length).
    metadata = {key: target_file.get(key) for key in target_file.keys()
                if not key.startswith("tokenizer.") or key == "tokenizer.ggml.tokens"}
    return config_class.from_gguf_metadata(metadata, source=str(target))


def write(path: str | Path, *, size: str = "tiny", type: str = "f32", seed: int = 0, vocab: str | Path | None = None,
          target: str | Path | None = None) -> Path:
    """Write a random DFlash drafter for the qwen35 GGUF `target` to `path`."""
    if target is None:
        raise LuceboxError(f"--arch {ARCH} needs --target FILE: the qwen35 or qwen35moe GGUF the drafter is for")
    cfg = draft_config(_target_config(target), size)
    return write_random_draft(path, cfg, type=type, seed=seed, size=size,
                              name=f"DFlash draft {size} RANDOM WEIGHTS (synthetic, seed {seed}) for {Path(target).name}")
