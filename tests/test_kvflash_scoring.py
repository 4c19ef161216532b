"""KVFlash's scoring policies (issue #15): `qk` chosen on the device, and `drafter` (PFlash's scorer model).

What is proved here:
- `qk`'s device-side choice (pooled keys per closed chunk, `torch.topk`, one copy of the ids) keeps exactly the
  chunks a plain reference ranking keeps (mean keys from the rows written, each layer's query against them,
  sorted on the host), reselection after reselection, with chunks coming back from host memory;
- a `qk` reselection over thousands of paged-out chunks iterates none of them on the host;
- `drafter` keeps exactly the top chunks of an independent computation of the scorer's chunk scores (the
  scorer's attention probabilities computed here by hand, mapped to the target's tokens by walking their bytes,
  averaged per chunk in Python), through two different vocabularies (a qwen35 target, a qwen3 scorer);
- with a pool as large as the context, `drafter` generates exactly what `full` does and never loads its scorer;
- over a small pool, through a real server, `/props` and `/metrics` report the scorer's cost per rescoring;
- without a scorer the flag is refused before anything loads, naming the flag to pass.
"""

from __future__ import annotations

import math
import re

import httpx
import pytest
import torch

from conftest import CountingDict, loaded_service
from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.engine import GenerationRequest
from lucebox_core.kv import KVLayerShape
from lucebox_core.kvflash import CHUNK, KVFlashCache
from lucebox_core.kvflash_policy import DrafterScorer
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
LAYERS = {0: KVLayerShape(2, 32, 32), 3: KVLayerShape(2, 32, 32)}  # 2 KV heads, 4 query heads (GQA 2)
QUERY_HEADS = 4



def _append(cache, tokens, gen, truth=None):
    length = cache.length
    cache.ensure_room(tokens)
    for layer, shape in LAYERS.items():
        k = torch.randn(tokens, shape.kv_heads, shape.k_head_dim, generator=gen)
        v = torch.randn(tokens, shape.kv_heads, shape.v_head_dim, generator=gen)
        if truth is not None:
            truth[layer][length:length + tokens] = k
        cache.append(layer, k, v)


