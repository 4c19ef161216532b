"""KVFlash (`--kvflash N|auto`): a bounded pool of KV slots per attention layer, 64-token chunks paged to host
memory and back.

What is proved here, on the tiny synthetic qwen35 (real GGUF, real tokenizer) and on the cache alone:
- a pool at least as large as the context is `full`, bit for bit: prefill, the static decode step, and
  speculative chain verification with a DFlash drafter;
- a chunk paged out and recalled comes back with identical bytes, for plain and block-quantized types;
- a prompt longer than the pool prefills (in passes the pool can take) and decodes, the device bytes staying
  the pool's while chunks go to host memory;
- a speculative verify over an overflowing pool, static or dynamic, then rolled back to the accepted path,
  leaves the cache that plain decoding of that path leaves;
- the flags' errors, and `/props` and `/metrics` of a real server.
"""

from __future__ import annotations

import re

import attrs
import httpx
import pytest
import torch

from conftest import loaded_service
from lucebox_core.assembly import EngineOptions, build_engine, check_options
from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import LuceboxError
from lucebox_core.kv import FullKVCache, KVLayerShape
from lucebox_core.kvflash import CHUNK, KVFlashCache, KVFlashPolicy
from lucebox_core.loading import load_model
from lucebox_core.plugins import registry
from lucebox_core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _policy(pool, policy="lru", tau=64):
    return attrs.evolve(registry().kv_policy("kvflash"), factory=KVFlashPolicy(pool, policy, tau))


@pytest.fixture(scope="module")
def target(tiny_target_and_draft):
    return tiny_target_and_draft[0]


@pytest.fixture(scope="module")
def full(target):
    return load_model(target)


@pytest.fixture(scope="module")
def pooled(target):
    """The same model under a 256-token pool (4 chunks), lru."""
    return load_model(target, kv_policy=_policy(256))


def _prompt(model, n, seed=0):
    return torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


# -- a pool as large as the context is `full` -------------------------------------------------------------


@pytest.mark.slow
def test_a_pool_at_least_the_context_is_bit_identical_to_full(target, full):
    wide = load_model(target, kv_policy=_policy("auto", "qk")).model  # auto: 4096, capped at the context
    model = full.model
    prompt = _prompt(model, 150)
    states = [model.new_state(256), wide.new_state(256)]
    assert isinstance(states[1].kv, KVFlashCache) and states[1].kv.pool_tokens == 256
    outputs = []
    for m, state in zip((model, wide), states):
        logits = [m.forward(state, prompt[:100], last_only=True), m.forward(state, prompt[100:])]
        token = int(logits[-1][-1].argmax())
        for _ in range(6):  # the static decode step (what a CUDA graph records), masked at the mapped slot
            logits.append(m.decode_step(state, token, graphs=False))
            token = int(logits[-1][-1].argmax())
        outputs.append(logits)
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    assert states[1].kv.info()["pages_out"] == 0


@pytest.mark.slow
def test_speculative_chain_verify_over_a_pool_as_large_as_the_context_equals_full(tiny_target_and_draft, full):
    from lucebox_core.speculative import SpeculativeDecoder, dflash

    target, draft = tiny_target_and_draft
    wide = load_model(target, kv_policy=_policy(512))
    prompt = [9000, 17, 42, 5, 6, 7]
    reference = Engine(full.model, full.tokenizer, ctx_size=256).generate(
        GenerationRequest(prompt_ids=prompt, max_tokens=8, sampling=GREEDY, ignore_eos=True)).token_ids
    results = []
    for loaded in (full, wide):
        decoder = SpeculativeDecoder(loaded.model, dflash.load(draft, loaded.model), spec_type="chain", block_size=4)
        engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=decoder)
        for accept, n in ((0, 3), (2, 8)):  # nothing accepted (every verify rolled back), and blocks of 3
            results.append(engine.generate(GenerationRequest(
                prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True, force_accept=accept,
                force_reference=reference)).token_ids)
    assert results[0] == results[2] == reference[:3] and results[1] == results[3] == reference


# -- paging -----------------------------------------------------------------------------------------------

LAYERS = {0: KVLayerShape(2, 128, 128), 5: KVLayerShape(2, 128, 128)}  # 128: a TQ3_0 rotation group


