"""Static steps: a step of fixed shapes over device buffers that stay put, recorded once as a graph and replayed.

A decode step driven from Python launches hundreds of kernels, and each launch costs microseconds of host
time: on a small model that, not the GPU, sets the speed. A step whose shapes and buffer addresses never
change (its inputs read from fixed device tensors, its state updated in place, its outputs left in buffers
of its own) can be recorded as a graph and replayed with one launch. A family describes such a step (the
decode step, a verify pass of N nodes, a drafter's block) as a function of a `StaticInputs`; `StaticStep`
owns the fixed input buffers, the graph memory pool, one recording per key, and the replay:

    step = StaticStep(ops, "decode step")                     # one per sequence state
    inputs = step.inputs(token=token, position=length)        # copied into the step's own buffers
    inputs.set("embedded", ops.embedding(inputs.token, table)) # eager work on them, then stored too
    logits = step.run(window, lambda i: forward(i), inputs, clone=True)

A recording is keyed by the caller's key (what the step's host-side choices depend on, such as the KV
window) and by the inputs' names and shapes, so a recording only ever replays over the buffers it read.
Everything device-specific (streams, graphs, pools) goes through the backend.

The one shape that must grow with a sequence is the window of the KV cache that attention reads:
`kv_window` rounds the length up to one of a few sizes per octave (so at most a quarter of the window is
masked-off padding), which keeps the number of recordings per sequence small.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .kv import window_limit

ENV_SWITCH = "LUCEBOX_CUDA_GRAPHS"  # "0" turns graph replay off (eager steps, for debugging and profiling)
_INSIDE = contextvars.ContextVar("lucebox_inside_static_step", default=False)
_DECODE_ONLY = contextvars.ContextVar("lucebox_decode_only_kernels", default=False)


def inside_static_step() -> bool:
    """Whether the caller runs inside a static step (`StaticStep.run`: its warm-up, its recording, or an eager
    run of it). A backend may launch differently there than in a prefill (lucebox_cuda.pdl: programmatic
    dependent launch) and must do so alike in the warm-up and the recording: the warm-up builds and loads
    every kernel the recording launches, since a kernel cannot be loaded while a stream is recording."""
    return _INSIDE.get()


def decode_only_kernels() -> bool:
    """Whether the static step running now may take kernels that only a decode step runs, which compute a token
    near-tie equal to, not bit-equal with, a verify pass (the persistent kernels of lucebox_cuda): a decode step of
    a sequence with no drafter. A sequence with one (`state.features`) keeps the kernels its verify passes share,
    so that its speculative output stays what its plain decoding gives, bit for bit."""
    return _DECODE_ONLY.get()


@contextlib.contextmanager
def running_static_step(*, decode_only: bool = False):
    """The scope of `inside_static_step()` (and of `decode_only_kernels()` with `decode_only`): `StaticStep.run`
    runs in it; tests may too."""
    token, only = _INSIDE.set(True), _DECODE_ONLY.set(decode_only)
    try:
        yield
    finally:
        _DECODE_ONLY.reset(only)
        _INSIDE.reset(token)


MIN_WINDOW = 256
WINDOWS_PER_OCTAVE = 4


def graphs_enabled(device: str | torch.device) -> bool:
    """Whether static steps on `device` should be replayed as graphs: on CUDA devices, unless switched off."""
    return torch.device(device).type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0"


def kv_window(length: int, max_context: int, minimum: int = MIN_WINDOW) -> int:
    """The KV window a step over `length` positions attends to: `length` rounded up to `minimum`, or above
    it to a multiple of a quarter of its octave's lower bound (257 -> 320, 8193 -> 10240), capped at
    `max_context`."""
    if length <= minimum:
        size = minimum
    else:
        step = 1 << max(0, (length - 1).bit_length() - 1 - (WINDOWS_PER_OCTAVE.bit_length() - 1))
        size = -(-length // step) * step
    return min(size, max_context)


class StaticInputs:
    """The fixed device buffers a static step reads, by name (attributes), as filled for one call."""

    def __init__(self, step: StaticStep):
        self._step = step
        self._buffers: dict[str, torch.Tensor] = {}

    def set(self, name: str, value: int | float | torch.Tensor) -> torch.Tensor:
        """Store `value` in the step's buffer `name` of its shape and dtype (made on first use, then reused:
        an int is a `[1]` long buffer, filled on the device without a copy) and return the buffer."""
        buffer = self._step._buffer(name, value)
        if isinstance(value, torch.Tensor):
            buffer.copy_(value)
        else:
            buffer.fill_(value)
        self._buffers[name] = buffer
        return buffer

    def __getattr__(self, name: str) -> torch.Tensor:
        buffers = self.__dict__.get("_buffers", {})
        if name not in buffers:
            raise AttributeError(f"the static inputs hold {sorted(buffers)}, not {name!r}")
        return buffers[name]

    @property
    def signature(self) -> tuple:
        """The names, shapes and dtypes of the buffers: a recording made over them replays only over them."""
        return tuple(sorted((name, tuple(b.shape), b.dtype) for name, b in self._buffers.items()))


class StaticStep:
    """One step function's fixed input buffers and recordings, for one owner (a sequence's state).

    `backend`: the ops the step runs on (its device services record and replay). `graphs`: record and
    replay (default: where the backend enables graphs); a call may override it. The graph memory pool is
    this step's own: its recordings are made, replayed and freed together. (A pool shared across sequences
    tripped PyTorch's allocator, a use_count assertion, once an earlier sequence's graphs were freed while a
    later one was recording: H200 run 3.)
    """

    def __init__(self, backend: Any, label: str, *, graphs: bool | None = None):
        self.backend = backend
        self.label = label
        self.device = torch.device(backend.device)
        self.graphs = backend.graphs_enabled() if graphs is None else graphs
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._recorded: dict[Hashable, tuple[Any, Any]] = {}
        self._pool: Any = None
        self.failure: str | None = None  # why recording failed; the step then runs eagerly

    def __len__(self) -> int:
        """Recordings held."""
        return len(self._recorded)

    def keys(self) -> list[Hashable]:
        """The recordings held, oldest first, each as (the key its run gave, its static inputs' names and shapes)."""
        return list(self._recorded)

    def recordings(self) -> list[Any]:
        """The recorded graphs (each with `replay()`), oldest first: for profiling a bare replay."""
        return [graph for graph, _ in self._recorded.values()]

    def _buffer(self, name: str, value: int | float | torch.Tensor) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            shape, dtype = tuple(value.shape), value.dtype
        else:
            shape, dtype = (1,), torch.long if isinstance(value, int) else torch.float32
        key = (name, shape, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return buffer

    def inputs(self, **values: int | float | torch.Tensor) -> StaticInputs:
        """Fill this step's buffers for one call (see `StaticInputs.set`); add more with `set`."""
        inputs = StaticInputs(self)
        for name, value in values.items():
            inputs.set(name, value)
        return inputs

    def holds(self, key: Hashable, inputs: StaticInputs) -> bool:
        """Whether `key` is recorded for inputs of these shapes: a `run` with graphs on replays it, and its outputs are
        the same tensors at every replay."""
        return (key, inputs.signature) in self._recorded

    def run(self, key: Hashable, step: Callable[[StaticInputs], Any], inputs: StaticInputs, *,
            clone: bool = False, graphs: bool | None = None, decode_only: bool = False) -> Any:
        """`step(inputs)`, recorded for `key` the first time and replayed after; returns its outputs (any
        structure of tensors).

        The first time, `step` runs eagerly on a side stream (the warm-up: kernels compile, weights upload,
        library handles are made; its result is the real result) and is then recorded, which runs nothing.
        `step` may read host values only to choose shapes that `key` (with the inputs' shapes) determines,
        and must update its state in place. A replay leaves its outputs in the recording's buffers, which
        the next replay overwrites: `clone` hands out copies. If recording fails, the step warns once; from
        then on keys without a recording run eagerly, and those recorded before still replay. `decode_only`: the
        step may take decode-only kernels (`decode_only_kernels`); `key` must tell such a recording apart.
        """
        with running_static_step(decode_only=decode_only):
            return self._run(key, step, inputs, clone=clone, graphs=graphs)

    def _run(self, key: Hashable, step: Callable[[StaticInputs], Any], inputs: StaticInputs, *, clone: bool,
             graphs: bool | None) -> Any:
        use_graphs = self.graphs if graphs is None else graphs
        if not use_graphs:
            return step(inputs)
        full_key = (key, inputs.signature)
        entry = self._recorded.get(full_key)
        if entry is not None:
            graph, outputs = entry
            graph.replay()
        elif self.failure is not None:  # recording failed once: new keys run eagerly, recorded ones replay
            return step(inputs)
        else:
            outputs = self.backend.on_side_stream(lambda: step(inputs))
            if self._pool is None:
                self._pool = self.backend.new_graph_pool()
            try:
                self._recorded[full_key] = self.backend.record_graph(lambda: step(inputs), self._pool)
            except Exception as exc:  # recording runs nothing, so the state is as the warm-up left it
                self.failure = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"graph capture of the {self.label} failed, running it eagerly: {self.failure}",
                              RuntimeWarning, stacklevel=2)
        return _cloned(outputs) if clone else outputs


def _cloned(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_cloned(o) for o in outputs)
    if isinstance(outputs, dict):
        return {k: _cloned(v) for k, v in outputs.items()}
    return outputs


def step_scope(model: Any) -> contextlib.AbstractContextManager:
    """What `model` does around each static step it runs (decode, verify): its `static_step_scope()` where
    it has one (Spark's: experts promoted between steps, read paged inside), else nothing."""
    scope = getattr(model, "static_step_scope", None)
    return scope() if scope is not None else contextlib.nullcontext()


def run_decode_step(model: Any, state: Any, token: Any, step: Callable[[Any, StaticInputs, int], Any], *,
                    graphs: bool | None = None, sampler: Any = None) -> Any:
    """One token at position `state.length` through a family's static decode step: what every family's
    `decode_step` does around its own `step(state, inputs, window)` (the layers, as a function of the
    fixed inputs and the KV window alone). Returns logits `[1, vocab]` and advances the state as a
    one-token forward does.

    The model gives `ops`, `embed(ids)`, `decode_graphs` and `decode_min_window`; the state `kv`, `length`,
    `features` (the drafter's feature ring or None), `captured` and `decode` (this runner, made on first
    use). The token and its position sit in fixed device buffers; the embedding is gathered eagerly,
    outside the recording (the GGUF dequantizers build small host constants a graph cannot record).
    Recordings with a feature ring are keyed on the ring too: a recording writes into the buffer it was
    made with.

    `sampler`: a `device_sampling.RecordedDraw`. The step then ends with the draw of the next token from its
    logits (in the recording: no logits go to the host, nothing waits) and returns `(logits, token [1])`;
    recordings are keyed on the draw's shape too.
    """
    ops = model.ops
    length = state.length
    state.kv.ensure_room(1)
    if state.decode is None:
        state.decode = StaticStep(ops, "decode step", graphs=model.decode_graphs)
    if isinstance(token, torch.Tensor) and token.device != torch.device(ops.device):
        token = int(token.reshape(-1)[0])  # a host value: filled on the device, no copy to wait for
    inputs = state.decode.inputs(token=token.reshape(1) if isinstance(token, torch.Tensor) else int(token),
                                 position=length)
    inputs.set("embedded", model.embed(inputs.token).reshape(1, 1, -1))
    window = kv_window(length + 1, window_limit(state.kv), model.decode_min_window)
    # A sequence with a drafter keeps the kernels its verify passes share (`decode_only_kernels`); its recordings
    # are told apart by the ring.
    key = window if state.features is None else (window, state.features.data_ptr())
    decode_only = state.features is None
    with step_scope(model):
        if sampler is None:
            result = state.decode.run(key, lambda step_inputs: step(state, step_inputs, window), inputs, clone=True,
                                      graphs=graphs, decode_only=decode_only)
        else:
            result = state.decode.run((key, sampler.key), lambda step_inputs: _then_draw(
                step(state, step_inputs, window), sampler), inputs, clone=True, graphs=graphs,
                decode_only=decode_only)
            sampler.drawn()
    state.kv.commit(length + 1)
    state.length = length + 1
    state.captured = {}
    return result


# -- recorded prefill pieces ------------------------------------------------------------------------------

PREFILL_SWITCH = "LUCEBOX_RECORDED_PREFILL"  # "0": prefill pieces always run as eager forward calls
MIN_RECORDED_PIECE = 8  # shorter pieces go through the decode step token by token (the engine's choice)
MIN_PREFILL_BUCKET = 16
# Longer pieces are GPU-bound (the 27B's 4096-token piece: ~400 ms of kernels for a few ms of launches), so a
# recording would save little and its padding would cost; shorter ones are host-bound on a small model (the
# 0.8B's 512-token piece: ~5 ms of kernels behind ~25 ms of Python launching ~600 ops).
MAX_RECORDED_PIECE = 1024


def prefill_bucket(tokens: int) -> int:
    """The length a recorded prefill piece of `tokens` runs at: `kv_window`'s rounding (`MIN_PREFILL_BUCKET` up to
    that many tokens, then four sizes an octave, so less than a quarter of a longer piece's bucket is padding),
    which bounds the recordings a sequence makes whatever the lengths of its prompts."""
    return kv_window(tokens, 1 << 62, MIN_PREFILL_BUCKET)


def _prefill_recorded(model: Any) -> bool:
    """Whether `model` offers recorded prefill pieces (`model.recorded_prefill`, a family's choice) and the switch
    is on."""
    return bool(getattr(model, "recorded_prefill", False)) and os.environ.get(PREFILL_SWITCH, "1") != "0"


def recorded_prefill_fits(model: Any, state: Any, tokens: int) -> bool:
    """Whether a prefill piece of `tokens` after what `state` holds may run as a recorded piece: the model offers
    one (`model.recorded_prefill`, a family's choice), the switch is on, the piece is of a recorded length, its
    padded length fits the cache, and no earlier recording of the piece failed."""
    if not _prefill_recorded(model):
        return False
    bucket = prefill_bucket(tokens)
    if not MIN_RECORDED_PIECE <= tokens or bucket > MAX_RECORDED_PIECE:
        return False
    if state.length + bucket > window_limit(state.kv) or state.kv.length != state.length:
        return False
    runner = getattr(state, "prefill", None)
    return runner is None or runner.failure is None


def prefill_mode(model: Any) -> str:
    """How `model`'s prefill pieces run, for /props: "recorded pieces of 8-1024 tokens (padded to buckets)", or
    "eager" (the family offers no recorded piece, graphs are off, or the switch is)."""
    if not _prefill_recorded(model):
        return "eager"
    return f"recorded pieces of {MIN_RECORDED_PIECE}-{MAX_RECORDED_PIECE} tokens (padded to buckets)"


def run_prefill_piece(model: Any, state: Any, token_ids: torch.Tensor,
                      step: Callable[[Any, StaticInputs, int], torch.Tensor], *, graphs: bool | None = None,
                      key: Hashable = None) -> torch.Tensor:
    """A prefill piece `token_ids` `[T]` after what `state` holds, as a recorded step of a fixed length: the last
    token's logits `[1, vocab]`, the state advanced by T positions, as `forward(..., last_only=True)` does.

    The piece is padded to `prefill_bucket(T)` tokens (id 0). The family's `step(state, inputs, window)` reads
    the ids' embeddings (`inputs.embedded` `[1, bucket, hidden]`), the start position (`inputs.start` `[1]`) and
    the real token count (`inputs.count` `[1]`) from fixed device buffers, so one recording per (bucket, KV
    window) serves every piece of that bucket: it must leave the state as the real tokens alone would (the
    padding's K/V rows sit past the committed length, where the next piece writes over them) and return the
    logits of token `count - 1`. The state's `prefill` holds the recordings (made on first use), apart from the
    decode step's, so that a piece that cannot be recorded leaves decoding graphed. `key`: what else the step's
    recordings depend on (the buffer of a drafter's feature ring that it writes)."""
    ops = model.ops
    tokens = int(token_ids.shape[0])
    bucket = prefill_bucket(tokens)
    start = state.length
    state.kv.ensure_room(tokens)
    if state.prefill is None:
        state.prefill = StaticStep(ops, "prefill piece", graphs=model.decode_graphs)
    ids = token_ids.to(ops.device, non_blocking=True)
    if bucket > tokens:
        ids = torch.nn.functional.pad(ids, (0, bucket - tokens))
    inputs = state.prefill.inputs(ids=ids, start=start, count=tokens)
    inputs.set("embedded", model.embed(inputs.ids).reshape(1, bucket, -1))
    window = kv_window(start + bucket, window_limit(state.kv), model.decode_min_window)
    with step_scope(model):
        logits = state.prefill.run((bucket, window, key), lambda step_inputs: step(state, step_inputs, window),
                                   inputs, clone=True, graphs=graphs)
    state.kv.commit(start + tokens)
    state.length = start + tokens
    state.captured = {}
    return logits


def _then_draw(logits: torch.Tensor, sampler: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return logits, sampler(logits[-1])
