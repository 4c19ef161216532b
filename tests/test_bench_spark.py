"""scripts/bench_spark.py end to end on the CPU, on tiny laguna and qwen35moe files: the all-resident row, a
calibration that writes the routing profile, the Spark row placed by it, llama-bench's command lines for the
same expert bytes, and the report. The speeds mean nothing here (2 shared cores); the fields must be sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lucebox_core import cli
from lucebox_core.spark import RoutingProfile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_spark.py"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three model loads, a 24-token calibration and two tiny tg runs: ~20-40 s on 2 cores
@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_the_spark_benchmark_runs_end_to_end_on_tiny_files(tmp_path, arch):
    model = tmp_path / f"{arch}-tiny-q8_0.gguf"
    assert cli.main(["synth", "--arch", arch, "--size", "tiny", "--type", "q8_0", "--seed", "4", "--router-skew",
                     "0.6", "-o", str(model)]) == 0
    RoutingProfile.path_for(model).write_text("layer,expert,count\n0,0,999\n")  # a stale profile: replaced
    out = tmp_path / "spark.json"
    done = _script("lucebox", "-m", str(model), "--device", "cpu", "-n", "4", "-r", "1", "--calibrate", "24",
                   "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    full, calibration, spark = report["rows"]
    assert [r["phase"] for r in report["rows"]] == ["full", "calibrate", "spark"]
    assert report["layout"]["routing"] == "skewed (router skew 0.6)"
    total = report["layout"]["expert_bytes"]
    assert full["resident_expert_bytes"] == total and full["tokens_per_s"] > 0 and full["device"] == "cpu"
    # The calibration decoded its tokens and wrote a profile of this traffic alone (the stale one is gone).
    assert calibration["tokens_decoded"] == 24 and not calibration["cut_short"]
    counts = RoutingProfile.load(calibration["profile"], *_shape(model)).counts
    assert int(counts[0, 0]) < 999 and int(counts.sum()) > 0
    assert 0.35 <= calibration["profile_hot_share"] <= 1
    # The Spark row: under the budget, fewer expert bytes resident than all of them, a hit rate in [0, 1].
    assert spark["resident_expert_bytes"] <= spark["budget_bytes"] == int(0.6 * total) < total
    assert 0 < spark["residency"] < 1 and 0 <= spark["hit_rate"] <= 1
    assert spark["hits"] + spark["misses"] > 0 and spark["bytes_moved"] >= 0 and spark["tokens_per_s"] > 0
    assert report["spark_vs_full"] == round(spark["tokens_per_s"] / full["tokens_per_s"], 4)
    # Plain torch on the CPU records no graphs: every step eager, Spark's too (its eager lookup, no host reads).
    assert full["graphed_step"] is False and spark["graphed_step"] is False and spark["graphed"] is False
    assert spark["zero_copy_reads"] == 0 and spark["zero_copy_reads_per_token"] == 0
    assert all(r["torch_max_allocated_bytes"] is None for r in report["rows"])  # no CUDA here
    # llama.cpp at the same expert bytes: -ngl 99 -fa 1 -p 0 -n 4, and --n-cpu-moe K leaving <= the budget.
    gpu, offload = report["llama_commands"]
    assert "-ngl 99 -fa 1 -p 0 -n 4 -r 1" in gpu and "--n-cpu-moe" not in gpu
    k = int(offload.split("--n-cpu-moe ")[1])
    assert 0 < k <= report["layout"]["n_layer"]
    table = _script("report", str(out))
    assert table.returncode == 0 and "lucebox --spark 0.6 of the experts (eager step)" in table.stdout


def _shape(model: Path) -> tuple[int, int]:
    from lucebox_core.ggufio import GGUFFile

    gguf = GGUFFile(model)
    arch = gguf.architecture
    layers = sum(1 for name in gguf.tensors if name.endswith("ffn_gate_exps.weight"))
    return layers, int(gguf.metadata[f"{arch}.expert_count"])


def test_llama_offload_keeps_at_most_the_budget_on_the_gpu():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_spark

    # Laguna's shape: a dense layer 0, then MoE layers of equal expert bytes.
    layout = {"expert_bytes": 39 * 100, "expert_bytes_per_layer": {str(i): 100 for i in range(1, 40)}}
    k, on_gpu = bench_spark.n_cpu_moe_for(layout, int(0.6 * 3900))
    assert (k, on_gpu) == (17, 2300)  # layers 0..16 to the host: 16 MoE layers, 23 of 39 left (59%)
    assert bench_spark.n_cpu_moe_for(layout, 3900) == (0, 3900)
    commands = bench_spark.llama_commands("lb", "m.gguf", layout, 0.6, 128, 3)
    assert commands[1]["command"][-2:] == ["--n-cpu-moe", "17"]
    assert commands[1]["override_tensor"].startswith("blk\\.(0|1|2|")
