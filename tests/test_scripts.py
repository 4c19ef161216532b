"""The GPU benchmark and check scripts, on the CPU: argument parsing, the merged table, the decode-at-depth
state restore, the speculative benchmark's logic (a dry run on tiny models) and the full-model comparison
rules. What needs a GPU (memory measurement, CUDA kernels, llama.cpp) is not run here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _import(name: str):
    """A script as a module (the scripts folder on the path, as when it runs: spec_bench imports its sibling)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


bench = _import("bench_vs_llamacpp")
spec_bench = _import("spec_bench")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from lucebox_qwen35 import draft_synth, synth

    folder = tmp_path_factory.mktemp("scripts")
    target = synth.write(folder / "qwen35-tiny-f32.gguf", size="tiny", type="f32", seed=5)
    drafter = draft_synth.write(folder / "qwen35-tiny-dflash-draft-tiny-f32.gguf", size="tiny", type="f32", seed=6,
                                target=target)
    return folder, target, drafter


@pytest.fixture(scope="module")
def tiny_loaded(tiny_files):
    from lucebox_core.loading import load_model

    return load_model(tiny_files[1], backend="torch", device="cpu")


# -- bench_vs_llamacpp: tests and table --------------------------------------------------------------------


def test_parse_tests_names_them_as_llama_bench_does():
    tests = bench.parse_tests("pp512, tg128,tg128@d8192,tg64 @ d32768")
    assert [t.name for t in tests] == ["pp512", "tg128", "tg128 @ d8192", "tg64 @ d32768"]
    assert tests[2] == bench.BenchTest("tg", 128, 8192)
    for bad in ("pp512@d10", "xx1", "tg0", "tg128@8192"):
        with pytest.raises(Exception, match="bad test"):
            bench.parse_tests(bad)


def test_parser_takes_every_subcommand():
    parser = bench.build_parser()
    args = parser.parse_args(["lucebox", "m.gguf", "--tests", "pp512,tg128@d8192", "-r", "2", "--cache-type", "q8_0"])
    assert args.r == 2 and args.cache_type == "q8_0" and args.tests[1].depth == 8192
    args = parser.parse_args(["memory", "m.gguf", "--ctx", "1024", "--cache-types", "f16"])
    assert (args.ctx, args.cache_types, args.decode) == (1024, "f16", 64)
    assert parser.parse_args(["table", "a.json", "b.json", "--md", "t.md"]).files == ["a.json", "b.json"]
    with pytest.raises(SystemExit):
        parser.parse_args(["lucebox", "m.gguf"])  # --tests is required


def _llama_record(model: str, n_prompt: int, n_gen: int, depth: int, rate: float) -> dict:
    return {"build_commit": "0c1e570", "model_filename": f"/tmp/w/{model}.gguf", "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": depth, "avg_ts": rate, "stddev_ts": 1.0, "type_k": "f16", "type_v": "f16"}


def _lucebox_row(model: str, test: str, rate: float, **extra) -> dict:
    row = {"engine": "lucebox", "model": model, "test": test, "tokens_per_s": rate, "backend": "cuda",
           "activations": "bfloat16", "kv_types": "bf16/bf16", "weight_bytes_per_token": 10**9, **extra}
    if test.startswith("tg"):
        row.update(n_gen=128, weight_GB_per_s=rate, graph_windows=1, graph_failure=None)
    return row


