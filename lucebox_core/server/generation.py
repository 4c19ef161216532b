"""What every endpoint shares: from a conversation to prompt ids, from request fields to a
`GenerationRequest`, and from the engine's steps to API-neutral events.

Each API module (chat completions, completions, responses, messages) only translates its wire format
into a `Conversation` + `Options`, and the events below back into its wire format.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, AsyncIterator, Callable, Iterable, TypeVar

import attrs
import torch

from ..chat_prompt import render_chat as render_chat_text
from ..chat_template import decode_tool_arguments
from ..engine import GenerationRequest, Step
from ..errors import LuceboxError
from ..sampling import SamplingParams
from .errors import invalid
from .replay import content_after_reasoning
from .scheduler import Finished
from .service import ModelService


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


T = TypeVar("T")


async def off_loop(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` on a worker thread: rendering and tokenizing a long prompt takes up to seconds
    (a megabyte: about one), during which the event loop must go on answering `/health` and streaming
    other requests. The tokenizer's Rust half releases the GIL; the Python half yields it every few ms."""
    return await asyncio.to_thread(function, *args)


# ------------------------------------------------------------------------------------------- inputs


@attrs.define(kw_only=True)
class ToolChoice:
    mode: str = "auto"  # "auto" | "none" | "required"
    name: str | None = None  # with mode "required": this function


@attrs.define(kw_only=True)
class Conversation:
    """A chat in the chat template's terms (OpenAI chat messages and function tools)."""

    messages: list[dict]
    tools: list[dict] = attrs.Factory(list)  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: ToolChoice = attrs.Factory(ToolChoice)
    thinking: bool | None = None  # None: the server's default
    template_kwargs: dict = attrs.Factory(dict)
    param: str = "messages"  # the request field the conversation came in (errors name it)
    pinned_arguments: dict | None = None  # --force-tool-call NAME=ARGS: the schema the forced call is held to


@attrs.define(kw_only=True)
class Options:
    """Generation settings, named as in OpenAI's API; `sampling` holds `SamplingParams` overrides."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # how the client named it, for error messages
    sampling: dict = attrs.Factory(dict)
    stop: list[str] = attrs.Factory(list)
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's and N alternatives
    json_schema: dict | None = None  # structured output: this schema
    json_object: bool = False  # structured output: any JSON object
    think_budget: int | None = None  # close the reasoning after this many tokens (may only tighten --think-max-tokens)
    ignore_eos: bool = False  # llama.cpp's `ignore_eos`: an end-of-generation token does not end it


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise invalid("at most 16 stop sequences are supported", param=param)
    return [s for s in stops if s]


def text_of(content: Any, where: str, part_types: Iterable[str] = ("text", "input_text", "output_text")) -> str:
    """The text of a message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if not isinstance(part, dict):
                raise invalid(f"{where}: each content part must be an object", param=where)
            kind = part.get("type", "text")
            if kind in part_types and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in ("image_url", "input_image", "image", "input_audio", "file", "input_file", "document"):
                raise invalid(f"{where}: content of type {kind!r} is not supported; this server takes text only",
                              param=where)
            else:
                raise invalid(f"{where}: unsupported content part {kind!r} (expected text)", param=where)
        return "".join(pieces)
    raise invalid(f"{where}: content must be a string or a list of parts", param=where)


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}: a function tool needs a non-empty string `name`", param=where)
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}: `parameters` must be a JSON schema object", param=where)
    function: dict[str, Any] = {"name": name}
    if isinstance(description, str):
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def thinking_from_effort(effort: str | None) -> bool | None:
    if effort is None:
        return None
    return effort.lower() not in ("none", "off", "disabled", "minimal")


# ------------------------------------------------------------------------------------- the prompt


@attrs.define
class Prompt:
    ids: list[int]
    text: str | None = None  # the rendered template (chat requests)
    in_reasoning: bool = False  # the template opened a thought the model will continue
    param: str = "prompt"  # the request field it came from: `messages`, `input`, `prompt` (errors name it)


