// The mixture-of-experts products of moe_matvec.cu (for each routed pair `s`,
//     y[s, n] = sum_k x[s / x_group, k] * W[ids[s], n, k]
// over an expert stack), on tensor cores for the K-quants (Q4_K, Q5_K, Q6_K): matvec_mma.cu's body over one
// expert's rows per pair.
//
// Why: moe_matvec.cu's CUDA-core body spends ~9 instructions per weight and is ALU-bound; its warp-per-row
// layout also leaves lanes idle on short rows (a 512-column down row is 16 Q4_K pieces for 32 lanes). The
// experts of Laguna-XS.2 and Qwen3.5-35B-A3B are 512 x 2048 and 2048 x 512 (0.8 ms of a 3-4 ms decode step
// on the H200 in the CUDA-core kernels). Here 16 output rows per block of WARPS warps, the warps taking a
// row's GGUF blocks in turn (WARPS = 2 for a 2-block row, 4 for an 8-block one); blockIdx.y is the pair and,
// in the pair kernels, blockIdx.z the stack.
//
// The four kernels mirror moe_matvec.cu's (plain, paged, pair, pair paged; the paged ones read expert e from
// `pool + where[e] * expert_bytes` where a device slot holds it, else from pinned host memory at
// `host + e * expert_bytes`, staged in shared memory (`staged_expert`), and add each routed pair to the
// layer's routing `counts` unless null). All run one body with one WARPS for a shape, so the paged products
// equal the stacked ones and the pair kernel equals two single launches, bit for bit. Launch with
// 32 * WARPS threads and (ceil(rows / 16), pairs, 1 or 2) blocks (the paged ones with `staged_bytes` of
// dynamic shared memory: 16 rows, the block's). The names: `moe_matvec_mma<WARPS>[_paged|_pair|_pair_paged]_
// <format>_<activation>`; two more, `_swiglu` and `_paged_swiglu`, are the plain and paged ones with the SwiGLU
// computed in the block (below).
//
// An always-on shared expert of the same format and shape (Laguna's, Qwen3.5-MoE's) rides along as extra pairs:
// pairs `routed`.. read `extra` (in the pair kernels `extra0` / `extra1`: its gate and up) instead of a stack's
// expert, activation row `extra_x + pair - routed` (the token's row for gate and up, the shared expert's own
// activation row for down), so the block's products are one launch each, not three more. Null `extra` and
// `routed` = the pairs: none.
#include "matvec_mma_body.cuh"
#include "triton_math.cuh"

template <class W, class X, int WARPS>
__device__ __forceinline__ void expert_rows(const u8* __restrict__ blocks, const X* __restrict__ x, X* __restrict__ y,
                                            int pair, int rows, int cols, int x_row) {
    matvec_mma_body<W, X, 1, WARPS, 1>(blocks, x + static_cast<i64>(x_row) * cols, y + static_cast<i64>(pair) * rows,
                                       rows, cols, 1);
}

// A missed expert's 16 rows for this block, staged in shared memory before the math (`staged_bytes`: the
// launch's dynamic shared memory; 0, or a span that does not fit or is not 16-byte aligned: read in place).
// Why: read in place, the body's loads take 144-byte GGUF blocks of 16 rows a row apart, neighbouring blocks
// in other warps; over the bus (host memory is not cached on the GPU) that reached ~22 GB/s, half of what
// contiguous reads get (scripts/zero_copy_probe.py: ~47 GB/s from 32 blocks up on the H200). The block's
// rows are one contiguous span of the expert, read here with 16-byte loads, eight in flight a thread. The
// body then reads the same bytes from shared memory: the same arithmetic, the same bits.
extern __shared__ __align__(16) u8 lucebox_staged_rows[];

template <class W>
__device__ __forceinline__ const u8* staged_expert(const u8* expert, int rows, int cols, int staged_bytes) {
    const i64 row_bytes = static_cast<i64>(cols / W::BLOCK_VALUES) * W::BLOCK_BYTES;
    const int row0 = blockIdx.x * 16;
    const i64 span = min(16, rows - row0) * row_bytes;
    const u8* source = expert + row0 * row_bytes;
    const unsigned long long alignment = reinterpret_cast<unsigned long long>(source) | span;
    if (span > staged_bytes || (alignment & 15) != 0) return expert;
    const uint4* from = reinterpret_cast<const uint4*>(source);
    uint4* to = reinterpret_cast<uint4*>(lucebox_staged_rows);
    const int words = static_cast<int>(span >> 4);
    constexpr int IN_FLIGHT = 8;
    for (int first = threadIdx.x; first < words; first += blockDim.x * IN_FLIGHT) {
        uint4 v[IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
            const int word = first + u * blockDim.x;
            if (word < words) v[u] = from[word];
        }
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
            const int word = first + u * blockDim.x;
            if (word < words) to[word] = v[u];
        }
    }
    __syncthreads();
    return lucebox_staged_rows - row0 * row_bytes;  // the body indexes rows from the expert's first
}