def _fill(cache, chunks, seed=0, loud=None):
    """Append `chunks` chunks of random rows to every layer; chunk `loud`'s keys point along +x."""
    gen = torch.Generator().manual_seed(seed)
    for chunk in range(chunks):
        cache.ensure_room(CHUNK)
        for layer, shape in LAYERS.items():
            k = torch.randn(CHUNK, shape.kv_heads, shape.k_head_dim, generator=gen)
            v = torch.randn(CHUNK, shape.kv_heads, shape.v_head_dim, generator=gen)
            if chunk == loud:
                k[..., 0] += 8.0
            cache.append(layer, k, v)


def _chunk_rows(cache, chunk):
    """The stored K and V rows of `chunk` in every layer, as the pool holds them now (copies)."""
    slot = cache.resident_positions().index(chunk * CHUNK)
    rows = {}
    for layer in LAYERS:
        keys, values = cache.gather(layer, cache.pool_tokens)
        rows[layer] = (keys[slot:slot + CHUNK].clone(), values[slot:slot + CHUNK].clone())
    return rows


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q4_0"), ("tq3_0", "q8_0")])
def test_a_chunk_paged_out_and_back_has_identical_bytes(types):
    cache = KVFlashCache(LAYERS, 1024, k_type=types[0], v_type=types[1], pool=256, policy="qk", tau=1)
    _fill(cache, 2, loud=1)
    before = _chunk_rows(cache, 1)
    _fill(cache, 3, seed=1)  # 5 chunks through a pool of 4: the scorer has seen no query, chunk 1 goes first
    assert 64 not in cache.resident_positions()
    assert cache.info()["host_chunks"] == 1 and cache.info()["pages_out"] == 1
    for layer, shape in LAYERS.items():  # a query along +x: chunk 1's mean key scores highest
        query = torch.zeros(1, 1, 2 * shape.kv_heads, shape.k_head_dim)
        query[..., 0] = 1.0
        cache.observe_query(layer, query)
    _fill(cache, 1, seed=2)  # the next chunk's plan reselects: chunk 1 comes back, another goes out
    assert 64 in cache.resident_positions() and cache.info()["pages_in"] == 1
    after = _chunk_rows(cache, 1)
    for layer in LAYERS:
        for old, new in zip(before[layer], after[layer]):
            assert old.dtype == new.dtype and torch.equal(old, new)
    assert cache.info()["bytes_in"] == sum(t.numel() * t.element_size() for pair in after.values() for t in pair)


def test_the_sink_and_trailing_chunks_stay_and_the_pool_does_not_grow():
    cache = KVFlashCache(LAYERS, 4096, k_type="f16", v_type="f16", pool=256)
    device_bytes = cache.nbytes
    _fill(cache, 12)
    held = cache.resident_positions()
    assert held[:CHUNK] == list(range(CHUNK))  # the sink
    assert set(range(10 * CHUNK, 12 * CHUNK)) <= set(held)  # the trailing chunk and the last one written
    assert len(held) == cache.pool_tokens and cache.nbytes == device_bytes
    assert cache.info()["host_chunks"] == 12 - 4 and cache.host_bytes == 8 * CHUNK * 2 * (2 * 128 * 2) * 2


def test_a_pass_larger_than_the_pool_allows_is_refused_before_anything_moves():
    cache = KVFlashCache(LAYERS, 4096, pool=256)
    _fill(cache, 5)
    with pytest.raises(LuceboxError, match=r"does not fit a pool of 256.*at most 64 tokens a pass"):
        cache.ensure_room(200)
    assert cache.length == 5 * CHUNK


# -- long prompts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_a_prompt_longer_than_the_pool_prefills_with_live_eviction(target, policy):
    assembled = build_engine(EngineOptions(model=str(target), ctx_size=1024, kvflash="320", kvflash_policy=policy))
    engine = assembled.engine
    assert engine.prefill_chunk == 128  # what the pool takes a pass: 5 chunks less the sink, trailing and one
    prompt = _prompt(assembled.loaded.model, 400, seed=3).tolist()
    sequence = engine.new_sequence()
    device_bytes = sequence.state.kv.nbytes
    result = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=6, sampling=GREEDY, ignore_eos=True),
                             sequence)
    kv = sequence.state.kv
    assert len(result.token_ids) == 6 and kv.length == 405  # the last token generated is not fed yet
    assert kv.nbytes == device_bytes == 2 * 320 * 1 * 256 * 4 * 2  # 2 layers, K and V, 1 head of 256 f32
    info = kv.info()
    assert info["resident_chunks"] == 5 and info["host_chunks"] == 2 and info["pages_out"] >= 2
    assert len(kv.resident_positions()) == 5 * CHUNK - (7 * CHUNK - 405)


