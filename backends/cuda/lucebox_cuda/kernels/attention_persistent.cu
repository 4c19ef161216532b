// A decode step's gated softmax attention (one token, Qwen3.5's full-attention layers) in one persistent launch with
// three grid-wide barriers, from the normed input to the output product:
//     q | gate, k, v = q_proj(m), k_proj(m), v_proj(m)          (per query head: 256 query dims, then 256 gate dims)
//     q, k           = rope(rms_norm(q) * q_norm), rope(rms_norm(k) * k_norm)    per head; NeoX RoPE on rot dims
//     K[p], V[p]     = k, v                                      (the cache's row at the token's position p)
//     o              = softmax(q K[0..p]^T * scale) V[0..p]      per query head over its KV head (GQA)
//     out            = o_proj(o * sigmoid(gate))
// where the unfused step launches the q | k | v products, the q/k norm + RoPE, the K/V store, the split attention
// and its merge, the gate and the output product: seven or eight kernels of a few microseconds each (Qwen3.5-0.8B:
// 6 of its 24 layers). Issue #17's megakernel, its third piece (ffn_persistent.cu and gdn_persistent.cu are the
// others): with it and the FFN's, every layer of the 0.8B is two launches.
//
//   Phase 1. Every block stages m in shared memory (with a residual, m = rms_norm(x + residual) * input_norm, each
//     block its own copy; block 0 stores the sum), then takes 16-row tiles of the q | gate, k and v products.
//   Barrier.
//   Phase 2. Units (KV head g, 4 * span keys): a block normalises and rotates its group's queries (and, in the unit
//     holding the position, the new key, which it stores with the new value in the cache's row p), then each warp
//     walks `span` keys of its own against every query of the group: an online softmax per query head, the
//     maximum, the sum of exp(score - maximum) and the unnormalised output in fp32, left in `partial_*` per
//     (query head, span of keys). The key row p is read from shared memory, never from the cache it was just
//     stored in (another unit may not see that store before the barrier: none reads it).
//   Barrier.
//   Phase 3. Units (query head): the spans up to p merged (the online softmax's rescaling), divided by the sum,
//     rounded, times sigmoid(gate) rounded as the unfused gate rounds it, into `core`.
//   Barrier.
//   Phase 4. Every block stages `core` and takes 16-row tiles of the output product into `out`.
//
// Arithmetic: the products are the `mma` kernel's (matvec_mma_rows, 4 warps); the norms, the rotation and the gate
// round where the Triton kernels round (qk_norm_rope, sigmoid_mul). The attention's sums (each score's dot product,
// the spans' merge) add in this kernel's order, not the split Triton kernel's, and the rotation's cos and sin are
// CUDA's: near-tie equal, not bit-equal, to the unfused step. A switch for plain decoding, as the other persistent
// kernels (a verify pass keeps the unfused kernels, so a speculative sequence's bits never depend on it).
//
// Shapes: head dim 256 (every Qwen3.5 / 3.6 size), GROUP query heads a KV head (a template argument: 4 for the
// 0.8B-9B, 6 for the 27B, 8 for the 35B-A3B), a plain 16-bit cache `[rows, kv_heads, 256]` of the activations' type
// and position = slot (no ring), the hidden size and query channels at most ATTN_STAGE_VALUES.
// LUCEBOX_ATTENTION_PERSISTENT(q | k format, v format, o format, activation, norm weight, group) defines
// `attention_persistent_<qk>_<v>_<o>_<activation>_<norm>_g<group>`: launch with 128 threads a block.
#include "grid_barrier.cuh"
#include "matvec_mma_body.cuh"
#include "triton_math.cuh"

