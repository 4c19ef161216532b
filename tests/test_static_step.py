"""The static-step runner: fixed input buffers, one recording per key and input shapes, replay.

On the CPU there are no CUDA graphs, so a stand-in backend emulates their contract: recording runs nothing
and returns output buffers shaped like the warm-up's (tensors in tuples, lists, dicts and attrs records); a replay re-runs the recorded function, which may
read only the static buffers and the values its key fixed, and writes its results into those output
buffers. A step that read a host value its key does not cover, or a fresh buffer instead of a static one,
would replay stale data here as it would on a GPU.
"""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.sampling import SamplingParams
from lucebox_core.static_step import StaticStep
from lucebox_core.torch_backend import TorchBackend


def _zeros_like(outputs):
    if isinstance(outputs, torch.Tensor):
        return torch.zeros_like(outputs)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_zeros_like(o) for o in outputs)
    if isinstance(outputs, dict):
        return {k: _zeros_like(v) for k, v in outputs.items()}
    if attrs.has(type(outputs)):  # a record of tensors (qwen35's `ReplayedRecurrence`): its tensor fields
        return attrs.evolve(outputs, **_tensor_fields(outputs, torch.zeros_like))
    return outputs


def _tensor_fields(record, transform) -> dict:
    return {field.name: transform(getattr(record, field.name)) for field in attrs.fields(type(record))
            if isinstance(getattr(record, field.name), torch.Tensor)}


def _copy_into(target, source):
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, (tuple, list)):
        for t, s in zip(target, source):
            _copy_into(t, s)
    elif isinstance(target, dict):
        for key in target:
            _copy_into(target[key], source[key])
    elif attrs.has(type(target)):
        for name, tensor in _tensor_fields(target, lambda t: t).items():
            tensor.copy_(getattr(source, name))


class _Graph:
    def __init__(self, function, outputs):
        self.function, self.outputs, self.replays = function, outputs, 0

    def replay(self):
        self.replays += 1
        _copy_into(self.outputs, self.function())


class GraphStandIn(TorchBackend):
    """Torch ops whose static steps are "recorded" as the graph contract says (see the module docstring)."""

    fail_recording = False

    def graphs_enabled(self) -> bool:
        return True

    def new_graph_pool(self):
        return object()

    def on_side_stream(self, function):
        self._last = function()
        return self._last

    def record_graph(self, function, pool):
        if self.fail_recording:
            raise RuntimeError("capture is not supported here")
        outputs = _zeros_like(self._last)  # recording runs nothing: buffers shaped like the warm-up's
        return _Graph(function, outputs), outputs


def test_inputs_are_copied_into_buffers_that_replays_read():
    backend = GraphStandIn(kernel_table_for={})
    step = StaticStep(backend, "test step")
    results = []
    for value in (3, 5, 7):
        inputs = step.inputs(position=value, rows=torch.full((2,), float(value)))
        results.append(step.run("key", lambda i: i.rows * i.position, inputs, clone=True))
    assert [r.tolist() for r in results] == [[9.0, 9.0], [25.0, 25.0], [49.0, 49.0]]
    assert len(step) == 1 and step.recordings()[0].replays == 2
    # Other input shapes are another recording, over buffers of their own.
    inputs = step.inputs(position=2, rows=torch.ones(3))
    assert step.run("key", lambda i: i.rows * i.position, inputs).tolist() == [2.0, 2.0, 2.0]
    assert len(step) == 2
    with pytest.raises(AttributeError, match="not 'missing'"):
        _ = inputs.missing


def test_outputs_are_the_recordings_unless_cloned():
    step = StaticStep(GraphStandIn(kernel_table_for={}), "test step")

    def run(value, clone):
        return step.run(0, lambda i: i.x + 1, step.inputs(x=torch.tensor([float(value)])), clone=clone)

    run(0, False)  # warm-up and recording
    shared, kept = run(1, False), run(2, True)
    run(3, False)
    assert shared.item() == 4.0 and kept.item() == 3.0  # the next replay overwrote the shared buffer


