// y[r, n] = sum_k x[r, k] * W[n, k] on tensor cores, matvec_mma.cu's exact method and arithmetic class (4 warps
// a row group, warp w takes GGUF blocks w, w+4, ...: the same bits), reading the weight from a *tiled* copy of
// its GGUF bytes instead of the file's row-major blocks.
//
// Why: in the row-major layout a warp's load instruction gathers 8 rows' pieces (4 lanes x 8 bytes a row, rows a
// row apart), GGUF's 144-byte Q4_K blocks straddle 32-byte sectors every other block, and each lane needs 5-12
// loads a block (Q6_K's 210-byte blocks only allow 16-bit ones). The products run at 50-60% of copy bandwidth.
// Tiled, the 16 rows x 1 GGUF block a warp consumes at once (a "tile") are one contiguous run of bytes in the
// order the lanes read them: every load is 16 bytes a lane, a warp's load is 128-512 contiguous bytes, and a
// row group's tiles follow each other along K, so a block of 4 warps streams one contiguous range.
// Measured (session 27, H100, scripts/tiled_probe.py): Q6_K products 1.16-1.30x the row-major kernels at batch 1
// (the 27B's head at the copy bandwidth); the 27B's Q4_K products 4-22% slower. So only Q6_K weights are held tiled
// (`tiled_weights.DEFAULT_FORMATS`); the other options below are the probe's.
//
// A tile holds the same bytes as the 16 rows' blocks (no padding; rows are padded to a multiple of 16 with
// zero rows, whose results are never stored). Offsets inside a tile, lane L = 4g + t holding rows g and g+8:
//   Q4_K (2304 bytes): the 16 rows' 16-byte heads (d, dmin, scales) at 16 r; then 4 chunks of 512 bytes at
//     256 + 512 c: lane L's 16 bytes = row g's quant bytes 16 + 32c + 8t .. +7, then row g+8's.
//   Q5_K (2816 bytes): heads as Q4_K; qh at 256: lane L's 16 bytes = row g's qh bytes 8t .. 8t+7, then row g+8's;
//     then the quant chunks as Q4_K from 768.
//   Q6_K (3360 bytes): the 16 rows' d (2 bytes) at 2 r; their 16 scales at 32 + 16 r; then 6 chunks of 512 bytes
//     at 288 + 512 k: lane L's 16 bytes = row (k < 3 ? g : g+8)'s ql_a / ql_b / qh words (k % 3) as MmaQ6K::Raw
//     holds them (its 4 words: [2h + i] = bytes 64h + 16i + 4t (ql_a), + 32 (ql_b); 128 + 32h + 16i + 4t (qh)).
// Tile order: row-group-major (ORDER 0: tile (row group G, GGUF block b) at (G * blocks_per_row + b) * TILE_BYTES, so
// a block's warps stream one contiguous range) or block-major (ORDER 1: at (b * groups + G) * TILE_BYTES, so the
// blocks resident at one time read neighbouring tiles, spread over the memory channels as row-major rows are).
// `lucebox_cuda.tiled_weights` writes the layout (and documents it the same way).
//
// AHEAD: GGUF blocks a warp has in flight beyond the one it multiplies (a register ring of AHEAD + 1 stages).
// WARPS: warps a row group (4: matvec_mma.cu's `mma` class; 8: `mma8`'s), each taking every WARPS-th GGUF block.
//
// LUCEBOX_MATVEC_TILED(format, activation, NB, WARPS, ROW_TILES, AHEAD, ORDER) defines
// `matvec_tiled_w<WARPS>_r<ROW_TILES>_a<AHEAD>_o<ORDER>_<format>_<activation>_<NB>`: launch with 32 * WARPS threads
// a block and ceil(rows / (16 * ROW_TILES)) blocks; arguments: tiles, x, y, rows, cols, batch.
#include "matvec_mma_body.cuh"

__device__ __forceinline__ uint4 load_16(const u8* p) { return *reinterpret_cast<const uint4*>(p); }

template <class W> struct TileLayout;

// Q4_K's and Q5_K's common part: the 16 rows' heads at 16 r, the 4 quant chunks from QUANTS.
template <class Raw, int QUANTS>
__device__ __forceinline__ void load_heads_and_quants(const u8* tile, int lane, Raw& a, Raw& b) {
    const int g = lane >> 2;
    a.head = load_16(tile + 16 * g);
    b.head = load_16(tile + 16 * (g + 8));
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const uint4 v = load_16(tile + QUANTS + 512 * c + 16 * lane);
        a.qs[c] = make_uint2(v.x, v.y);
        b.qs[c] = make_uint2(v.z, v.w);
    }
}

