"""The HTTP server (`lucebox serve`): OpenAI chat/completions/responses and Anthropic messages on Litestar."""

from .app import create_app
from .service import ModelService, ServeConfig

__all__ = ["create_app", "ModelService", "ServeConfig"]
