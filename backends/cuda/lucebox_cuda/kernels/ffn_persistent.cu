// A dense SwiGLU MLP of a decode step (one token) with the residual add and norm before it, in one persistent
// launch:
//     summed = x + residual                       (the mixer's output joins the residual stream)
//     m      = rms_norm(summed) * norm
//     a      = silu(gate(m)) * up(m)              (gate | up: one fused weight, [2I x hidden])
//     out    = down(a)                            (the MLP's output, added by the next layer's norm)
// where the unfused step launches add + norm, the gate | up product, the SwiGLU and the down product.
//
// Why: a small model's decode step is launch-bound, not bandwidth-bound. Each of those four kernels is a few
// microseconds of work that pays a launch, a ramp while its first loads are in flight and a drain while its
// last blocks finish (Qwen3.5-0.8B: ~11 kernels a layer, ~1.6 ms a step on the H200 for ~0.5 GB of weights,
// which the copy bandwidth reads in ~0.12 ms). Here the four are two phases of one kernel, separated by one
// grid-wide barrier: the first step of issue #17's megakernel (every layer's work in one persistent kernel).
//
// The grid is persistent: every block must be resident at once for the barrier to finish, so the launcher
// sizes it from the driver's occupancy (`ffn_persistent.grid_size`), never more blocks than the SMs hold.
//   Phase 1. Every block computes the add and the norm itself (hidden values, a few KB: cheaper than a barrier)
//     into its shared memory; block 0 stores `summed`.
//     Then it takes 16-row tiles of the gate rows in turn (tile t, t + grid, ...): the gate's 16 rows and the
//     up's 16 rows (rows I + 16t of the fused weight) into `products`, and their SwiGLU into `act`.
//   Barrier.
//   Phase 2. Every block stages `act` in shared memory, then takes 16-row tiles of the down product into `out`.
// The products run matvec_mma.cu's tensor-core body (`matvec_mma_rows`, 4 warps, one row tile), so each output
// has the arithmetic of the unfused `mma` kernel: the same bits where the unfused step runs a 4-warp variant of
// one K slice (not `mma8` or a split-K `pipe` one). The norm and the SwiGLU round where the Triton kernels round,
// with their operations (triton_math.cuh); the norm's sum of squares adds in another order, so its last bit may
// differ from the Triton kernel's, and a normed value's bf16 rounding with it.
//
// The barrier (grid_barrier.cuh) needs no reset between launches.
//
// LUCEBOX_FFN_PERSISTENT(gate_up format, down format, activation, norm weight) defines
// `ffn_persistent_<gate_up>_<down>_<activation>_<norm>` (LUCEBOX_FFN_PERSISTENT_R2: `ffn_persistent_r2_...`, 32-row
// tiles): launch with 128 threads a block.
#include "grid_barrier.cuh"
#include "matvec_mma_body.cuh"
#include "triton_math.cuh"

constexpr int FFN_WARPS = 4;
constexpr int FFN_TILE = 16;
// The longest vector a block stages (hidden and intermediate sizes): 36 KiB of 16-bit values, the 27B's 17,408
// intermediate values with room; with the products' partial sums under the 48 KiB of static shared memory.
constexpr int FFN_STAGE_VALUES = 18432;

