"""Tokenizers built from GGUF metadata (`tokenizer.ggml.*`), tokenizing exactly as llama.cpp does.

Two vocabulary kinds are supported, both run on the Hugging Face `tokenizers` library (Rust):

- `gpt2`: byte-level BPE (Qwen, Laguna, Llama-3...). Text is split by the pre-tokenizer regexes named
  by `tokenizer.ggml.pre`, each piece's UTF-8 bytes are mapped to GPT-2's printable alphabet, then
  merged by rank.
- `gemma4`: SentencePiece-style BPE. Spaces become `▁`, the text is split only into runs of newlines
  and runs of everything else, merges run on raw characters, and characters that no merge reaches
  fall back to `<0xXX>` byte tokens.

What llama.cpp does around the BPE is done here in Python, in its order: control, unknown and
user-defined tokens are cut out of the text first (longest first; control and unknown ones only
with `parse_special`), BOS is prepended when asked, and the end-of-generation set is built from the
special-token ids plus the token names llama.cpp treats as EOG. The cutting finds every special
token in one pass over the text (one compiled trie), so a vocabulary with a hundred thousand of them
costs what one with ten does.

One departure: the `[PAD{id}]` placeholders llama.cpp's converter (and Lucebox's synthetic models)
put where a vocabulary has no token are treated as unused, whatever type the file gives them: they
name no text, are never matched in text, print nothing, and `unused_ids()` lists them so that
generation never samples them.
"""

from __future__ import annotations

import codecs
import enum
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from tokenizers import Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import GGUFError, LuceboxError

__all__ = ["IncrementalDetokenizer", "TokenType", "Tokenizer"]


