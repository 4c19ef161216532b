"""The HTTP server (`lucebox serve`): OpenAI chat/completions/responses and Anthropic messages on Litestar.

Imported lazily, so that `lucebox` commands other than `serve` work where the server's dependencies
(Litestar, uvicorn) are not installed.
"""

from typing import Any

__all__ = ["create_app", "ModelService", "ServeConfig"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name in ("ModelService", "ServeConfig"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
