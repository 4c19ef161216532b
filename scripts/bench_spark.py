"""Spark's benchmark (#14): a MoE GGUF's decode speed all on the GPU and with a bounded expert residency, beside
llama.cpp's at the same expert bytes on the GPU.

`lucebox`: three fresh processes on one file, each a load of its own (so the peak memory is the row's):

- `full`: every expert resident. tg N as `lucebox bench` measures it (an untimed run at its shape first, then
  `-r` runs of N random tokens fed one at a time, the host waiting for the device after each; the median).
- `calibrate`: Spark at the budget below, from no profile (an existing `MODEL.gguf.spark.csv` is replaced):
  sampled decoding (temperature 1) of `--calibrate` tokens, in requests of up to 256, for about
  `--calibrate-seconds` (the requests sized to end near it); the routing profile it counted is written
  beside the model (after every request: a phase cut short keeps what it counted), as the server does at exit.
- `spark`: a fresh load with `--spark --spark-vram B`, B = `--residency` of the file's expert bytes, placed by
  that profile; tg N as above, with the pools' hit rate, misses, bytes moved, pairs read from host memory
  (`zero_copy_reads`) and promotions counted after the warm-up run. Where the backend runs Spark's paged
  kernel the decode step replays as one graph (`graphed_step`, on every row: the full row's too).

Each row: tok/s, per-token ms (median, p90, max), load seconds, the experts' bytes resident on the device, peak
device memory (torch's allocator peak; with nvidia-smi on the PATH, the whole GPU's peak used, comparable with
llama.cpp's). `spark_vs_full` is the spark row's speed over the full row's.

`llama`: llama-bench on the same file, all on the GPU (`-ngl 99 -fa 1 -p 0 -n N`) and with `--n-cpu-moe K`, K
the fewest leading layers whose experts go to host memory so that the experts left on the GPU fit the same
budget (`--print-only`: the command lines). `report`: the rows of several JSON files as one markdown table, with
the issue's targets checked.

Random weights route close to uniformly over the experts: the worst case for an expert cache (a uniform
profile places nothing better than any other choice). `lucebox synth --router-skew F` writes the realistic
case, routers biased toward a fixed hot set; the file's name says which (`routing` in the JSON).

    python scripts/bench_spark.py lucebox -m laguna-xs2-q4_k_m.gguf --residency 0.6 --json spark.json
    python scripts/bench_spark.py llama -m laguna-xs2-q4_k_m.gguf --llama-bench /path/llama-bench --json llama.json
    python scripts/bench_spark.py report spark.json llama.json --md spark.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

EXPERT_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
CALIBRATE_CHUNK = 256  # tokens decoded a request during calibration
CALIBRATE_PROMPT = 16
CALIBRATE_PROBE = 32  # the first request's tokens, which time the rest
PHASES = ("full", "calibrate", "spark")
HOT_SHARE = 0.35  # the share of experts whose picks `profile_hot_share` reports (as synth's hot set)


# -- the file: expert bytes per layer, the budget, llama.cpp's matching --n-cpu-moe ------------------------------


def expert_layout(path: str | os.PathLike) -> dict[str, Any]:
    """The file's routed-expert bytes per layer (gate, up and down stacks) and what its name says of its routing."""
    from lucebox_core.ggufio import GGUFFile

    gguf = GGUFFile(path)
    per_layer: dict[int, int] = {}
    for name, info in gguf.tensors.items():
        match = EXPERT_STACK.match(name)
        if match:
            per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + info.n_bytes
    if not per_layer:
        raise SystemExit(f"{path}: no routed-expert tensors (blk.N.ffn_*_exps.weight): not a MoE file")
    name = str(gguf.metadata.get("general.name", ""))
    skew = re.search(r"router skew ([0-9.]+)", name)
    return {"architecture": gguf.architecture, "n_layer": int(gguf.metadata.get(f"{gguf.architecture}.block_count", 0)),
            "expert_bytes_per_layer": {str(k): v for k, v in sorted(per_layer.items())},
            "expert_bytes": sum(per_layer.values()), "weight_bytes": sum(i.n_bytes for i in gguf.tensors.values()),
            "routing": (f"skewed (router skew {skew.group(1)})" if skew
                        else "random (close to uniform: a cache's worst case)")}


