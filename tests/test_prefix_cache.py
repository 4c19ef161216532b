"""The prefix cache: a restored conversation prefix gives the very output a cold prefill gives (bit for bit,
plain and speculative), in RAM and from disk after a restart; corrupt, truncated and foreign files are
skipped with a warning and never loaded; the disk budget and the RAM slots hold."""

import logging

import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import LuceboxError
from lucebox_core.loading import load_model
from lucebox_core.prefix_cache import (SUFFIX, PrefixCache, PrefixCacheConfig, Snapshot, parse_size, prefix_key,
                                       read_snapshot_file, turn_boundaries, write_snapshot_file)
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import SpeculativeDecoder, dflash
from lucebox_core.state_snapshot import SnapshotMismatch

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def loaded(tiny_target_and_draft):
    return load_model(tiny_target_and_draft[0])


@pytest.fixture(scope="module")
def drafter(tiny_target_and_draft, loaded):
    return dflash.load(tiny_target_and_draft[1], loaded.model)


def _conversation(loaded, seed: int, turns: int, turn_tokens: int = 23) -> list[list[int]]:
    """Token prompts of a growing conversation: each one the previous, its answer and a new message, every
    message ended by an end-of-turn id; the last prompt of each ends mid-turn (an open assistant header)."""
    generator = torch.Generator().manual_seed(seed)
    end = min(loaded.tokenizer.eot_ids)
    history: list[int] = []
    prompts = []
    for _ in range(turns):
        history += torch.randint(10, 5000, (turn_tokens,), generator=generator).tolist() + [end]
        prompts.append(history + torch.randint(10, 5000, (3,), generator=generator).tolist())
    return prompts


def _engine(loaded, cache=None, drafter=None, chunk=16):
    speculative = None if drafter is None else SpeculativeDecoder(loaded.model, drafter, spec_type="ddtree")
    return Engine(loaded.model, loaded.tokenizer, ctx_size=512, prefill_chunk=chunk, speculative=speculative,
                  prefix_cache=cache)


def _cache(tmp_path=None, **config):
    directory = str(tmp_path / "kv") if tmp_path is not None else None
    return PrefixCache(PrefixCacheConfig(min_tokens=1, directory=directory, **config), "test-fingerprint")


def _prefill(engine, prompt):
    sequence = engine.new_sequence()
    engine.prefill(sequence, prompt)
    return sequence


def test_turn_boundaries_follow_end_of_turn_ids():
    assert turn_boundaries([5, 9, 7, 9, 9, 1], {9}) == [2, 4, 5]
    assert turn_boundaries([1, 2, 3], {9}) == []


def test_a_restored_prefix_gives_bit_identical_logits_and_greedy_output(loaded):
    first, second, third = _conversation(loaded, seed=1, turns=3)
    cache = _cache()
    cached, cold = _engine(loaded, cache), _engine(loaded)
    cached.generate(GenerationRequest(prompt_ids=first, max_tokens=4, sampling=GREEDY))
    assert cache.stats.snapshots == 1 and cache.stats.hits == 0
    for prompt, reused in ((second, len(first) - 3), (third, len(second) - 3)):
        warm = _prefill(cached, prompt)
        reference = _prefill(cold, prompt)
        assert warm.tokens == reference.tokens == prompt
        assert torch.equal(warm.pending_logits, reference.pending_logits)  # bit for bit
        cached.release(warm)
        cold.release(reference)
        request = GenerationRequest(prompt_ids=prompt, max_tokens=12, sampling=GREEDY)
        hit = cached.generate(request)
        assert hit.timings.cached_tokens == len(prompt) - 3 >= reused
        assert hit.timings.prompt_tokens == 3  # only the open turn was prefilled
        assert hit.token_ids == cold.generate(request).token_ids


def test_a_restored_prefix_continues_with_speculative_decoding(loaded, drafter):
    first, second = _conversation(loaded, seed=2, turns=2, turn_tokens=40)
    cache = _cache()
    speculative = _engine(loaded, cache, drafter)
    speculative.generate(GenerationRequest(prompt_ids=first, max_tokens=4, sampling=GREEDY))
    request = GenerationRequest(prompt_ids=second, max_tokens=24, sampling=GREEDY)
    hit = speculative.generate(request)
    assert hit.timings.cached_tokens == len(first) - 3
    assert hit.timings.accepted_lengths  # it did decode speculatively
    assert hit.token_ids == _engine(loaded).generate(request).token_ids  # == plain, cold, no cache


