// The tensor-core pieces shared by the matrix-vector kernels (matvec_mma.cu, matvec_pipe.cu): the mma
// element types (bf16, fp16), activations as B fragments, and each K-quant format's lane mapping (what
// lane t reads from one row's GGUF block and how a 16-value mma step's A fragment is made from it).
// See matvec_mma.cu for why and how the exact 16-bit products work.
#pragma once
#include "gguf_blocks.cuh"
#if LUCEBOX_HIP
#error "the tensor-core kernels (mma.sync, cp.async, prmt) are CUDA-only; the HIP backend runs matvec.cu"
#endif

// -- 16-bit element types of the mma ------------------------------------------------------------------

struct MmaBf16 {
    // bf16 128.0 is 0x4300: its 7-bit mantissa holds q (< 128) exactly.
    static constexpr u32 MAGIC_PAIR = 0x43004300u, ONE_PAIR = 0x3F803F80u;
    static constexpr float MAGIC = 128.0f;
    static __device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

struct MmaF16 {
    // fp16 1024.0 is 0x6400: its 10-bit mantissa holds q (< 1024) exactly.
    static constexpr u32 MAGIC_PAIR = 0x64006400u, ONE_PAIR = 0x3C003C00u;
    static constexpr float MAGIC = 1024.0f;
    static __device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
    u32 out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
    return out;
}

// Two 16-bit (magic + q) values from the 4 unsigned quant bytes of `q4`: bytes 0 and 1 (the A fragment's k slots
// 2t, 2t+1), or 2 and 3 (slots 2t+8, 2t+9).
template <class E> __device__ __forceinline__ u32 low_pair(u32 q4) { return byte_perm(q4, E::MAGIC_PAIR, 0x7150u); }
template <class E> __device__ __forceinline__ u32 high_pair(u32 q4) { return byte_perm(q4, E::MAGIC_PAIR, 0x7352u); }

// 2^23 + byte k of `word` as an fp32 (the byte in the low mantissa bits). The constant is prmt's first operand so
// that the selector can be the immediate: with the constant second, ptxas made it the immediate and spent an
// instruction a call moving the selector into a register.
__device__ __forceinline__ float magic_byte(u32 word, int k) {
    return __uint_as_float(byte_perm(0x4B000000u, word, 0x3104u + k));
}

// Exact fp32 value of byte k of `word`, through the mantissa of 2^23 (no conversion unit).
__device__ __forceinline__ float byte_to_float(u32 word, int k) { return magic_byte(word, k) - 8388608.0f; }

// Byte k of `word` times v: exact for v of at most 16 significant bits (an fp16 GGUF block scale). (One FMA,
// (2^23 + byte) * v - 2^23 * v, would give the same bits in one instruction less, but ptxas then held more
// registers and recomputed the activation addresses in the loop: more instructions in all, session 29.)
__device__ __forceinline__ float byte_times(u32 word, int k, float v) { return byte_to_float(word, k) * v; }

// -- activations as B fragments ----------------------------------------------------------------------

// B registers (b0, b1) of one lane for one 16-value step: columns c..c+3 of one activation row placed as
// b0 = (x[c], x[c+1]) (k slots 2t, 2t+1), b1 = (x[c+2], x[c+3]) (slots 2t+8, 2t+9): 16-bit activations are the
// registers as loaded. `load8` gives two steps' registers from 8 consecutive columns c..c+7 (one 16-byte load for
// 16-bit activations). `part` picks the bf16 part of an fp32 activation.
template <class X> struct ActivationFragment;

// 16-bit activations go to the mma as loaded (the B fragment's column pairs are in load order): one body for both.
template <class T, class Elem> struct SixteenBitFragment {
    typedef Elem E;
    static constexpr int SPLITS = 1;
    static __device__ __forceinline__ void load(const T* p, int, u32& b0, u32& b1) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        b0 = v.x;
        b1 = v.y;
    }
    static __device__ __forceinline__ void load8(const T* p, int, u32 (&b0)[2], u32 (&b1)[2]) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        b0[0] = v.x;
        b1[0] = v.y;
        b0[1] = v.z;
        b1[1] = v.w;
    }
};

template <> struct ActivationFragment<bf16> : SixteenBitFragment<bf16, MmaBf16> {};
template <> struct ActivationFragment<f16> : SixteenBitFragment<f16, MmaF16> {};

__device__ __forceinline__ float bf16_round(float v) {
    u16 bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    return bf16_bits_to_float(bits);
}

// Part `part` (0, 1, 2) of v = hi + mid + lo, each a bf16 (exact for normal fp32 values: 8+8+8 bits).
__device__ __forceinline__ float bf16_part(float v, int part) {
    const float hi = bf16_round(v);
    if (part == 0) return hi;
    const float rest = v - hi;  // exact
    const float mid = bf16_round(rest);
    return part == 1 ? mid : rest - mid;
}

__device__ __forceinline__ u32 pack_bf16x2(float low, float high) {
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(high), "f"(low));
    return out;
}

