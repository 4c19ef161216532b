"""Random-weight laguna GGUF files with llama.cpp's exact layout and metadata, and the family's vocabulary.

Weights look like a fresh initialisation: matrices zero-mean with std 0.02 (random quantized blocks of the
file's types, never encoded from floats), norms in [0.9, 1.1], the router's selection bias small. The
vocabulary is the Laguna-style BPE shipped in `data/` (see `scripts/laguna_vocab.py`), padded to the model's
100,352 entries; the chat template is Laguna-XS.2's.
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
from lucebox_core.specs import SYNTHESIZED_TYPES
from lucebox_core.synthetic import router_skew_scale, with_router_skew, write_random_model
from lucebox_core.vocab import Vocab, from_gguf, from_hf_folder

from . import layout

TYPES = SYNTHESIZED_TYPES
END_OF_TURN = "</assistant>"  # ends an assistant turn: an end-of-generation token besides 〈|EOS|〉


def data_dir() -> Path:
    return Path(str(resources.files("lucebox_laguna") / "data"))


def packaged_chat_template() -> str:
    return (data_dir() / "laguna-xs2-chat-template.jinja").read_text(encoding="utf-8")


def laguna_vocab(vocab_path: str | Path | None, size: int) -> Vocab:
    """The packaged Laguna-style vocabulary (or `vocab_path`'s, a GGUF), cut or padded to `size`, with
    Laguna-XS.2's chat template and `</assistant>` as the end-of-turn token."""
    if vocab_path is not None:
        vocab = from_gguf(vocab_path)
    else:
        vocab = from_hf_folder(data_dir(), pre="laguna")
        assert vocab is not None  # the packaged tokenizer.json is always there
    if len(vocab) > size:  # a test model with a smaller table: keep the first ids (the control tokens)
        del vocab.tokens[size:], vocab.token_types[size:]
        if vocab.scores is not None:
            del vocab.scores[size:]
        kept = set(vocab.tokens)
        vocab.merges = [m for m in vocab.merges if "".join(m.split(" ", 1)) in kept and
                        all(part in kept for part in m.split(" ", 1))]
    vocab.pad_to(size)
    end_of_turn = vocab.id_of(END_OF_TURN)
    if end_of_turn is not None:
        vocab.set_id("eot", end_of_turn)
    vocab.keys.setdefault("tokenizer.chat_template", (packaged_chat_template(), GGUFValueType.STRING, None))
    return vocab


def tensor_plans(cfg: layout.LagunaConfig, type: str) -> list[TensorPlan]:
    """The tensors of a `type` file of `cfg`, in file order, with their ggml types."""
    return gguf_out.tensor_plans(layout.tensor_shapes(cfg), type, n_layer=cfg.n_layer, tied_output=cfg.tied_output)


def _small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape))
    if name.endswith("norm.weight"):
        return rng.uniform(0.9, 1.1, n)
    if name.endswith("exp_probs_b.bias"):
        return rng.normal(0.0, 0.01, n)
    if name.endswith("ffn_gate_inp.weight"):
        return rng.normal(0.0, 0.02, n)
    raise ValueError(f"no synthetic rule for small tensor {name}")


def write(path: str | Path, *, size: str = "tiny", type: str = "f32", seed: int = 0,
          vocab: str | Path | None = None, router_skew: float | None = None) -> Path:
    """Write a random-weight laguna GGUF of `size` (tiny, xs2) and `type` to `path`; `router_skew` F: routers
    biased toward a hot set of experts per layer, about F of the picks (`synthetic.with_router_skew`)."""
    try:
        cfg = layout.size(size)
        file_type(type, TYPES)
        if router_skew is not None:  # out of reach: refused before anything is written
            router_skew_scale(router_skew, cfg.n_expert, cfg.n_expert_used)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    tokens = laguna_vocab(vocab, cfg.vocab)

    def add_metadata(writer) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    label = size if router_skew is None else f"{size} router skew {router_skew:g}"
    return write_random_model(path, tensor_plans(cfg, type), arch=layout.ARCH, title="Laguna", size=label,
                              type=type, seed=seed, add_metadata=add_metadata,
                              small_tensor=with_router_skew(_small_tensor, router_skew, cfg.n_expert_used))
