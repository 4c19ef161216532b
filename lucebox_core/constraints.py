"""Constrained decoding with llguidance: JSON, JSON schema and Lark grammars as engine `Constraint`s.

llguidance (Rust, MIT) compiles the grammar and computes, each step, the set of tokens that keep the
output inside it. It needs the raw bytes of every token: we take them from our `Tokenizer`
(`token_bytes`, which undoes GPT-2's byte-to-unicode mapping). Control tokens are marked special
(llguidance's convention: a 0xFF byte in front) so grammar text can never be spelled with them; the
grammar can still name one as `<[id]>`. Padding ids (`[PAD123]` placeholders of llama.cpp's converter,
unused tokens, and ids past the vocabulary in a padded output layer) are never allowed.

The token table costs about a second to build for a 250k vocabulary, so it is cached per tokenizer.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from .errors import LuceboxError

log = logging.getLogger("lucebox.constraints")

__all__ = [
    "ConstraintError",
    "GrammarConstraint",
    "OpenedCallConstraint",
    "grammar_tokenizer",
    "json_object_constraint",
    "json_schema_constraint",
    "lark_constraint",
    "lark_literal",
    "response_format_constraint",
]

# Whitespace between JSON tokens is bounded: enough for pretty-printing a few levels deep, but a model
# cannot fall into an endless run of newlines (llama.cpp bounds it for the same reason).
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n\r]{0,32}"}

_PLACEHOLDER = re.compile(r"\[PAD\d+\]")  # names llama.cpp's converter gives ids missing from the vocab


class ConstraintError(LuceboxError):
    """A grammar or JSON schema that cannot be used (invalid, or unsupported by llguidance)."""


class _TokenizerBridge:
    """The shape `llguidance.TokenizerWrapper` reads: token bytes, special ids, and an encode call."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eot_ids)
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token_id in range(tokenizer.vocab_size):
            if tokenizer.is_control(token_id):
                self.tokens.append(b"\xff" + tokenizer.id_to_token(token_id).encode())
                self.special_token_ids.append(token_id)
            elif _PLACEHOLDER.fullmatch(tokenizer.id_to_token(token_id)):
                self.tokens.append(b"")  # llguidance never allows an empty token
            else:
                self.tokens.append(tokenizer.token_bytes(token_id))
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance asks for canonical tokenizations of forced text (it calls this with UTF-8 bytes).
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._encode(text, add_bos=False)


