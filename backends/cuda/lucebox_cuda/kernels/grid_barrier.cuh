// What the persistent kernels (ffn_, moe_, gdn_, attention_persistent.cu) share: a barrier across the whole grid, a
// block-wide sum, the staging of rows other blocks wrote, and the add + RMSNorm of their first phase.
//
// The grid must be resident all at once (the barrier waits for every block): the launchers size it from the
// driver's occupancy with a margin (`ffn_persistent.grid_size`). The counter needs no reset: block 0 adds
// 2^31 - (blocks - 1) and every other block 1, so once all have arrived the top bit has flipped and the low bits
// are back at zero (where a zeroed counter starts); a block waits for the flip from the value its own add
// returned. The add is a release (the block's writes, made visible to thread 0 by `__syncthreads`, go with it) and
// the polls acquire (the block's later reads come after the other blocks' writes). One counter
// serves every launch of a device's stream: each launch's barriers end before the next launch's begin (every
// kernel launched with PDL waits for the one ahead before it lets the next one start).
#pragma once
#include "common.cuh"
#include "triton_math.cuh"

// A barrier waits microseconds. One that waits for ~30 s (polls of L2, ~0.5 us each) means a block never ran
// (the grid was not all resident: another process's kernels, an SM partition): trap, an error rather than a hung
// GPU.
constexpr unsigned int GRID_BARRIER_POLL_LIMIT = 1u << 26;

// Where a megakernel asked for its phases' times (`megakernel.run(..., timeline=)`), else null: block 0's thread 0
// appends its SM clock after each barrier (slot 0 counts them). A module's own variable: null in every other program.
__device__ u64* grid_barrier_timeline = nullptr;

__device__ __forceinline__ void grid_barrier_mark() {
    if (blockIdx.x != 0) return;
    u64* timeline = grid_barrier_timeline;
    if (timeline != nullptr) timeline[++timeline[0]] = clock64();
}

__device__ __forceinline__ void grid_barrier(unsigned int* arrived) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        unsigned int before, now, polls = 0;
        // The ordering is in the instructions (a release add, acquire polls), not in two fences: ~20% cheaper a
        // barrier (session 34's floor, 1.15 against 1.43 us idle on an H100). The release is cumulative: the
        // block's writes, ordered before it by __syncthreads, are published with it.
        asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(before) : "l"(arrived), "r"(add) : "memory");
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(arrived) : "memory");
            if (++polls == GRID_BARRIER_POLL_LIMIT) __trap();
        } while (((before ^ now) & 0x80000000u) == 0);
        grid_barrier_mark();
    }
    __syncthreads();
}

// A 16-bit value another block of this launch may have written: a load that goes to L2 (`__ldcg`), never to a line
// this SM may hold from before (a megakernel's layers read each other's outputs, within one launch, so). Not a
// volatile load: independent ones may be in flight together (volatile ones went one round trip at a time).
template <class X> __device__ __forceinline__ float grid_seen(const X* p, i64 i) {
    return bits_to_float<X>(__ldcg(reinterpret_cast<const unsigned short*>(p) + i));
}

// A block-wide sum (any multiple of 32 threads up to 1024); every thread gets it.
__device__ __forceinline__ float grid_block_sum(float v) {
    __shared__ float partial[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // an earlier call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float total = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(total);
}

// `count` 16-bit values (both pointers 16-byte aligned) that other blocks of this launch
// wrote, from global into shared memory: 16-byte loads through L2 (`__ldcg`: never a line this SM may hold from
// before), four a thread issued before any is stored, so that their round trips overlap.
__device__ __forceinline__ void grid_stage(const u16* from, u16* to, int count) {
    constexpr int AHEAD = 4;
    const uint4* words = reinterpret_cast<const uint4*>(from);
    uint4* into = reinterpret_cast<uint4*>(to);
    const int n = count / 8;
    for (int base = threadIdx.x; base < n; base += AHEAD * blockDim.x) {
        uint4 v[AHEAD];
#pragma unroll
        for (int k = 0; k < AHEAD; ++k)
            if (base + k * static_cast<int>(blockDim.x) < n) v[k] = __ldcg(words + base + k * blockDim.x);
#pragma unroll
        for (int k = 0; k < AHEAD; ++k)
            if (base + k * static_cast<int>(blockDim.x) < n) into[base + k * blockDim.x] = v[k];
    }
    for (int i = 8 * n + threadIdx.x; i < count; i += blockDim.x) to[i] = __ldcg(from + i);  // a tail short of 8
    __syncthreads();
}

// The residual add and RMSNorm of a persistent kernel's first phase, each block its own copy: `staged` (shared
// memory, `hidden` values) gets rms_norm(x + residual) * norm and block 0 stores the rounded sum in `summed_out`.
// x and the residual are read through L2 (`grid_seen`): in the megakernel another block wrote them in this launch.
// Rounded as the Triton add + norm rounds (the sum, then (s * inverse_rms) * w); only the sum of squares adds in
// another order (the block's), so its last bit, and a normed value's rounding with it, may differ. Ends with the
// block synchronised.
template <class X, class Nw>
__device__ __forceinline__ void add_rms_norm_staged(const X* __restrict__ x, const X* __restrict__ residual,
                                                    const Nw* __restrict__ norm, float eps, int hidden, X* staged,
                                                    X* __restrict__ summed_out) {
    // Four values a thread loaded before any is used (their round trips overlap); the squares add in the order of
    // one value at a time (i = thread, thread + blockDim, ...).
    constexpr int AHEAD = 4;
    float squares = 0.0f;
    for (int base = threadIdx.x; base < hidden; base += AHEAD * blockDim.x) {
        float xs[AHEAD], rs[AHEAD];
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            const int i = base + k * blockDim.x;
            if (i < hidden) xs[k] = grid_seen(x, i), rs[k] = grid_seen(residual, i);
        }
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            const int i = base + k * blockDim.x;
            if (i >= hidden) break;
            const X s = from_float<X>(__fadd_rn(xs[k], rs[k]));
            staged[i] = s;  // the rounded sum for now; normalised below once the sum of squares is known
            if (blockIdx.x == 0) summed_out[i] = s;
            const float v = to_float(s);
            squares = fmaf(v, v, squares);
        }
    }
    const float mean_square = triton_div(grid_block_sum(squares), static_cast<float>(hidden));
    const float inverse_rms = triton_div(1.0f, triton_sqrt(__fadd_rn(mean_square, eps)));
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        staged[i] = from_float<X>(__fmul_rn(__fmul_rn(to_float(staged[i]), inverse_rms), to_float(norm[i])));
    __syncthreads();
}

// A persistent mixer's first phase (gdn_persistent.cu, attention_persistent.cu): with a residual, the layer's input
// add + norm into `staged` as `add_rms_norm_staged` (block 0 stores the sum); without one, the input as it is (the
// launch ahead normed it). Ends with the block synchronised.
template <class X, class Nw>
__device__ __forceinline__ void stage_layer_input(const X* __restrict__ x, const X* __restrict__ residual,
                                                  const Nw* __restrict__ norm, float eps, int hidden, X* staged,
                                                  X* __restrict__ summed_out) {
    if (residual != nullptr) {
        add_rms_norm_staged(x, residual, norm, eps, hidden, staged, summed_out);
        return;
    }
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) staged[i] = x[i];
    __syncthreads();
}
