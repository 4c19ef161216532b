"""POST /v1/completions: raw text in (a string or token ids), raw text out; no template, no parser."""

from __future__ import annotations

from typing import Any, AsyncIterator

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from . import sse
from .errors import invalid
from .generation import (
    Collected, Done, Generation, Options, TextDelta, TokenLogprob, generation_request, new_id, now, off_loop,
    stop_list, tokenize_prompt,
)
from .openai_chat import _error_payload, response_format_options, sampling_overrides
from .schemas import CompletionRequest
from .service import ModelService

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def _logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions logprobs shape: parallel lists."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top.append({text: logprob for text, logprob, _ in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@post("/v1/completions", status_code=200, summary="Text completion (OpenAI legacy)", tags=["openai"])
async def completions(data: JSONBody[CompletionRequest], service: NamedDependency[ModelService]) -> Response[Any]:
    service.require_ready()
    if data.n not in (None, 1) or data.best_of not in (None, 1):
        raise invalid("only `n` = 1 (and `best_of` = 1) is supported", param="n")
    if data.suffix:
        raise invalid("`suffix` (fill-in-the-middle) is not supported", param="suffix")
    options = Options(max_tokens=data.max_tokens, sampling=sampling_overrides(data), stop=stop_list(data.stop),
                      logprobs=data.logprobs, ignore_eos=bool(data.ignore_eos))
    response_format_options(options, data.response_format)
    prompt, request = await off_loop(_prepare, service, data.prompt, options)
    generation = Generation(service, prompt, request)
    echo = (prompt.text if prompt.text is not None else service.loaded.tokenizer.decode(prompt.ids)) if data.echo else ""
    completion_id, created, model = new_id("cmpl-"), now(), service.model_name
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        chunks = _stream(generation, completion_id, created, model, echo, include_usage, data.logprobs is not None)
        return sse.stream(sse.guarded(chunks, generation, lambda e: sse.data(_error_payload(e)) + sse.DONE))
    try:
        collected = await Collected.gather(generation)
    finally:
        generation.cancel()
    assert collected.done is not None
    choice = {
        "text": echo + collected.content, "index": 0,
        "logprobs": _logprobs(collected.logprobs, len(echo)) if data.logprobs is not None else None,
        "finish_reason": collected.done.finish_reason,
    }
    body = {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "lucebox", "choices": [choice], "usage": collected.done.usage.openai()}
    return Response(body, media_type="application/json")


def _prepare(service: ModelService, raw_prompt: Any, options: Options) -> tuple[Any, Any]:
    """The prompt and the engine request (blocking: tokenizing, compiling a grammar)."""
    prompt = tokenize_prompt(service, raw_prompt)
    if options.max_tokens is None:
        options.max_tokens = max(1, min(DEFAULT_MAX_TOKENS, service.ctx_size - len(prompt.ids)))
    return prompt, generation_request(service, prompt, options)


async def _stream(generation: Generation, completion_id: str, created: int, model: str, echo: str,
                  include_usage: bool, with_logprobs: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, logprobs: list[TokenLogprob] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": completion_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "lucebox",
            "choices": [{"text": text, "index": 0,
                         "logprobs": _logprobs(logprobs or [], offset) if with_logprobs else None,
                         "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse.data(payload)

    offset = 0
    if echo:
        yield chunk(echo)
        offset = len(echo)
    pending: list[TokenLogprob] = []
    async for event in generation:
        if isinstance(event, TokenLogprob):
            pending.append(event)
        elif isinstance(event, TextDelta) and event.text:
            yield chunk(event.text, logprobs=pending)
            offset += len(event.text)
            pending = []
        elif isinstance(event, Done):
            yield chunk("", event.finish_reason, logprobs=pending)
            if include_usage:
                yield sse.data({"id": completion_id, "object": "text_completion", "created": created, "model": model,
                                "system_fingerprint": "lucebox", "choices": [], "usage": event.usage.openai()})
    yield sse.DONE
