"""The endpoints around generation: models, health, props, metrics, tokenize, detokenize."""

from __future__ import annotations

from typing import Any

from litestar import Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from .. import __version__
from .errors import invalid
from .generation import off_loop
from .schemas import DetokenizeRequest, TokenizeRequest
from .service import ModelService

ENDPOINTS = [
    "GET /health", "GET /v1/models", "GET /props", "GET /metrics", "POST /tokenize", "POST /detokenize",
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
    "POST /v1/messages/count_tokens",
]
EFFORTS = ["none", "low", "medium", "high"]


def _model_card(service: ModelService) -> dict:
    return {
        "id": service.model_name, "object": "model", "created": int(service.started), "owned_by": "lucebox",
        "context_length": service.ctx_size, "max_context_length": service.ctx_size,
    }


@get("/v1/models", summary="List the served model (OpenAI)", tags=["openai"])
async def list_models(service: NamedDependency[ModelService]) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(service)]}


@get("/v1/models/{model_id:path}", summary="Describe a model (any id names the served model)", tags=["openai"])
async def retrieve_model(model_id: FromPath[str], service: NamedDependency[ModelService]) -> dict[str, Any]:
    return _model_card(service)


@get("/health", summary="200 when ready, 503 while loading or after a failed load", tags=["server"])
async def health(service: NamedDependency[ModelService]) -> Response[dict[str, Any]]:
    if service.status == "ok":
        return Response({"status": "ok"}, status_code=200)
    body: dict[str, Any] = {"status": service.status}
    if service.error:
        body["error"] = service.error
    return Response(body, status_code=503, headers={"Retry-After": "1"} if service.status == "loading" else None)


@get("/props", summary="Model, context and runtime settings (Lucebox /props, schema 2)", tags=["server"])
async def props(service: NamedDependency[ModelService]) -> dict[str, Any]:
    config = service.config
    loaded = service.loaded
    body: dict[str, Any] = {
        "server": {"name": "lucebox", "version": __version__, "props_schema": 2},
        "build_info": f"lucebox {__version__} props_schema=2",
        "status": service.status,
        "model_alias": service.model_name,
        "model_path": str(loaded.path) if loaded else config.model,
        "total_slots": config.parallel,
        "api": {"endpoints": ENDPOINTS},
        "speculative": {"enabled": False, "ddtree_budget": None},
        "speculative_mode": "off",
        "model": None,
        "default_generation_settings": {"n_ctx": service.ctx_size},
    }
    if loaded is None:
        return body
    drafter = service.drafter_info
    if drafter is not None:
        body["speculative"] = {"enabled": True, "ddtree_budget": drafter.get("tree_budget"), **drafter}
        body["speculative_mode"] = drafter.get("kind", "on")  # the drafter's kind: dflash, ...
    from ..sampling import SamplingParams

    metadata = loaded.gguf.metadata
    sampling = SamplingParams.from_gguf_defaults(metadata)
    has_parser = service.parser_spec is not None and service.parser_spec.name != "plain"
    body.update({
        "model": {
            "arch": service.architecture, "name": metadata.get("general.name"), "family": loaded.family.name,
            "draft_path": service.config.model_draft, "vocab_size": loaded.tokenizer.vocab_size,
            "n_ctx_train": loaded.model.context_length,
        },
        "default_generation_settings": {
            "n_ctx": service.ctx_size, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "min_p": sampling.min_p, "repeat_penalty": sampling.repeat_penalty,
        },
        "capabilities": {"reasoning_supported": True, "speculative_supported": True, "tools_supported": has_parser},
        "reasoning": {"supported": True, "default": "on" if config.thinking_default else "off",
                      "supported_efforts": EFFORTS, "think_max_tokens": config.think_max_tokens},
        "runtime": {"backend": loaded.backend_name,
                    "target_device": config.target_device or config.device or str(getattr(loaded.backend, "device", "default")),
                    "device_map": _device_map_info(loaded, config),
                    "parallel": config.parallel, "chunk": service.engine.prefill_chunk,
                    # The context and how it was chosen (-c, or what fits in memory).
                    "context": service.context.as_dict() if service.context is not None else None,
                    "kv_policy": loaded.model.kv_policy.name, "cache_type_k": getattr(loaded.model, "cache_type_k", None),
                    "cache_type_v": getattr(loaded.model, "cache_type_v", None),
                    # The ops this backend runs as kernels (where their checks accept the arguments).
                    "op_kernels": sorted(getattr(loaded.backend, "op_kernels", {}) or {})},
        "sampling": {"capabilities": {f"supports_{name}": True for name in (
            "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
            "seed", "stop", "logprobs", "response_format", "tools", "ignore_eos")}},
        "chat_template": loaded.chat_template.source if loaded.chat_template else None,
        "response_parser": service.parser_spec.name if service.parser_spec else None,
        "prefix_cache": service.prefix_cache_info() or {"enabled": False},
        "prefill_compression": service.prefill_compression_info() or {"mode": "off"},
        "spark": service.spark.describe() if service.spark is not None else {"enabled": False},
        "kvflash": service.kvflash_info() or {"enabled": False},
        "tool_replay": {"max_entries": service.tool_replay.max_entries, "max_bytes": service.tool_replay.max_bytes,
                        "current_entries": len(service.tool_replay), "current_bytes": service.tool_replay.nbytes},
    })
    return body


