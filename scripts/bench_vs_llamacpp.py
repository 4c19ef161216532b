"""Helpers of `bench_vs_llamacpp.sh`: Lucebox's side of the benchmark, the memory check, and the merged table.

    python3 scripts/bench_vs_llamacpp.py header --json H.json [--part A] [--commit SHA]
    python3 scripts/bench_vs_llamacpp.py lucebox MODEL.gguf --tests pp512,pp4096,tg128,tg128@d8192 [-r 3] --json OUT.json
    python3 scripts/bench_vs_llamacpp.py memory MODEL.gguf --ctx 32768 --cache-types f16,q8_0 --json OUT.json
    python3 scripts/bench_vs_llamacpp.py table FILE.json [FILE.json ...] [--json MERGED.json] [--md TABLE.md]
    python3 scripts/bench_vs_llamacpp.py synth SIZE TYPE PATH
    python3 scripts/bench_vs_llamacpp.py profile MODEL.gguf [--ctx 4096] [--out DIR]

`lucebox` times the tests llama-bench runs, through the library (no CLI: the GPU image lacks the server's
packages): `ppN` prefills N random tokens through the engine's chunked prefill; `tgN` decodes N tokens one
at a time through `model.forward` (the CUDA-graph decode step on a GPU), synchronising after each token
as llama-bench does; `tgN@dD` first prefills D tokens (untimed), keeps the state, and restores it before
each repetition, exactly as llama-bench caches and restores its depth state.

`memory` loads the model once per KV cache type, prefills a context of `--ctx` positions up to the last
few and decodes those, and reports peak allocated / reserved bytes (torch) and the device memory the
process uses (`torch.cuda.mem_get_info`), against the model's own estimate.

`table` merges any mix of: part files written by `table --json`, `lucebox`/`memory` outputs, headers, and
llama-bench `-o json` outputs, into one markdown table (both engines, same file, ratio, weight GB/s and
its share of the copy bandwidth measured in the same run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3
DECODE_WARMUP_STEPS = 2  # the first records the decode step's CUDA graph for the window, the second replays it
MEMORY_TARGET_GIB = 20.0  # issue #5: Qwen3.5-27B Q4_K_M with a 32K context in <= 20 GiB


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- tests, named as llama-bench names them --------------------------------------------------------------


@dataclass(frozen=True)
class BenchTest:
    kind: str  # "pp" (prompt processing) or "tg" (text generation)
    tokens: int
    depth: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}{self.tokens}" + (f" @ d{self.depth}" if self.depth else "")


_TEST = re.compile(r"^(pp|tg)(\d+)(?:\s*@\s*d(\d+))?$")


def parse_tests(text: str) -> list[BenchTest]:
    """`pp512,tg128,tg128@d8192` -> tests. Depth applies to decode only (as llama-bench's `-p 0 -d D`)."""
    tests = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _TEST.match(part)
        if not match:
            raise argparse.ArgumentTypeError(f"bad test {part!r}: expected ppN, tgN or tgN@dD")
        kind, tokens, depth = match.group(1), int(match.group(2)), int(match.group(3) or 0)
        if tokens <= 0 or (depth and kind != "tg"):
            raise argparse.ArgumentTypeError(f"bad test {part!r}: N must be positive, and only tg takes a depth")
        tests.append(BenchTest(kind, tokens, depth))
    return tests


def test_sort_key(name: str) -> tuple:
    match = _TEST.match(name.replace(" ", ""))
    if not match:
        return (2, 0, 0, name)
    return (match.group(1) == "tg", int(match.group(3) or 0), int(match.group(2)), name)


# -- the facts every result needs --------------------------------------------------------------------------


def commit_id(explicit: str | None = None) -> str:
    """The commit to record: given, else $COMMIT / $LUCEBOX_COMMIT (the device gets a copy without .git),
    else git's (with `+wt` when the tree has uncommitted changes), else 'unknown'."""
    for value in (explicit, os.environ.get("COMMIT"), os.environ.get("LUCEBOX_COMMIT")):
        if value:
            return value
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()
        return sha + ("+wt" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def nvidia_smi() -> dict[str, str]:
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.strip().splitlines()[0]
        name, driver, memory = (field.strip() for field in line.split(","))
        return {"gpu": name, "driver": driver, "gpu_memory": memory}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"gpu": "none (nvidia-smi unavailable)", "driver": "-", "gpu_memory": "-"}


def copy_bandwidth_gb_s(device: Any = "cuda", size: int = 2 * GIB, repeats: int = 20) -> float:
    """Device-to-device copy, read + write bytes per second (median of CUDA-event-timed copies)."""
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size / (statistics.median(times) * 1e-3) / 1e9


def environment(commit: str | None = None, part: str = "", measure_copy: bool = True) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "kind": "header", "part": part, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **nvidia_smi(), "torch": torch.__version__, "cuda": torch.version.cuda or "-",
        "hip": getattr(torch.version, "hip", None) or "-",  # a ROCm build (AMD GPUs, the hip backend)
        "python": platform.python_version(), "commit": commit_id(commit),
    }
    if torch.cuda.is_available():
        facts["gpu"] = facts["gpu"] if facts["driver"] != "-" else torch.cuda.get_device_name(0)
        if measure_copy:
            facts["copy_gb_s"] = copy_bandwidth_gb_s()
    return facts


