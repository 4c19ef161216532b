// The tensor-core matrix-vector body shared by matvec_mma.cu (dense weights) and moe_matvec_mma.cu (expert
// stacks): see matvec_mma.cu for the method.
#pragma once
#include "mma_formats.cuh"

// -- pieces shared by the row-major kernel below and the tiled one (matvec_tiled.cu) -------------------

// The B columns of an activation batch: column n of a tile is activation row n / SPLITS, fp32 part n % SPLITS.
template <class X, int NB> struct MmaColumns {
    typedef ActivationFragment<X> Frag;
    static constexpr int SPLITS = Frag::SPLITS, COLUMNS = NB * SPLITS, TILES = (COLUMNS + 7) / 8;
    // This lane's B column in each tile: activation row and fp32 part, or none (zeros).
    const X* x_col[TILES];
    int part[TILES];
    bool has_col[TILES];
    __device__ __forceinline__ MmaColumns(const X* __restrict__ x, int cols, int batch, int g) {
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            const int column = 8 * tile + g, r = column / SPLITS;
            has_col[tile] = column < COLUMNS && r < batch;
            part[tile] = column % SPLITS;
            x_col[tile] = x + static_cast<i64>(has_col[tile] ? r : 0) * cols;
        }
    }
};

// This lane's B registers of sub-block group `grp` in column tile `tile` (zeros where it has no column), in the
// order the group's mma steps take them; two steps of 8 consecutive columns come in one load.
template <class W, class X, int NB>
__device__ __forceinline__ void group_columns(const MmaColumns<X, NB>& columns, int tile, int base, int grp, int t,
                                              u32 (&b0)[W::STEPS_PER_GROUP], u32 (&b1)[W::STEPS_PER_GROUP]) {
    typedef typename MmaColumns<X, NB>::Frag Frag;
#pragma unroll
    for (int within = 0; within < W::STEPS_PER_GROUP; ++within) b0[within] = b1[within] = 0;
    if (!columns.has_col[tile]) return;
    const X* x_col = columns.x_col[tile] + base;
    if constexpr (W::PAIRED_STEPS && W::STEPS_PER_GROUP == 2) {
        Frag::load8(x_col + W::step_column(2 * grp, t), columns.part[tile], b0, b1);
    } else {
#pragma unroll
        for (int within = 0; within < W::STEPS_PER_GROUP; ++within)
            Frag::load(x_col + W::step_column(grp * W::STEPS_PER_GROUP + within, t), columns.part[tile], b0[within],
                       b1[within]);
    }
}

// Where group `grp` of GGUF block `block` keeps tile `tile`'s 8 column sums in a given-sums buffer (floats).
template <class W, int TILES> __device__ __forceinline__ i64 given_sums_at(int block, int grp, int tile) {
    constexpr int GROUPS = W::STEPS / W::STEPS_PER_GROUP;
    return ((static_cast<i64>(block) * GROUPS + grp) * TILES + tile) * 8;
}

// Group `grp` of GGUF block `block`: lane t's S fragment of each column tile, as the all-ones mma leaves it (every row
// of that product is the same sum: columns 2t, 2t + 1 serve rows g and g + 8).
template <class W, int TILES>
__device__ __forceinline__ void read_given_sums(const float* __restrict__ sums, int block, int grp, int t,
                                                float (&s)[TILES][4]) {
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const float* at = sums + given_sums_at<W, TILES>(block, grp, tile) + 2 * t;
        const float2 v = __ldg(reinterpret_cast<const float2*>(at));
        s[tile][0] = s[tile][2] = v.x;
        s[tile][1] = s[tile][3] = v.y;
    }
}