template <> struct TileLayout<MmaQ4K> {
    static constexpr int BYTES = 16 * MmaQ4K::BLOCK_BYTES;
    static __device__ __forceinline__ void load(const u8* tile, int lane, MmaQ4K::Raw& a, MmaQ4K::Raw& b) {
        load_heads_and_quants<MmaQ4K::Raw, 256>(tile, lane, a, b);
    }
};

template <> struct TileLayout<MmaQ5K> {
    static constexpr int BYTES = 16 * MmaQ5K::BLOCK_BYTES, HIGH = 256;
    static __device__ __forceinline__ void load(const u8* tile, int lane, MmaQ5K::Raw& a, MmaQ5K::Raw& b) {
        load_heads_and_quants<MmaQ5K::Raw, 768>(tile, lane, a, b);
        const uint4 high = load_16(tile + HIGH + 16 * lane);
        a.qh = make_uint2(high.x, high.y);
        b.qh = make_uint2(high.z, high.w);
    }
};

template <> struct TileLayout<MmaQ6K> {
    static constexpr int BYTES = 16 * MmaQ6K::BLOCK_BYTES, SCALES = 32, QUANTS = 288;
    static __device__ __forceinline__ void words(uint4 v, u32* out) {
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    }
    static __device__ __forceinline__ void load(const u8* tile, int lane, MmaQ6K::Raw& a, MmaQ6K::Raw& b) {
        const int g = lane >> 2;
        a.d = load_u16(tile + 2 * g);
        b.d = load_u16(tile + 2 * (g + 8));
        words(load_16(tile + SCALES + 16 * g), a.sc);
        words(load_16(tile + SCALES + 16 * (g + 8)), b.sc);
        const u8* quants = tile + QUANTS + 16 * lane;
        words(load_16(quants), a.ql_a);
        words(load_16(quants + 512), a.ql_b);
        words(load_16(quants + 1024), a.qh);
        words(load_16(quants + 1536), b.ql_a);
        words(load_16(quants + 2048), b.ql_b);
        words(load_16(quants + 2560), b.qh);
    }
};

// Warp `warp` of the WARPS that share row groups row0 / 16 .. + ROW_TILES - 1: its sums over GGUF blocks warp, warp +
// WARPS, ... of those rows, into `acc`.
template <class W, class X, int NB, int WARPS, int ROW_TILES, int AHEAD, int ORDER, bool GIVEN_SUMS = false>
__device__ __forceinline__ void tiled_accumulate(const u8* __restrict__ tiles, const X* __restrict__ x, int rows,
                                                 int cols, int batch, int row0, int warp,
                                                 float (&acc)[ROW_TILES][MmaColumns<X, NB>::TILES][4],
                                                 const float* __restrict__ sums = nullptr) {
    typedef TileLayout<W> L;
    typedef MmaColumns<X, NB> C;
    typedef typename W::Raw Raw;
    constexpr int TILES = C::TILES, STAGES = AHEAD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int blocks_per_row = cols / W::BLOCK_VALUES, groups = (rows + 15) >> 4;
    // Tile (G, b) at group_tiles[G] + b * block_stride. A second row tile past the last row group re-reads the last
    // one (valid memory); its results are not stored.
    const i64 block_stride = static_cast<i64>(ORDER == 0 ? 1 : groups) * L::BYTES;
    const u8* group_tiles[ROW_TILES];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
        group_tiles[rt] = tiles + static_cast<i64>(min((row0 >> 4) + rt, groups - 1)) *
                                      (ORDER == 0 ? blocks_per_row : 1) * L::BYTES;
    const C columns(x, cols, batch, g);
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[rt][tile][k] = 0.0f;

    // The ring: stage s holds the block the warp multiplies at step s (mod STAGES) of its walk along K.
    Raw ring_a[STAGES][ROW_TILES], ring_b[STAGES][ROW_TILES];
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        const int block = warp + s * WARPS;
        if (block < blocks_per_row)
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt)
                L::load(group_tiles[rt] + block * block_stride, lane, ring_a[s][rt], ring_b[s][rt]);
    }
    // The first blocks are in flight: only now wait for the kernel that wrote the activations (PDL).
    lucebox_wait_prior_grid();
    for (int first = warp; first < blocks_per_row; first += STAGES * WARPS) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            const int block = first + s * WARPS;
            if (block >= blocks_per_row) break;
            // Refill the stage multiplied one step ago with the block AHEAD steps on.
            const int ahead = block + AHEAD * WARPS;
            if (ahead < blocks_per_row)
