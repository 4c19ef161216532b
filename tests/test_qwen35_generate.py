"""Every type `lucebox synth` writes loads and generates; quantized files match transformers run on the
same (dequantized) weights, logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_qwen35 import layout, synth

from test_qwen35_synth import to_transformers

PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module", params=["f32", "f16", "q8_0", "q4_k_m"])
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / f"tiny-{request.param}.gguf"
    synth.write(path, size="tiny", type=request.param, seed=11)
    return request.param, path


def test_every_synth_type_loads_and_generates(written):
    type_name, path = written
    loaded = load_model(path)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True)
    first = engine.generate(request)
    assert len(first.token_ids) == 6 and all(0 <= t < loaded.model.vocab_size for t in first.token_ids)
    assert engine.generate(request).token_ids == first.token_ids  # greedy is deterministic
    sampled = GenerationRequest(prompt_ids=PROMPT, max_tokens=6, sampling=SamplingParams(temperature=1.0, seed=5))
    assert engine.generate(sampled).token_ids == engine.generate(sampled).token_ids


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k_m"])
def test_quantized_files_match_transformers_on_the_same_weights(type_name, tiny_quantized_files,
                                                                 tiny_quantized_readers):
    """Read back by gguf's GGUFReader and dequantized by gguf's numpy code, the session's files (written and
    parsed once: test_qwen35_synth reads the same ones)."""
    path = tiny_quantized_files[type_name]
    reference = to_transformers(tiny_quantized_readers[type_name], layout.size("tiny"))
    loaded = load_model(path)
    state = loaded.model.new_state(64)
    tokens = list(PROMPT)
    ours = loaded.model.forward(state, torch.tensor(tokens))
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
    for _ in range(8):  # greedy decode, one token at a time against the full-sequence reference
        token = int(ours[-1].argmax())
        tokens.append(token)
        ours = loaded.model.forward(state, torch.tensor([token]))
        with torch.no_grad():
            theirs = reference(torch.tensor([tokens])).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


def test_answer_ended_by_a_stop_string_continues_like_a_fresh_prefill(tmp_path):
    """The plain loop feeds each sampled token before the host reads it (the device works while the host
    detokenizes). An answer ended by a stop string then leaves its last token fed; the next call on the
    sequence must continue exactly as a fresh sequence given the whole history as a prompt."""
    path = tmp_path / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=13)
    loaded = load_model(path)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    greedy = SamplingParams(temperature=0)
    free = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_tokens=8, sampling=greedy, ignore_eos=True))
    # A stop string made of the text of the 4th generated token: the answer ends there.
    stop = loaded.tokenizer.decode(free.token_ids[3:4])
    assert stop.strip(), "the synthetic model's 4th token must decode to visible text"
    sequence = engine.new_sequence()
    stopped = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_tokens=8, sampling=greedy, ignore_eos=True,
                                                stop=[stop]), sequence)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert sequence.tokens == PROMPT + stopped.token_ids and sequence.unfed == []  # the last token was fed ahead
    follow_up = [9707, 11]
    continued = engine.generate(GenerationRequest(prompt_ids=follow_up, max_tokens=5, sampling=greedy,
                                                  ignore_eos=True), sequence)
    fresh = engine.generate(GenerationRequest(prompt_ids=PROMPT + stopped.token_ids + follow_up, max_tokens=5,
                                              sampling=greedy, ignore_eos=True))
    assert continued.token_ids == fresh.token_ids
    # An answer ended by max_tokens leaves its last token unfed, as before: one position for it remains.
    limited = engine.new_sequence()
    engine.generate(GenerationRequest(prompt_ids=PROMPT, max_tokens=3, sampling=greedy, ignore_eos=True), limited)
    assert limited.unfed == free.token_ids[2:3] and limited.tokens == PROMPT + free.token_ids[:2]


def test_a_failure_after_the_token_was_fed_leaves_the_sequence_consistent(tmp_path):
    """A token fed ahead is recorded on the sequence at once: if a later check of that token raises (here a
    constraint rejecting it), the sequence still says what the model holds, and continues correctly."""
    path = tmp_path / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=14)
    loaded = load_model(path)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256)

    class RejectsThird:
        accepted = 0
        finished = False

        def allowed(self, vocab_size):
            return None

        def accept(self, token_id):
            self.accepted += 1
            if self.accepted == 3:
                raise ValueError("rejected")

    greedy = SamplingParams(temperature=0)
    sequence = engine.new_sequence()
    with pytest.raises(ValueError, match="rejected"):
        engine.generate(GenerationRequest(prompt_ids=PROMPT, max_tokens=8, sampling=greedy, ignore_eos=True,
                                          constraint=RejectsThird()), sequence)
    assert sequence.state.length == sequence.length == len(PROMPT) + 3 and sequence.unfed == []
    follow_up = [9707, 11]
    continued = engine.generate(GenerationRequest(prompt_ids=follow_up, max_tokens=4, sampling=greedy,
                                                  ignore_eos=True), sequence)
    fresh = engine.generate(GenerationRequest(prompt_ids=sequence.tokens[: len(PROMPT) + 3] + follow_up,
                                              max_tokens=4, sampling=greedy, ignore_eos=True))
    assert continued.token_ids == fresh.token_ids
