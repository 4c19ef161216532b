// A decode step's Gated DeltaNet mixer (one token, Qwen3.5's linear-attention layers) in one persistent launch
// with two grid-wide barriers, from the normed input to the mixer's output:
//     qkv, z, b, a = in_proj(m)                   (four products of the normed input m)
//     q | k | v    = silu(conv1d(window, qkv))    (depthwise, 4 taps: the conv state's 3 inputs, then qkv)
//     q, k         = l2norm(q) / sqrt(d_k), l2norm(k)          per key head
//     beta         = sigmoid(b);  decay = exp(ssm_a * softplus(a + dt_bias))    per value head
//     S            = decay * S;  S += k (beta (v - S^T k))^T;  o = S^T q       (the gated delta rule)
//     out          = out_proj(rms_norm(o) * norm * silu(z))    (the gated norm, per value head)
// where the unfused step launches the qkv | z and b | a products, the convolution, the delta step, the gated norm
// and the output product: six kernels of a few microseconds each (Qwen3.5-0.8B: 18 of its 24 layers), each paying a
// launch, a ramp and a drain. Issue #17's megakernel, its second piece (ffn_persistent.cu is the first).
//
//   Phase 1. Every block stages m in shared memory: with a residual, m = rms_norm(x + residual) * input_norm,
//     each block its own copy (the layer's input add + norm: one launch fewer; block 0 stores the sum), else m = x.
//     Then it takes 16-row tiles of the four products in turn (qkv's rows, then z's, b's, a's) into `products`.
//   Barrier.
//   Phase 2. Units (value head h, 32 of its 128 value dims): a block convolves the q and k channels of h's key head
//     and the unit's v channels itself (from `products` and the conv state, which nobody writes in this phase),
//     normalises q and k, computes the gates, and steps its 128 x 32 slice of h's state: a warp a quarter of the
//     key dims, a lane a value dim, the slice in registers between the decay, the delta update and the readout.
//     The readout goes to `core`.
//   Barrier.
//   Phase 3. The conv state shifts in the new inputs (every block a stride of channels: phase 2's reads of the old
//     state are all done). Then every block stages the gated norm of `core` (each head's sum of squares by a warp)
//     and takes 16-row tiles of the output product into `out`.
//
// Arithmetic: the products are the `mma` kernel's (matvec_mma_rows, 4 warps); the convolution, SiLU, L2 norm, gates,
// delta step and gated norm round where the Triton kernels round (conv_silu_update_, gated_delta_decode_,
// gated_rms_norm), with their operations (triton_math.cuh). Sums of squares, the taps and the key-dim reductions add
// in this kernel's order, not Triton's, so a value's last bit may differ: near-tie equal, not bit-equal, to the
// unfused step (a switch for plain decoding, as the other persistent kernels).
//
// The barrier and the grid are ffn_persistent.cu's; `__launch_bounds__(128, 3)` keeps the registers (~180 with a
// Q6_K qkv beside Q4_K products) under 3 blocks an SM's worth, so the grid's cap of 2 leaves one as a margin. Shapes: d_k = d_v = 128, 4 conv taps, value heads a multiple of
// 16 (b's and a's rows are whole tiles) and of the key heads; the hidden size and the value channels at most
// GDN_STAGE_VALUES. LUCEBOX_GDN_PERSISTENT(qkv format, other products' format, activation, norm weight) defines
// `gdn_persistent_<qkv>_<rest>_<activation>_<norm>`: launch with 128 threads a block.
#include "grid_barrier.cuh"
#include "matvec_mma_body.cuh"
#include "triton_math.cuh"

constexpr int GDN_WARPS = 4;
constexpr int GDN_TILE = 16;
constexpr int GDN_HEAD_DIM = 128;  // d_k = d_v
constexpr int GDN_CHUNK = 32;      // value dims a phase-2 unit steps: a lane each
constexpr int GDN_TAPS = 4;
constexpr int GDN_STAGE_VALUES = 8192;