// Expert `expert`'s blocks in Spark's paged stack: its device slot, or the pinned host copy staged for this
// block (`staged_expert`).
template <class W>
__device__ __forceinline__ const u8* paged_rows(const u8* pool, const u8* host, const long long* where,
                                                long long expert, long long expert_bytes, int rows, int cols,
                                                int staged_bytes) {
    const long long slot = where[expert];
    return slot >= 0 ? pool + slot * expert_bytes
                     : staged_expert<W>(host + expert * expert_bytes, rows, cols, staged_bytes);
}

// The activation row of a pair: a routed pair's token (pair / x_group), or the shared expert's row.
__device__ __forceinline__ int pair_x_row(int pair, int x_group, int routed, int extra_x) {
    return pair < routed ? pair / x_group : extra_x + pair - routed;
}

// The SwiGLU kinds (`_swiglu`, `_paged_swiglu`: the down product of a SwiGLU block) take the gate and up
// products instead of the activations and compute the pair's activation row, silu(gate) * up rounded as the
// separate Triton SwiGLU kernel rounds it, with its operations (triton_math.cuh), into shared memory
// before the body reads it: the SwiGLU's launch a layer fewer (Laguna-XS.2: 39 a step). Each block computes its
// pair's row itself (a row is a few hundred values, a block a few microseconds of weight reads). Every pair path
// (decode, verify, paged or not) takes the same kind, so their bits stay alike. Rows up to SWIGLU_MAX_COLS
// 16-bit values (the caller checks: `catalogue.MOE_SWIGLU_MAX_COLS`).
constexpr int SWIGLU_MAX_COLS = 4096;

template <class X>
__device__ __forceinline__ const X* swiglu_row(const X* __restrict__ gate, const X* __restrict__ up, int x_row,
                                               int cols) {
    static_assert(sizeof(X) == 2, "16-bit activations: the row's room is counted in them");
    __shared__ __align__(16) X act[SWIGLU_MAX_COLS];
    lucebox_wait_prior_grid();  // the gate and up products are the kernel ahead's
    const X* g = gate + static_cast<i64>(x_row) * cols;
    const X* u = up + static_cast<i64>(x_row) * cols;
    for (int k = threadIdx.x; k < cols; k += blockDim.x) {
        act[k] = from_float<X>(__fmul_rn(triton_silu_rounded<X>(to_float(g[k])), to_float(u[k])));
    }
    __syncthreads();
    return act;
}

#define LUCEBOX_MOE_EXTRA_ARGS const u8 *__restrict__ extra, int routed, int extra_x
#define LUCEBOX_MOE_PAIR_EXTRA_ARGS const u8 *__restrict__ extra0, const u8 *__restrict__ extra1, int routed, int extra_x

#define LUCEBOX_MOE_MATVEC_MMA(FORMAT, ACT, WARPS)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                \
        moe_matvec_mma##WARPS##_##FORMAT##_##ACT(const u8* __restrict__ weight, const ACT* __restrict__ x,   \
                                                 ACT* __restrict__ y, const long long* __restrict__ ids,     \
                                                 long long expert_bytes, int rows, int cols, int x_group,    \
                                                 LUCEBOX_MOE_EXTRA_ARGS) {                                   \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const u8* blocks = pair < routed ? weight + ids[pair] * expert_bytes : extra;                        \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, x, y, pair, rows, cols,                                \
                                              pair_x_row(pair, x_group, routed, extra_x));                   \
    }

#define LUCEBOX_MOE_MATVEC_MMA_PAGED(FORMAT, ACT, WARPS)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_matvec_mma##WARPS##_paged_##FORMAT##_##ACT( \
        const u8* __restrict__ pool, const u8* __restrict__ host, const long long* __restrict__ where,        \
        unsigned long long* __restrict__ counts, int staged_bytes, const ACT* __restrict__ x,                \
        ACT* __restrict__ y, const long long* __restrict__ ids, long long expert_bytes, int rows, int cols,   \
        int x_group, LUCEBOX_MOE_EXTRA_ARGS) {                                                               \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        if (pair < routed) count_routed_pair(counts, ids[pair], true);                                       \
        const u8* blocks = pair < routed ? paged_rows<Mma_##FORMAT>(pool, host, where, ids[pair],             \
                                                                    expert_bytes, rows, cols, staged_bytes)  \
                                         : extra;                                                            \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, x, y, pair, rows, cols,                                \
                                              pair_x_row(pair, x_group, routed, extra_x));                   \
    }

