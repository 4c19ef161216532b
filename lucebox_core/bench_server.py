"""`lucebox bench-server --url URL --suite {short,agent,long} [-n N]`: time any OpenAI-compatible server.

Each request is a streaming chat completion (`temperature` 0, `stream_options.include_usage`), sent one
after another, timed on this side of the wire:

- TTFT: from sending the request to the first chunk with non-empty `content` or reasoning (queueing,
  tokenizing, prefill and the first decode step);
- end-to-end: from sending to the end of the stream;
- decode tok/s: (completion tokens - 1) / (end-to-end - TTFT), the tokens after the first over the time
  after it; completion tokens come from the final `usage` (a server that sends none is counted by its
  content chunks, and the row says so);
- prefill tok/s: prompt tokens / TTFT.

The suites are fixed prompts built here, so two servers (Lucebox and llama-server, say) get the same
requests: `short` (one-line questions), `agent` (an agent-style system prompt and a tool list over a code
listing, ~2K and ~6K tokens), `long` (a ~12K-token document and a question about it). `-n` repeats the
suite's prompts to N requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from .errors import LuceboxError

_SHORT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence.",
          "List three prime numbers.", "What does HTTP stand for?", "Name a sorting algorithm and its complexity."]
_TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name, text in (("read_file", "Read a file of the repository"), ("list_dir", "List a folder"),
                       ("run_tests", "Run the test suite in a folder"))]


def _code_listing(lines: int) -> str:
    body = []
    for i in range(lines):
        body.append(f"def helper_{i}(values):\n    total = 0\n    for v in values:\n        total += v * {i % 7 + 1}\n"
                    f"    return total  # helper {i}\n")
    return "\n".join(body)


def suite_requests(suite: str, count: int | None, max_tokens: int) -> list[dict[str, Any]]:
    """The chat requests (messages, tools, max_tokens) of a suite, repeated or cut to `count`."""
    if suite == "short":
        cases = [{"messages": [{"role": "user", "content": q}]} for q in _SHORT]
    elif suite == "agent":
        system = ("You are a coding agent working in a repository. Use the tools to inspect files before "
                  "answering. Be concise.")
        cases = [{"messages": [{"role": "system", "content": system},
                               {"role": "user", "content": f"Here is utils.py:\n\n{_code_listing(n)}\n\n"
                                                           "Which helper multiplies by 3? Answer briefly."}],
                  "tools": _TOOLS} for n in (40, 130)]
    elif suite == "long":
        document = _code_listing(330)
        cases = [{"messages": [{"role": "user", "content": f"{document}\n\nSummarise what these functions do."}]}]
    else:
        raise LuceboxError(f"unknown suite {suite!r}: choose short, agent or long")
    count = count if count is not None else len(cases)
    if count < 1:
        raise LuceboxError(f"-n must be at least 1, got {count}")
    return [{**cases[i % len(cases)], "max_tokens": max_tokens} for i in range(count)]


@attrs.define
class Timing:
    index: int
    ttft_s: float | None
    end_to_end_s: float
    prompt_tokens: int | None
    completion_tokens: int
    usage_reported: bool
    finish_reason: str | None

    @property
    def decode_tps(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2 or self.end_to_end_s <= self.ttft_s:
            return None
        return (self.completion_tokens - 1) / (self.end_to_end_s - self.ttft_s)

    @property
    def prefill_tps(self) -> float | None:
        return self.prompt_tokens / self.ttft_s if self.prompt_tokens and self.ttft_s else None

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "decode_tps": self.decode_tps, "prefill_tps": self.prefill_tps}


def time_request(client: Any, url: str, model: str, body: dict[str, Any], index: int, headers: dict) -> Timing:
    """Send one streaming chat request and time it."""
    payload = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, **body}
    ttft = None
    usage = None
    chunks_with_text = 0
    finish = None
    started = time.perf_counter()
    with client.stream("POST", f"{url}/chat/completions", json=payload, headers=headers) as response:
        if response.status_code != 200:
            raise LuceboxError(f"{url}/chat/completions answered {response.status_code}: "
                               f"{response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or "")
                if delta.get("tool_calls"):
                    text = text or "tool"
                if text:
                    chunks_with_text += 1
                    if ttft is None:
                        ttft = time.perf_counter() - started
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter() - started
    completion = usage.get("completion_tokens") if usage else None
    return Timing(index, ttft, end, usage.get("prompt_tokens") if usage else None,
                  completion if completion is not None else chunks_with_text, usage is not None, finish)


def summary(timings: list[Timing]) -> dict[str, Any]:
    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.fmean(present) if present else None

    total_time = sum(t.end_to_end_s for t in timings)
    total_completion = sum(t.completion_tokens for t in timings)
    return {
        "requests": len(timings), "mean_ttft_s": mean([t.ttft_s for t in timings]),
        "mean_end_to_end_s": mean([t.end_to_end_s for t in timings]),
        "mean_decode_tps": mean([t.decode_tps for t in timings]),
        "mean_prefill_tps": mean([t.prefill_tps for t in timings]),
        "total_prompt_tokens": sum(t.prompt_tokens or 0 for t in timings),
        "total_completion_tokens": total_completion, "total_s": total_time,
        "overall_output_tps": total_completion / total_time if total_time > 0 else None,
    }


def _discover_model(client: Any, url: str, headers: dict) -> str:
    response = client.get(f"{url}/models", headers=headers)
    if response.status_code != 200:
        raise LuceboxError(f"{url}/models answered {response.status_code}; pass --model")
    models = response.json().get("data") or []
    if not models:
        raise LuceboxError(f"{url}/models lists no model; pass --model")
    return models[0]["id"]


def add_bench_server_parser(commands: Any) -> None:
    p = commands.add_parser("bench-server", help="time a running OpenAI-compatible server (TTFT, decode tok/s, "
                                                 "end-to-end) over streaming chat requests")
    p.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 "
                                                "(a URL without /v1 gets it added)")
    p.add_argument("--suite", choices=("short", "agent", "long"), default="short", help="the prompts (default short)")
    p.add_argument("-n", "--requests", type=int, default=None, help="requests to send (default: one per prompt)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per request (default 128)")
    p.add_argument("--model", help="model id to request (default: the first /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (env OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take (default 600)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the per-request timings and totals here")
    p.set_defaults(run=cmd_bench_server)


def cmd_bench_server(args: argparse.Namespace) -> int:
    import os

    import httpx
    from rich.console import Console
    from rich.table import Table

    url = args.url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    if args.max_tokens < 1:
        raise LuceboxError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    requests = suite_requests(args.suite, args.requests, args.max_tokens)
    timings = []
    try:
        with httpx.Client(timeout=args.timeout) as client:
            model = args.model or _discover_model(client, url, headers)
            for index, body in enumerate(requests):
                timings.append(time_request(client, url, model, body, index, headers))
    except httpx.HTTPError as exc:
        raise LuceboxError(f"cannot reach {url}: {exc}") from None
    totals = summary(timings)

    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    table = Table(title=f"bench-server {args.suite} against {url} ({model})")
    for column in ("#", "prompt tok", "gen tok", "TTFT s", "decode tok/s", "prefill tok/s", "end-to-end s", "finish"):
        table.add_column(column, justify="right")
    for t in timings:
        table.add_row(str(t.index), str(t.prompt_tokens or "-"),
                      f"{t.completion_tokens}{'' if t.usage_reported else '*'}", fmt(t.ttft_s),
                      fmt(t.decode_tps, 1), fmt(t.prefill_tps, 1), fmt(t.end_to_end_s), str(t.finish_reason))
    table.add_row("all", str(totals["total_prompt_tokens"]), str(totals["total_completion_tokens"]),
                  fmt(totals["mean_ttft_s"]), fmt(totals["mean_decode_tps"], 1), fmt(totals["mean_prefill_tps"], 1),
                  fmt(totals["total_s"]), f"{fmt(totals['overall_output_tps'], 1)} tok/s", style="bold")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # a log file or pipe: wide enough that the columns do not wrap
    console.print(table)
    if not all(t.usage_reported for t in timings):
        console.print("* the server sent no usage: tokens counted as content chunks")
    if args.json:
        args.json.write_text(json.dumps({"url": url, "model": model, "suite": args.suite,
                                         "requests": [t.as_dict() for t in timings], "total": totals}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