constexpr int ATTN_WARPS = 4;
constexpr int ATTN_TILE = 16;
constexpr int ATTN_HEAD_DIM = 256;
constexpr int ATTN_LANE_DIMS = ATTN_HEAD_DIM / 32;  // 8 dims a lane: one 16-byte load of a K or V row
constexpr int ATTN_STAGE_VALUES = 8192;
// -inf, the running maximum before any key (exp(-inf - score) = 0: the first key's rescale of nothing).
#define ATTN_MINUS_INFINITY __int_as_float(0xff800000)
// Keys a warp loads before it uses the first: 4, or 2 where a larger group's accumulators take the registers.
template <int GROUP> struct AttnKeysInFlight { static constexpr int value = GROUP <= 4 ? 4 : 2; };
// Blocks an SM must hold: 3 (~168 registers) up to 4 query heads a KV head, 2 (~255) past that, where the group's
// accumulators would spill; the launcher's grid takes one less a SM (`attention_persistent.BLOCKS_PER_SM`), a margin.
#define ATTN_MIN_BLOCKS(GROUP) ((GROUP) <= 4 ? 3 : 2)
constexpr int ATTN_MAX_PARTIALS = 1024;  // spans of keys a query head's merge takes (the launcher's partition)

// A lane's 8 dims of a cache row (16 bytes loaded by the caller: rows of earlier launches, plain loads) as floats.
template <class X> __device__ __forceinline__ void attn_unpack8(const uint4& words, float* out) {
    const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = bits_to_float<X>(static_cast<u16>(w[i] & 0xffffu));
        out[2 * i + 1] = bits_to_float<X>(static_cast<u16>(w[i] >> 16));
    }
}

