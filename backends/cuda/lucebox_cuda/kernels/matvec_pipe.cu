// y[r, n] = sum_k x[r, k] * W[n, k] on tensor cores for K-quant weights (Q4_K, Q5_K, Q6_K) and 1..NB
// activation rows, with the weight *streamed*: the same exact math as matvec_mma.cu (16-bit magic-number
// quants, mma.m16n8k16 with fp32 accumulation, per-sub-block scale and min on the fp32 sums; see there),
// but each warp keeps DEPTH - 1 GGUF blocks of its rows in flight through shared memory with `cp.async`.
//
// Why: the register-prefetch kernel holds one block (16 rows x 144 bytes) in flight per warp beyond the
// one it decodes, and its registers cap the warps per SM, so on the decode shapes (0.6-2 waves) the SMs
// wait on memory latency: 34-58% of copy bandwidth. Here loads in flight cost shared memory, not
// registers, and are independent of the math; the pipeline depth is a template constant.
//
// Parameters (all compile-time but the K-split):
//   WARPS  warps per thread block; they share ROWS = 16 * GM weight rows and split the row's GGUF
//          blocks between them (warp w takes blocks w, w + WARPS, ... of its K-slice, so at any time the
//          block's warps stream neighbouring bytes of each row).
//   DEPTH  ring stages per warp: DEPTH - 1 GGUF blocks are being copied while one is decoded.
//   GM     16-row groups per warp (1 or 2): with 2, each activation fragment (a global load and two
//          `prmt`) and each sum-of-x mma serve 32 rows instead of 16 (fewer instructions per weight).
//   gridDim.y  K-slices ("split-K"): slice s of the grid takes GGUF blocks [s*B/S, (s+1)*B/S) of every
//          row. With more than one, each slice writes fp32 partial sums to `partials` [S, batch, rows]
//          and the last slice to finish a row group (a per-row-group arrival counter in `counters`,
//          which it resets to zero for the next launch) adds them in slice order and writes y: the
//          result is deterministic, and no memset is needed between launches (graph-capturable).
//          `counters` must hold gridDim.x zeros before the first launch; `partials` needs no init.
//
// Shared memory is dynamic: `matvec_pipe_shared_bytes` below (the host mirrors it in catalogue.py and the
// kernel traps if launched with less). Q4_K/Q5_K blocks (144/176 bytes) are whole 16-byte chunks;
// Q6_K blocks (210 bytes, 2-byte aligned) are over-fetched from the 16-byte boundary below their start
// (14 chunks), the bytes past the tensor's end zero-filled (cp.async's src-size), and decoded from their
// offset in the copy with 16-bit loads, as from global memory.
//
// LUCEBOX_MATVEC_PIPE(format, activation, NB, WARPS, DEPTH, GM) defines
// `matvec_pipe_w<WARPS>_d<DEPTH>_m<GM>_<format>_<activation>_<NB>`; launch with 32 * WARPS threads, grid
// (ceil(rows / (16 * GM)), slices), and the dynamic shared memory above. Arguments: weight, x, y, rows,
// cols, batch, partials (float*, may be null with one slice), counters (u32*, likewise).
#include "matvec_mma_body.cuh"  // the formats, and the given sums' layout (`given_sums_at`)

// -- cp.async (sm_80 and later) ------------------------------------------------------------------------