def _resident_chunks(cache):
    return sorted({p // CHUNK for p in cache.resident_positions()})


# -- qk on the device ------------------------------------------------------------------------------------


def _reference_qk(truth, queries, length, tokens, pool_chunks):
    """The chunks a reselection at `length` for a pass of `tokens` keeps, ranked plainly: every complete chunk's mean key (from the
    rows written), each layer's query head against its KV head, summed, sorted on the host (float64)."""
    first = length // CHUNK
    protected = {0, first - 1}
    scores = {}
    for chunk in range(first):
        if chunk in protected:
            continue
        total = 0.0
        for layer, shape in LAYERS.items():
            mean = truth[layer][chunk * CHUNK:(chunk + 1) * CHUNK].double().mean(0)  # [H, D]
            query = queries[layer].double()  # [Hq, D]
            group = QUERY_HEADS // shape.kv_heads
            for head in range(QUERY_HEADS):
                total += float(query[head] @ mean[head // group])
        scores[chunk] = total
    tail = set(range(first, (length + tokens - 1) // CHUNK + 1))
    room = pool_chunks - len(tail) - len(protected)
    ranked = sorted(scores, key=lambda c: -scores[c])
    margin = scores[ranked[room - 1]] - scores[ranked[room]] if len(ranked) > room else math.inf
    return sorted(protected | set(ranked[:room]) | tail), margin


def test_qk_on_the_device_keeps_what_a_plain_reference_ranking_keeps():
    context = 48 * CHUNK
    cache = KVFlashCache(LAYERS, context, pool=8 * CHUNK, policy="qk", tau=1)
    gen = torch.Generator().manual_seed(11)
    truth = {layer: torch.zeros(context, s.kv_heads, s.k_head_dim) for layer, s in LAYERS.items()}
    for _ in range(30):
        _append(cache, CHUNK, gen, truth)
    checked = 0
    for step in range(12):
        queries = {layer: torch.randn(QUERY_HEADS, s.k_head_dim, generator=gen) for layer, s in LAYERS.items()}
        for layer, query in queries.items():
            cache.observe_query(layer, query[None, None])
        length, tokens = cache.length, 1 + step * 5
        _append(cache, tokens, gen, truth)  # tau 1: this plan reselects over every chunk
        expected, margin = _reference_qk(truth, queries, length, tokens, cache.pool_chunks)
        assert margin > 1e-6  # no near-tie at the cut: the choice is determined
        assert _resident_chunks(cache) == expected
        checked += 1
    assert checked == 12 and cache.info()["pages_in"] > 0 and cache.info()["reselections"] >= 12


def test_a_qk_reselection_over_thousands_of_paged_chunks_iterates_none_of_them():
    cache = KVFlashCache(LAYERS, 2100 * CHUNK, pool=4 * CHUNK, policy="qk", tau=32)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2000):
        _append(cache, CHUNK, gen)
    for layer, shape in LAYERS.items():
        cache.observe_query(layer, torch.randn(1, 1, QUERY_HEADS, shape.k_head_dim, generator=gen))
    assert cache.info()["host_chunks"] == 2000 - 4
    cache._host = CountingDict(cache._host)
    before = cache.info()["reselections"]
    for _ in range(3 * 32):  # three reselections, each ranking all 2000 chunks
        _append(cache, 1, gen)
    assert cache.info()["reselections"] == before + 3
    assert cache._host.visited == 0


# -- drafter --------------------------------------------------------------------------------------------

TEXT = ("The lighthouse keeper counted ships every night. Harbour records list cargo, weather and tides. "
        "Merchants argued about prices while fishermen mended nets by the old stone pier. ")


@pytest.fixture(scope="module")
def scorer_path(tmp_path_factory):
    from lucebox_qwen35 import synth

    return str(synth.write_qwen3(tmp_path_factory.mktemp("kvflash-scorer") / "scorer.gguf", size="tiny",
                                 type="f32", seed=13))


@pytest.fixture(scope="module")
def target(tiny_target_and_draft):
    return tiny_target_and_draft[0]


@pytest.fixture(scope="module")
def target_tokenizer(target):
    return load_model(target).tokenizer


def _text_ids(tokenizer, count):
    ids = []
    while len(ids) < count:
        ids += tokenizer.encode(TEXT, add_bos=False)
    return ids[:count]


def _independent_chunk_scores(scorer, target_tokenizer, ids):
    """The drafter's chunk scores over target tokens `ids`, computed here: the scorer's tail queries against
    its keys by hand (softmax per head, the max over heads and layers, the mean over the queries, a centred
    pool of 13), each target token given the score of the scorer token holding its first byte (walking the
    bytes), then each 64-token chunk's mean."""
    model, tokenizer = scorer.model, scorer.tokenizer
    text = target_tokenizer.decode(ids)
    scorer_ids = tokenizer.encode(text, add_bos=False)
    queries, keys = model.tail_attention(torch.tensor(scorer_ids), 8)
    length = len(scorer_ids)
    best = torch.zeros(8, length, dtype=torch.float64)
    for q, k in zip(queries, keys):
        group = q.shape[0] // k.shape[0]
        for head in range(q.shape[0]):
            logits = (q[head].double() @ k[head // group].double().T) / math.sqrt(q.shape[-1])
            for row in range(8):
                logits[row, length - 8 + row + 1:] = -math.inf
            best = torch.maximum(best, torch.softmax(logits, dim=-1))
    mean = best.mean(0).tolist()
    pooled = [sum(mean[max(0, i - 6):i + 7]) / len(mean[max(0, i - 6):i + 7]) for i in range(length)]
    ends, at = [], 0
    for token in scorer_ids:
        at += len(tokenizer.token_bytes(token))
        ends.append(at)
    per_target, at = [], 0
    for token in ids:
        owner = next((i for i, end in enumerate(ends) if end > at), length - 1)
        per_target.append(pooled[owner])
        at += len(target_tokenizer.token_bytes(token))
    return [sum(per_target[c * CHUNK:(c + 1) * CHUNK]) / len(per_target[c * CHUNK:(c + 1) * CHUNK])
            for c in range(-(-len(ids) // CHUNK))]


def test_drafter_keeps_exactly_the_top_chunks_of_an_independent_computation(scorer_path, target_tokenizer):
    ids = _text_ids(target_tokenizer, 14 * CHUNK)
    scorer = DrafterScorer(scorer_path, load_model)
    pool_chunks = 6
    cache = KVFlashCache(LAYERS, 16 * CHUNK, pool=pool_chunks * CHUNK, policy="drafter", tau=CHUNK, scorer=scorer)
    cache.bind_tokens(lambda: ids, target_tokenizer)
    assert not scorer.loaded
    gen = torch.Generator().manual_seed(2)
    for _ in range(13):
        _append(cache, CHUNK, gen)
    _append(cache, 5, gen)
    assert scorer.loaded and scorer.cost.rescores >= 1
    length = cache._scored_at  # the last rescoring, at the plan of the last pass (nothing left since)
    assert length == 13 * CHUNK and cache.length == length + 5
    chunk_scores = _independent_chunk_scores(scorer, target_tokenizer, ids[:length])
    first = length // CHUNK
    protected = {0, first - 1}
    ranked = sorted((c for c in range(first) if c not in protected), key=lambda c: -chunk_scores[c])
    room = pool_chunks - 1 - len(protected)
    assert chunk_scores[ranked[room - 1]] - chunk_scores[ranked[room]] > 1e-7  # the cut is not a near-tie
    assert _resident_chunks(cache) == sorted(protected | set(ranked[:room]) | {first})
    info = cache.info()
    assert info["scorer_rescores"] == scorer.cost.rescores and info["scorer_last_tokens"] == length
    assert info["scorer_seconds"] >= info["scorer_last_seconds"] > 0


def test_drafter_rescoring_interval_grows_with_the_history(scorer_path, target_tokenizer):
    """Every max(tau, history / 45) tokens: at tau 1, past 512 tokens a rescoring waits 11 tokens (qk's rule,
    every tau, would rescore at every one)."""
    ids = _text_ids(target_tokenizer, 10 * CHUNK)
    scorer = DrafterScorer(scorer_path, load_model)
    cache = KVFlashCache(LAYERS, 10 * CHUNK, pool=4 * CHUNK, policy="drafter", tau=1, scorer=scorer)
    cache.bind_tokens(lambda: ids, target_tokenizer)
    gen = torch.Generator().manual_seed(4)
    for _ in range(8):
        _append(cache, CHUNK, gen)
    _append(cache, 1, gen)  # at 512, a chunk boundary: rescored
    rescored = scorer.cost.rescores
    assert cache._scored_at == 8 * CHUNK
    due = next(n for n in range(513, 640) if n - 512 >= n // 45)
    assert due == 523
    while cache.length < due:  # plans at 513 .. 522
        _append(cache, 1, gen)
    assert scorer.cost.rescores == rescored
    _append(cache, 1, gen)  # the plan at 523
    assert scorer.cost.rescores == rescored + 1 and cache._scored_at == due


@pytest.mark.slow
def test_drafter_over_a_pool_as_large_as_the_context_is_exactly_full(target, scorer_path):
    def generate(**options):
        assembled = build_engine(EngineOptions(model=str(target), ctx_size=512, **options))
        prompt = _text_ids(assembled.loaded.tokenizer, 300)
        result = assembled.engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=8, sampling=GREEDY,
                                                             ignore_eos=True))
        return result.token_ids, assembled.loaded.model.kv_policy.factory

    reference, _ = generate()
    tokens, factory = generate(kvflash="512", kvflash_policy="drafter", kvflash_scorer=scorer_path)
    assert tokens == reference
    assert factory.describe()["pages_out"] == 0 and not factory.scorer.loaded


@pytest.fixture(scope="module")
def service(tmp_path_factory, target, scorer_path):
    yield from loaded_service(tmp_path_factory, model=str(target), ctx_size=1024, kvflash="256",
                              kvflash_policy="drafter", kvflash_scorer=scorer_path)


def test_props_and_metrics_report_the_drafter_scorer_cost(service):
    from lucebox_core.server import create_app
    from lucebox_core.server.testing import ServerThread

    with ServerThread(create_app(service.config, service)) as url:
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": TEXT * 12, "max_tokens": 4, "temperature": 0},
                           timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] > 256
        props = httpx.get(f"{url}/props").json()
        metrics = httpx.get(f"{url}/metrics").text
    flash = props["kvflash"]
    assert flash["policy"] == "drafter" and flash["scorer_loaded"] and flash["scorer"].endswith("scorer.gguf")
    assert flash["scorer_rescores"] >= 1 and flash["pages_out"] >= 1 and flash["reselections"] >= 1
    assert flash["scorer_mean_seconds"] == pytest.approx(flash["scorer_seconds"] / flash["scorer_rescores"])

    def metric(name):
        match = re.search(rf"^lucebox_kvflash_{name} (\S+)$", metrics, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert metric("scorer_rescores") == flash["scorer_rescores"]
    assert metric("scorer_seconds") == pytest.approx(flash["scorer_seconds"]) and metric("scorer_seconds") > 0
    assert metric("scorer_mean_seconds") > 0 and metric("reselections") == flash["reselections"]


def test_drafter_finds_the_scorer_beside_the_model_or_names_the_flag(target, scorer_path, tmp_path):
    import shutil

    from lucebox_core.assembly import check_options
    from lucebox_core.errors import LuceboxError

    with pytest.raises(LuceboxError, match=r"drafter needs a scorer model: pass --kvflash-scorer FILE"):
        check_options(EngineOptions(model=str(target), kvflash="auto", kvflash_policy="drafter"))
    (tmp_path / "target.gguf").symlink_to(target)
    shutil.copy(scorer_path, tmp_path / "qwen3-scorer.gguf")
    beside = check_options(EngineOptions(model=str(tmp_path / "target.gguf"), kvflash="auto",
                                         kvflash_policy="drafter")).kv_policy.factory
    assert beside.scorer.path == str(tmp_path / "qwen3-scorer.gguf")
    named = check_options(EngineOptions(model=str(target), kvflash="auto", kvflash_policy="drafter",
                                        prefill_drafter=scorer_path)).kv_policy.factory
    assert named.scorer.path == scorer_path and not named.scorer.loaded


def test_the_scorer_flags_parse_on_every_command(target, scorer_path):
    from lucebox_core.assembly import check_options
    from lucebox_core.cli import build_parser

    for command in (["generate", "-p", "hi"], ["bench"], ["serve"]):
        args = build_parser().parse_args([*command, "-m", str(target), "--kvflash", "auto", "--kvflash-policy",
                                          "drafter", "--kvflash-scorer", scorer_path])
        options = EngineOptions.from_args(args)
        assert options.kvflash_scorer == scorer_path
        described = check_options(options).kv_policy.factory.describe()
        assert described["policy"] == "drafter" and described["scorer"] == scorer_path
        assert not described["scorer_loaded"] and described["scorer_rescores"] == 0
    for command in (["generate", "-p", "hi"], ["serve"]):  # PFlash's scorer flag is the default
        args = build_parser().parse_args([*command, "-m", str(target), "--kvflash", "auto", "--kvflash-policy",
                                          "drafter", "--prefill-drafter", scorer_path])
        assert check_options(EngineOptions.from_args(args)).kv_policy.factory.scorer.path == scorer_path