// A block-wide maximum (any multiple of 32 threads up to 1024); every thread gets it.
__device__ __forceinline__ float grid_block_max(float v) {
    __shared__ float partial[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    __syncthreads();  // an earlier call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : ATTN_MINUS_INFINITY;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// One head's row of `products` (this launch's: volatile loads) normalised and rotated by the whole block (128
// threads, two dims each) into `rotated` as floats of X values: RMSNorm with `weight`, rounded to X (the norm's
// output), then NeoX RoPE on the first rot_dim dims (dim i with i + rot_dim / 2), rounded to X (the op's output).
// `normed` is shared scratch of 256 floats. Ends with the block synchronised.
template <class X, class Nw>
__device__ __forceinline__ void attn_norm_rope(const X* products, i64 first, const Nw* __restrict__ weight,
                                               const float* __restrict__ inv_freq, float position, int rot_dim,
                                               float eps, float* normed, float* rotated) {
    const int t = threadIdx.x;
    const float x0 = grid_seen(products, first + t), x1 = grid_seen(products, first + t + 128);
    const float mean_square = triton_div(grid_block_sum(fmaf(x1, x1, __fmul_rn(x0, x0))),
                                         static_cast<float>(ATTN_HEAD_DIM));
    const float inverse_rms = triton_div(1.0f, triton_sqrt(__fadd_rn(mean_square, eps)));
    normed[t] = to_float(from_float<X>(__fmul_rn(__fmul_rn(x0, inverse_rms), to_float(weight[t]))));
    normed[t + 128] = to_float(from_float<X>(__fmul_rn(__fmul_rn(x1, inverse_rms), to_float(weight[t + 128]))));
    __syncthreads();
    const int half = rot_dim / 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int d = t + 128 * j;
        float value = normed[d];
        if (d < rot_dim) {
            const bool first_half = d < half;
            const float partner = normed[first_half ? d + half : d - half];
            float sine, cosine;
            sincosf(__fmul_rn(position, inv_freq[first_half ? d : d - half]), &sine, &cosine);
            // first' = first cos - second sin; second' = second cos + first sin
            value = fmaf(value, cosine, __fmul_rn(first_half ? -partner : partner, sine));
        }
        rotated[d] = to_float(from_float<X>(value));
    }
    __syncthreads();
}

template <class Wqk, class Wv, class Wo, class X, class Nw, int GROUP>
__device__ __forceinline__ void attention_persistent_body(
    const X* __restrict__ x, const X* __restrict__ residual, const Nw* __restrict__ input_norm,
    X* __restrict__ summed_out, const u8* __restrict__ q_w, const u8* __restrict__ k_w, const u8* __restrict__ v_w,
    const u8* __restrict__ o_w, const Nw* __restrict__ q_norm, const Nw* __restrict__ k_norm,
    const float* __restrict__ inv_freq, const i64* __restrict__ position_ptr, X* key_cache, X* value_cache,
    X* products, float* partial_max, float* partial_sum, float* partial_acc, X* core, X* __restrict__ out,
    unsigned int* __restrict__ arrived, int hidden, int kv_heads, int rot_dim, int span, int spans, float scale,
    float eps, float input_eps, X* staged) {
    // `staged`: ATTN_STAGE_VALUES values of shared memory, the caller's (a megakernel's bodies share one)
    static_assert(sizeof(X) == 2, "16-bit activations and cache rows");
    __shared__ __align__(16) float queries[GROUP][ATTN_HEAD_DIM];
    __shared__ float span_weight[ATTN_MAX_PARTIALS];
    __shared__ float new_key[ATTN_HEAD_DIM], new_value[ATTN_HEAD_DIM], normed[ATTN_HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q_heads = kv_heads * GROUP;
    const int q_rows = q_heads * 2 * ATTN_HEAD_DIM, kv_rows = kv_heads * ATTN_HEAD_DIM;
    X* k_rows = products + q_rows;
    X* v_rows = k_rows + kv_rows;
    lucebox_wait_prior_grid();
    const i64 position = *position_ptr;  // the launch ahead may have written it (a graph's input buffer)

    // Phase 1: the normed input in shared memory (add + norm, or the input as it is), then the products' tiles.
    stage_layer_input(x, residual, input_norm, input_eps, hidden, staged, summed_out);
    const int q_tiles = q_rows / ATTN_TILE, kv_tiles = kv_rows / ATTN_TILE;
    for (int tile = blockIdx.x; tile < q_tiles + 2 * kv_tiles; tile += gridDim.x) {
        if (tile < q_tiles) {
            matvec_mma_rows<Wqk, X, 1, ATTN_WARPS, 1>(q_w, staged, products, q_rows, hidden, 1, tile * ATTN_TILE);
        } else if (tile < q_tiles + kv_tiles) {
            matvec_mma_rows<Wqk, X, 1, ATTN_WARPS, 1>(k_w, staged, k_rows, kv_rows, hidden, 1,
                                                      (tile - q_tiles) * ATTN_TILE);
        } else {
            matvec_mma_rows<Wv, X, 1, ATTN_WARPS, 1>(v_w, staged, v_rows, kv_rows, hidden, 1,
                                                     (tile - q_tiles - kv_tiles) * ATTN_TILE);
        }
        __syncthreads();  // the body's shared partial sums are reused by the next tile
    }
    grid_barrier(arrived);

    // Phase 2: units (KV head, 4 * span keys); warp w takes the unit's w-th span, [first, first + span).
    const float angle_position = static_cast<float>(position);
    for (int unit = blockIdx.x; unit < kv_heads * spans; unit += gridDim.x) {
        const int kv_head = unit / spans, unit_span = unit % spans;
        const i64 unit_first = static_cast<i64>(unit_span) * ATTN_WARPS * span;
        if (unit_first > position) continue;  // keys past the token's: nothing to see (the whole block skips)
        for (int j = 0; j < GROUP; ++j)
            attn_norm_rope<X, Nw>(products, static_cast<i64>(kv_head * GROUP + j) * 2 * ATTN_HEAD_DIM, q_norm,
                                  inv_freq, angle_position, rot_dim, eps, normed, queries[j]);
        const bool holds_new_row = position < unit_first + static_cast<i64>(ATTN_WARPS) * span;
        if (holds_new_row) {  // the token's own key and value: rows this unit alone stores
            attn_norm_rope<X, Nw>(k_rows, static_cast<i64>(kv_head) * ATTN_HEAD_DIM, k_norm, inv_freq,
                                  angle_position, rot_dim, eps, normed, new_key);
            const i64 row = (position * kv_heads + kv_head) * ATTN_HEAD_DIM;
            for (int d = threadIdx.x; d < ATTN_HEAD_DIM; d += blockDim.x) {
                new_value[d] = grid_seen(v_rows, static_cast<i64>(kv_head) * ATTN_HEAD_DIM + d);
                key_cache[row + d] = from_float<X>(new_key[d]);  // exact: floats of X values
                value_cache[row + d] = from_float<X>(new_value[d]);
            }
            __syncthreads();
        }
        const i64 first = unit_first + static_cast<i64>(warp) * span;
        const i64 end = first + span < position + 1 ? first + span : position + 1;
        float running_max[GROUP], running_sum[GROUP], acc[GROUP][ATTN_LANE_DIMS];
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            running_max[j] = ATTN_MINUS_INFINITY;
            running_sum[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < ATTN_LANE_DIMS; ++i) acc[j][i] = 0.0f;
        }
        // A batch of keys' rows loaded before any is used: the loads' latency paid once a batch.
        constexpr int ATTN_KEYS_IN_FLIGHT = AttnKeysInFlight<GROUP>::value;
        for (i64 batch = first; batch < end; batch += ATTN_KEYS_IN_FLIGHT) {
            uint4 key_words[ATTN_KEYS_IN_FLIGHT], value_words[ATTN_KEYS_IN_FLIGHT];
#pragma unroll
            for (int c = 0; c < ATTN_KEYS_IN_FLIGHT; ++c) {
                const i64 key = batch + c;
                if (key < end && key != position) {
                    const i64 row = (key * kv_heads + kv_head) * ATTN_HEAD_DIM + lane * ATTN_LANE_DIMS;
                    key_words[c] = *reinterpret_cast<const uint4*>(key_cache + row);
                    value_words[c] = *reinterpret_cast<const uint4*>(value_cache + row);
                }
            }
#pragma unroll
            for (int c = 0; c < ATTN_KEYS_IN_FLIGHT; ++c) {
                const i64 key = batch + c;
                if (key >= end) break;
                float k[ATTN_LANE_DIMS], v[ATTN_LANE_DIMS];
                if (key == position) {  // the token's own row, from shared memory
#pragma unroll
                    for (int i = 0; i < ATTN_LANE_DIMS; ++i) {
                        k[i] = new_key[lane * ATTN_LANE_DIMS + i];
                        v[i] = new_value[lane * ATTN_LANE_DIMS + i];
                    }
                } else {
                    attn_unpack8<X>(key_words[c], k);
                    attn_unpack8<X>(value_words[c], v);
                }
#pragma unroll
                for (int j = 0; j < GROUP; ++j) {
                    const float4 q0 = *reinterpret_cast<const float4*>(&queries[j][lane * ATTN_LANE_DIMS]);
                    const float4 q1 = *reinterpret_cast<const float4*>(&queries[j][lane * ATTN_LANE_DIMS + 4]);
                    const float q[ATTN_LANE_DIMS] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < ATTN_LANE_DIMS; ++i) dot = fmaf(q[i], k[i], dot);
                    const float score = __fmul_rn(warp_sum(dot), scale);
                    const float top = fmaxf(running_max[j], score);
                    const float rescale = triton_exp(__fsub_rn(running_max[j], top));  // 0 at the first key
                    const float weight = triton_exp(__fsub_rn(score, top));
                    running_sum[j] = fmaf(running_sum[j], rescale, weight);
#pragma unroll
                    for (int i = 0; i < ATTN_LANE_DIMS; ++i)
                        acc[j][i] = fmaf(acc[j][i], rescale, __fmul_rn(weight, v[i]));
                    running_max[j] = top;
                }
            }
        }
        if (first < end) {  // a span with keys: its partial result per query head of the group
            const i64 index = static_cast<i64>(unit_span) * ATTN_WARPS + warp;
#pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                const i64 slot = static_cast<i64>(kv_head * GROUP + j) * spans * ATTN_WARPS + index;
                if (lane == 0) {
                    partial_max[slot] = running_max[j];
                    partial_sum[slot] = running_sum[j];
                }
                float* into = partial_acc + slot * ATTN_HEAD_DIM + lane * ATTN_LANE_DIMS;
                *reinterpret_cast<float4*>(into) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
                *reinterpret_cast<float4*>(into + 4) = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
            }
        }
        __syncthreads();  // the next unit rewrites `queries`, `new_key` and `new_value`
    }
    grid_barrier(arrived);

    // Phase 3: per query head, the spans holding keys 0 .. position merged, divided, gated. Their partial results
    // are this launch's: loads that go to L2 (`__ldcg`, past the barrier's fence), which unlike volatile ones may be
    // in flight together. Each span's weight exp(max - top) goes to shared memory once, for every dim.
    // Spans [0, used) hold a key each, the rest none (capped at the partition's: the caller's window covers the
    // position, and a window that did not would read no partial result past the scratch).
    const int used = static_cast<int>(min(position / span + 1, static_cast<i64>(spans) * ATTN_WARPS));
    for (int head = blockIdx.x; head < q_heads; head += gridDim.x) {
        const i64 base = static_cast<i64>(head) * spans * ATTN_WARPS;
        float top = ATTN_MINUS_INFINITY;
        for (int s = threadIdx.x; s < used; s += blockDim.x) top = fmaxf(top, __ldcg(partial_max + base + s));
        top = grid_block_max(top);
        float total = 0.0f;
        for (int s = threadIdx.x; s < used; s += blockDim.x) {
            const float weight = triton_exp(__fsub_rn(__ldcg(partial_max + base + s), top));
            span_weight[s] = weight;
            total = fmaf(__ldcg(partial_sum + base + s), weight, total);
        }
        total = grid_block_sum(total);  // synchronises: every span's weight is in shared memory
        const int t = threadIdx.x;
        float o0 = 0.0f, o1 = 0.0f;
#pragma unroll 4
        for (int s = 0; s < used; ++s) {
            const float* row = partial_acc + (base + s) * ATTN_HEAD_DIM;
            o0 = fmaf(__ldcg(row + t), span_weight[s], o0);
            o1 = fmaf(__ldcg(row + t + 128), span_weight[s], o1);
        }
        const float o[2] = {o0, o1};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int d = t + 128 * j;
            // The attention's output in X, then o * sigmoid(gate) with the sigmoid rounded to X (sigmoid_mul's).
            const float attended = to_float(from_float<X>(triton_div(o[j], total)));
            const float gate = grid_seen(products, static_cast<i64>(head) * 2 * ATTN_HEAD_DIM + ATTN_HEAD_DIM + d);
            const float gate_sigmoid = to_float(from_float<X>(triton_sigmoid(gate)));
            core[head * ATTN_HEAD_DIM + d] = from_float<X>(__fmul_rn(attended, gate_sigmoid));
        }
        __syncthreads();  // the next head rewrites `span_weight`
    }
    grid_barrier(arrived);

    // Phase 4: the output product over the gated heads.
    const int out_tiles = hidden / ATTN_TILE;
    if (blockIdx.x >= out_tiles) return;  // the whole block: no barrier follows
    const int q_channels = q_heads * ATTN_HEAD_DIM;
    grid_stage(reinterpret_cast<const u16*>(core), reinterpret_cast<u16*>(staged), q_channels);
    for (int tile = blockIdx.x; tile < out_tiles; tile += gridDim.x) {
        matvec_mma_rows<Wo, X, 1, ATTN_WARPS, 1>(o_w, staged, out, hidden, q_channels, 1, tile * ATTN_TILE);
        __syncthreads();
    }
}