template <> struct ActivationFragment<f32> {
    typedef MmaBf16 E;
    static constexpr int SPLITS = 3;
    static __device__ __forceinline__ void load(const f32* p, int part, u32& b0, u32& b1) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        const float x0 = bf16_part(v.x, part), x1 = bf16_part(v.y, part);
        const float x2 = bf16_part(v.z, part), x3 = bf16_part(v.w, part);
        b0 = pack_bf16x2(x0, x1);
        b1 = pack_bf16x2(x2, x3);
    }
    static __device__ __forceinline__ void load8(const f32* p, int part, u32 (&b0)[2], u32 (&b1)[2]) {
        load(p, part, b0[0], b1[0]);
        load(p + 4, part, b0[1], b1[1]);
    }
};

// -- weight formats: raw bytes of one row's block for one lane, and their decoding per mma step --------
//
// Each format: STEPS mma steps of 16 values per 256-value block, STEPS_PER_GROUP steps share one
// sub-block scale (and min). `load` fetches what lane t needs from one row's block; `step_quants` gives
// the 4 unsigned quants of step s as bytes, `step_column` their first column; `group` a sub-block's scale
// and min times the block's d and dmin; BIAS is subtracted from the unsigned quants (Q6_K's 32).
// PAIRED_STEPS: steps 2j and 2j+1 read 8 consecutive columns (one activation load for both, `load8`).

struct MmaQ4K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 144, STEPS = 16, STEPS_PER_GROUP = 2;
    static constexpr bool PAIRED_STEPS = true;
    static constexpr bool HAS_MIN = true;
    static constexpr float BIAS = 0.0f;
    struct Raw { uint4 head; uint2 qs[4]; };
    // Lane t reads bytes 8t..8t+7 of each 32-byte chunk c: values 8t..8t+7 of sub-blocks 2c (low
    // nibbles) and 2c+1 (high nibbles).
    static __device__ __forceinline__ Raw load(const u8* block, int t) {
        Raw raw;
        raw.head = *reinterpret_cast<const uint4*>(block);
#pragma unroll
        for (int c = 0; c < 4; ++c) raw.qs[c] = *reinterpret_cast<const uint2*>(block + 16 + 32 * c + 8 * t);
        return raw;
    }
    // Step s: sub-block j = s/2, its values 8t + 4(s%2) .. +3.
    static __device__ __forceinline__ u32 step_quants(const Raw& raw, int s) {
        const int j = s >> 1;
        const u32 word = (s & 1) ? raw.qs[j >> 1].y : raw.qs[j >> 1].x;
        return ((j & 1) ? word >> 4 : word) & 0x0F0F0F0Fu;
    }
    static __device__ __forceinline__ int step_column(int s, int t) { return 32 * (s >> 1) + 8 * t + 4 * (s & 1); }
    static __device__ __forceinline__ void scales(const Raw& raw, float& d, float& dmin) {
        d = half_bits_to_float(static_cast<u16>(raw.head.x & 0xFFFFu));
        dmin = half_bits_to_float(static_cast<u16>(raw.head.x >> 16));
    }
    // 6-bit scales and mins of the 8 sub-blocks, one per byte: scales 0-3, 4-7, mins 0-3, 4-7.
    struct Groups { u32 sc_low, sc_high, m_low, m_high; };
    static __device__ __forceinline__ Groups groups(const Raw& raw) {
        const u32 w0 = raw.head.y, w1 = raw.head.z, w2 = raw.head.w;
        return {w0 & 0x3F3F3F3Fu, (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u),
                w1 & 0x3F3F3F3Fu, ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u)};
    }
    // Sub-block j's d * scale and dmin * min (exact: byte_times).
    static __device__ __forceinline__ void group(const Groups& g, int j, float d, float dmin, float& d_scale,
                                                 float& dmin_min) {
        d_scale = byte_times(j < 4 ? g.sc_low : g.sc_high, j & 3, d);
        dmin_min = byte_times(j < 4 ? g.m_low : g.m_high, j & 3, dmin);
    }
};

