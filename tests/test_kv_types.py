"""KV cache types (`-ctk` / `-ctv`): f32, f16, bf16 and GGUF Q8_0, for K and V independently (q4_0 and
tq3_0: tests/test_kv_quant.py).

Q8_0 is checked bit for bit against gguf's numpy reference (which mirrors ggml's `quantize_row_q8_0_ref`);
a tiny synthetic qwen35 model then decodes with each K/V type pair and stays within a stated tolerance of
an f32 cache, through the dynamic forward, the static (CUDA-graph) decode step and speculative
verify/commit; the CLI and the server take the flags; and the memory estimate puts Qwen3.5-27B Q4_K_M at
32K context with an f16 cache under 20 GiB.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from lucebox_core import quants as lucebox_quants
from lucebox_core.errors import LuceboxError
from lucebox_core.kv import (
    K_FLAG,
    KV_CACHE_TYPES,
    FullKVCache,
    KVLayerShape,
    dequantize_q8_0,
    kv_bytes_per_token,
    kv_cache_type,
    quantize_q8_0,
)
from lucebox_qwen35 import layout, synth
from lucebox_qwen35.memory import estimate_memory, layout_weight_bytes
from lucebox_qwen35.loader import load

STEPS = 16
# Largest |logit difference| from an f32 cache over the run, relative to the largest |logit| (measured on
# this model: f16 2e-4, bf16 1.5e-3, q8_0 5.3e-3).
TOLERANCE = {"f32": 0.0, "f16": 5e-3, "bf16": 5e-3, "q8_0": 2e-2}
# The types this module decodes a model with; q4_0 and tq3_0 (and their pair rule) are tests/test_kv_quant.py's.
PLAIN_AND_Q8 = ("f32", "f16", "bf16", "q8_0")
ALL_PAIRS = list(itertools.product(PLAIN_AND_Q8, repeat=2))


def _random_rows(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Normal values with per-row scales over four orders of magnitude, plus the edge cases of rounding."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, (*shape[:-1], 1))
    x = x.astype(np.float32)
    x.reshape(-1, 32)[0] = 0  # an all-zero block: scale 0, inverse 0
    x.reshape(-1, 32)[1] = np.arange(32) - 15.5  # halves: roundf rounds them away from zero
    x.reshape(-1, 32)[2] = -x.reshape(-1, 32)[1] * 127 / 15.5  # values that land exactly on +-127 and halves
    return x


# -- Q8_0 -----------------------------------------------------------------------------------------------


def test_q8_0_round_trip_is_bit_exact_with_gguf():
    x = _random_rows((300, 4, 256), seed=1)
    ours = quantize_q8_0(torch.from_numpy(x))
    reference = quants.quantize(x, GGMLQuantizationType.Q8_0)
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == reference.shape == (300, 4, 8 * 34)
    np.testing.assert_array_equal(ours.numpy(), reference)
    decoded = dequantize_q8_0(ours)
    np.testing.assert_array_equal(decoded.numpy(), quants.dequantize(reference, GGMLQuantizationType.Q8_0))
    # The same numbers as the weight dequantizer, and storing decoded rows again gives the same bits
    # (speculative commit re-appends the rows that verification read back).
    weights = lucebox_quants.dequantize(ours.reshape(-1), GGMLQuantizationType.Q8_0, tuple(x.shape))
    assert torch.equal(decoded, weights)
    assert torch.equal(quantize_q8_0(decoded), ours)
    assert dequantize_q8_0(ours, torch.bfloat16).dtype == torch.bfloat16


def test_each_role_is_stored_and_read_in_its_own_type():
    shapes = {3: KVLayerShape(2, 64, 32), 7: KVLayerShape(1, 32, 64)}
    cache = FullKVCache(shapes, max_context=16, dtype=torch.float32, k_type="q8_0", v_type="bf16")
    raw_k, raw_v = cache.gather(3, 16)
    assert raw_k.dtype == torch.uint8 and tuple(raw_k.shape) == (16, 2, 2 * 34)
    assert raw_v.dtype == torch.bfloat16 and tuple(raw_v.shape) == (16, 2, 32)
    k, v = torch.from_numpy(_random_rows((5, 2, 64), seed=2)), torch.from_numpy(_random_rows((5, 2, 32), seed=3))
    all_k, all_v = cache.append(3, k, v)
    assert all_k.dtype == torch.float32 and all_v.dtype == torch.bfloat16
    reference_k = quants.dequantize(quants.quantize(k.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(all_k.numpy(), reference_k)
    assert torch.equal(all_v, v.to(torch.bfloat16))
    assert [torch.equal(a, b) for a, b in zip(cache.as_stored(k, v), (all_k, all_v))] == [True, True]
    # The static step's write at a device position reads back as append does.
    cache.write(3, torch.tensor([5]), k[:1], v[:1])
    window_k, window_v = cache.gather(3, 6)
    assert torch.equal(dequantize_q8_0(window_k[5]), all_k[0]) and torch.equal(window_v[5], all_v[0])
    cache.commit(6)
    cache.rollback(2)
    assert cache.length == 2 and torch.equal(cache.read(3)[0], all_k[:2])


def test_cache_bytes_shrink_with_the_type():
    # Qwen3.5-27B's attention layers: 4 KV heads of 256.
    shape = KVLayerShape(4, 256, 256)
    per_token = {t: kv_bytes_per_token(shape, t, t) for t in KV_CACHE_TYPES}
    # q8_0: 2 x 32 blocks x 34 bytes; q4_0: x 18; tq3_0: x 14.
    assert per_token == {"f32": 8192, "f16": 4096, "bf16": 4096, "q8_0": 2176, "q4_0": 1152, "tq3_0": 896}
    assert kv_bytes_per_token(shape, "q8_0", "f16") == 1088 + 2048
    for k_type, v_type in itertools.product(KV_CACHE_TYPES, repeat=2):
        if (k_type, v_type) == ("tq3_0", "f32"):  # not a pair (test_kv_quant)
            continue
        cache = FullKVCache({3: shape, 7: shape}, max_context=10, k_type=k_type, v_type=v_type)
        expected = 2 * 10 * kv_bytes_per_token(shape, k_type, v_type)
        assert cache.nbytes == expected == 10 * cache.bytes_per_token


def test_bad_cache_types_are_errors_that_name_the_flag():
    assert kv_cache_type("Q8_0") == "q8_0" and kv_cache_type(torch.bfloat16) == "bf16"
    with pytest.raises(LuceboxError, match=r"-ctk/--cache-type-k: unknown KV cache type 'q4_1'.*q8_0, q4_0, tq3_0"):
        kv_cache_type("q4_1", K_FLAG)
    with pytest.raises(LuceboxError, match=r"-ctv/--cache-type-v.*torch.int8"):
        FullKVCache({0: KVLayerShape(1, 32, 32)}, 4, v_type=torch.int8)
    with pytest.raises(LuceboxError, match=r"-ctk/--cache-type-k q8_0.*layer 0's K head dim is 40"):
        FullKVCache({0: KVLayerShape(1, 40, 32)}, 4, k_type="q8_0")


# -- a tiny model decoding with each pair ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("kv") / "tiny-f32.gguf", size="tiny", type="f32", seed=17)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 248320, (9,), generator=torch.Generator().manual_seed(4))


def _decode(model, prompt, tokens=None):
    """Logits of the prompt's last position and of `STEPS` one-token steps (greedy unless `tokens` are
    given: then those are fed, so every cache type sees the same inputs)."""
    state = model.new_state(64)
    logits, fed = [model.forward(state, prompt)[-1]], []
    for step in range(STEPS):
        token = int(logits[-1].argmax()) if tokens is None else tokens[step]
        fed.append(token)
        logits.append(model.forward(state, torch.tensor([token]))[0])
    return torch.stack(logits), fed


@pytest.fixture(scope="module")
def f32_run(tiny_path, prompt):
    return _decode(load(tiny_path, cache_type_k="f32", cache_type_v="f32"), prompt)


@pytest.mark.parametrize(("k_type", "v_type"), ALL_PAIRS)
def test_each_pair_decodes_within_tolerance_of_f32(tiny_path, prompt, f32_run, k_type, v_type):
    reference, greedy_tokens = f32_run
    model = load(tiny_path, cache_type_k=k_type, cache_type_v=v_type)
    state = model.new_state(8)
    assert (state.kv.k_type, state.kv.v_type) == (k_type, v_type)
    ours, _ = _decode(model, prompt, greedy_tokens)
    error = float((ours - reference).abs().max() / reference.abs().max())
    assert error <= max(TOLERANCE[k_type], TOLERANCE[v_type]) + 1e-6, error
    # Greedy picks agree wherever the f32 run's top two are not within the tolerance of each other.
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error * float(reference.abs().max())
    assert torch.equal(ours.argmax(-1)[clear], reference.argmax(-1)[clear])


def test_default_cache_type_is_the_backend_dtype(tiny_path):
    model = load(tiny_path)
    assert (model.cache_type_k, model.cache_type_v) == ("f32", "f32")
    assert load(tiny_path, kv_dtype=torch.float16).new_state(4).kv.k_type == "f16"
    with pytest.raises(LuceboxError, match=r"-ctv/--cache-type-v: unknown KV cache type 'q4'"):
        load(tiny_path, cache_type_v="q4")


@pytest.fixture(scope="module")
def q8_model(tiny_path):
    return load(tiny_path, cache_type_k="q8_0", cache_type_v="q8_0")


def test_static_decode_step_with_a_q8_0_cache(q8_model, prompt):
    model = q8_model
    model.decode_min_window = 8  # the window grows during the run: 8, 10, 12, 14, 16
    try:
        dynamic, static = model.new_state(64), model.new_state(64)
        dynamic_logits = model.forward(dynamic, prompt)[-1:]
        static_logits = model.forward(static, prompt)[-1:]
        # The two paths differ by float noise (~1e-6: RoPE of a device position, another attention kernel);
        # where that noise straddles a rounding boundary, Q8_0 stores the neighbouring code, one quantum
        # (max|block| / 127) away. So: logits within 5e-4 (f32 caches agree to 1e-6; one flipped code here
        # moves them ~1e-4), decoded K/V within one quantum, and nearly every byte identical.
        for _ in range(6):
            torch.testing.assert_close(static_logits, dynamic_logits, atol=5e-4, rtol=1e-4)
            token = int(dynamic_logits[-1].argmax())
            dynamic_logits = model.forward(dynamic, torch.tensor([token]))
            static_logits = model.decode_step(static, token, graphs=False)
        for layer in dynamic.kv.shapes:
            for ours, theirs in zip(static.kv.gather(layer, 15), dynamic.kv.gather(layer, 15)):
                assert (ours != theirs).float().mean() < 1e-3
                a, b = dequantize_q8_0(ours), dequantize_q8_0(theirs)
                quantum = b.reshape(*b.shape[:-1], -1, 32).abs().amax(-1) / 127
                assert ((a - b).reshape(quantum.shape + (32,)).abs() <= quantum[..., None] * 1.01).all()
    finally:
        model.decode_min_window = 256


def test_speculative_verify_and_commit_with_a_q8_0_cache(q8_model, prompt):
    """Verification gives the nodes their K/V as the Q8_0 cache will read them back, so the accepted path's
    logits equal plain decoding, and the committed rows are the same bytes."""
    model = q8_model
    tree_state, plain_state = model.new_state(64), model.new_state(64)
    for state in (tree_state, plain_state):
        model.forward(state, prompt)
    tokens, parents, path = [100, 21, 11, 22, 12, 13], [-1, 0, 0, 1, 2, 4], [0, 2, 4, 5]
    verification = model.verify(tree_state, tokens, parents)
    model.commit(tree_state, verification, path)
    plain = torch.stack([model.forward(plain_state, torch.tensor([tokens[i]]))[0] for i in path])
    torch.testing.assert_close(verification.logits[path], plain, atol=2e-4, rtol=1e-4)
    assert tree_state.length == plain_state.length == len(prompt) + len(path)
    end = tree_state.length
    for layer in tree_state.kv.shapes:
        for a, b in zip(tree_state.kv.gather(layer, end), plain_state.kv.gather(layer, end)):
            assert torch.equal(a, b)
    torch.testing.assert_close(model.decode_step(tree_state, 7, graphs=False),
                               model.forward(plain_state, torch.tensor([7])), atol=2e-4, rtol=1e-4)


# -- the flags ------------------------------------------------------------------------------------------


def _lucebox(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lucebox_core.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_takes_the_cache_type_flags(tiny_path):
    base = ["generate", "-m", str(tiny_path), "--prompt-ids", "1,2,3,4", "-n", "4", "--temp", "0", "--json",
            "--ignore-eos", "-c", "64"]
    result = _lucebox(*base, "-ctk", "q8_0", "-ctv", "q8_0")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]) == 4
    bad = _lucebox(*base, "--cache-type-v", "q5_1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: -ctv/--cache-type-v: unknown KV cache type 'q5_1'; choose one of f32, f16, bf16, q8_0, q4_0, tq3_0"
    ]


def test_serve_config_reaches_the_model(tiny_path):
    from lucebox_core.server.service import ModelService, ServeConfig

    service = ModelService(ServeConfig(model=str(tiny_path), ctx_size=32, cache_type_k="q8_0", cache_type_v="bf16"))
    service.load()
    try:
        assert service.status == "ok", service.error
        assert (service.loaded.model.cache_type_k, service.loaded.model.cache_type_v) == ("q8_0", "bf16")
    finally:
        service.close()


# -- memory ---------------------------------------------------------------------------------------------


def test_loaded_model_estimate_counts_every_weight(tiny_path):
    model = load(tiny_path, cache_type_k="q8_0", cache_type_v="f16")
    estimate = model.estimate_memory(1000)
    config = layout.size("tiny")
    # An f32 file loads as f32 tensors of the same bytes.
    assert estimate.weights == layout_weight_bytes(config, "f32")
    assert estimate.kv == 1000 * model.new_state(1000).kv.bytes_per_token == 2 * 1000 * (272 + 512)


def test_qwen35_27b_q4_k_m_at_32k_fits_in_20_gib():
    config = layout.size("27b")
    weights = layout_weight_bytes(config, "q4_k_m")
    f16 = estimate_memory(config, 32768, weight_bytes=weights, cache_type_k="f16", cache_type_v="f16")
    # 16 attention layers x 32768 positions x (K + V: 4 heads x 256 x 2 bytes each) = 2 GiB exactly.
    assert f16.kv == 2 * 2**30
    # 48 Gated DeltaNet layers, each 48 fp32 states of 128 x 128 plus a bf16 conv tail of 3 x 10240.
    assert f16.deltanet == 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2)
    assert 15 * 2**30 < weights < 16 * 2**30  # the real file is 16.7 GB
    assert f16.total <= 20 * 2**30, str(f16)  # about 17.55 GiB
    q8 = estimate_memory(config, 32768, weight_bytes=weights, cache_type_k="q8_0", cache_type_v="q8_0")
    assert q8.kv == f16.kv * 17 // 32 and q8.total < f16.total