#pragma unroll
                for (int rt = 0; rt < ROW_TILES; ++rt)
                    L::load(group_tiles[rt] + ahead * block_stride, lane, ring_a[(s + AHEAD) % STAGES][rt],
                            ring_b[(s + AHEAD) % STAGES][rt]);
            mma_block<W, X, NB, ROW_TILES, GIVEN_SUMS>(ring_a[s], ring_b[s], block, t, columns, acc, sums);
        }
    }
}

// The warp-unit kernel's store: each warp (one a thread block) writes its partial sums of its row group to
// `partials` ([group][warp][16 rows][8 * TILES columns], fp32); the last of the group's WARPS warps to arrive (an
// arrival counter a group in `counters`, which it resets to zero for the next launch) adds them in warp order, each
// fp32 part after the other, as mma_store does: the same bits.
template <class X, int NB, int WARPS>
__device__ __forceinline__ void unit_store(const float (&acc)[1][MmaColumns<X, NB>::TILES][4], X* __restrict__ y,
                                           int rows, int batch, int group, int warp, float* __restrict__ partials,
                                           u32* __restrict__ counters) {
    constexpr int SPLITS = MmaColumns<X, NB>::SPLITS, COLUMNS = 8 * MmaColumns<X, NB>::TILES;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* mine = partials + (static_cast<i64>(group) * WARPS + warp) * 16 * COLUMNS;
#pragma unroll
    for (int tile = 0; tile < COLUMNS / 8; ++tile)
#pragma unroll
        for (int k = 0; k < 4; ++k) mine[(g + 8 * (k >> 1)) * COLUMNS + 8 * tile + 2 * t + (k & 1)] = acc[0][tile][k];
    __threadfence();  // this warp's partials are visible device-wide before its arrival is counted
    __syncwarp();
    u32 arrived = 0;
    if (lane == 0) arrived = atomicAdd(counters + group, 1u);
    arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
    if (arrived != WARPS - 1) return;
    __threadfence();
    if (lane == 0) counters[group] = 0;  // every warp has arrived: reset for the next launch
    const float* all = partials + static_cast<i64>(group) * WARPS * 16 * COLUMNS;
    for (int i = lane; i < 16 * NB; i += 32) {
        const int r = i / 16, local = i % 16, row = 16 * group + local;
        if (r >= batch || row >= rows) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
#pragma unroll
            for (int split = 0; split < SPLITS; ++split)
                total += __ldcg(all + (w * 16 + local) * COLUMNS + r * SPLITS + split);  // L2: other SMs wrote them
        y[static_cast<i64>(r) * rows + row] = from_float<X>(total);
    }
}

#define LUCEBOX_MATVEC_TILED_KERNEL(NAME, BOUNDS, FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER)               \
    extern "C" __global__ void BOUNDS NAME(const u8* __restrict__ tiles, const ACT* __restrict__ x,            \
                                           ACT* __restrict__ y, int rows, int cols, int batch) {               \
        float acc[ROW_TILES][MmaColumns<ACT, NB>::TILES][4];                                                   \
        const int row0 = blockIdx.x * 16 * ROW_TILES;                                                          \
        tiled_accumulate<Mma_##FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER>(tiles, x, rows, cols, batch,   \
                                                                               row0, threadIdx.x >> 5, acc);   \
        mma_store<ACT, NB, WARPS, ROW_TILES>(acc, y, rows, batch, row0);                                       \
    }
#define LUCEBOX_MATVEC_TILED(FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER)                                   \
    LUCEBOX_MATVEC_TILED_KERNEL(matvec_tiled_w##WARPS##_r##ROW_TILES##_a##AHEAD##_o##ORDER##_##FORMAT##_##ACT##_##NB, \
                                __launch_bounds__(32 * WARPS), FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER)