# -- speculative verification over an overflowing pool ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("start", [300, 318])  # nodes inside one chunk; nodes crossing into a new chunk
def test_rollback_across_a_verify_over_a_small_pool(pooled, start):
    model = pooled.model
    prompt, tokens = _prompt(model, start, seed=4), _prompt(model, 5, seed=5)
    parents, path = [-1, 0, 1, 2, 3], [0, 1, 2]
    plain, dynamic, static = (model.new_state(1024) for _ in range(3))
    for state in (plain, dynamic, static):
        for begin in range(0, start, 64):
            model.forward(state, prompt[begin:begin + 64], last_only=True)
    v_dynamic = model.verify(dynamic, tokens, parents, static=False)
    v_static = model.verify(static, tokens, parents, static=True, graphs=False)
    torch.testing.assert_close(v_static.logits, v_dynamic.logits, atol=1e-5, rtol=1e-5)
    model.commit(dynamic, v_dynamic, path)
    model.commit(static, v_static, path)
    # Plain decoding of the accepted tokens, with the room the verify pass made: the same residency.
    plain.kv.ensure_room(len(parents))
    model.forward(plain, tokens[path])
    assert static.length == dynamic.length == plain.length == start + 3
    assert static.kv.resident_positions() == dynamic.kv.resident_positions() == plain.kv.resident_positions()
    token = torch.tensor([int(tokens[4])])
    for _ in range(3):
        expected = model.forward(plain, token)
        for state in (dynamic, static):
            torch.testing.assert_close(model.forward(state, token), expected, atol=1e-5, rtol=1e-5)
        token = expected[-1:].argmax(-1)


@pytest.mark.slow
def test_speculative_chain_decoding_over_an_overflowing_pool_equals_plain_decoding_over_it(tiny_target_and_draft,
                                                                                         pooled):
    """A 300-token prompt through a 256-token pool, then generation that stays inside chunk 4 (no eviction
    while decoding): the chain verify's nodes, masked at their pool slots, give plain decoding's tokens."""
    from lucebox_core.speculative import SpeculativeDecoder, dflash

    model = pooled.model
    prompt = _prompt(model, 300, seed=6).tolist()
    plain = Engine(model, pooled.tokenizer, ctx_size=1024, prefill_chunk=64)
    reference = plain.generate(GenerationRequest(prompt_ids=prompt, max_tokens=8, sampling=GREEDY,
                                                 ignore_eos=True)).token_ids
    decoder = SpeculativeDecoder(model, dflash.load(tiny_target_and_draft[1], model), spec_type="chain", block_size=4)
    speculative = Engine(model, pooled.tokenizer, ctx_size=1024, prefill_chunk=64, speculative=decoder)
    sequence = speculative.new_sequence()
    result = speculative.generate(GenerationRequest(prompt_ids=prompt, max_tokens=8, sampling=GREEDY,
                                                    ignore_eos=True, force_accept=2, force_reference=reference),
                                  sequence)
    assert result.token_ids == reference
    assert sequence.state.kv.info()["host_chunks"] == 1 and len(sequence.state.kv.resident_positions()) < 300


# -- flags, /props and /metrics --------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"kvflash": "100"}, r"--kvflash 100: the pool must hold at least 256 tokens"),
    ({"kvflash": "lots"}, r"--kvflash: expected a pool size in tokens or 'auto', got 'lots'"),
    ({"kvflash": "auto", "kvflash_policy": "drafter"}, r"drafter needs a scorer model: pass --kvflash-scorer FILE"),
    ({"kvflash": "auto", "kvflash_policy": "drafter", "kvflash_scorer": "/nowhere.gguf"},
     r"/nowhere.gguf: no such file \(--kvflash-scorer\)"),
    ({"kvflash": "auto", "kvflash_policy": "qk", "kvflash_scorer": __file__}, r"--kvflash-scorer scores chunks for "
                                                                             r"--kvflash-policy drafter, not qk"),
    ({"kvflash": "auto", "kvflash_policy": "mru"}, r"unknown policy 'mru'; choose one of lru, qk, drafter"),
    ({"kvflash": "auto", "kvflash_tau": 0}, r"--kvflash-tau must be at least 1"),
    ({"kvflash_policy": "qk"}, r"need --kvflash N\|auto"),
    ({"kvflash": "auto", "kv_policy": "toy"}, r"cannot go with --kv-policy toy"),
])
def test_bad_kvflash_flags_are_named(options, message):
    with pytest.raises(LuceboxError, match=message):
        check_options(EngineOptions(**options))


