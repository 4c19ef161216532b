"""The benchmark on an AMD machine: `scripts/bench_amd.sh` runs `bench_vs_llamacpp.sh` with the hip backend and
refuses, with the backend's reason, where it cannot run; the table names the HIP runtime."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_vs_llamacpp as bench  # noqa: E402


def test_the_default_backend_follows_the_torch_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
    assert bench._default_backend() == "hip"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert bench._default_backend() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench._default_backend() is None


def test_the_table_names_the_hip_runtime(tmp_path):
    header = {"kind": "header", "part": "all", "date_utc": "2026-12-03 10:00 UTC", "gpu": "AMD Radeon RX 7900 XTX",
              "driver": "-", "torch": "2.11.0+rocm6.4", "cuda": "-", "hip": "6.4.43482", "commit": "abc1234",
              "copy_gb_s": 800.0}
    row = {"engine": "lucebox", "model": "qwen35-27b-q4_k_m", "test": "tg128", "tokens_per_s": 20.0, "backend": "hip",
           "activations": "bfloat16", "kv_types": "bf16/bf16", "weight_bytes_per_token": 10**9, "n_gen": 128,
           "weight_GB_per_s": 20.0, "graph_windows": 1, "graph_failure": None}
    (tmp_path / "header.json").write_text(json.dumps(header))
    (tmp_path / "lucebox.json").write_text(json.dumps([row]))
    bench.main(["table", str(tmp_path / "header.json"), str(tmp_path / "lucebox.json"), "--md", str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    assert "| 2.11.0+rocm6.4 / HIP 6.4.43482 |" in text and "Lucebox: hip, bfloat16 activations" in text


def test_bench_amd_refuses_without_a_usable_hip_backend(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "scripts" / "bench_amd.sh")], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path), "LLAMA_BENCH": "/nonexistent"}, timeout=120)
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return  # an AMD machine: the script would run the benchmark
    assert run.returncode == 2
    assert "the hip backend cannot run here:" in run.stderr
    assert ("not a ROCm build" if importlib.util.find_spec("hip") else "hip-python is not installed") in run.stderr
    assert not list(tmp_path.iterdir())  # it stopped before writing anything
