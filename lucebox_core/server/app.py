"""The Litestar application: routes, the API key, error bodies, request metrics, background loading."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Litestar, Request, Response
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from . import anthropic, info, openai_chat, openai_completions, responses
from .errors import APIError, error_response, handle_exception
from .request_log import RequestLog
from .service import ModelService, ServeConfig

# Reachable without the API key: orchestrators probe /health; the schema describes the API.
_PUBLIC = ("/health", "/schema")


def _api_key_guard(api_key: str):
    expected = api_key.encode()

    async def check(request: Request) -> Response | None:
        if request.url.path.startswith(_PUBLIC):
            return None
        given = request.headers.get("x-api-key")
        authorization = request.headers.get("authorization", "")
        if given is None and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), expected):
            message = "missing API key" if given is None else "invalid API key"
            return error_response(request.url.path, APIError(
                401, f"{message}: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'", code="invalid_api_key"))
        return None

    return check


def _count_requests(service: ModelService, known_paths: set[str]):
    """ASGI middleware: count every HTTP response by endpoint and status."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = scope["path"] if scope["path"] in known_paths else "other"

            async def counting_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    service.metrics.requests.inc(endpoint=path, status=str(message["status"]))
                await send(message)

            await app(scope, receive, counting_send)

        return wrapped

    return middleware


ROUTES = [
    openai_chat.chat_completions, openai_completions.completions, responses.create_response,
    anthropic.messages, anthropic.count_tokens,
    info.list_models, info.retrieve_model, info.health, info.props, info.metrics, info.tokenize, info.detokenize,
]
KNOWN_PATHS = {
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/models", "/health", "/props", "/metrics", "/tokenize", "/detokenize",
}


def create_app(config: ServeConfig, service: ModelService | None = None, *, load: bool = True) -> Litestar:
    """The app for `config`. The model loads in the background once the server starts (unless `load`
    is False, or `service` already holds a loaded model). A `service` passed in stays open when the app
    shuts down (its owner closes it, and may serve it from several apps)."""
    owned = service is None
    service = service if service is not None else ModelService(config)

    def on_startup() -> None:
        if load and service.status == "loading" and service.loaded is None:
            service.start_loading()

    return Litestar(
        route_handlers=ROUTES,
        dependencies={"service": Provide(lambda: service, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        before_request=_api_key_guard(config.api_key) if config.api_key else None,
        middleware=[_count_requests(service, KNOWN_PATHS)]
        + ([RequestLog(config.request_log).middleware] if config.request_log else []),
        cors_config=CORSConfig(allow_origins=["*"], allow_headers=["*"], expose_headers=["*"]),
        openapi_config=OpenAPIConfig(title="Lucebox", version=__version__,
                                     description="OpenAI-, Responses- and Anthropic-compatible LLM server"),
        on_startup=[on_startup],
        on_shutdown=[service.close] if owned else [],
        request_max_body_size=64 * 1024 * 1024,
        state={"service": service},
        debug=False,
    )