def test_kvflash_flags_parse_on_every_command():
    from lucebox_core.cli import build_parser

    for command in (["generate", "-p", "hi"], ["bench"], ["serve"]):
        args = build_parser().parse_args([*command, "--kvflash", "auto", "--kvflash-policy", "qk", "--kvflash-tau", "32"])
        options = EngineOptions.from_args(args)
        assert (options.kvflash, options.kvflash_policy, options.kvflash_tau) == ("auto", "qk", 32)
        assert check_options(options).kv_policy.factory.describe()["policy"] == "qk"


def test_kvflash_refuses_sliding_window_layers():
    with pytest.raises(LuceboxError, match="layer 2 is a sliding-window layer"):
        KVFlashCache({2: KVLayerShape(1, 64, 64, window=128)}, 1024)


@pytest.fixture(scope="module")
def service(tmp_path_factory, target):
    yield from loaded_service(tmp_path_factory, model=str(target), ctx_size=1024, kvflash="256")


def test_props_and_metrics_show_the_pool_residency_and_traffic(service):
    from lucebox_core.server import create_app
    from lucebox_core.server.testing import ServerThread

    with ServerThread(create_app(service.config, service)) as url:
        prompt = " ".join(str(n) for n in range(160))  # longer than the pool of 256 tokens
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                           timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] > 256
        props = httpx.get(f"{url}/props").json()
        metrics = httpx.get(f"{url}/metrics").text
    assert props["runtime"]["kv_policy"] == "kvflash" and props["prefix_cache"] == {"enabled": False}
    flash = props["kvflash"]
    assert flash["enabled"] and flash["pool_tokens"] == 256 and flash["policy"] == "lru"
    assert flash["pages_out"] >= 1 and flash["host_chunks"] >= 1 and flash["bytes_out"] > 0
    assert flash["host_reserved_bytes"] >= flash["host_bytes"] > 0  # the arena's slabs hold the paged chunks

    def metric(name):
        match = re.search(rf"^lucebox_kvflash_{name} (\S+)$", metrics, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert metric("pool_tokens") == 256 and metric("pages_out") == flash["pages_out"]
    assert metric("host_chunks") == flash["host_chunks"] and metric("bytes_out") == flash["bytes_out"]


@pytest.mark.slow
def test_the_bench_script_times_full_and_kvflash_on_the_cpu(target, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "kvflash.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_kvflash.py"
    subprocess.run([sys.executable, str(script), "-m", str(target), "--depths", "270", "--pool", "256", "-n", "2",
                    "-r", "1", "--json", str(out)], check=True, capture_output=True, text=True, timeout=300)
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [row["kv"] for row in rows] == ["full", "kvflash lru pool 256", "kvflash qk pool 256"]
    assert all(row["test"] == "tg2 @ d270" and row["tokens_per_s"] > 0 for row in rows)
    assert all(row["pool_tokens"] == 256 and row["pages_out"] >= 1 for row in rows[1:])


def test_a_family_whose_attention_does_not_read_a_pool_refuses_kvflash(tmp_path):
    from lucebox_laguna import synth as laguna_synth

    path = laguna_synth.write(tmp_path / "laguna.gguf", size="tiny", type="q8_0", seed=3)
    with pytest.raises(LuceboxError, match="'kvflash' KV policy keeps a bounded resident set, which LagunaModel"):
        load_model(path, kv_policy=_policy(256))


def _lucebox(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lucebox_core.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_names_a_kvflash_policy_it_cannot_run_in_one_line(target):
    result = _lucebox("generate", "-m", str(target), "-p", "hi", "--kvflash", "auto", "--kvflash-policy", "drafter")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert "--kvflash-policy drafter needs a scorer model: pass --kvflash-scorer FILE" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_generate_with_kvflash_runs_a_prompt_longer_than_the_pool(target):
    import json

    ids = ",".join(str(100 + i) for i in range(300))
    result = _lucebox("generate", "-m", str(target), "--prompt-ids", ids, "-c", "512", "-n", "4", "--json",
                      "--ignore-eos", "--temp", "0", "--kvflash", "256", "--kvflash-policy", "qk", "--kvflash-tau", "32")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]) == 4