_CACHE: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of our `Tokenizer` (built once per tokenizer, then cached)."""
    with _CACHE_LOCK:
        cached = _CACHE.get(tokenizer)
        if cached is None:
            bridge = llguidance.TokenizerWrapper(_TokenizerBridge(tokenizer))
            cached = llguidance.LLTokenizer(bridge, eos_token=sorted(tokenizer.eot_ids))
            _CACHE[tokenizer] = cached
        return cached


class GrammarConstraint:
    """The engine's `Constraint` for one generation under an llguidance grammar.

    `allowed` gives the tokens that keep the output a prefix of the language (end-of-generation ids
    only where the output so far is complete); `finished` turns true when nothing more can be added.
    """

    def __init__(self, tokenizer: Any, grammar: str, *, _matcher: Any = None) -> None:
        self._ll_tokenizer = grammar_tokenizer(tokenizer)
        if _matcher is None:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
            if is_error:
                raise ConstraintError(f"invalid grammar: {messages[0] if messages else 'unknown error'}")
            _matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
            if _matcher.is_error():
                raise ConstraintError(f"invalid grammar: {_matcher.get_error()}")
        self._tokenizer, self._grammar, self._matcher = tokenizer, grammar, _matcher
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self._ll_tokenizer.vocab_size)

    def fresh(self) -> GrammarConstraint:
        """A constraint of the same grammar at its start, without compiling the grammar again (a copy of this
        one's matcher, which must not have been used yet)."""
        return GrammarConstraint(self._tokenizer, self._grammar, _matcher=self._matcher.deep_copy())

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Consume several tokens; False (and the matcher in error) when the grammar does not allow them."""
        return bool(self._matcher.consume_tokens([int(t) for t in token_ids])) and not self._matcher.is_error()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        self._raise_on_error()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        mask = np.zeros(vocab_size, dtype=bool)
        known = min(vocab_size, self._ll_tokenizer.vocab_size)
        mask[:known] = bits[:known]
        return torch.from_numpy(mask)

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(int(token_id)):
            self._raise_on_error(f"token {token_id} is not allowed by the grammar")

    @property
    def finished(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """True when the output so far is a whole sentence of the grammar (it may still go on)."""
        return self._matcher.is_accepting()

    def _raise_on_error(self, context: str = "") -> None:
        if self._matcher.is_error():
            detail = self._matcher.get_error()
            raise ConstraintError(f"{context}: {detail}" if context else detail)


class OpenedCallConstraint:
    """Tool calls under tool_choice "auto": the text is free, and each call the model opens is held to the
    grammar of one call (its tool's schema) from its opening tag on.

    A shadow of the response's own parser reads the output as it is generated, so the constraint and the
    parser agree on what is a call (not one inside the reasoning, say). While no call is open nothing is
    masked (`dormant`: the engine may decode speculatively meanwhile); when the shadow sees a call open, a
    matcher of the call grammar is primed with the call's text so far and masks every token until the call
    is complete, and the text is free again. `finished` is never true: text may follow a call.

    A call opened by a token that brings more text than the grammar can continue from (the tag spelled in
    pieces, the last with other text after it) cannot be held to the grammar: it is logged and left to the
    parser.
    """

    finished = False

    def __init__(self, tokenizer: Any, grammar: str, shadow: Any) -> None:
        self._tokenizer = tokenizer
        self._template = GrammarConstraint(tokenizer, grammar)  # compiled once; each call starts from a copy
        self._shadow = shadow
        self._detokenizer = tokenizer.detokenizer()
        self._call: GrammarConstraint | None = None
        self._settled = False  # the shadow's open call is done with (complete, or not held to the grammar)

    @property
    def dormant(self) -> bool:
        """True while no call is being held to the grammar: any token may come next."""
        return self._call is None

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        return None if self._call is None else self._call.allowed(vocab_size)

    def accept(self, token_id: int) -> None:
        if self._call is not None:
            self._call.accept(token_id)
        text = self._detokenizer.push(token_id)
        if text:
            self._shadow.feed(text)
        opened = self._shadow.call_open
        if self._call is not None and (self._call.finished or not opened):
            self._call, self._settled = None, opened
        elif not opened:
            self._settled = False
        elif self._call is None and not self._settled:
            self._open()

    def _open(self) -> None:
        call = self._template.fresh()
        text = self._shadow.open_call_text()
        if call.accept_tokens(self._tokenizer.encode(text, add_bos=False, parse_special=True)):
            self._call = None if call.finished else call
            self._settled = call.finished
        else:
            log.warning("a tool call opened as %r, which its grammar cannot continue: not held to its schema", text)
            self._settled = True


def lark_constraint(tokenizer: Any, lark: str) -> GrammarConstraint:
    """Output must match a Lark grammar (llguidance's dialect; `%json {...}` embeds a JSON schema)."""
    return GrammarConstraint(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))


def json_schema_constraint(
    tokenizer: Any, schema: Mapping[str, Any], *, after_reasoning: bool = False, reasoning_close: str = "</think>"
) -> GrammarConstraint:
    """Output must be JSON valid under `schema`; with `after_reasoning`, only after `reasoning_close`."""
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    try:
        body = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON schema cannot be serialised: {exc}") from exc
    if not after_reasoning:
        return GrammarConstraint(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(body))
    lark = f"start: {reasoning_rule(tokenizer, reasoning_close)} answer\nanswer: %json {body}\n" + reasoning_rules(reasoning_close)
    return lark_constraint(tokenizer, lark)


def json_object_constraint(tokenizer: Any, *, after_reasoning: bool = False) -> GrammarConstraint:
    """Output must be one JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_constraint(tokenizer, {"type": "object"}, after_reasoning=after_reasoning)


def response_format_constraint(
    tokenizer: Any, response_format: Mapping[str, Any] | None, *, after_reasoning: bool = False
) -> GrammarConstraint | None:
    """The constraint for an OpenAI `response_format` (or a Responses API `text.format`), or None.

    Accepts `{"type": "text"}`, `{"type": "json_object"}`, and `{"type": "json_schema", "json_schema":
    {"schema": {...}}}` (Chat Completions) or `{"type": "json_schema", "schema": {...}}` (Responses).
    """
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_object_constraint(tokenizer, after_reasoning=after_reasoning)
    if kind == "json_schema":
        holder = response_format.get("json_schema", response_format)
        schema = holder.get("schema") if isinstance(holder, Mapping) else None
        if schema is None:
            raise ConstraintError("response_format json_schema has no 'schema'")
        return json_schema_constraint(tokenizer, schema, after_reasoning=after_reasoning)
    raise ConstraintError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def lark_literal(tokenizer: Any, text: str) -> str:
    """`text` as a Lark item: the special-token reference when it is one control token, else a string."""
    token_id = tokenizer.token_to_id(text)
    if token_id is not None and tokenizer.is_control(token_id):
        return f"<[{token_id}]>"
    return json.dumps(text)


def reasoning_rules(close: str = "</think>") -> str:
    """Free text up to the end of the reasoning (`close`), for prompts that leave the model inside a thought."""
    escaped = re.escape(close).replace("/", "\\/")
    return f'REASONING_TEXT: /(?s:.*)/\nreasoning_text_lazy[lazy]: /(?s:.*){escaped}/\nGAP: /[ \\t\\r\\n]{{0,8}}/'


REASONING_RULES = reasoning_rules()


def reasoning_rule(tokenizer: Any, close: str = "</think>") -> str:
    """A Lark expression for `…close` plus blank lines, whether `close` is a control token or text."""
    close = lark_literal(tokenizer, close)
    if close.startswith("<["):
        return f"REASONING_TEXT {close} GAP"
    return "reasoning_text_lazy GAP"
