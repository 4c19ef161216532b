"""`lucebox serve`: the argparse subcommand and the uvicorn run loop."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import attrs

from ..errors import LuceboxError


def add_serve_parser(commands: Any) -> None:
    """Add `serve` to the `lucebox` subcommands (an argparse subparsers object)."""
    from ..flags import add_model_arguments, add_speculative_arguments

    p = commands.add_parser("serve", help="serve the OpenAI, Responses and Anthropic HTTP APIs")
    add_model_arguments(p, ctx_help="context length per sequence")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="sequences generated at once; the rest wait in a queue (default 1)")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="most tokens one request may generate (default: what fits in the context)")
    p.add_argument("--model-name", help="model id reported to clients (default: the file name); any id is accepted")
    p.add_argument("--chat-template-file", help="jinja chat template to use instead of the GGUF's")
    p.add_argument("--api-key", default=os.environ.get("LUCEBOX_API_KEY"),
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key' (env LUCEBOX_API_KEY)")
    p.add_argument("--reasoning", choices=("on", "off"), default="off",
                   help="thinking when a request does not say (default off)")
    p.add_argument("--think-max-tokens", type=int, help="close a thought after this many tokens")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_speculative_arguments(p, force=False)
    p.set_defaults(run=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..assembly import EngineOptions, check_options
    from .app import create_app
    from .service import ModelService, ServeConfig

    engine_options = EngineOptions.from_args(args)
    check_options(engine_options)  # bad flags, files and plugin names fail before the socket opens
    config = ServeConfig(
        **attrs.asdict(engine_options, recurse=False), host=args.host, port=args.port, model_name=args.model_name,
        api_key=args.api_key, n_predict=args.n_predict, think_max_tokens=args.think_max_tokens,
        thinking_default=args.reasoning == "on",
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    service = ModelService(config, on_load_error=on_load_error)
    app = create_app(config, service)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=3))
    print(f"Lucebox listening on http://{args.host}:{args.port} (OpenAI base URL http://{args.host}:{args.port}/v1); "
          "the model loads in the background", file=sys.stderr)
    try:
        server.run()
    finally:
        service.close()
    if failure:
        raise LuceboxError(f"cannot load the model: {failure[0]}")
    if not server.started:
        return 1
    return 0