def n_cpu_moe_for(layout: dict[str, Any], budget: int) -> tuple[int, int]:
    """llama.cpp's `--n-cpu-moe K` (the experts of layers 0..K-1 in host memory) for the fewest such layers that
    leave at most `budget` expert bytes on the GPU, and the bytes left."""
    per_layer = {int(k): v for k, v in layout["expert_bytes_per_layer"].items()}
    on_gpu = layout["expert_bytes"]
    for k in range(0, max(per_layer) + 2):
        if on_gpu <= budget:
            return k, on_gpu
        on_gpu -= per_layer.get(k, 0)
    return max(per_layer) + 1, 0


def llama_commands(binary: str, model: str, layout: dict[str, Any], residency: float, n_gen: int,
                   reps: int) -> list[dict[str, Any]]:
    """llama-bench's all-GPU and expert-offload command lines for this file and residency."""
    budget = int(layout["expert_bytes"] * residency)
    k, on_gpu = n_cpu_moe_for(layout, budget)
    base = [binary, "-m", model, "-ngl", "99", "-fa", "1", "-p", "0", "-n", str(n_gen), "-r", str(reps), "-o", "json"]
    layers = "|".join(str(i) for i in range(k))
    return [{"label": "llama.cpp all on GPU", "n_cpu_moe": 0, "gpu_expert_bytes": layout["expert_bytes"],
             "command": base},
            {"label": f"llama.cpp --n-cpu-moe {k}", "n_cpu_moe": k, "gpu_expert_bytes": on_gpu,
             "residency": round(on_gpu / layout["expert_bytes"], 4), "command": [*base, "--n-cpu-moe", str(k)],
             # the same placement with -ot, for llama.cpp builds without --n-cpu-moe
             "override_tensor": f"blk\\.({layers})\\.ffn_(up|down|gate)_exps=CPU" if k else None}]


# -- device memory -----------------------------------------------------------------------------------------------


class GpuPeak:
    """The GPU's peak memory used (nvidia-smi, every 0.2 s) while the block runs; None without nvidia-smi."""

    def __init__(self, index: int = 0):
        self.index, self.peak_bytes = index, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "-i", str(self.index), "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                used = int(out.stdout.split()[0]) * 2**20
                self.peak_bytes = max(self.peak_bytes or 0, used)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.2)

    def __enter__(self) -> GpuPeak:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=6)


def _gpu_index(device: str | None) -> int:
    return int(device.split(":")[1]) if device and device.startswith("cuda:") else 0