def refuse_certainly_too_long(service: ModelService, text: str, param: str) -> None:
    """Refuse a text that cannot fit in the context whatever its tokens, before tokenizing it: no token stands
    for more than `max_token_bytes` bytes, so N bytes are at least N / that many tokens. Counting its bytes
    takes milliseconds where tokenizing 64 MB would take a minute."""
    if len(text) < service.ctx_size:  # fewer characters than positions: the bound cannot decide
        return
    tokenizer = service.loaded.tokenizer
    at_least = -(-len(text.encode("utf-8", "surrogatepass")) // tokenizer.max_token_bytes)
    if at_least >= service.ctx_size:
        raise invalid(
            f"the prompt from `{param}` is at least {at_least} tokens ({len(text)} characters) but the context "
            f"holds {service.ctx_size}; shorten it (or start the server with a larger -c/--ctx-size)",
            param=param, code="context_length_exceeded",
        )


def one_system_message(messages: list[dict]) -> list[dict]:
    """All system (and developer) messages merged into one, first.

    Clients send several (Codex: `instructions` plus developer messages; some put one mid-conversation),
    while most templates (Qwen's among them) accept one system message, at the beginning only.
    """
    systems = [m for m in messages if m.get("role") == "system"]
    if len(systems) <= 1 and (not systems or messages[0] is systems[0]):
        return messages
    merged = {"role": "system", "content": "\n\n".join(str(m.get("content") or "") for m in systems)}
    return [merged] + [m for m in messages if m.get("role") != "system"]


def render_chat(service: ModelService, conversation: Conversation) -> Prompt:
    """The prompt of a chat: the template rendered, control-token text that users and tools wrote kept as
    text (see `lucebox_core.chat_prompt`), then tokenized. Blocking: handlers run it off the event loop."""
    loaded = service.loaded
    template = loaded.chat_template
    param = conversation.param
    if template is None:
        raise invalid(f"{loaded.path.name} has no chat template; start the server with --chat-template-file")
    if not conversation.messages:
        raise invalid(f"`{param}` must not be empty", param=param)
    kwargs = dict(conversation.template_kwargs)
    thinking = conversation.thinking
    if thinking is None and "enable_thinking" not in kwargs:
        thinking = service.config.thinking_default
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    tools = conversation.tools if conversation.tool_choice.mode != "none" else []
    if conversation.tool_choice.name is not None:  # a named choice: only that tool is offered
        tools = [t for t in tools if t["function"]["name"] == conversation.tool_choice.name]
    try:
        messages = service.tool_replay.restore(one_system_message(conversation.messages))
        rendered = render_chat_text(template, loaded.tokenizer, decode_tool_arguments(messages),
                                    tools=tools or None, add_generation_prompt=True, **kwargs)
        ids = rendered.encode(loaded.tokenizer)
        compressor = service.chat_compressor
        if compressor is not None and compressor.wanted(len(ids)):
            # PFlash: aged free text shortened by the scorer (never the system prompt, tools, tool calls and
            # results; the last user message only under `always` when the rest alone is over the threshold),
            # then the chat rendered again.
            def measure(chat: list[dict]) -> int:
                return len(render_chat_text(template, loaded.tokenizer, decode_tool_arguments(chat),
                                            tools=tools or None, add_generation_prompt=True,
                                            **kwargs).encode(loaded.tokenizer))

            shorter = compressor.apply(messages, measure)
            if shorter is not messages:
                rendered = render_chat_text(template, loaded.tokenizer, decode_tool_arguments(shorter),
                                            tools=tools or None, add_generation_prompt=True, **kwargs)
                ids = rendered.encode(loaded.tokenizer)
    except LuceboxError as exc:
        raise invalid(f"the conversation cannot be rendered: {exc}", param=param) from None
    refuse_certainly_too_long(service, rendered.text, param)
    opening = service.parser_spec.reasoning_tags[0] if service.parser_spec is not None else "<think>"
    return Prompt(ids, rendered.text, in_reasoning=rendered.text.rstrip().endswith(opening.rstrip()), param=param)


def tokenize_prompt(service: ModelService, prompt: Any, param: str = "prompt") -> Prompt:
    """A completions prompt: a string, token ids, or a one-element list of either. A string is raw model
    input (the client writes any template markup itself), so its control-token text is parsed, as
    llama-server does. Blocking: handlers run it off the event loop."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    tokenizer = service.loaded.tokenizer
    if isinstance(prompt, str):
        refuse_certainly_too_long(service, prompt, param)
        ids = tokenizer.encode(prompt, parse_special=True)
        compressor = service.chat_compressor
        if compressor is not None and compressor.wanted(len(ids)):
            prompt = compressor.apply_text(prompt)  # PFlash, whole: its last chunks (the question) kept
            ids = tokenizer.encode(prompt, parse_special=True)
        return Prompt(ids, prompt, param=param)
    if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", param=param)
        return Prompt(list(prompt), param=param)
    raise invalid("`prompt` must be a string, a list of token ids, or a list holding one of those "
                  "(batches of several prompts are not supported)", param=param)


# ---------------------------------------------------------------------------------- the request


def generation_request(service: ModelService, prompt: Prompt, options: Options, constraint: Any = None) -> GenerationRequest:
    ctx = service.ctx_size
    if not prompt.ids:
        raise invalid("the prompt is empty", param=prompt.param)
    if len(prompt.ids) >= ctx:
        raise invalid(
            f"the prompt is {len(prompt.ids)} tokens but the context holds {ctx}; shorten it "
            "(or start the server with a larger -c/--ctx-size)", param=prompt.param, code="context_length_exceeded",
        )
    room = ctx - len(prompt.ids)
    requested = options.max_tokens
    if requested is not None and service.config.n_predict is not None:
        # The server's limit (-n) applies first, as llama-server's does: a client that always asks for more
        # than the context holds (Claude Code asks for 32000) works against a server started with -n.
        requested = min(requested, service.config.n_predict)
    if requested is not None and requested > room:
        raise invalid(
            f"`{options.max_tokens_param}` is {requested} but only {room} tokens fit in the context "
            f"({ctx}) after the {len(prompt.ids)}-token prompt; ask for fewer (or start the server with "
            "-n N to cap every request, or a larger -c)", param=options.max_tokens_param,
            code="context_length_exceeded",
        )
    max_tokens = options.max_tokens if options.max_tokens is not None else room
    if service.config.n_predict is not None:  # the server's limit (-n), as llama-server applies it
        max_tokens = min(max_tokens, service.config.n_predict)
    overrides = dict(options.sampling)
    vocab = service.loaded.tokenizer.vocab_size
    for token_id, _ in overrides.get("logit_bias", ()):
        if token_id >= vocab:
            raise invalid(f"`logit_bias` names token {token_id}, outside the vocabulary [0, {vocab})", param="logit_bias")
    if 0 < overrides.get("temperature", 1.0) < 1e-6:
        overrides["temperature"] = 0.0  # logits divided by so small a number overflow: it is greedy anyway
    try:
        sampling = SamplingParams.from_gguf_defaults(service.loaded.gguf.metadata, **overrides)
    except (LuceboxError, TypeError, ValueError) as exc:
        raise invalid(f"invalid sampling settings: {exc}") from None
    if constraint is None:
        constraint = structured_output_constraint(service, options, prompt)
    budgets = [b for b in (service.config.think_max_tokens, options.think_budget) if b is not None]
    if budgets:
        constraint = ThinkBudget.wrap(constraint, service.loaded.tokenizer, min(budgets), prompt.in_reasoning,
                                      tags=_reasoning_tags(service))
    return GenerationRequest(
        prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling, stop=options.stop,
        logprobs=options.logprobs, constraint=constraint, ignore_eos=options.ignore_eos,
    )


def structured_output_constraint(service: ModelService, options: Options, prompt: Prompt) -> Any:
    """A constraint that makes the output valid JSON (for the schema, if one is given); when the prompt
    leaves the model thinking, the reasoning stays free and the JSON follows `</think>`."""
    if options.json_schema is None and not options.json_object:
        return None
    from ..constraints import json_schema_constraint

    schema = options.json_schema if options.json_schema is not None else {"type": "object"}
    # Compact JSON, as OpenAI's structured outputs give: free whitespace lets a weak model pad
    # forever (until max_tokens) without ever closing the object. A schema may say otherwise.
    schema = {"x-guidance": {"whitespace_flexible": False}, **schema}
    try:
        return json_schema_constraint(service.loaded.tokenizer, schema, after_reasoning=prompt.in_reasoning,
                                      reasoning_close=_reasoning_tags(service)[1])
    except LuceboxError as exc:
        raise invalid(f"the JSON schema cannot be enforced: {exc}", param="response_format") from None


def _reasoning_tags(service: ModelService) -> tuple[str, str]:
    return service.parser_spec.reasoning_tags if service.parser_spec is not None else ("<think>", "</think>")


class ThinkBudget:
    """A constraint that ends a thought after `budget` tokens by allowing only its closing tag next (the
    family's: Qwen's `</think>`, Gemma-4's `<channel|>`).

    It wraps the request's other constraint (a JSON grammar that leaves the reasoning free, say), which
    still sees every token; the model then goes on to answer as if it had closed the thought itself.
    """

    def __init__(self, inner: Any, open_id: int | None, close_id: int, budget: int, thinking: bool):
        self.inner, self.open_id, self.close_id, self.budget = inner, open_id, close_id, budget
        self.thinking = thinking
        self.spent = 0

    @classmethod
    def wrap(cls, inner: Any, tokenizer: Any, budget: int, thinking: bool,
             tags: tuple[str, str] = ("<think>", "</think>")) -> Any:
        close_id = tokenizer.token_to_id(tags[1])
        if close_id is None:  # a model without a single-token close tag has no thought to cut
            return inner
        return cls(inner, tokenizer.token_to_id(tags[0].strip()), close_id, max(0, budget), thinking)

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if self.thinking and self.spent >= self.budget:
            forced = torch.zeros(vocab_size, dtype=torch.bool)
            forced[self.close_id] = True
            return forced
        return self.inner.allowed(vocab_size) if self.inner is not None else None

    def accept(self, token_id: int) -> None:
        if self.inner is not None:
            self.inner.accept(token_id)
        if token_id == self.close_id:
            self.thinking = False
        elif token_id == self.open_id:
            self.thinking = True
        elif self.thinking:
            self.spent += 1

    @property
    def finished(self) -> bool:
        return self.inner is not None and self.inner.finished

    @property
    def dormant(self) -> bool:
        """Nothing masked now: the thought is within its budget, and the inner constraint (if any) is dormant."""
        forcing = self.thinking and self.spent >= self.budget
        return not forcing and (self.inner is None or bool(getattr(self.inner, "dormant", False)))


# ------------------------------------------------------------------------------------ the events


@attrs.frozen
class TextDelta:
    text: str
    reasoning: bool = False


@attrs.frozen
class ToolCallStart:
    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallDelta:
    index: int
    arguments: str  # a piece of the JSON arguments


@attrs.frozen
class ToolCallEnd:
    index: int
    raw_text: str = ""  # the call exactly as generated


@attrs.frozen
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: tuple[tuple[str, float, list[int]], ...]


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    prompt_ms: float
    decode_ms: float
    accepted_lengths: tuple[int, ...] = ()  # per speculative step: accepted drafts + bonus
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled (of prompt_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def timings(self) -> dict:
        decode_s = self.decode_ms / 1000
        timings = {
            "prompt_n": self.prompt_tokens - self.cached_tokens, "cache_n": self.cached_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "predicted_n": self.completion_tokens, "predicted_ms": round(self.decode_ms, 3),
            "predicted_per_second": round(self.completion_tokens / decode_s, 3) if decode_s > 0 else 0.0,
        }
        if self.accepted_lengths:
            timings["accepted_lengths"] = list(self.accepted_lengths)
            timings["mean_accepted_length"] = round(sum(self.accepted_lengths) / len(self.accepted_lengths), 3)
        return timings

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "timings": self.timings(),
        }


@attrs.frozen
class Done:
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage


Event = TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | TokenLogprob | Done


class Generation:
    """One submitted generation, consumed once with `async for event in generation`.

    Validation happens before: by the time a `Generation` exists, the request is known to be good, so
    a streaming handler can send its headers. The parser (when given) splits raw text into reasoning,
    content and tool calls.
    """

    def __init__(self, service: ModelService, prompt: Prompt, request: GenerationRequest, parser: Any = None):
        self.service = service
        self.prompt = prompt
        self.request = request
        self.parser = parser
        self.raw_text: list[str] = []  # exactly what the model produced (for tool-call replay)
        self.job = service.scheduler.submit(request)

    def cancel(self) -> None:
        self.job.cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        service, tokenizer = self.service, self.service.loaded.tokenizer
        metrics = service.metrics
        generated = 0
        reasoning_chars = 0
        call_ids: list[str] = []
        finish = "length"
        try:
            async for item in self.job:
                if isinstance(item, Finished):
                    timings = item.timings
                    break
                step: Step = item
                if step.token_id is not None:
                    generated += 1
                if step.logprob is not None and step.token_id is not None:
                    yield self._logprob(tokenizer, step)
                self.raw_text.append(step.text)
                for event in self._parse(step.text, final=step.finish_reason is not None):
                    if isinstance(event, ToolCallStart):
                        call_ids.append(event.id)
                    if isinstance(event, TextDelta) and event.reasoning:
                        reasoning_chars += len(event.text)
                    yield event
                if step.finish_reason:
                    finish = step.finish_reason
            else:  # the job ended without a Finished item: it was cancelled
                return
        except LuceboxError as exc:
            raise invalid(str(exc)) from None
        if call_ids and finish == "stop":
            finish = "tool_calls"
        if call_ids:
            raw = content_after_reasoning("".join(self.raw_text), self.prompt.in_reasoning,
                                          close=_reasoning_tags(self.service)[1])
            service.tool_replay.remember(call_ids, raw)
        reasoning_tokens = 0
        if reasoning_chars:
            reasoning_tokens = min(generated, len(tokenizer.encode(
                "".join(self.raw_text)[: reasoning_chars + 16], add_bos=False)))
        usage = Usage(len(self.prompt.ids), generated, reasoning_tokens,
                      timings.prompt_seconds * 1000, timings.decode_seconds * 1000, tuple(timings.accepted_lengths),
                      timings.cached_tokens)
        for accepted in timings.accepted_lengths:
            metrics.accepted_length.observe(accepted)
        metrics.prompt_tokens.inc(timings.prompt_tokens)
        metrics.cached_prompt_tokens.inc(timings.cached_tokens)
        metrics.generated_tokens.inc(generated)
        if self.job.first_token_at is not None:
            metrics.ttft.observe(self.job.first_token_at - self.job.submitted)
        if timings.decode_tokens_per_s > 0:
            metrics.decode_speed.observe(timings.decode_tokens_per_s)
        if timings.prompt_tokens_per_s > 0:
            metrics.prefill_speed.observe(timings.prompt_tokens_per_s)
        metrics.prefill_seconds.inc(timings.prompt_seconds)
        yield Done(finish, usage)

    def _parse(self, text: str, final: bool) -> list[Event]:
        if self.parser is None:
            return [TextDelta(text)] if text else []
        events = adapt_parser_events(self.parser.feed(text)) if text else []
        if final:
            events += adapt_parser_events(self.parser.finish())
        return events

    @staticmethod
    def _logprob(tokenizer: Any, step: Step) -> TokenLogprob:
        def piece(token_id: int) -> tuple[str, list[int]]:
            raw = tokenizer.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), list(raw)

        alternatives = []
        for token_id, logprob in step.top_logprobs:
            text, raw = piece(token_id)
            alternatives.append((text, float(logprob), raw))
        text, raw = piece(step.token_id)
        return TokenLogprob(text, float(step.logprob), raw, tuple(alternatives))


def adapt_parser_events(events: Iterable[Any]) -> list[Event]:
    """The family parser's events in the server's terms (the one place the two meet)."""
    adapted: list[Event] = []
    for event in events or ():
        kind = type(event).__name__
        if kind == "ReasoningDelta":
            adapted.append(TextDelta(event.text, reasoning=True))
        elif kind == "ContentDelta":
            adapted.append(TextDelta(event.text))
        elif kind == "ToolCallStart":
            adapted.append(ToolCallStart(event.index, getattr(event, "id", None) or new_id("call_"), event.name))
        elif kind == "ToolCallArgsDelta":
            adapted.append(ToolCallDelta(event.index, event.fragment))
        elif kind == "ToolCallEnd":
            adapted.append(ToolCallEnd(event.index, getattr(event, "raw_text", "")))
        elif isinstance(event, (TextDelta, ToolCallStart, ToolCallDelta, ToolCallEnd)):
            adapted.append(event)
    return adapted


def make_parser(service: ModelService, conversation: Conversation, prompt: Prompt) -> Any:
    """The family's streaming parser for this response (reasoning, content, tool calls)."""
    tools = conversation.tools if conversation.tool_choice.mode != "none" else []
    return service.parser_spec.create(tools=tools, thinking=prompt.in_reasoning)


# -------------------------------------------------------------------------------------- collecting


@attrs.define
class Collected:
    """A whole response gathered from its events (the non-streaming form of every endpoint)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = attrs.Factory(list)  # [{"id", "name", "arguments"}]
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    done: Done | None = None

    @classmethod
    async def gather(cls, events: AsyncIterator[Event]) -> "Collected":
        collected = cls()
        content, reasoning = [], []
        async for event in events:
            if isinstance(event, TextDelta):
                (reasoning if event.reasoning else content).append(event.text)
            elif isinstance(event, ToolCallStart):
                collected.tool_calls.append({"id": event.id, "name": event.name, "arguments": ""})
            elif isinstance(event, ToolCallDelta):
                collected.tool_calls[event.index]["arguments"] += event.arguments
            elif isinstance(event, TokenLogprob):
                collected.logprobs.append(event)
            elif isinstance(event, Done):
                collected.done = event
        collected.content, collected.reasoning = "".join(content), "".join(reasoning)
        for call in collected.tool_calls:
            call["arguments"] = call["arguments"] or "{}"
        return collected


def now() -> int:
    return int(time.time())
