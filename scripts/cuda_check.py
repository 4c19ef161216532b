"""GPU-machine check of the CUDA backend: every kernel against references, then timings, then a model.

    python scripts/cuda_check.py [--out DIR] [--commit SHA] [--skip-correctness] [--skip-triton] [--skip-timing]
                                 [--skip-model] [--models tiny:f32,0.8b:q4_k_m] [--steps 64]

1. Correctness, on fresh random inputs each case (random GGUF blocks with sane, non-zero scales; outputs
   poisoned with NaN before each run so an unwritten element fails): matrix-vector products for every
   weight format, activation dtype and a spread of batch sizes, the dequantize-tile kernel, the prefill
   path, and RMSNorm, against a float64 reference (and the torch backend's error alongside, for scale).
2. Timings on 27B-shaped matrices: achieved GB/s of weight bytes per kernel launch (CUDA-graph replays,
   weights rotated through more than the L2 holds, medians) against the measured device copy bandwidth.
3. The Triton kernels: `main()` of `lucebox_cuda.triton_ops` (and of `triton_gdn`, `triton_attention`,
   `triton_fused` where those modules exist), each checking its kernels against the torch reference on
   the GPU (NaN-poisoned outputs, relative error bounds per dtype).
4. Whole models (synthetic tiny F32 and 0.8B Q4_K_M): CudaBackend against TorchBackend in fp32 on the same
   GPU. Prefill logits of a 100-token prompt (the tiled prefill path) within stated bounds; then 64 greedy
   tokens through the engine's decode loop (the recorded CUDA-graph step), which must equal the reference's
   (eager forward calls) or part only at a near-tie: where the reference's top two logits lie within
   TIE_TOLERANCE. Required for fp32 activations; for bf16 the logits bound is relative to torch's own
   bf16 drift and greedy agreement is reported.

Prints a table per part and writes `cuda_check.json` (rewritten after every part) under --out. Exits
non-zero if any kernel case, Triton module or model check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from lucebox_core import quants
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend
from lucebox_cuda import catalogue, nvrtc, tiled_weights
from lucebox_cuda.backend import CudaBackend
from lucebox_cuda.timing import event_times_ms

os.environ.setdefault(tiled_weights.ENV_SWITCH, "0")  # the explicit variants here read GGUF's rows: none tiled

# Relative Frobenius error bounds against the float64 reference, by activation (= output) dtype: the
# kernels accumulate in fp32, so what remains is accumulation order plus one rounding of the output.
MATVEC_BOUND = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}
# The prefill path also rounds the dequantized weights to the activation dtype before cuBLAS.
PREFILL_BOUND = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
NORM_BOUND = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FORMATS = {name: ggml_type for ggml_type, name in catalogue.WEIGHT_FORMATS.items()}

RESULTS: dict = {"correctness": [], "triton": [], "timing": [], "model": {}}


def log(message: str = "") -> None:
    print(message, flush=True)


# -- random weights --------------------------------------------------------------------------------------


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def random_weight(fmt: str, rows: int, cols: int, gen: torch.Generator, device: torch.device) -> QuantTensor:
    """Random GGUF blocks: random quant bits and sub-block scales, fp16 super-scales in a sane positive
    range (so values are O(1) and nothing overflows fp16 activations), never all zeros."""
    ggml_type = FORMATS[fmt]
    if fmt in ("f32", "f16", "bf16"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt]
        values = torch.randn(rows, cols, generator=gen, device=device).to(dtype) * 0.05
        return QuantTensor(f"w_{fmt}", ggml_type, (rows, cols), values.view(torch.uint8).reshape(-1))
    block_values, block_bytes = quants.block_size(ggml_type), quants.type_size(ggml_type)
    blocks = rows * cols // block_values
    raw = torch.randint(0, 256, (blocks, block_bytes), generator=gen, device=device, dtype=torch.uint8)

    def scales(low: float, high: float) -> torch.Tensor:
        return _fp16_bytes(torch.rand(blocks, generator=gen, device=device) * (high - low) + low)

    if fmt in ("q4_k", "q5_k"):
        raw[:, 0:2] = scales(2e-4, 8e-4)  # d: 6-bit scales times 4- or 5-bit quants
        raw[:, 2:4] = scales(2e-4, 8e-4)  # dmin
    elif fmt == "q6_k":
        raw[:, 208:210] = scales(1e-4, 4e-4)  # d: int8 scales times 6-bit quants
    elif fmt in ("q8_0", "q5_0"):  # d first; Q5_0 left random bytes there (NaN scales: session 29's 30 failures)
        raw[:, 0:2] = scales(2e-4, 8e-4)
    return QuantTensor(f"w_{fmt}", ggml_type, (rows, cols), raw.reshape(-1))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double()
    if not torch.isfinite(out64).all():
        return float("nan")
    return float((out64 - ref).norm() / ref.norm())


def record(kind: str, case: str, error: float, bound: float, extra: str = "") -> None:
    ok = error == error and error <= bound  # NaN fails
    RESULTS["correctness"].append({"kind": kind, "case": case, "error": error, "bound": bound, "ok": ok,
                                   "note": extra})
    log(f"{'ok  ' if ok else 'FAIL'} {kind:8s} {case:44s} err {error:.2e} (bound {bound:.0e}) {extra}")


def guarded(kind: str, case: str, fn) -> None:
    try:
        fn()
    except Exception as exc:
        RESULTS["correctness"].append({"kind": kind, "case": case, "error": None, "bound": None, "ok": False,
                                       "note": f"{type(exc).__name__}: {exc}"})
        log(f"FAIL {kind:8s} {case:44s} raised {type(exc).__name__}: {exc}")
        traceback.print_exc()


# -- compile everything first, in parallel, into the disk cache -------------------------------------------


MATVEC_CASES = (
    [(fmt, dtype, batch) for fmt in FORMATS for dtype in DTYPES for batch in (1, 3, 8)]
    + [(fmt, torch.bfloat16, batch) for fmt in FORMATS for batch in (2, 5, 13, 33, 64)]
    + [(fmt, torch.float16, batch) for fmt in catalogue.MMA_FORMATS for batch in (16, 64)]
)


def matvec_variants(fmt: str, dtype: torch.dtype, batch: int) -> list[str]:
    """Every kernel variant that serves this case (the default first)."""
    act = catalogue.ACTIVATIONS[dtype]
    return list(catalogue.MATVEC_VARIANTS) if catalogue.has_mma_kernel(fmt, act, batch) else ["simt"]


def matvec_program(fmt: str, dtype: torch.dtype, batch: int, variant: str) -> nvrtc.KernelProgram:
    return catalogue.matvec_kernel(fmt, catalogue.ACTIVATIONS[dtype], batch, 16, variant).program


def _compile_one(args: tuple[nvrtc.KernelProgram, str]) -> tuple[str, float]:
    program, arch = args
    start = time.perf_counter()
    nvrtc.compile_program(program, arch)
    return program.instantiations[0], time.perf_counter() - start


def precompile(arch: str) -> None:
    programs = {matvec_program(fmt, dtype, batch, variant)
                for fmt, dtype, batch in MATVEC_CASES for variant in matvec_variants(fmt, dtype, batch)}
    programs |= {matvec_program(fmt, torch.bfloat16, batch, variant)
                 for fmt, _, batch in TIMING_CASES for variant in matvec_variants(fmt, torch.bfloat16, batch)}
    programs |= {catalogue.dequant(fmt, catalogue.ACTIVATIONS[d])[0] for fmt in FORMATS for d in DTYPES}
    programs |= {catalogue.rms_norm(catalogue.ACTIVATIONS[a], catalogue.ACTIVATIONS[w])[0]
                 for a in DTYPES for w in DTYPES}
    start = time.perf_counter()
    context = multiprocessing.get_context("fork")  # before any CUDA call in this process
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        times = [t for _, t in pool.map(_compile_one, [(p, arch) for p in programs])]
    log(f"compiled {len(programs)} programs for {arch} in {time.perf_counter() - start:.1f} s wall "
        f"(per program median {statistics.median(times):.2f} s, max {max(times):.2f} s)")
    RESULTS["compile"] = {"programs": len(programs), "wall_s": time.perf_counter() - start,
                          "median_s": statistics.median(times), "max_s": max(times)}


# -- correctness -----------------------------------------------------------------------------------------


def check_matvec(backend: CudaBackend, gen: torch.Generator) -> None:
    """Every variant of each case on the same fresh inputs (the tensor-core and the CUDA-core kernel)."""
    device = backend.device
    for fmt, dtype, batch in MATVEC_CASES:
        shapes = ((1001, 5120), (67, 17408), (517, 1280)) if batch in (1, 8) else ((1001, 5120),)
        for rows, cols in shapes:
            case = f"{fmt} {str(dtype)[6:]} batch {batch} [{rows}x{cols}]"

            def run(fmt=fmt, dtype=dtype, batch=batch, rows=rows, cols=cols, case=case) -> None:
                weight = random_weight(fmt, rows, cols, gen, device)
                x = torch.randn(batch, cols, generator=gen, device=device).to(dtype)
                dense64 = quants.dequantize(weight.data, weight.ggml_type, weight.shape).double()
                ref = x.double() @ dense64.T
                oracle = TorchBackend(device, dtype, weight_cache_bytes=0).linear(x, weight)
                for variant in matvec_variants(fmt, dtype, batch):
                    out = torch.full((batch, rows), float("nan"), dtype=dtype, device=device)
                    backend.matvec(x, weight, out=out, variant=variant)
                    torch.cuda.synchronize()
                    record("matvec", f"{case} {variant}", relative_error(out, ref), MATVEC_BOUND[dtype],
                           f"torch backend err {relative_error(oracle, ref):.1e}")

            guarded("matvec", case, run)


def check_dequant_and_prefill(backend: CudaBackend, gen: torch.Generator) -> None:
    device = backend.device
    for fmt in FORMATS:
        for dtype in DTYPES:
            case = f"{fmt} -> {str(dtype)[6:]} rows 3:203 of [517x2048]"

            def run_dequant(fmt=fmt, dtype=dtype) -> None:
                weight = random_weight(fmt, 517, 2048, gen, device)
                ref = quants.dequantize(weight.data, weight.ggml_type, weight.shape)[3:203].double()
                out = torch.full((200, 2048), float("nan"), dtype=dtype, device=device)
                backend.dequantize_rows(weight, 3, 203, dtype, out=out)
                torch.cuda.synchronize()
                # The only differences allowed: fused multiply-add in the affine map, one output rounding.
                bound = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}[dtype]
                record("dequant", case, relative_error(out, ref), bound)

            guarded("dequant", case, run_dequant)
        case = f"{fmt} bf16 prefill 100 rows [3000x5120]"

        def run_prefill(fmt=fmt) -> None:
            weight = random_weight(fmt, 3000, 5120, gen, device)
            dense64 = quants.dequantize(weight.data, weight.ggml_type, weight.shape).double()
            x = torch.randn(2, 50, 5120, generator=gen, device=device).to(torch.bfloat16)
            out = backend.linear(x, weight)
            torch.cuda.synchronize()
            record("prefill", case, relative_error(out, x.double() @ dense64.T), PREFILL_BOUND[torch.bfloat16])

        guarded("prefill", case, run_prefill)


def check_rms_norm(backend: CudaBackend, gen: torch.Generator) -> None:
    device = backend.device
    for shape in ((7, 5120), (3, 24, 256), (2, 1, 17), (1, 1, 1024)):
        for dtype in DTYPES:
            for weight_dtype in sorted({dtype, torch.float32}, key=str):
                case = f"x {str(dtype)[6:]} w {str(weight_dtype)[6:]} {list(shape)}"

                def run(shape=shape, dtype=dtype, weight_dtype=weight_dtype) -> None:
                    x = (torch.randn(*shape, generator=gen, device=device) * 3 + 0.5).to(dtype)
                    w = (torch.rand(shape[-1], generator=gen, device=device) + 0.5).to(weight_dtype)
                    x64 = x.double()
                    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
                    out = torch.full_like(x, float("nan"))
                    backend.rms_norm(x, w, 1e-6, out=out)
                    torch.cuda.synchronize()
                    oracle = TorchBackend(device, dtype).rms_norm(x, w, 1e-6)
                    record("rms_norm", case, relative_error(out, ref), NORM_BOUND[dtype],
                           f"torch backend err {relative_error(oracle, ref):.1e}")

                guarded("rms_norm", case, run)


# -- timing ----------------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device) -> float:
    size = 2 * 1024**3
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(event_times_ms(lambda: dst.copy_(src), 20))
    return 2 * size / (ms * 1e-3) / 1e9


def graph_time_us(launch_all, launches: int, replays: int = 15) -> float:
    """Median time of one launch, from replays of a graph holding `launches` of them."""
    launch_all()  # warm (uploads, module loads happen outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_all()
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(event_times_ms(graph.replay, replays)) * 1e3 / launches


# The 27B shapes (gate/up, down, qkv, attention output, head) at batch 1, then small batches.
SHAPES_27B = ((17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120), (248320, 5120))
TIMING_CASES = [  # (format, [out, in] torch order, batch); every variant of each is timed
    *[("q4_k", shape, 1) for shape in SHAPES_27B],
    *[("q6_k", shape, 1) for shape in SHAPES_27B],
    ("q5_k", (17408, 5120), 1), ("q8_0", (10240, 5120), 1), ("q8_0", (5120, 17408), 1),
    ("bf16", (17408, 5120), 1), ("f16", (17408, 5120), 1),
    *[("q4_k", (17408, 5120), b) for b in (2, 4, 8, 16, 32, 64)],
    *[("q4_k", (5120, 17408), b) for b in (4, 16)],
    *[("q6_k", (5120, 17408), b) for b in (2, 4, 8, 16)],
]


def time_kernels(backend: CudaBackend, gen: torch.Generator, copy_gbs: float) -> None:
    device = backend.device
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    log(f"\n{'kernel':40s} {'batch':>5s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s}")
    for fmt, (rows, cols), batch in TIMING_CASES:
        try:
            probe = random_weight(fmt, 8, cols, gen, device)
            weight_bytes = probe.nbytes // 8 * rows
            # Enough copies that one pass over them is several times the L2: each launch reads from DRAM.
            copies = max(1, min(16, -(-4 * l2 // weight_bytes)))
            weights = [random_weight(fmt, rows, cols, gen, device) for _ in range(copies)]
            dtype = torch.bfloat16
            xs = [torch.randn(batch, cols, generator=gen, device=device).to(dtype) for _ in range(copies)]
            outs = [torch.empty(batch, rows, dtype=dtype, device=device) for _ in range(copies)]
            launches = copies * max(1, 24 // copies)

            for variant in matvec_variants(fmt, dtype, batch):

                def launch_all(variant=variant) -> None:
                    for i in range(launches):
                        k = i % copies
                        backend.matvec(xs[k], weights[k], out=outs[k], variant=variant)

                us = graph_time_us(launch_all, launches)
                gbs = weight_bytes / (us * 1e-6) / 1e9
                name = f"matvec {variant} {fmt} [{rows}x{cols}]"
                log(f"{name:40s} {batch:5d} {us:9.1f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}%")
                RESULTS["timing"].append({"kernel": "matvec", "variant": variant, "format": fmt, "rows": rows,
                                          "cols": cols, "batch": batch, "us": us, "weight_bytes": weight_bytes,
                                          "gb_s": gbs, "pct_copy": 100 * gbs / copy_gbs, "copies": copies})
            del weights, xs, outs
        except Exception as exc:
            log(f"timing {fmt} {rows}x{cols} batch {batch} raised {type(exc).__name__}: {exc}")
            traceback.print_exc()
    # cuBLAS on a dense bf16 copy of one shape, for scale (it reads 2 bytes per weight).
    for rows, cols in ((17408, 5120), (5120, 17408)):
        copies = max(1, min(16, -(-4 * l2 // (rows * cols * 2))))
        dense = [torch.randn(rows, cols, generator=gen, device=device).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, cols, generator=gen, device=device).to(torch.bfloat16)
        launches = copies * max(1, 24 // copies)
        us = graph_time_us(lambda: [torch.nn.functional.linear(x, dense[i % copies]) for i in range(launches)],
                           launches)
        gbs = rows * cols * 2 / (us * 1e-6) / 1e9
        log(f"{f'cuBLAS bf16 dense [{rows}x{cols}]':40s} {1:5d} {us:9.1f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}%")
        RESULTS["timing"].append({"kernel": "cublas_bf16", "rows": rows, "cols": cols, "batch": 1, "us": us,
                                  "gb_s": gbs, "pct_copy": 100 * gbs / copy_gbs})


# -- Triton kernels ----------------------------------------------------------------------------------------

# The Triton kernel modules of lucebox_cuda, each with a `main()` that checks its kernels against the torch
# reference on the GPU (returns non-zero on a failure). Modules still being written may be absent.
TRITON_MODULES = ("triton_ops", "triton_gdn", "triton_attention", "triton_fused")


def run_triton_checks() -> None:
    """Call each Triton module's `main()`; an absent module is reported, a failing or raising one fails."""
    import importlib
    import importlib.util

    for name in TRITON_MODULES:
        qualified = f"lucebox_cuda.{name}"
        if importlib.util.find_spec(qualified) is None:
            log(f"\ntriton: {qualified} is not there (skipped)")
            RESULTS["triton"].append({"module": qualified, "present": False, "ok": True})
            continue
        log(f"\ntriton: {qualified}.main()")
        start = time.perf_counter()
        try:
            module = importlib.import_module(qualified)
            entry = getattr(module, "main", None)
            if entry is None:
                raise AttributeError(f"{qualified} has no main()")
            try:
                code = entry()
            except SystemExit as exit_:  # a main() written for `python -m` may exit
                code = exit_.code
            ok, note = code in (0, None), f"returned {code}"
        except Exception as exc:
            traceback.print_exc()
            ok, note = False, f"raised {type(exc).__name__}: {exc}"
        log(f"{'ok  ' if ok else 'FAIL'} triton {qualified}: {note} ({time.perf_counter() - start:.1f} s)")
        RESULTS["triton"].append({"module": qualified, "present": True, "ok": ok, "note": note})


