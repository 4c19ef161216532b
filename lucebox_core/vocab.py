"""Tokenizer metadata (`tokenizer.*` GGUF keys) for files a family writes: the `Vocab` record, and two
sources for it, a vocab-only (or any) GGUF, copied verbatim, and a Hugging Face folder's BPE `tokenizer.json`
(+ `tokenizer_config.json`). A family adds its own synthetic vocabulary on top (control tokens, padding, its
chat template)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
from gguf import GGUFValueType, TokenType

from .errors import GGUFError, LuceboxError
from .ggufio import GGUFFile

PAD_TOKEN = re.compile(r"\[PAD\d+\]")

_ARRAY_KEYS = {
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.token_type": "token_types",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.scores": "scores",
}


@attrs.define
class Vocab:
    """The `tokenizer.*` keys of a GGUF file.

    The four per-token arrays are lists; every other key sits in `keys` as
    `(value, GGUF value type, array element type or None)`, written back unchanged.
    """

    tokens: list[str]
    token_types: list[int]
    merges: list[str] = attrs.Factory(list)
    scores: list[float] | None = None
    keys: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = attrs.Factory(dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def id_of(self, text: str) -> int | None:
        try:
            return self.tokens.index(text)
        except ValueError:
            return None

    def set_id(self, role: str, token_id: int | None) -> None:
        """Set `tokenizer.ggml.<role>_token_id` (bos, eos, eot, padding...); None removes it."""
        key = f"tokenizer.ggml.{role}_token_id"
        if token_id is None:
            self.keys.pop(key, None)
        else:
            self.keys[key] = (int(token_id), GGUFValueType.UINT32, None)

    def pad_to(self, size: int, token_type: int = TokenType.UNUSED) -> None:
        """Append `[PAD{i}]` tokens up to `size` entries, as llama.cpp's converter does."""
        if len(self.tokens) > size:
            raise ValueError(f"the vocabulary has {len(self.tokens)} tokens, more than the model's {size}")
        for i in range(len(self.tokens), size):
            self.tokens.append(f"[PAD{i}]")
            self.token_types.append(int(token_type))
            if self.scores is not None:
                self.scores.append(-1000.0)

    def add_to_writer(self, writer: Any) -> None:
        writer.add_key_value("tokenizer.ggml.tokens", self.tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
        writer.add_key_value(
            "tokenizer.ggml.token_type", [int(t) for t in self.token_types], GGUFValueType.ARRAY, GGUFValueType.INT32
        )
        if self.scores is not None:
            writer.add_key_value("tokenizer.ggml.scores", self.scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        if self.merges:
            writer.add_key_value("tokenizer.ggml.merges", self.merges, GGUFValueType.ARRAY, GGUFValueType.STRING)
        for key, (value, vtype, sub) in self.keys.items():
            writer.add_key_value(key, value, vtype, sub)


# -- sources -----------------------------------------------------------------------------------


def from_gguf(path: str | Path) -> Vocab:
    """Every `tokenizer.*` key of a GGUF file (typically a vocab-only one)."""
    path = Path(path)
    arrays: dict[str, Any] = {}
    keys: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    source = GGUFFile(path)
    for key in source.keys():
        if not key.startswith("tokenizer."):
            continue
        if key in _ARRAY_KEYS:
            arrays[_ARRAY_KEYS[key]] = source.get(key)
        else:
            keys[key] = (source.get(key), *source.value_type(key))
    if "tokens" not in arrays:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens key, so no vocabulary to copy")
    n = len(arrays["tokens"])
    arrays.setdefault("token_types", [int(TokenType.NORMAL)] * n)
    if len(arrays["token_types"]) != n:
        raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(arrays['token_types'])} entries for {n} tokens")
    return Vocab(keys=keys, **arrays)


def _looks_special(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry


def from_hf_folder(hf_dir: Path, *, pre: str = "qwen35") -> Vocab | None:
    """A gpt2-style BPE vocabulary from `tokenizer.json` (+ `tokenizer_config.json`), or None if absent."""
    tokenizer_json = hf_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        return None
    try:
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        model = data["model"]
    except (ValueError, KeyError) as exc:
        raise LuceboxError(f"{tokenizer_json}: not a tokenizers JSON file ({exc})") from None
    if model.get("type") != "BPE":
        raise LuceboxError(f"{tokenizer_json}: tokenizer model is {model.get('type')!r}; only BPE converts")
    by_id: dict[int, tuple[str, int]] = {i: (tok, int(TokenType.NORMAL)) for tok, i in model["vocab"].items()}
    for added in data.get("added_tokens", []):
        text = added["content"]
        special = added.get("special") or _looks_special(text)
        by_id[int(added["id"])] = (text, int(TokenType.CONTROL if special else TokenType.USER_DEFINED))
    size = max(by_id) + 1
    tokens = [by_id.get(i, (f"[PAD{i}]", int(TokenType.UNUSED)))[0] for i in range(size)]
    types = [by_id.get(i, ("", int(TokenType.UNUSED)))[1] for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = Vocab(tokens=tokens, token_types=types, merges=merges)
    vocab.keys["tokenizer.ggml.model"] = ("gpt2", GGUFValueType.STRING, None)
    vocab.keys["tokenizer.ggml.pre"] = (pre, GGUFValueType.STRING, None)

    config_path = hf_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    model_config: dict[str, Any] = {}
    if (hf_dir / "config.json").is_file():
        model_config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
        model_config = {**model_config.get("text_config", {}), **model_config}
    index = {text: i for i, text in enumerate(tokens)}
    for role, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        text = _token_text(config.get(key))
        token_id = index.get(text) if text else None
        if token_id is None:
            fallback = model_config.get(f"{key}_id")
            token_id = fallback[0] if isinstance(fallback, list) and fallback else fallback
        if isinstance(token_id, int):
            vocab.set_id(role, token_id)
    if "add_bos_token" in config:
        vocab.keys["tokenizer.ggml.add_bos_token"] = (bool(config["add_bos_token"]), GGUFValueType.BOOL, None)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        vocab.keys["tokenizer.chat_template"] = (template, GGUFValueType.STRING, None)
    return vocab
