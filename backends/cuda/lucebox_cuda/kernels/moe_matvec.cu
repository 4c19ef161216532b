// Mixture-of-experts products for few tokens: for each routed (token, expert) pair `s`,
//     y[s, n] = sum_k x[s / x_group, k] * W[ids[s], n, k]
// over a stack of expert weights W [experts, rows, cols] in one GGUF format. Only the chosen experts' blocks
// are read; the expert ids are read on the device, so routing, top-k and these products need no host round
// trip (a decode step with them records as one CUDA graph).
//
// `x_group`: how many consecutive pairs share an activation row: the top-k of one token for the gate/up
// product (x_group = k), one row each for the down product (x_group = 1).
//
// One warp per output row, as matvec.cu (whose body, matvec_body.cuh, this reuses); blockIdx.y is the pair. Instantiate with
// LUCEBOX_MOE_MATVEC(format, activation), defining `moe_matvec_<format>_<activation>`. Launch with 128
// threads per block, (ceil(rows / 4), pairs) blocks.
//
// The paged variant (Spark, `lucebox_core.spark`: a stack split between device slots and host memory):
// LUCEBOX_MOE_MATVEC_PAGED(format, activation) defines `moe_matvec_paged_<format>_<activation>`, which reads
// expert e's blocks from `pool + where[e] * expert_bytes` where `where[e] >= 0` (a device slot holds it) and
// else from `host + e * expert_bytes`: every expert's bytes in pinned host memory, read by the GPU over the
// bus (zero-copy, through unified addressing). The table is read on the device, so which experts are resident
// may change between replays of a recorded step without recording it again; the bytes and the arithmetic are
// the plain kernel's, so the products equal the all-resident stack's bit for bit. Launched as the plain one.
// `counts` (or null): the layer's routing counts, one added per pair (`count_routed_pair`, common.cuh).
//
// The pair variants (a SwiGLU block's gate and up stacks, same format and shape, one launch instead of two):
// LUCEBOX_MOE_MATVEC_PAIR(format, activation) defines `moe_matvec_pair_<format>_<activation>` and
// LUCEBOX_MOE_MATVEC_PAIR_PAGED the paged one (one residency table for both stacks, as Spark keeps it).
// blockIdx.z picks the stack (0: the first, into y0; 1: the second, into y1); each output row's arithmetic is
// the single kernel's, so the products equal two single launches bit for bit. Launch with (ceil(rows / 4),
// pairs, 2) blocks of 128 threads.
#include "matvec_body.cuh"

#define LUCEBOX_MOE_MATVEC(FORMAT, ACT)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * LUCEBOX_MATVEC_WARPS)                                \
        moe_matvec_##FORMAT##_##ACT(const u8* __restrict__ weight, const ACT* __restrict__ x,                \
                                    ACT* __restrict__ y, const long long* __restrict__ ids,                  \
                                    long long expert_bytes, int rows, int cols, int x_group) {               \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const u8* expert = weight + ids[pair] * expert_bytes;                                                \
        matvec_body<W_##FORMAT, ACT, 1>(expert, x + static_cast<i64>(pair / x_group) * cols,               \
                                        y + static_cast<i64>(pair) * rows, rows, cols, 1);                   \
    }

#define LUCEBOX_MOE_MATVEC_PAGED(FORMAT, ACT)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * LUCEBOX_MATVEC_WARPS)                                \
        moe_matvec_paged_##FORMAT##_##ACT(const u8* __restrict__ pool, const u8* __restrict__ host,          \
                                          const long long* __restrict__ where,                               \
                                          unsigned long long* __restrict__ counts, const ACT* __restrict__ x, \
                                          ACT* __restrict__ y, const long long* __restrict__ ids,            \
                                          long long expert_bytes, int rows, int cols, int x_group) {         \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const long long expert = ids[pair];                                                                  \
        count_routed_pair(counts, expert, true);                                                             \
        const long long slot = where[expert];                                                                \
        const u8* blocks = slot >= 0 ? pool + slot * expert_bytes : host + expert * expert_bytes;            \
        matvec_body<W_##FORMAT, ACT, 1>(blocks, x + static_cast<i64>(pair / x_group) * cols,               \
                                        y + static_cast<i64>(pair) * rows, rows, cols, 1);                   \
    }

#define LUCEBOX_MOE_MATVEC_PAIR(FORMAT, ACT)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * LUCEBOX_MATVEC_WARPS)                                \
        moe_matvec_pair_##FORMAT##_##ACT(const u8* __restrict__ weight0, const u8* __restrict__ weight1,      \
                                         const ACT* __restrict__ x, ACT* __restrict__ y0,                   \
                                         ACT* __restrict__ y1, const long long* __restrict__ ids,            \
                                         long long expert_bytes, int rows, int cols, int x_group) {          \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const u8* expert = (blockIdx.z == 0 ? weight0 : weight1) + ids[pair] * expert_bytes;                 \
        ACT* y = blockIdx.z == 0 ? y0 : y1;                                                                  \
        matvec_body<W_##FORMAT, ACT, 1>(expert, x + static_cast<i64>(pair / x_group) * cols,               \
                                        y + static_cast<i64>(pair) * rows, rows, cols, 1);                   \
    }

#define LUCEBOX_MOE_MATVEC_PAIR_PAGED(FORMAT, ACT)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * LUCEBOX_MATVEC_WARPS)                                \
        moe_matvec_pair_paged_##FORMAT##_##ACT(const u8* __restrict__ pool0, const u8* __restrict__ host0,    \
                                               const u8* __restrict__ pool1, const u8* __restrict__ host1,    \
                                               const long long* __restrict__ where,                          \
                                               unsigned long long* __restrict__ counts,                      \
                                               const ACT* __restrict__ x, ACT* __restrict__ y0,              \
                                               ACT* __restrict__ y1, const long long* __restrict__ ids,      \
                                               long long expert_bytes, int rows, int cols, int x_group) {    \
        lucebox_wait_prior_grid();                                                                           \
        const int pair = blockIdx.y;                                                                         \
        const long long expert = ids[pair];                                                                  \
        count_routed_pair(counts, expert, blockIdx.z == 0);                                                  \
        const long long slot = where[expert];                                                                \
        const u8* pool = blockIdx.z == 0 ? pool0 : pool1;                                                    \
        const u8* host = blockIdx.z == 0 ? host0 : host1;                                                    \
        const u8* blocks = slot >= 0 ? pool + slot * expert_bytes : host + expert * expert_bytes;            \
        ACT* y = blockIdx.z == 0 ? y0 : y1;                                                                  \
        matvec_body<W_##FORMAT, ACT, 1>(blocks, x + static_cast<i64>(pair / x_group) * cols,               \
                                        y + static_cast<i64>(pair) * rows, rows, cols, 1);                   \
    }