// Q5_K: Q4_K plus a fifth bit per value: bit j of qh[b] for value b of sub-block j (qh: 32 bytes at 16,
// nibbles at 48). Lane t needs qh bytes 8t..8t+7, the same positions as its nibbles.
struct MmaQ5K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 176, STEPS = 16, STEPS_PER_GROUP = 2;
    static constexpr bool PAIRED_STEPS = true;
    static constexpr bool HAS_MIN = true;
    static constexpr float BIAS = 0.0f;
    struct Raw { uint4 head; uint2 qh; uint2 qs[4]; };
    static __device__ __forceinline__ Raw load(const u8* block, int t) {
        Raw raw;
        raw.head = *reinterpret_cast<const uint4*>(block);
        raw.qh = *reinterpret_cast<const uint2*>(block + 16 + 8 * t);
#pragma unroll
        for (int c = 0; c < 4; ++c) raw.qs[c] = *reinterpret_cast<const uint2*>(block + 48 + 32 * c + 8 * t);
        return raw;
    }
    static __device__ __forceinline__ u32 step_quants(const Raw& raw, int s) {
        const int j = s >> 1;
        const u32 word = (s & 1) ? raw.qs[j >> 1].y : raw.qs[j >> 1].x;
        const u32 high = (s & 1) ? raw.qh.y : raw.qh.x;
        return (((j & 1) ? word >> 4 : word) & 0x0F0F0F0Fu) | (((high >> j) & 0x01010101u) << 4);
    }
    static __device__ __forceinline__ int step_column(int s, int t) { return MmaQ4K::step_column(s, t); }
    static __device__ __forceinline__ void scales(const Raw& raw, float& d, float& dmin) {
        d = half_bits_to_float(static_cast<u16>(raw.head.x & 0xFFFFu));
        dmin = half_bits_to_float(static_cast<u16>(raw.head.x >> 16));
    }
    typedef MmaQ4K::Groups Groups;
    static __device__ __forceinline__ Groups groups(const Raw& raw) {
        MmaQ4K::Raw head;
        head.head = raw.head;
        return MmaQ4K::groups(head);
    }
    static __device__ __forceinline__ void group(const Groups& g, int j, float d, float dmin, float& d_scale,
                                                 float& dmin_min) {
        MmaQ4K::group(g, j, d, dmin, d_scale, dmin_min);
    }
};

// Q6_K (210-byte blocks, only 2-byte aligned: 16-bit loads). Step s: half h = s/8, quarter r = (s/2)%4,
// sixteen i = s%2; lane t takes values b = 16i + 4t .. +3 of quarter r (columns 128h + 32r + b): low
// nibbles of ql[64h + b] (r = 0, 2: low, high nibble) or ql[64h + 32 + b] (r = 1, 3), two bits of
// qh[32h + b] (bits 2r, 2r+1). Each step is exactly one 16-value sub-block: scale scales[8h + 2r + i].
struct MmaQ6K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210, STEPS = 16, STEPS_PER_GROUP = 1;
    static constexpr bool PAIRED_STEPS = false;
    static constexpr bool HAS_MIN = false;
    static constexpr float BIAS = 32.0f;
    struct Raw { u32 ql_a[4], ql_b[4], qh[4], sc[4]; u16 d; };  // [2h + i]
    static __device__ __forceinline__ Raw load(const u8* block, int t) {
        Raw raw;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int b = 16 * i + 4 * t;
                raw.ql_a[2 * h + i] = load_u32_from_u16s(block + 64 * h + b);
                raw.ql_b[2 * h + i] = load_u32_from_u16s(block + 64 * h + 32 + b);
                raw.qh[2 * h + i] = load_u32_from_u16s(block + 128 + 32 * h + b);
            }
#pragma unroll
        for (int k = 0; k < 4; ++k) raw.sc[k] = load_u32_from_u16s(block + 192 + 4 * k);
        raw.d = load_u16(block + 208);
        return raw;
    }
    static __device__ __forceinline__ u32 step_quants(const Raw& raw, int s) {
        const int hi = ((s >> 3) << 1) | (s & 1), r = (s >> 1) & 3;
        const u32 low = (r & 1) ? raw.ql_b[hi] : raw.ql_a[hi];
        const u32 nibbles = ((r & 2) ? low >> 4 : low) & 0x0F0F0F0Fu;
        const u32 qh = raw.qh[hi];
        const u32 top = (r == 0 ? qh << 4 : r == 1 ? qh << 2 : r == 2 ? qh : qh >> 2) & 0x30303030u;
        return nibbles | top;
    }
    static __device__ __forceinline__ int step_column(int s, int t) {
        return 128 * (s >> 3) + 32 * ((s >> 1) & 3) + 16 * (s & 1) + 4 * t;
    }
    static __device__ __forceinline__ void scales(const Raw& raw, float& d, float& dmin) {
        d = half_bits_to_float(raw.d);
        dmin = 0.0f;
    }
    // int8 scales with the sign bit flipped (q + 128, unsigned), 4 per word.
    struct Groups { u32 sc[4]; };
    static __device__ __forceinline__ Groups groups(const Raw& raw) {
        Groups g;
#pragma unroll
        for (int k = 0; k < 4; ++k) g.sc[k] = raw.sc[k] ^ 0x80808080u;
        return g;
    }
    // Group of step s: scales[8h + 2r + i] = index s (the step order is the scale order). d * scale, exactly: the
    // unsigned byte's product less 128 d (both exact, and so is their difference).
    static __device__ __forceinline__ void group(const Groups& g, int s, float d, float, float& d_scale,
                                                 float& dmin_min) {
        d_scale = byte_times(g.sc[s >> 2], s & 3, d) - 128.0f * d;
        dmin_min = 0.0f;
    }
};

typedef MmaQ4K Mma_q4_k;
typedef MmaQ5K Mma_q5_k;
typedef MmaQ6K Mma_q6_k;