// One channel of the one-token convolution, then SiLU, as conv_silu_update_ rounds it: the taps over the window
// (the state's 3 inputs, then the new one) in fp32, rounded to X, then y * sigmoid(y) rounded to X.
template <class X>
__device__ __forceinline__ float gdn_conv_silu(const X* __restrict__ conv_weight, const X* conv_state,
                                               const X* products, int channels, int c) {
    const X* w = conv_weight + static_cast<i64>(c) * GDN_TAPS;
    float y = __fmul_rn(to_float(conv_state[c]), to_float(w[0]));
#pragma unroll
    for (int tap = 1; tap < GDN_TAPS - 1; ++tap)
        y = fmaf(to_float(conv_state[static_cast<i64>(tap) * channels + c]), to_float(w[tap]), y);
    y = fmaf(grid_seen(products, c), to_float(w[GDN_TAPS - 1]), y);
    y = to_float(from_float<X>(y));
    return to_float(from_float<X>(__fmul_rn(y, triton_sigmoid(y))));
}

template <class Wq, class Wr, class X, class Nw>
__device__ __forceinline__ void gdn_persistent_body(
    const X* __restrict__ x, const X* __restrict__ residual, const Nw* __restrict__ input_norm, X* __restrict__ summed_out,
    const u8* __restrict__ qkv_w, const u8* __restrict__ z_w, const u8* __restrict__ b_w,
    const u8* __restrict__ a_w, const u8* __restrict__ out_w, const X* __restrict__ conv_weight,
    const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, const Nw* __restrict__ norm, X* conv_state,
    float* recurrent, X* products, X* core, X* __restrict__ out, unsigned int* __restrict__ arrived, int hidden,
    int key_heads, int value_heads, float eps, float input_eps, X* staged) {
    // `staged`: GDN_STAGE_VALUES values of shared memory, the caller's (a megakernel's bodies share one)
    static_assert(sizeof(X) == 2, "16-bit activations: the staged vector's room is counted in them");
    __shared__ float q_s[GDN_HEAD_DIM], k_s[GDN_HEAD_DIM], v_s[GDN_CHUNK];
    __shared__ float partial[GDN_WARPS][GDN_CHUNK];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int key_channels = key_heads * GDN_HEAD_DIM, value_channels = value_heads * GDN_HEAD_DIM;
    const int channels = 2 * key_channels + value_channels;  // the convolved ones: q | k | v
    X* z_rows = products + channels;
    X* b_rows = z_rows + value_channels;
    X* a_rows = b_rows + value_heads;
    lucebox_wait_prior_grid();

    // Phase 1: the normed input in shared memory: the residual add and the layer's input norm, each block its own
    // copy (block 0 stores the sum), or without a residual the input as it is (normed by the launch ahead). Then
    // the four products' tiles.
    stage_layer_input(x, residual, input_norm, input_eps, hidden, staged, summed_out);
    const int qkv_tiles = channels / GDN_TILE, z_tiles = value_channels / GDN_TILE, ba_tiles = value_heads / GDN_TILE;
    for (int tile = blockIdx.x; tile < qkv_tiles + z_tiles + 2 * ba_tiles; tile += gridDim.x) {
        if (tile < qkv_tiles) {
            matvec_mma_rows<Wq, X, 1, GDN_WARPS, 1>(qkv_w, staged, products, channels, hidden, 1, tile * GDN_TILE);
        } else if (tile < qkv_tiles + z_tiles) {
            matvec_mma_rows<Wr, X, 1, GDN_WARPS, 1>(z_w, staged, z_rows, value_channels, hidden, 1,
                                                    (tile - qkv_tiles) * GDN_TILE);
        } else {
            const int t = tile - qkv_tiles - z_tiles;
            const bool is_b = t < ba_tiles;
            matvec_mma_rows<Wr, X, 1, GDN_WARPS, 1>(is_b ? b_w : a_w, staged, is_b ? b_rows : a_rows, value_heads,
                                                    hidden, 1, (is_b ? t : t - ba_tiles) * GDN_TILE);
        }
        __syncthreads();  // the body's shared partial sums are reused by the next tile
    }
    grid_barrier(arrived);

    // Phase 2: (value head, 32 value dims) units of the delta step.
    const int chunks = GDN_HEAD_DIM / GDN_CHUNK;
    const float scale = 0.08838834764831845f;  // 128^-0.5 rounded to fp32, as the Triton kernel's fp32 argument
    for (int unit = blockIdx.x; unit < value_heads * chunks; unit += gridDim.x) {
        const int head = unit / chunks, chunk = unit % chunks, key_head = head % key_heads;  // tiled heads
        const int t = threadIdx.x;  // 128 threads: one q and one k channel each
        const float q = gdn_conv_silu(conv_weight, conv_state, products, channels, key_head * GDN_HEAD_DIM + t);
        const float k = gdn_conv_silu(conv_weight, conv_state, products, channels,
                                      key_channels + key_head * GDN_HEAD_DIM + t);
        if (t < GDN_CHUNK)
            v_s[t] = gdn_conv_silu(conv_weight, conv_state, products, channels,
                                   2 * key_channels + head * GDN_HEAD_DIM + chunk * GDN_CHUNK + t);
        // L2 norms with eps inside the root, rounded to X as the reference's l2norm output; q then scaled.
        const float q_norm = triton_sqrt(__fadd_rn(grid_block_sum(__fmul_rn(q, q)), 1e-6f));
        const float k_norm = triton_sqrt(__fadd_rn(grid_block_sum(__fmul_rn(k, k)), 1e-6f));
        q_s[t] = __fmul_rn(to_float(from_float<X>(triton_div(q, q_norm))), scale);
        k_s[t] = to_float(from_float<X>(triton_div(k, k_norm)));
        const float beta = to_float(from_float<X>(triton_sigmoid(grid_seen(b_rows, head))));
        // g = ssm_a * softplus(a + dt_bias) in fp32 (softplus linear past 20, as torch's); decay = exp(g). The log
        // is `logf` (libdevice's, as Triton's `tl.log`): `__logf`'s lg2.approx would cost a small softplus its
        // relative accuracy, and every head's decay with it.
        const float pre = __fadd_rn(grid_seen(a_rows, head), dt_bias[head]);
        const float softplus = pre > 20.0f ? pre : logf(__fadd_rn(1.0f, triton_exp(fminf(pre, 20.0f))));
        const float decay = triton_exp(__fmul_rn(ssm_a[head], softplus));
        __syncthreads();  // q_s, k_s, v_s complete

        // Warp w: key dims [32w, 32w + 32) of the slice; lane: value dim chunk * 32 + lane. Row-major [d_k, d_v]:
        // a warp's 32 loads of a key dim are one 128-byte line.
        float* slice = recurrent + (static_cast<i64>(head) * GDN_HEAD_DIM + 32 * warp) * GDN_HEAD_DIM +
                       chunk * GDN_CHUNK + lane;
        float s[32];
        float remembered = 0.0f;  // (S^T k) over this warp's key dims
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            s[r] = __fmul_rn(slice[static_cast<i64>(r) * GDN_HEAD_DIM], decay);
            remembered = fmaf(s[r], k_s[32 * warp + r], remembered);
        }
        partial[warp][lane] = remembered;
        __syncthreads();
        remembered = __fadd_rn(__fadd_rn(partial[0][lane], partial[1][lane]),
                               __fadd_rn(partial[2][lane], partial[3][lane]));
        const float update = __fmul_rn(__fsub_rn(v_s[lane], remembered), beta);
        float read = 0.0f;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            s[r] = fmaf(k_s[32 * warp + r], update, s[r]);
            read = fmaf(s[r], q_s[32 * warp + r], read);
            slice[static_cast<i64>(r) * GDN_HEAD_DIM] = s[r];
        }
        __syncthreads();  // every warp has read `partial` above
        partial[warp][lane] = read;
        __syncthreads();
        if (warp == 0)
            core[head * GDN_HEAD_DIM + chunk * GDN_CHUNK + lane] = from_float<X>(__fadd_rn(
                __fadd_rn(partial[0][lane], partial[1][lane]), __fadd_rn(partial[2][lane], partial[3][lane])));
        __syncthreads();  // the next unit rewrites q_s, k_s, v_s and `partial`
    }
    grid_barrier(arrived);

    // Phase 3: the conv state takes the new inputs (the window's last 3 rows), a stride of channels a block.
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x) {
#pragma unroll
        for (int tap = 0; tap < GDN_TAPS - 2; ++tap)
            conv_state[static_cast<i64>(tap) * channels + c] = conv_state[static_cast<i64>(tap + 1) * channels + c];
        conv_state[static_cast<i64>(GDN_TAPS - 2) * channels + c] =
            from_float<X>(grid_seen(products, c));  // exact: a 16-bit value back to its type
    }
    const int out_tiles = hidden / GDN_TILE;
    if (blockIdx.x >= out_tiles) return;  // the whole block: no barrier follows
    // The gated norm of every head into shared memory: rms_norm(o) * norm, rounded; silu(z), rounded; their product.
    for (int head = warp; head < value_heads; head += GDN_WARPS) {
        float o[GDN_HEAD_DIM / 32];
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < GDN_HEAD_DIM / 32; ++j) {
            o[j] = grid_seen(core, head * GDN_HEAD_DIM + lane + 32 * j);
            squares = fmaf(o[j], o[j], squares);
        }
        const float mean_square = triton_div(warp_sum(squares), static_cast<float>(GDN_HEAD_DIM));
        const float inverse_rms = triton_div(1.0f, triton_sqrt(__fadd_rn(mean_square, eps)));