def test_table_merges_parts_and_llama_bench_output(tmp_path):
    header_a = {"kind": "header", "part": "A", "date_utc": "2026-12-01 10:00 UTC", "gpu": "NVIDIA H200",
                "driver": "580.159.04", "torch": "2.11.0", "cuda": "13.0", "commit": "abc1234", "copy_gb_s": 4000.0}
    (tmp_path / "header.json").write_text(json.dumps(header_a))
    (tmp_path / "lucebox_27b.json").write_text(json.dumps([
        _lucebox_row("qwen35-27b-q4_k_m", "pp512", 1000.0), _lucebox_row("qwen35-27b-q4_k_m", "tg128", 50.0)]))
    # llama-bench may print log lines before its JSON array.
    (tmp_path / "llama_27b.json").write_text("ggml_cuda_init: found 1 CUDA devices\n" + json.dumps([
        _llama_record("qwen35-27b-q4_k_m", 512, 0, 0, 2000.0), _llama_record("qwen35-27b-q4_k_m", 0, 128, 0, 100.0)]))
    (tmp_path / "broken.json").write_text("llama-bench: error\n")
    part_a = tmp_path / "bench_A.json"
    bench.main(["table", *map(str, sorted(tmp_path.glob("*.json"))), "--json", str(part_a),
                "--md", str(tmp_path / "a.md")])

    # Part B: depth rows of both engines and a memory row; a newer tg128 figure wins over part A's.
    header_b = {**header_a, "part": "B", "copy_gb_s": 4200.0}
    part_b = tmp_path / "b"
    part_b.mkdir()
    (part_b / "header.json").write_text(json.dumps(header_b))
    (part_b / "lucebox_depth.json").write_text(json.dumps([
        _lucebox_row("qwen35-27b-q4_k_m", "tg128 @ d8192", 40.0, n_depth=8192),
        _lucebox_row("qwen35-27b-q4_k_m", "tg128", 60.0)]))
    (part_b / "llama_depth.json").write_text(json.dumps([_llama_record("qwen35-27b-q4_k_m", 0, 128, 8192, 80.0)]))
    memory = {"kind": "memory", "model": "qwen35-27b-q4_k_m", "cache_type": "q8_0", "ctx": 32768,
              "peak_allocated_prefill": 18 * 2**30, "peak_allocated_decode": 17 * 2**30,
              "peak_used_estimate": 19.5 * 2**30, "used_end": 19 * 2**30, "estimate_total": 17.5 * 2**30,
              "decode_tok_s": 30.0, "fits_target": True}
    (part_b / "memory.json").write_text(json.dumps([memory]))
    merged = tmp_path / "merged.json"
    bench.main(["table", str(part_a), *map(str, sorted(part_b.glob("*.json"))), "--json", str(merged),
                "--md", str(tmp_path / "all.md")])
    text = (tmp_path / "all.md").read_text()
    results = json.loads(merged.read_text())

    assert {h["part"] for h in results["headers"]} == {"A", "B"}
    rows = {(r["engine"], r["test"]): r for r in results["rows"]}
    assert rows[("lucebox", "tg128")]["tokens_per_s"] == 60.0  # the later file wins
    # llama.cpp's decode rows get the file's weight bytes per token, so both engines' GB/s compare.
    assert rows[("llama.cpp", "tg128 @ d8192")]["weight_GB_per_s"] == pytest.approx(80.0)
    bench_part = text.split("### Device memory")[0]
    lines = {line.split("|")[2].strip(): line for line in bench_part.splitlines() if line.startswith("| qwen35")}
    assert list(lines) == ["pp512", "tg128", "tg128 @ d8192"]  # prompt tests first, then decode by depth
    assert "0.50x" in lines["pp512"] and "0.60x" in lines["tg128"] and "0.50x" in lines["tg128 @ d8192"]
    # GB/s against the median copy bandwidth of the runs (4100 GB/s): 60 GB/s is 1%, 100 GB/s 2%.
    assert "60 (1%)" in lines["tg128"] and "100 (2%)" in lines["tg128"]
    assert "| qwen35-27b-q4_k_m | q8_0 | 32768 | 18.00 / 17.00 | 19.50 |" in text
    assert "`abc1234`" in text and "0c1e570" in text and "in 2 of 2 decode tests" in text
    # Merging the merged file again changes nothing.
    again = tmp_path / "again.json"
    bench.main(["table", str(merged), "--json", str(again)])
    assert json.loads(again.read_text()) == results