# -- Lucebox's side --------------------------------------------------------------------------------------


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class DecodeSnapshot:
    """A sequence's state at depth, restored before each repetition (llama-bench restores its cached depth
    state the same way). Knows the qwen35 state: KV fill pointers (`kv.rollback`), the Gated DeltaNet conv
    and recurrent tensors (restored in place: a recorded decode graph holds their addresses), the length."""

    def __init__(self, state: Any) -> None:
        self.length = state.length
        self.supported = hasattr(getattr(state, "kv", None), "rollback") and hasattr(state, "linear")
        self.linear = {}
        if self.supported:
            self.linear = {i: (s.conv.clone(), s.recurrent.clone()) for i, s in state.linear.items()}

    def restore(self, state: Any) -> bool:
        """Put `state` back at the snapshot's depth; False if this state kind is not known (it then goes on)."""
        if not self.supported:
            return False
        state.kv.rollback(self.length)
        for i, (conv, recurrent) in self.linear.items():
            state.linear[i].conv.copy_(conv)
            state.linear[i].recurrent.copy_(recurrent)
        state.length = self.length
        return True


def _graph_status(state: Any) -> dict[str, Any]:
    step = getattr(state, "decode", None)  # the decode step's StaticStep
    if step is None:
        return {"graph_windows": 0, "graph_failure": None}
    return {"graph_windows": len(step), "graph_failure": step.failure}


def time_prefill(engine: Any, ids: list[int]) -> float:
    sequence = engine.new_sequence()
    _sync()
    start = time.perf_counter()
    engine.prefill(sequence, ids)
    _sync()
    return time.perf_counter() - start


def time_decode(model: Any, state: Any, tokens: Iterable[Any]) -> float:
    """Seconds to feed `tokens` one at a time, waiting for each (llama-bench's test_gen does the same)."""
    _sync()
    start = time.perf_counter()
    for token in tokens:
        model.forward(state, token)
        _sync()
    return time.perf_counter() - start