# -- whole model -----------------------------------------------------------------------------------------

# Full-model tolerances, the candidate backend against the torch backend in fp32 on the same GPU. Logits of
# these random-weight models are O(1) (std ~0.3, largest ~2); their top-two gaps are often 1e-3..1e-1.
MODEL_LOGITS_REL = {torch.float32: 1e-3}  # relative Frobenius error of the prefill logits
MODEL_LOGITS_ABS = {torch.float32: 5e-3}  # largest absolute logit difference on the prefill
# Greedy paths may part only where the reference's top two logits lie within this of each other.
TIE_TOLERANCE = {torch.float32: 1e-3}
# bf16 activations drift from the f32 reference on their own; the torch backend in bf16 measures how far,
# and the candidate may drift no further than this many times that (or BF16_FLOOR). Greedy agreement is
# then reported, not required: the drift is larger than the typical top-two gap.
BF16_DRIFT_FACTOR, BF16_FLOOR = 1.5, 5e-2
MODEL_CASES = (("tiny", "f32"), ("0.8b", "q4_k_m"))
PROMPT_TOKENS = 100  # more than the matvec kernels' batch limit: the prefill takes the tiled path


@dataclasses.dataclass
class ReferenceRun:
    prefill: torch.Tensor  # [T, vocab] fp32 logits of the prompt
    tokens: list[int]  # greedy tokens
    step_logits: list[torch.Tensor]  # logits that chose tokens[i]: prefill[-1], then each step's


