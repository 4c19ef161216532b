"""Prometheus metrics in the text exposition format, without a client library.

Only the three kinds the server needs: counters (optionally with labels), gauges read at scrape time,
and histograms. Updates come from the event loop and worker threads alike, so each metric holds a lock.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

PREFIX = "lucebox_"


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{key}="{value}"' for key, value in pairs)
    return "{" + inner + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help
        self._values: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            values = dict(self._values) or {(): 0.0}
        lines += [f"{self.name}{_labels(key)} {_number(value)}" for key, value in sorted(values.items())]
        return lines


class Gauge:
    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = PREFIX + name, help, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_number(self.read())}"]


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help = PREFIX + name, help
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for index, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[index] += 1

    @property
    def count(self) -> int:
        return self._counts[-1]

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            for bound, count in zip(self.buckets, self._counts):
                lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {count}')
            lines.append(f"{self.name}_sum {_number(self._sum)}")
            lines.append(f"{self.name}_count {self._counts[-1]}")
        return lines


class CounterView:
    """A labelled counter kept elsewhere (a dict of label value -> count), read at scrape time."""

    def __init__(self, name: str, help: str, label: str, read: Callable[[], dict]):
        self.name, self.help, self.label, self.read = PREFIX + name, help, label, read

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.read() or {}
        lines += [f'{self.name}{{{self.label}="{key}"}} {_number(value)}' for key, value in sorted(values.items())]
        return lines


class ServerMetrics:
    """Everything `/metrics` reports."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float],
                 prefix_cache: Callable[[], dict] = dict, prefill_compression: Callable[[], dict] = dict,
                 spark: Callable[[], dict] = dict, kvflash: Callable[[], dict] = dict,
                 speculation: Callable[[], dict] = dict):
        self.requests = Counter("requests_total", "HTTP requests handled, by endpoint and status")
        self.prompt_tokens = Counter("prompt_tokens_total", "prompt tokens processed")
        self.cached_prompt_tokens = Counter("prompt_tokens_cached_total",
                                            "prompt tokens restored from the prefix cache instead of prefilled")
        self.prefill_seconds = Counter("prefill_seconds_total", "seconds the target spent prefilling prompts")
        self.generated_tokens = Counter("generated_tokens_total", "tokens generated")
        self.cancelled = Counter("cancelled_generations_total", "generations stopped because the client left")
        self.ttft = Histogram(
            "time_to_first_token_seconds", "time from request to first generated token",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.decode_speed = Histogram(
            "decode_tokens_per_second", "decode speed of each finished generation",
            (1, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000),
        )
        self.prefill_speed = Histogram(
            "prefill_tokens_per_second", "prompt processing speed of each generation",
            (10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000),
        )
        self.accepted_length = Histogram(
            "speculative_accepted_length", "tokens committed per speculative verify step (accepted drafts + bonus)",
            (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32),
        )
        self.queue_depth = Gauge("queue_depth", "generations waiting for a free slot", queue_depth)
        self.running = Gauge("running_generations", "generations in progress", running)
        # The prefix cache's figures (`PrefixCache.describe`), read at scrape time; 0 while it is off.
        self.prefill_compression = [
            Gauge(f"prefill_compression_{key}", text, lambda key=key: float(prefill_compression().get(key) or 0))
            for key, text in (("requests", "chats PFlash compressed"),
                              ("messages", "aged messages compressed by the scorer (each once)"),
                              ("reused", "messages given their earlier compressed text (FlowKV)"),
                              ("compression_ratio", "characters kept of those compressed"),
                              ("seconds", "seconds spent in the scorer (its loads while parked included)"),
                              ("last_user", "oversized chats whose last user message was compressed too (always)"),
                              ("scorer_loads", "scorer loads for a compression (while parked)"),
                              ("scorer_load_seconds", "seconds spent loading the parked scorer"))
        ] + [CounterView("prefill_compression_skipped_total", "chats left uncompressed though compression was "
                         "wanted, by reason", "reason", lambda: prefill_compression().get("skipped") or {})]
        self.spark = [
            Gauge(f"spark_{key}", text, lambda key=key: float(spark().get(key) or 0))
            for key, text in (("residency", "fraction of MoE experts resident on the device (--spark)"),
                              ("hits", "expert lookups served by a resident slot"),
                              ("misses", "expert lookups not served by a resident slot"),
                              ("bytes_moved", "bytes copied into expert slots"),
                              ("zero_copy_reads", "routed experts a graphed step read from host memory"),
                              ("promotions", "experts promoted into slots between graphed steps"),
                              ("graphed", "1 where decode and verify run as graphs over paged experts"))
        ]
        self.kvflash = [
            Gauge(f"kvflash_{key}", text, lambda key=key: float(kvflash().get(key) or 0))
            for key, text in (("pool_tokens", "KV pool size in tokens per attention layer (--kvflash)"),
                              ("resident_chunks", "64-token KV chunks resident in the pools of live sequences"),
                              ("host_chunks", "64-token KV chunks paged out to host memory"),
                              ("pages_out", "KV chunks copied to host memory"),
                              ("pages_in", "KV chunks copied back into a pool"),
                              ("bytes_out", "bytes of KV copied to host memory"),
                              ("bytes_in", "bytes of KV copied back into a pool"),
                              ("reselections", "times qk or drafter chose the resident chunks by score"),
                              ("reselect_seconds", "host seconds those reselections took, scoring included"),
                              ("scorer_rescores", "passes of the drafter policy's scorer over a sequence"),
                              ("scorer_seconds", "seconds of those passes, all together"),
                              ("scorer_mean_seconds", "seconds a drafter rescoring takes on average"),
                              ("scorer_last_seconds", "seconds the last drafter rescoring took"))
        ]
        # The speculation governor's decision and the measured rates behind it (--tree-budget auto).
        self.speculation = [
            Gauge("speculation_drafting", "1 while the governor drafts, 0 while it decodes plainly (drafting slower)",
                  lambda: float(speculation().get("mode") == "drafting")),
        ] + [
            Gauge(f"speculation_{key}", text, lambda key=key: float(speculation().get(key) or 0))
            for key, text in (("drafting_tokens_per_s", "measured tokens per second of drafted steps"),
                              ("plain_tokens_per_s", "measured tokens per second of plain steps"),
                              ("fallbacks", "times drafting was judged slower than plain decoding"),
                              ("plain_tokens", "tokens decoded plainly because drafting was slower"),
                              ("probes", "drafted steps that probed after a plain run"),
                              ("last_probe_ms", "milliseconds the last probe took"))
        ]
        self.prefix_cache = [
            Gauge(f"prefix_cache_{key}", text, lambda key=key: float(prefix_cache().get(key) or 0))
            for key, text in (("lookups", "prompts looked up in the prefix cache"),
                              ("hits", "prompts that restored a cached prefix"),
                              ("disk_hits", "of those, restored from a file of --kv-cache-dir"),
                              ("tokens_reused", "prompt tokens restored instead of prefilled"),
                              ("held", "snapshots held in RAM"), ("ram_bytes", "bytes of the snapshots held in RAM"),
                              ("disk_files", "snapshot files in --kv-cache-dir"),
                              ("disk_bytes", "bytes of the snapshot files in --kv-cache-dir"),
                              ("rejected_files", "corrupt or foreign snapshot files skipped"))
        ]

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.cached_prompt_tokens, self.prefill_seconds,
                       self.generated_tokens, self.cancelled, self.ttft, self.decode_speed, self.prefill_speed,
                       self.accepted_length, self.queue_depth, self.running,
                       *self.prefix_cache, *self.prefill_compression, *self.spark, *self.kvflash, *self.speculation):
            lines += metric.render()
        return "\n".join(lines) + "\n"