__device__ __forceinline__ u32 shared_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// 16 bytes global -> shared, bypassing L1; bytes past `source_bytes` (1..16) are written as zeros.
__device__ __forceinline__ void copy_async_16(u32 destination, const void* source, int source_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(destination), "l"(source),
                 "r"(source_bytes)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` of this thread's committed copy groups are still in flight.
template <int pending> __device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// -- shared-memory layout ------------------------------------------------------------------------------

// One row's GGUF block as copied: whole 16-byte chunks. Blocks that are not a multiple of 16 bytes start
// at an even offset 0..14 inside their first chunk, so they need (bytes + 14) rounded up to chunks.
template <class W> struct StreamedBlock {
    static constexpr bool OVERFETCH = W::BLOCK_BYTES % 16 != 0;
    static constexpr int CHUNKS = OVERFETCH ? (W::BLOCK_BYTES + 14 + 15) / 16 : W::BLOCK_BYTES / 16;
    static constexpr int ROW_STRIDE = 16 * CHUNKS;
};

template <class W, class X, int NB, int WARPS, int DEPTH, int GM> struct PipeShape {
    static constexpr int SPLITS = ActivationFragment<X>::SPLITS;
    static constexpr int TILES = (NB * SPLITS + 7) / 8;
    static constexpr int ROWS = 16 * GM;
    static constexpr int STAGE_BYTES = ROWS * StreamedBlock<W>::ROW_STRIDE;
    static constexpr int RING_BYTES = WARPS * DEPTH * STAGE_BYTES;
    // After the stream, the warps' partial sums reuse the ring: [WARPS][ROWS][8 * TILES + 1] floats.
    static constexpr int PARTIAL_STRIDE = 8 * TILES + 1;
    static constexpr int PARTIAL_BYTES = WARPS * ROWS * PARTIAL_STRIDE * 4;
    static constexpr int SHARED_BYTES = RING_BYTES > PARTIAL_BYTES ? RING_BYTES : PARTIAL_BYTES;
};

// -- the kernel ---------------------------------------------------------------------------------------

template <class W, class X, int NB, int WARPS, int DEPTH, int GM, bool GIVEN_SUMS = false>
__device__ __forceinline__ void matvec_pipe_body(const u8* __restrict__ weight, const X* __restrict__ x,
                                                 X* __restrict__ y, int rows, int cols, int batch,
                                                 float* __restrict__ partials, u32* __restrict__ counters,
                                                 const float* __restrict__ sums = nullptr) {
    static_assert(DEPTH >= 2, "a pipeline needs a stage to decode and one to fill");
    static_assert(GM == 1 || GM == 2, "one or two 16-row groups per warp");
    typedef ActivationFragment<X> Frag;
    typedef typename Frag::E E;
    typedef StreamedBlock<W> Streamed;
    typedef PipeShape<W, X, NB, WARPS, DEPTH, GM> Shape;
    constexpr int SPLITS = Shape::SPLITS, COLUMNS = NB * SPLITS, TILES = Shape::TILES, ROWS = Shape::ROWS;
    constexpr int GROUPS = W::STEPS / W::STEPS_PER_GROUP;
    constexpr float OFFSET = E::MAGIC + W::BIAS;
    extern __shared__ __align__(16) u8 shared[];
    __shared__ u32 last_slice;

    {
        u32 dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < static_cast<u32>(Shape::SHARED_BYTES)) __trap();  // host/kernel layouts disagree
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const int blocks_per_row = cols / W::BLOCK_VALUES;
    const i64 row_bytes = static_cast<i64>(blocks_per_row) * W::BLOCK_BYTES;

    // This thread block's K-slice of GGUF blocks, and this warp's share of it.
    const int slices = gridDim.y, slice = blockIdx.y;
    const int first = static_cast<int>(static_cast<i64>(blocks_per_row) * slice / slices);
    const int last = static_cast<int>(static_cast<i64>(blocks_per_row) * (slice + 1) / slices);
    const int count = max(0, (last - first - warp + WARPS - 1) / WARPS);

    // What this lane copies each stage: chunk c = lane + 32 j of the stage's ROWS x CHUNKS chunks.
    // Rows past the end re-read the last row (valid memory); their results are never stored.
    constexpr int STAGE_CHUNKS = ROWS * Streamed::CHUNKS, COPIES = (STAGE_CHUNKS + 31) / 32;
    const u8* copy_source[COPIES];
    u32 copy_offset[COPIES];
#pragma unroll
    for (int j = 0; j < COPIES; ++j) {
        const int c = lane + 32 * j, local = c / Streamed::CHUNKS, within = c % Streamed::CHUNKS;
        const int row = min(row0 + local, rows - 1);
        copy_source[j] = weight + row * row_bytes + 16 * within;
        copy_offset[j] = local * Streamed::ROW_STRIDE + 16 * within;
    }
    const u8* weight_end = weight + rows * row_bytes;
    u8* ring = shared + warp * DEPTH * Shape::STAGE_BYTES;
    const u32 ring_address = shared_address(ring);

    // Copy this warp's i-th GGUF block (of every row it owns) into ring stage `stage`.
    auto issue = [&](int i, int stage) {
        const i64 block_offset = static_cast<i64>(first + warp + WARPS * i) * W::BLOCK_BYTES;
        const u32 destination = ring_address + stage * Shape::STAGE_BYTES;
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            if (STAGE_CHUNKS % 32 != 0 && lane + 32 * j >= STAGE_CHUNKS) continue;
            const u8* source = copy_source[j] + block_offset;
            int bytes = 16;
            if (Streamed::OVERFETCH) {
                // From the 16-byte boundary at or below; every chunk starts before the tensor's end (the
                // last begins at most 208 bytes past the block start), so 1..16 bytes are real.
                source = reinterpret_cast<const u8*>(reinterpret_cast<unsigned long long>(source) & ~15ull);
                const i64 left = weight_end - source;
                bytes = left < 16 ? static_cast<int>(left) : 16;
            }
            copy_async_16(destination + copy_offset[j], source, bytes);
        }
    };

    // The rows whose A fragments this lane holds: group m, half h -> local row 16 m + 8 h + g, and (for
    // over-fetched formats) the low 4 bits of that row's byte offset, to find a block inside its copy.
    u32 row_phase[GM][2];
#pragma unroll
    for (int m = 0; m < GM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = min(row0 + 16 * m + 8 * h + g, rows - 1);
            row_phase[m][h] = static_cast<u32>(row * row_bytes) & 15u;
        }

    // This lane's B column in each tile: activation row and fp32 part, or none (zeros).
    const X* x_col[TILES];
    int part[TILES];
    bool has_col[TILES];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int column = 8 * tile + g, r = column / SPLITS;
        has_col[tile] = column < COLUMNS && r < batch;
        part[tile] = column % SPLITS;
        x_col[tile] = x + static_cast<i64>(has_col[tile] ? r : 0) * cols;
    }

    float acc[GM][TILES][4];
#pragma unroll
    for (int m = 0; m < GM; ++m)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[m][tile][k] = 0.0f;
    const u32 ones[4] = {E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR, E::ONE_PAIR};

    // Prologue: DEPTH - 1 blocks in flight. Every thread commits one group per stage, empty or not, so
    // that "group i landed" is always "at most DEPTH - 1 groups pending" after issuing i + DEPTH - 1.
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) {
        if (i < count) issue(i, i);
        copy_async_commit();
    }
    // DEPTH - 1 weight blocks are on their way: only now wait for the kernel ahead (PDL), before the first
    // activation load and before any write of `partials`, `counters` or `y`.
    lucebox_wait_prior_grid();
    int read_stage = 0, write_stage = DEPTH - 1;
    for (int i = 0; i < count; ++i) {
        __syncwarp();  // every lane is done reading the stage about to be refilled (read at i - 1)
        if (i + DEPTH - 1 < count) issue(i + DEPTH - 1, write_stage);
        copy_async_commit();
        copy_async_wait<DEPTH - 1>();
        __syncwarp();  // all lanes' copies of block i are complete and visible to the warp

        const int block = first + warp + WARPS * i;
        const u8* stage = ring + read_stage * Shape::STAGE_BYTES;
        typename W::Raw raw[GM][2];
        float d[GM][2], dmin[GM][2];
        typename W::Groups groups[GM][2];
#pragma unroll
        for (int m = 0; m < GM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 phase = Streamed::OVERFETCH ? (row_phase[m][h] + static_cast<u32>(block) * W::BLOCK_BYTES) & 15u : 0u;
                raw[m][h] = W::load(stage + (16 * m + 8 * h + g) * Streamed::ROW_STRIDE + phase, t);
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
            if constexpr (GIVEN_SUMS) read_given_sums<W>(sums, block, grp, t, s);  // as in mma_block
#pragma unroll
            for (int within = 0; within < W::STEPS_PER_GROUP; ++within) {
                const int step = grp * W::STEPS_PER_GROUP + within;
                const int column = base + W::step_column(step, t);
                u32 b0[TILES], b1[TILES];
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile) {
                    b0[tile] = b1[tile] = 0;
                    if (has_col[tile]) Frag::load(x_col[tile] + column, part[tile], b0[tile], b1[tile]);
                    if constexpr (!GIVEN_SUMS) E::mma(s[tile], ones, b0[tile], b1[tile]);
                }
#pragma unroll
                for (int m = 0; m < GM; ++m) {
                    const u32 q_a = W::step_quants(raw[m][0], step), q_b = W::step_quants(raw[m][1], step);
                    const u32 a[4] = {low_pair<E>(q_a), low_pair<E>(q_b), high_pair<E>(q_a), high_pair<E>(q_b)};
#pragma unroll
                    for (int tile = 0; tile < TILES; ++tile) E::mma(p[m][tile], a, b0[tile], b1[tile]);
                }
            }
#pragma unroll
            for (int m = 0; m < GM; ++m) {
                float da, ma, db, mb;
                W::group(groups[m][0], grp, d[m][0], dmin[m][0], da, ma);
                W::group(groups[m][1], grp, d[m][1], dmin[m][1], db, mb);
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
        read_stage = read_stage + 1 == DEPTH ? 0 : read_stage + 1;
        write_stage = write_stage + 1 == DEPTH ? 0 : write_stage + 1;
    }

    // Add the warps' partial sums through shared memory (the ring, now idle in every warp).
    copy_async_wait<0>();
    __syncthreads();
    float* partial = reinterpret_cast<float*>(shared);  // [warp][local row][column]
#pragma unroll
    for (int m = 0; m < GM; ++m)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                partial[(warp * ROWS + 16 * m + g + 8 * (k >> 1)) * Shape::PARTIAL_STRIDE + 8 * tile + 2 * t + (k & 1)] =
                    acc[m][tile][k];
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * NB; i += 32 * WARPS) {
        const int r = i / ROWS, local = i % ROWS, row = row0 + local;
        if (r >= batch || row >= rows) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
#pragma unroll
            for (int split = 0; split < SPLITS; ++split)
                total += partial[(w * ROWS + local) * Shape::PARTIAL_STRIDE + r * SPLITS + split];
        if (slices == 1)
            y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
        else
            partials[(static_cast<i64>(slice) * batch + r) * rows + row] = total;
    }
    if (slices == 1) return;

    // Split-K: the last slice of this row group to arrive adds every slice's partials, in slice order.
    __threadfence();  // this block's partials are visible device-wide before its arrival is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 arrived = atomicAdd(counters + blockIdx.x, 1u);
        last_slice = arrived == static_cast<u32>(slices - 1);
        if (last_slice) counters[blockIdx.x] = 0;  // every slice has arrived: reset for the next launch
    }
    __syncthreads();
    if (!last_slice) return;
    __threadfence();
    const volatile float* finished = partials;  // written by other blocks: read past L1
    for (int i = threadIdx.x; i < ROWS * NB; i += 32 * WARPS) {
        const int r = i / ROWS, local = i % ROWS, row = row0 + local;
        if (r >= batch || row >= rows) continue;
        float total = 0.0f;
        for (int s = 0; s < slices; ++s) total += finished[(static_cast<i64>(s) * batch + r) * rows + row];
        y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
    }
}

#define LUCEBOX_MATVEC_PIPE(FORMAT, ACT, NB, WARPS, DEPTH, GM)                                           \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                            \
        matvec_pipe_w##WARPS##_d##DEPTH##_m##GM##_##FORMAT##_##ACT##_##NB(                              \
            const u8* __restrict__ weight, const ACT* __restrict__ x, ACT* __restrict__ y, int rows,    \
            int cols, int batch, float* __restrict__ partials, u32* __restrict__ counters) {            \
        matvec_pipe_body<Mma_##FORMAT, ACT, NB, WARPS, DEPTH, GM>(weight, x, y, rows, cols, batch,      \
                                                                    partials, counters);                 \
    }
// With given sums (see matvec_mma.cu's LUCEBOX_MATVEC_MMA_S): `matvec_pipe_s_w<WARPS>_...`, one more argument.
#define LUCEBOX_MATVEC_PIPE_S(FORMAT, ACT, NB, WARPS, DEPTH, GM)                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                            \
        matvec_pipe_s_w##WARPS##_d##DEPTH##_m##GM##_##FORMAT##_##ACT##_##NB(                            \
            const u8* __restrict__ weight, const ACT* __restrict__ x, ACT* __restrict__ y, int rows,    \
            int cols, int batch, float* __restrict__ partials, u32* __restrict__ counters,              \
            const float* __restrict__ sums) {                                                           \
        matvec_pipe_body<Mma_##FORMAT, ACT, NB, WARPS, DEPTH, GM, true>(weight, x, y, rows, cols, batch, \
                                                                          partials, counters, sums);     \
    }