def test_a_failed_recording_warns_once_and_runs_new_keys_eagerly_after():
    backend = GraphStandIn(kernel_table_for={})
    step = StaticStep(backend, "test step")
    step.run("recorded", lambda i: i.x * 2, step.inputs(x=torch.tensor([1.0])))
    backend.fail_recording = True
    with pytest.warns(RuntimeWarning, match="graph capture of the test step failed"):
        first = step.run("new", lambda i: i.x * 2, step.inputs(x=torch.tensor([3.0])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = step.run("new", lambda i: i.x * 2, step.inputs(x=torch.tensor([4.0])))
        replayed = step.run("recorded", lambda i: i.x * 2, step.inputs(x=torch.tensor([5.0])))
    assert (first.item(), second.item(), replayed.item()) == (6.0, 8.0, 10.0)
    assert step.failure and len(step) == 1 and step.recordings()[0].replays == 1  # the recorded key still replays


def test_graphs_off_runs_eagerly():
    step = StaticStep(GraphStandIn(kernel_table_for={}), "test step", graphs=False)
    assert step.run(0, lambda i: i.x * 3, step.inputs(x=torch.tensor([2.0]))).item() == 6.0
    assert len(step) == 0


def test_the_warm_up_and_the_recording_both_run_inside_the_static_step():
    """`inside_static_step()` holds in a step's warm-up, in its recording and in an eager run of it, and
    nowhere else: a backend that launches differently there (PDL) builds in the warm-up every kernel its
    recording launches."""
    from lucebox_core.static_step import inside_static_step

    class Capturing(GraphStandIn):  # a capture runs the step's Python (its launches are recorded, not run)
        def record_graph(self, function, pool):
            function()
            return super().record_graph(function, pool)

    backend = Capturing(kernel_table_for={})
    seen = []

    def step_function(inputs):
        seen.append(inside_static_step())
        return inputs.x + 1

    recorded = StaticStep(backend, "test step")
    recorded.run(0, step_function, recorded.inputs(x=torch.tensor([1.0])))  # warm-up, then recording
    recorded.run(0, step_function, recorded.inputs(x=torch.tensor([2.0])))  # the stand-in's replay runs it too
    eager = StaticStep(backend, "test step", graphs=False)
    eager.run(0, step_function, eager.inputs(x=torch.tensor([1.0])))
    assert seen == [True] * 4  # warm-up, recording, replay, eager
    assert not inside_static_step()


def _generate(target, draft, backend, *, force: float | None = None,
              split_head: bool = False) -> tuple[list[int], list[int]]:
    from lucebox_core.assembly import load_drafter
    from lucebox_core.speculative import SpeculativeDecoder
    from lucebox_core.tokenizer import Tokenizer
    from lucebox_qwen35.loader import load

    model = load(target, backend)
    model.decode_min_window = 8  # windows change during the run: several recordings per step
    tokenizer = Tokenizer.from_gguf(target)
    speculative = None
    if draft is not None:
        drafter = load_drafter(str(draft), model, backend)
        drafter.split_head = split_head
        speculative = SpeculativeDecoder(model, drafter, "ddtree", budget=6)
    engine = Engine(model, tokenizer, ctx_size=96, speculative=speculative)
    request = GenerationRequest(prompt_ids=[7, 8, 9, 10, 11], max_tokens=40, sampling=SamplingParams(temperature=0),
                                ignore_eos=True)
    if force is not None:
        import attrs

        plain = Engine(model, tokenizer, ctx_size=96)
        reference = plain.generate(attrs.evolve(request, max_tokens=40 + speculative.block_size)).token_ids
        request = attrs.evolve(request, force_accept=force, force_reference=reference)
    result = engine.generate(request)
    second = engine.generate(request)  # on the released sequence: its recordings are replayed
    assert second.token_ids == result.token_ids
    if isinstance(backend, GraphStandIn):
        (kept,) = engine._idle
        if speculative is None:
            assert len(kept.state.decode) >= 2  # several KV windows, each recorded once
        else:  # every token comes out of a verify pass; one draft block recorded, and the context syncs per count
            runs = [run for run, _ in kept.draft.step.keys()]
            blocks = [run for run in runs if not (isinstance(run, tuple) and run[0] == "sync")]
            assert len(kept.state.verify) >= 2 and len(blocks) == 1 and len(kept.draft.step) > 1
            assert (kept.draft.head_step is not None and len(kept.draft.head_step) == 1) == split_head
    return result.token_ids, result.timings.accepted_lengths


def test_qwen35_decode_verify_and_draft_replayed_as_recorded_equal_eager(tiny_target_and_draft):
    """The family's three static steps (decode, verify of N nodes, the drafter's block) through the runner
    with the graph contract emulated: the tokens are those of eager decoding, plain and speculative."""
    target, draft = tiny_target_and_draft
    eager = TorchBackend(kernel_table_for={})
    emulated = GraphStandIn(kernel_table_for={})
    plain_tokens, _ = _generate(target, None, eager)
    assert _generate(target, None, emulated)[0] == plain_tokens
    tokens, lengths = _generate(target, draft, emulated, force=3)
    assert tokens == plain_tokens and set(lengths[:-1]) == {4}


def test_a_drafter_recorded_in_two_parts_drafts_as_one(tiny_target_and_draft):
    """A drafter on another device than the target's head records its layers there and the borrowed output
    layer on the head's device (a graph records one device); forced here on the CPU: the same tokens and the
    same accepted lengths as the one-part recording, each part recorded once."""
    target, draft = tiny_target_and_draft
    emulated = GraphStandIn(kernel_table_for={})
    one_part = _generate(target, draft, emulated, force=3)
    assert _generate(target, draft, GraphStandIn(kernel_table_for={}), force=3, split_head=True) == one_part


def _engine_on(target, backend) -> Engine:
    from lucebox_core.tokenizer import Tokenizer
    from lucebox_qwen35.loader import load

    model = load(target, backend)
    model.decode_min_window = 8
    return Engine(model, Tokenizer.from_gguf(target), ctx_size=96)


# Two requests of one draw shape (top-k, penalty window and bias on): the second replays the first's
# recordings, with another seed, temperature, filters, penalties and biases.
SAMPLED = [
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.3, repeat_last_n=8,
                   presence_penalty=0.2, logit_bias={3: 2.0}, seed=5),
    SamplingParams(temperature=1.4, top_k=20, top_p=0.7, min_p=0.1, repeat_penalty=0.8, repeat_last_n=8,
                   frequency_penalty=0.3, logit_bias={4: -1.0, 9: 1.5}, seed=6),
]
GREEDY_PENALIZED = SamplingParams(temperature=0, repeat_penalty=1.6, repeat_last_n=16, presence_penalty=0.5)


def test_sampling_ends_the_recorded_decode_step_and_its_replays_read_no_host_values(tiny_target_and_draft):
    """With the graph contract emulated, plain decoding's steps end with the draw (their recordings hand out
    the token); the tokens equal those of eager steps followed by eager device draws. The second request of
    a shape only replays the first's recordings: had the draw read its seed, knobs or window from the host
    when recorded, it would replay the first request's and its tokens would differ."""
    target, _ = tiny_target_and_draft
    eager = _engine_on(target, TorchBackend(kernel_table_for={}))
    emulated = _engine_on(target, GraphStandIn(kernel_table_for={}))

    def generate(engine, params):
        # A prompt longer than STEPPED_PIECE_TOKENS: one forward call, so every recording is a sampled step's.
        request = GenerationRequest(prompt_ids=[7, 8, 9, 10, 11, 12, 13, 14], max_tokens=16, sampling=params,
                                    ignore_eos=True)
        return engine.generate(request).token_ids

    first = generate(emulated, SAMPLED[0])
    assert first == generate(eager, SAMPLED[0])
    (kept,) = emulated._idle
    recordings = dict(kept.state.decode._recorded)
    assert recordings and all(isinstance(outputs, tuple) for _, outputs in recordings.values())  # (logits, token)
    replays = sum(graph.replays for graph, _ in recordings.values())
    second = generate(emulated, SAMPLED[1])
    assert second == generate(eager, SAMPLED[1]) and second != first
    assert kept.state.decode._recorded.keys() == recordings.keys()  # nothing recorded anew
    assert sum(graph.replays for graph, _ in recordings.values()) >= replays + 12
    assert generate(emulated, GREEDY_PENALIZED) == generate(eager, GREEDY_PENALIZED)


def test_short_prefill_pieces_run_as_recorded_decode_steps(tiny_target_and_draft):
    """A prompt's pieces of at most STEPPED_PIECE_TOKENS (here the 3-token tail after the last turn boundary)
    go through the recorded decode step where the model records one; longer pieces through one forward call.
    The prefix cache still gives the uncached output: a restored sequence runs the same pieces."""
    from lucebox_core import engine as engine_module
    from lucebox_core.prefix_cache import PrefixCache, PrefixCacheConfig
    from lucebox_core.tokenizer import Tokenizer
    from lucebox_qwen35.loader import load

    tiny_target, _ = tiny_target_and_draft
    backend = GraphStandIn(kernel_table_for={})
    model = load(tiny_target, backend)
    tokenizer = Tokenizer.from_gguf(tiny_target)
    end_of_turn = min(Engine(model, tokenizer, ctx_size=128).eog_ids)
    turn = [5, 6, 7, 8, 9, 10, 11, end_of_turn]
    prompt = turn * 3 + [12, 13, 14]  # pieces of 8, 8, 8, then the 3-token tail
    calls = []
    forward = model.forward

    def counting(state, token_ids, *args, **kwargs):
        calls.append(int(token_ids.numel()))
        return forward(state, token_ids, *args, **kwargs)

    model.forward = counting
    request = GenerationRequest(prompt_ids=prompt, max_tokens=6, sampling=SamplingParams(temperature=0),
                                ignore_eos=True)
    plain = Engine(model, tokenizer, ctx_size=128).generate(request).token_ids
    assert calls[:6] == [8, 8, 8, 1, 1, 1] and engine_module.STEPPED_PIECE_TOKENS >= 3
    cache = PrefixCache(PrefixCacheConfig(slots=2, min_tokens=1), "test")
    cached_engine = Engine(model, tokenizer, ctx_size=128, prefix_cache=cache)
    assert cached_engine.generate(request).token_ids == plain  # takes the snapshot
    calls.clear()
    second = cached_engine.generate(request)
    assert second.token_ids == plain and second.timings.cached_tokens == 24
    assert calls[:3] == [1, 1, 1]  # only the tail was prefilled, stepped


def test_decode_only_kernels_are_offered_to_plain_decode_steps_only(tiny_target_and_draft, monkeypatch):
    """`decode_only_kernels()` (where lucebox_cuda's persistent kernels, near-tie equal to a verify pass, may run)
    holds in the decode steps of a sequence without a drafter, and in no static step of a speculative one (its
    decode steps, verify passes and draft blocks), so a switch for those kernels never costs speculative output
    its equality with plain decoding."""
    from lucebox_core import static_step
    from lucebox_core.static_step import decode_only_kernels

    seen: dict[str, set[bool]] = {}
    original = static_step.StaticStep._run

    def recording(self, *args, **kwargs):
        seen.setdefault(self.label, set()).add(decode_only_kernels())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(static_step.StaticStep, "_run", recording)
    target, draft = tiny_target_and_draft
    _generate(target, None, GraphStandIn(kernel_table_for={}))
    assert seen == {"decode step": {True}}
    seen.clear()
    _generate(target, draft, GraphStandIn(kernel_table_for={}))  # unforced: no plain reference run beside it
    assert seen and all(values == {False} for values in seen.values()), seen
    assert not decode_only_kernels()