template <class Wg, class Wd, class X, class Nw, int ROW_TILES>
__device__ __forceinline__ void ffn_persistent_body(
    const u8* __restrict__ gate_up, const u8* __restrict__ down, const X* __restrict__ x,
    const X* __restrict__ residual, const Nw* __restrict__ norm, X* __restrict__ summed_out,
    X* __restrict__ products, X* __restrict__ act, X* __restrict__ out, unsigned int* __restrict__ arrived,
    int hidden, int inter, float eps, X* staged) {
    static_assert(sizeof(X) == 2, "16-bit activations: the staged vector's room is counted in them");
    // `staged`, the vector the products read: the normed input in phase 1, the SwiGLU's output in phase 2. In shared
    // memory (the caller's: FFN_STAGE_VALUES values, or a megakernel's shared buffer), so that the products' loads
    // (read-only ones, for a kernel parameter) never see a line written in this launch.
    lucebox_wait_prior_grid();
    // Phase 1: the add and the norm, each block its own copy.
    add_rms_norm_staged(x, residual, norm, eps, hidden, staged, summed_out);

    // Gate and up tiles (16 * ROW_TILES rows each), then their SwiGLU.
    constexpr int rows_a_tile = FFN_TILE * ROW_TILES;
    const int gate_tiles = inter / rows_a_tile;
    for (int tile = blockIdx.x; tile < gate_tiles; tile += gridDim.x) {
        const int row0 = tile * rows_a_tile;
        matvec_mma_rows<Wg, X, 1, FFN_WARPS, ROW_TILES>(gate_up, staged, products, 2 * inter, hidden, 1, row0);
        __syncthreads();  // the body's shared partial sums are reused by the next call
        matvec_mma_rows<Wg, X, 1, FFN_WARPS, ROW_TILES>(gate_up, staged, products, 2 * inter, hidden, 1,
                                                        inter + row0);
        __syncthreads();  // both products of the tile are stored (by this block: visible to it now)
        if (threadIdx.x < rows_a_tile) {
            const int row = row0 + threadIdx.x;
            const float silu = triton_silu_rounded<X>(to_float(products[row]));
            act[row] = from_float<X>(__fmul_rn(silu, to_float(products[inter + row])));
        }
    }
    grid_barrier(arrived);

    // Phase 2: the down product over every block's SwiGLU rows (blocks past its tiles are done).
    const int down_tiles = (hidden + rows_a_tile - 1) / rows_a_tile;
    if (blockIdx.x >= down_tiles) return;  // the whole block: no barrier follows
    grid_stage(reinterpret_cast<const u16*>(act), reinterpret_cast<u16*>(staged), inter);
    for (int tile = blockIdx.x; tile < down_tiles; tile += gridDim.x) {
        matvec_mma_rows<Wd, X, 1, FFN_WARPS, ROW_TILES>(down, staged, out, hidden, inter, 1, tile * rows_a_tile);
        __syncthreads();
    }
}

#define LUCEBOX_FFN_PERSISTENT_ROWS(PREFIX, ROW_TILES, GATE_UP, DOWN, ACT, NORM)                              \
    extern "C" __global__ void __launch_bounds__(32 * FFN_WARPS)                                             \
        PREFIX##_##GATE_UP##_##DOWN##_##ACT##_##NORM(                                                         \
            const u8* __restrict__ gate_up, const u8* __restrict__ down, const ACT* __restrict__ x,            \
            const ACT* __restrict__ residual, const NORM* __restrict__ norm, ACT* __restrict__ summed_out,     \
            ACT* __restrict__ products, ACT* __restrict__ act, ACT* __restrict__ out,                          \
            unsigned int* __restrict__ arrived, int hidden, int inter, float eps) {                          \
        __shared__ __align__(16) ACT staged[FFN_STAGE_VALUES];                                               \
        ffn_persistent_body<Mma_##GATE_UP, Mma_##DOWN, ACT, NORM, ROW_TILES>(                                 \
            gate_up, down, x, residual, norm, summed_out, products, act, out, arrived, hidden, inter, eps,     \
            staged);                                                                                          \
    }
#define LUCEBOX_FFN_PERSISTENT(GATE_UP, DOWN, ACT, NORM) \
    LUCEBOX_FFN_PERSISTENT_ROWS(ffn_persistent, 1, GATE_UP, DOWN, ACT, NORM)
// Two row tiles a step (`ffn_persistent_r2_...`): the same bits (a row's arithmetic does not depend on
// ROW_TILES), twice the weight rows in flight a warp and half the steps; the rows a multiple of 32.
#define LUCEBOX_FFN_PERSISTENT_R2(GATE_UP, DOWN, ACT, NORM) \
    LUCEBOX_FFN_PERSISTENT_ROWS(ffn_persistent_r2, 2, GATE_UP, DOWN, ACT, NORM)
