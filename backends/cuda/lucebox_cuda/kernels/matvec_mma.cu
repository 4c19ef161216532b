// y[r, n] = sum_k x[r, k] * W[n, k] on tensor cores, for K-quant weights (Q4_K, Q5_K, Q6_K) and 1..NB
// activation rows: the batch-1 decode product and the small-batch (speculative verify) products.
//
// Why tensor cores at batch 1: the CUDA-core kernel (matvec.cu) spends ~9 instructions per weight
// (decode, int->float, FMA, min term) and is ALU-bound at a third of the bandwidth. Here a weight costs
// about one instruction: 4-bit/6-bit quants become 16-bit floats by placing them in the mantissa of a
// "magic" constant (one `prmt` makes two: 128 + q in bf16, or 1024 + q in fp16, exact), and
// `mma.sync.m16n8k16` does the multiplications with fp32 accumulation. The magic offset and the GGUF
// sub-block scale and min are applied to the fp32 partial sums of each sub-block:
//     sum_k w_k x_k = d*sc * (P - (magic + bias) * S) - dmin*m * S,
// where P = sum (magic + q) x over the sub-block and S = sum x over it (S comes from a second mma
// against an all-ones A, so it lands in the same registers as P). All products are exact (16-bit
// operands, fp32 products) and sums are fp32, so the result is as accurate as the CUDA-core kernel's.
//
// Activations are the mma's B operand (k x n, n = 8 columns per tile). bf16 activations are used as
// they are; fp16 ones too (the fp16 mma); fp32 activations are split into three bf16 parts (hi, mid,
// lo: exact, 24 bits) that occupy three B columns and are summed at the end. Column n of B is
// activation row n / SPLITS, part n % SPLITS; a batch of NB rows needs ceil(NB * SPLITS / 8) tiles,
// and every tile reuses the same decoded weight registers: each weight is read and decoded once.
//
// Layout: a block of 4 warps owns 16 weight rows (the mma's M); the warps split the row's GGUF blocks
// between them (warp w takes blocks w, w+4, ...) and add their partial sums through shared memory.
// In the mma's A fragment, lane (g = lane/4, t = lane%4) holds rows g and g+8, k slots 2t, 2t+1, 2t+8,
// 2t+9. The k order inside a 16-value mma step is ours to choose as long as A and B agree, so each lane
// takes 4 *consecutive* columns c..c+3 of one sub-block and places them as (c, c+1) in slots (2t, 2t+1)
// and (c+2, c+3) in slots (2t+8, 2t+9): one `prmt` per A register makes two (magic + q) values, and 16-bit
// activations are the B registers as loaded (no `prmt`; until session 28 the pairs were (c, c+2), (c+1, c+3),
// which cost two `prmt` a step on the B side). Q4_K's and Q5_K's two steps of a sub-block read 8 consecutive
// columns: one 16-byte activation load for both.
//
// LUCEBOX_MATVEC_MMA(format, activation, NB) defines `matvec_mma_<format>_<activation>_<NB>` (4 warps:
// launch with 128 threads per block and ceil(rows / 16) blocks); LUCEBOX_MATVEC_MMA8 the same with 8
// warps, `matvec_mma8_...` (256 threads): for long rows and few row groups, where 4 warps per 16 rows
// leave the GPU short of loads in flight.
#include "matvec_mma_body.cuh"

#define LUCEBOX_MATVEC_MMA_KERNEL(NAME, BOUNDS, WARPS, ROW_TILES, TWO_SETS, FORMAT, ACT, NB)             \
    extern "C" __global__ void BOUNDS NAME(const u8* __restrict__ weight, const ACT* __restrict__ x,      \
                                           ACT* __restrict__ y, int rows, int cols, int batch) {          \
        matvec_mma_body<Mma_##FORMAT, ACT, NB, WARPS, ROW_TILES, TWO_SETS>(weight, x, y, rows, cols, batch); \
    }
#define LUCEBOX_MATVEC_MMA_WARPS(PREFIX, WARPS, ROW_TILES, FORMAT, ACT, NB)                              \
    LUCEBOX_MATVEC_MMA_KERNEL(PREFIX##_##FORMAT##_##ACT##_##NB, __launch_bounds__(32 * WARPS), WARPS,     \
                              ROW_TILES, false, FORMAT, ACT, NB)
