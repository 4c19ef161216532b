"""Speculative decoding on the CPU reference path: DFlash drafter, chain and DDTree verification.

A tiny synthetic qwen35 target and a tiny synthetic drafter (random weights: the real drafter accepts
almost nothing, so `force_accept` drives the accept path through the real verifier).
"""

from __future__ import annotations

import json
import sys
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import (
    SpeculativeDecoder,
    dflash,
    forced_accept_counts,
    trees,
)

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5], [9000, 17, 42], [151644, 872, 198, 3838, 374, 220], [77777]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from lucebox_qwen35 import draft_synth, synth

    folder = tmp_path_factory.mktemp("spec")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=3)
    draft = draft_synth.write(folder / "draft.gguf", size="tiny", type="f32", seed=4, target=target)
    return target, draft


@pytest.fixture(scope="module")
def loaded(files):
    torch.manual_seed(0)
    return load_model(files[0])


@pytest.fixture(scope="module")
def drafter(files, loaded):
    return dflash.load(files[1], loaded.model)


def _engine(loaded, drafter=None, spec_type="ddtree", **options):
    speculative = None if drafter is None else SpeculativeDecoder(loaded.model, drafter, spec_type=spec_type, **options)
    return Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=speculative)


def _greedy(engine, prompt, n, **fields):
    return engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                             **fields))


# -- files ------------------------------------------------------------------------------------------


def test_synthetic_target_has_the_mask_token_as_a_control_token(files, drafter):
    types = GGUFFile(files[0]).get("tokenizer.ggml.token_type")
    assert drafter.mask_token_id == 248070
    assert types[248070] == 3  # CONTROL
    assert drafter.config.target_layer_ids == (1, 4, 7)


def test_draft_gguf_errors_name_the_file_and_key(tmp_path, files, loaded):
    with pytest.raises(GGUFError, match=r"target\.gguf.*architecture"):
        dflash.load(files[0], loaded.model)

    missing = tmp_path / "missing.gguf"
    writer = GGUFWriter(str(missing), "dflash-draft")
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(GGUFError, match=r"missing\.gguf.*'dflash\.fc\.weight'"):
        dflash.load(missing, loaded.model)

    # A key of the wrong type: copy the synthetic draft with dflash.block_size as a string.
    source = GGUFFile(files[1])
    bad = tmp_path / "bad_key.gguf"
    writer = GGUFWriter(str(bad), "qwen35-dflash-draft")
    for key in source.keys():  # noqa: SIM118 (GGUFFile.keys)
        if key.startswith("qwen35-dflash-draft.") and not key.endswith("block_size"):
            value = source.get(key)
            if isinstance(value, list):
                sub = GGUFValueType.BOOL if isinstance(value[0], bool) else GGUFValueType.INT32
                writer.add_key_value(key, value, GGUFValueType.ARRAY, sub)
            elif isinstance(value, float):
                writer.add_key_value(key, value, GGUFValueType.FLOAT32)
            else:
                writer.add_key_value(key, value, GGUFValueType.UINT32)
    writer.add_key_value("qwen35-dflash-draft.dflash.block_size", "sixteen", GGUFValueType.STRING)
    for name in source.tensors:
        writer.add_tensor(name, source.tensor(name).dequantize(torch.float32, "cpu").numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(GGUFError, match=r"bad_key\.gguf.*dflash\.block_size"):
        dflash.load(bad, loaded.model)


# -- trees ------------------------------------------------------------------------------------------


def test_ddtree_is_best_first_with_the_chain_first():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=generator) * 3
    log_probs, ids = trees.top_k_log_probs(logits, 4)
    tree = trees.ddtree(7, log_probs, ids, budget=12)
    assert len(tree) == 13 and tree.tokens[0] == 7
    assert tree.tokens[1:7] == [row[0] for row in ids]  # the top-1 chain, whole
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)
    # Every node outside the chain is at least as likely as any candidate left out: brute force.
    chosen = {tuple(tree.tokens[j] for j in _path(tree, i)) for i in range(1, len(tree))}
    worst_chosen = min(tree.scores[7:])
    for depth in range(1, 7):
        for prefix in list(chosen) + [()]:
            if len(prefix) != depth - 1:
                continue
            base = sum(log_probs[d][ids[d].index(t)] for d, t in enumerate(prefix))
            for rank in range(4):
                candidate = (*prefix, ids[depth - 1][rank])
                if candidate not in chosen:
                    assert base + log_probs[depth - 1][rank] <= worst_chosen + 1e-6
    index = trees.TreeIndex.build(tree.parents)
    visible = index.visibility()
    for i in range(len(tree)):
        assert set(torch.nonzero(visible[i]).flatten().tolist()) == {0, *_path(tree, i)} | {i}


