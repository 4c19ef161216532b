"""`lucebox serve --force-tool-call NAME[=ARGUMENTS]`: a testing aid that makes any model call a tool.

A model with random weights never chooses to call a tool, yet a client's tool loop (run the tool, send its
result back, read the answer) is what breaks most often. With this flag, a chat request that offers a tool
named NAME and does not yet carry a tool result is answered as if it had asked for that tool
(`tool_choice` naming it: the family's tool-call grammar forces the call); a request whose last message is a
tool result is answered as if `tool_choice` were "none", so the model answers in text and the loop ends.
ARGUMENTS (a JSON object) pins the call's arguments: the grammar is then built from a schema whose every
property is that value (`const`), so the client runs a known, harmless command. Several NAMEs may be given
(the flag repeats); the first one a request offers is used. Requests without such a tool are untouched.

`lucebox serve --short-answers CHARS` (testing, with or without the flag above): every answer not forced to
be a tool call is plain text (even when tools are offered), held by a grammar to at most CHARS characters of letters, digits, spaces and punctuation, after which the
model must end it, so a random-weight model's answer ends with `stop` instead of running into the token
limit (which agent clients report as an error, or retry). Both flags turn thinking off for the requests
they touch: a random model's thought never closes.

Never use either for real work: they override what the client asked for.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..errors import LuceboxError


@attrs.frozen
class ForcedTool:
    name: str
    arguments: dict[str, Any] | None = None  # None: the model writes them (held to the tool's own schema)

    @classmethod
    def parse(cls, text: str) -> "ForcedTool":
        """`NAME` or `NAME=JSON-OBJECT` (the flag's value)."""
        name, _, arguments = text.partition("=")
        name = name.strip()
        if not name:
            raise LuceboxError(f"--force-tool-call {text!r}: give a tool name, as NAME or NAME='{{\"arg\": ...}}'")
        if not arguments:
            return cls(name)
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise LuceboxError(f"--force-tool-call {name}: the arguments are not JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise LuceboxError(f"--force-tool-call {name}: the arguments must be a JSON object, not {arguments!r}")
        return cls(name, parsed)

    def pinned_schema(self) -> dict[str, Any]:
        """A JSON schema only these arguments satisfy."""
        assert self.arguments is not None
        return {"type": "object", "properties": {k: {"const": v} for k, v in self.arguments.items()},
                "required": list(self.arguments), "additionalProperties": False}


def parse_forced_tools(values: list[str] | tuple[str, ...] | None) -> tuple[ForcedTool, ...]:
    return tuple(ForcedTool.parse(value) for value in values or ())


def apply_forced_tool(forced: tuple[ForcedTool, ...], conversation: Any) -> Any:
    """`conversation` (a generation.Conversation) with its tool_choice overridden as the module says, and the
    forced tool's schema pinned when the flag gave arguments. `forced_tool_schema` on the result keeps the
    original tools for rendering the prompt (the client's definitions, as it sent them)."""
    ToolChoice = type(conversation.tool_choice)  # generation.ToolChoice (imported there: no import cycle)
    if not forced or not conversation.tools:
        return conversation
    offered = {tool["function"]["name"] for tool in conversation.tools}
    chosen = next((tool for tool in forced if tool.name in offered), None)
    if chosen is None:
        return conversation
    if conversation.messages and conversation.messages[-1].get("role") == "tool":
        return attrs.evolve(conversation, tool_choice=ToolChoice(mode="none"), thinking=False)
    return attrs.evolve(conversation, tool_choice=ToolChoice(mode="required", name=chosen.name), thinking=False,
                        pinned_arguments=chosen.pinned_schema() if chosen.arguments is not None else None)


def short_answer_grammar(chars: int) -> str:
    """A lark grammar: 1 to `chars` characters of plain text, then the end."""
    return f"start: /[A-Za-z0-9 ,.!?'-]{{1,{int(chars)}}}/\n"


def tools_with_pinned_arguments(conversation: Any) -> list[dict]:
    """The conversation's tools, the forced one's parameters replaced by its pinned schema (if any)."""
    schema = conversation.pinned_arguments
    if schema is None:
        return conversation.tools
    name = conversation.tool_choice.name
    return [{**tool, "function": {**tool["function"], "parameters": schema}} if tool["function"]["name"] == name
            else tool for tool in conversation.tools]
