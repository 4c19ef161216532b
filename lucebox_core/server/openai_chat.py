"""POST /v1/chat/completions, streaming and not, as OpenAI's API defines it.

Reasoning goes out under both `reasoning_content` (DeepSeek / llama.cpp) and `reasoning` (vLLM /
OpenRouter), and either is accepted on input messages.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

import attrs

from ..errors import LuceboxError
from . import sse
from .forced_tool import apply_forced_tool, short_answer_grammar, tools_with_pinned_arguments
from .errors import APIError, invalid
from .generation import (
    Collected, Conversation, Done, Generation, Options, TextDelta, TokenLogprob, ToolCallDelta, ToolCallStart,
    ToolChoice, function_tool, generation_request, make_parser, new_id, now, off_loop, render_chat, stop_list,
    text_of, thinking_from_effort,
)
from .schemas import ChatCompletionRequest, ChatMessage, ResponseFormat
from .service import ModelService

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _message(message: ChatMessage, index: int) -> dict:
    where = f"messages[{index}]"
    if message.role not in _ROLES:
        raise invalid(f"{where}.role: {message.role!r} is not one of {', '.join(sorted(_ROLES))}", param=f"{where}.role")
    converted: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": text_of(message.content, f"{where}.content"),
    }
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        converted["reasoning_content"] = reasoning
    if message.tool_calls:
        calls = []
        for position, call in enumerate(message.tool_calls):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(f"{where}.tool_calls[{position}]: needs `function` with a `name`",
                              param=f"{where}.tool_calls")
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": function.get("arguments") or "{}"}})
        converted["tool_calls"] = calls
    if message.tool_call_id is not None:
        converted["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        converted["name"] = message.name
    return converted


def tool_choice(value: Any, param: str = "tool_choice") -> ToolChoice:
    """OpenAI's `tool_choice`: "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    (Responses puts `name` at the top level of the object)."""
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid(f"`{param}` must be 'auto', 'none', 'required' or a function, not {value!r}", param=param)
        return ToolChoice(mode=value)
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else value.get("name")
    if value.get("type") != "function" or not isinstance(name, str):
        raise invalid(f"`{param}` as an object must be {{'type': 'function', 'function': {{'name': ...}}}}", param=param)
    return ToolChoice(mode="required", name=name)


def check_named_tool(conversation: Conversation, param: str = "tool_choice") -> None:
    choice = conversation.tool_choice
    if choice.mode == "required" and not conversation.tools:
        raise invalid(f"`{param}` asks for a tool call but no `tools` are given", param=param)
    if choice.name is not None and all(t["function"]["name"] != choice.name for t in conversation.tools):
        raise invalid(f"`{param}` names {choice.name!r}, which is not among `tools`", param=param)


def response_format_options(options: Options, response_format: ResponseFormat | None, param: str = "response_format") -> None:
    if response_format is None or response_format.type == "text":
        return
    if response_format.type == "json_object":
        options.json_object = True
    elif response_format.type == "json_schema":
        schema = response_format.json_schema.schema if response_format.json_schema else None
        if not isinstance(schema, dict):
            raise invalid(f"`{param}.json_schema.schema` must be a JSON schema object", param=param)
        options.json_schema = schema
    else:
        raise invalid(f"`{param}.type` must be 'text', 'json_object' or 'json_schema'", param=param)


def sampling_overrides(data: Any) -> dict:
    """SamplingParams overrides from OpenAI fields (and llama.cpp's extra names)."""
    repeat = getattr(data, "repeat_penalty", None) or getattr(data, "repetition_penalty", None)
    values = {
        "temperature": data.temperature, "top_p": data.top_p, "top_k": getattr(data, "top_k", None),
        "min_p": getattr(data, "min_p", None), "presence_penalty": getattr(data, "presence_penalty", None),
        "frequency_penalty": getattr(data, "frequency_penalty", None), "repeat_penalty": repeat,
        "seed": data.seed,
    }
    bias = getattr(data, "logit_bias", None)
    if bias:
        values["logit_bias"] = logit_bias(bias)
    return {key: value for key, value in values.items() if value is not None}


def logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id as a string -> a number from -100 to 100 added to its logit)."""
    if len(bias) > 1024:
        raise invalid("`logit_bias` may name at most 1024 tokens", param="logit_bias")
    entries = []
    for key, value in bias.items():
        if not key.isdigit():
            raise invalid(f"`logit_bias` keys are token ids, not {key!r}", param="logit_bias")
        entries.append((int(key), float(value)))
    return tuple(entries)


def conversation_and_options(data: ChatCompletionRequest) -> tuple[Conversation, Options]:
    if data.n not in (None, 1):
        raise invalid("only `n` = 1 is supported", param="n")
    messages = [_message(message, index) for index, message in enumerate(data.messages)]
    tools = [function_tool(t.function.name, t.function.description, t.function.parameters, f"tools[{i}]")
             for i, t in enumerate(data.tools or []) if t.type == "function"]
    template_kwargs = dict(data.chat_template_kwargs or {})
    thinking = template_kwargs.pop("enable_thinking", None)
    if not isinstance(thinking, bool):
        thinking = thinking_from_effort(data.reasoning_effort)
    conversation = Conversation(messages=messages, tools=tools, tool_choice=tool_choice(data.tool_choice),
                                thinking=thinking, template_kwargs=template_kwargs)
    check_named_tool(conversation)
    max_tokens, param = data.max_tokens, "max_tokens"
    if data.max_completion_tokens is not None:
        max_tokens, param = data.max_completion_tokens, "max_completion_tokens"
    logprobs = None
    if data.logprobs:
        logprobs = data.top_logprobs or 0
    options = Options(max_tokens=max_tokens, max_tokens_param=param, sampling=sampling_overrides(data),
                      stop=stop_list(data.stop), logprobs=logprobs, ignore_eos=bool(data.ignore_eos))
    response_format_options(options, data.response_format)
    return conversation, options


async def start_chat(service: ModelService, conversation: Conversation, options: Options) -> Generation:
    """Render, validate (off the event loop) and submit a chat generation (shared by every chat-shaped
    endpoint)."""
    service.require_ready()
    conversation = apply_forced_tool(service.forced_tools, conversation)
    if service.config.short_answers and conversation.tool_choice.mode != "required":
        conversation = attrs.evolve(conversation, thinking=False)  # --short-answers: see forced_tool.py
    prompt, request, parser = await off_loop(prepare_chat, service, conversation, options)
    return Generation(service, prompt, request, parser)


def prepare_chat(service: ModelService, conversation: Conversation, options: Options) -> tuple[Any, Any, Any]:
    """The prompt, the engine request and the response parser of a chat; blocking (rendering, tokenizing,
    compiling a grammar)."""
    prompt = render_chat(service, conversation)
    if conversation.pinned_arguments is not None:  # --force-tool-call: the prompt shows the client's tools
        conversation = attrs.evolve(conversation, tools=tools_with_pinned_arguments(conversation))
    parser = make_parser(service, conversation, prompt)
    constraint = None
    choice = conversation.tool_choice
    structured = options.json_schema is not None or options.json_object
    if choice.mode == "auto" and conversation.tools and not structured:
        # Free text, but each call the model opens is held to its tool's schema (the family's grammar).
        try:
            constraint = parser.constraint_for("auto", service.loaded.tokenizer)
        except LuceboxError as exc:
            raise invalid(f"the tools' schemas cannot be enforced: {exc}", param="tools") from None
    if choice.mode == "required":  # the output must be a tool call: the family's parser knows its grammar
        if structured:
            raise invalid("a forced tool call and a JSON response format cannot be combined", param="tool_choice")
        wanted = {"type": "function", "function": {"name": choice.name}} if choice.name else "required"
        try:
            constraint = parser.constraint_for(wanted, service.loaded.tokenizer)
        except LuceboxError as exc:
            raise invalid(f"the tool call cannot be enforced: {exc}", param="tool_choice") from None
        if constraint is None:
            raise invalid(f"this model family ({service.architecture}) has no tool-call grammar, so a tool call "
                          "cannot be forced; use tool_choice 'auto'", param="tool_choice")
    short = service.config.short_answers
    if short and choice.mode != "required" and not structured and not prompt.in_reasoning:
        # --short-answers (testing): plain text of bounded length, then the end (forced_tool.py says why).
        from ..constraints import lark_constraint

        constraint = lark_constraint(service.loaded.tokenizer, short_answer_grammar(short))
    return prompt, generation_request(service, prompt, options, constraint), parser


def _logprob_entry(entry: TokenLogprob) -> dict:
    return {
        "token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes,
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in entry.top],
    }


@post("/v1/chat/completions", status_code=200, summary="Chat completion (OpenAI)", tags=["openai"])
async def chat_completions(data: JSONBody[ChatCompletionRequest], service: NamedDependency[ModelService]) -> Response[Any]:
    conversation, options = conversation_and_options(data)
    generation = await start_chat(service, conversation, options)
    chat_id, created, model = new_id("chatcmpl-"), now(), service.model_name
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        chunks = _stream(generation, chat_id, created, model, include_usage)
        return sse.stream(sse.guarded(chunks, generation, lambda e: sse.data(_error_payload(e)) + sse.DONE))
    try:
        collected = await Collected.gather(generation)
    finally:
        generation.cancel()
    assert collected.done is not None
    message: dict[str, Any] = {"role": "assistant", "content": collected.content}
    if collected.reasoning:
        message["reasoning_content"] = message["reasoning"] = collected.reasoning
    if collected.tool_calls:
        message["content"] = collected.content or None
        message["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in collected.tool_calls
        ]
    logprobs = {"content": [_logprob_entry(e) for e in collected.logprobs]} if options.logprobs is not None else None
    body = {
        "id": chat_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": "lucebox",
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": collected.done.finish_reason}],
        "usage": collected.done.usage.openai(),
    }
    return Response(body, media_type="application/json")


def _error_payload(error: APIError) -> dict:
    return {"error": {"message": error.message, "type": error.type or "server_error", "param": error.param,
                      "code": error.code}}


async def _stream(generation: Generation, chat_id: str, created: int, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": "lucebox",
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                         "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse.data(payload)

    yield chunk({"role": "assistant", "content": ""})
    pending_logprobs: list[dict] = []
    async for event in generation:
        if isinstance(event, TokenLogprob):
            pending_logprobs.append(_logprob_entry(event))
        elif isinstance(event, TextDelta):
            if not event.text:
                continue
            delta = {"reasoning_content": event.text, "reasoning": event.text} if event.reasoning else {"content": event.text}
            yield chunk(delta, logprobs=pending_logprobs)
            pending_logprobs = []
        elif isinstance(event, ToolCallStart):
            yield chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                          "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallDelta):
            if event.arguments:
                yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        elif isinstance(event, Done):
            yield chunk({}, event.finish_reason, logprobs=pending_logprobs)
            if include_usage:
                usage = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "system_fingerprint": "lucebox", "choices": [], "usage": event.usage.openai()}
                yield sse.data(usage)
    yield sse.DONE
