"""A request's constraint run one step ahead of the sampler, on a worker thread.

A grammar's mask of allowed tokens costs host time (llguidance walks the vocabulary's token trie each step),
and on a busy CPU that time grows. The mask for step t+1 needs only the token of step t, so the worker takes
that token as soon as it is sampled, feeds it to the constraint and computes the next mask while the model
runs its forward pass (on the GPU, or on the host's other cores: llguidance and torch both release the GIL),
and the engine waits for the mask only when it is about to sample.

Only the worker touches the constraint while it runs: the engine reads what the constraint said after each
token (`finished`, `dormant`) from the snapshot the worker hands back. `LUCEBOX_MASK_AHEAD=0` does the same
work inline, each piece when the engine asks for it (the loop as it was, for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import torch

__all__ = ["MaskAhead"]


class MaskAhead:
    """The engine's view of one request's constraint (see the module docstring).

    `start()` computes the first mask (while the prompt is prefilled); after each sampled token, `after(read)`
    hands the worker a function that waits for the token and returns it; `accepted(token)` waits until the
    constraint has taken it; `mask()` waits for the next mask. `accept_now` takes tokens on the calling thread
    (speculative blocks, decoded while the constraint masks nothing).
    """

    def __init__(self, constraint: Any, vocab_size: int, executor: Executor | None,
                 host_buffer: Callable[..., torch.Tensor] | None = None):
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.finished = False
        self.dormant = bool(getattr(constraint, "dormant", False))
        self._executor = executor  # None: inline, each piece of work done when its result is asked for
        self._read: Callable[[], int] | None = None
        self._host_buffer = host_buffer  # pinned memory on a GPU, so the mask's copy does not block the host
        self._mask: Future[torch.Tensor | None] | None = None
        self._accepted: Future[tuple[int, bool, bool]] | None = None

    def start(self) -> None:
        if self._executor is not None:
            self._mask = self._executor.submit(self._next_mask)

    def after(self, read_token: Callable[[], int]) -> None:
        if self._executor is None:
            self._read = read_token
            return
        accepted: Future[tuple[int, bool, bool]] = Future()

        def work() -> torch.Tensor | None:
            try:
                token = read_token()
                state = self._take(token)
            except BaseException as exc:
                accepted.set_exception(exc)
                raise
            accepted.set_result(state)
            return None if state[1] or state[2] else self._next_mask()

        self._wait()
        self._accepted = accepted
        self._mask = self._executor.submit(work)

    def accepted(self, token: int) -> None:
        """Wait until the worker has taken `token`; `finished` and `dormant` then say what came of it."""
        if self._executor is None:
            assert self._read is not None, "after() was not called for this token"
            read, self._read = self._read, None
            _, self.finished, self.dormant = self._take(read())
            return
        assert self._accepted is not None, "after() was not called for this token"
        taken, self.finished, self.dormant = self._accepted.result()
        self._accepted = None
        assert taken == token, (taken, token)

    def accept_now(self, token: int) -> None:
        self._wait()
        _, self.finished, self.dormant = self._take(token)

    def mask(self) -> torch.Tensor | None:
        """The allowed tokens of the coming step (None: any), waited for if the worker computes it."""
        future, self._mask = self._mask, None
        if future is not None:
            return future.result()
        return None if self.finished or self.dormant else self._next_mask()

    def _take(self, token: int) -> tuple[int, bool, bool]:
        self.constraint.accept(token)
        return token, bool(self.constraint.finished), bool(getattr(self.constraint, "dormant", False))

    def _next_mask(self) -> torch.Tensor | None:
        allowed = self.constraint.allowed(self.vocab_size)
        if allowed is None or self._host_buffer is None:
            return allowed
        pinned = self._host_buffer(tuple(allowed.shape), torch.bool)
        pinned.copy_(allowed)
        return pinned

    def _wait(self) -> None:
        """Let a mask still being computed finish (unused): the constraint is then the caller's alone."""
        future, self._mask = self._mask, None
        if future is not None:
            future.exception()
