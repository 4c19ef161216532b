"""Server-sent events, byte for byte as OpenAI and Anthropic send them."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import msgspec
from litestar.response import Stream

from .errors import APIError

log = logging.getLogger("lucebox.server")

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def data(payload: Any) -> bytes:
    """An OpenAI-style event: one `data:` line with compact JSON, then a blank line."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def event(name: str, payload: Any) -> bytes:
    """A named event (Anthropic, Responses): `event:` then `data:`, then a blank line."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def stream(events: AsyncIterator[bytes]) -> Stream:
    return Stream(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"},
    )


async def guarded(chunks: AsyncIterator[bytes], generation: Any, error_event: Callable[[APIError], bytes]) -> AsyncIterator[bytes]:
    """Pass `chunks` through; turn a failure into one error event; cancel the generation when the client
    leaves (the response is closed or cancelled mid-stream), so its slot frees at once (the scheduler
    counts the cancellation where the work stops)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield error_event(exc)
    except Exception as exc:  # the headers are gone: the error can only travel as an event
        log.exception("stream failed")
        yield error_event(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
    finally:
        generation.cancel()
