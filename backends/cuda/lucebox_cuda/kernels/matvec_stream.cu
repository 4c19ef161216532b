// y[r, n] = sum_k x[r, k] * W[n, k] on tensor cores for K-quant weights (Q4_K, Q5_K, Q6_K) and 1..NB
// activation rows: the streamed kernel of matvec_pipe.cu (cp.async ring per warp, the exact math of
// mma_staged.cuh) with the work split "stream-K" over a persistent grid.
//
// Why: at batch 1 the decode products run 0.6-4 waves of short-lived blocks. Each warp of matvec_pipe.cu
// streams only ~5 GGUF blocks, so its pipeline is mostly filling and draining, and the last wave leaves
// SMs idle (Nsight Compute on the 17408 x 5120 Q4_K product: 32% of DRAM bandwidth, 1.37 waves). Here
// the weight is a list of tiles, one GGUF block (256 columns) of 16 * GM rows each, in row-group-major
// order (row group 0's blocks 0..B-1, then row group 1's...), and the grid's warps take equal contiguous
// runs of it: every warp streams from its first tile to its last with one unbroken pipeline, and all
// warps finish together whatever the shape.
//
// A row group whose tiles lie in one warp's run is finished by that warp (summed over its blocks in
// order) and written to y. One shared by several warps (at most the first and last of each run) is
// combined deterministically: each contributor writes its fp32 partial sums to its own slot in
// `partials` and counts its arrival in `counters[row group]`; the last to arrive adds the slots in warp
// order, writes y and resets the counter to zero for the next launch (no memset between launches:
// graph-capturable). Which warps share a row group depends on the grid and the shape, never on the
// batch, so a column's arithmetic is the same at every batch size.
//
// Launch: 32 * WARPS threads per block, any grid (the host sizes it to fill the GPU once: blocks per SM
// from the occupancy calculator x SMs, at most tiles / WARPS), the dynamic shared memory of
// `StreamShape` (plus cols * sizeof(X) to keep a single bf16/fp16 activation row in shared memory:
// the kernel stages it when given the room). Arguments: weight, x, y, rows, cols, batch, partials (float,
// 2 * warps * batch * 16 * GM), counters (u32, one per row group, zero before the first launch).
//
// LUCEBOX_MATVEC_STREAM(format, activation, NB, WARPS, DEPTH, GM) defines
// `matvec_stream_w<WARPS>_d<DEPTH>_m<GM>_<format>_<activation>_<NB>`.
#include "cp_async.cuh"
#include "mma_staged.cuh"

template <class W, class X, int NB, int WARPS, int DEPTH, int GM> struct StreamShape {
    static constexpr int TILES = StagedMath<W, X, NB, GM>::TILES;
    static constexpr int ROWS = 16 * GM;
    static constexpr int STAGE_BYTES = ROWS * StreamedBlock<W>::ROW_STRIDE;
    static constexpr int RING_BYTES = WARPS * DEPTH * STAGE_BYTES;
    // Each warp's sums of a finished row group, to regroup them from mma fragments to (row, batch row).
    static constexpr int FLUSH_STRIDE = 8 * TILES + 1;
    static constexpr int FLUSH_BYTES = WARPS * ROWS * FLUSH_STRIDE * 4;
    static constexpr int SHARED_BYTES = RING_BYTES + FLUSH_BYTES;
};