// The probe's register caps: MIN_BLOCKS thread blocks an SM must hold at once. Only there: an explicit minimum,
// even 1, changes ptxas's allocation (sm_90, session 28: `mma` Q4_K 114 -> 124 registers, Q6_K 106 -> 161 at 1).
#define LUCEBOX_MATVEC_MMA_BOUNDED(PREFIX, WARPS, ROW_TILES, MIN_BLOCKS, FORMAT, ACT, NB)                 \
    LUCEBOX_MATVEC_MMA_KERNEL(PREFIX##_##FORMAT##_##ACT##_##NB, __launch_bounds__(32 * WARPS, MIN_BLOCKS), \
                              WARPS, ROW_TILES, false, FORMAT, ACT, NB)
#define LUCEBOX_MATVEC_MMA(FORMAT, ACT, NB) LUCEBOX_MATVEC_MMA_WARPS(matvec_mma, 4, 1, FORMAT, ACT, NB)
#define LUCEBOX_MATVEC_MMA8(FORMAT, ACT, NB) LUCEBOX_MATVEC_MMA_WARPS(matvec_mma8, 8, 1, FORMAT, ACT, NB)
// 2 row tiles per block of 4 warps (`mma_r2`): launch with ceil(rows / 32) blocks of 128 threads.
// Bit-identical to `mma` (same warp count), half the activation reads. (4 row tiles spill at 255
// registers for sm_90 even at batch 1: ptxas -v.)
#define LUCEBOX_MATVEC_MMA_R2(FORMAT, ACT, NB) LUCEBOX_MATVEC_MMA_WARPS(matvec_mma_r2, 4, 2, FORMAT, ACT, NB)
// `mma` with two register sets used in turn (`matvec_mma_rows`' TWO_SETS: no moves a block, more registers):
// `matvec_mma_pp_...` (the catalogue's "mma_pp", the 27B's Q4_K batch-1 products: 1.03-1.15x `mma` on an H100,
// session 29), and for the probe `PREFIX_...` capped to MIN_BLOCKS thread blocks an SM. Bit-identical to `mma`.
#define LUCEBOX_MATVEC_MMA_PP(FORMAT, ACT, NB)                                                            \
    LUCEBOX_MATVEC_MMA_KERNEL(matvec_mma_pp_##FORMAT##_##ACT##_##NB, __launch_bounds__(128), 4, 1, true,   \
                              FORMAT, ACT, NB)
#define LUCEBOX_MATVEC_MMA_PP_BOUNDED(PREFIX, MIN_BLOCKS, FORMAT, ACT, NB)                                \
    LUCEBOX_MATVEC_MMA_KERNEL(PREFIX##_##FORMAT##_##ACT##_##NB, __launch_bounds__(128, MIN_BLOCKS), 4, 1,  \
                              true, FORMAT, ACT, NB)
// Given sums (`mma_block`'s GIVEN_SUMS): `matvec_mma_s_...` and `matvec_mma_r2_s_...` take a last argument, the
// sub-block sums that `matvec_sums_<format>_<activation>_<NB>` (x, sums, cols, batch) wrote for the same activations
// and batch tile just before. Bit-identical to `mma`; the backend uses them from GIVEN_SUMS_MIN_TILE rows.
#define LUCEBOX_MATVEC_MMA_GIVEN_SUMS(NAME, ROW_TILES, FORMAT, ACT, NB)                                  \
    extern "C" __global__ void __launch_bounds__(128) NAME##_##FORMAT##_##ACT##_##NB(                     \
        const u8* __restrict__ weight, const ACT* __restrict__ x, ACT* __restrict__ y, int rows, int cols,  \
        int batch, const float* __restrict__ sums) {                                                      \
        matvec_mma_body<Mma_##FORMAT, ACT, NB, 4, ROW_TILES, false, true>(weight, x, y, rows, cols, batch,   \
                                                                         sums);                           \
    }
#define LUCEBOX_MATVEC_MMA_S(FORMAT, ACT, NB) LUCEBOX_MATVEC_MMA_GIVEN_SUMS(matvec_mma_s, 1, FORMAT, ACT, NB)
#define LUCEBOX_MATVEC_MMA_R2_S(FORMAT, ACT, NB) LUCEBOX_MATVEC_MMA_GIVEN_SUMS(matvec_mma_r2_s, 2, FORMAT, ACT, NB)
#define LUCEBOX_MATVEC_SUMS(FORMAT, ACT, NB)                                                             \
    extern "C" __global__ void __launch_bounds__(128) matvec_sums_##FORMAT##_##ACT##_##NB(                \
        const ACT* __restrict__ x, float* __restrict__ sums, int cols, int batch) {                       \
        given_sums<Mma_##FORMAT, ACT, NB>(x, sums, cols, batch);                                          \
    }
