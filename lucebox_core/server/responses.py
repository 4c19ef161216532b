"""POST /v1/responses: OpenAI's Responses API, as Codex CLI speaks it.

Input items (messages, function calls and their outputs, reasoning) become one chat conversation.
Fields Codex sends that a local server cannot honour (`store`, `include`, `service_tier`,
`prompt_cache_key`, `parallel_tool_calls`) are accepted and ignored. Recent responses are kept in memory
so `previous_response_id` continues a conversation. One `ResponseBuilder` turns the generation events
into output items, for the stream and for the final object alike.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import attrs
from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from . import sse
from .errors import APIError, invalid
from .generation import (
    Conversation, Done, Generation, Options, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, function_tool,
    new_id, now, text_of, thinking_from_effort,
)
from .openai_chat import check_named_tool, start_chat, tool_choice
from .schemas import ResponsesRequest
from .service import ModelService


@attrs.define
class StoredResponse:
    """What `previous_response_id` continues from: the conversation, with this response's output."""

    messages: list[dict]


def _content_text(content: Any, where: str) -> str:
    return text_of(content, where, part_types=("input_text", "output_text", "text", "refusal", "summary_text",
                                               "reasoning_text"))


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat-template messages.

    Consecutive assistant-side items (reasoning, output text, function calls) form one assistant turn.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []

    def assistant() -> dict:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            text = _content_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant()["content"] += text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id") or item.get("id")
            arguments = item.get("arguments", item.get("input", "{}"))
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise invalid(f"{where}: a function_call needs string `name` and `arguments`", param=where)
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _content_text(parts, f"{where}.content")
            if text:
                message = assistant()
                message["reasoning_content"] = message.get("reasoning_content", "") + text
        # Other items (web search calls, item references, encrypted reasoning only...) carry nothing
        # this model can read: skipped.
    return messages


def _tools(tools: list[dict] | None) -> list[dict]:
    converted = []
    for index, tool in enumerate(tools or []):
        if tool.get("type") == "function":
            converted.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"),
                                           f"tools[{index}]"))
        # Built-in tools (web_search, file_search, local_shell, custom...) have no local implementation.
    return converted


