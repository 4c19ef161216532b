"""The floor under a one-launch 0.8B decode step: how fast a persistent grid can stream a step's weights through the
grid-wide barriers that the megakernel's phases need (issue #17, item 4).

The persistent pieces of session 26 lost to the kernels they replace (0.54-0.84x): each block's tiles ran one
after another with no weights in flight between them. Before a megakernel is written, this measures what the
schedule itself allows, with no arithmetic at all: one launch reads a whole step's weight bytes, phase by phase,
each block its even share of each phase, with a grid barrier (`grid_barrier.cuh`, the one the persistent kernels
use, and two others that put the ordering in the atomic and the polls instead of in fences) between phases.
Three ways of reading:

- `barriers`: the barriers alone (no bytes): what the schedule's synchronisation costs.
- `direct`: after each barrier, each block loads its share (16-byte loads, four in flight a thread): the persistent
  pieces' way, where nothing is in flight while a block waits.
- `ring`: each block streams its shares through a ring of shared-memory chunks filled by `cp.async`, several
  chunks ahead, across the barriers: a weight does not depend on the activations, so the next phase's first chunks
  are already loading while the block waits for the others. The megakernel's schedule, if it pays.

Each also with one phase (no barrier): the bandwidth a persistent grid reaches streaming the same bytes.

The phases are Qwen3.5-0.8B's, their bytes those of the project's Q4_K_M writer (`lucebox_qwen35.synth`'s tensor
plan: the tied head Q6_K, the DeltaNet qkv and half the down products Q6_K, the rest Q4_K). A DeltaNet layer is 3
mixer phases (products; convolution, gates, delta step with the 1 MiB state read and written, gated norm; output
product) and 2 MLP phases (add + norm + gate | up; down); an attention layer 4 mixer phases (products; norm, RoPE,
K/V store and attention spans; merge and gate; output product) and the same 2; then the head and the choice of the
token (`--schedule partials`: 3 and 4, see SCHEDULES). Each launch is one step; the figure is the median over
`--steps` launches after a warm-up, beside the copy bandwidth measured in the same call.

    python3 scripts/megakernel_floor.py [--blocks-per-sm 1 2] [--schedule unfused|partials] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import attrs
import torch
from gguf import GGML_QUANT_SIZES

from lucebox_cuda import nvrtc
from lucebox_cuda.nvrtc import Int, Pointer
from lucebox_cuda.timing import median_ms
from lucebox_qwen35 import layout, synth

from bench_vs_llamacpp import copy_bandwidth_gb_s  # scripts/ is the path's first entry when run as a script

THREADS, CHUNK = 256, 8192  # a ring's chunk: 8 KiB, 16 bytes a thread twice
# Ring depths (chunks a block; all but one in flight): 32 KiB covers a phase's start; 64 and 128 KiB keep loading
# through a barrier's wait (~1.5 us at ~23 GB/s an SM) and more.
RING_STAGES = (4, 8, 16)

SOURCE = r"""
#include "grid_barrier.cuh"

constexpr int CHUNK = %(chunk)d;

__device__ __forceinline__ u32 ring_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %%1; cvt.u32.u64 %%0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// This block's even share of phase `p`'s bytes (16-byte units): [begin, end).
__device__ __forceinline__ void block_share(const long long* offsets, int p, long long& begin, long long& end) {
    const long long units = (offsets[p + 1] - offsets[p]) / 16;
    const long long each = (units + gridDim.x - 1) / gridDim.x;
    begin = offsets[p] + min(units, each * blockIdx.x) * 16;
    end = offsets[p] + min(units, each * (blockIdx.x + 1)) * 16;
}

// The next chunk of this block's shares, phase after phase; false past the last phase.
struct Cursor { int phase; long long at, end; };
__device__ __forceinline__ bool next_chunk(Cursor& c, const long long* offsets, int phases, long long& begin,
                                           int& bytes, int& phase) {
    while (c.at >= c.end) {
        if (++c.phase >= phases) return false;
        block_share(offsets, c.phase, c.at, c.end);
    }
    begin = c.at;
    bytes = static_cast<int>(min(static_cast<long long>(CHUNK), c.end - c.at));
    phase = c.phase;
    c.at += bytes;
    return true;
}