def test_decode_snapshot_restores_the_state_at_depth(tiny_loaded):
    model = tiny_loaded.model
    state = model.new_state(64)
    model.forward(state, torch.tensor(bench.random_ids(20, model.vocab_size, 1)))
    snapshot = bench.DecodeSnapshot(state)
    tokens = [torch.tensor([t]) for t in (11, 2222, 33333)]
    first = [model.forward(state, t) for t in tokens]
    assert state.length == 23
    assert snapshot.restore(state) and state.length == 20
    second = [model.forward(state, t) for t in tokens]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # A state kind the snapshot does not know is left to go on (and says so).
    assert not bench.DecodeSnapshot(type("Other", (), {"length": 3})()).restore(object())


def test_lucebox_tests_rows(tiny_loaded):
    seen = []
    tests = bench.parse_tests("pp16,tg2,tg2@d8")
    rows = bench.lucebox_tests(tiny_loaded, tests, reps=2, on_row=seen.append, warmup_tokens=16)
    assert seen == rows and [r["test"] for r in rows] == ["pp16", "tg2", "tg2 @ d8"]
    for row in rows:
        assert row["engine"] == "lucebox" and row["backend"] == "torch" and len(row["samples_s"]) == 2
        assert row["tokens_per_s"] > 0 and row["model"] == "qwen35-tiny-f32"
    depth = rows[2]
    assert depth["n_depth"] == 8 and depth["state_restored"] and depth["graph_windows"] == 0  # no graphs on a CPU
    assert depth["weight_GB_per_s"] == pytest.approx(depth["weight_bytes_per_token"] * depth["tokens_per_s"] / 1e9)


