"""What the server serves: the configuration, the model (loaded in the background), its scheduler.

The socket opens before the model is loaded, so `/health` can say 503 "loading" to orchestrators;
generation endpoints answer 503 until the model is ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from ..assembly import EngineOptions
from .errors import APIError
from .metrics import ServerMetrics
from .replay import ToolCallReplay

log = logging.getLogger("lucebox.server")


@attrs.frozen(kw_only=True)
class ServeConfig(EngineOptions):
    """The engine's options (`EngineOptions`: model, backend, context, KV policy, drafter...) and the server's."""

    host: str = "127.0.0.1"
    port: int = 8000
    prefix_cache_slots: int = 8  # a server keeps conversation prefixes (prefix_cache.DEFAULT_SLOTS)
    model_name: str | None = None  # the id reported to clients (default: the file's stem)
    api_key: str | None = None
    n_predict: int | None = None  # most tokens one request generates (None: what fits in the context)
    think_max_tokens: int | None = None  # close a thought that runs longer than this
    thinking_default: bool = False  # thinking when the request does not say (Lucebox's default: off)
    responses_kept: int = 256  # recent /v1/responses kept for previous_response_id
    request_log: str | None = None  # --log-requests: a JSON line per request, its shape (request_log.py)
    force_tool_calls: tuple[str, ...] = ()  # --force-tool-call (testing only; forced_tool.py)
    short_answers: int | None = None  # --short-answers CHARS (testing only; forced_tool.py)
    # PFlash prefill compression of chats (chat_compression.py, pflash.py): off unless asked.
    prefill_compression: str = "off"  # --prefill-compression off|auto|always
    prefill_threshold: int = 32768  # --prefill-threshold: auto compresses prompts of at least this many tokens
    prefill_keep_ratio: float = 0.05  # --prefill-keep-ratio
    prefill_curve: tuple[str, ...] = ()  # --prefill-curve T:R ...
    prefill_compressor: str = "pflash"  # --prefill-compressor NAME (the prefill compressor hook)
    prefill_alpha: float = 0.85  # --prefill-alpha: the scorer's block-sparse attention keeps score >= alpha x max
    prefill_skip_park: bool = False  # --prefill-skip-park: the scorer stays loaded even where it does not fit
    prefill_force_park: bool = False  # --prefill-force-park (testing only): parked even where it fits


class ModelService:
    """The loaded model and everything that runs generations on it."""

    def __init__(self, config: ServeConfig, on_load_error: Callable[[BaseException], None] | None = None):
        self.config = config
        self.status = "loading"
        self.error: str | None = None
        self.loaded: Any = None  # LoadedModel
        self.engine: Any = None
        self.context: Any = None  # lucebox_core.context.ContextChoice, once loaded
        self.scheduler: Any = None
        self.chat_compressor: Any = None  # a ChatCompressor while --prefill-compression is on
        self.spark: Any = None  # lucebox_core.spark.Spark with --spark
        self.parser_spec: Any = None  # the family's ResponseParser spec
        self.started = time.time()
        self.metrics = ServerMetrics(
            queue_depth=lambda: self.scheduler.queue_depth if self.scheduler else 0,
            running=lambda: self.scheduler.running if self.scheduler else 0,
            prefix_cache=self.prefix_cache_info, prefill_compression=self.prefill_compression_info,
            spark=lambda: self.spark.describe() if self.spark is not None else {},
            kvflash=self.kvflash_info,
            speculation=lambda: (self.drafter_info or {}).get("speculation") or {},
        )
        self.responses: OrderedDict[str, Any] = OrderedDict()
        self.tool_replay = ToolCallReplay()
        from .forced_tool import parse_forced_tools

        self.forced_tools = parse_forced_tools(config.force_tool_calls)
        self._on_load_error = on_load_error
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ loading

    def start_loading(self) -> threading.Thread:
        thread = threading.Thread(target=self.load, name="lucebox-load", daemon=True)
        thread.start()
        return thread

    def load(self) -> None:
        from ..assembly import build_engine
        from .scheduler import Scheduler

        try:
            assembled = build_engine(self.config)
            loaded, engine = assembled.loaded, assembled.engine
            self.parser_spec = _parser_for(loaded)
            self.chat_compressor = build_chat_compressor(self.config, loaded)
            self.spark = assembled.spark
            self.loaded, self.engine, self.context = loaded, engine, assembled.context
            self.scheduler = Scheduler(engine, self.config.parallel, on_cancelled=self.metrics.cancelled.inc)
            self.status = "ok"
            log.info("model %s ready (%s backend): %s", loaded.path, loaded.backend_name, assembled.context.describe())
        except BaseException as exc:
            self.status, self.error = "error", str(exc)
            if self._on_load_error is not None:
                self._on_load_error(exc)  # the owner reports it (`lucebox serve`: its one error line)
            else:
                log.error("cannot load the model: %s", exc)
            if not isinstance(exc, Exception):
                raise

    @property
    def drafter_info(self) -> dict[str, Any] | None:
        """What `/props` reports about speculative decoding (None without a drafter)."""
        speculative = self.engine.speculative if self.engine is not None else None
        return speculative.describe() if speculative is not None else None

    def prefill_compression_info(self) -> dict[str, Any]:
        """What `/props` and `/metrics` report about PFlash ({} while it is off)."""
        return self.chat_compressor.describe() if self.chat_compressor is not None else {}

    def prefix_cache_info(self) -> dict[str, Any]:
        """What `/props` and `/metrics` report about the prefix cache ({} while it is off)."""
        cache = self.engine.prefix_cache if self.engine is not None else None
        return {"enabled": True, **cache.describe()} if cache is not None else {}

    def kvflash_info(self) -> dict[str, Any]:
        """KVFlash's pool, residency and page traffic over the live sequences ({} under another KV policy)."""
        policy = getattr(getattr(self.loaded, "model", None), "kv_policy", None)
        describe = getattr(getattr(policy, "factory", None), "describe", None)
        return describe() if describe is not None else {}

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        cache = self.engine.prefix_cache if self.engine is not None else None
        if cache is not None:
            cache.close()  # the snapshot files being written are finished first
        if self.spark is not None:
            self.spark.save_profile()  # the routing traffic served, for the next start's placement

    def require_ready(self) -> None:
        if self.status == "loading":
            raise APIError(503, "the model is still loading; retry shortly", type="server_unavailable",
                           code="model_loading")
        if self.status != "ok":
            raise APIError(503, f"the model failed to load: {self.error}", type="server_unavailable",
                           code="model_load_failed")

    # ----------------------------------------------------------------------------------- identity

    @property
    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        if self.loaded is not None:
            return self.loaded.path.stem
        if self.config.model:
            from pathlib import Path

            return Path(self.config.model).stem
        return "lucebox-default"

    @property
    def ctx_size(self) -> int | None:
        """Positions per sequence (None while loading without -c: what fits is known once loaded)."""
        return self.engine.ctx_size if self.engine is not None else self.config.ctx_size

    @property
    def architecture(self) -> str | None:
        return self.loaded.gguf.architecture if self.loaded is not None else None

    # ------------------------------------------------------------------------- stored responses

    def remember_response(self, response_id: str, record: Any) -> None:
        with self._lock:
            self.responses[response_id] = record
            self.responses.move_to_end(response_id)
            while len(self.responses) > self.config.responses_kept:
                self.responses.popitem(last=False)

    def recall_response(self, response_id: str) -> Any:
        with self._lock:
            return self.responses.get(response_id)


def _parser_for(loaded: Any) -> Any:
    """The response parser a plugin offers for this model's architecture (else reasoning-only)."""
    from ..parsing import response_parser_for

    return response_parser_for(loaded.gguf.architecture)


def build_chat_compressor(config: ServeConfig, loaded: Any) -> Any:
    """The `ChatCompressor` the config asks for (None when off), its compressor made through the prefill
    compressor hook (`--prefill-compressor`, default pflash)."""
    if config.prefill_compression == "off":
        return None
    from ..chat_compression import ChatCompressor
    from ..plugins import registry

    spec = registry().prefill_compressor(config.prefill_compressor)
    compressor = spec.create(config, loaded)
    return ChatCompressor(compressor, mode=config.prefill_compression, threshold=config.prefill_threshold,
                          name=getattr(compressor, "name", spec.name))