#pragma unroll
        for (int j = 0; j < GDN_HEAD_DIM / 32; ++j) {
            const int d = lane + 32 * j, i = head * GDN_HEAD_DIM + d;
            const float normed = to_float(from_float<X>(__fmul_rn(__fmul_rn(o[j], inverse_rms), to_float(norm[d]))));
            const float z = grid_seen(z_rows, i);
            const float gate = to_float(from_float<X>(__fmul_rn(z, triton_sigmoid(z))));
            staged[i] = from_float<X>(__fmul_rn(normed, gate));
        }
    }
    __syncthreads();
    for (int tile = blockIdx.x; tile < out_tiles; tile += gridDim.x) {
        matvec_mma_rows<Wr, X, 1, GDN_WARPS, 1>(out_w, staged, out, hidden, value_channels, 1, tile * GDN_TILE);
        __syncthreads();
    }
}

#define LUCEBOX_GDN_PERSISTENT(QKV, REST, ACT, NORM)                                                            \
    extern "C" __global__ void __launch_bounds__(32 * GDN_WARPS, 3) gdn_persistent_##QKV##_##REST##_##ACT##_##NORM( \
        const ACT* __restrict__ x, const ACT* __restrict__ residual, const NORM* __restrict__ input_norm,       \
        ACT* __restrict__ summed_out, const u8* __restrict__ qkv_w, const u8* __restrict__ z_w,                 \
        const u8* __restrict__ b_w, const u8* __restrict__ a_w, const u8* __restrict__ out_w,                  \
        const ACT* __restrict__ conv_weight, const float* __restrict__ ssm_a, const float* __restrict__ dt_bias,  \
        const NORM* __restrict__ norm, ACT* conv_state, float* recurrent, ACT* products, ACT* core,              \
        ACT* __restrict__ out, unsigned int* __restrict__ arrived, int hidden, int key_heads, int value_heads,   \
        float eps, float input_eps) {                                                                          \
        __shared__ __align__(16) ACT staged[GDN_STAGE_VALUES];                                                 \
        gdn_persistent_body<Mma_##QKV, Mma_##REST, ACT, NORM>(x, residual, input_norm, summed_out, qkv_w, z_w, b_w,  \
                                                              a_w, out_w, conv_weight, ssm_a,                      \
                                                              dt_bias, norm, conv_state, recurrent, products, core, \
                                                              out, arrived, hidden, key_heads, value_heads, eps,  \
                                                              input_eps, staged);                                  \
    }