def reference_greedy(model: Any, prompt: list[int], steps: int, unused: Sequence[int] = ()) -> ReferenceRun:
    """The reference: eager forward calls (no static step, no graph), greedy, every step's logits kept. `unused`:
    ids the engine never samples (the tokenizer's padding placeholders), left out here too."""
    model.decode_graphs = False
    state = model.new_state(len(prompt) + steps + 1)
    prefill = model.forward(state, torch.tensor(prompt)).float()
    never = torch.tensor(list(unused), dtype=torch.long, device=prefill.device)
    logits, tokens, chosen_from = prefill[-1], [], []
    for _ in range(steps):
        logits = logits.index_fill(-1, never, float("-inf"))
        chosen_from.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model.forward(state, torch.tensor([tokens[-1]])).float()[-1]
    return ReferenceRun(prefill, tokens, chosen_from)


def candidate_run(model: Any, tokenizer: Any, prompt: list[int], steps: int) -> dict:
    """The candidate: prefill logits by a forward call, then greedy tokens through the engine's decode
    loop (the recorded static step on a GPU), with each chosen token's log-probability."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams

    state = model.new_state(len(prompt) + 1)
    prefill = model.forward(state, torch.tensor(prompt)).float()
    del state
    engine = Engine(model, tokenizer, ctx_size=len(prompt) + steps + 2)
    sequence = engine.new_sequence()
    request = GenerationRequest(prompt_ids=prompt, max_tokens=steps, sampling=SamplingParams(temperature=0),
                                ignore_eos=True, logprobs=0)
    tokens, logprobs = [], []
    start = time.perf_counter()
    for step in engine.stream(sequence, request):
        if step.token_id is not None:
            tokens.append(step.token_id)
            logprobs.append(step.logprob)
    seconds = time.perf_counter() - start
    step = getattr(sequence.state, "decode", None)  # the decode step's StaticStep (its recordings)
    return {"prefill": prefill, "tokens": tokens, "logprobs": logprobs, "seconds": seconds,
            "graph_windows": len(step) if step is not None else 0,
            "graph_failure": step.failure if step is not None else None}


def compare_greedy(reference: ReferenceRun, tokens: list[int], logprobs: list[float | None],
                   tie_tolerance: float) -> dict:
    """Where the candidate's greedy tokens part from the reference's, and whether that is a near-tie; the
    largest log-probability difference of the chosen tokens while the paths agree."""
    same, verdict, gap = 0, "identical", None
    logprob_diff = 0.0
    for i, (mine, theirs) in enumerate(zip(tokens, reference.tokens)):
        if mine != theirs:
            top2 = reference.step_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            verdict = ("near-tie" if gap <= tie_tolerance else "DIVERGED") + f" at step {i}"
            break
        same += 1
        if logprobs[i] is not None:
            reference_logprob = float(torch.log_softmax(reference.step_logits[i].double(), -1)[theirs])
            logprob_diff = max(logprob_diff, abs(logprobs[i] - reference_logprob))
    if len(tokens) < len(reference.tokens) and verdict == "identical":
        verdict = f"DIVERGED: only {len(tokens)} tokens"
    return {"same": same, "verdict": verdict, "top2_gap": gap, "tie_tolerance": tie_tolerance,
            "max_logprob_diff": logprob_diff}


def _model_file(workdir: Path, size: str, gguf_type: str) -> Path:
    path = workdir / f"qwen35-{size}-{gguf_type}.gguf"
    if not path.exists():
        from lucebox_qwen35.synth import write

        start = time.perf_counter()
        write(path, size=size, type=gguf_type, seed=0)
        log(f"synthesized {path.name} in {time.perf_counter() - start:.1f} s")
    return path


def model_check(device: torch.device, workdir: Path, size: str, gguf_type: str, steps: int = 64) -> None:
    """One synthetic model through CudaBackend (f32 and bf16) against TorchBackend f32 on the same GPU."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_core.tokenizer import Tokenizer
    from lucebox_qwen35.loader import load

    path = _model_file(workdir, size, gguf_type)
    gguf = GGUFFile(path)
    tokenizer = Tokenizer.from_metadata(gguf.metadata, source=str(path))
    prompt = torch.randint(0, 200000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1234)).tolist()
    label = f"{size} {gguf_type}"
    report = RESULTS["model"].setdefault(label, {})

    reference = reference_greedy(load(gguf, TorchBackend(device, torch.float32)), prompt, steps, tokenizer.unused_ids())
    torch_bf16 = load(gguf, TorchBackend(device, torch.bfloat16))
    torch_bf16.decode_graphs = False
    state = torch_bf16.new_state(PROMPT_TOKENS + 1)
    bf16_drift = relative_error(torch_bf16.forward(state, torch.tensor(prompt)).float(), reference.prefill.double())
    del torch_bf16, state
    report["torch_bf16_prefill_rel_err"] = bf16_drift
    log(f"\nmodel {label}: {PROMPT_TOKENS}-token prompt, {steps} greedy steps; torch bf16 drifts "
        f"{bf16_drift:.2e} from torch f32")

    for dtype in (torch.float32, torch.bfloat16):
        name = f"cuda_{str(dtype)[6:]}"
        try:
            candidate = candidate_run(load(gguf, CudaBackend(device, dtype)), tokenizer, prompt, steps)
        except Exception as exc:
            traceback.print_exc()
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            log(f"FAIL model {label} {name} raised {type(exc).__name__}: {exc}")
            continue
        rel = relative_error(candidate["prefill"], reference.prefill.double())
        max_abs = float((candidate["prefill"] - reference.prefill).abs().max())
        strict = dtype == torch.float32
        tie = TIE_TOLERANCE[dtype] if strict else 4 * max_abs  # bf16: reported only
        greedy = compare_greedy(reference, candidate["tokens"], candidate["logprobs"], tie)
        rel_bound = MODEL_LOGITS_REL[dtype] if strict else max(BF16_FLOOR, BF16_DRIFT_FACTOR * bf16_drift)
        problems = []
        if not rel <= rel_bound:
            problems.append(f"prefill rel err {rel:.2e} > {rel_bound:.1e}")
        if strict and not max_abs <= MODEL_LOGITS_ABS[dtype]:
            problems.append(f"prefill max-abs {max_abs:.2e} > {MODEL_LOGITS_ABS[dtype]:.0e}")
        if strict and greedy["verdict"].startswith("DIVERGED"):
            problems.append(f"greedy {greedy['verdict']} (top-2 gap {greedy['top2_gap']})")
        if device.type == "cuda" and (candidate["graph_failure"] or not candidate["graph_windows"]):
            problems.append(f"decode did not replay a CUDA graph ({candidate['graph_failure']})")
        ok = not problems
        gap = f", reference top-2 gap {greedy['top2_gap']:.2e} (tolerance {tie:.1e})" if greedy["top2_gap"] else ""
        log(f"{'ok  ' if ok else 'FAIL'} model {label} {name}: prefill logits rel err {rel:.2e} (bound "
            f"{rel_bound:.1e}), max-abs {max_abs:.2e}; greedy {greedy['same']}/{steps} same, {greedy['verdict']}{gap}"
            f"{'' if strict else ' (bf16: reported, not required)'}; chosen-token log-prob diff "
            f"{greedy['max_logprob_diff']:.1e}; graph windows {candidate['graph_windows']}; "
            f"{steps / candidate['seconds']:.1f} tok/s through the engine" + (f"; {problems}" if problems else ""))
        report[name] = {"ok": ok, "problems": problems, "prefill_rel_err": rel, "rel_bound": rel_bound,
                        "prefill_max_abs": max_abs, **greedy, "graph_windows": candidate["graph_windows"],
                        "graph_failure": candidate["graph_failure"], "tok_s": steps / candidate["seconds"]}