// The barrier under test. 0: grid_barrier.cuh's (until session 35 a relaxed atomicAdd between two __threadfence and
// volatile polls; since, kind 1).
// 1: the same flip-bit counter with the ordering in the instructions: a release add, acquire polls, no fences.
// 2: a release add, relaxed polls, one acquire fence after the flip.
template <int KIND> __device__ __forceinline__ void barrier(unsigned int* arrived) {
    if (KIND == 0) {
        grid_barrier(arrived);
        return;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        unsigned int before, now, polls = 0;
        asm volatile("atom.add.release.gpu.u32 %%0, [%%1], %%2;" : "=r"(before) : "l"(arrived), "r"(add) : "memory");
        do {
            if (KIND == 1)
                asm volatile("ld.acquire.gpu.u32 %%0, [%%1];" : "=r"(now) : "l"(arrived) : "memory");
            else
                asm volatile("ld.relaxed.gpu.u32 %%0, [%%1];" : "=r"(now) : "l"(arrived) : "memory");
            if (++polls == GRID_BARRIER_POLL_LIMIT) __trap();
        } while (((before ^ now) & 0x80000000u) == 0);
        if (KIND == 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}

template <int KIND> __device__ __forceinline__ void barriers_body(unsigned int* arrived, int phases, u32* sink) {
    for (int p = 1; p < phases; ++p) barrier<KIND>(arrived);
    if (threadIdx.x == 0) sink[blockIdx.x] = phases;
}

template <int KIND> __device__ __forceinline__ void direct_body(const u8* __restrict__ weights,
        const long long* __restrict__ offsets, int phases, unsigned int* arrived, u32* sink) {
    u32 folded = 0;
    for (int p = 0; p < phases; ++p) {
        if (p > 0) barrier<KIND>(arrived);
        long long begin, end;
        block_share(offsets, p, begin, end);
        const uint4* words = reinterpret_cast<const uint4*>(weights + begin);
        const int count = static_cast<int>((end - begin) / 16);
#pragma unroll 4
        for (int i = threadIdx.x; i < count; i += blockDim.x) {
            const uint4 w = words[i];
            folded ^= w.x ^ w.y ^ w.z ^ w.w;
        }
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = folded;
}

template <int KIND, int STAGES> __device__ __forceinline__ void ring_body(const u8* __restrict__ weights,
        const long long* __restrict__ offsets, int phases, unsigned int* arrived, u32* sink) {
    extern __shared__ __align__(16) uint4 ring[];  // STAGES chunks
    Cursor to_load{-1, 0, 0}, to_use{-1, 0, 0};
    // Fill a ring slot with the next chunk (or nothing): always one commit group, so the counting stays even.
    auto load_next = [&](int slot) {
        long long begin;
        int bytes, phase;
        if (next_chunk(to_load, offsets, phases, begin, bytes, phase)) {
            const u32 base = ring_address(ring + slot * (CHUNK / 16));
            for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x)
                asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;" ::"r"(base + 16 * i),
                             "l"(weights + begin + 16 * i) : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int s = 0; s < STAGES - 1; ++s) load_next(s);
    u32 folded = 0;
    int passed = 0;  // barriers passed: the phase this block may read
    long long begin;
    int bytes, phase;
    for (int slot = 0; next_chunk(to_use, offsets, phases, begin, bytes, phase); slot = (slot + 1) %% STAGES) {
        asm volatile("cp.async.wait_group %%0;" ::"n"(STAGES - 2) : "memory");
        __syncthreads();  // every thread's copies of this chunk landed; the slot refilled below was read
        while (passed < phase) { barrier<KIND>(arrived); ++passed; }
        const uint4* words = ring + slot * (CHUNK / 16);
        for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
            const uint4 w = words[i];
            folded ^= w.x ^ w.y ^ w.z ^ w.w;
        }
        load_next((slot + STAGES - 1) %% STAGES);
    }
    while (passed < phases - 1) { barrier<KIND>(arrived); ++passed; }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = folded;
}

#define FLOOR_KERNELS(KIND)                                                                                     \
    extern "C" __global__ void __launch_bounds__(%(threads)d) floor_barriers_##KIND(unsigned int* arrived,      \
                                                                                 int phases, u32* sink) {       \
        barriers_body<KIND>(arrived, phases, sink);                                                             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(%(threads)d) floor_direct_##KIND(const u8* weights,            \
            const long long* offsets, int phases, unsigned int* arrived, u32* sink) {                           \
        direct_body<KIND>(weights, offsets, phases, arrived, sink);                                             \
    }                                                                                                           \
    FLOOR_RING(KIND, 4)                                                                                         \
    FLOOR_RING(KIND, 8)                                                                                         \
    FLOOR_RING(KIND, 16)
#define FLOOR_RING(KIND, STAGES)                                                                                \
    extern "C" __global__ void __launch_bounds__(%(threads)d) floor_ring_##KIND##_s##STAGES(const u8* weights,  \
            const long long* offsets, int phases, unsigned int* arrived, u32* sink) {                           \
        ring_body<KIND, STAGES>(weights, offsets, phases, arrived, sink);                                       \
    }
