// The tensor-core arithmetic of one GGUF block of 16 * GM weight rows held in shared memory, shared by the
// streamed matrix-vector kernels (matvec_pipe.cu, matvec_stream.cu): the math of matvec_mma.cu (16-bit
// magic-number quants, mma.m16n8k16 with fp32 accumulation, per-sub-block scale and min applied to the
// fp32 sums; see there). One function, so that every streamed kernel computes a block's contribution with
// the same instructions in the same order.
#pragma once
#include "mma_formats.cuh"

template <class W, class X, int NB, int GM> struct StagedMath {
    typedef ActivationFragment<X> Frag;
    typedef typename Frag::E E;
    static constexpr int SPLITS = Frag::SPLITS, COLUMNS = NB * SPLITS, TILES = (COLUMNS + 7) / 8;
    static constexpr int GROUPS = W::STEPS / W::STEPS_PER_GROUP;
    // Sub-block sums P come out as magic + bias times S too large; this removes it.
    static constexpr float OFFSET = E::MAGIC + W::BIAS;

    // This lane's B column in each tile: activation row and fp32 part, or none (zeros).
    struct Columns {
        const X* x[TILES];
        int part[TILES];
        bool present[TILES];
    };
    static __device__ __forceinline__ Columns columns(const X* x, int cols, int batch, int g) {
        Columns c;
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            const int column = 8 * tile + g, r = column / SPLITS;
            c.present[tile] = column < COLUMNS && r < batch;
            c.part[tile] = column % SPLITS;
            c.x[tile] = x + static_cast<i64>(c.present[tile] ? r : 0) * cols;
        }
        return c;
    }

    // acc += this block's products. `rows[m][h]`: the copy of the block of row 16 m + 8 h + g (this lane's
    // A rows) in shared memory; `block`: its index along the row (which activations it meets).
    static __device__ __forceinline__ void accumulate(const u8* const (&rows)[GM][2], int block, int t,
                                                      const Columns& cols, float (&acc)[GM][TILES][4]) {
        const u32 ones[4] = {E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR};
        typename W::Raw raw[GM][2];
        float d[GM][2], dmin[GM][2];
        typename W::Groups groups[GM][2];
#pragma unroll
        for (int m = 0; m < GM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                raw[m][h] = W::load(rows[m][h], t);
                W::scales(raw[m][h], d[m][h], dmin[m][h]);
                groups[m][h] = W::groups(raw[m][h]);
            }
        const int base = block * W::BLOCK_VALUES;
#pragma unroll
        for (int grp = 0; grp < GROUPS; ++grp) {
            float p[GM][TILES][4], s[TILES][4];
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    s[tile][k] = 0.0f;
#pragma unroll
                    for (int m = 0; m < GM; ++m) p[m][tile][k] = 0.0f;
                }
#pragma unroll
            for (int within = 0; within < W::STEPS_PER_GROUP; ++within) {
                const int step = grp * W::STEPS_PER_GROUP + within;
                const int column = base + W::step_column(step, t);
                u32 b0[TILES], b1[TILES];
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile) {
                    b0[tile] = b1[tile] = 0;
                    if (cols.present[tile]) Frag::load(cols.x[tile] + column, cols.part[tile], b0[tile], b1[tile]);
                    E::mma(s[tile], ones, b0[tile], b1[tile]);
                }
#pragma unroll
                for (int m = 0; m < GM; ++m) {
                    const u32 q_a = W::step_quants(raw[m][0], step), q_b = W::step_quants(raw[m][1], step);
                    const u32 a[4] = {even_pair<E>(q_a), even_pair<E>(q_b), odd_pair<E>(q_a), odd_pair<E>(q_b)};
#pragma unroll
                    for (int tile = 0; tile < TILES; ++tile) E::mma(p[m][tile], a, b0[tile], b1[tile]);
                }
            }
#pragma unroll
            for (int m = 0; m < GM; ++m) {
                float scale_a, min_a, scale_b, min_b;
                W::group(groups[m][0], grp, scale_a, min_a);
                W::group(groups[m][1], grp, scale_b, min_b);
                const float da = d[m][0] * scale_a, db = d[m][1] * scale_b;
                const float ma = dmin[m][0] * min_a, mb = dmin[m][1] * min_b;
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        // Fragment element k: row g (k < 2) or g + 8, column 2t + (k & 1) of the tile.
                        if ((k & 1) && 8 * tile + 1 >= COLUMNS) continue;  // odd columns unused at all
                        const float sum_x = s[tile][k];
                        const float q_dot_x = fmaf(-OFFSET, sum_x, p[m][tile][k]);
                        acc[m][tile][k] = fmaf(k < 2 ? da : db, q_dot_x, acc[m][tile][k]);
                        if (W::HAS_MIN) acc[m][tile][k] = fmaf(-(k < 2 ? ma : mb), sum_x, acc[m][tile][k]);
                    }
            }
        }
    }
};