def _device_map_info(loaded: Any, config: Any) -> dict[str, Any]:
    """Where the target's layers, its head and the drafter run (--target-devices, --draft-device), and how a
    decode step runs (`step`: "graph", "graph per part" for a split recorded a graph per part, "eager per
    part", "eager") and its prefill pieces (`prefill`: recorded or eager, `static_step.prefill_mode`)."""
    from ..split_step import step_mode
    from ..static_step import prefill_mode

    device_map = getattr(loaded.model, "device_map", None)
    if device_map is not None:
        return {**device_map.describe(), "step": step_mode(loaded.model), "prefill": prefill_mode(loaded.model)}
    device = str(getattr(loaded.backend, "device", "cpu"))
    layers = len(getattr(loaded.model, "layers", ()))
    return {"parts": [{"device": device, "layers": f"0-{layers - 1}" if layers else ""}], "embed_device": device,
            "head_device": device, "draft_device": config.draft_device or (device if config.model_draft else None),
            "step": step_mode(loaded.model), "prefill": prefill_mode(loaded.model)}


@get("/metrics", summary="Prometheus metrics", tags=["server"], media_type="text/plain; version=0.0.4")
async def metrics(service: NamedDependency[ModelService]) -> str:
    return service.metrics.render()


@post("/tokenize", status_code=200, summary="Text to token ids (llama.cpp)", tags=["server"])
async def tokenize(data: JSONBody[TokenizeRequest], service: NamedDependency[ModelService]) -> dict[str, Any]:
    service.require_ready()
    tokenizer = service.loaded.tokenizer

    def tokens() -> dict[str, Any]:  # off the event loop: a megabyte takes about a second
        # add_special: the special tokens the model adds itself (its BOS where it has add_bos), as llama-server does.
        ids = tokenizer.encode(data.content, add_bos=None if data.add_special else False,
                               parse_special=data.parse_special)
        if data.with_pieces:
            return {"tokens": [{"id": i, "piece": tokenizer.token_bytes(i).decode("utf-8", "replace")} for i in ids]}
        return {"tokens": ids}

    return await off_loop(tokens)


@post("/detokenize", status_code=200, summary="Token ids to text (llama.cpp)", tags=["server"])
async def detokenize(data: JSONBody[DetokenizeRequest], service: NamedDependency[ModelService]) -> dict[str, Any]:
    service.require_ready()
    tokenizer = service.loaded.tokenizer
    bad = [i for i in data.tokens if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
    return {"content": tokenizer.decode(data.tokens)}