def _path(tree, node):
    path = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def test_forced_counts_mix_floor_and_ceil():
    counts = forced_accept_counts(8.3)
    first = [next(counts) for _ in range(100)]
    assert set(first) == {8, 9} and sum(first) == 830


# -- target verify / commit -------------------------------------------------------------------------


def test_commit_equals_plain_decoding_of_the_accepted_path(loaded, drafter):
    model = loaded.model
    prompt = torch.tensor([5, 6, 7, 8, 9, 10])
    tree_state, plain_state = model.new_state(64), model.new_state(64)
    for state in (tree_state, plain_state):
        drafter.prepare_target(model, state, 64)
        model.forward(state, prompt)
    # Root 100; two branches, the accepted one root -> 11 -> 12 -> 13 is not in insertion order.
    tokens = [100, 21, 11, 22, 12, 23, 13, 24]
    parents = [-1, 0, 0, 1, 2, 3, 4, 4]
    verification = model.verify(tree_state, tokens, parents)
    assert tree_state.length == 6  # nothing committed yet
    path = [0, 2, 4, 6]
    model.commit(tree_state, verification, path)

    plain_logits = []
    for token in [100, 11, 12, 13]:
        plain_logits.append(model.forward(plain_state, torch.tensor([token]))[0])
    torch.testing.assert_close(verification.logits[path], torch.stack(plain_logits), atol=2e-4, rtol=1e-4)
    assert tree_state.length == plain_state.length == 10
    for layer in tree_state.kv.shapes:
        for a, b in zip(tree_state.kv.read(layer), plain_state.kv.read(layer)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for layer, linear in tree_state.linear.items():
        torch.testing.assert_close(linear.conv, plain_state.linear[layer].conv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear.recurrent, plain_state.linear[layer].recurrent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.read_features(tree_state, 0, 10), model.read_features(plain_state, 0, 10),
                               atol=1e-5, rtol=1e-5)
    # Continuing from both states gives the same next logits: nothing of the rejected branch survived.
    torch.testing.assert_close(model.forward(tree_state, torch.tensor([3]))[0],
                               model.forward(plain_state, torch.tensor([3]))[0], atol=2e-4, rtol=1e-4)


# -- lossless at temperature 0 ----------------------------------------------------------------------


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_real_drafter_output_equals_plain_greedy(loaded, drafter, spec_type):
    plain, spec = _engine(loaded), _engine(loaded, drafter, spec_type)
    for prompt in PROMPTS[:2]:
        expected = _greedy(plain, prompt, 5)
        result = _greedy(spec, prompt, 5)
        assert result.token_ids == expected.token_ids
        assert len(result.timings.accepted_lengths) >= 1


def _check_forced(loaded, drafter, spec_type, accept, prompt, reference_len=40):
    plain, spec = _engine(loaded), _engine(loaded, drafter, spec_type)
    n = 2 * (int(accept) + 1) + 1  # the first token, then two whole blocks
    reference = _greedy(plain, prompt, reference_len).token_ids
    result = _greedy(spec, prompt, n, force_accept=accept, force_reference=reference)
    assert result.token_ids == reference[:n]
    assert result.timings.accepted_lengths[:2] == [int(accept) + 1] * 2


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
@pytest.mark.parametrize("accept", [0, 5, 15])
def test_forced_acceptance_equals_plain_greedy(loaded, drafter, spec_type, accept):
    _check_forced(loaded, drafter, spec_type, accept, PROMPTS[accept % len(PROMPTS)])


@pytest.mark.slow
@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
@pytest.mark.parametrize("accept", [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14])
def test_forced_acceptance_every_k(loaded, drafter, spec_type, accept):
    _check_forced(loaded, drafter, spec_type, accept, PROMPTS[accept % len(PROMPTS)])


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_sequence_continued_across_calls_with_stops_inside_blocks(loaded, drafter, spec_type):
    """Three calls on one sequence; max_tokens ends each call inside a block, so only the emitted part
    is committed, and the next call continues from exactly there."""
    plain, spec = _engine(loaded), _engine(loaded, drafter, spec_type)
    plain_sequence, spec_sequence = plain.new_sequence(), spec.new_sequence()
    for prompt, n in ((PROMPTS[0], 6), (PROMPTS[1], 5), (PROMPTS[3], 7)):
        reference = plain.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY,
                                                     ignore_eos=True), plain_sequence).token_ids
        result = spec.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                                 force_accept=8, force_reference=reference), spec_sequence)
        assert result.token_ids == reference
        assert spec_sequence.tokens == plain_sequence.tokens and spec_sequence.unfed == plain_sequence.unfed
        assert spec_sequence.state.length == plain_sequence.state.length


def test_tree_budget_auto_is_lossless(loaded, drafter):
    plain, spec = _engine(loaded), _engine(loaded, drafter, "ddtree", budget="auto")
    reference = _greedy(plain, PROMPTS[2], 12).token_ids
    result = _greedy(spec, PROMPTS[2], 12, force_accept=4, force_reference=reference)
    assert result.token_ids == reference
    assert spec.speculative.verifier.last_budget is not None