// The sums S of every sub-block group of every column tile (the all-ones mma of `mma_block`, fragment for fragment),
// written once for a whole product: sums[((block * GROUPS + group) * TILES + tile) * 8 + column]. One warp a
// (GGUF block, group) pair; launch with 128 threads and ceil(cols / BLOCK_VALUES * GROUPS / 4) blocks.
template <class W, class X, int NB>
__device__ __forceinline__ void given_sums(const X* __restrict__ x, float* __restrict__ sums, int cols, int batch) {
    typedef MmaColumns<X, NB> C;
    typedef typename C::Frag::E E;
    constexpr int GROUPS = W::STEPS / W::STEPS_PER_GROUP;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pair = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int block = pair / GROUPS, grp = pair % GROUPS;
    lucebox_wait_prior_grid();  // before any read of x and any write of `sums` (the product ahead may read them)
    if (block >= cols / W::BLOCK_VALUES) return;
    const C columns(x, cols, batch, g);
    const u32 ones[4] = {E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR};
#pragma unroll
    for (int tile = 0; tile < C::TILES; ++tile) {
        u32 b0[W::STEPS_PER_GROUP], b1[W::STEPS_PER_GROUP];
        group_columns<W>(columns, tile, block * W::BLOCK_VALUES, grp, t, b0, b1);
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int within = 0; within < W::STEPS_PER_GROUP; ++within) E::mma(s, ones, b0[within], b1[within]);
        if (g == 0) *reinterpret_cast<float2*>(sums + given_sums_at<W, C::TILES>(block, grp, tile) + 2 * t) =
            make_float2(s[0], s[1]);
    }
}

// Add one GGUF block (`block` of the row) of ROW_TILES row tiles to the accumulators: `raw_a` / `raw_b` hold this
// lane's bytes of rows g and g+8 of each tile. The mma steps, then each sub-block's scale and min on its fp32 sums.
// GIVEN_SUMS: S comes from `sums` (matvec_sums' output for these activations, `given_sums` above) instead of this
// block's own all-ones mma: the same mma on the same fragments, so the same bits, with a third to a half fewer
// tensor-core steps where the activations fill two or more tiles. Those steps turned out not to bound the verify
// products (session 37: no faster end to end), so the backend takes this form only with LUCEBOX_GIVEN_SUMS=1.
template <class W, class X, int NB, int ROW_TILES, bool GIVEN_SUMS = false>
__device__ __forceinline__ void mma_block(const typename W::Raw (&raw_a)[ROW_TILES],
                                          const typename W::Raw (&raw_b)[ROW_TILES], int block, int t,
                                          const MmaColumns<X, NB>& columns,
                                          float (&acc)[ROW_TILES][MmaColumns<X, NB>::TILES][4],
                                          const float* __restrict__ sums = nullptr) {
    typedef MmaColumns<X, NB> C;
    typedef typename C::Frag Frag;
    typedef typename Frag::E E;
    constexpr int COLUMNS = C::COLUMNS, TILES = C::TILES;
    constexpr int GROUPS = W::STEPS / W::STEPS_PER_GROUP;
    // Sub-block sums P come out as magic + bias times S too large; this removes it.
    constexpr float OFFSET = E::MAGIC + W::BIAS;
    const u32 ones[4] = {E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR};

    float d_a[ROW_TILES], dmin_a[ROW_TILES], d_b[ROW_TILES], dmin_b[ROW_TILES];
    typename W::Groups groups_a[ROW_TILES], groups_b[ROW_TILES];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt) {
        W::scales(raw_a[rt], d_a[rt], dmin_a[rt]);
        W::scales(raw_b[rt], d_b[rt], dmin_b[rt]);
        groups_a[rt] = W::groups(raw_a[rt]);
        groups_b[rt] = W::groups(raw_b[rt]);
    }
    const int base = block * W::BLOCK_VALUES;
#pragma unroll
    for (int grp = 0; grp < GROUPS; ++grp) {
        float p[ROW_TILES][TILES][4], s[TILES][4];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                s[tile][k] = 0.0f;
#pragma unroll
                for (int rt = 0; rt < ROW_TILES; ++rt) p[rt][tile][k] = 0.0f;
            }
        if constexpr (GIVEN_SUMS) read_given_sums<W>(sums, block, grp, t, s);  // before the mma steps that hide it
        // The group's A registers, [step within the group][row tile], then each tile's B registers: two steps of 8
        // consecutive columns come in one load, and B is live for one tile at a time (registers at 16-64 rows).
        // Every accumulator sees the group's steps in step order, as a step-outer loop would.
        u32 a[W::STEPS_PER_GROUP][ROW_TILES][4];