def test_prefill_profile_separates_host_and_kernels(tiny_files, tmp_path):
    """scripts/prefill_profile.py on the tiny file on the CPU: two chunks, the host ops that ran them, no GPU time."""
    prefill_profile = _import("prefill_profile")
    out = tmp_path / "prefill.json"
    assert prefill_profile.main([str(tiny_files[1]), "--tokens", "24", "--chunk", "16", "--reps", "2",
                                 "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["tokens"] == 24 and summary["prefill_chunk"] == 16 and len(summary["walls_ms"]) == 2
    assert summary["tok_s"] == pytest.approx(24 / (summary["wall_ms"] / 1e3))
    assert summary["gpu_busy_ms"] == 0 and summary["kernels"] == []  # a CPU run launches no kernels
    ops = {op["name"]: op for op in summary["host_ops"]}
    assert "aten::mm" in ops and ops["aten::mm"]["count"] >= 2  # the products of both chunks
    assert "prefill qwen35-tiny-f32.gguf" in prefill_profile.report(summary)


def test_recorded_prefill_check_compares_pieces_and_replays(tiny_files, tmp_path):
    """scripts/recorded_prefill_check.py on the tiny file on the CPU (the recorded path's step run eagerly): each
    piece, then each again on the emptied state, against eager pieces; the state after; timings both ways."""
    check = _import("recorded_prefill_check")
    out = tmp_path / "check.json"
    assert check.main([str(tiny_files[1]), "--pieces", "20,13,40", "--timed", "16", "--reps", "1", "--ctx", "256",
                       "--without-graphs", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["piece"], r.get("replay", False)) for r in report["pieces"]] == [
        (20, False), (13, False), (40, False), (20, True), (13, True), (40, True)]
    assert all(r["relative_max_diff"] < 1e-4 and r["argmax_equal"] for r in report["pieces"])
    assert report["failure"] is None and report["recordings"] == 0  # no graphs on a CPU: nothing recorded
    assert max(report["state_relative_max_diff"].values()) < 1e-3
    assert [(t["tokens"], t["recorded"]) for t in report["timing"]] == [(16, False), (16, True)]


def test_prefill_profile_names_the_host_functions_and_call_sites(tiny_files, tmp_path):
    """--python: one more prefill under cProfile, the engine's prefill among the project's functions; --stacks: torch
    ops by the project's lines that called them (the GDN scan's products in the family's ops on the CPU)."""
    prefill_profile = _import("prefill_profile")
    out = tmp_path / "prefill.json"
    assert prefill_profile.main([str(tiny_files[1]), "--tokens", "24", "--chunk", "16", "--reps", "1", "--python",
                                 "--stacks", "--top", "30", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    functions = [f["function"] for f in summary["python"]]
    assert any(f.startswith("engine.py:") and f.endswith(":prefill") for f in functions)
    assert all(f["cum_ms"] >= f["self_ms"] >= 0 for f in summary["python"])
    sites = summary["op_stacks"]
    assert sites and all(row["where"] and "lucebox" in row["where"][0] for row in sites)
    assert any(row["op"] == "aten::bmm" and any("gated_delta_rule" in f for f in row["where"]) for row in sites)
    report = prefill_profile.report(summary)
    assert "torch ops by call site" in report and "cProfile" in report


def test_commit_id_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("COMMIT", "feedbee")
    assert bench.commit_id() == "feedbee"
    assert bench.commit_id("given12") == "given12"


# -- spec_bench ---------------------------------------------------------------------------------------------


def test_forced_lengths_follow_the_floor_ceil_mix():
    assert spec_bench.forced_lengths(4, 24) == [5] * 5
    assert spec_bench.forced_lengths(8.3, 24) == [9, 9, 9]
    lengths = spec_bench.forced_lengths(8.3, 1000)
    assert 1 + sum(lengths) >= 1000 and 1 + sum(lengths) - lengths[-1] < 1000  # the first token needs no verify
    assert spec_bench.forced_lengths(4, 16) == [5, 5, 5]
    assert sum(x - 1 for x in lengths) / len(lengths) == pytest.approx(8.3, abs=0.02)


def test_tree_shapes_have_the_requested_sizes():
    torch.manual_seed(0)
    logits = torch.randn(15, 1000)
    for size in (1, 2, 16, 23, 64):
        shapes = spec_bench.tree_shapes(7, logits, size, vocab=1000)
        for tokens, parents in shapes.values():
            assert len(tokens) == len(parents) == size and tokens[0] == 7 and parents[0] == -1
            assert all(0 <= p < i for i, p in enumerate(parents) if i)
        assert spec_bench.tree_depth(shapes["chain"][1]) == size - 1
        assert spec_bench.tree_depth(shapes["tree"][1]) <= min(size - 1, 15)


def test_spec_parser_and_limits():
    args = spec_bench.build_parser().parse_args([])
    assert args.size == "27b" and args.sizes == [1, 2, 4, 8, 16, 23, 32, 48, 64]
    assert args.force == [4.0, 8.3, 12.0] and args.budget == 22 and args.reference == "spec"
    args = spec_bench.build_parser().parse_args(["--size", "tiny", "--force", "4", "--skip", "verify,e2e", "--unforced"])
    assert args.force == [4.0] and args.skip == ["verify", "e2e"] and args.unforced
    with pytest.raises(SystemExit, match="below the drafter's block"):
        spec_bench.main(["--force", "16", "--device", "cpu"])


def test_spec_markdown_labels_forced_figures():
    data = {
        "header": {"date_utc": "d", "gpu": "g", "driver": "x", "torch": "t", "cuda": "c", "commit": "abc"},
        "setup": {"target": "t.gguf", "drafter": "d.gguf", "block": 16, "prefill": 1024, "n_gen": 128, "prompt": 32,
                  "reference": "spec", "backend": "cuda", "activations": "bfloat16"},
        "verify": [{"function": "verify", "shape": shape, "nodes": n, "depth": n - 1, "seconds": 0.01 * n}
                   for n in (16, 32) for shape in ("chain", "tree")],
        "draft": {"block": 16, "draft_s": 0.02, "tree_build_s": 0.001, "budget": 22},
        "e2e": [{"decoder": "plain", "tok_s": 50.0},
                {"decoder": "ddtree budget 22", "spec_type": "ddtree", "nodes": 23, "force_accept": 8.3,
                 "tok_s": 100.0, "tokens_per_verify": 9.3, "forcing_held": False, "matches_reference": [True]}],
    }
    text = spec_bench.markdown(data)
    assert "| ddtree budget 22 | FORCED 8.3 | 9.30 (forcing did NOT hold) | 100.0 | 2.00x |" in text
    # Predicted: 9.3 tokens / (verify at 23 nodes, interpolated 0.23 s, + draft 0.02 s).
    assert f"| {9.3 / 0.25:,.1f} | yes |" in text
    assert "never an acceptance rate" in text


@pytest.mark.slow
def test_spec_bench_dry_run_on_tiny_models(tiny_files, tmp_path):
    folder, target, drafter = tiny_files
    out = tmp_path / "out"
    code = spec_bench.main(["--size", "tiny", "--type", "f32", "--device", "cpu", "--target", str(target),
                            "--drafter", str(drafter), "--workdir", str(folder), "--prefill", "24",
                            "--sizes", "1,4", "--reps", "1", "-n", "5", "--e2e-reps", "1", "--force", "4",
                            "--out", str(out)])
    assert code == 0
    data = json.loads((out / "spec_bench.json").read_text())
    assert {(r["shape"], r["nodes"]) for r in data["verify"]} == {(s, n) for s in ("chain", "tree") for n in (1, 4)}
    assert all(r["seconds"] > 0 for r in data["verify"]) and data["draft"]["draft_s"] > 0
    forced = [r for r in data["e2e"] if r.get("force_accept") == 4]
    assert {r["spec_type"] for r in forced} == {"chain", "ddtree"}
    for row in forced:  # f32 on the CPU: the verify path and plain decoding agree, so forcing holds exactly
        assert row["forcing_held"] and row["tokens_per_verify"] == 5 and all(row["matches_reference"])
    assert not [r for r in data["e2e"] if r.get("spec_type") and r["force_accept"] is None]  # not asked for
    # The reference pass (every draft forced to plain greedy's token): the verify path's greedy equals plain
    # greedy in f32 on the CPU, and forcing all 15 drafts holds until the reference (5 + 16 tokens) runs out.
    assert [p["plain_greedy_first_difference"] for p in data["reference_passes"]] == [[None], [None]]
    assert [p["lengths"] for p in data["reference_passes"]] == [[[16, 5]], [[16, 5]]]
    assert "FORCED 4" in (out / "spec_bench.md").read_text()


# -- cuda_check's full-model rules ------------------------------------------------------------------------


def test_greedy_comparison_near_tie_rule():
    cuda_check = pytest.importorskip("cuda_check", reason="lucebox_cuda is not importable here")
    logits = [torch.tensor([0.0, 1.0, 0.9995, -1.0]), torch.tensor([2.0, 0.0, 0.0, 0.5])]
    reference = cuda_check.ReferenceRun(torch.zeros(3, 4), [1, 0], logits)
    logprob = [float(torch.log_softmax(x.double(), -1).max()) for x in logits]
    same = cuda_check.compare_greedy(reference, [1, 0], logprob, 1e-3)
    assert same["verdict"] == "identical" and same["same"] == 2 and same["max_logprob_diff"] < 1e-12
    tie = cuda_check.compare_greedy(reference, [2, 0], [None, None], 1e-3)
    assert tie["verdict"] == "near-tie at step 0" and tie["top2_gap"] == pytest.approx(5e-4, rel=1e-3)
    diverged = cuda_check.compare_greedy(reference, [1, 3], logprob, 1e-3)
    assert diverged["verdict"] == "DIVERGED at step 1" and diverged["same"] == 1
    assert cuda_check.compare_greedy(reference, [1], logprob, 1e-3)["verdict"].startswith("DIVERGED")


def test_reference_and_engine_greedy_agree_on_the_cpu(tiny_loaded):
    cuda_check = pytest.importorskip("cuda_check", reason="lucebox_cuda is not importable here")
    from lucebox_qwen35.loader import load

    from lucebox_core.torch_backend import TorchBackend

    prompt = bench.random_ids(40, 200000, 3)
    reference = cuda_check.reference_greedy(load(tiny_loaded.gguf, TorchBackend("cpu", torch.float32)), prompt, 4,
                                            tiny_loaded.tokenizer.unused_ids())
    candidate = cuda_check.candidate_run(tiny_loaded.model, tiny_loaded.tokenizer, prompt, 4)
    assert candidate["tokens"] == reference.tokens and len(reference.step_logits) == 4
    assert torch.allclose(candidate["prefill"], reference.prefill)
    verdict = cuda_check.compare_greedy(reference, candidate["tokens"], candidate["logprobs"], 1e-3)
    assert verdict["verdict"] == "identical" and verdict["max_logprob_diff"] < 1e-4


# -- the shell entry points ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["bench_vs_llamacpp.sh", *sorted(p.name for p in SCRIPTS.glob("gpu_session*.sh"))])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


FAKE_LLAMA_BENCH = """#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
def values(flag, default):
    return [int(v) for v in args[args.index(flag) + 1].split(",")] if flag in args else default
rows = []
for d in values("-d", [0]):
    rows += [{"model_filename": args[args.index("-m") + 1], "n_prompt": p, "n_gen": 0, "n_depth": d,
              "avg_ts": 900.0, "build_commit": "fake"} for p in values("-p", [512]) if p]
    rows += [{"model_filename": args[args.index("-m") + 1], "n_prompt": 0, "n_gen": n, "n_depth": d,
              "avg_ts": 90.0, "build_commit": "fake"} for n in values("-n", [128]) if n]
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_bench_script_dry_run(tmp_path):
    """Part B end to end on a CPU: tiny file, torch backend, a stand-in llama-bench; the part's table."""
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PART": "B", "WORK": str(tmp_path / "w"), "BIG": "tiny",
           "BACKEND": "torch", "SKIP": "memory", "LLAMA_BENCH": str(fake), "DEPTH_TESTS": "tg2@d8",
           "DEPTH_REPS": "1", "COMMIT": "test123"}
    subprocess.run(["bash", "scripts/bench_vs_llamacpp.sh"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    text = (tmp_path / "out" / "bench_B.md").read_text()
    assert "| qwen35-tiny-q4_k_m | tg2 @ d8 |" in text and "| qwen35-tiny-q4_k_m | tg128 @ d8192 |" in text
    assert "`test123`" in text and "fake" in text
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"bench_B.json", "bench_B.md", "bench_B.tgz"}


def test_memory_measurement_flow_with_a_stand_in_allocator(tiny_files, monkeypatch):
    """The memory step's bookkeeping on the CPU: torch.cuda's counters replaced by fixed numbers (the real
    ones need a GPU), the tiny model filled to its context and decoded there."""
    gib = 2**30
    counters = {"mem_get_info": lambda: (100 * gib, 140 * gib), "reset_peak_memory_stats": lambda: None,
                "max_memory_allocated": lambda: 17 * gib, "max_memory_reserved": lambda: 18 * gib,
                "memory_allocated": lambda: 16 * gib, "empty_cache": lambda: None}
    for name, value in counters.items():
        monkeypatch.setattr(torch.cuda, name, value)
    row = bench.measure_memory(str(tiny_files[1]), backend="torch", device="cpu", cache_type="q8_0", ctx=40,
                               decode_steps=3)
    assert row["kind"] == "memory" and row["cache_type"] == "q8_0" and row["depth"] == 40 - 3 - 2
    assert row["baseline_used"] == 40 * gib and row["peak_used_estimate"] == 58 * gib and not row["fits_target"]
    assert row["kv_bytes"] > 0 and row["decode_tok_s"] > 0 and row["estimate_total"] > row["kv_bytes"]
    assert row["estimate_parts"]["kv"] == row["kv_bytes"]  # the model's estimate counts the same KV buffers


def test_verify_determinism_script_measures_every_node(tmp_path):
    """scripts/verify_determinism.py on a tiny model on the CPU: a row per node of a chain and of a tree,
    each with its depth, and every difference between verified and decoded logits at rounding level here
    (f32 reference backend)."""
    import importlib.util
    import json

    from lucebox_qwen35 import synth

    model = synth.write(tmp_path / "tiny.gguf", size="tiny", type="f32", seed=2)
    spec = importlib.util.spec_from_file_location("verify_determinism", SCRIPTS / "verify_determinism.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "det.json"
    assert module.main([str(model), "--nodes", "5", "--prefix", "9", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["depth"]) for r in rows] == [("chain", d) for d in range(5)] + [
        ("tree", 0), ("tree", 1), ("tree", 1), ("tree", 2), ("tree", 2)]
    assert all(r["max_abs"] < 1e-4 * r["logit_scale"] for r in rows)
    assert all(r["argmax_same"] for r in rows)


def test_constrained_decode_bench_reports_both_masks_idle_and_busy(tiny_files, capsys, monkeypatch):
    monkeypatch.delenv("LUCEBOX_MASK_AHEAD", raising=False)
    script = _import("constrained_decode_bench")
    assert script.main(["-m", str(tiny_files[1]), "-n", "4", "-r", "1", "--busy", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["busy_processes"], r["mask"]) for r in rows] == [(0, "ahead"), (0, "inline"), (1, "ahead"), (1, "inline")]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)


def test_spec_step_profile_splits_a_step_and_profiles_the_draft(tiny_target_and_draft, tmp_path):
    """scripts/spec_step_profile.py on the tiny pair on the CPU, forced: each part of a step timed (the drafter's sync
    inside the draft, not counted twice), and the draft made again under the profiler."""
    profile = _import("spec_step_profile")
    target, draft = tiny_target_and_draft
    out = tmp_path / "step.json"
    assert profile.main([str(target), str(draft), "--force-accept", "3", "-n", "12", "--draft-kernels", "2",
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    parts = result["parts_ms_per_step"]
    assert {"draft", "draft sync", "candidates", "verify", "walk", "commit"} <= set(parts)
    assert parts["draft sync"] <= parts["draft"]
    assert result["steps"] >= 1 and result["draft_kernels"]["calls"] == 2 and result["draft_kernels"]["wall_ms"] > 0


def test_verify_profile_times_chains_and_a_tree_and_names_kernel_kinds(tiny_files, tmp_path):
    """scripts/verify_profile.py on the tiny file on the CPU: a chain pass per node count and two trees of the
    largest, each timed; the kernel names of the GPU's products, attention and recurrence fall into their kinds."""
    profile = _import("verify_profile")
    out = tmp_path / "verify.json"
    assert profile.main([str(tiny_files[1]), "--nodes", "1,5", "--depth", "24", "--reps", "2",
                         "--json", str(out)]) == 0
    passes = json.loads(out.read_text())["passes"]
    assert [(p["nodes"], p["shape"]) for p in passes] == [(1, "chain"), (5, "chain"), (5, "tree"), (5, "ddtree")]
    assert all(p["wall_ms"] > 0 for p in passes)
    assert profile.tree_parents(6, "tree") == [-1, 0, 0, 1, 1, 2]
    assert profile.tree_parents(9, "ddtree") == [-1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert profile.kernel_kind("matvec_tiled_w4_r2_a1_o0_q6_k_bf16_24") == "products q6_k"
    assert profile.kernel_kind("mma_q4_k_bf16_24") == "products q4_k"
    assert profile.kernel_kind("_tree_attention_kernel") == "attention"
    assert profile.kernel_kind("_gated_delta_tree_kernel") == "gated delta recurrence"
    assert profile.kernel_kind("void at::native::vectorized_elementwise_kernel") == "copies and fills"


def test_megakernel_floor_phases_cover_every_matrix_and_its_kernels_compile():
    """The probe's step reads every matrix of the 0.8B Q4_K_M plan once (and the DeltaNet states), in the
    megakernel's phase count; its kernels compile for Hopper and Ampere (run on the GPU by gpu_session.sh)."""
    from lucebox_qwen35 import layout, synth

    floor = _import("megakernel_floor")
    cfg = layout.SIZES["0.8b"]
    plans = synth.tensor_plans(cfg, "q4_k_m")
    phases = floor.step_phases("0.8b", "q4_k_m")
    attention_layers = sum(p.name.endswith("attn_q.weight") for p in plans)
    linear_layers = cfg.n_layer - attention_layers
    assert (attention_layers, linear_layers) == (6, 18)
    assert len(phases) == 6 * attention_layers + 5 * linear_layers + 2
    matrices = sum(floor.tensor_bytes(p) for p in plans if len(p.shape) == 2)
    assert sum(phases) == matrices + linear_layers * 2 * 16 * 128 * 128 * 4
    assert phases[-2] == floor.tensor_bytes(plans[0]) == 248_320 * 1024 // 256 * 210  # the tied head, Q6_K
    partials = floor.step_phases("0.8b", "q4_k_m", "partials")  # output and down products joined to the phase before
    assert len(partials) == 4 * attention_layers + 3 * linear_layers + 2 and sum(partials) == sum(phases)
    with pytest.raises(ValueError, match="schedule"):
        floor.step_phases("0.8b", "q4_k_m", "fused")
    pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")
    from lucebox_cuda import nvrtc

    for arch in ("sm_86", "sm_90"):
        cubin = nvrtc._compile(floor.Program(), arch, nvrtc.DEFAULT_OPTIONS)
        kernels = [f"floor_{read}_{kind}" for read in ("barriers", "direct") for kind in floor.BARRIERS]
        kernels += [f"floor_ring_{kind}_s{stages}" for kind in floor.BARRIERS for stages in floor.RING_STAGES]
        assert all(name.encode() in cubin for name in kernels)


def test_probe_tuned_table_picks_the_fastest_timed_variant_of_the_defaults_class_only(tmp_path, monkeypatch):
    tuned = _import("probe_tuned_table")
    row = {"format": "q4_k", "out": 34816, "in": 5120}
    faster_mma = {**row, "batch": 8, "default_variant": "mma_r2", "default_us": 10.0, "mma_us": 8.0, "mma_r2_us": 9.0}
    only_other_class = {**row, "batch": 12, "default_variant": "pipe_w4_d4_m2_k1", "default_us": 10.0, "mma8_us": 5.0,
                        "mma_us": 11.0}
    default_best = {**row, "batch": 16, "default_variant": "mma", "default_us": 7.0, "mma_r2_us": 8.0}
    chosen = tuned.overrides([faster_mma, only_other_class, default_best])
    assert chosen == {("q4_k", 8, 34816, 5120): "mma"}  # mma8 is 8 warps: another class, never chosen
    probe, table = tmp_path / "probe.json", tmp_path / "table.json"
    probe.write_text(json.dumps([faster_mma, only_other_class, default_best]))
    monkeypatch.setattr(sys, "argv", ["probe_tuned_table.py", str(probe), str(table)])
    tuned.main()
    from lucebox_cuda import catalogue, matvec_table

    monkeypatch.setenv(matvec_table.TUNED_TABLE_ENV, str(table))
    saved = dict(catalogue.MATVEC_TUNED)
    try:
        assert catalogue.default_variant("q4_k", "bf16", 8, 34816, 5120) == "mma_r2"
        matvec_table._load_tuned_override()  # the file laid over the built-in table
        assert catalogue.default_variant("q4_k", "bf16", 8, 34816, 5120) == "mma"
    finally:
        catalogue.MATVEC_TUNED.clear()
        catalogue.MATVEC_TUNED.update(saved)
