"""`lucebox bench` measures as llama-bench does: a fresh random id per decode token, the host waiting for the
device after each, warm-ups at each row's own shape, and speculative rows (forced ones labelled so)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.bench import DECODE_WARMUP_STEPS, run_bench


class Recorder:
    """Wraps the model's forward and the backend's synchronize: what was fed, and when the host waited."""

    def __init__(self, assembled, monkeypatch):
        self.events: list[tuple] = []
        model, backend = assembled.loaded.model, assembled.engine.backend
        forward, synchronize = model.forward, backend.synchronize

        def recording_forward(state, token_ids, *args, **kwargs):
            ids = torch.as_tensor(token_ids).reshape(-1).tolist()
            self.events.append(("forward", tuple(ids)))
            return forward(state, token_ids, *args, **kwargs)

        def recording_synchronize():
            self.events.append(("sync",))
            synchronize()

        monkeypatch.setattr(model, "forward", recording_forward)
        monkeypatch.setattr(backend, "synchronize", recording_synchronize)


def test_decode_feeds_fresh_random_ids_and_waits_for_each(tiny_target_and_draft, monkeypatch):
    n_gen, reps = 6, 2
    assembled = build_engine(EngineOptions(model=str(tiny_target_and_draft[0]), ctx_size=64))
    recorder = Recorder(assembled, monkeypatch)
    rows = run_bench(assembled, prompts=[], n_gen=n_gen, depths=[0], reps=reps)
    assert [r["test"] for r in rows] == [f"tg{n_gen}"]
    events = recorder.events
    one_token = [i for i, e in enumerate(events) if e[0] == "forward" and len(e[1]) == 1]
    # The warm-up run at this depth, then each repetition: warm-up steps, then n_gen timed tokens.
    assert len(one_token) == (1 + reps) * (DECODE_WARMUP_STEPS + n_gen)
    for run in range(1 + reps):
        timed = one_token[run * (DECODE_WARMUP_STEPS + n_gen) + DECODE_WARMUP_STEPS:][:n_gen]
        ids = [events[i][1][0] for i in timed]
        assert len(set(ids)) > 1  # fresh ids, not one token fed again and again
        for index in timed:
            assert events[index + 1] == ("sync",), "the host waits for every token"


def test_rows_keep_every_repetition_and_their_spread(tiny_target_and_draft):
    """The figure is the median repetition; beside it each repetition's rate and their standard deviation
    (llama-bench's `± stddev`), shown in the table: a noisy row says so."""
    from lucebox_core.bench import format_bench

    reps = 3
    assembled = build_engine(EngineOptions(model=str(tiny_target_and_draft[0]), ctx_size=64))
    rows = run_bench(assembled, prompts=[8], n_gen=4, depths=[0], reps=reps)
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    for row in rows:
        samples = row["tokens_per_s_samples"]
        assert len(samples) == reps and all(rate > 0 for rate in samples)
        assert row["tokens_per_s"] == pytest.approx(statistics.median(samples))
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert row["tokens_per_s_stddev"] == pytest.approx(statistics.stdev(samples))
    decode = rows[1]
    assert decode["achieved_GB_per_s"] == pytest.approx(decode["weight_bytes_per_token"] * decode["tokens_per_s"] / 1e9)
    table = format_bench(assembled.loaded, rows)
    assert f"{rows[0]['tokens_per_s']:.2f} ± {rows[0]['tokens_per_s_stddev']:.2f}" in table
    single = run_bench(assembled, prompts=[8], n_gen=0, depths=[0], reps=1)[0]
    assert single["tokens_per_s_stddev"] == 0.0 and len(single["tokens_per_s_samples"]) == 1


def test_speculative_and_forced_rows_warm_up_at_their_shapes(tiny_target_and_draft, monkeypatch):
    target, draft = tiny_target_and_draft
    assembled = build_engine(EngineOptions(model=str(target), model_draft=str(draft), ctx_size=96,
                                           spec_type="chain"))
    block = assembled.speculative.block_size
    recorder = Recorder(assembled, monkeypatch)
    # The verify passes' node counts, a speculative generation's start marked: every token of the tiny model
    # reads its 248k-row head, so one timed repetition and 8 tokens (two forced steps of 4) are enough to
    # compare the untimed run's shapes with a timed one's.
    generation = "generation"
    verify_calls = []
    model, engine = assembled.loaded.model, assembled.engine
    verify, generate = model.verify, engine.generate
    monkeypatch.setattr(model, "verify", lambda *a, **k: verify_calls.append(len(a[1])) or verify(*a, **k))
    monkeypatch.setattr(engine, "generate", lambda *a, **k: verify_calls.append(generation) or generate(*a, **k))
    reps = 1
    rows = run_bench(assembled, prompts=[8], n_gen=8, depths=[0], reps=reps, force_accept=3)
    tests = [r["test"] for r in rows]
    assert tests == ["pp8", "tg8", "tg8 spec chain FORCED accept 3", "tg8 plain engine",
                     f"draft step (block {block})", "verify 1 nodes", f"verify {block} nodes"]  # chain's largest: a block
    spec = rows[2]
    # The same requests through the plain engine, and the ratio speculation must keep above 1.
    assert rows[3]["speculative_over_plain"] == pytest.approx(spec["tokens_per_s"] / rows[3]["tokens_per_s"])
    assert "governed_plain_tokens" not in spec  # a chain has no governor
    assert len(spec["runs_tokens_per_s"]) == len(rows[3]["runs_tokens_per_s"]) == reps
    assert spec["forced_accept"] == 3 and spec["mean_accepted_length"] == pytest.approx(4.0, abs=0.5)
    assert all(r["tokens_per_s"] > 0 and r["seconds"] > 0 for r in rows)
    # The speculative generations (the untimed one at the row's shapes, then the timed ones), each the same
    # sequence of verify shapes, then the cost rows (a warm-up + `reps` calls per node count).
    cost_calls = 2 * (1 + reps)
    assert verify_calls[-cost_calls:] == [1] * (1 + reps) + [block] * (1 + reps)
    runs = []
    for call in verify_calls[:-cost_calls]:
        if call == generation:
            runs.append([])
        else:
            runs[-1].append(call)
    assert len(runs) == 1 + reps and runs[0] and all(run == runs[0] for run in runs), runs
    # The cost rows' clocks start after a synchronisation, and stop after one.
    last = [e for e in recorder.events][-3:]
    assert last[-1] == ("sync",)


def test_bench_cli_spec_rows_json(tiny_target_and_draft):
    target, draft = tiny_target_and_draft
    result = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "bench", "-m", str(target), "-md", str(draft),
                             "--force-accept", "2", "-p", "0", "-n", "6", "-r", "1", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    spec = next(r for r in rows if " spec " in r["test"])
    assert spec["test"].endswith("FORCED accept 2") and spec["mean_accepted_length"] == pytest.approx(3.0, abs=0.5)
    bad = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "bench", "-m", str(target), "--force-accept", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "needs a drafter" in bad.stderr


def test_a_mixture_of_experts_counts_the_experts_one_token_reads(tmp_path):
    """`decode_bytes_per_token` (the GB/s of a tg row) on a tiny Laguna file, against gguf's own reader: every
    tensor but the embedding table, the stacked `*_exps` tensors at the routed share (k of E experts)."""
    gguf = pytest.importorskip("gguf")
    from lucebox_core.bench import decode_bytes_per_token
    from lucebox_core.ggufio import GGUFFile
    from lucebox_laguna import synth

    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=1)
    reader = gguf.GGUFReader(path)
    field = {f.name: f for f in reader.fields.values()}
    experts = int(field["laguna.expert_count"].parts[-1][0])
    used = int(field["laguna.expert_used_count"].parts[-1][0])
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    routed = [n for n in sizes if "_exps." in n]
    assert routed and 1 < used < experts
    expected = sum(size for name, size in sizes.items() if name not in routed and name != "token_embd.weight")
    expected += sum(sizes[n] * used // experts for n in routed)
    assert decode_bytes_per_token(GGUFFile(path)) == expected
    assert expected < sum(sizes.values()) - sizes["token_embd.weight"]