#pragma unroll
        for (int within = 0; within < W::STEPS_PER_GROUP; ++within)
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                const int step = grp * W::STEPS_PER_GROUP + within;
                const u32 q_a = W::step_quants(raw_a[rt], step), q_b = W::step_quants(raw_b[rt], step);
                a[within][rt][0] = low_pair<E>(q_a);
                a[within][rt][1] = low_pair<E>(q_b);
                a[within][rt][2] = high_pair<E>(q_a);
                a[within][rt][3] = high_pair<E>(q_b);
            }
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            u32 b0[W::STEPS_PER_GROUP], b1[W::STEPS_PER_GROUP];  // [step]
            group_columns<W>(columns, tile, base, grp, t, b0, b1);
#pragma unroll
            for (int within = 0; within < W::STEPS_PER_GROUP; ++within) {
#pragma unroll
                for (int rt = 0; rt < ROW_TILES; ++rt) E::mma(p[rt][tile], a[within][rt], b0[within], b1[within]);
                if constexpr (!GIVEN_SUMS) E::mma(s[tile], ones, b0[within], b1[within]);
            }
        }
#pragma unroll
        for (int rt = 0; rt < ROW_TILES; ++rt) {
            float da, ma, db, mb;
            W::group(groups_a[rt], grp, d_a[rt], dmin_a[rt], da, ma);
            W::group(groups_b[rt], grp, d_b[rt], dmin_b[rt], db, mb);
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    // Fragment element k: row g (k < 2) or g+8, column 2t + (k & 1) of the tile.
                    if ((k & 1) && 8 * tile + 1 >= COLUMNS) continue;  // odd columns unused at all
                    const float sum_x = s[tile][k];
                    const float q_dot_x = fmaf(-OFFSET, sum_x, p[rt][tile][k]);
                    acc[rt][tile][k] = fmaf(k < 2 ? da : db, q_dot_x, acc[rt][tile][k]);
                    if (W::HAS_MIN) acc[rt][tile][k] = fmaf(-(k < 2 ? ma : mb), sum_x, acc[rt][tile][k]);
                }
        }
    }
}

// Add the warps' partial sums in warp order (partial[warp][row][column]) and store rows row0.. of y.
template <class X, int NB, int WARPS, int ROW_TILES>
__device__ __forceinline__ void mma_store(const float (&acc)[ROW_TILES][MmaColumns<X, NB>::TILES][4],
                                          X* __restrict__ y, int rows, int batch, int row0) {
    constexpr int SPLITS = MmaColumns<X, NB>::SPLITS, TILES = MmaColumns<X, NB>::TILES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    __shared__ float partial[WARPS][16 * ROW_TILES][8 * TILES + 1];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                partial[warp][16 * rt + g + 8 * (k >> 1)][8 * tile + 2 * t + (k & 1)] = acc[rt][tile][k];
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * ROW_TILES * NB; i += 32 * WARPS) {
        const int r = i / (16 * ROW_TILES), local = i % (16 * ROW_TILES), row = row0 + local;
        if (r >= batch || row >= rows) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
#pragma unroll
            for (int split = 0; split < SPLITS; ++split) total += partial[w][local][r * SPLITS + split];
        y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
    }
}

// -- the kernel ---------------------------------------------------------------------------------------

