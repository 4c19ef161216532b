// The matrix-vector body shared by matvec.cu and moe_matvec.cu: one warp per output row, each weight byte
// read once and dequantized in registers, used against up to NB activation rows (see matvec.cu).
#pragma once
#include "gguf_blocks.cuh"

#define LUCEBOX_MATVEC_WARPS 4

template <class W, class X, int NB>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ weight, const X* __restrict__ x,
                                            X* __restrict__ y, int rows, int cols, int batch) {
    lucebox_wait_prior_grid();  // before the early return too: every block waits for the kernel ahead (PDL)
    const int row = blockIdx.x * LUCEBOX_MATVEC_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int blocks_per_row = cols / W::BLOCK_VALUES;
    const u8* row_bytes = weight + static_cast<i64>(row) * blocks_per_row * W::BLOCK_BYTES;
    const int pieces = blocks_per_row * W::PIECES;

    float acc[NB];
#pragma unroll
    for (int r = 0; r < NB; ++r) acc[r] = 0.0f;

    // Two pieces in flight per lane at small batches; beyond that the activation loads already give each
    // lane enough independent work, and a second copy would spill registers.
    constexpr int UNROLL = NB <= 2 ? 2 : 1;
#pragma unroll UNROLL
    for (int p = lane; p < pieces; p += 32) {
        const int block = p / W::PIECES;
        Piece<W::RUNS, W::RUN> piece;
        W::decode(row_bytes + static_cast<i64>(block) * W::BLOCK_BYTES, p % W::PIECES, piece);
        const int base = block * W::BLOCK_VALUES;
#pragma unroll
        for (int run = 0; run < W::RUNS; ++run) {
#pragma unroll
            for (int r = 0; r < NB; ++r) {
                // Rows past `batch` re-read the last real row (valid memory) and are never stored.
                const X* x_row = x + static_cast<i64>(r < batch ? r : batch - 1) * cols;
                float xs[W::RUN];
                ActivationLoad<X, W::RUN>::load(x_row + base + piece.col[run], xs);
                float dot = 0.0f, sum = 0.0f;
#pragma unroll
                for (int k = 0; k < W::RUN; ++k) {
                    dot = fmaf(piece.q[run * W::RUN + k], xs[k], dot);
                    if (W::HAS_MIN) sum += xs[k];
                }
                acc[r] = fmaf(piece.scale[run], dot, acc[r]);
                if (W::HAS_MIN) acc[r] = fmaf(-piece.min[run], sum, acc[r]);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < NB; ++r) {
        const float total = warp_sum(acc[r]);
        if (lane == (r & 31) && r < batch) y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
    }
}
