"""`lucebox serve`: the argparse subcommand and the uvicorn run loop."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ..errors import LuceboxError


def add_serve_parser(commands: Any) -> None:
    """Add `serve` to the `lucebox` subcommands (an argparse subparsers object)."""
    p = commands.add_parser("serve", help="serve the OpenAI, Responses and Anthropic HTTP APIs")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded default model, random weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context length per sequence (default 4096)")
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
    p.add_argument("--backend", help="kernel backend (default: the available one with the highest priority)")
    p.add_argument("--device", help="torch device for the backend, e.g. cpu, cuda:0")
    from ..cli import add_cache_type_arguments, add_ubatch_argument

    add_cache_type_arguments(p)
    add_ubatch_argument(p)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from ..cli import add_speculative_arguments

    add_speculative_arguments(p, force=False)
    p.set_defaults(run=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import cache_type_options
    from .app import create_app
    from .service import ModelService, ServeConfig

    if args.model is not None and not os.path.isfile(args.model):
        raise LuceboxError(f"{args.model}: no such file")
    for flag, value in (("--parallel", args.parallel), ("--ctx-size", args.ctx_size),
                        ("--ubatch-size", 1 if args.ubatch_size is None else args.ubatch_size)):
        if value < 1:
            raise LuceboxError(f"{flag} must be at least 1, got {value}")
    cache_types = cache_type_options(args.cache_type_k, args.cache_type_v)  # bad types fail before binding
    config = ServeConfig(
        model=args.model, host=args.host, port=args.port, ctx_size=args.ctx_size, model_name=args.model_name,
        chat_template_file=args.chat_template_file, api_key=args.api_key, parallel=args.parallel,
        backend=args.backend, device=args.device, n_predict=args.n_predict, prefill_chunk=args.ubatch_size,
        think_max_tokens=args.think_max_tokens, thinking_default=args.reasoning == "on",
        model_draft=args.model_draft, spec_type=args.spec_type, tree_budget=args.tree_budget,
        draft_block_size=args.draft_block_size, cache_type_k=cache_types.get("cache_type_k"),
        cache_type_v=cache_types.get("cache_type_v"),
    )
    if args.model_draft is not None and not os.path.isfile(args.model_draft):
        raise LuceboxError(f"{args.model_draft}: no such file")
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
