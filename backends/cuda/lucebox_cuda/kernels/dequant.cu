// Decode a range of rows of a GGUF weight into a dense [rows, cols] tile of `ACT` (the prefill path:
// a bounded scratch tile then a tensor-core matmul). Same piece decoders as the matrix-vector kernels,
// so this doubles as a direct check of them against the torch reference.
//
// LUCEBOX_DEQUANT(format, activation) defines `dequant_<format>_<activation>`; any grid, any block size
// (grid-stride loop over pieces).
#include "gguf_blocks.cuh"

template <class W, class X>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ weight, X* __restrict__ out, int rows, int cols) {
    const int pieces_per_row = cols / W::BLOCK_VALUES * W::PIECES;
    const i64 total = static_cast<i64>(rows) * pieces_per_row;
    for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; t < total;
         t += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 row = t / pieces_per_row;
        const int p = static_cast<int>(t - row * pieces_per_row);
        const int block = p / W::PIECES;
        const i64 block_index = row * (cols / W::BLOCK_VALUES) + block;
        Piece<W::RUNS, W::RUN> piece;
        W::decode(weight + block_index * W::BLOCK_BYTES, p % W::PIECES, piece);
        X* dst = out + row * cols + block * W::BLOCK_VALUES;
#pragma unroll
        for (int run = 0; run < W::RUNS; ++run)
#pragma unroll
            for (int k = 0; k < W::RUN; ++k)
                dst[piece.col[run] + k] =
                    from_float<X>(piece.scale[run] * piece.q[run * W::RUN + k] - piece.min[run]);
    }
}

#define LUCEBOX_DEQUANT(FORMAT, ACT)                                                                     \
    extern "C" __global__ void dequant_##FORMAT##_##ACT(const u8* __restrict__ weight, ACT* __restrict__ out, \
                                                        int rows, int cols) {                           \
        dequant_body<W_##FORMAT, ACT>(weight, out, rows, cols);                                         \
    }
