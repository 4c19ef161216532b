"""Tokenizer metadata (`tokenizer.*` GGUF keys) for written qwen35 files.

Three sources: a vocab-only GGUF (copied verbatim), a Hugging Face folder's `tokenizer.json`
(+ `tokenizer_config.json`), and the synthetic vocabulary: the packaged Qwen-family BPE vocab padded
to the real Qwen3.5 size with the reasoning / tool-call control tokens added.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from gguf import GGUFValueType, TokenType

from lucebox_core.vocab import PAD_TOKEN, Vocab, from_gguf, from_hf_folder  # noqa: F401 (the family's sources)

# The reasoning / tool-call tokens the Qwen3.5 chat template emits, at their Qwen3 ids: in the
# packaged 151,936-token vocabulary those ids hold `[PAD...]` placeholders, so no real token or
# merge moves.
CHAT_CONTROL_TOKENS: dict[str, int] = {
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}




def packaged_vocab_path() -> Path:
    return Path(str(resources.files("lucebox_qwen35") / "data" / "ggml-vocab-qwen35.gguf"))


def packaged_chat_template() -> str:
    return (resources.files("lucebox_qwen35") / "data" / "qwen35-chat-template.jinja").read_text(encoding="utf-8")


def synthetic(vocab_path: str | Path | None, size: int) -> Vocab:
    """The vocabulary of a synthetic qwen35 model: `vocab_path` (default: the packaged one) with the
    chat control tokens added, padded with control tokens to `size`, Qwen3.5's special ids and the
    packaged Qwen3.5 chat template."""
    vocab = from_gguf(vocab_path or packaged_vocab_path())
    for text, preferred in CHAT_CONTROL_TOKENS.items():
        token_id = vocab.id_of(text)
        if token_id is None:
            if preferred < len(vocab) and PAD_TOKEN.fullmatch(vocab.tokens[preferred]):
                token_id = preferred
                vocab.tokens[token_id] = text
            else:
                token_id = len(vocab)
                vocab.tokens.append(text)
                vocab.token_types.append(int(TokenType.CONTROL))
                if vocab.scores is not None:
                    vocab.scores.append(0.0)
        vocab.token_types[token_id] = int(TokenType.CONTROL)
    vocab.pad_to(size, TokenType.CONTROL)
    # Qwen3.5 ends a chat turn with <|im_end|> (its chat EOS) and pads with <|endoftext|>.
    im_end, endoftext = vocab.id_of("<|im_end|>"), vocab.id_of("<|endoftext|>")
    if im_end is not None:
        vocab.set_id("eos", im_end)
        vocab.set_id("eot", im_end)
    if endoftext is not None:
        vocab.set_id("padding", endoftext)
        if "tokenizer.ggml.bos_token_id" not in vocab.keys:
            vocab.set_id("bos", endoftext)
    vocab.keys["tokenizer.ggml.add_bos_token"] = (False, GGUFValueType.BOOL, None)
    vocab.keys["tokenizer.chat_template"] = (packaged_chat_template(), GGUFValueType.STRING, None)
    return vocab


# -- Qwen3 (the `qwen3` family) ---------------------------------------------------------------------------

# Qwen3's added tokens past `<|im_end|>` (151645), at their ids in Qwen3's `tokenizer.json`: the first eleven
# are special (control tokens); the tool-call, fill-in-the-middle and reasoning ones are not, and llama.cpp's
# converter makes those that do not look like `<|...|>` user-defined (matched in any text, printed as text).
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED = 151646
QWEN3_PRE = "qwen2"  # Qwen3's pre-tokenizer is Qwen2's (no combining marks kept in words, unlike qwen35)


def packaged_qwen3_chat_template() -> str:
    """Qwen3-0.6B's chat template (tools as JSON in `<tools>`, calls as `<tool_call>{json}</tool_call>`)."""
    return (resources.files("lucebox_qwen35") / "data" / "qwen3-chat-template.jinja").read_text(encoding="utf-8")


def qwen3(vocab_path: str | Path | None, size: int) -> Vocab:
    """The vocabulary of a synthetic qwen3 model: the packaged Qwen-family BPE (Qwen3's 151,643 merged tokens
    and its first three specials) with Qwen3's added tokens at their real ids, the `qwen2` pre-tokenizer, padded
    to `size`, Qwen3's special ids and Qwen3-0.6B's chat template. `vocab_path` (a GGUF) is copied as it is
    instead, only padded, its chat template kept when it has one."""
    if vocab_path is not None:
        vocab = from_gguf(vocab_path)
        vocab.pad_to(size)
        vocab.keys.setdefault("tokenizer.chat_template", (packaged_qwen3_chat_template(), GGUFValueType.STRING, None))
        return vocab
    vocab = from_gguf(packaged_vocab_path())
    for offset, text in enumerate(QWEN3_ADDED_TOKENS):
        token_id = QWEN3_FIRST_ADDED + offset
        if not PAD_TOKEN.fullmatch(vocab.tokens[token_id]):
            raise ValueError(f"{packaged_vocab_path()}: id {token_id} holds {vocab.tokens[token_id]!r}, not padding")
        vocab.tokens[token_id] = text
        looks_special = text.startswith("<|") and text.endswith("|>")
        vocab.token_types[token_id] = int(TokenType.CONTROL if looks_special else TokenType.USER_DEFINED)
    # Past the added tokens: unused padding rows (151669 .. 151935 in the real model's 151,936-row table).
    for token_id in range(QWEN3_FIRST_ADDED + len(QWEN3_ADDED_TOKENS), len(vocab)):
        vocab.token_types[token_id] = int(TokenType.UNUSED)
    vocab.pad_to(size)
    # As llama.cpp converts Qwen3-0.6B: <|im_end|> ends a turn (eos, eot), <|endoftext|> is bos and padding,
    # no BOS is added.
    im_end, endoftext = vocab.id_of("<|im_end|>"), vocab.id_of("<|endoftext|>")
    vocab.set_id("eos", im_end)
    vocab.set_id("eot", im_end)
    vocab.set_id("bos", endoftext)
    vocab.set_id("padding", endoftext)
    vocab.keys["tokenizer.ggml.pre"] = (QWEN3_PRE, GGUFValueType.STRING, None)
    vocab.keys["tokenizer.ggml.add_bos_token"] = (False, GGUFValueType.BOOL, None)
    vocab.keys["tokenizer.chat_template"] = (packaged_qwen3_chat_template(), GGUFValueType.STRING, None)
    return vocab