def conversation_and_options(data: ResponsesRequest, service: ModelService) -> tuple[Conversation, Options, list[dict]]:
    history: list[dict] = []
    if data.previous_response_id:
        stored = service.recall_response(data.previous_response_id)
        if stored is None:
            raise APIError(400, f"previous response {data.previous_response_id!r} is not known to this server "
                                "(it keeps only recent responses, in memory)", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(stored.messages)
    messages = history + input_messages(data.input)
    system = [{"role": "system", "content": data.instructions}] if data.instructions else []
    effort = data.reasoning.effort if data.reasoning else None
    conversation = Conversation(messages=system + messages, tools=_tools(data.tools), param="input",
                                tool_choice=tool_choice(data.tool_choice), thinking=thinking_from_effort(effort))
    check_named_tool(conversation)
    options = Options(max_tokens=data.max_output_tokens, max_tokens_param="max_output_tokens",
                      sampling={k: v for k, v in {"temperature": data.temperature, "top_p": data.top_p,
                                                  "top_k": data.top_k, "seed": data.seed}.items() if v is not None})
    text_format = data.text.format if data.text else None
    if text_format is not None and text_format.type != "text":
        if text_format.type == "json_object":
            options.json_object = True
        elif text_format.type == "json_schema":
            if not isinstance(text_format.schema, dict):
                raise invalid("`text.format.schema` must be a JSON schema object", param="text.format.schema")
            options.json_schema = text_format.schema
        else:
            raise invalid("`text.format.type` must be text, json_object or json_schema", param="text.format.type")
    return conversation, options, messages


class ResponseBuilder:
    """Turns generation events into Responses output items and the stream's events."""

    def __init__(self, response: dict):
        self.response = response
        self.sequence = 0
        self.output: list[dict] = response["output"]
        self.open: dict | None = None  # the item receiving deltas
        self.calls: dict[int, dict] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.event(kind, payload)

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def _open(self, item: dict) -> list[bytes]:
        events = self._close()
        self.output.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))
        elif item["type"] == "function_call":
            item["arguments"] = item["arguments"] or "{}"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, event: Any) -> list[bytes]:
        events: list[bytes] = []
        if isinstance(event, TextDelta) and event.text:
            kind = "reasoning" if event.reasoning else "message"
            if self.open is None or self.open["type"] != kind:
                if kind == "reasoning":
                    item = {"id": new_id("rs_"), "type": "reasoning", "summary": [],
                            "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                else:
                    item = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
                events += self._open(item)
            item, index = self.open, len(self.output) - 1
            item["content"][0]["text"] += event.text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self._event(name, item_id=item["id"], output_index=index, content_index=0,
                                      delta=event.text, **extra))
        elif isinstance(event, ToolCallStart):
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                    "name": event.name, "arguments": ""}
            self.calls[event.index] = item
            events += self._open(item)
        elif isinstance(event, ToolCallDelta) and event.arguments:
            item = self.calls[event.index]
            item["arguments"] += event.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=event.arguments))
        elif isinstance(event, ToolCallEnd):
            if self.open is self.calls.get(event.index):
                events += self._close()
        return events

    def finish(self, done: Done) -> list[bytes]:
        events = self._close()
        usage = done.usage
        self.response["usage"] = {
            "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens,
            "timings": usage.timings(),
        }
        if done.finish_reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.response))
        else:
            self.response["status"] = "completed"
            events.append(self._event("response.completed", response=self.response))
        return events

    def assistant_message(self) -> dict:
        """This response's output as one chat message, for `previous_response_id`."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "function_call":
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return message


@post("/v1/responses", status_code=200, summary="Create a response (OpenAI Responses API)", tags=["openai"])
async def create_response(data: JSONBody[ResponsesRequest], service: NamedDependency[ModelService]) -> Response[Any]:
    conversation, options, messages = conversation_and_options(data, service)
    generation = await start_chat(service, conversation, options)
    response = {
        "id": new_id("resp_"), "object": "response", "created_at": now(), "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": data.instructions,
        "max_output_tokens": data.max_output_tokens, "model": service.model_name, "output": [],
        "parallel_tool_calls": bool(data.parallel_tool_calls), "previous_response_id": data.previous_response_id,
        "reasoning": {"effort": data.reasoning.effort if data.reasoning else None, "summary": None},
        "store": data.store if data.store is not None else True, "temperature": data.temperature,
        "text": {"format": {"type": data.text.format.type if data.text and data.text.format else "text"}},
        "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
        "tools": data.tools or [], "top_p": data.top_p, "truncation": data.truncation or "disabled",
        "usage": None, "user": data.user, "metadata": data.metadata or {},
    }
    builder = ResponseBuilder(response)

    def remember() -> None:
        service.remember_response(response["id"], StoredResponse(messages + [builder.assistant_message()]))

    if data.stream:
        return sse.stream(sse.guarded(_stream(generation, builder, remember), generation, _error_event(builder)))
    try:
        async for event in generation:
            if isinstance(event, Done):
                builder.finish(event)
            else:
                builder.feed(event)
    finally:
        generation.cancel()
    remember()
    response["output_text"] = "".join(item["content"][0]["text"] for item in response["output"]
                                      if item["type"] == "message")
    return Response(response, media_type="application/json")


def _error_event(builder: ResponseBuilder):
    def encode(error: APIError) -> bytes:
        builder.response["status"] = "failed"
        builder.response["error"] = {"code": error.code or "server_error", "message": error.message}
        return builder._event("response.failed", response=builder.response)

    return encode


async def _stream(generation: Generation, builder: ResponseBuilder, remember: Any) -> AsyncIterator[bytes]:
    for chunk in builder.start():
        yield chunk
    async for event in generation:
        chunks = builder.finish(event) if isinstance(event, Done) else builder.feed(event)
        if isinstance(event, Done):
            remember()
        for chunk in chunks:
            yield chunk