#define LUCEBOX_ATTENTION_PERSISTENT(QK, V, O, ACT, NORM, GROUP)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS, ATTN_MIN_BLOCKS(GROUP))                        \
        attention_persistent_##QK##_##V##_##O##_##ACT##_##NORM##_g##GROUP(                                        \
            const ACT* __restrict__ x, const ACT* __restrict__ residual, const NORM* __restrict__ input_norm,     \
            ACT* __restrict__ summed_out, const u8* __restrict__ q_w, const u8* __restrict__ k_w,                 \
            const u8* __restrict__ v_w, const u8* __restrict__ o_w, const NORM* __restrict__ q_norm,             \
            const NORM* __restrict__ k_norm, const float* __restrict__ inv_freq,                                  \
            const i64* __restrict__ position, ACT* key_cache, ACT* value_cache, ACT* products,                    \
            float* partial_max, float* partial_sum, float* partial_acc, ACT* core, ACT* __restrict__ out,         \
            unsigned int* __restrict__ arrived, int hidden, int kv_heads, int rot_dim, int span, int spans,        \
            float scale, float eps, float input_eps) {                                                            \
        __shared__ __align__(16) ACT staged[ATTN_STAGE_VALUES];                                                   \
        attention_persistent_body<Mma_##QK, Mma_##V, Mma_##O, ACT, NORM, GROUP>(                                  \
            x, residual, input_norm, summed_out, q_w, k_w, v_w, o_w, q_norm, k_norm, inv_freq, position,          \
            key_cache, value_cache, products, partial_max, partial_sum, partial_acc, core, out, arrived, hidden,  \
            kv_heads, rot_dim, span, spans, scale, eps, input_eps, staged);                                       \
    }