#define LUCEBOX_MOE_MATVEC_MMA_PAIR(FORMAT, ACT, WARPS)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_matvec_mma##WARPS##_pair_##FORMAT##_##ACT(  \
        const u8* __restrict__ weight0, const u8* __restrict__ weight1, const ACT* __restrict__ x,           \
        ACT* __restrict__ y0, ACT* __restrict__ y1, const long long* __restrict__ ids,                       \
        long long expert_bytes, int rows, int cols, int x_group, LUCEBOX_MOE_PAIR_EXTRA_ARGS) {             \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const bool first = blockIdx.z == 0;                                                                  \
        const u8* blocks = pair < routed ? (first ? weight0 : weight1) + ids[pair] * expert_bytes            \
                                         : (first ? extra0 : extra1);                                        \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, x, first ? y0 : y1, pair, rows, cols,                  \
                                              pair_x_row(pair, x_group, routed, extra_x));                   \
    }

#define LUCEBOX_MOE_MATVEC_MMA_PAIR_PAGED(FORMAT, ACT, WARPS)                                                \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                \
        moe_matvec_mma##WARPS##_pair_paged_##FORMAT##_##ACT(                                                 \
            const u8* __restrict__ pool0, const u8* __restrict__ host0, const u8* __restrict__ pool1,        \
            const u8* __restrict__ host1, const long long* __restrict__ where,                               \
            unsigned long long* __restrict__ counts, int staged_bytes, const ACT* __restrict__ x,            \
            ACT* __restrict__ y0, ACT* __restrict__ y1, const long long* __restrict__ ids,                   \
            long long expert_bytes, int rows, int cols, int x_group, LUCEBOX_MOE_PAIR_EXTRA_ARGS) {         \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const bool first = blockIdx.z == 0;                                                                  \
        if (pair < routed) count_routed_pair(counts, ids[pair], first);                                      \
        const u8* blocks = pair < routed ? paged_rows<Mma_##FORMAT>(first ? pool0 : pool1,                   \
                                                                    first ? host0 : host1, where, ids[pair], \
                                                                    expert_bytes, rows, cols, staged_bytes)  \
                                         : (first ? extra0 : extra1);                                        \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, x, first ? y0 : y1, pair, rows, cols,                  \
                                              pair_x_row(pair, x_group, routed, extra_x));                   \
    }

#define LUCEBOX_MOE_MATVEC_MMA_SWIGLU(FORMAT, ACT, WARPS)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_matvec_mma##WARPS##_swiglu_##FORMAT##_##ACT( \
        const u8* __restrict__ weight, const ACT* __restrict__ gate, const ACT* __restrict__ up,             \
        ACT* __restrict__ y, const long long* __restrict__ ids, long long expert_bytes, int rows, int cols,   \
        int x_group, LUCEBOX_MOE_EXTRA_ARGS) {                                                               \
        const int pair = blockIdx.y;                                                                         \
        const ACT* act = swiglu_row<ACT>(gate, up, pair_x_row(pair, x_group, routed, extra_x), cols);        \
        const u8* blocks = pair < routed ? weight + ids[pair] * expert_bytes : extra;                        \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, act, y, pair, rows, cols, 0);                          \
    }

#define LUCEBOX_MOE_MATVEC_MMA_PAGED_SWIGLU(FORMAT, ACT, WARPS)                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                \
        moe_matvec_mma##WARPS##_paged_swiglu_##FORMAT##_##ACT(                                               \
            const u8* __restrict__ pool, const u8* __restrict__ host, const long long* __restrict__ where,    \
            unsigned long long* __restrict__ counts, int staged_bytes, const ACT* __restrict__ gate,         \
            const ACT* __restrict__ up, ACT* __restrict__ y, const long long* __restrict__ ids,              \
            long long expert_bytes, int rows, int cols, int x_group, LUCEBOX_MOE_EXTRA_ARGS) {               \
        const int pair = blockIdx.y;                                                                         \
        const ACT* act = swiglu_row<ACT>(gate, up, pair_x_row(pair, x_group, routed, extra_x), cols);        \
        if (pair < routed) count_routed_pair(counts, ids[pair], true);                                       \
        const u8* blocks = pair < routed ? paged_rows<Mma_##FORMAT>(pool, host, where, ids[pair],             \
                                                                    expert_bytes, rows, cols, staged_bytes)  \
                                         : extra;                                                            \
        expert_rows<Mma_##FORMAT, ACT, WARPS>(blocks, act, y, pair, rows, cols, 0);                          \
    }
