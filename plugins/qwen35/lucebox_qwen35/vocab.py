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