def test_snapshots_survive_a_restart_on_disk(loaded, tmp_path):
    first, second = _conversation(loaded, seed=3, turns=2)
    cache = _cache(tmp_path)
    _engine(loaded, cache).generate(GenerationRequest(prompt_ids=first, max_tokens=2, sampling=GREEDY))
    cache.close()
    files = list((tmp_path / "kv" / "test-fingerprint").glob(f"*{SUFFIX}"))
    assert len(files) == 1 and files[0].stem == prefix_key(first[:-3])
    restarted = _cache(tmp_path)  # a new server: nothing in RAM
    request = GenerationRequest(prompt_ids=second, max_tokens=10, sampling=GREEDY)
    hit = _engine(loaded, restarted).generate(request)
    assert hit.timings.cached_tokens == len(first) - 3 and restarted.stats.disk_hits == 1
    assert hit.token_ids == _engine(loaded).generate(request).token_ids
    restarted.close()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "foreign fingerprint", "not a cache file",
                                    "header garbage"])
def test_a_damaged_or_foreign_file_is_skipped_with_a_warning(loaded, tmp_path, caplog, damage):
    first, second = _conversation(loaded, seed=4, turns=2)
    cache = _cache(tmp_path)
    _engine(loaded, cache).generate(GenerationRequest(prompt_ids=first, max_tokens=1, sampling=GREEDY))
    cache.close()
    [path] = (tmp_path / "kv" / "test-fingerprint").glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-100] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "foreign fingerprint":
        snapshot = read_snapshot_file(path, "test-fingerprint")
        write_snapshot_file(path, "another-model", snapshot)
        data = bytearray(path.read_bytes())
    elif damage == "not a cache file":
        data = bytearray(b"GGUF" + bytes(200))
    else:
        data[8:16] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    restarted = _cache(tmp_path)
    request = GenerationRequest(prompt_ids=second, max_tokens=1, sampling=GREEDY)
    with caplog.at_level(logging.WARNING, logger="lucebox.prefix_cache"):
        result = _engine(loaded, restarted).generate(request)
    # Prefilled from scratch (nothing of the file was restored), and the file is gone, so it is not read again.
    assert result.timings.cached_tokens == 0 and result.timings.prompt_tokens == len(second)
    assert restarted.stats.rejected_files == 1 and not path.exists()
    assert any("skipping" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    restarted.close()


def test_the_disk_budget_evicts_the_least_recently_used_files(tmp_path):
    one = Snapshot(tuple(range(10)), {"x": torch.arange(4096, dtype=torch.float32)})  # 16 KiB of payload
    cache = PrefixCache(PrefixCacheConfig(slots=0, min_tokens=1, directory=str(tmp_path), disk_budget=40_000), "fp")
    for start in range(4):
        cache.store(tuple(range(start, start + 10)), dict(one.tensors))
        cache.flush()
    files = sorted(p.stem for p in (tmp_path / "fp").glob(f"*{SUFFIX}"))
    assert files == sorted(prefix_key(tuple(range(s, s + 10))) for s in (2, 3))
    assert cache.describe()["disk_bytes"] <= 40_000
    cache.close()


def test_ram_slots_keep_the_most_recently_used():
    cache = PrefixCache(PrefixCacheConfig(slots=2, min_tokens=1), "fp")
    prompts = [[i] * 4 + [7, 8] for i in (1, 2, 3)]
    for prompt in prompts[:2]:
        cache.store(prompt[:4], {"x": torch.zeros(1)})
    assert cache.lookup(prompts[0], [4]) is not None  # touches the first: the second is now the oldest
    cache.store(prompts[2][:4], {"x": torch.zeros(1)})
    assert cache.lookup(prompts[1], [4]) is None
    assert cache.lookup(prompts[0], [4]) is not None and cache.lookup(prompts[2], [4]) is not None
    assert cache.describe()["held"] == 2


def test_a_snapshot_from_another_configuration_is_refused_and_changes_nothing(loaded, tiny_target_and_draft):
    other = load_model(tiny_target_and_draft[0], cache_type_k="q8_0", cache_type_v="q8_0")
    prompt = _conversation(loaded, seed=5, turns=1)[0]
    tensors = loaded.model.snapshot_state(_prefill(_engine(loaded), prompt).state)
    state = other.model.new_state(512)
    with pytest.raises(SnapshotMismatch, match="KV rows"):
        other.model.restore_state(state, tensors, len(prompt))
    assert state.length == 0 and state.kv.length == 0


@pytest.mark.parametrize("family", ["gemma4", "laguna", "qwen3"])
def test_other_families_restore_exactly(family, tmp_path):
    """Gemma-4's and Laguna's sliding-window rings (16 rows in the tiny files) wrap within the prompt."""
    from lucebox_core.plugins import registry

    synth = registry().named("lucebox_synthesizers", family, "synth")
    model = load_model(synth.write(tmp_path / f"{family}.gguf", size="tiny", type="f32", seed=6))
    first, second = _conversation(model, seed=6, turns=2, turn_tokens=30)
    cache = _cache()
    cached = _engine(model, cache, chunk=8)
    cached.generate(GenerationRequest(prompt_ids=first, max_tokens=2, sampling=GREEDY))
    request = GenerationRequest(prompt_ids=second, max_tokens=10, sampling=GREEDY)
    hit = cached.generate(request)
    assert hit.timings.cached_tokens == len(first) - 3
    assert hit.token_ids == _engine(model, chunk=8).generate(request).token_ids


@pytest.mark.parametrize(("text", "size"), [("4G", 4 * 2**30), ("512M", 512 * 2**20), ("1.5GiB", 3 * 2**29),
                                            ("100000", 100000), ("64k", 65536)])
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1G", "0"])
def test_bad_sizes_name_the_flag(text):
    with pytest.raises(LuceboxError, match="--kv-cache-budget"):
        parse_size(text)


def test_the_ttft_benchmark_restores_the_first_turn(tiny_target_and_draft, tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_prefix_cache.py"
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["-m", str(tiny_target_and_draft[0]), "--context", "160", "--turn-tokens", "40",
                       "--answer-tokens", "8", "--new-tokens", "8", "--reps", "1", "-ub", "32",
                       "--kv-cache-dir", str(tmp_path / "kv"), "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    rows = {row["mode"]: row for row in written if row["test"] == "ttft_second_turn"}
    assert rows["cold"]["restored_tokens"] == 0 and rows["cold"]["prefilled_tokens"] == 160 + 16 + 3
    for mode in ("ram", "disk"):
        assert rows[mode]["restored_tokens"] == rows[mode]["expected_restore"] == 157  # up to the open header
        assert rows[mode]["snapshot_bytes"] > 0
    # The breakdown of one more RAM-restored turn: a restore, then forward calls over exactly the new tokens.
    (breakdown,) = [row for row in written if row["test"] == "ttft_breakdown"]
    assert breakdown["restore_s"] > 0 and sum(tokens for tokens, _ in breakdown["forward_calls"]) == 179 - 157
    assert breakdown["seconds"] >= breakdown["restore_s"] + breakdown["forward_s"]


def test_the_ram_budget_holds_and_an_oversized_snapshot_stays_out(caplog):
    cache = PrefixCache(PrefixCacheConfig(slots=8, min_tokens=1, ram_budget=10_000), "fp")
    for i in range(3):
        cache.store((i, 1, 2), {"x": torch.zeros(1000)})  # 4000 bytes each: two fit
    assert cache.describe()["held"] == 2 and cache.describe()["ram_bytes"] <= 10_000
    assert cache.lookup([0, 1, 2, 9], [3]) is None and cache.lookup([2, 1, 2, 9], [3]) is not None
    with caplog.at_level(logging.WARNING, logger="lucebox.prefix_cache"):
        cache.store((5, 1, 2), {"x": torch.zeros(5000)})
    assert cache.lookup([5, 1, 2, 9], [3]) is None and "--prefix-cache-ram" in caplog.text
