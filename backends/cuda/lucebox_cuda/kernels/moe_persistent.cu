// A decode step's mixture-of-experts block (one token) with the residual add and norm before it, in one persistent
// launch with two grid-wide barriers:
//     summed = x + residual;  m = rms_norm(summed) * norm
//     logits = router . m                         (fp32 router rows, each logit rounded to the activation type)
//     ids, weights = top_k(logits)                (sigmoid + selection bias, or softmax; renormalised)
//     a_p    = silu(gate_p(m)) * up_p(m)          for each chosen expert p and the shared expert
//     out    = sum_k weights_k * down_k(a_k) + [sigmoid(shared_gate . m)] * down_shared(a_shared)
// where the unfused step launches add + norm, the router (product and top-k), the gate | up pair products, the
// SwiGLU, the down products and their combine: six kernels a layer, each a few microseconds of launch, ramp and
// drain (Laguna-XS.2's step: 39 MoE layers, ~14 kernels a layer, launch-bound; issue #14's analysis).
//
//   Phase 1. Every block: the add and the norm into shared memory (block 0 stores `summed`); then router rows, a
//     warp a row (rows blockIdx.x * WARPS + warp, stepping by the grid's warps), into `logits` (and the shared
//     expert's gate logit: one more row, `GATED`).
//   Barrier.
//   Phase 2. Every block chooses the experts itself from the logits (a few hundred values: cheaper than another
//     barrier; every block computes the same choice from the same values), then takes units (pair, 16-row tile)
//     of the gate and up products of the chosen experts and the shared one (pair top_k), and their SwiGLU into
//     `act`.
//   Barrier.
//   Phase 3. Each block stages every pair's `act` row in shared memory, then takes 16-row tiles of the output:
//     each pair's down rows for the tile (into `down_rows`, rounded to the activation type as the unfused
//     product's output is), then their weighted sum in slot order, the shared expert last (as `combine_pairs`).
//
// Arithmetic: the expert products are the unfused pair kernels' (matvec_mma_body with 4 warps: a 512-value row's
// two GGUF blocks go to warps 0 and 1 as in the 2-warp kernel, and the idle warps add exact zeros), the SwiGLU,
// the norm and the combine round with the Triton kernels' operations (triton_math.cuh). The router's logits and
// the norm's sum of squares add in another order than the Triton kernels, so a logit's or a normed value's last
// bit may differ, and a near tie between two experts' scores may then go the other way: near-tie equal, not
// bit-equal, to the unfused step.
//
// The barrier is ffn_persistent.cu's (the same counter: launches on one stream, one after another); the grid is
// sized as that kernel's. Rows of at most MOE_STAGE_VALUES values a phase stages: the hidden size, and the
// pairs' intermediate rows together ((top_k + 1) * inter). LUCEBOX_MOE_PERSISTENT(gate format, down format,
// activation, norm, SIGMOID, GATED) defines `moe_persistent_<gate>_<down>_<activation>_<norm>_<s|x><g|n>`
// (s: sigmoid router with a selection bias and a scale, x: softmax; g: the shared expert behind a sigmoid gate,
// n: ungated): launch with 128 threads a block.
#include "grid_barrier.cuh"
#include "matvec_mma_body.cuh"
#include "triton_math.cuh"

constexpr int MOE_WARPS = 4;
constexpr int MOE_TILE = 16;
constexpr int MOE_STAGE_VALUES = 8192;
constexpr int MOE_MAX_TOP_K = 16;
constexpr int MOE_MAX_EXPERTS = 512;
constexpr float MOE_FLOAT_LOWEST = -3.4028234663852886e38f;  // a NaN or -inf score's place: below every real one

__device__ __forceinline__ int moe_shfl_xor(int v, int offset) { return __shfl_xor_sync(0xFFFFFFFFu, v, offset); }

// One (value, index) candidate of the top-k: the larger value wins, the lower index among equals.
__device__ __forceinline__ bool moe_better(float value, int index, float other_value, int other_index) {
    return value > other_value || (value == other_value && index < other_index);
}