// With given sums (matvec_mma.cu's LUCEBOX_MATVEC_MMA_S): `matvec_tiled_s_w...`, the sums a last argument.
#define LUCEBOX_MATVEC_TILED_S(FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER)                                 \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                   \
        matvec_tiled_s_w##WARPS##_r##ROW_TILES##_a##AHEAD##_o##ORDER##_##FORMAT##_##ACT##_##NB(                \
            const u8* __restrict__ tiles, const ACT* __restrict__ x, ACT* __restrict__ y, int rows, int cols,  \
            int batch, const float* __restrict__ sums) {                                                       \
        float acc[ROW_TILES][MmaColumns<ACT, NB>::TILES][4];                                                   \
        const int row0 = blockIdx.x * 16 * ROW_TILES;                                                          \
        tiled_accumulate<Mma_##FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER, true>(                         \
            tiles, x, rows, cols, batch, row0, threadIdx.x >> 5, acc, sums);                                   \
        mma_store<ACT, NB, WARPS, ROW_TILES>(acc, y, rows, batch, row0);                                       \
    }
// The probe's register caps: MIN_BLOCKS thread blocks an SM must hold at once, named _b<MIN_BLOCKS> after the order
// (an explicit minimum changes ptxas's allocation even at 1: see matvec_mma.cu).
#define LUCEBOX_MATVEC_TILED_BOUNDED(FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER, MIN_BLOCKS)               \
    LUCEBOX_MATVEC_TILED_KERNEL(                                                                               \
        matvec_tiled_w##WARPS##_r##ROW_TILES##_a##AHEAD##_o##ORDER##_b##MIN_BLOCKS##_##FORMAT##_##ACT##_##NB,  \
        __launch_bounds__(32 * WARPS, MIN_BLOCKS), FORMAT, ACT, NB, WARPS, ROW_TILES, AHEAD, ORDER)

// Warp units: one warp a thread block, block u being warp u % WARPS of row group u / WARPS (launch with 32 threads
// and ceil(rows / 16) * WARPS blocks; extra arguments `partials`, float [ceil(rows / 16) * WARPS * 16 * 8 * TILES],
// no init, and `counters`, u32 [ceil(rows / 16)], zero before the first launch). The GPU then balances warps, not
// blocks of four: a shape with few row groups (the 27B's down product: 320) fills every SM evenly.
#define LUCEBOX_MATVEC_TILED_UNITS(FORMAT, ACT, NB, WARPS, AHEAD, ORDER)                                        \
    extern "C" __global__ void __launch_bounds__(32)                                                           \
        matvec_tiled_units_w##WARPS##_a##AHEAD##_o##ORDER##_##FORMAT##_##ACT##_##NB(                           \
            const u8* __restrict__ tiles, const ACT* __restrict__ x, ACT* __restrict__ y, int rows, int cols,  \
            int batch, float* __restrict__ partials, u32* __restrict__ counters) {                             \
        float acc[1][MmaColumns<ACT, NB>::TILES][4];                                                           \
        const int group = blockIdx.x / WARPS, warp = blockIdx.x % WARPS;                                       \
        tiled_accumulate<Mma_##FORMAT, ACT, NB, WARPS, 1, AHEAD, ORDER>(tiles, x, rows, cols, batch,           \
                                                                        16 * group, warp, acc);                \
        unit_store<ACT, NB, WARPS>(acc, y, rows, batch, group, warp, partials, counters);                      \
    }

// -- the bulk-copy ring (Hopper: sm_90 and later) ------------------------------------------------------------------
//
// The same warps, blocks and arithmetic as the kernel above (4 warps a row group, warp w takes GGUF blocks w, w+4, ...;
// mma_block; mma_store: the same bits), but a warp's tiles come through a ring of DEPTH stages in shared memory that
// one lane fills with one `cp.async.bulk` a tile (the copy engine moves the tile; an mbarrier a stage counts its
// bytes in). Why: the register ring above holds AHEAD tiles a warp in registers, which caps the warps an SM holds and
// the bytes in flight; the Nsight profile of session 30 found the Q4_K products latency-bound at 11-18 warps an SM
// with one block in flight a warp. Here DEPTH - 1 to DEPTH tiles a warp are in flight in shared memory, the
// registers hold only the tile being multiplied, and a stage costs one instruction to ask for, not a load a lane.
// A tile is contiguous (TileLayout::BYTES, a multiple of 16: the copy's unit) and 16-byte aligned in a row-group-major
// copy, so one copy takes it whole.
//
// LUCEBOX_MATVEC_BULK(format, activation, NB, DEPTH) defines `matvec_bulk_d<DEPTH>_<format>_<activation>_<NB>`:
// launch with 128 threads a block, ceil(rows / 16) blocks and 4 * DEPTH tiles of dynamic shared memory
// (`catalogue.matvec_bulk`); arguments: tiles (row-group-major), x, y, rows, cols, batch. Below sm_90 the kernel
// traps: the backend picks it only where the device has the copy engine (compute capability 9.0 and later).
// Measured slower than the row-major kernels on the 27B's Q4_K products (session 36): `LUCEBOX_BULK_COPIES=1` only.

