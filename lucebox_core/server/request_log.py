"""`lucebox serve --log-requests FILE`: one JSON line per HTTP request, saying what shape it had.

A client's compatibility depends on what it sends (which API, which fields, streaming or not, which tools,
which `tool_choice`, what its conversation looks like), so the log keeps exactly that and none of the
text: field names, counts, roles and block types, the tools' names. The client harness reads it to check
what each real client sent; a user reads it to see what their client sends.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from litestar.types import ASGIApp, Receive, Scope, Send

# Headers that say who the client is (never the API key).
_CLIENT_HEADERS = ("user-agent", "anthropic-version", "anthropic-beta", "openai-beta", "originator", "x-stainless-lang")


def _message_shape(message: Any) -> str:
    """`role` or `role:type+type` for a message whose content is a list of blocks (Anthropic, Responses)."""
    if not isinstance(message, dict):
        return type(message).__name__
    role = str(message.get("role") or message.get("type") or "?")
    content = message.get("content")
    kinds: list[str] = []
    if isinstance(content, list):
        kinds = [str(block.get("type", "?")) if isinstance(block, dict) else type(block).__name__ for block in content]
    if message.get("tool_calls"):
        kinds.append(f"tool_calls*{len(message['tool_calls'])}")
    return f"{role}:{'+'.join(kinds)}" if kinds else role


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, dict):
        return "?"
    function = tool.get("function")
    if isinstance(function, dict) and "name" in function:  # OpenAI chat
        return str(function["name"])
    return str(tool.get("name") or tool.get("type") or "?")  # Responses / Anthropic / built-in tools


def request_shape(body: Any) -> dict[str, Any]:
    """What a JSON request body says about the client, without its text."""
    if not isinstance(body, dict):
        return {"body": type(body).__name__}
    shape: dict[str, Any] = {"fields": sorted(body)}
    for field in ("model", "stream", "max_tokens", "max_output_tokens", "max_completion_tokens", "tool_choice",
                  "parallel_tool_calls", "previous_response_id", "store"):
        if field in body:
            shape[field] = body[field]
    if isinstance(body.get("tools"), list):
        shape["tools"] = [_tool_name(tool) for tool in body["tools"]]
    conversation = body.get("messages", body.get("input"))
    if isinstance(conversation, list):
        shape["messages"] = [_message_shape(message) for message in conversation]
    elif isinstance(conversation, str):
        shape["messages"] = ["text"]
    if "system" in body or "instructions" in body:
        shape["system"] = True
    return shape


class RequestLog:
    """Appends one JSON line per request to `path` (thread-safe; the file is opened per line, so it can be
    read, moved or truncated while the server runs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, ensure_ascii=False, default=str) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as out:
            out.write(line)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """ASGI middleware: note the request's body as it is read and its status as it is answered."""

        async def logged(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            chunks: list[bytes] = []
            written: list[bool] = []
            started = time.time()

            async def reading() -> Any:
                message = await receive()
                if message.get("type") == "http.request":
                    chunks.append(message.get("body", b""))
                return message

            def note(status: int | None) -> None:
                if not written:
                    written.append(True)
                    self.write(self._entry(scope, b"".join(chunks), status, started))

            async def answering(message: Any) -> None:
                if message["type"] == "http.response.start":
                    # Written before the client gets the status: once it has its answer, the line is there
                    # (a stream is logged as it starts).
                    note(message["status"])
                await send(message)

            try:
                await app(scope, reading, answering)
            finally:
                note(None)  # no response started (the connection dropped first)

        return logged

    @staticmethod
    def _entry(scope: Scope, body: bytes, status: int | None, started: float) -> dict[str, Any]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        entry: dict[str, Any] = {
            "time": round(started, 3), "method": scope["method"], "path": scope["path"],
            "query": scope.get("query_string", b"").decode("latin-1"), "status": status,
            "client": {name: headers[name] for name in _CLIENT_HEADERS if name in headers},
        }
        if body:
            try:
                entry["request"] = request_shape(json.loads(body))
            except ValueError:
                entry["request"] = {"body": f"not JSON ({len(body)} bytes)"}
        return entry


def read_request_log(path: str | Path) -> list[dict[str, Any]]:
    """The entries a `RequestLog` wrote (none when the file does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