FLOOR_KERNELS(0)
FLOOR_KERNELS(1)
FLOOR_KERNELS(2)
"""
BARRIERS = {0: "grid_barrier.cuh", 1: "release/acquire", 2: "release, relaxed polls"}


@attrs.frozen
class Program:
    """A one-off compilation unit for `nvrtc._compile`: this script's source with the kernels' headers."""

    file: str = "megakernel_floor.cu"

    def source(self) -> str:
        return SOURCE % {"chunk": CHUNK, "threads": THREADS}

    def headers(self) -> dict[str, str]:
        return {name: text for name, text in nvrtc.kernel_sources().items() if name.endswith(".cuh")}


# Which phase of a layer reads each of its weights (by GGUF name); the rest (norms, the convolution) are in the
# phase of the product beside them and are a few KB.
MIXER_PRODUCTS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_conv1d", "attn_q.", "attn_k.", "attn_v.")
OUTPUT_PRODUCTS = ("ssm_out", "attn_output")


def tensor_bytes(plan) -> int:
    block, size = GGML_QUANT_SIZES[plan.ggml_type]
    return math.prod(plan.shape) // block * size


# The phase schedules: `unfused` keeps a phase wherever the persistent pieces have one (5 a DeltaNet layer, 6 an
# attention layer); `partials` joins each output product to the phase before it and the down product to the gate | up
# phase, as a block that made a slice of a product's input would multiply it by that slice's columns and leave
# partial sums for the next phase to add in a fixed order (3 a DeltaNet layer, 4 an attention layer).
SCHEDULES = ("unfused", "partials")


def step_phases(size: str = "0.8b", type: str = "q4_k_m", schedule: str = "unfused") -> list[int]:
    """The weight bytes of each phase of a one-launch decode step of the qwen35 `size` in a `type` file as the
    project's writer lays it out (see the module's text), in `schedule`'s phases; 16-byte multiples."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    cfg = layout.SIZES[size]
    plans = synth.tensor_plans(cfg, type)
    per_layer: list[dict[str, int]] = [{} for _ in range(cfg.n_layer)]
    for plan in plans:
        if plan.name.startswith("blk."):
            index, name = plan.name.split(".", 2)[1:]
            per_layer[int(index)][name] = tensor_bytes(plan)
    phases: list[int] = []
    state = 2 * cfg.ssm_dt_rank * cfg.ssm_d_state * (cfg.ssm_d_inner // cfg.ssm_dt_rank) * 4  # fp32, read + written
    for weights in per_layer:
        products = sum(b for n, b in weights.items() if n.startswith(MIXER_PRODUCTS))
        output = sum(b for n, b in weights.items() if n.startswith(OUTPUT_PRODUCTS))
        mlp = [weights["ffn_gate.weight"] + weights["ffn_up.weight"], weights["ffn_down.weight"]]
        attention = "attn_q.weight" in weights
        if schedule == "partials":  # the output product and the down product as partial sums of the phase before
            phases += [products, 0, output, sum(mlp)] if attention else [products, state + output, sum(mlp)]
        elif attention:  # products; norm, RoPE, K/V store, spans; merge and gate; output
            phases += [products, 0, 0, output, *mlp]
        else:  # products; convolution, gates, delta step, gated norm; output
            phases += [products, state, output, *mlp]
    head = next(p for p in plans if p.name == ("token_embd.weight" if cfg.tied_output else "output.weight"))
    phases += [tensor_bytes(head), 0]
    return [b // 16 * 16 for b in phases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks-per-sm", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", default="0.8b", help="a qwen35 size of the writer's (lucebox_qwen35.layout.SIZES)")
    parser.add_argument("--type", default="q4_k_m", help="the file type whose weight bytes a step reads")
    parser.add_argument("--schedule", choices=SCHEDULES, default="unfused", help="the step's phases (see SCHEDULES)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    from cuda.bindings import driver  # here: the test of this script's phases runs without cuda-bindings

    device = torch.device("cuda", torch.cuda.current_device())
    properties = torch.cuda.get_device_properties(device)
    major, minor = torch.cuda.get_device_capability(device)
    module = nvrtc.CudaModule(nvrtc._compile(Program(), f"sm_{major}{minor}", nvrtc.DEFAULT_OPTIONS), device.index)
    stream = torch.cuda.current_stream(device).cuda_stream

    phases = step_phases(args.size, args.type, args.schedule)
    offsets = torch.tensor([0, *torch.tensor(phases).cumsum(0).tolist()], dtype=torch.int64, device=device)
    total = int(offsets[-1])
    weights = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    one_phase = torch.tensor([0, total], dtype=torch.int64, device=device)
    arrived = torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(properties.multi_processor_count * 8 * THREADS, dtype=torch.int32, device=device)
    copy = copy_bandwidth_gb_s(device)
    print(f"{properties.name}: {properties.multi_processor_count} SMs, copy {copy:.0f} GB/s; a step: {len(phases)} "
          f"phases ({len(phases) - 1} barriers), {total / 1e6:.1f} MB of weights (the head {phases[-2] / 1e6:.1f})")

    rows = []
    for per_sm in args.blocks_per_sm:
        grid = properties.multi_processor_count * per_sm

        def launcher(name: str, table: torch.Tensor, count: int, shared: int):
            """A launch of kernel `name`, or None where `per_sm` blocks of it cannot all be resident on an SM (the
            barrier would wait for a block that never runs)."""
            function = module.function(name)
            if shared > 48 * 1024:
                attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                if int(driver.cuFuncSetAttribute(function, attribute, shared)[0]) != 0:
                    return None
            result, resident = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, THREADS, shared)
            if int(result) != 0 or int(resident) < per_sm:
                return None
            if name.startswith("floor_barriers"):
                values = [Pointer(arrived.data_ptr()), Int(count), Pointer(sink.data_ptr())]
            else:
                values = [Pointer(weights.data_ptr()), Pointer(table.data_ptr()), Int(count),
                          Pointer(arrived.data_ptr()), Pointer(sink.data_ptr())]
            return lambda: nvrtc.launch(function, grid, THREADS, values, stream=stream, shared_bytes=shared)

        # (read, barrier kind, ring stages, the phase table, its phase count)
        cases = [(read, kind, 0, offsets, len(phases)) for kind in BARRIERS for read in ("barriers", "direct")]
        cases += [("ring", kind, stages, offsets, len(phases)) for kind in BARRIERS for stages in RING_STAGES]
        cases += [("direct", 0, 0, one_phase, 1)]  # no barrier: the streaming alone
        cases += [("ring", 0, stages, one_phase, 1) for stages in RING_STAGES]
        for read, kind, stages, table, count in cases:
            name = f"floor_{read}_{kind}" + (f"_s{stages}" if stages else "")
            launch = launcher(name, table, count, stages * CHUNK)
            row = {"blocks_per_sm": per_sm, "grid": grid, "read": read, "ring_kib": stages * CHUNK // 1024,
                   "phases": count, "barrier": BARRIERS[kind] if count > 1 else None}
            if launch is None:
                row["skipped"] = f"{per_sm} blocks of {stages * CHUNK // 1024} KiB do not fit an SM"
            else:
                us = 1000 * median_ms(launch, args.steps)
                bytes_read = 0 if read == "barriers" else total
                row.update(us=round(us, 2), tok_s=round(1e6 / us, 1), gb_s=round(bytes_read / us / 1e3, 1),
                           of_copy=round(bytes_read / us / 1e3 / copy, 3))
                if read == "barriers":
                    row["us_a_barrier"] = round(us / max(count - 1, 1), 3)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": properties.name, "copy_gb_s": round(copy, 1), "schedule": args.schedule,
                       "phases": len(phases),
                       "weight_bytes": total, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