def lucebox_tests(loaded: Any, tests: list[BenchTest], reps: int,
                  on_row: Callable[[dict], None] = lambda row: None, warmup_tokens: int = 512,
                  prefill_chunk: int | None = None) -> list[dict]:
    """Time `tests` on a loaded model; one row per test (median over `reps`, every sample kept)."""
    import torch

    from lucebox_core.bench import decode_bytes_per_token
    from lucebox_core.engine import Engine

    model, vocab = loaded.model, loaded.model.vocab_size
    bytes_per_token = decode_bytes_per_token(loaded.gguf)
    common = {"engine": "lucebox", "model": Path(loaded.path).stem, "backend": loaded.backend_name,
              "activations": str(model.ops.dtype).removeprefix("torch."),
              "kv_types": f"{getattr(model, 'cache_type_k', '?')}/{getattr(model, 'cache_type_v', '?')}",
              "weight_bytes_per_token": bytes_per_token}
    # Warm-up: one 512-token chunk and a few decode steps (weights upload, kernels compile, handles load).
    warm = Engine(model, loaded.tokenizer, ctx_size=warmup_tokens + 8)
    start = time.perf_counter()
    warm_sequence = warm.new_sequence()
    warm.prefill(warm_sequence, random_ids(warmup_tokens, vocab, 99))
    time_decode(model, warm_sequence.state, [torch.tensor([7])] * 4)
    del warm_sequence
    log(f"  warm-up (weight upload, kernel compiles) {time.perf_counter() - start:.1f} s")

    rows = []
    for test in tests:
        start = time.perf_counter()
        row: dict[str, Any] = {**common, "test": test.name, "n_prompt": test.tokens if test.kind == "pp" else 0,
                               "n_gen": test.tokens if test.kind == "tg" else 0, "n_depth": test.depth}
        if test.kind == "pp":
            engine = Engine(model, loaded.tokenizer, ctx_size=test.tokens + 1, prefill_chunk=prefill_chunk)
            row["prefill_chunk"] = engine.prefill_chunk
            time_prefill(engine, random_ids(test.tokens, vocab, 77))  # warm-up at this size, as llama-bench's
            samples = [time_prefill(engine, random_ids(test.tokens, vocab, rep)) for rep in range(reps)]
        else:
            engine = Engine(model, loaded.tokenizer, ctx_size=test.depth + test.tokens + DECODE_WARMUP_STEPS + 1)
            sequence = engine.new_sequence()
            if test.depth:
                depth_start = time.perf_counter()
                engine.prefill(sequence, random_ids(test.depth, vocab, 1000 + test.depth))
                row["depth_prefill_s"] = time.perf_counter() - depth_start
            snapshot = DecodeSnapshot(sequence.state)
            token_ids = [torch.tensor([t]) for t in random_ids(test.tokens + DECODE_WARMUP_STEPS, vocab, 5)]
            time_decode(model, sequence.state, token_ids[:DECODE_WARMUP_STEPS])
            samples = []
            for _ in range(reps):
                row["state_restored"] = snapshot.restore(sequence.state)
                samples.append(time_decode(model, sequence.state, token_ids[DECODE_WARMUP_STEPS:]))
            row.update(_graph_status(sequence.state))
            if row["graph_failure"] or (model.ops.device.type == "cuda" and not row["graph_windows"]):
                log(f"  WARNING: {test.name} did not replay a CUDA graph: {row['graph_failure']}")
            del sequence, snapshot
        seconds = statistics.median(samples)
        row.update({"seconds": seconds, "samples_s": samples, "tokens_per_s": test.tokens / seconds})
        if test.kind == "tg":
            row["weight_GB_per_s"] = bytes_per_token * row["tokens_per_s"] / 1e9
        log(f"  {row['model']} {test.name}: {row['tokens_per_s']:,.1f} tok/s (reps {reps}, "
            f"{time.perf_counter() - start:.1f} s)")
        rows.append(row)
        on_row(row)
    return rows


def cmd_lucebox(args: argparse.Namespace) -> int:
    from lucebox_core.loading import load_model

    start = time.perf_counter()
    loaded = load_model(args.model, backend=args.backend, device=args.device, **_cache_options(args.cache_type))
    log(f"loaded {Path(args.model).name} in {time.perf_counter() - start:.1f} s: backend {loaded.backend_name}, "
        f"{loaded.model.ops!r}")
    if args.backend and loaded.backend_name != args.backend:
        raise SystemExit(f"asked for backend {args.backend}, got {loaded.backend_name}")
    rows: list[dict] = []

    def save(row: dict) -> None:  # after every test, so a run killed at its time limit keeps what it measured
        rows.append(row)
        _write_json(args.json, rows)

    lucebox_tests(loaded, args.tests, args.r, on_row=save, prefill_chunk=args.ubatch_size)
    return 0


def _cache_options(cache_type: str | None) -> dict[str, str]:
    return {"cache_type_k": cache_type, "cache_type_v": cache_type} if cache_type else {}


# -- memory ----------------------------------------------------------------------------------------------


