"""`lucebox serve`: the argparse subcommand and the uvicorn run loop.

Everything that can be checked before the server says it is listening is: the flags, the model file's
header (a GGUF some installed family loads), the chat template, and the address (the socket is bound here
and handed to uvicorn), so a mistake is one `error:` line and exit status 2, never a "listening" line
followed by a traceback-free failure. A model that fails while loading in the background (weights that do
not fit, a broken tensor) ends the server with one such line too.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from typing import Any

import attrs

from ..errors import LuceboxError


def add_serve_parser(commands: Any) -> None:
    """Add `serve` to the `lucebox` subcommands (an argparse subparsers object)."""
    from ..flags import (add_model_arguments, add_prefill_compression_arguments, add_prefix_cache_arguments,
                         add_speculative_arguments)

    p = commands.add_parser("serve", help="serve the OpenAI, Responses and Anthropic HTTP APIs")
    from ..flags import CTX_HELP

    add_model_arguments(p, ctx_help=CTX_HELP.replace("context to allocate", "context per sequence"))
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
    p.add_argument("--log-requests", metavar="FILE",
                   help="append one JSON line per request to FILE: its path, status and shape (fields, tools, "
                        "message roles; never the text)")
    p.add_argument("--force-tool-call", action="append", metavar="NAME[=JSON]", default=[],
                   help="TESTING ONLY: when a request offers tool NAME and holds no tool result yet, force a call "
                        "to it (JSON pins its arguments); after a tool result, forbid tools. Repeatable")
    p.add_argument("--short-answers", type=int, metavar="CHARS",
                   help="TESTING ONLY: hold every plain text answer to at most CHARS characters, then end it "
                        "(a random-weight model's answers then end with 'stop'); thinking off")
    add_speculative_arguments(p, force=False)
    add_prefix_cache_arguments(p)
    add_prefill_compression_arguments(p)
    p.set_defaults(run=cmd_serve)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (uvicorn listens on it), or a LuceboxError saying why not (the port
    is taken, the address is not this machine's, the name does not resolve)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not 0 <= port <= 65535:  # getaddrinfo would quietly take it modulo 65536
        raise LuceboxError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, protocol)
    except (OSError, OverflowError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise LuceboxError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse the port
        listener.bind(address)
    except (OSError, OverflowError) as exc:
        listener.close()
        reason = getattr(exc, "strerror", None) or str(exc)
        in_use = isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE
        hint = " (another server runs there: stop it or choose another --port)" if in_use else ""
        raise LuceboxError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}{hint}") from None
    listener.set_inheritable(True)
    return listener


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
        thinking_default=args.reasoning == "on", request_log=args.log_requests,
        force_tool_calls=tuple(args.force_tool_call), short_answers=args.short_answers,
        prefill_compression=args.prefill_compression, prefill_threshold=args.prefill_threshold,
        prefill_keep_ratio=args.prefill_keep_ratio, prefill_curve=tuple(args.prefill_curve),
        prefill_alpha=args.prefill_alpha,
        prefill_compressor=args.prefill_compressor, prefill_skip_park=args.prefill_skip_park,
        prefill_force_park=args.prefill_force_park,
    )
    from ..flags import check_prefill_arguments

    check_prefill_arguments(config)
    if args.short_answers is not None and args.short_answers < 1:
        raise LuceboxError(f"--short-answers must be at least 1, got {args.short_answers}")
    from .forced_tool import parse_forced_tools

    parse_forced_tools(config.force_tool_calls)  # a malformed value is an error line before the socket opens
    listener = listening_socket(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:  # reported once, below, as the command's error line
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    service = ModelService(config, on_load_error=on_load_error)
    app = create_app(config, service)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=3))
    port = listener.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"Lucebox listening on http://{host}:{port} (OpenAI base URL http://{host}:{port}/v1); "
          "the model loads in the background", file=sys.stderr)
    try:
        server.run(sockets=[listener])
    finally:
        service.close()
        listener.close()
    if failure:
        raise LuceboxError(f"cannot load the model: {failure[0]}")
    if not server.started:
        raise LuceboxError(f"the server on {host}:{port} did not start")
    return 0

