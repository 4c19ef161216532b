// Issue #17's megakernel: a Qwen3.5 decode step's whole decoder stack in one persistent launch, from the token's
// embedding to the final-normed hidden state (what the output head reads):
//     for each layer:  mixed  = mixer(rms_norm(x + residual) * input_norm)        (Gated DeltaNet or gated attention)
//                      x      = mlp(rms_norm(mixed + summed) * post_norm)         (SwiGLU)
//     out = rms_norm(x + residual) * final_norm
// where the recorded step launches ~11 kernels a layer (the 0.8B: ~270 a token), each paying a launch, a ramp while
// its first loads are in flight and a drain while its last blocks finish.
//
// The layers are the persistent pieces' bodies, one after another with a grid barrier between them:
// `gdn_persistent_body` (3 phases) or `attention_persistent_body` (4), then `ffn_persistent_body` (2). Each body's
// first phase does the layer's residual add and norm itself (every block its own copy; block 0 stores the sum), so
// a linear layer is 5 phases and 4 barriers and an attention layer 6 and 5, plus the barrier after each body. The
// final add + norm is block 0's alone. The output head and the draw stay the step's own kernels (the head is a
// third of a 0.8B step's bytes in one product, which its standalone kernel streams).
//
// Arithmetic: each body's, so an output is near-tie equal to the recorded step, not bit-equal (the norms' sums add
// in the block's order): a decode-only path, never a verify pass's (`static_step.decode_only_kernels`).
//
// What one launch changes against the pieces' own launches: the bodies read each other's outputs within the launch,
// so every row another block wrote is read through L2 (`grid_seen`, `grid_stage`, `__ldcg`), never through a line
// this SM may hold; the residual sums alternate between two rows (a body's block 0 writes one while the others read
// the other). Per-layer operands come from a table (`MegaField` u64 slots a layer, written by
// `lucebox_cuda.megakernel`); each layer's weight formats pick one of the bodies instantiated for this model (the
// MEGA_*_CASES lists the launcher appends: a Q4_K_M file mixes Q4_K and Q6_K layers).
//
// The launcher's lines: the three case lists, the layer loop's header, then the kernel:
//     #define MEGA_GDN_CASES MEGA_GDN_CASE(0, q6_k, q4_k) ...            (variant, qkv format, other products')
//     #define MEGA_ATTENTION_CASES MEGA_ATTENTION_CASE(0, q4_k, q6_k, q4_k) ...   (variant, q | k, v, o formats)
//     #define MEGA_FFN_CASES MEGA_FFN_CASE(0, q4_k, q6_k) ...            (variant, gate | up format, down format)
//     #include "qwen35_megakernel_body.cuh"
//     LUCEBOX_QWEN35_MEGAKERNEL(name, activation, norm weight, group)
// Launch with 128 threads a block, the grid resident all at once (`megakernel.grid_size`).
#include "ffn_persistent.cu"
#include "gdn_persistent.cu"
#include "attention_persistent.cu"

constexpr int MEGA_STAGE_VALUES = 8192;  // the hidden size, the value / query channels and the intermediate size
static_assert(MEGA_STAGE_VALUES <= GDN_STAGE_VALUES && MEGA_STAGE_VALUES <= ATTN_STAGE_VALUES &&
              MEGA_STAGE_VALUES <= FFN_STAGE_VALUES, "a body's phases stage at most their own room");

// A layer's row of the table: u64 slots (pointers and small integers), in `megakernel.FIELDS`' order.
enum MegaField {
    MEGA_KIND,           // 0: a Gated DeltaNet layer, 1: a gated attention layer
    MEGA_MIXER_VARIANT,  // the case of MEGA_GDN_CASES or MEGA_ATTENTION_CASES
    MEGA_FFN_VARIANT,    // the case of MEGA_FFN_CASES
    MEGA_INPUT_NORM,
    MEGA_POST_NORM,
    MEGA_GATE_UP,
    MEGA_DOWN,
    MEGA_W0,  // qkv rows | q (| gate) rows
    MEGA_W1,  // z rows   | k rows
    MEGA_W2,  // b rows   | v rows
    MEGA_W3,  // a rows   | o
    MEGA_W4,  // out      | (none)
    MEGA_P0,  // conv1d   | q_norm
    MEGA_P1,  // ssm_a    | k_norm
    MEGA_P2,  // dt_bias  | (none)
    MEGA_P3,  // the gated norm | (none)
    MEGA_S0,  // conv state     | key cache
    MEGA_S1,  // recurrent state | value cache
    // The bytes each block's loads will read, for the L2 prefetch a layer ahead (`mega_prefetch_layer`): the
    // weights' rows in use (w0-w4, gate | up, down), then the recurrent state (0 for an attention layer).
    MEGA_PREFETCH,
    MEGA_PREFETCH_RANGES = 8,
    MEGA_FIELDS = MEGA_PREFETCH + 2 * MEGA_PREFETCH_RANGES  // (address, bytes) pairs
};

template <class T> __device__ __forceinline__ T* mega_ptr(const u64* f, int field) {
    return reinterpret_cast<T*>(f[field]);
}