template <class W, class X, int NB, int WARPS, int DEPTH, int GM>
__device__ __forceinline__ void matvec_stream_body(const u8* __restrict__ weight, const X* __restrict__ x,
                                                   X* __restrict__ y, int rows, int cols, int batch,
                                                   float* __restrict__ partials, u32* __restrict__ counters) {
    static_assert(DEPTH >= 2, "a pipeline needs a stage to decode and one to fill");
    static_assert(GM == 1 || GM == 2, "one or two 16-row groups per tile");
    typedef StagedMath<W, X, NB, GM> Math;
    typedef StreamedBlock<W> Streamed;
    typedef StreamShape<W, X, NB, WARPS, DEPTH, GM> Shape;
    constexpr int SPLITS = Math::SPLITS, TILES = Math::TILES, ROWS = Shape::ROWS;
    extern __shared__ __align__(16) u8 shared[];

    u32 dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < static_cast<u32>(Shape::SHARED_BYTES)) __trap();  // host/kernel layouts disagree

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int blocks_per_row = cols / W::BLOCK_VALUES;
    const int row_groups = (rows + ROWS - 1) / ROWS;
    const i64 row_bytes = static_cast<i64>(blocks_per_row) * W::BLOCK_BYTES;
    const i64 tiles = static_cast<i64>(row_groups) * blocks_per_row;
    const i64 warps = min(static_cast<i64>(gridDim.x) * WARPS, tiles);
    const i64 me = static_cast<i64>(blockIdx.x) * WARPS + warp;

    // One activation row in shared memory when the host gave the room (the decode step): every step's B
    // fragment is then a shared-memory load instead of a global one that may miss L1.
    const X* x_source = x;
    constexpr bool CAN_STAGE_X = NB == 1 && SPLITS == 1;
    if (CAN_STAGE_X && dynamic_bytes >= static_cast<u32>(Shape::SHARED_BYTES) + cols * sizeof(X)) {
        X* staged_x = reinterpret_cast<X*>(shared + Shape::SHARED_BYTES);
        const int vectors = cols * static_cast<int>(sizeof(X)) / 16;
        for (int i = threadIdx.x; i < vectors; i += 32 * WARPS)
            reinterpret_cast<uint4*>(staged_x)[i] = reinterpret_cast<const uint4*>(x)[i];
        __syncthreads();
        x_source = staged_x;
    }
    if (me >= warps) return;  // more warps than tiles (tiny products): no run

    // This warp's run of tiles [first, last), and who owns a tile: the largest w with start(w) <= tile.
    const i64 first = me * tiles / warps, last = (me + 1) * tiles / warps;
    const int count = static_cast<int>(last - first);
    auto owner = [&](i64 tile) { return ((tile + 1) * warps - 1) / tiles; };
    const int first_group = static_cast<int>(first / blocks_per_row);

    // What this lane copies each stage: chunk c = lane + 32 j of the stage's ROWS x CHUNKS chunks.
    constexpr int STAGE_CHUNKS = ROWS * Streamed::CHUNKS, COPIES = (STAGE_CHUNKS + 31) / 32;
    const u8* weight_end = weight + rows * row_bytes;
    u8* ring = shared + warp * DEPTH * Shape::STAGE_BYTES;
    const u32 ring_address = shared_address(ring);

    // Copy tile (group, block) into ring stage `stage`. Rows past the end re-read the last row (valid
    // memory); their results are never stored.
    auto issue = [&](int group, int block, int stage) {
        const u32 destination = ring_address + stage * Shape::STAGE_BYTES;
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            const int c = lane + 32 * j;
            if (STAGE_CHUNKS % 32 != 0 && c >= STAGE_CHUNKS) continue;
            const int local = c / Streamed::CHUNKS, within = c % Streamed::CHUNKS;
            const int row = min(group * ROWS + local, rows - 1);
            const u8* source = weight + row * row_bytes + static_cast<i64>(block) * W::BLOCK_BYTES + 16 * within;
            int bytes = 16;
            if (Streamed::OVERFETCH) {
                // From the 16-byte boundary at or below; every chunk starts before the tensor's end, so
                // 1..16 bytes are real (see matvec_pipe.cu).
                source = reinterpret_cast<const u8*>(reinterpret_cast<unsigned long long>(source) & ~15ull);
                const i64 left = weight_end - source;
                bytes = left < 16 ? static_cast<int>(left) : 16;
            }
            copy_async_16(destination + local * Streamed::ROW_STRIDE + 16 * within, source, bytes);
        }
    };

    const typename Math::Columns columns = Math::columns(x_source, cols, batch, g);
    float acc[GM][TILES][4];