def model_failures() -> list[str]:
    return [f"model {label} {name}: {result.get('problems') or result.get('error')}"
            for label, report in RESULTS["model"].items() for name, result in report.items()
            if isinstance(result, dict) and not result.get("ok", True)]


# -- main ------------------------------------------------------------------------------------------------


def environment(device: torch.device, commit: str) -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "nvidia-smi unavailable"
    try:
        from importlib.metadata import version

        bindings = version("cuda-bindings")
    except Exception:
        bindings = "?"
    props = torch.cuda.get_device_properties(device)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit, "gpu": smi,
            "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
            "arch": f"sm_{props.major}{props.minor}", "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_bindings": bindings, "nvrtc": "%d.%d" % nvrtc.nvrtc_version(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--commit", default=os.environ.get("COMMIT") or os.environ.get("LUCEBOX_COMMIT", "unknown"))
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--models", default=",".join(f"{s}:{t}" for s, t in MODEL_CASES),
                        help="synthetic models for the full-model check, SIZE:TYPE,... (default tiny:f32,0.8b:q4_k_m)")
    parser.add_argument("--steps", type=int, default=64, help="greedy steps of the full-model check")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lucebox-cuda-check"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def save() -> None:  # after every part: a call killed at its time limit keeps what was checked
        RESULTS["elapsed_s"] = time.perf_counter() - started
        (args.out / "cuda_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))

    major, minor = torch.cuda.get_device_capability(0)
    if not args.skip_correctness:
        precompile(f"sm_{major}{minor}")  # worker processes only run NVRTC, never CUDA
    device = torch.device("cuda", 0)
    RESULTS["environment"] = environment(device, args.commit)
    log(json.dumps(RESULTS["environment"]))
    backend = CudaBackend(device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(int(time.time()))  # fresh inputs every run

    for part in () if args.skip_correctness else (check_matvec, check_dequant_and_prefill, check_rms_norm):
        part(backend, gen)
    failures = [r for r in RESULTS["correctness"] if not r["ok"]]
    log(f"\ncorrectness: {len(RESULTS['correctness']) - len(failures)}/{len(RESULTS['correctness'])} cases pass "
        f"[{time.perf_counter() - started:.0f} s]")
    save()

    if not args.skip_triton:
        run_triton_checks()
        save()
    if not args.skip_timing:
        copy_gbs = copy_bandwidth(device)
        RESULTS["copy_gb_s"] = copy_gbs
        log(f"\ndevice-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
        time_kernels(backend, gen, copy_gbs)
        log(f"[timing done at {time.perf_counter() - started:.0f} s]")
        save()
    if not args.skip_model:
        for case in filter(None, args.models.split(",")):
            size, _, gguf_type = case.partition(":")
            try:
                model_check(device, args.workdir, size, gguf_type or "q4_k_m", args.steps)
            except Exception as exc:
                log(f"FAIL model check {case} raised {type(exc).__name__}: {exc}")
                traceback.print_exc()
                RESULTS["model"].setdefault(case, {})["check"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            log(f"[model {case} done at {time.perf_counter() - started:.0f} s]")
            save()
    problems = [f"{r['kind']} {r['case']}: {r['error']} {r['note']}" for r in failures]
    problems += [f"triton {r['module']}: {r['note']}" for r in RESULTS["triton"] if not r["ok"]]
    problems += model_failures()
    RESULTS["failures"] = problems
    save()
    log(f"\nfailures: {len(problems)} [{time.perf_counter() - started:.0f} s]")
    for problem in problems:
        log(f"  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
