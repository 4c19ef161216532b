"""A conversation as prompt ids, where only the chat template's own markup becomes control tokens.

A chat template writes control tokens as text (`<|im_start|>user\n...<|im_end|>`), so the rendered prompt
is tokenized with special-token parsing on. Done naively, a user who types `<|im_end|>` in a message
closes their own turn and can write the assistant's (a tool result fetched from a web page can do the
same). So before rendering, every control-token text in what users and tools supplied is swapped for an
inert placeholder; after rendering the placeholders are put back, and the tokenizer is told that those
characters are literal text (`Tokenizer.encode(literal_spans=...)`). A conversation whose user text holds
no control-token text renders and tokenizes exactly as before, id for id.

What counts as user-supplied (tokenized as text):
- the messages of every role but `assistant`: user, system/developer, tool results, and any other;
- the tool calls of assistant messages (names, arguments): data a tool will see, often quoting user input;
- tool definitions, documents and extra template variables (a tool description comes from an MCP server).

The assistant's own content and reasoning keep their control tokens: they are the model's text sent back
(tool-call replay re-sends the exact text the model wrote, and Gemma-4 writes its calls with control
tokens), so the next prompt extends the previous one token for token. A client that lets its end users
edit assistant turns should treat them as it treats any other text it forwards.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from .chat_template import ChatTemplate
from .tokenizer import Tokenizer, valid_unicode

# The role whose content is the model's own text.
MODEL_ROLE = "assistant"


@attrs.frozen
class RenderedChat:
    """A rendered conversation: its text and the character spans that are user text holding control-token
    text (empty for almost every conversation)."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()

    def encode(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt ids: the template's control tokens parsed, the literal spans left as text. No BOS is
        added: templates write their own."""
        return tokenizer.encode(self.text, add_bos=False, parse_special=True, literal_spans=self.literal_spans)


def render_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], *,
                tools: list[dict] | None = None, documents: list[dict] | None = None,
                add_generation_prompt: bool = True, user_control_tokens: bool = False,
                **template_kwargs: Any) -> RenderedChat:
    """Render `messages` (see `ChatTemplate.render`) so that control-token text in user-supplied parts stays
    text. `user_control_tokens=True` honours it instead (an explicit opt-in, like `--parse-special`)."""
    if user_control_tokens:
        return RenderedChat(template.render(messages, tools=tools, documents=documents,
                                            add_generation_prompt=add_generation_prompt, **template_kwargs))
    shield = _Shield(tokenizer)
    shielded_messages = [_shield_message(message, shield) for message in messages]
    text = template.render(
        shielded_messages, tools=shield.value(tools), documents=shield.value(documents),
        add_generation_prompt=add_generation_prompt, **shield.value(template_kwargs),
    )
    return shield.restore(text)


def _shield_message(message: Any, shield: _Shield) -> Any:
    if not isinstance(message, Mapping):
        return message  # the template reports what is wrong with it
    if message.get("role") != MODEL_ROLE:
        return {key: value if key == "role" else shield.value(value) for key, value in message.items()}
    if "tool_calls" in message:
        return {**message, "tool_calls": shield.value(message["tool_calls"])}
    return message


class _Shield:
    """Swaps control-token text in strings for placeholders, and puts it back in the rendered text.

    A placeholder is `lbx<nonce>t<id>x`: letters and digits only, so the template's filters (`trim`,
    `tojson`, `replace` of other text) leave it whole, and a nonce fresh per render, so no input can forge
    one. The swap back is case-blind, in case a template changes the case of what it prints.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.nonce = secrets.token_hex(8)
        self.used = False

    def text(self, value: str) -> str:
        value = valid_unicode(value)
        found = self.tokenizer.control_tokens_in(value)
        if not found:
            return value
        self.used = True
        pieces, position = [], 0
        for start, end, token_id in found:
            pieces += [value[position:start], f"lbx{self.nonce}t{token_id}x"]
            position = end
        pieces.append(value[position:])
        return "".join(pieces)

    def value(self, value: Any) -> Any:
        """`value` with every string in it (keys of mappings included) shielded."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.value(key): self.value(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.value(item) for item in value)
        return value

    def restore(self, rendered: str) -> RenderedChat:
        rendered = valid_unicode(rendered)  # the spans must index the text the tokenizer sees
        if not self.used:
            return RenderedChat(rendered)
        placeholder = re.compile(f"lbx{self.nonce}t(\\d+)x", re.IGNORECASE)
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        position = length = 0
        for match in placeholder.finditer(rendered):
            before = rendered[position : match.start()]
            original = self.tokenizer.id_to_token(int(match.group(1)))
            pieces += [before, original]
            length += len(before)
            spans.append((length, length + len(original)))
            length += len(original)
            position = match.end()
        pieces.append(rendered[position:])
        return RenderedChat("".join(pieces), tuple(spans))