def measure_memory(path: str, *, backend: str | None, device: str | None, cache_type: str, ctx: int,
                   decode_steps: int, prefill_chunk: int | None = None) -> dict[str, Any]:
    """Peak device memory of the model with one sequence of `ctx` positions, filled to the end."""
    import torch

    from lucebox_core.engine import Engine
    from lucebox_core.loading import load_model

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    baseline_used = total - free  # the CUDA context and whatever an earlier measurement left
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loaded = load_model(path, backend=backend, device=device, **_cache_options(cache_type))
    model = loaded.model
    engine = Engine(model, loaded.tokenizer, ctx_size=ctx, prefill_chunk=prefill_chunk)
    sequence = engine.new_sequence()
    depth = ctx - decode_steps - DECODE_WARMUP_STEPS
    prefill_start = time.perf_counter()
    engine.prefill(sequence, random_ids(depth, model.vocab_size, 31))
    _sync()
    prefill_s = time.perf_counter() - prefill_start
    row: dict[str, Any] = {
        "kind": "memory", "model": Path(path).stem, "cache_type": cache_type, "ctx": ctx, "depth": depth,
        "backend": loaded.backend_name, "activations": str(model.ops.dtype).removeprefix("torch."),
        "prefill_tok_s": depth / prefill_s,
        "peak_allocated_prefill": torch.cuda.max_memory_allocated(),
        "peak_reserved_prefill": torch.cuda.max_memory_reserved(),
        "kv_bytes": sequence.state.kv.nbytes, "prefill_chunk": engine.prefill_chunk,
    }
    torch.cuda.reset_peak_memory_stats()
    tokens = [torch.tensor([t]) for t in random_ids(decode_steps + DECODE_WARMUP_STEPS, model.vocab_size, 32)]
    time_decode(model, sequence.state, tokens[:DECODE_WARMUP_STEPS])
    decode_s = time_decode(model, sequence.state, tokens[DECODE_WARMUP_STEPS:])
    free, _ = torch.cuda.mem_get_info()
    row.update({
        "decode_tok_s": decode_steps / decode_s, **_graph_status(sequence.state),
        "peak_allocated_decode": torch.cuda.max_memory_allocated(),
        "peak_reserved_decode": torch.cuda.max_memory_reserved(),
        "allocated_end": torch.cuda.memory_allocated(),
        "baseline_used": baseline_used, "used_end": total - free, "gpu_total": total,
        "device_weight_bytes": getattr(model.ops, "device_weight_bytes", None),
        "seconds": time.perf_counter() - start,
    })
    # The whole process at its peak: what the context and libraries hold, plus the allocator's peak.
    row["peak_used_estimate"] = baseline_used + max(row["peak_reserved_prefill"], row["peak_reserved_decode"])
    if hasattr(model, "estimate_memory"):
        estimate = model.estimate_memory(ctx)
        row["estimate_total"] = estimate.total
        row["estimate_parts"] = {"weights": estimate.weights, "kv": estimate.kv, "deltanet": estimate.deltanet,
                                 "logits": estimate.logits}
    row["fits_target"] = row["peak_used_estimate"] <= MEMORY_TARGET_GIB * GIB
    del sequence, engine, model, loaded
    gc.collect()
    torch.cuda.empty_cache()
    return row


def cmd_memory(args: argparse.Namespace) -> int:
    cache_types = args.cache_types.split(",")
    if len(cache_types) > 1:
        # One process per cache type: a second measurement in the same process also counted what the first
        # model left behind (session 2: "q8_0" peaked at the f16 run's 17.6 GiB plus its own).
        rows: list[dict] = []
        for cache_type in cache_types:
            with tempfile.NamedTemporaryFile(suffix=".json") as part:
                command = [sys.executable, __file__, "memory", args.model, "--ctx", str(args.ctx),
                           "--cache-types", cache_type, "--decode", str(args.decode), "--json", part.name]
                command += ["--backend", args.backend] if args.backend else []
                command += ["--device", args.device] if args.device else []
                command += ["--ubatch-size", str(args.ubatch_size)] if args.ubatch_size else []
                if subprocess.run(command).returncode != 0:
                    log(f"memory: the {cache_type} measurement failed")
                    continue
                rows.extend(json.loads(Path(part.name).read_text()))
            _write_json(args.json, rows)
        return 0
    rows = []
    for cache_type in cache_types:
        log(f"memory: {Path(args.model).name}, KV {cache_type}, context {args.ctx}")
        row = measure_memory(args.model, backend=args.backend, device=args.device, cache_type=cache_type,
                             ctx=args.ctx, decode_steps=args.decode, prefill_chunk=args.ubatch_size)
        log(f"  peak allocated {row['peak_allocated_prefill'] / GIB:.2f} GiB (prefill) / "
            f"{row['peak_allocated_decode'] / GIB:.2f} GiB (decode); process at peak ~{row['peak_used_estimate'] / GIB:.2f}"
            f" GiB; estimate {row.get('estimate_total', 0) / GIB:.2f} GiB; {row['seconds']:.0f} s")
        rows.append(row)
        _write_json(args.json, rows)
    return 0