# -- temperature > 0 --------------------------------------------------------------------------------


def _chi_square_ok(counts: dict, probs: dict, samples: int) -> None:
    # Pearson chi-square against the exact distribution, cells with expected >= 5; a generous bound
    # (the 99.99th percentile for these degrees of freedom is well below 3 * dof + 30).
    stat, cells = 0.0, 0
    for key, p in probs.items():
        expected = p * samples
        if expected >= 5:
            stat += (counts.get(key, 0) - expected) ** 2 / expected
            cells += 1
    assert stat < 3 * cells + 30, (stat, cells)


def test_chain_speculative_sampling_keeps_the_target_distribution():
    vocab, samples = 4, 20000
    generator = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p2 = {t: torch.softmax(torch.randn(vocab, generator=generator), 0) for t in range(vocab)}
    q1 = torch.tensor([0.25, 0.25, 0.4, 0.1])
    q2 = torch.tensor([0.1, 0.6, 0.2, 0.1])
    counts: dict = {}
    for _ in range(samples):
        drafted = [int(torch.multinomial(q1, 1, generator=generator)), int(torch.multinomial(q2, 1, generator=generator))]
        tree = trees.chain(0, drafted)

        def target(node, accepted):
            return p1 if node == 0 else p2[accepted[0]] if node == 1 else torch.full((vocab,), 1 / vocab)

        path, bonus = trees.chain_rejection_walk(tree, target, [q1, q2], generator)
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        counts[tuple(emitted[:2])] = counts.get(tuple(emitted[:2]), 0) + 1 if len(emitted) >= 2 else 0
        if len(emitted) < 2:  # the first token was a resample: the second comes from the next step's target
            second = int(torch.multinomial(p2[emitted[0]], 1, generator=generator))
            counts[(emitted[0], second)] = counts.get((emitted[0], second), 0) + 1
    exact = {(a, b): float(p1[a] * p2[a][b]) for a in range(vocab) for b in range(vocab)}
    assert sum(counts.values()) == samples
    _chi_square_ok(counts, exact, samples)