// The top_k largest of `choice` (one warp, experts <= MOE_MAX_EXPERTS, 16 a lane), descending, the lowest index
// among equals; NaN or -inf ranks below every real score but above a taken slot (-inf), so the ids are always
// top_k distinct experts.
__device__ __forceinline__ void moe_top_k(float* choice_of_lane, int experts, int top_k, int* ids) {
    const int lane = threadIdx.x & 31;
    constexpr int PER_LANE = MOE_MAX_EXPERTS / 32;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const float c = choice_of_lane[j];
        choice_of_lane[j] = (lane + 32 * j) < experts ? (c >= MOE_FLOAT_LOWEST ? c : MOE_FLOAT_LOWEST)
                                                     : -__int_as_float(0x7f800000);
    }
    for (int k = 0; k < top_k; ++k) {
        float best = -__int_as_float(0x7f800000);
        int best_index = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (moe_better(choice_of_lane[j], lane + 32 * j, best, best_index)) {
                best = choice_of_lane[j];
                best_index = lane + 32 * j;
            }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = lucebox_shfl_xor(best, offset);
            const int other_index = moe_shfl_xor(best_index, offset);
            if (moe_better(other, other_index, best, best_index)) {
                best = other;
                best_index = other_index;
            }
        }
        ids[k] = min(best_index, experts - 1);
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (lane + 32 * j == best_index) choice_of_lane[j] = -__int_as_float(0x7f800000);
    }
}

// One token's choice from its logits (other blocks wrote them: volatile loads), by warp 0: SIGMOID, Laguna's router
// (`sigmoid_topk_row`: ranked by sigmoid(logit) + bias, the chosen sigmoids renormalised, times `scale`); else
// Qwen3.5-MoE's (`softmax_topk_row`: softmax, the chosen probabilities renormalised). The sums add in this warp's
// order, Triton's in its own: a weight may differ in a last bit.
template <bool SIGMOID>
__device__ __forceinline__ void moe_choose(const float* logits, const float* __restrict__ bias, float scale,
                                           int experts, int top_k, int* chosen, float* chosen_weight) {
    constexpr int PER_LANE = MOE_MAX_EXPERTS / 32;
    const int lane = threadIdx.x & 31;
    const volatile float* seen = logits;
    float score[PER_LANE];   // sigmoid(logit), or the probability
    float choice[PER_LANE];  // what the top-k ranks: sigmoid + bias, or the probability
    float row_max = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int e = lane + 32 * j;
        score[j] = e < experts ? seen[e] : 0.0f;
        if (e < experts) row_max = fmaxf(row_max, score[j]);
    }
    if (SIGMOID) {
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const int e = lane + 32 * j;
            score[j] = triton_sigmoid(score[j]);
            choice[j] = e < experts ? __fadd_rn(score[j], bias[e]) : 0.0f;
        }
    } else {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) row_max = fmaxf(row_max, lucebox_shfl_xor(row_max, offset));
        float partial = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            score[j] = lane + 32 * j < experts ? triton_exp(__fsub_rn(score[j], row_max)) : 0.0f;
            partial = __fadd_rn(partial, score[j]);
        }
        const float total = warp_sum(partial);
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            score[j] = triton_div(score[j], total);
            choice[j] = score[j];
        }
    }
    int ids[MOE_MAX_TOP_K];
    moe_top_k(choice, experts, top_k, ids);
    float values[MOE_MAX_TOP_K];
    float total = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        float mine = 0.0f;  // the chosen expert's score, held by one lane: the warp's sum adds exact zeros to it
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (lane + 32 * j == ids[k]) mine = score[j];
        values[k] = warp_sum(mine);
        total = __fadd_rn(total, values[k]);
    }
    if (lane == 0)
        for (int k = 0; k < top_k; ++k) {
            chosen[k] = ids[k];
            const float share = triton_div(values[k], total);
            chosen_weight[k] = SIGMOID ? __fmul_rn(share, scale) : share;
        }
}

