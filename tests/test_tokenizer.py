"""The GGUF tokenizer against llama.cpp's own test vectors and an independent pure-Python BPE."""

from __future__ import annotations

import itertools
import math
import random
import time
from pathlib import Path

import gguf
import pytest
import regex

from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.tokenizer import Tokenizer, TokenType

VOCAB_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vocab"
QWEN35 = VOCAB_DIR / "ggml-vocab-qwen35.gguf"
GEMMA4 = VOCAB_DIR / "ggml-vocab-gemma-4.gguf"
VOCABS = {"qwen35": QWEN35, "gemma4": GEMMA4}

pytestmark = pytest.mark.skipif(not QWEN35.exists(), reason=f"no vocabulary fixtures at {VOCAB_DIR}")


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """Test vectors as llama.cpp's test-tokenizer-0 reads them.

    Inputs are separated by "\\n__ggml_vocab_test__\\n" (so the newline before each separator is not
    part of the input); the .out file has one line of ids per input. They were made with
    add_special = false (no BOS) and parse_special = false.
    """
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    separator = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        end = raw.find(separator, pos)
        if end < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:end])
        pos = end + len(separator)
    outputs = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(inputs) == len(outputs), vocab
    return [(text, [int(i) for i in line.split()]) for text, line in zip(inputs, outputs)]


VECTORS = [
    pytest.param(name, text, ids, id=f"{name}-{n}")
    for name, path in VOCABS.items()
    if path.exists()
    for n, (text, ids) in enumerate(read_vectors(path))
]


@pytest.fixture(scope="module")
def metadata() -> dict[str, dict]:
    # Read once: opening these vocabularies takes seconds (from_gguf is tested on a small file).
    return {name: GGUFFile(path).metadata for name, path in VOCABS.items()}


@pytest.fixture(scope="module")
def tokenizers(metadata) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_metadata(metadata[name], source=str(path)) for name, path in VOCABS.items()}


@pytest.fixture(scope="module")
def qwen(tokenizers) -> Tokenizer:
    return tokenizers["qwen35"]


@pytest.fixture(scope="module")
def gemma(tokenizers) -> Tokenizer:
    return tokenizers["gemma4"]


# --- llama.cpp's vectors --------------------------------------------------------------------------


@pytest.mark.parametrize("name, text, expected", VECTORS)
def test_llama_cpp_vectors(tokenizers, name, text, expected):
    assert tokenizers[name].encode(text, add_bos=False, parse_special=False) == expected


def test_vectors_cover_what_they_should():
    # The checks above are only worth something if the files hold what we think they hold.
    qwen_inputs = [text for text, _ in read_vectors(QWEN35)]
    assert len(qwen_inputs) == 50 and len(read_vectors(GEMMA4)) == 46
    assert "" in qwen_inputs and "\n\n\n" in qwen_inputs
    assert any("\u0300" in text for text in qwen_inputs)  # combining marks: where qwen35 differs from qwen2


# --- an independent reference: plain-Python BPE as llama.cpp describes it -------------------------

QWEN35_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def references(metadata) -> dict[str, tuple[dict[str, int], dict[tuple[str, str], int]]]:
    """Per vocabulary: token -> id, and (left, right) -> merge rank."""
    result = {}
    for name, meta in metadata.items():
        ranks = {}
        for rank, merge in enumerate(meta["tokenizer.ggml.merges"]):
            left, right = merge[1:].split(" ", 1)  # the first character may itself be a space
            ranks.setdefault((merge[0] + left, right), rank)
        result[name] = ({t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}, ranks)
    return result


def bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the adjacent pair of lowest rank (leftmost on ties) until none is mergeable."""
    while len(symbols) > 1:
        rank, at = min((ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(itertools.pairwise(symbols)))
        if rank == math.inf:
            break
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    return symbols


def gpt2_byte_chars() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def reference_qwen35(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    byte_chars = gpt2_byte_chars()
    ids = []
    for word in regex.findall(QWEN35_SPLIT, text):
        ids += [vocab[s] for s in bpe([byte_chars[b] for b in word.encode()], ranks)]
    return ids


def reference_gemma4(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    ids = []
    for word in regex.findall(r"[^\n]+|\n+", text.replace(" ", "\u2581")):
        for symbol in bpe(list(word), ranks):
            ids += [vocab[symbol]] if symbol in vocab else [vocab[f"<0x{b:02X}>"] for b in symbol.encode()]
    return ids


ATOMS = [
    "Hello", "world", "the", "Qwen", "tokenizer", "llama", "x", "I", "'s", "'LL", "'re", "'d", "don't",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000",
    "0", "7", "42", "2026", "3.14", "½", "٣",
    ".", ",", "!", "?", "...", "(", ")", "{", "}", "<", ">", "<|", "|>", "->", "==", "#", "$", "€", "—", "’", "«",
    "你好", "世界", "龘", "𠀀", "日本語", "한국어", "ไทย", "สวัสดีครับ", "नमस्ते", "العربية", "Ελληνικά", "Привет",
    "e\u0301", "a\u0300\u0300", "n\u0303", "Việt", "\u0301", "\u0308x",
    "🦙", "🚀", "😶\u200d🌫️", "👍🏽", "🇫🇷", "👩\u200d💻", "\u200d", "\ufe0f", "\ue000", "\U0001f9ec",
]  # fmt: skip


def random_texts(seed: int, count: int, *, allow_space_escape: bool) -> list[str]:
    rng = random.Random(seed)
    atoms = ATOMS + (["\u2581"] if allow_space_escape else [])
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def test_qwen35_matches_reference_bpe_on_random_text(qwen, references):
    for text in random_texts(1, 300, allow_space_escape=True):
        assert qwen.encode(text) == reference_qwen35(text, *references["qwen35"]), text


def test_gemma4_matches_reference_bpe_on_random_text(gemma, references):
    for text in random_texts(2, 300, allow_space_escape=True):
        assert gemma.encode(text, add_bos=False) == reference_gemma4(text, *references["gemma4"]), text


def test_gemma4_falls_back_to_byte_tokens(gemma):
    ids = gemma.encode("\U000e0100", add_bos=False)  # a variation selector no merge reaches
    assert [gemma.id_to_token(i) for i in ids] == ["<0xF3>", "<0xA0>", "<0x84>", "<0x80>"]
    assert gemma.decode(ids) == "\U000e0100"


# --- special tokens, BOS, EOG ------------------------------------------------------------------------


def test_parse_special_qwen(qwen):
    im_start = qwen.token_to_id("<|im_start|>")
    assert im_start == 151644 and qwen.is_control(im_start)
    assert qwen.encode("<|im_start|>", parse_special=True) == [im_start]
    plain = qwen.encode("<|im_start|>", parse_special=False)
    assert len(plain) > 1 and im_start not in plain
    assert qwen.decode(plain) == "<|im_start|>"
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    ids = qwen.encode(chat, parse_special=True)
    assert ids[0] == im_start and qwen.token_to_id("<|im_end|>") in ids
    assert qwen.decode(ids) == chat
    assert qwen.decode(ids, skip_special=True) == "user\nHi\n"


def test_parse_special_gemma(gemma):
    turn = gemma.token_to_id("<|turn>")
    assert gemma.encode("<|turn>model", add_bos=False, parse_special=True) == [turn, gemma.token_to_id("model")]
    assert turn not in gemma.encode("<|turn>model", add_bos=False)
    # User-defined tokens are cut out even without parse_special, as llama.cpp does...
    closing = gemma.token_to_id("<tool_response|>")
    assert gemma.encode("x<tool_response|>", add_bos=False) == [gemma.token_to_id("x"), closing]
    # ...except those llama.cpp promotes to control because they end generation.
    opening = gemma.token_to_id("<|tool_response>")
    assert opening not in gemma.encode("<|tool_response>", add_bos=False)
    assert gemma.encode("<|tool_response>", add_bos=False, parse_special=True) == [opening]
    assert gemma.decode([closing], skip_special=True) == "<tool_response|>"
    assert gemma.decode([opening], skip_special=True) == ""


def test_bos(qwen, gemma):
    assert not qwen.add_bos and qwen.bos_id == 151643
    assert qwen.encode("Hi") == qwen.encode("Hi", add_bos=False) == [13048]
    assert qwen.encode("Hi", add_bos=True) == [151643, 13048]
    assert gemma.add_bos and gemma.bos_id == 2
    assert gemma.encode("Hi")[0] == 2 and gemma.encode("Hi")[1:] == gemma.encode("Hi", add_bos=False)
    assert gemma.encode("") == [2] and gemma.encode("", add_bos=False) == []
    assert gemma.decode(gemma.encode("Hi"), skip_special=True) == "Hi"


def test_end_of_generation_ids(qwen, gemma):
    assert qwen.eos_id == 151643
    assert qwen.eot_ids == {qwen.token_to_id("<|endoftext|>"), qwen.token_to_id("<|im_end|>")}
    assert gemma.eos_id == 1
    assert gemma.eot_ids == {gemma.token_to_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")}
    # `</s>` is ordinary text in both vocabularies (an HTML tag), not an end of generation.
    assert qwen.token_to_id("</s>") not in qwen.eot_ids and gemma.token_to_id("</s>") not in gemma.eot_ids
    assert all(qwen.is_eog(i) for i in qwen.eot_ids) and not qwen.is_eog(qwen.token_to_id("</s>"))


def test_padded_vocabulary(qwen, metadata):
    # Like the synthetic models: the real size, with reasoning / tool-call control tokens appended.
    meta = dict(metadata["qwen35"])
    added = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *added]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[TokenType.CONTROL] * len(added)]
    padded = Tokenizer.from_metadata(meta, source="padded")
    think = padded.token_to_id("<think>")
    assert think == qwen.vocab_size and padded.vocab_size == qwen.vocab_size + 4
    assert padded.encode("<think>\nok</think>", parse_special=True)[0] == think
    assert think not in padded.encode("<think>")
    # The "[PADnnnnnn]" filler tokens (user-defined in this file) name no text: they print nothing, text that
    # spells one is plain text, and they are listed as never to be generated.
    pad = padded.token_to_id("[PAD151700]")
    assert padded.decode([pad]) == "" and pad not in padded.encode("a[PAD151700]b")
    assert padded.decode(padded.encode("a[PAD151700]b")) == "a[PAD151700]b"
    unused = padded.unused_ids()
    assert pad in unused and len(unused) == sum(t.startswith("[PAD") for t in meta["tokenizer.ggml.tokens"])
    assert think not in unused and qwen.token_to_id("<|im_end|>") not in unused


def _partition_token_by_token(tokenizer: Tokenizer, specials: list[int], text: str,
                              parse_special: bool) -> list[str | int]:
    """llama.cpp's `tokenizer_st_partition` as it is written: every special token in turn (`specials`, longest
    first), splits every piece of text left (the reference the one-pass search must equal)."""
    fragments: list[str | int] = [text] if text else []
    for token_id in specials:
        token_text = tokenizer.id_to_token(token_id)
        if tokenizer.is_control(token_id) and not parse_special:
            continue
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or token_text not in fragment:
                split.append(fragment)
                continue
            for n, piece in enumerate(fragment.split(token_text)):
                if n:
                    split.append(token_id)
                if piece:
                    split.append(piece)
        fragments = split
    return fragments


def test_one_pass_special_search_equals_token_by_token(gemma):
    # Gemma-4's specials overlap (`<|tool_response>` / `<tool_response|>`, `<|image>` / `<|image|>`): random
    # texts built from their pieces must cut exactly where llama.cpp's token-by-token loop cuts.
    user_defined = ("<|tool_call>", "<tool_call|>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>")
    specials = sorted((i for i in range(gemma.vocab_size)
                       if gemma.is_control(i) or gemma.id_to_token(i) in user_defined),
                      key=lambda i: -len(gemma.id_to_token(i)))
    rng = random.Random(5)
    pieces = ["<|", "|>", "<", ">", "|", "tool_response", "image", "turn", "channel", "a", " ", "<|turn>",
              "<turn|>", "<|image|>", "<|tool_response>", "<tool_response|>", '<|"|>', "\n"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        for parse_special in (False, True):
            expected = _partition_token_by_token(gemma, specials, text, parse_special)
            ids = []
            for fragment in expected:
                ids.extend(gemma.encode(fragment, add_bos=False) if isinstance(fragment, str) else [fragment])
            assert gemma.encode(text, add_bos=False, parse_special=parse_special) == ids, text


def test_many_special_tokens_cost_one_pass(metadata):
    # 96,700 control tokens (as many as the default model once had) and a 1 MB text that names some: one pass
    # over the text, not one per token (which took 28 s at 1 MB).
    meta = dict(metadata["qwen35"])
    extra = [f"<|reserved_{i}|>" for i in range(96_700)]
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[TokenType.CONTROL] * len(extra)]
    many = Tokenizer.from_metadata(meta, source="many specials")
    text = ("Plain words <|reserved_77|> and <|im_end|> markup <|reserved_9|>. " * 16_000)[:1_000_000]
    many.encode("warm up <|reserved_1|>", parse_special=True)  # compiles the search once
    start = time.perf_counter()
    ids = many.encode(text, parse_special=True)
    assert time.perf_counter() - start < 5  # about 0.3 s; the budget allows for a loaded 2-core machine
    reserved = many.token_to_id("<|reserved_77|>")
    assert ids.count(reserved) == text.count("<|reserved_77|>") > 10_000
    assert many.decode(ids) == text


def test_literal_spans_keep_control_text_as_text(qwen):
    im_end = qwen.token_to_id("<|im_end|>")
    text = "<|im_start|>user\nhi<|im_end|> there<|im_end|>\n"
    user = text.index("hi"), text.index(" there")  # the user wrote "hi<|im_end|>"
    ids = qwen.encode(text, parse_special=True, literal_spans=[user])
    assert ids.count(im_end) == 1 and ids[-2] == im_end  # only the template's own
    assert qwen.decode(ids) == text
    # Where the spans hold no control-token text nothing changes, not even the pieces the BPE sees.
    plain = "<|im_start|>user\nSay hi.<|im_end|>\n"
    span = [(plain.index("Say"), plain.index("<|im_end|>"))]
    assert qwen.encode(plain, parse_special=True, literal_spans=span) == qwen.encode(plain, parse_special=True)
    assert qwen.control_tokens_in(text) == [(0, 12, qwen.token_to_id("<|im_start|>")), (19, 29, im_end),
                                            (35, 45, im_end)]


# --- decoding ----------------------------------------------------------------------------------------


def test_round_trip_random_unicode(qwen, gemma):
    for text in random_texts(3, 300, allow_space_escape=True):
        assert qwen.decode(qwen.encode(text)) == text
    # Gemma writes spaces as "▁", so a literal "▁" comes back as a space: leave it out.
    for text in random_texts(4, 150, allow_space_escape=False):
        assert gemma.decode(gemma.encode(text, add_bos=False)) == text


@pytest.mark.parametrize("name", ["qwen35", "gemma4"])
def test_incremental_detokenizer_holds_back_partial_characters(tokenizers, name):
    tok = tokenizers[name]
    text = "A 龘𠀀 🦙😶\u200d🌫️ e\u0301 \U000e0100 ไทย 日本語 done"
    ids = tok.encode(text, add_bos=False)
    partial = [i for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "the text should have characters split across tokens"
    detok = tok.detokenizer()
    chunks = [detok.push(i) for i in ids]
    assert "" in chunks
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert "".join(chunks) + detok.flush() == tok.decode(ids) == text


def test_incremental_detokenizer_on_invalid_bytes(qwen):
    byte_token = {b: qwen.token_to_id(c) for b, c in enumerate(gpt2_byte_chars())}
    detok = qwen.detokenizer()
    assert detok.push(byte_token[0xE4]) == ""  # first of three bytes: wait
    assert detok.push(byte_token[0xBD]) == ""
    assert detok.push(byte_token[ord("A")]) == "\ufffdA"  # "A" proves it can never complete
    assert detok.push(byte_token[0xF0]) == ""
    assert detok.flush() == "\ufffd"  # cut short by the end of the stream
    assert detok.push(byte_token[0xFF]) == "\ufffd"  # never valid: at once
    assert detok.flush() == ""


def test_detokenizer_skip_special(qwen):
    ids = qwen.encode("<|im_start|>hi<|im_end|>", parse_special=True)
    detok = qwen.detokenizer(skip_special=True)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hi"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# --- construction ------------------------------------------------------------------------------------


def test_qwen35_keeps_combining_marks_in_words(qwen):
    # The one difference from qwen2's regex: a mark joins its letter, so Thai "รั" is one piece and,
    # here, one token (qwen2 would split it into two).
    assert qwen.encode("รั") == [124891]


def test_lookups(qwen, gemma):
    assert qwen.vocab_size == 151936 and gemma.vocab_size == 262144
    assert qwen.id_to_token(qwen.token_to_id("Ġhello")) == "Ġhello"
    assert qwen.token_to_id("no such token") is None
    assert gemma.id_to_token(2) == "<bos>" and gemma.is_control(2) and not gemma.is_control(100)


def test_build_is_fast(metadata):
    # The budget is 1-2 s for a 262k vocabulary; allow for a loaded 2-core test machine.
    start = time.perf_counter()
    Tokenizer.from_metadata(metadata["gemma4"])
    assert time.perf_counter() - start < 4


def write_tiny_vocab(path: Path) -> list[str]:
    """A 260-token byte-level vocabulary written by gguf's own writer."""
    writer = gguf.GGUFWriter(path, "qwen2")
    tokens = gpt2_byte_chars() + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def test_from_gguf(tmp_path):
    tokens = write_tiny_vocab(tmp_path / "tiny.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    assert tok.vocab_size == len(tokens) and tok.pre == "qwen35" and not tok.add_bos
    assert tok.encode(" the") == [tokens.index("Ġthe")]
    assert tok.encode(" the<|endoftext|>", parse_special=True)[-1] == len(tokens) - 1
    assert tok.eot_ids == {len(tokens) - 1} and tok.decode(tok.encode(" the t")) == " the t"
    start = time.perf_counter()
    assert Tokenizer.from_gguf(str(tmp_path / "tiny.gguf")) is tok  # cached per file
    assert time.perf_counter() - start < 0.05


def test_merges_that_name_no_token_are_dropped(tmp_path):
    write_tiny_vocab(tmp_path / "tiny.gguf")
    meta = GGUFFile(tmp_path / "tiny.gguf").metadata
    meta["tokenizer.ggml.merges"] = ["x y", *meta["tokenizer.ggml.merges"], "zz"]  # "xy" is no token
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("xy the") == [tok.token_to_id("x"), tok.token_to_id("y"), tok.token_to_id("Ġthe")]


def test_gemma4_newline_runs(gemma):
    # llama.cpp takes a run of newlines whole when the vocabulary has it (its PR 21343).
    for n in range(1, 40):
        whole = gemma.token_to_id("\n" * n)
        ids = gemma.encode("\n" * n, add_bos=False)
        assert ids == [whole] if whole is not None else len(ids) > 1
        assert gemma.decode(ids) == "\n" * n


def test_errors_name_the_key(metadata):
    meta = metadata["qwen35"]
    with pytest.raises(GGUFError, match=r"model\.gguf: tokenizer\.ggml\.tokens"):
        Tokenizer.from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}, source="model.gguf")
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model = 'llama'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.pre = 'nonesuch'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "nonesuch"})
    with pytest.raises(GGUFError, match="duplicate"):
        tokens = meta["tokenizer.ggml.tokens"]
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": [*tokens[:-1], tokens[0]]})
    with pytest.raises(GGUFError, match="token_type"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": [1, 1]})


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        Tokenizer.from_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    write_tiny_vocab(tmp_path / "tiny.gguf")
    truncated.write_bytes((tmp_path / "tiny.gguf").read_bytes()[:3000])
    with pytest.raises(GGUFError, match="truncated"):
        Tokenizer.from_gguf(truncated)