class TokenType(enum.IntEnum):
    """Values of `tokenizer.ggml.token_type`."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class _Attr:
    """Token attribute bits as llama.cpp keeps them: a token can gain CONTROL on top of its GGUF type.

    Plain ints rather than an enum.IntFlag: a quarter-million flag operations must take milliseconds.
    """

    NONE = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_ATTR_OF_TYPE = {
    TokenType.NORMAL: _Attr.NORMAL,
    TokenType.UNKNOWN: _Attr.UNKNOWN,
    TokenType.CONTROL: _Attr.CONTROL,
    TokenType.USER_DEFINED: _Attr.USER_DEFINED,
    TokenType.UNUSED: _Attr.UNUSED,
    TokenType.BYTE: _Attr.BYTE,
}

# --- pre-tokenizers -------------------------------------------------------------------------------
# The regexes of llama.cpp's `llm_tokenizer_bpe` (src/llama-vocab.cpp), keyed by `tokenizer.ggml.pre`.
# Each list is applied in order, every regex splitting the pieces the previous one left (matches and
# the text between them both stay pieces): the `isolated` behaviour of HF's `Split`.

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 keeps combining marks (\p{M}) inside words and out of punctuation runs; qwen2 does not.
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LINES = r"[^\n]+|[\n]+"
# What llama.cpp uses when `tokenizer.ggml.pre` is missing or "default".
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@attrs.frozen
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False  # the default when `tokenizer.ggml.add_bos_token` is absent


_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer(_DEFAULT),
    "qwen35": _PreTokenizer((_QWEN35,)),
    **{name: _PreTokenizer((_QWEN2,)) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    "laguna": _PreTokenizer((_LINES, _QWEN2)),
    **{
        name: _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")
    },
    **{name: _PreTokenizer((_GPT2,)) for name in ("gpt-2", "phi-2")},
    # gemma4 splits lines from newline runs only; spaces are escaped to ▁ before (see _build_backend).
    "gemma4": _PreTokenizer((_LINES,), add_bos=True),
}

# --- special-token names ---------------------------------------------------------------------------
# llama.cpp finds these by text when the GGUF does not give their ids, and marks them CONTROL
# (here only among control and user-defined tokens: see Tokenizer._special_token).

_EOT_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOM_NAMES = ("<|eom_id|>",)
# Fill-in-the-middle pad / repo / file-separator tokens end generation in llama.cpp.
_FIM_EOG_NAMES = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip

_SPACE_ESCAPE = "\u2581"  # ▁


def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (printable Latin-1 maps to itself)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {byte: chr(byte) for byte in kept}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


# Turns a byte-level token's text into Latin-1 text whose code points are the token's bytes.
_GPT2_UNMAP = str.maketrans({char: chr(byte) for byte, char in _gpt2_byte_alphabet().items()})


# --- the tokenizer --------------------------------------------------------------------------------


class Tokenizer:
    """A GGUF vocabulary: encode text to ids and back, as llama.cpp does.

    Read-only after construction and safe to share between threads.
    """

    vocab_size: int
    model: str  # `tokenizer.ggml.model`: "gpt2" or "gemma4"
    pre: str  # the pre-tokenizer used
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]  # every id that ends generation
    add_bos: bool

    def __init__(self, metadata: Mapping[str, Any], *, source: str = "") -> None:
        where = source or "<metadata>"
        self.source = source
        self.model = _string(metadata, "tokenizer.ggml.model", where)
        if self.model not in ("gpt2", "gemma4"):
            raise GGUFError(
                f"{where}: tokenizer.ggml.model = {self.model!r} is not supported (supported: gpt2, gemma4)"
            )
        tokens = _string_list(metadata, "tokenizer.ggml.tokens", where)
        self.vocab_size = len(tokens)
        # llama.cpp names empty tokens so that every id has a distinct text.
        self._tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        self._ids = {text: i for i, text in enumerate(self._tokens)}
        if len(self._ids) != self.vocab_size:
            raise GGUFError(f"{where}: tokenizer.ggml.tokens has duplicate entries")
        self._attrs = _token_attrs(metadata, self.vocab_size, where)
        for token_id, text in enumerate(self._tokens):
            if text.startswith("[PAD") and text == f"[PAD{token_id}]":
                self._attrs[token_id] = _Attr.UNUSED  # a placeholder, whatever the file calls it

        if self.model == "gemma4":
            self.pre = "gemma4"  # llama.cpp ignores tokenizer.ggml.pre for this model
        else:
            self.pre = str(metadata.get("tokenizer.ggml.pre") or "default")
        pre = _PRE_TOKENIZERS.get(self.pre)
        if pre is None:
            raise GGUFError(
                f"{where}: tokenizer.ggml.pre = {self.pre!r} is not supported "
                f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
            )

        special = self._special_ids(metadata)
        self.bos_id = special["bos"]
        self.eos_id = special["eos"]
        self.eot_ids = self._eog_ids(special)
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos))
        if self.model == "gemma4":
            self.add_bos = True  # as llama.cpp: Gemma 4 GGUFs that say otherwise are wrong
        if self.add_bos and self.bos_id is None:
            raise GGUFError(f"{where}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")

        # Longest first, as llama.cpp cuts them out of the text.
        specials = [i for i, a in enumerate(self._attrs) if a & (_Attr.CONTROL | _Attr.USER_DEFINED | _Attr.UNKNOWN)]
        specials.sort(key=lambda i: -len(self._tokens[i]))
        self._specials = _SpecialTokens(
            [(self._tokens[i], i, bool(self._attrs[i] & (_Attr.CONTROL | _Attr.UNKNOWN))) for i in specials]
        )
        self._max_token_bytes: int | None = None
        merges = _string_list(metadata, "tokenizer.ggml.merges", where)
        self._backend = _build_backend(self.model, pre, self._ids, merges)

    # --- construction ---

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "") -> Tokenizer:
        """Build from a GGUF metadata mapping; `source` (a path) only names it in error messages."""
        return cls(metadata, source=source)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a GGUF file, reading only its metadata. Cached per file (path, size, mtime)."""
        path = Path(path)
        try:
            stat = path.stat()
        except OSError as exc:
            raise GGUFError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with _FILE_CACHE_LOCK:
            cached = _FILE_CACHE.get(key)
            if cached is not None:
                _FILE_CACHE.move_to_end(key)
                return cached
        from .ggufio import GGUFFile  # here, because it imports torch

        tokenizer = cls(GGUFFile(path).metadata, source=str(path))
        with _FILE_CACHE_LOCK:
            _FILE_CACHE[key] = tokenizer
            while len(_FILE_CACHE) > _FILE_CACHE_SIZE:
                _FILE_CACHE.popitem(last=False)
        return tokenizer

    def _special_ids(self, metadata: Mapping[str, Any]) -> dict[str, int | None]:
        """The ids of BOS, EOS, EOT, EOM and the FIM tokens that end generation; CONTROL-marks named ones."""
        ids: dict[str, int | None] = {}
        for name, key in (
            ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
            ("eom", "eom_token_id"), ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
            ("fim_sep", "fim_sep_token_id"),
        ):  # fmt: skip
            value = metadata.get(f"tokenizer.ggml.{key}")
            # llama.cpp ignores an out-of-range id rather than failing.
            ids[name] = int(value) if value is not None and 0 <= int(value) < self.vocab_size else None
        by_name = {"eot": _EOT_NAMES, "eom": _EOM_NAMES, **_FIM_EOG_NAMES}
        for name, candidates in by_name.items():
            if ids[name] is None:
                ids[name] = next((t for t in map(self._special_token, candidates) if t is not None), None)
        return ids

    def _eog_ids(self, special: dict[str, int | None]) -> frozenset[int]:
        named = (self._special_token(text) for text in _EOG_NAMES)
        ids = [special[name] for name in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")]
        return frozenset(t for t in (*ids, *named) if t is not None)

    def _special_token(self, text: str) -> int | None:
        """The id of `text` if the vocabulary has it as a control or user-defined token.

        llama.cpp also takes ordinary tokens by these names and promotes them to control, but Qwen's
        and Gemma's vocabularies hold `</s>` as plain text (an HTML tag), which must neither stop
        generation nor be hidden; converters type the real ones as control or user-defined.
        Found tokens gain the CONTROL attribute, as in llama.cpp (so `<|tool_response>` is only
        matched in text with `parse_special`).
        """
        token = self._ids.get(text)
        if token is None or not self._attrs[token] & (_Attr.CONTROL | _Attr.USER_DEFINED):
            return None
        self._attrs[token] |= _Attr.CONTROL
        return token

    # --- encoding ---

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`.

        `add_bos` (default: the vocabulary's `add_bos`) prepends BOS. With `parse_special`, control
        tokens written in the text (`<|im_start|>`) become their ids; without it they are tokenized
        as plain text. User-defined tokens are always matched, as in llama.cpp.

        `literal_spans`: `(start, end)` character ranges of `text` where control tokens are not
        recognised even with `parse_special` (what a user wrote inside a rendered chat template). The
        text around them is still encoded in one piece, so spans that hold no control-token text
        change nothing. `text` must then be valid Unicode (see `valid_unicode`), as positions refer to it.
        """
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise LuceboxError(f"{self.source or 'tokenizer'}: no BOS token to add")
            ids.append(self.bos_id)
        valid = valid_unicode(text)
        if literal_spans and len(valid) != len(text):
            raise ValueError("literal_spans need valid Unicode text (see valid_unicode): positions would move")
        fragments = self._specials.split(valid, parse_special, literal_spans)
        texts = [f for f in fragments if isinstance(f, str)]
        if len(texts) == 1:
            encodings = [self._backend.encode(texts[0], add_special_tokens=False)]
        else:  # in parallel, in Rust
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        encoded = iter(encodings)
        for fragment in fragments:
            ids.extend(next(encoded).ids if isinstance(fragment, str) else (fragment,))
        return ids

    def control_tokens_in(self, text: str) -> list[tuple[int, int, int]]:
        """`(start, end, id)` of every control token written in `text`, as `encode(text, parse_special=True)`
        would cut them out (user-defined tokens, which are always cut, are not listed)."""
        fragments = self._specials.split(valid_unicode(text), True, (), only_control=True)
        found, position = [], 0
        for fragment in fragments:
            if isinstance(fragment, str):
                position += len(fragment)
            else:
                end = position + len(self._tokens[fragment])
                found.append((position, end, fragment))
                position = end
        return found

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for: a text of N bytes is at least N / this many tokens."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(
                len(self.token_bytes(i)) if self._attrs[i] & (_Attr.NORMAL | _Attr.BYTE) else len(text.encode())
                for i, text in enumerate(self._tokens)
            )
        return self._max_token_bytes

    # --- decoding ---

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (llama.cpp's `token_to_piece`); may be part of a character."""
        attr = self._attrs[token_id]
        text = self._tokens[token_id]
        if attr & (_Attr.CONTROL | _Attr.UNKNOWN):
            return b"" if skip_special else text.encode()
        if attr & _Attr.USER_DEFINED:
            return text.encode()
        if attr & _Attr.NORMAL:
            if self.model == "gemma4":
                return text.replace(_SPACE_ESCAPE, " ").encode()
            latin1 = text.translate(_GPT2_UNMAP)
            try:
                return latin1.encode("latin-1")
            except UnicodeEncodeError:  # not a byte-level token after all: keep its text
                return text.encode()
        if attr & _Attr.BYTE:
            return bytes([int(text[3:5], 16)]) if len(text) == 6 and text.startswith("<0x") else text.encode()
        return b""  # unused tokens print nothing, as in llama.cpp

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD. `skip_special` drops control tokens."""
        return b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids).decode("utf-8", "replace")

    def detokenizer(self, *, skip_special: bool = False) -> IncrementalDetokenizer:
        """A streaming decoder: feed ids one at a time, get text only once its characters are complete."""
        return IncrementalDetokenizer(self, skip_special=skip_special)

    # --- lookups ---

    def token_to_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text` in the vocabulary (e.g. "<|im_end|>"), or None."""
        return self._ids.get(text)

    def id_to_token(self, id: int) -> str:
        """The vocabulary's spelling of a token (byte-level BPE tokens read like "Ġhello")."""
        return self._tokens[id]

    def is_control(self, id: int) -> bool:
        """True for control tokens (including those llama.cpp promotes to control, like EOG tokens)."""
        return bool(self._attrs[id] & _Attr.CONTROL)

    def is_eog(self, id: int) -> bool:
        return id in self.eot_ids

    def unused_ids(self) -> list[int]:
        """Ids that stand for no text (unused entries, `[PAD{id}]` placeholders): never to be generated."""
        return [i for i, a in enumerate(self._attrs) if a == _Attr.UNUSED]

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"source={self.source!r})"
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, never splitting a UTF-8 character.

    Bytes of a character spread over several tokens are held back until it is complete. A sequence
    that can never complete becomes U+FFFD as soon as the following bytes prove it invalid, or at
    `flush()`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text that `token_id` completes (often "", never a partial character)."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id, skip_special=self._skip_special))

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD; the detokenizer is then ready for a new stream."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class _SpecialTokens:
    """The special tokens of a vocabulary, cut out of a text as llama.cpp's `tokenizer_st_partition` does,
    in one pass.

    llama.cpp takes the tokens longest first and splits every remaining piece of text at each one's
    occurrences (left to right, not overlapping). Searching the text once per token costs a second per
    100 KB with a hundred thousand tokens, so instead one compiled trie finds, at every position, the
    longest special token starting there (the shorter ones starting there are its prefixes); then the
    occurrences are taken in llama.cpp's order, each kept unless it overlaps one kept before. The
    result is the same, token for token.
    """

    def __init__(self, specials: list[tuple[str, int, bool]]):
        """`specials`: `(text, id, needs_parse_special)`, in the order they are cut (longest first)."""
        self._entries = {text: (rank, token_id, needs) for rank, (text, token_id, needs) in enumerate(specials)}
        self._texts = [text for text, _, _ in specials]
        self._pattern: re.Pattern[str] | None = None  # compiled when first needed (~1 s per 100k tokens)
        self._prefixes: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _compiled(self) -> re.Pattern[str]:
        pattern = self._pattern
        if pattern is None:
            with self._lock:
                if self._pattern is None:
                    # A zero-width match at every position where a token starts, capturing the longest one.
                    self._pattern = re.compile(f"(?=({_trie_pattern(self._texts)}))")
                pattern = self._pattern
        return pattern

    def _starting_with(self, longest: str) -> tuple[str, ...]:
        """The special tokens that are prefixes of `longest` (itself included)."""
        found = self._prefixes.get(longest)
        if found is None:
            found = tuple(longest[:n] for n in range(1, len(longest) + 1) if longest[:n] in self._entries)
            self._prefixes[longest] = found
        return found

    def split(self, text: str, parse_special: bool, literal_spans: Sequence[tuple[int, int]] = (),
              *, only_control: bool = False) -> list[str | int]:
        """`text` as pieces of plain text and special-token ids. Control (and unknown) tokens count only
        with `parse_special`, and not where they overlap a literal span; `only_control` ignores the others."""
        if not self._entries or not text:
            return [text] if text else []
        literal = None
        if literal_spans:
            literal = bytearray(len(text))
            for start, end in literal_spans:
                literal[max(0, start) : max(0, end)] = b"\x01" * max(0, min(end, len(text)) - max(0, start))
        found: list[tuple[int, int, int, int]] = []  # (rank, start, end, id)
        for match in self._compiled().finditer(text):
            start = match.start()
            for candidate in self._starting_with(match.group(1)):
                rank, token_id, needs_parse_special = self._entries[candidate]
                if needs_parse_special:
                    end = start + len(candidate)
                    if not parse_special or (literal is not None and literal.find(1, start, end) >= 0):
                        continue
                elif only_control:
                    continue
                found.append((rank, start, start + len(candidate), token_id))
        if not found:
            return [text]
        found.sort()
        taken = bytearray(len(text))
        kept = []
        for _, start, end, token_id in found:
            if taken.find(1, start, end) < 0:
                taken[start:end] = b"\x01" * (end - start)
                kept.append((start, end, token_id))
        kept.sort()
        fragments: list[str | int] = []
        position = 0
        for start, end, token_id in kept:
            if start > position:
                fragments.append(text[position:start])
            fragments.append(token_id)
            position = end
        if position < len(text):
            fragments.append(text[position:])
        return fragments


def _trie_pattern(texts: Iterable[str]) -> str:
    """A regex matching any of `texts`, as a trie (one branch per distinct next character), preferring the
    longest: Python's `re` tries alternatives one by one, so a flat alternation of 100k words is 100k
    tries per position, a trie a handful."""
    root: dict[str, Any] = {}
    for text in texts:
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict[str, Any]) -> str:
        # Iterative along single-child chains, recursive only at branches (whose depth is small).
        literal = []
        while len(node) == 1 and "" not in node:
            (char, node), = node.items()
            literal.append(re.escape(char))
        head = "".join(literal)
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return head
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return head + (f"(?:{body})?" if "" in node else body)  # greedy: longer words first

    return pattern(root)


