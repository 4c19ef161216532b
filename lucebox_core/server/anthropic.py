"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as Claude Code speaks it.

Content blocks map onto chat-template messages: text, `tool_use` (assistant tool calls), `tool_result`
(tool messages) and `thinking` (reasoning). One `MessageBuilder` turns generation events into content
blocks, for the stream (message_start, content_block_start/delta/stop, message_delta, message_stop)
and for the final message alike. Errors use Anthropic's shape (see errors.py).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from . import sse
from .errors import APIError, invalid
from .generation import (
    Conversation, Done, Generation, Options, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, ToolChoice,
    function_tool, new_id, off_loop, render_chat, stop_list, text_of,
)
from .openai_chat import check_named_tool, start_chat
from .schemas import CountTokensRequest, MessagesRequest
from .service import ModelService

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _system(system: str | list[dict] | None) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        # Claude Code puts a per-request billing header in the system blocks; it would change the
        # prompt prefix on every request for no benefit to the model.
        system = [block for block in system
                  if not str(block.get("text", "")).startswith("x-anthropic-billing-header")]
    text = text_of(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(data: CountTokensRequest) -> list[dict]:
    messages = _system(data.system)
    for index, message in enumerate(data.messages):
        where = f"messages[{index}]"
        if message.role not in ("user", "assistant"):
            raise invalid(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        text, reasoning, calls = [], [], []
        had_results = False
        for position, block in enumerate(blocks):
            kind = block.get("type")
            here = f"{where}.content[{position}]"
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind in ("thinking", "redacted_thinking"):
                reasoning.append(str(block.get("thinking", "")))
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise invalid(f"{here}: a tool_use block needs a `name`", param=here)
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content")
                result = content if isinstance(content, str) else text_of(content or [], f"{here}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
                had_results = True
            else:
                raise invalid(f"{here}: unsupported content block {kind!r} for role {message.role}", param=here)
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                turn["reasoning_content"] = "".join(reasoning)
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
        elif text or not had_results:
            messages.append({"role": "user", "content": "".join(text)})
    return messages


def _conversation(data: CountTokensRequest) -> Conversation:
    tools = [function_tool(tool.name, tool.description, tool.input_schema, f"tools[{index}]")
             for index, tool in enumerate(data.tools or []) if tool.input_schema is not None]
    choice = ToolChoice()
    if data.tool_choice is not None:
        kind = data.tool_choice.get("type")
        if kind == "any":
            choice = ToolChoice(mode="required")
        elif kind == "tool":
            if not isinstance(data.tool_choice.get("name"), str):
                raise invalid("`tool_choice` of type 'tool' needs a `name`", param="tool_choice")
            choice = ToolChoice(mode="required", name=data.tool_choice["name"])
        elif kind == "none":
            choice = ToolChoice(mode="none")
        elif kind != "auto":
            raise invalid("`tool_choice.type` must be auto, any, tool or none", param="tool_choice")
    thinking = None
    if data.thinking is not None:
        thinking = data.thinking.type != "disabled"
    conversation = Conversation(messages=_messages(data), tools=tools, tool_choice=choice, thinking=thinking)
    check_named_tool(conversation)
    return conversation


class MessageBuilder:
    """Generation events -> Anthropic content blocks and stream events."""

    def __init__(self, message: dict):
        self.message = message
        self.blocks: list[dict] = message["content"]
        self.open: dict | None = None
        self.arguments: dict[int, str] = {}
        self.calls: dict[int, dict] = {}

    def start(self) -> list[bytes]:
        return [sse.event("message_start", {"type": "message_start", "message": self.message}),
                sse.event("ping", {"type": "ping"})]

    def _open(self, block: dict) -> list[bytes]:
        events = self._close()
        self.blocks.append(block)
        self.open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else block
        events.append(sse.event("content_block_start", {"type": "content_block_start",
                                                         "index": len(self.blocks) - 1, "content_block": shown}))
        return events

    def _close(self) -> list[bytes]:
        block, self.open = self.open, None
        if block is None:
            return []
        index = self.blocks.index(block)
        events = []
        if block["type"] == "thinking":
            events.append(sse.event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "signature_delta", "signature": ""}}))
        return events + [sse.event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, delta: dict) -> bytes:
        return sse.event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                  "delta": delta})

    def feed(self, event: Any) -> list[bytes]:
        events: list[bytes] = []
        if isinstance(event, TextDelta) and event.text:
            kind = "thinking" if event.reasoning else "text"
            if self.open is None or self.open["type"] != kind:
                block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                events += self._open(block)
            self.open[kind] += event.text
            events.append(self._delta({"type": "thinking_delta", "thinking": event.text} if kind == "thinking"
                                      else {"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            # The call's own id under Anthropic's prefix, so tool-call replay finds it when it comes back.
            block = {"type": "tool_use", "id": "toolu_" + event.id.split("_", 1)[-1], "name": event.name, "input": {}}
            self.calls[event.index] = block
            self.arguments[event.index] = ""
            events += self._open(block)
        elif isinstance(event, ToolCallDelta) and event.arguments:
            self.arguments[event.index] += event.arguments
            events.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
        elif isinstance(event, ToolCallEnd):
            block = self.calls.get(event.index)
            if block is not None:
                block["input"] = _json_object(self.arguments[event.index])
                if self.open is block:
                    events += self._close()
        return events

    def finish(self, done: Done) -> list[bytes]:
        events = self._close()
        for index, block in self.calls.items():  # calls cut short by max_tokens keep what parses
            if not block["input"]:
                block["input"] = _json_object(self.arguments[index])
        reason = "tool_use" if self.calls and done.finish_reason != "length" else _STOP_REASONS[done.finish_reason]
        self.message["stop_reason"] = reason
        self.message["usage"]["output_tokens"] = done.usage.completion_tokens
        # Anthropic counts cache reads apart: input_tokens are the prompt tokens that were processed.
        self.message["usage"]["input_tokens"] = done.usage.prompt_tokens - done.usage.cached_tokens
        self.message["usage"]["cache_read_input_tokens"] = done.usage.cached_tokens
        self.message["usage"]["timings"] = done.usage.timings()  # Lucebox's addition: speeds, accepted lengths
        events.append(sse.event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": {"output_tokens": done.usage.completion_tokens,
                      "input_tokens": done.usage.prompt_tokens - done.usage.cached_tokens,
                      "cache_read_input_tokens": done.usage.cached_tokens, "timings": done.usage.timings()},
        }))
        events.append(sse.event("message_stop", {"type": "message_stop"}))
        return events


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@post("/v1/messages", status_code=200, summary="Create a message (Anthropic Messages API)", tags=["anthropic"])
async def messages(data: JSONBody[MessagesRequest], service: NamedDependency[ModelService]) -> Response[Any]:
    conversation = _conversation(data)
    sampling = {key: value for key, value in {"temperature": data.temperature, "top_p": data.top_p,
                                              "top_k": data.top_k}.items() if value is not None}
    budget = data.thinking.budget_tokens if data.thinking is not None and data.thinking.type == "enabled" else None
    options = Options(max_tokens=data.max_tokens, sampling=sampling, think_budget=budget,
                      stop=stop_list(data.stop_sequences, "stop_sequences"))
    generation = await start_chat(service, conversation, options)
    message = {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": service.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(generation.prompt.ids), "output_tokens": 0,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }
    builder = MessageBuilder(message)
    if data.stream:
        return sse.stream(sse.guarded(_stream(generation, builder), generation, _error_event))
    try:
        async for event in generation:
            builder.finish(event) if isinstance(event, Done) else builder.feed(event)
    finally:
        generation.cancel()
    return Response(message, media_type="application/json")


def _error_event(error: APIError) -> bytes:
    kind = "invalid_request_error" if error.status == 400 else "api_error"
    return sse.event("error", {"type": "error", "error": {"type": kind, "message": error.message}})


async def _stream(generation: Generation, builder: MessageBuilder) -> AsyncIterator[bytes]:
    for chunk in builder.start():
        yield chunk
    async for event in generation:
        for chunk in builder.finish(event) if isinstance(event, Done) else builder.feed(event):
            yield chunk


@post("/v1/messages/count_tokens", status_code=200, summary="Count a request's input tokens (Anthropic)",
      tags=["anthropic"])
async def count_tokens(data: JSONBody[CountTokensRequest], service: NamedDependency[ModelService]) -> dict[str, int]:
    service.require_ready()
    prompt = await off_loop(render_chat, service, _conversation(data))
    return {"input_tokens": len(prompt.ids)}
