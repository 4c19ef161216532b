"""Write the Laguna-style BPE tokenizer that `lucebox-laguna` ships (`lucebox_laguna/data/tokenizer.json` and
`tokenizer_config.json`), since Poolside's own tokenizer is not available offline.

What it shares with Laguna-XS.2's tokenizer: byte-level BPE with llama.cpp's `laguna` pre-tokenizer (lines
split from newline runs first, then the Qwen2 regex), the control tokens its chat template writes, and the ids
the model's config names (`〈|EOS|〉` 2 is BOS and an end token, the padding token 9, `</assistant>` 24). The
other control ids and the merges (trained here on this repository's text, a few thousand) are Lucebox's own;
the converters pad the table to the model's 100,352 entries.

It also writes tokenizer test vectors for it, in llama.cpp's test-tokenizer-0 form (`laguna-vocab.inp`: inputs
separated by lines `__ggml_vocab_test__`; `.out`: the ids of each, no BOS, special text not parsed), made by
transformers' own tokenizer of `tokenizer.json` over llama.cpp's tokenizer test inputs and chat/code samples.

usage: python scripts/laguna_vocab.py [OUT_DIR]   (default: plugins/laguna/lucebox_laguna/data)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
MERGED_VOCAB = 8192  # trained entries (control tokens and the byte alphabet included)
LINES = r"[^\n]+|[\n]+"
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# id -> text of the control tokens; the ids 2, 9 and 24 are Laguna-XS.2's, the rest Lucebox's choice.
CONTROL_TOKENS = {
    0: "〈|UNK|〉", 1: "〈|BOS|〉", 2: "〈|EOS|〉", 9: "〈|PAD|〉",
    10: "<system>", 11: "</system>", 12: "<user>", 13: "</user>", 14: "<tool_response>", 15: "</tool_response>",
    16: "<think>", 17: "</think>", 18: "<tool_call>", 19: "</tool_call>", 20: "<arg_key>", 21: "</arg_key>",
    22: "<arg_value>", 23: "<assistant>", 24: "</assistant>", 25: "</arg_value>",
}
N_CONTROL = 32  # ids below this are control tokens (unnamed ones reserved)


def control_texts() -> list[str]:
    return [CONTROL_TOKENS.get(i, f"〈|reserved_{i}|〉") for i in range(N_CONTROL)]


def corpus() -> list[str]:
    files = sorted(p for pattern in ("**/*.md", "**/*.py") for p in ROOT.glob(pattern)
                   if ".venv" not in p.parts and "node_modules" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LINES), behavior="isolated"),
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=MERGED_VOCAB, special_tokens=control_texts(), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    return tokenizer


LLAMA_CPP_INPUTS = ROOT.parent / "shared" / "fixtures" / "vocab" / "ggml-vocab-qwen35.gguf.inp"
SEPARATOR = "\n__ggml_vocab_test__\n"
SAMPLES = [
    "<user>\nWhat is 2+2?\n</user>\n<assistant>\n</think>",
    "def add(a, b):\n    return a + b\n\n\n\nprint(add(1, 2))\r\n",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "It's 3.14159 — naïve café, 東京, Привет мир! 🚀🚀",
    "   leading spaces\t\ttabs\n\n\nand\n \n newlines   ",
]


def write_vectors(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    inputs = LLAMA_CPP_INPUTS.read_bytes().decode("utf-8").split(SEPARATOR) if LLAMA_CPP_INPUTS.is_file() else []
    inputs = [text for text in inputs if text] + SAMPLES
    ids = [tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] for text in inputs]
    (out / "laguna-vocab.inp").write_text(SEPARATOR.join(inputs), encoding="utf-8")
    (out / "laguna-vocab.out").write_text("".join(" ".join(map(str, row)) + "\n" for row in ids), encoding="utf-8")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "plugins/laguna/lucebox_laguna/data"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build()
    for text in control_texts():
        assert tokenizer.token_to_id(text) == control_texts().index(text)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
        "bos_token": "〈|EOS|〉", "eos_token": "〈|EOS|〉", "pad_token": "〈|PAD|〉", "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    write_vectors(out)
    print(f"wrote {out}/tokenizer.json ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