template <class Wg, class Wd, class X, class Nw, bool SIGMOID, bool GATED>
__device__ __forceinline__ void moe_persistent_body(
    const X* __restrict__ x, const X* __restrict__ residual, const Nw* __restrict__ norm, float eps,
    const float* __restrict__ router, const float* __restrict__ bias, const float* __restrict__ shared_gate_row,
    float scale, const u8* __restrict__ gate_exps, const u8* __restrict__ up_exps, const u8* __restrict__ down_exps,
    long long gate_expert_bytes, long long down_expert_bytes, const u8* __restrict__ shared_gate,
    const u8* __restrict__ shared_up, const u8* __restrict__ shared_down, X* __restrict__ summed_out,
    X* __restrict__ out, float* __restrict__ logits, X* __restrict__ gate_logit, X* __restrict__ products,
    X* __restrict__ act, X* __restrict__ down_rows, long long* __restrict__ ids_out, float* __restrict__ weights_out,
    unsigned int* __restrict__ arrived, int hidden, int inter, int experts, int top_k) {
    static_assert(sizeof(X) == 2, "16-bit activations: the staged rows' room is counted in them");
    __shared__ __align__(16) X staged[MOE_STAGE_VALUES];
    __shared__ int chosen[MOE_MAX_TOP_K];
    __shared__ float chosen_weight[MOE_MAX_TOP_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pairs = top_k + 1;  // the chosen experts, then the shared one
    lucebox_wait_prior_grid();

    // Phase 1: the add and the norm (each block its own copy), then the router's rows.
    add_rms_norm_staged(x, residual, norm, eps, hidden, staged, summed_out);
    const int router_rows = experts + (GATED ? 1 : 0);
    for (int row = blockIdx.x * MOE_WARPS + warp; row < router_rows; row += gridDim.x * MOE_WARPS) {
        const float* weight = row < experts ? router + static_cast<i64>(row) * hidden : shared_gate_row;
        float sum = 0.0f;
        for (int k = 4 * lane; k < hidden; k += 128) {  // 4 values a lane, 16-byte loads (hidden % 256 == 0)
            const float4 w = *reinterpret_cast<const float4*>(weight + k);
            sum = fmaf(w.x, to_float(staged[k]), sum);
            sum = fmaf(w.y, to_float(staged[k + 1]), sum);
            sum = fmaf(w.z, to_float(staged[k + 2]), sum);
            sum = fmaf(w.w, to_float(staged[k + 3]), sum);
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const X rounded = from_float<X>(sum);  // as the router's product gives it, in the activations' type
            if (row < experts) logits[row] = to_float(rounded);
            else gate_logit[0] = rounded;
        }
    }
    grid_barrier(arrived);

    // Phase 2: the choice (warp 0 of every block), then the gate and up products and their SwiGLU.
    if (warp == 0) moe_choose<SIGMOID>(logits, bias, scale, experts, top_k, chosen, chosen_weight);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < top_k) {  // for a check of the choice: the unfused router's outputs
        ids_out[threadIdx.x] = chosen[threadIdx.x];
        weights_out[threadIdx.x] = chosen_weight[threadIdx.x];
    }
    const int tiles = inter / MOE_TILE;
    for (int unit = blockIdx.x; unit < pairs * tiles; unit += gridDim.x) {
        const int pair = unit / tiles, row0 = (unit % tiles) * MOE_TILE;
        const bool routed = pair < top_k;
        const u8* gate = routed ? gate_exps + chosen[pair] * gate_expert_bytes : shared_gate;
        const u8* up = routed ? up_exps + chosen[pair] * gate_expert_bytes : shared_up;
        X* gate_rows = products + static_cast<i64>(pair) * 2 * inter;
        matvec_mma_rows<Wg, X, 1, MOE_WARPS, 1>(gate, staged, gate_rows, inter, hidden, 1, row0);
        __syncthreads();
        matvec_mma_rows<Wg, X, 1, MOE_WARPS, 1>(up, staged, gate_rows + inter, inter, hidden, 1, row0);
        __syncthreads();
        if (threadIdx.x < MOE_TILE) {
            const int row = row0 + threadIdx.x;
            const float silu = triton_silu_rounded<X>(to_float(gate_rows[row]));
            act[static_cast<i64>(pair) * inter + row] = from_float<X>(__fmul_rn(silu, to_float(gate_rows[inter + row])));
        }
    }
    grid_barrier(arrived);

    // Phase 3: the down products of every pair for a tile of output rows, and their combine.
    const int out_tiles = hidden / MOE_TILE;
    if (blockIdx.x >= out_tiles) return;  // the whole block: no barrier follows
    grid_stage(reinterpret_cast<const u16*>(act), reinterpret_cast<u16*>(staged), pairs * inter);
    // The gate logit, another block's phase-1 write: a volatile load, as every cross-block read here.
    const u16 gate_bits = *reinterpret_cast<const volatile u16*>(gate_logit);
    const float shared_weight = GATED ? triton_sigmoid(bits_to_float<X>(gate_bits)) : 1.0f;
    for (int tile = blockIdx.x; tile < out_tiles; tile += gridDim.x) {
        const int row0 = tile * MOE_TILE;
        for (int pair = 0; pair < pairs; ++pair) {
            const u8* down = pair < top_k ? down_exps + chosen[pair] * down_expert_bytes : shared_down;
            matvec_mma_rows<Wd, X, 1, MOE_WARPS, 1>(down, staged + pair * inter, down_rows + static_cast<i64>(pair) * hidden,
                                                   hidden, inter, 1, row0);
            __syncthreads();
        }
        if (threadIdx.x < MOE_TILE) {
            const int row = row0 + threadIdx.x;
            float total = 0.0f;
            for (int k = 0; k < top_k; ++k) total = fmaf(to_float(down_rows[static_cast<i64>(k) * hidden + row]),
                                                         chosen_weight[k], total);
            const float shared = to_float(down_rows[static_cast<i64>(top_k) * hidden + row]);
            total = GATED ? fmaf(shared, shared_weight, total) : __fadd_rn(total, shared);
            out[row] = from_float<X>(total);
        }
        __syncthreads();
    }
}

