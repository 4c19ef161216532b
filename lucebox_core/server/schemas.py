"""Request bodies, as clients send them.

Each model lists the fields a client may send, with the types the API documents; fields the server
cannot honour are still declared (and ignored) so the OpenAPI schema says they are accepted, and
fields nobody declared are tolerated (msgspec ignores unknown keys). Value checks that the schema can
express (ranges) live here as `Meta` constraints so they show in the schema too; the rest is checked
where the request is turned into a generation (`generation.py`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Json = dict[str, Any]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NonNegative = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
TokenCount = Annotated[int, Meta(ge=1)]  # max_tokens and its kin: OpenAI and Anthropic refuse anything below 1
Stop = str | list[str]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # a 64-bit seed (what a torch generator takes)
LogitBias = dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]]  # token id (as a string) -> added to its logit


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling knobs shared by the OpenAI-style endpoints (llama.cpp names accepted too)."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: NonNegative | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: bool | None = None  # llama.cpp's: run to max_tokens past an end-of-generation token


# --------------------------------------------------------------------------------- chat completions


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: Json | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: Json | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Json] | None = None
    name: str | None = None
    tool_calls: list[Json] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # DeepSeek / llama.cpp convention
    reasoning: str | None = None  # vLLM / OpenRouter convention


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    n: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | Json | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: Json | None = None
    user: str | None = None
    metadata: Json | None = None
    logit_bias: LogitBias | None = None
    store: bool | None = None


# -------------------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    n: Positive | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Positive | None = None
    user: str | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------------------------- responses


class ResponsesTextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # "text" | "json_object" | "json_schema"
    name: str | None = None
    schema: Json | None = None
    strict: bool | None = None
    description: str | None = None


class ResponsesText(msgspec.Struct, kw_only=True):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[Json]
    model: str | None = None
    instructions: str | None = None
    stream: bool | None = False
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: NonNegative | None = None
    seed: Seed | None = None
    tools: list[Json] | None = None
    tool_choice: str | Json | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: ResponsesText | None = None
    reasoning: ReasoningOptions | None = None
    # Accepted and ignored (Codex sends them).
    store: bool | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    metadata: Json | None = None
    truncation: str | None = None
    user: str | None = None


# ----------------------------------------------------------------------------------------- anthropic


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Json]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: Json | None = None
    type: str | None = None


class AnthropicThinking(msgspec.Struct, kw_only=True):
    type: str  # "enabled" | "disabled"
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    messages: list[AnthropicMessage]
    model: str | None = None
    system: str | list[Json] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: Json | None = None
    thinking: AnthropicThinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: TokenCount
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Probability | None = None
    top_k: NonNegative | None = None
    metadata: Json | None = None
    service_tier: str | None = None


# ------------------------------------------------------------------------------------------- others


class TokenizeRequest(msgspec.Struct, kw_only=True):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