# -- merging and the table -------------------------------------------------------------------------------


def _write_json(path: str | None, value: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(value, indent=1, default=str))
    else:
        print(json.dumps(value, default=str))


def llama_test_name(row: dict) -> str:
    depth = int(row.get("n_depth", 0) or 0)
    if int(row.get("n_gen", 0) or 0) > 0:
        return f"tg{row['n_gen']}" + (f" @ d{depth}" if depth else "")
    return f"pp{row['n_prompt']}" + (f" @ d{depth}" if depth else "")


def llama_row(row: dict) -> dict:
    """A llama-bench `-o json` record as a bench row."""
    return {
        "engine": "llama.cpp", "model": Path(str(row.get("model_filename", "?"))).stem, "test": llama_test_name(row),
        "n_prompt": int(row.get("n_prompt", 0) or 0), "n_gen": int(row.get("n_gen", 0) or 0),
        "n_depth": int(row.get("n_depth", 0) or 0), "tokens_per_s": float(row["avg_ts"]),
        "stddev_tok_s": float(row.get("stddev_ts", 0) or 0), "samples_ns": row.get("samples_ns"),
        "build_commit": row.get("build_commit"), "kv_types": f"{row.get('type_k', '?')}/{row.get('type_v', '?')}",
        "flash_attn": row.get("flash_attn"),
    }


def _read_json(path: str) -> Any:
    text = Path(path).read_text().strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        # llama-bench may print log lines before its JSON array.
        start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
        if start < 0:
            return None
        try:
            return json.loads(text[start:])
        except ValueError:
            return None


def load_results(paths: Iterable[str]) -> dict[str, list[dict]]:
    """Every header, bench row and memory row in `paths`, whatever wrote them. Later files win a (engine,
    model, test) or (model, KV type, context) that several hold."""
    headers: list[dict] = []
    bench: dict[tuple, dict] = {}
    memory: dict[tuple, dict] = {}

    def add(record: dict) -> None:
        if record.get("kind") == "header":
            headers.append(record)
        elif record.get("kind") == "memory":
            memory[(record["model"], record["cache_type"], record["ctx"])] = record
        elif "avg_ts" in record:
            row = llama_row(record)
            bench[(row["engine"], row["model"], row["test"])] = row
        elif record.get("engine") and "tokens_per_s" in record:
            bench[(record["engine"], record["model"], record["test"])] = record

    for path in paths:
        data = _read_json(path)
        if data is None:
            log(f"(skipped {path}: no JSON)")
            continue
        if isinstance(data, dict) and ("rows" in data or "headers" in data):  # a merged part file
            for record in [*data.get("headers", []), *data.get("rows", []), *data.get("memory", [])]:
                add(record)
        elif isinstance(data, dict):
            add(data)
        elif isinstance(data, list):
            for record in data:
                if isinstance(record, dict):
                    add(record)
    # The weight bytes a decode step reads are the file's: give llama.cpp's rows the Lucebox figure.
    weights = {row["model"]: row["weight_bytes_per_token"] for row in bench.values() if row.get("weight_bytes_per_token")}
    for row in bench.values():
        if row["engine"] == "llama.cpp" and row["model"] in weights and row["test"].startswith("tg"):
            row["weight_bytes_per_token"] = weights[row["model"]]
            row["weight_GB_per_s"] = weights[row["model"]] * row["tokens_per_s"] / 1e9
    unique_headers = list({json.dumps(h, sort_keys=True, default=str): h for h in headers}.values())
    return {"headers": unique_headers, "rows": list(bench.values()), "memory": list(memory.values())}