def test_sampled_tree_walk_keeps_the_target_distribution():
    vocab, samples = 3, 15000
    generator = torch.Generator().manual_seed(1)
    p_root = torch.tensor([0.6, 0.3, 0.1])
    p_next = {t: torch.softmax(torch.randn(vocab, generator=generator), 0) for t in range(vocab)}
    tree = trees.DraftTree([9, 0, 1, 2], [-1, 0, 0, 1])  # root -> {0, 1}, 0 -> 2
    counts: dict = {}
    for _ in range(samples):
        def draw(node, accepted):
            p = p_root if node == 0 else p_next[accepted[0]]
            return int(torch.multinomial(p, 1, generator=generator))

        path, bonus = trees.sampled_walk(tree, draw)
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p_next[emitted[0]], 1, generator=generator)))
        counts[tuple(emitted[:2])] = counts.get(tuple(emitted[:2]), 0) + 1
    exact = {(a, b): float(p_root[a] * p_next[a][b]) for a in range(vocab) for b in range(vocab)}
    _chi_square_ok(counts, exact, samples)


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_sampling_end_to_end_replays_with_a_seed(loaded, drafter, spec_type):
    spec = _engine(loaded, drafter, spec_type)
    params = SamplingParams(temperature=0.9, top_k=3, top_p=1.0, min_p=0.0, seed=11)
    runs = [spec.generate(GenerationRequest(prompt_ids=PROMPTS[0], max_tokens=4, sampling=params, ignore_eos=True))
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 4
    # Every token is one of the target's top 3 at its position, among the ids that may be generated (not the
    # vocabulary's padding).
    plain_state = loaded.model.new_state(64)
    logits = loaded.model.forward(plain_state, torch.tensor(PROMPTS[0]))[-1]
    for token in runs[0].token_ids:
        suppressed = spec.suppressed.to(logits.device)
        assert token in torch.topk(logits.masked_fill(suppressed, float("-inf")), 3).indices.tolist()
        logits = loaded.model.forward(plain_state, torch.tensor([token]))[-1]


# -- z-lab checkpoint conversion ------------------------------------------------------------------


def test_zlab_checkpoint_converts_and_drafts_like_a_from_scratch_reference(tmp_path, loaded):
    from safetensors.torch import save_file

    hidden, heads, kv_heads, head_dim, ffn, layers = 256, 4, 2, 64, 384, 2
    generator = torch.Generator().manual_seed(5)
    weights = {"fc.weight": torch.randn(hidden, 3 * hidden, generator=generator) * 0.02,
               "hidden_norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
               "norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
                            "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                            "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}.items():
            weights[p + name + ".weight"] = torch.randn(*shape, generator=generator) * 0.05
        for name, size in {"input_layernorm": hidden, "post_attention_layernorm": hidden,
                           "self_attn.q_norm": head_dim, "self_attn.k_norm": head_dim}.items():
            weights[p + name + ".weight"] = 1 + 0.1 * torch.randn(size, generator=generator)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
              "num_hidden_layers": layers, "intermediate_size": ffn, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "block_size": 8, "vocab_size": 248320, "dflash_config": {"target_layer_ids": [1, 3, 6]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # Through `lucebox convert`, which picks the DFlash converter by the config's architectures.
    out = tmp_path / "draft.gguf"
    result = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "convert", str(tmp_path), "-o", str(out),
                             "--type", "f32"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert GGUFFile(out).architecture == "dflash-draft"
    model = loaded.model
    drafter = dflash.load(out, model)
    assert drafter.config.target_layer_ids == (1, 3, 6) and drafter.block_size == 8
    assert drafter.mask_token_id == 248070  # no override in the checkpoint: the target's

    state = model.new_state(64)
    drafter.prepare_target(model, state, 64)
    model.forward(state, torch.tensor([11, 12, 13, 14, 15, 16, 17]))
    draft_state = drafter.new_state()
    got = drafter.draft(model, state, draft_state, [42])

    # From scratch, z-lab style: no cache, the whole context projected and attended in one pass, in fp32 on the CPU
    # (a model loaded on a GPU computes in 16 bits: this tolerance is the fp32 path's).
    if got.device.type != "cpu":
        pytest.skip("the from-scratch reference holds the fp32 CPU path to 2e-3; this model runs on a GPU")
    w = {k.removeprefix("model."): v for k, v in weights.items()}
    rms = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    ctx = rms(model.read_features(state, 0, 7) @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = model.embed(torch.tensor([42] + [248070] * 7))
    pos = torch.arange(15).float()
    inv = 1e6 ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    ang = pos[:, None] * inv

    def rope(t):
        a, b = t[..., : head_dim // 2], t[..., head_dim // 2 :]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    for i in range(layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(8, heads, head_dim), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(15, kv_heads, head_dim), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(15, kv_heads, head_dim)
        q, k = rope(torch.cat([torch.zeros(7, heads, head_dim), q]))[7:], rope(k)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(8, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    expected = model.output_logits(rms(x, w["norm.weight"])[1:])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("graphs", ["stand-in", "cuda"])
def test_recorded_context_sync_projects_as_the_eager_one(tiny_target_and_draft, monkeypatch, graphs):
    """`LUCEBOX_RECORDED_DRAFT_SYNC=1`, on emulated graphs (`test_static_step.GraphStandIn`: a replay re-runs the step
    over its static buffers only) and on CUDA graphs: the drafter's context rows and its draft logits equal the eager
    sync's to the bit, step after step, as new counts are recorded (20 after the prompt, then 3) and replayed from
    other starts."""
    from lucebox_core.loading import load_model
    from lucebox_core.speculative.dflash import RECORDED_SYNC_SWITCH
    from lucebox_qwen35.loader import load
    from test_static_step import GraphStandIn

    if graphs == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target, draft = tiny_target_and_draft
    if graphs == "cuda":
        model = load_model(target, backend="cuda", device="cuda").model
    else:
        model = load(target, GraphStandIn(kernel_table_for={}))
    drafter = dflash.load(draft, model)
    device = model.ops.device
    gen = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, model.vocab_size, (20,), generator=gen).to(device)
    accepted = [torch.randint(0, model.vocab_size, (3,), generator=gen).to(device) for _ in range(4)]
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(RECORDED_SYNC_SWITCH, switch)
        target_state, state = model.new_state(96), drafter.new_state()
        drafter.prepare_target(model, target_state, 96)
        model.forward(target_state, prompt)
        logits = []
        for tokens in accepted:
            logits.append(drafter.draft(model, target_state, state, [int(tokens[0])]).clone())
            model.forward(target_state, tokens)
        logits.append(drafter.draft(model, target_state, state, [5]).clone())
        runs[switch] = (state, logits)
    (eager, eager_logits), (recorded, recorded_logits) = runs["0"], runs["1"]
    assert recorded.length == eager.length == len(prompt) + 3 * len(accepted)

    def syncs(state) -> list[int]:
        return sorted(key[1] for key, _ in state.step._recorded if isinstance(key, tuple) and key[0] == "sync")

    assert syncs(recorded) == [3, 20] and syncs(eager) == []
    assert torch.equal(recorded.positions, eager.positions)
    for mine, theirs in zip(recorded.keys + recorded.values, eager.keys + eager.values):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(recorded_logits, eager_logits):
        assert torch.equal(mine, theirs)