// A layer's weights (and recurrent state) into L2 while the layer before it runs: every thread of the grid asks for
// its stride of 128-byte lines (`prefetch.global.L2`, nothing waits for it). A phase's products then read L2, and the
// memory streams across the barriers, where each phase would otherwise start its first loads after one (session
// 34's floor: a barrier does not overlap loads issued after it). A layer of the 0.8B is ~14 MB of the H100's 50 MB.
// Measured slower (session 35): `megakernel.PREFETCH_ENV` asks for it, off by default.
__device__ __forceinline__ void mega_prefetch_layer(const u64* f) {
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    for (int range = 0; range < MEGA_PREFETCH_RANGES; ++range) {
        const u8* base = mega_ptr<const u8>(f, MEGA_PREFETCH + 2 * range);
        const u64 lines = (f[MEGA_PREFETCH + 2 * range + 1] + 127) / 128;
        for (u64 line = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; line < lines; line += stride)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base + line * 128));
    }
}

#define MEGA_GDN_CASE(INDEX, QKV, REST)                                                                          \
    case INDEX:                                                                                                  \
        gdn_persistent_body<Mma_##QKV, Mma_##REST, X, Nw>(                                                       \
            x, residual, mega_ptr<const Nw>(f, MEGA_INPUT_NORM), mixer_sum, mega_ptr<const u8>(f, MEGA_W0),      \
            mega_ptr<const u8>(f, MEGA_W1), mega_ptr<const u8>(f, MEGA_W2), mega_ptr<const u8>(f, MEGA_W3),      \
            mega_ptr<const u8>(f, MEGA_W4), mega_ptr<const X>(f, MEGA_P0), mega_ptr<const float>(f, MEGA_P1),    \
            mega_ptr<const float>(f, MEGA_P2), mega_ptr<const Nw>(f, MEGA_P3), mega_ptr<X>(f, MEGA_S0),          \
            mega_ptr<float>(f, MEGA_S1), products, core, mixer_out, arrived, hidden, key_heads, value_heads,     \
            mixer_eps, eps, staged);                                                                             \
        break;
#define MEGA_ATTENTION_CASE(INDEX, QK, V, O)                                                                     \
    case INDEX:                                                                                                  \
        attention_persistent_body<Mma_##QK, Mma_##V, Mma_##O, X, Nw, GROUP>(                                     \
            x, residual, mega_ptr<const Nw>(f, MEGA_INPUT_NORM), mixer_sum, mega_ptr<const u8>(f, MEGA_W0),      \
            mega_ptr<const u8>(f, MEGA_W1), mega_ptr<const u8>(f, MEGA_W2), mega_ptr<const u8>(f, MEGA_W3),      \
            mega_ptr<const Nw>(f, MEGA_P0), mega_ptr<const Nw>(f, MEGA_P1), inv_freq, position,                  \
            mega_ptr<X>(f, MEGA_S0), mega_ptr<X>(f, MEGA_S1), products, partial_max, partial_sum, partial_acc,   \
            core, mixer_out, arrived, hidden, kv_heads, rot_dim, span, spans, scale, attention_eps, eps, staged); \
        break;
#define MEGA_FFN_CASE(INDEX, GATE_UP, DOWN)                                                                      \
    case INDEX:                                                                                                  \
        ffn_persistent_body<Mma_##GATE_UP, Mma_##DOWN, X, Nw, 1>(                                                \
            mega_ptr<const u8>(f, MEGA_GATE_UP), mega_ptr<const u8>(f, MEGA_DOWN), mixer_out, mixer_sum,         \
            mega_ptr<const Nw>(f, MEGA_POST_NORM), layer_sum, mlp_products, act, mlp_out, arrived, hidden, inter, \
            eps, staged);                                                                                        \
        break;

#define LUCEBOX_QWEN35_MEGAKERNEL(NAME, ACT, NORM, GROUP_SIZE)                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) NAME(                                                   \
        const u64* __restrict__ table, int layers, const ACT* __restrict__ embedded, const ACT* __restrict__ zeros, \
        const NORM* __restrict__ final_norm, ACT* __restrict__ normed_out, ACT* sums, ACT* mixer_out,            \
        ACT* mlp_out, ACT* products, ACT* mlp_products, ACT* core, ACT* act, float* partial_max,                 \
        float* partial_sum, float* partial_acc, const float* __restrict__ inv_freq,                              \
        const i64* __restrict__ position, unsigned int* __restrict__ arrived, int hidden, int inter,             \
        int key_heads, int value_heads, int kv_heads, int rot_dim, int span, int spans, float scale,             \
        float mixer_eps, float attention_eps, float eps, u64* timeline, int prefetch_ahead) {                    \
        megakernel_body<ACT, NORM, GROUP_SIZE>(table, layers, embedded, zeros, final_norm, normed_out, sums,     \
                                               mixer_out, mlp_out, products, mlp_products, core, act,            \
                                               partial_max, partial_sum, partial_acc, inv_freq, position,        \
                                               arrived, hidden, inter, key_heads, value_heads, kv_heads,         \
                                               rot_dim, span, spans, scale, mixer_eps, attention_eps, eps,       \
                                               timeline, prefetch_ahead);                                        \
    }
