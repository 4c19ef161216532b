// Decode a range of rows of a GGUF weight into a dense [rows, cols] tile of `ACT` (the prefill path:
// a bounded scratch tile then a tensor-core matmul). Same piece decoders as the matrix-vector kernels,
// so this doubles as a direct check of them against the torch reference.
//
// LUCEBOX_DEQUANT(format, activation) defines `dequant_<format>_<activation>`; LUCEBOX_DEQUANT_ROWS the same
// over the rows named by a device array of ids, `dequant_rows_<format>_<activation>` (the embedding lookup).
// Any grid, any block size (grid-stride loop over pieces).
#include "gguf_blocks.cuh"

// The unsigned word of a vector store of N bytes.
template <int N> struct StoreWord;
template <> struct StoreWord<4> { using type = unsigned int; };
template <> struct StoreWord<8> { using type = uint2; };
template <> struct StoreWord<16> { using type = uint4; };

// `ids`: null for rows 0..rows-1 of `weight`; else output row r decodes weight row ids[r] (an embedding lookup
// whose token ids are on the device: no host value depends on them, so a recorded step may hold it).
template <class W, class X>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ weight, X* __restrict__ out, int rows, int cols,
                                             const long long* __restrict__ ids = nullptr) {
    lucebox_wait_prior_grid();  // a prefill's scratch: the previous layer's product may still read it
    const int pieces_per_row = cols / W::BLOCK_VALUES * W::PIECES;
    const i64 total = static_cast<i64>(rows) * pieces_per_row;
    for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; t < total;
         t += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 row = t / pieces_per_row;
        const int p = static_cast<int>(t - row * pieces_per_row);
        const int block = p / W::PIECES;
        const i64 source = ids != nullptr ? static_cast<i64>(ids[row]) : row;
        const i64 block_index = source * (cols / W::BLOCK_VALUES) + block;
        Piece<W::RUNS, W::RUN> piece;
        W::decode(weight + block_index * W::BLOCK_BYTES, p % W::PIECES, piece);
        X* dst = out + row * cols + block * W::BLOCK_VALUES;
        // Each run's values go out in 8- or 16-byte stores: element-wise 2-byte stores from a warp touch 32
        // sectors each and ran this kernel at ~200 GB/s (H200 profile of a 27B prefill, run 6).
        constexpr int RUN_BYTES = W::RUN * static_cast<int>(sizeof(X));
        constexpr int STORE = RUN_BYTES >= 16 ? 16 : RUN_BYTES;
        using V = typename StoreWord<STORE>::type;
#pragma unroll
        for (int run = 0; run < W::RUNS; ++run) {
            alignas(16) X values[W::RUN];
#pragma unroll
            for (int k = 0; k < W::RUN; ++k)
                values[k] = from_float<X>(piece.scale[run] * piece.q[run * W::RUN + k] - piece.min[run]);
            const V* words = reinterpret_cast<const V*>(values);
            V* target = reinterpret_cast<V*>(dst + piece.col[run]);
#pragma unroll
            for (int i = 0; i < RUN_BYTES / STORE; ++i) target[i] = words[i];
        }
    }
}

#define LUCEBOX_DEQUANT(FORMAT, ACT)                                                                     \
    extern "C" __global__ void dequant_##FORMAT##_##ACT(const u8* __restrict__ weight, ACT* __restrict__ out, \
                                                        int rows, int cols) {                           \
        dequant_body<W_##FORMAT, ACT>(weight, out, rows, cols);                                         \
    }

#define LUCEBOX_DEQUANT_ROWS(FORMAT, ACT)                                                                \
    extern "C" __global__ void dequant_rows_##FORMAT##_##ACT(const u8* __restrict__ weight,               \
                                                             const long long* __restrict__ ids,           \
                                                             ACT* __restrict__ out, int rows, int cols) { \
        dequant_body<W_##FORMAT, ACT>(weight, out, rows, cols, ids);                                    \
    }

// Rows first_row .. first_row + rows - 1 of a weight held tiled (`tiled_weights.py`, row-group-major) back in GGUF's
// row-major bytes, one 2-byte unit a thread: what a prefill's dequant of such a weight reads. One kernel instead of
// torch's byte gather and two copies (~20 ms of the 27B's pp4096 on the H100, session 30). Every piece a tile holds
// is 2 or 4 bytes at an even offset, so 2-byte units move whole. `unit_offsets` [16, half_block]: the offset, in
// units, inside a tile of unit j of row r % 16's block; a tile (row group G, block b) starts at unit
// (G * blocks + b) * 16 * half_block. Grid: x over a row's units, y over rows (each y loops on by gridDim.y).
// `untile_rows_at`: rows ids[0 .. rows - 1] (long, on the device) instead: an embedding lookup's rows, read after the
// kernel ahead (which may have written the ids) in one launch, not ~8 of torch's index arithmetic (session 36).
__device__ __forceinline__ void untile_body(const u16* __restrict__ tiles, const int* __restrict__ unit_offsets,
                                            u16* __restrict__ out, int first_row, const long long* __restrict__ ids,
                                            int rows, int blocks, int half_block) {
    const int row_units = blocks * half_block;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const i64 row = ids ? ids[r] : first_row + r;
        const i64 group_start = (row >> 4) * blocks * 16 * half_block;
        const int* offsets = unit_offsets + (row & 15) * half_block;
        for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < row_units; u += gridDim.x * blockDim.x) {
            const int b = u / half_block;
            out[static_cast<i64>(r) * row_units + u] =
                tiles[group_start + static_cast<i64>(b) * 16 * half_block + offsets[u - b * half_block]];
        }
    }
}
#define LUCEBOX_UNTILE_ROWS()                                                                                  \
    extern "C" __global__ void untile_rows(const u16* __restrict__ tiles, const int* __restrict__ unit_offsets,  \
                                           u16* __restrict__ out, int first_row, int rows, int blocks,          \
                                           int half_block) {                                                    \
        lucebox_wait_prior_grid(); /* the scratch rows: the previous product may still read them */            \
        untile_body(tiles, unit_offsets, out, first_row, nullptr, rows, blocks, half_block);                   \
    }                                                                                                          \
    extern "C" __global__ void untile_rows_at(const u16* __restrict__ tiles, const int* __restrict__ unit_offsets, \
                                              const long long* __restrict__ ids, u16* __restrict__ out, int rows, \
                                              int blocks, int half_block) {                                    \
        lucebox_wait_prior_grid(); /* the ids and the scratch rows: the kernels ahead write and read them */  \
        untile_body(tiles, unit_offsets, out, 0, ids, rows, blocks, half_block);                               \
    }