def _rate(value: float | None) -> str:
    return f"{value:,.1f}" if value else "–"


def _bandwidth(row: dict | None, copy_gb_s: float | None) -> str:
    if not row or not row.get("weight_GB_per_s"):
        return ""
    gbs = row["weight_GB_per_s"]
    text = f"{gbs:,.0f}" if gbs >= 10 else f"{gbs:.2f}"
    return f"{text} ({100 * gbs / copy_gb_s:.0f}%)" if copy_gb_s else text


def markdown(results: dict[str, list[dict]]) -> str:
    headers, rows, memory = results["headers"], results["rows"], results["memory"]
    copies = [h["copy_gb_s"] for h in headers if h.get("copy_gb_s")]
    copy_gb_s = statistics.median(copies) if copies else None
    llama_commits = sorted({str(r["build_commit"]) for r in rows if r.get("build_commit")})
    lines = ["## Lucebox vs llama.cpp, same GGUF files, same run", ""]
    if headers:
        lines += ["| part | date | GPU | driver | torch / CUDA or HIP | Lucebox commit | copy GB/s (read + write) |",
                  "| --- | --- | --- | --- | --- | --- | ---: |"]
        for h in headers:
            copy = f"{h['copy_gb_s']:,.0f}" if h.get("copy_gb_s") else "–"
            runtime = f"HIP {h['hip']}" if h.get("hip", "-") != "-" else h.get("cuda")
            lines.append(f"| {h.get('part') or '–'} | {h.get('date_utc')} | {h.get('gpu')} | {h.get('driver')} "
                         f"| {h.get('torch')} / {runtime} | `{h.get('commit')}` | {copy} |")
        lines.append("")
    lucebox_rows = [r for r in rows if r["engine"] == "lucebox"]
    setups = sorted({f"{r.get('backend')}, {r.get('activations')} activations, KV {r.get('kv_types')}"
                     for r in lucebox_rows})
    decode_rows = [r for r in lucebox_rows if r.get("n_gen")]
    graphed = sum(1 for r in decode_rows if r.get("graph_windows") and not r.get("graph_failure"))
    lines.append(f"Lucebox: {'; '.join(setups) or '–'}; decode replayed as a CUDA graph in {graphed} of "
                 f"{len(decode_rows)} decode tests. llama.cpp: "
                 f"{', '.join(llama_commits) or '–'}, `-ngl 99 -fa 1`, KV "
                 f"{', '.join(sorted({r.get('kv_types', '?') for r in rows if r['engine'] == 'llama.cpp'})) or '–'}. "
                 "GB/s: weight bytes a decode step reads x tok/s (KV reads at depth not counted); % of the copy "
                 "bandwidth measured in the same run.")
    lines += ["", "| model | test | Lucebox tok/s | llama.cpp tok/s | Lucebox / llama.cpp | Lucebox weight GB/s "
              "(% copy) | llama.cpp weight GB/s (% copy) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    by_key = {(r["engine"], r["model"], r["test"]): r for r in rows}
    for model in sorted({r["model"] for r in rows}, key=lambda m: (_model_size(m), m)):
        tests = sorted({r["test"] for r in rows if r["model"] == model}, key=test_sort_key)
        for test in tests:
            ours, theirs = by_key.get(("lucebox", model, test)), by_key.get(("llama.cpp", model, test))
            mine_rate = ours["tokens_per_s"] if ours else None
            their_rate = theirs["tokens_per_s"] if theirs else None
            ratio = f"{mine_rate / their_rate:.2f}x" if mine_rate and their_rate else "–"
            note = " (no graph)" if ours and ours.get("n_gen") and ours.get("graph_failure") else ""
            lines.append(f"| {model} | {test} | {_rate(mine_rate)}{note} | {_rate(their_rate)} | {ratio} "
                         f"| {_bandwidth(ours, copy_gb_s)} | {_bandwidth(theirs, copy_gb_s)} |")
    if memory:
        lines += ["", f"### Device memory, one sequence filled to its context (target <= {MEMORY_TARGET_GIB:g} GiB)",
                  "", "| model | KV | context | peak allocated: prefill / decode GiB | process at peak GiB "
                  "(context + peak reserved) | used after decode GiB | estimate GiB | decode tok/s at depth | fits |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for m in sorted(memory, key=lambda m: (m["model"], m["ctx"], m["cache_type"])):
            estimate = f"{m['estimate_total'] / GIB:.2f}" if m.get("estimate_total") else "–"
            lines.append(
                f"| {m['model']} | {m['cache_type']} | {m['ctx']} | {m['peak_allocated_prefill'] / GIB:.2f} / "
                f"{m['peak_allocated_decode'] / GIB:.2f} | {m['peak_used_estimate'] / GIB:.2f} | "
                f"{m['used_end'] / GIB:.2f} | {estimate} | {m['decode_tok_s']:.1f} | "
                f"{'yes' if m['fits_target'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _model_size(model: str) -> float:
    match = re.search(r"(\d+(?:\.\d+)?)b", model)
    return float(match.group(1)) if match else 0.0


def cmd_table(args: argparse.Namespace) -> int:
    results = load_results(args.files)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def cmd_header(args: argparse.Namespace) -> int:
    facts = environment(args.commit, args.part, measure_copy=not args.no_copy)
    log(" | ".join(f"{k} {v}" for k, v in facts.items() if k != "kind"))
    _write_json(args.json, facts)
    return 0


# -- the decode-step profile -----------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    """One decode step timed eagerly, through `decode_step` with graphs, and as a bare replay; then GPU
    kernel time by kernel over replays (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lucebox_core.bench import decode_bytes_per_token
    from lucebox_core.loading import load_model

    loaded = load_model(args.model)
    model = loaded.model
    print(f"profile {Path(args.model).name}: backend {loaded.backend_name}, {model.ops!r}")
    spark = None
    if args.spark is not None:
        from lucebox_core.spark import attach_spark

        # The experts behind Spark's pools, placed by the profile beside the model (uniform without one).
        spark = attach_spark(model, None, model_path=loaded.path, share=args.spark)
    state = model.new_state(args.ctx)
    model.forward(state, torch.randint(0, model.vocab_size, (16,)))
    # Tokens that vary, so the routing does (one token repeated routes the same way every step: Spark's pools
    # would see one expert set).
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (4096,), generator=generator).tolist()
    turn = iter(range(10**9))

    def next_token() -> int:
        return tokens[next(turn) % len(tokens)]

    token = 1000

    def per_step(run: Callable[[], Any], steps: int) -> float:
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        _sync()
        return (time.perf_counter() - start) / steps

    eager = per_step(lambda: model.decode_step(state, next_token(), graphs=False), 8)
    model.decode_step(state, token, graphs=True)  # records the window's graph
    # 256 steps first, with or without Spark, so both profiles attend over the same depth (attention's time
    # grows with it); with Spark they warm the pools up (the accounting promotes the hot misses).
    per_step(lambda: model.decode_step(state, next_token(), graphs=True), 256)
    graphed = statistics.median(per_step(lambda: model.decode_step(state, next_token(), graphs=True), 32)
                                for _ in range(3))
    graph = state.decode.recordings()[0]
    bare = statistics.median(per_step(graph.replay, 32) for _ in range(3))
    weight_bytes = decode_bytes_per_token(loaded.gguf)
    summary: dict[str, Any] = {
        "model": Path(args.model).name, "eager_ms": eager * 1e3, "graph_step_ms": graphed * 1e3,
        "bare_replay_ms": bare * 1e3, "graph_tok_s": 1 / graphed, "weight_GB_per_s": weight_bytes / graphed / 1e9,
        "weight_bytes_per_token": weight_bytes,
    }
    replays = 10
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            if spark is None:
                graph.replay()
            else:  # whole steps: the promotions' copies and table updates between replays count too
                model.decode_step(state, next_token(), graphs=True)
        torch.cuda.synchronize()
    if spark is not None:
        summary["spark"] = spark.describe()
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            kernels.append((event.key, device_us / replays, event.count / replays))
    kernels.sort(key=lambda k: -k[1])
    total = sum(k[1] for k in kernels)
    summary["kernel_us_per_step"] = total
    summary["kernels"] = [{"name": name[:90], "us_per_step": us, "launches_per_step": n} for name, us, n in kernels[:25]]
    print(f"eager {eager * 1e3:.2f} ms | graph step {graphed * 1e3:.3f} ms ({1 / graphed:.1f} tok/s, "
          f"{weight_bytes / graphed / 1e9:.0f} GB/s weights) | bare replay {bare * 1e3:.3f} ms | "
          f"GPU kernel time {total / 1e3:.3f} ms/step in {sum(k[2] for k in kernels):.0f} launches")
    for name, us, n in kernels[:12]:
        print(f"  {us:9.1f} us {us / max(total, 1e-9):6.1%} x{n:5.0f}  {name[:80]}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        suffix = "" if spark is None else f"_spark{args.spark:g}"
        (Path(args.out) / f"profile_{Path(args.model).stem}{suffix}.json").write_text(json.dumps(summary, indent=1))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from lucebox_qwen35 import synth

    start = time.perf_counter()
    synth.write(args.path, size=args.size, type=args.type)
    log(f"wrote {args.path} ({args.size} {args.type}, RANDOM WEIGHTS) in {time.perf_counter() - start:.1f} s")
    return 0


# -- command line ----------------------------------------------------------------------------------------


def _default_backend() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return "hip" if getattr(torch.version, "hip", None) else "cuda"  # a ROCm build reports AMD GPUs as cuda


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("model")
        p.add_argument("--backend", help="kernel backend (default: cuda on an NVIDIA GPU, hip on an AMD one, else the default)")
        p.add_argument("--device", help="torch device, e.g. cpu")
        p.add_argument("--json", help="write the rows here (rewritten after each one) instead of stdout")

    p = sub.add_parser("header", help="date, GPU, driver, torch, CUDA, commit, copy bandwidth")
    p.add_argument("--json")
    p.add_argument("--part", default="")
    p.add_argument("--commit")
    p.add_argument("--no-copy", action="store_true", help="do not measure the copy bandwidth")
    p.set_defaults(run=cmd_header)

    p = sub.add_parser("lucebox", help="Lucebox's side of the benchmark, through the library")
    model_options(p)
    p.add_argument("--tests", type=parse_tests, required=True, help="e.g. pp512,pp4096,tg128,tg128@d8192")
    p.add_argument("-r", type=int, default=3, help="repetitions per test (median reported)")
    p.add_argument("--cache-type", help="KV cache type for K and V (default: the backend's dtype)")
    p.add_argument("-ub", "--ubatch-size", type=int, help="prefill chunk (default: the model's)")
    p.set_defaults(run=cmd_lucebox)

    p = sub.add_parser("memory", help="peak device memory with a full context, per KV cache type")
    model_options(p)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--cache-types", default="f16,q8_0")
    p.add_argument("--decode", type=int, default=64, help="decode steps at the end of the context (timed)")
    p.add_argument("-ub", "--ubatch-size", type=int, help="prefill chunk (default: the model's)")
    p.set_defaults(run=cmd_memory)

    p = sub.add_parser("table", help="merge result files into one markdown table")
    p.add_argument("files", nargs="*")
    p.add_argument("--json", help="write the merged results here")
    p.add_argument("--md", help="write the markdown here")
    p.set_defaults(run=cmd_table)

    p = sub.add_parser("profile", help="where one decode step's time goes")
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--spark", type=float, metavar="SHARE",
                   help="MoE models: the experts behind Spark's slot pools at this share of their bytes (e.g. 0.6); "
                        "whole steps profiled (promotions included)")
    p.add_argument("--out")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("synth", help="write a synthetic qwen35 GGUF")
    p.add_argument("size")
    p.add_argument("type")
    p.add_argument("path")
    p.set_defaults(run=cmd_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "backend", None) is None and hasattr(args, "backend") and args.device is None:
        args.backend = _default_backend()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # a failed graph capture warns once: let every one show
        return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
