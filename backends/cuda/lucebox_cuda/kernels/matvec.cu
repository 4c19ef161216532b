// y[r, n] = sum_k x[r, k] * W[n, k] for a GGUF weight W [rows, cols] and 1..NB activation rows.
//
// One warp per output row. Lanes walk the row's pieces (8-32 weights each, see gguf_blocks.cuh), so each
// weight byte is read from memory once and dequantized in registers, then used against all NB activation
// rows: a speculative-verify batch costs the same weight traffic as one token. fp32 accumulation, one
// warp reduction per activation row at the end.
//
// Instantiate with LUCEBOX_MATVEC(format, activation, NB), e.g. LUCEBOX_MATVEC(q4_k, bf16, 1), which
// defines the kernel `matvec_q4_k_bf16_1`. Launch with 128 threads per block, ceil(rows / 4) blocks.
#include "matvec_body.cuh"

#define LUCEBOX_MATVEC(FORMAT, ACT, NB)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * LUCEBOX_MATVEC_WARPS)                            \
        matvec_##FORMAT##_##ACT##_##NB(const u8* __restrict__ weight, const ACT* __restrict__ x,         \
                                       ACT* __restrict__ y, int rows, int cols, int batch) {             \
        matvec_body<W_##FORMAT, ACT, NB>(weight, x, y, rows, cols, batch);                             \
    }
