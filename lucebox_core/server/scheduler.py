"""Running generations off the event loop.

The model's forward pass is blocking torch code, so generations run on worker threads: `parallel`
threads (the `-np` flag), each driving one sequence at a time, fed from one FIFO queue so requests are
served in arrival order and none is dropped. Each job streams its `Step`s back to the event loop
through an asyncio queue. A job cancelled by its client (a disconnect) stops at the next token, and its
sequence (KV cache, recurrent state) is dropped, which frees the slot for the next job in the queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

import attrs

from ..engine import Engine, GenerationRequest, Step, Timings
from .errors import APIError

log = logging.getLogger("lucebox.server")


@attrs.frozen
class Finished:
    """The last item of a job: how long prefill and decode took."""

    timings: Timings


@attrs.frozen
class Failed:
    error: BaseException


class Job:
    """One generation: submitted by a handler, run by a worker, consumed with `async for`."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._loop = loop
        self._items: asyncio.Queue[Step | Finished | Failed] = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit(self, item: Step | Finished | Failed) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Step | Finished]:
        """Steps as they come, then one `Finished`; a failure in the worker is raised here."""
        try:
            while True:
                item = await self._items.get()
                if isinstance(item, Failed):
                    raise item.error
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            # However the consumer stops (done, disconnect, error), the worker stops too.
            self.cancel()


class Scheduler:
    def __init__(self, engine: Engine, parallel: int = 1, on_cancelled: Callable[[], None] | None = None):
        self.engine = engine
        self.parallel = max(1, parallel)
        # Called (on a worker thread) for each job its client left before it ended: counted where the
        # work stops, so a job that had already ended when its client left is not counted.
        self._on_cancelled = on_cancelled or (lambda: None)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._running = 0
        self.closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"lucebox-slot-{index}", daemon=True)
            for index in range(self.parallel)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

    def submit(self, request: GenerationRequest) -> Job:
        if self.closed:
            raise APIError(503, "the server is shutting down", type="server_unavailable")
        job = Job(request, asyncio.get_running_loop())
        self._queue.put(job)
        return job

    def close(self) -> None:
        self.closed = True
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:
                self._on_cancelled()
                continue
            with self._lock:
                self._running += 1
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running -= 1

    def _run(self, job: Job) -> None:
        timings = Timings()
        sequence, steps, failed = None, None, False
        try:
            sequence = self.engine.new_sequence()
            steps = self.engine.stream(sequence, job.request, timings)
            for step in steps:
                if job.first_token_at is None:
                    job.first_token_at = time.perf_counter()
                job._emit(step)
                if job.cancelled and step.finish_reason is None:
                    self._on_cancelled()
                    break
            job._emit(Finished(timings))
        except BaseException as exc:  # handed to the request's handler, which turns it into an API error
            failed = True
            if not isinstance(exc, Exception):
                raise
            log.debug("generation failed: %r", exc)
            job._emit(Failed(exc))
        finally:
            if steps is not None:
                steps.close()
            # Kept for the next request (buffers and recorded graphs reused), or freed if the pool is full.
            # Not after a failure: the state may be half-updated, or hold a failed recording.
            if sequence is not None and not failed:
                self.engine.release(sequence)
            del sequence