// ROW_TILES groups of 16 rows per block (the "mma" and "mma8" kernels: 1). Each activation fragment a
// warp loads then serves ROW_TILES weight tiles, and the sub-block sums S (which depend on the activations
// alone) are computed once for all of them: at 16-64 activation rows the activations, re-read once per
// block, outweigh the weights, and more rows per block read them fewer times. A row's arithmetic is the
// same whatever ROW_TILES (the same mma steps in the same order, the same partial-sum order), so every
// variant of one warp count gives the same bits.
// The rows from `row0` (16 * ROW_TILES of them): a block's tile, which a grid of one tile a block takes from its
// index (`matvec_mma_body`) and a persistent kernel from its own loop over tiles (ffn_persistent.cu).
template <class W, class X, int NB, int WARPS, int ROW_TILES, bool TWO_SETS = false, bool GIVEN_SUMS = false>
__device__ __forceinline__ void matvec_mma_rows(const u8* __restrict__ weight, const X* __restrict__ x,
                                                X* __restrict__ y, int rows, int cols, int batch, int row0,
                                                const float* __restrict__ sums = nullptr) {
    typedef MmaColumns<X, NB> C;
    constexpr int TILES = C::TILES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int blocks_per_row = cols / W::BLOCK_VALUES;
    // Rows past the end re-read the last row (valid memory); their results are never stored.
    const u8* bytes_a[ROW_TILES];
    const u8* bytes_b[ROW_TILES];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt) {
        const int row_a = min(row0 + 16 * rt + g, rows - 1), row_b = min(row0 + 16 * rt + g + 8, rows - 1);
        bytes_a[rt] = weight + static_cast<i64>(row_a) * blocks_per_row * W::BLOCK_BYTES;
        bytes_b[rt] = weight + static_cast<i64>(row_b) * blocks_per_row * W::BLOCK_BYTES;
    }
    const C columns(x, cols, batch, g);

    float acc[ROW_TILES][TILES][4];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[rt][tile][k] = 0.0f;

    int block = warp;
    if constexpr (TWO_SETS) {
        // Two register sets, used in turn: the next block's bytes load into one while the other's are multiplied.
        // The one-set loop below copies a "next" set over (~30 moves a block at batch 1, session 29); this one has
        // none, but ptxas holds more registers for it (Q4_K 115 -> 143). Same blocks in the same order: same bits.
        typename W::Raw set_a[2][ROW_TILES], set_b[2][ROW_TILES];
        const auto load = [&](int set, int at) {
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                set_a[set][rt] = W::load(bytes_a[rt] + static_cast<i64>(at) * W::BLOCK_BYTES, t);
                set_b[set][rt] = W::load(bytes_b[rt] + static_cast<i64>(at) * W::BLOCK_BYTES, t);
            }
        };
        if (block < blocks_per_row) load(0, block);
        lucebox_wait_prior_grid();  // the first weight block is in flight: now wait for the activations' writer (PDL)
        while (block < blocks_per_row) {
            const int next = block + WARPS;
            if (next < blocks_per_row) load(1, next);  // in flight during the math
            mma_block<W, X, NB, ROW_TILES, GIVEN_SUMS>(set_a[0], set_b[0], block, t, columns, acc, sums);
            if (next >= blocks_per_row) break;
            block = next + WARPS;
            if (block < blocks_per_row) load(0, block);
            mma_block<W, X, NB, ROW_TILES, GIVEN_SUMS>(set_a[1], set_b[1], next, t, columns, acc, sums);
        }
    } else {
        typename W::Raw raw_a[ROW_TILES], raw_b[ROW_TILES];
        if (block < blocks_per_row) {
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                raw_a[rt] = W::load(bytes_a[rt] + static_cast<i64>(block) * W::BLOCK_BYTES, t);
                raw_b[rt] = W::load(bytes_b[rt] + static_cast<i64>(block) * W::BLOCK_BYTES, t);
            }
        }
        lucebox_wait_prior_grid();  // the first weight block is in flight: now wait for the activations' writer (PDL)
        for (; block < blocks_per_row; block += WARPS) {
            // Fetch the next block's bytes before working on this one (loads in flight during the math).
            const int next = block + WARPS;
            typename W::Raw next_a[ROW_TILES], next_b[ROW_TILES];
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                next_a[rt] = raw_a[rt];
                next_b[rt] = raw_b[rt];
                if (next < blocks_per_row) {
                    next_a[rt] = W::load(bytes_a[rt] + static_cast<i64>(next) * W::BLOCK_BYTES, t);
                    next_b[rt] = W::load(bytes_b[rt] + static_cast<i64>(next) * W::BLOCK_BYTES, t);
                }
            }
            mma_block<W, X, NB, ROW_TILES, GIVEN_SUMS>(raw_a, raw_b, block, t, columns, acc, sums);
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                raw_a[rt] = next_a[rt];
                raw_b[rt] = next_b[rt];
            }
        }
    }
    mma_store<X, NB, WARPS, ROW_TILES>(acc, y, rows, batch, row0);
}

template <class W, class X, int NB, int WARPS, int ROW_TILES, bool TWO_SETS = false, bool GIVEN_SUMS = false>
__device__ __forceinline__ void matvec_mma_body(const u8* __restrict__ weight, const X* __restrict__ x,
                                                X* __restrict__ y, int rows, int cols, int batch,
                                                const float* __restrict__ sums = nullptr) {
    matvec_mma_rows<W, X, NB, WARPS, ROW_TILES, TWO_SETS, GIVEN_SUMS>(weight, x, y, rows, cols, batch,
                                                                      blockIdx.x * 16 * ROW_TILES, sums);
}