def torch_memory(device: Any) -> dict[str, Any]:
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return {"torch_max_allocated_bytes": None, "torch_max_reserved_bytes": None, "device_used_bytes": None}
    free, total = torch.cuda.mem_get_info(device)
    return {"torch_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "torch_max_reserved_bytes": torch.cuda.max_memory_reserved(device), "device_used_bytes": total - free}


# -- one phase, in its own process --------------------------------------------------------------------------------


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_rows(assembled: Any, n_gen: int, reps: int) -> dict[str, Any]:
    """tg `n_gen` as `lucebox bench` measures it (warm-up run at this shape, then `reps` runs; the median),
    with Spark's pool counters reset after the warm-up."""
    import torch

    from lucebox_core.bench import DECODE_WARMUP_STEPS
    from lucebox_core.spark import SlotStats

    engine, model, spark = assembled.engine, assembled.loaded.model, assembled.spark
    sync = engine.backend.synchronize
    replayed: list[bool] = []  # per run: whether its decode steps replayed a recorded graph

    def run(seed: int) -> list[float]:
        sequence = engine.new_sequence()
        ids = _random_ids(DECODE_WARMUP_STEPS + n_gen, model.vocab_size, seed)
        for token in ids[:DECODE_WARMUP_STEPS]:
            model.forward(sequence.state, torch.tensor([token]))
        sync()
        token_s = []
        for token in ids[DECODE_WARMUP_STEPS:]:
            before = time.perf_counter()
            model.forward(sequence.state, torch.tensor([token]))
            sync()  # as llama-bench: the host waits for every token
            token_s.append(time.perf_counter() - before)
        step = sequence.state.decode  # the static decode step (None where one-token forwards run eagerly)
        replayed.append(bool(step is not None and step.graphs and step.failure is None and len(step)))
        engine.release(sequence)
        return token_s

    run(1000)  # the warm-up at this shape (kernels tuned, graphs recorded; the pools settle)
    if spark is not None:
        for layer in spark.layers:
            for pool in layer.pools:
                pool.stats = SlotStats()
    runs = [run(rep) for rep in range(reps)]
    seconds = statistics.median(sum(r) for r in runs)
    token_ms = sorted(s * 1e3 for r in runs for s in r)
    row = {"test": f"tg{n_gen}", "tokens_per_s": n_gen / seconds, "seconds": seconds,
           "token_ms_median": round(statistics.median(token_ms), 3),
           "token_ms_p90": round(token_ms[int(0.9 * (len(token_ms) - 1))], 3), "token_ms_max": round(token_ms[-1], 3),
           # whether every timed run's decode step was one replayed graph (with Spark: over its paged experts)
           "graphed_step": bool(replayed) and all(replayed)}
    if spark is not None:
        if spark.graphed is not None:
            spark.graphed.account()  # the last step's routing, counted in
        described = spark.describe()
        row.update({key: described[key] for key in ("residency", "hits", "misses", "hit_rate", "bytes_moved",
                                                     "zero_copy_reads", "promotions", "graphed")})
        # every token fed after the warm-up run, the two untimed ones a run starts with included
        fed = max(1, (DECODE_WARMUP_STEPS + n_gen) * reps)
        row["bytes_moved_per_token"] = described["bytes_moved"] // fed
        row["zero_copy_reads_per_token"] = round(described["zero_copy_reads"] / fed, 2)
    return row


def calibrate(assembled: Any, tokens: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    """Sampled decoding of up to `tokens` tokens (at most `seconds`), then the profile written beside the model."""
    from lucebox_core.engine import GenerationRequest
    from lucebox_core.sampling import SamplingParams

    engine, vocab = assembled.engine, assembled.loaded.model.vocab_size
    done, start, request = 0, time.perf_counter(), 0
    while done < tokens and (left := seconds - (time.perf_counter() - start)) > 0:
        # The first request a short one, its rate then sizing the others to end near the time limit.
        rate = done / (seconds - left) if done else None
        chunk = min(CALIBRATE_CHUNK, tokens - done, max(1, int(rate * left)) if rate else CALIBRATE_PROBE)
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed + request)
        result = engine.generate(GenerationRequest(
            prompt_ids=_random_ids(CALIBRATE_PROMPT, vocab, seed + request), ignore_eos=True,
            max_tokens=chunk, sampling=sampling))
        done += len(result.token_ids)
        request += 1
        assembled.spark.save_profile()
    elapsed = time.perf_counter() - start
    return {"tokens_decoded": done, "requests": request, "seconds": round(elapsed, 2),
            "tokens_per_s": done / elapsed if elapsed else None, "cut_short": done < tokens,
            "profile": str(assembled.spark.profile_path), "profile_hot_share": profile_hot_share(assembled.spark)}


def profile_hot_share(spark: Any) -> float | None:
    """The share of counted picks that went to each layer's most picked `HOT_SHARE` of experts (uniform
    routing: a little above HOT_SHARE; a skewed router: about its F)."""
    counts = spark.profile.counts
    total = int(counts.sum())
    if not total:
        return None
    top = max(1, round(HOT_SHARE * counts.shape[1]))
    return round(int(counts.sort(dim=1, descending=True).values[:, :top].sum()) / total, 4)


def phase_main(args: argparse.Namespace) -> int:
    import torch

    from lucebox_core.assembly import EngineOptions, build_engine
    from lucebox_core.bench import DECODE_WARMUP_STEPS

    layout = expert_layout(args.model)
    spark = args.phase != "full"
    budget = int(layout["expert_bytes"] * args.residency)
    context = max(DECODE_WARMUP_STEPS + args.n_gen, CALIBRATE_PROMPT + CALIBRATE_CHUNK) + 16
    options = EngineOptions(model=args.model, ctx_size=context, backend=args.backend, device=args.device,
                            spark=spark, spark_vram=str(budget) if spark else None,
                            spark_promote=args.promote if spark else None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    assembled = build_engine(options)
    load_s = time.perf_counter() - start
    loaded = assembled.loaded
    device = torch.device(loaded.model.ops.device)
    row: dict[str, Any] = {"phase": args.phase, "engine": "lucebox", "backend": loaded.backend_name,
                           "device": str(device), "load_s": round(load_s, 2)}
    if spark:
        row["label"] = f"lucebox --spark {args.residency:g} of the experts" + (
            f", --spark-promote {args.promote}" if args.promote is not None else "")
        row["promotion_bytes"] = assembled.spark.promotion_bytes
        row["budget_bytes"] = budget
        row["resident_expert_bytes"] = sum(pool.stack.nbytes for layer in assembled.spark.layers
                                           for pool in layer.pools)
    else:
        row["label"] = "lucebox all on GPU" if device.type == "cuda" else "lucebox all resident"
        row["resident_expert_bytes"] = layout["expert_bytes"]
    if args.phase == "calibrate":
        row.update(calibrate(assembled, args.calibrate, args.calibrate_seconds))
    else:
        row.update(decode_rows(assembled, args.n_gen, args.reps))
    row.update(torch_memory(device))
    Path(args.result).write_text(json.dumps(row, indent=2))
    return 0


# -- lucebox: the three phases -------------------------------------------------------------------------------------


def run_phase(args: argparse.Namespace, phase: str, folder: Path) -> dict[str, Any]:
    result = folder / f"{phase}.json"
    command = [sys.executable, __file__, "phase", phase, "-m", args.model, "--residency", str(args.residency),
               "-n", str(args.n_gen), "-r", str(args.reps), "--calibrate", str(args.calibrate),
               "--calibrate-seconds", str(args.calibrate_seconds), "--result", str(result)]
    for flag, value in (("--device", args.device), ("--backend", args.backend), ("--promote", args.promote)):
        if value:
            command += [flag, value]
    print(f"--- {phase}: {' '.join(command[2:])}", flush=True)
    start = time.perf_counter()
    with GpuPeak(_gpu_index(args.device)) as peak:
        try:
            completed = subprocess.run(command, timeout=args.phase_timeout)
            error = None if completed.returncode == 0 else f"exit status {completed.returncode}"
        except subprocess.TimeoutExpired:
            error = f"killed after {args.phase_timeout} s (--phase-timeout)"
    if error is None and not result.is_file():
        error = "no result written"
    row = json.loads(result.read_text()) if error is None else {"phase": phase, "engine": "lucebox", "error": error}
    row["wall_s"] = round(time.perf_counter() - start, 2)
    row["gpu_peak_used_bytes"] = peak.peak_bytes
    print(f"--- {phase}: " + (f"error: {error}" if error else _summary(row)), flush=True)
    return row


def _summary(row: dict[str, Any]) -> str:
    parts = [row.get("label", row.get("phase", "?"))]
    if row.get("tokens_per_s") is not None:
        parts.append(f"{row['tokens_per_s']:.2f} tok/s")
    for key, text in (("hit_rate", "hit rate"), ("profile_hot_share", "top-35% share"),
                      ("tokens_decoded", "tokens")):
        if row.get(key) is not None:
            parts.append(f"{text} {row[key]}")
    for key in ("resident_expert_bytes", "gpu_peak_used_bytes", "torch_max_allocated_bytes"):
        if row.get(key):
            parts.append(f"{key.removesuffix('_bytes')} {row[key] / 2**30:.2f} GiB")
    return ", ".join(parts)


def lucebox_main(args: argparse.Namespace) -> int:
    from lucebox_core.spark import RoutingProfile

    layout = expert_layout(args.model)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - set(PHASES):
        raise SystemExit(f"--phases: choose among {','.join(PHASES)}, got {args.phases!r}")
    folder = Path(args.workdir or Path(args.json or args.model).parent) / f".bench_spark_{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "residency": args.residency,
              "budget_bytes": int(layout["expert_bytes"] * args.residency), "n_gen": args.n_gen, "reps": args.reps,
              "layout": layout, "rows": [], "spark_vs_full": None,
              "llama_commands": [" ".join(c["command"]) for c in llama_commands(
                  "llama-bench", args.model, layout, args.residency, args.n_gen, args.reps)]}
    rows = report["rows"]
    for phase in [p for p in PHASES if p in phases]:
        profile = RoutingProfile.path_for(args.model)
        if phase == "calibrate" and profile.is_file():  # from no profile: the placement is this run's traffic alone
            print(f"--- replacing {profile}", flush=True)
            profile.unlink()
        rows.append(run_phase(args, phase, folder))
        rates = {row["phase"]: row.get("tokens_per_s") for row in rows}
        if rates.get("full") and rates.get("spark"):
            report["spark_vs_full"] = round(rates["spark"] / rates["full"], 4)
        if args.json:  # after every phase: a call cut short keeps the rows it finished
            Path(args.json).write_text(json.dumps(report, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    print(f"spark / full: {report['spark_vs_full']} ({layout['routing']})", flush=True)
    return 0 if all("error" not in row for row in rows) else 1


# -- llama.cpp ------------------------------------------------------------------------------------------------------


def llama_main(args: argparse.Namespace) -> int:
    layout = expert_layout(args.model)
    commands = llama_commands(args.llama_bench, args.model, layout, args.residency, args.n_gen, args.reps)
    if args.print_only:
        for entry in commands:
            print(" ".join(entry["command"]))
            if entry.get("override_tensor"):
                print(f"  (or, for the same placement: -ot '{entry['override_tensor']}')")
        return 0
    rows: list[dict[str, Any]] = []
    report = {"model": args.model, "residency": args.residency, "layout": layout, "rows": rows}
    wanted = {"gpu": 0, "offload": 1}
    for entry in [commands[wanted[r.strip()]] for r in args.rows.split(",") if r.strip() in wanted]:
        print(f"--- {entry['label']}: {' '.join(entry['command'])}", flush=True)
        row = {key: value for key, value in entry.items() if key != "command"}
        row.update({"engine": "llama.cpp", "command": " ".join(entry["command"]), "test": f"tg{args.n_gen}"})
        with GpuPeak() as peak:
            try:
                completed = subprocess.run(entry["command"], capture_output=True, text=True, timeout=args.timeout)
                results = json.loads(completed.stdout) if completed.returncode == 0 else None
                if results:
                    row.update({"tokens_per_s": results[0]["avg_ts"], "stddev_tokens_per_s": results[0]["stddev_ts"]})
                else:
                    row["error"] = f"exit status {completed.returncode}: {completed.stderr[-600:]}"
            except subprocess.TimeoutExpired:
                row["error"] = f"killed after {args.timeout} s"
            except OSError as exc:
                row["error"] = f"cannot run {args.llama_bench} ({exc})"
            except (json.JSONDecodeError, KeyError, IndexError) as exc:
                row["error"] = f"unreadable llama-bench output ({exc})"
        row["gpu_peak_used_bytes"] = peak.peak_bytes
        print(f"--- {row['label']}: " + (f"error: {row['error']}" if "error" in row else _summary(row)), flush=True)
        rows.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in row for row in rows) else 1


# -- report ---------------------------------------------------------------------------------------------------------


def report_main(args: argparse.Namespace) -> int:
    by_model: dict[str, list[dict[str, Any]]] = {}
    layouts: dict[str, dict[str, Any]] = {}
    for path in args.files:
        if not Path(path).is_file():  # a step that did not run (a shell glob left as it was)
            print(f"(no {path})", file=sys.stderr)
            continue
        data = json.loads(Path(path).read_text())
        name = Path(data["model"]).name
        layouts[name] = data["layout"]
        by_model.setdefault(name, []).extend(data["rows"])
    lines = []
    for name, rows in by_model.items():
        lines += [f"### {name}: {layouts[name]['routing']}", "",
                  "| engine | config | tg tok/s | vs lucebox full | hit rate | moved MiB/token | experts on GPU GiB | "
                  "GPU peak GiB |", "|---|---|---|---|---|---|---|---|"]
        full = _full_row(name, by_model, layouts)
        if full is not None and full not in rows:
            lines.insert(-2, f"(no full row for this file: compared with {full['_file']}'s, the same layout)\n")
        for row in rows:
            if row.get("phase") == "calibrate" and "error" not in row:
                lines.append(f"| lucebox | calibration: {row.get('tokens_decoded')} tokens decoded, top-35% "
                             f"share {row.get('profile_hot_share')} | {_num(row.get('tokens_per_s'))} | | | | | |")
                continue
            rate = row.get("tokens_per_s")
            versus = f"{rate / full['tokens_per_s']:.2f}" if rate and full else ""
            moved = row.get("bytes_moved_per_token")
            experts = row.get("resident_expert_bytes", row.get("gpu_expert_bytes"))
            step = {True: " (graphed step)", False: " (eager step)"}.get(row.get("graphed_step"), "")
            lines.append(f"| {row.get('engine', '?')} | {row.get('label', row.get('phase'))}{step}"
                         f"{' ERROR ' + str(row['error'])[:80] if 'error' in row else ''} | {_num(rate)} | {versus} | "
                         f"{_num(row.get('hit_rate'), 3)} | {_num(moved and moved / 2**20)} | "
                         f"{_num(experts and experts / 2**30)} | {_num(_peak(row))} |")
        lines += ["", *_targets(rows if full is None or full in rows else [full, *rows]), ""]
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


def _full_row(name: str, by_model: dict[str, list[dict[str, Any]]],
              layouts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The file's all-resident row, or else one of another file with the same experts (a skewed file and its
    random-router twin differ only in their routers' values)."""
    for other in [name, *by_model]:
        same = layouts[other]["expert_bytes_per_layer"] == layouts[name]["expert_bytes_per_layer"]
        row = next((r for r in by_model[other] if r.get("phase") == "full" and r.get("tokens_per_s")), None)
        if same and row is not None:
            return row if other == name else {**row, "_file": other}
    return None


def _num(value: Any, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _peak(row: dict[str, Any]) -> float | None:
    peak = row.get("gpu_peak_used_bytes") or row.get("torch_max_reserved_bytes")
    return peak / 2**30 if peak else None


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, where the rows to check them are present."""
    def rate(predicate: Any) -> float | None:
        return next((r["tokens_per_s"] for r in rows if r.get("tokens_per_s") and predicate(r)), None)

    full = rate(lambda r: r.get("phase") == "full")
    spark = rate(lambda r: r.get("phase") == "spark")
    llama_gpu = rate(lambda r: r.get("engine") == "llama.cpp" and r.get("n_cpu_moe") == 0)
    llama_off = rate(lambda r: r.get("engine") == "llama.cpp" and r.get("n_cpu_moe"))
    checks = [("all on GPU >= 2x llama.cpp", full, llama_gpu, 2.0),
              ("Spark >= 90% of all on GPU", spark, full, 0.9),
              ("Spark >= 2x llama.cpp's expert offload at the same expert bytes", spark, llama_off, 2.0)]
    return [f"- {text}: {mine / theirs:.2f}x, {'met' if mine / theirs >= want else 'MISSED'}"
            for text, mine, theirs, want in checks if mine and theirs]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("-m", "--model", required=True, help="MoE GGUF file")
        q.add_argument("--residency", type=float, default=0.6, help="share of the experts' bytes resident with Spark "
                       "(and left on the GPU by llama.cpp's --n-cpu-moe) (default 0.6)")
        q.add_argument("-n", "--n-gen", type=int, default=128, help="tokens decoded per run (default 128)")
        q.add_argument("-r", "--reps", type=int, default=3, help="repetitions, the median reported (default 3)")

    def lucebox_options(q: argparse.ArgumentParser) -> None:
        q.add_argument("--calibrate", type=int, default=2048, help="tokens decoded to calibrate (default 2048)")
        q.add_argument("--calibrate-seconds", type=float, default=120.0,
                       help="stop calibrating after this long, tokens or not (default 120)")
        q.add_argument("--device", help="torch device, e.g. cuda:0 or cpu")
        q.add_argument("--backend", help="kernel backend (default: the best available)")
        q.add_argument("--promote", metavar="SIZE", help="Spark's --spark-promote: expert bytes promoted between "
                       "two decode steps at most (default: the engine's, 24M; 0: none)")

    q = commands.add_parser("lucebox", help="the full, calibrate and spark rows, each a fresh process")
    common(q)
    lucebox_options(q)
    q.add_argument("--phase-timeout", type=float, default=300.0, help="seconds a phase may take (default 300)")
    q.add_argument("--phases", default=",".join(PHASES), help="which rows, in this order (default "
                   "full,calibrate,spark; e.g. calibrate,spark beside another file's full row of the same layout)")
    q.add_argument("--workdir", help="where the phases' results go meanwhile (default: beside --json)")
    q.add_argument("--json", help="write the rows to this file")
    q.set_defaults(run=lucebox_main)

    q = commands.add_parser("phase", help="one phase in this process (what `lucebox` runs)")
    q.add_argument("phase", choices=["full", "calibrate", "spark"])
    common(q)
    lucebox_options(q)
    q.add_argument("--result", required=True, help="write the row to this file")
    q.set_defaults(run=phase_main)

    q = commands.add_parser("llama", help="llama-bench all on GPU and with --n-cpu-moe at the same expert bytes")
    common(q)
    q.add_argument("--llama-bench", default="llama-bench", help="the llama-bench binary (default: on the PATH)")
    q.add_argument("--timeout", type=float, default=180.0, help="seconds a llama-bench run may take (default 180)")
    q.add_argument("--print-only", action="store_true", help="print the command lines, run nothing")
    q.add_argument("--rows", default="gpu,offload", help="gpu (all on GPU), offload (--n-cpu-moe) or both "
                   "(default gpu,offload)")
    q.add_argument("--json", help="write the rows to this file")
    q.set_defaults(run=llama_main)

    q = commands.add_parser("report", help="the rows of JSON files from `lucebox` and `llama` as one table")
    q.add_argument("files", nargs="+", help="JSON files written by the other commands")
    q.add_argument("--md", help="also write the table to this file")
    q.set_defaults(run=report_main)
    args = p.parse_args(argv)
    if hasattr(args, "residency") and not 0 < args.residency <= 1:
        p.error(f"--residency must be in (0, 1], got {args.residency}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