#pragma unroll
    for (int m = 0; m < GM; ++m)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[m][tile][k] = 0.0f;

    // The tile to issue next, as (row group, block), walked forward without divisions.
    int issue_group = first_group, issue_block = static_cast<int>(first % blocks_per_row);
    auto advance = [&](int& group, int& block) {
        if (++block == blocks_per_row) {
            block = 0;
            ++group;
        }
    };
    // Prologue: DEPTH - 1 tiles in flight; one commit group per stage, empty or not (see matvec_pipe.cu).
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) {
        if (i < count) {
            issue(issue_group, issue_block, i);
            advance(issue_group, issue_block);
        }
        copy_async_commit();
    }

    float* flush = reinterpret_cast<float*>(shared + Shape::RING_BYTES) + warp * ROWS * Shape::FLUSH_STRIDE;
    int group = first_group, block = static_cast<int>(first % blocks_per_row);
    bool whole_group = block == 0;  // this warp's run began at the group's first block
    int read_stage = 0, write_stage = DEPTH - 1;
    for (int i = 0; i < count; ++i) {
        __syncwarp();  // every lane is done reading the stage about to be refilled (read at i - 1)
        if (i + DEPTH - 1 < count) {
            issue(issue_group, issue_block, write_stage);
            advance(issue_group, issue_block);
        }
        copy_async_commit();
        copy_async_wait<DEPTH - 1>();
        __syncwarp();  // all lanes' copies of tile i are complete and visible to the warp

        const u8* stage = ring + read_stage * Shape::STAGE_BYTES;
        const u8* staged[GM][2];
#pragma unroll
        for (int m = 0; m < GM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 phase = 0;
                if (Streamed::OVERFETCH) {
                    const int row = min(group * ROWS + 16 * m + 8 * h + g, rows - 1);
                    phase = static_cast<u32>(row * row_bytes + static_cast<i64>(block) * W::BLOCK_BYTES) & 15u;
                }
                staged[m][h] = stage + (16 * m + 8 * h + g) * Streamed::ROW_STRIDE + phase;
            }
        Math::accumulate(staged, block, t, columns, acc);
        read_stage = read_stage + 1 == DEPTH ? 0 : read_stage + 1;
        write_stage = write_stage + 1 == DEPTH ? 0 : write_stage + 1;

        const bool group_ends = block == blocks_per_row - 1;
        if (group_ends || i == count - 1) {
            // Regroup the fragments: flush[local row][column], then each (batch row, local row) sums its
            // fp32 parts (split order, as matvec_pipe.cu).
            __syncwarp();
#pragma unroll
            for (int m = 0; m < GM; ++m)
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        flush[(16 * m + g + 8 * (k >> 1)) * Shape::FLUSH_STRIDE + 8 * tile + 2 * t + (k & 1)] =
                            acc[m][tile][k];
                        acc[m][tile][k] = 0.0f;
                    }
            __syncwarp();
            const int row0 = group * ROWS;
            if (whole_group && group_ends) {
                for (int v = lane; v < ROWS * NB; v += 32) {
                    const int r = v / ROWS, local = v % ROWS, row = row0 + local;
                    if (r >= batch || row >= rows) continue;
                    float total = 0.0f;
#pragma unroll
                    for (int split = 0; split < SPLITS; ++split) total += flush[local * Shape::FLUSH_STRIDE + r * SPLITS + split];
                    y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
                }
            } else {
                // Shared row group: slot 0 of a warp holds its first group's sums, slot 1 its last's.
                auto slot = [&](i64 w, int which) {
                    return partials + ((w * 2 + which) * batch) * ROWS;  // [batch][ROWS]
                };
                float* mine = slot(me, group == first_group ? 0 : 1);
                for (int v = lane; v < ROWS * NB; v += 32) {
                    const int r = v / ROWS, local = v % ROWS;
                    if (r >= batch) continue;
                    float total = 0.0f;
#pragma unroll
                    for (int split = 0; split < SPLITS; ++split) total += flush[local * Shape::FLUSH_STRIDE + r * SPLITS + split];
                    mine[r * ROWS + local] = total;
                }
                __threadfence();  // this lane's partials are visible device-wide before the arrival counts
                __syncwarp();
                const i64 group_first_tile = static_cast<i64>(group) * blocks_per_row;
                const i64 owner_first = owner(group_first_tile), owner_last = owner(group_first_tile + blocks_per_row - 1);
                u32 arrived = 0;
                if (lane == 0) arrived = atomicAdd(counters + group, 1u);
                arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
                if (arrived == static_cast<u32>(owner_last - owner_first)) {
                    // Last of the group's warps: add every warp's sums in warp order.
                    if (lane == 0) counters[group] = 0;  // every contributor has arrived: reset for the next launch
                    __threadfence();
                    for (int v = lane; v < ROWS * NB; v += 32) {
                        const int r = v / ROWS, local = v % ROWS, row = row0 + local;
                        if (r >= batch || row >= rows) continue;
                        float total = 0.0f;
                        for (i64 w = owner_first; w <= owner_last; ++w) {
                            const int which = (w * tiles / warps) / blocks_per_row == group ? 0 : 1;
                            const volatile float* theirs = slot(w, which);  // written by other warps: past L1
                            total += theirs[r * ROWS + local];
                        }
                        y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
                    }
                }
            }
            whole_group = true;  // the next group (if any) starts at its first block
        }
        advance(group, block);
    }
    copy_async_wait<0>();
}

#define LUCEBOX_MATVEC_STREAM(FORMAT, ACT, NB, WARPS, DEPTH, GM)                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                            \
        matvec_stream_w##WARPS##_d##DEPTH##_m##GM##_##FORMAT##_##ACT##_##NB(                            \
            const u8* __restrict__ weight, const ACT* __restrict__ x, ACT* __restrict__ y, int rows,    \
            int cols, int batch, float* __restrict__ partials, u32* __restrict__ counters) {            \
        matvec_stream_body<Mma_##FORMAT, ACT, NB, WARPS, DEPTH, GM>(weight, x, y, rows, cols, batch,    \
                                                                      partials, counters);               \
    }