__device__ __forceinline__ u32 bulk_shared_address(const void* pointer) {
    return static_cast<u32>(__cvta_generic_to_shared(pointer));
}

template <class W, class X, int NB, int DEPTH>
__device__ __forceinline__ void bulk_accumulate(const u8* __restrict__ tiles, const X* __restrict__ x, int rows,
                                                int cols, int batch, int row0,
                                                float (&acc)[1][MmaColumns<X, NB>::TILES][4]) {
    typedef TileLayout<W> L;
    typedef MmaColumns<X, NB> C;
    constexpr int WARPS = 4, TILES = C::TILES;
    extern __shared__ __align__(128) u8 bulk_ring[];  // [warp][stage][L::BYTES]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int blocks_per_row = cols / W::BLOCK_VALUES;
    const u8* group_tiles = tiles + static_cast<i64>(row0 >> 4) * blocks_per_row * L::BYTES;
    u8* ring = bulk_ring + warp * DEPTH * L::BYTES;
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[0][tile][k] = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ __align__(8) u64 bulk_full[WARPS][DEPTH];  // a stage's mbarrier: its tile's bytes have landed
    const auto ask = [&](int stage, int block) {  // lane 0: tile `block` of the row group into `stage`
        const u32 bar = bulk_shared_address(&bulk_full[warp][stage]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(L::BYTES) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(bulk_shared_address(ring + stage * L::BYTES)),
                     "l"(group_tiles + static_cast<i64>(block) * L::BYTES), "r"(L::BYTES), "r"(bar)
                     : "memory");
    };
    if (lane == 0) {
#pragma unroll
        for (int stage = 0; stage < DEPTH; ++stage)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bulk_shared_address(&bulk_full[warp][stage]))
                         : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the inits, before the copy engine's use
#pragma unroll
        for (int stage = 0; stage < DEPTH; ++stage)
            if (warp + stage * WARPS < blocks_per_row) ask(stage, warp + stage * WARPS);
    }
    __syncwarp();
    const C columns(x, cols, batch, g);
    // The first tiles are in flight: only now wait for the kernel that wrote the activations (PDL).
    lucebox_wait_prior_grid();
    int stage = 0;
    u32 phase = 0;
    for (int block = warp; block < blocks_per_row; block += WARPS) {
        const u32 bar = bulk_shared_address(&bulk_full[warp][stage]);
        u32 landed = 0;
        while (!landed)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(landed)
                         : "r"(bar), "r"(phase)
                         : "memory");
        typename W::Raw a[1], b[1];
        L::load(ring + stage * L::BYTES, lane, a[0], b[0]);
        mma_block<W, X, NB, 1>(a, b, block, t, columns, acc);
        // The stage takes the tile DEPTH steps on only once every lane's reads of it have landed: the mma steps
        // above used them, and the warp's barrier orders every lane before lane 0's request. (Asking right after
        // the reads were issued, before the math, let a copy overwrite a stage still being read: the 27B head's
        // 16-row product at depth 4 differed from `mma`'s bits now and then, session 36.)
        __syncwarp();
        const int refill = block + DEPTH * WARPS;
        if (lane == 0 && refill < blocks_per_row) ask(stage, refill);
        if (++stage == DEPTH) stage = 0, phase ^= 1;
    }
#else
    (void)x, (void)rows, (void)batch, (void)g, (void)t, (void)group_tiles, (void)ring, (void)lane;
    lucebox_wait_prior_grid();
    __trap();  // no bulk copies below sm_90: the backend never launches this kernel there
#endif
}

#define LUCEBOX_MATVEC_BULK(FORMAT, ACT, NB, DEPTH)                                                             \
    extern "C" __global__ void __launch_bounds__(128) matvec_bulk_d##DEPTH##_##FORMAT##_##ACT##_##NB(              \
        const u8* __restrict__ tiles, const ACT* __restrict__ x, ACT* __restrict__ y, int rows, int cols,       \
        int batch) {                                                                                           \
        float acc[1][MmaColumns<ACT, NB>::TILES][4];                                                           \
        const int row0 = blockIdx.x * 16;                                                                      \
        bulk_accumulate<Mma_##FORMAT, ACT, NB, DEPTH>(tiles, x, rows, cols, batch, row0, acc);                 \
        mma_store<ACT, NB, 4, 1>(acc, y, rows, batch, row0);                                                   \
    }