# --- building blocks ------------------------------------------------------------------------------


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (JSON allows "\\ud83d") replaced by U+FFFD, which HF requires."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text

_FILE_CACHE: OrderedDict[tuple[str, int, int], Tokenizer] = OrderedDict()
_FILE_CACHE_SIZE = 4
_FILE_CACHE_LOCK = threading.Lock()


def _build_backend(model: str, pre: _PreTokenizer, ids: Mapping[str, int], merges: Sequence[str]) -> HFTokenizer:
    """The HF tokenizer that encodes text free of special tokens."""
    pairs = list(map(_split_merge, merges))

    def bpe(pairs: list[tuple[str, str]]) -> models.BPE:
        return models.BPE(
            vocab=dict(ids),
            merges=pairs,
            byte_fallback=model == "gemma4",  # "<0xXX>" tokens for characters no merge reaches
            ignore_merges=pre.ignore_merges,
        )

    try:
        model_bpe = bpe(pairs)
    except Exception:  # noqa: BLE001 -- HF raises a bare Exception for a merge whose parts or result are not tokens
        # llama.cpp would apply such a merge and then spell the result byte by byte. Vocabularies
        # from the converters have none; drop them rather than refuse the file.
        model_bpe = bpe([(a, b) for a, b in pairs if a in ids and b in ids and a + b in ids])
    backend = HFTokenizer(model_bpe)
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
    if model == "gemma4":
        backend.normalizer = normalizers.Replace(" ", _SPACE_ESCAPE)
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    else:
        # No normalizer: llama.cpp does not apply NFC (HF's Qwen tokenizer.json does).
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character, so a part may start with one.
    cut = merge.find(" ", 1)
    return (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")


def _token_attrs(metadata: Mapping[str, Any], n_tokens: int, where: str) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [_Attr.NORMAL] * n_tokens
    if not isinstance(types, Sequence) or len(types) < n_tokens:
        raise GGUFError(f"{where}: tokenizer.ggml.token_type must list one type per token ({n_tokens})")
    attr_of = {int(t): a for t, a in _ATTR_OF_TYPE.items()}
    return [attr_of.get(int(t), _Attr.NONE) for t in types[:n_tokens]]


def _string(metadata: Mapping[str, Any], key: str, where: str) -> str:
    value = metadata.get(key)
    if not isinstance(value, str):
        raise GGUFError(f"{where}: {key} is missing or not a string")
    return value


def _string_list(metadata: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value[:1]):
        raise GGUFError(f"{where}: {key} is missing or not an array of strings")
    return list(value)