#define LUCEBOX_MOE_PERSISTENT_KERNEL(GATE, DOWN, ACT, NORM, SIGMOID, GATED, SUFFIX)                            \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS)                                               \
        moe_persistent_##GATE##_##DOWN##_##ACT##_##NORM##_##SUFFIX(                                            \
            const ACT* __restrict__ x, const ACT* __restrict__ residual, const NORM* __restrict__ norm, float eps, \
            const float* __restrict__ router, const float* __restrict__ bias,                                  \
            const float* __restrict__ shared_gate_row, float scale, const u8* __restrict__ gate_exps,          \
            const u8* __restrict__ up_exps, const u8* __restrict__ down_exps, long long gate_expert_bytes,     \
            long long down_expert_bytes, const u8* __restrict__ shared_gate, const u8* __restrict__ shared_up, \
            const u8* __restrict__ shared_down, ACT* __restrict__ summed_out, ACT* __restrict__ out,           \
            float* __restrict__ logits, ACT* __restrict__ gate_logit, ACT* __restrict__ products,              \
            ACT* __restrict__ act, ACT* __restrict__ down_rows, long long* __restrict__ ids_out,                \
            float* __restrict__ weights_out, unsigned int* __restrict__ arrived, int hidden, int inter,        \
            int experts, int top_k) {                                                                          \
        moe_persistent_body<Mma_##GATE, Mma_##DOWN, ACT, NORM, SIGMOID, GATED>(                                \
            x, residual, norm, eps, router, bias, shared_gate_row, scale, gate_exps, up_exps, down_exps,       \
            gate_expert_bytes, down_expert_bytes, shared_gate, shared_up, shared_down, summed_out, out, logits, \
            gate_logit, products, act, down_rows, ids_out, weights_out, arrived, hidden, inter, experts, top_k); \
    }
#define LUCEBOX_MOE_PERSISTENT(GATE, DOWN, ACT, NORM)                                                          \
    LUCEBOX_MOE_PERSISTENT_KERNEL(GATE, DOWN, ACT, NORM, true, false, sn)                                      \
    LUCEBOX_MOE_PERSISTENT_KERNEL(GATE, DOWN, ACT, NORM, false, true, xg)
