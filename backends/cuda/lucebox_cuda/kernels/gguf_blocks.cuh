// GGUF weight formats, decoded a "piece" at a time: VALUES weights of one row that one thread turns into
// fp32 in registers. A piece is `RUNS` runs of `RUN` consecutive columns; the weights of a run share one
// affine map `value = scale * q - min`, so a dot product with activations needs only
// `scale * dot(q, x) - min * sum(x)` per run.
//
// Pieces are numbered so that the 32 lanes of a warp, taking consecutive pieces, read consecutive bytes
// (coalesced), with the widest loads each format's alignment allows. Quantized integers become floats
// through `small_uint_to_float` (integer and FMA units) rather than the slow conversion unit.
// Layouts follow gguf's reference (`gguf/quants.py`, ggml-quants.c).
#pragma once
#include "common.cuh"

template <int RUNS, int RUN> struct Piece {
    float q[RUNS * RUN];
    float scale[RUNS];
    float min[RUNS];
    int col[RUNS];  // first column of each run, relative to the block's first value
};

// The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes shared by Q4_K and Q5_K, read as
// three little-endian words (shifts by a run-time amount stay in registers; byte arrays would not).
// Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 keep their low
// 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in the top bits of
// bytes 0-3 (scales) and 4-7 (mins).
__device__ __forceinline__ void k_scale_min(const u8* packed, int j, float& scale, float& min) {
    const u32 w0 = *reinterpret_cast<const u32*>(packed);
    const u32 w1 = *reinterpret_cast<const u32*>(packed + 4);
    const u32 w2 = *reinterpret_cast<const u32*>(packed + 8);
    const int shift = 8 * (j & 3);
    const u32 b0 = (w0 >> shift) & 0xFF, b1 = (w1 >> shift) & 0xFF;
    u32 s, m;
    if (j < 4) {
        s = b0 & 63;
        m = b1 & 63;
    } else {
        const u32 b2 = (w2 >> shift) & 0xFF;
        s = (b2 & 0x0F) | ((b0 >> 6) << 4);
        m = (b2 >> 4) | ((b1 >> 6) << 4);
    }
    scale = small_uint_to_float<0>(s);
    min = small_uint_to_float<0>(m);
}

// Q4_K: 144 bytes for 256 values: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles.
// Byte b of the 32-byte chunk c holds value b of sub-block 2c (low nibble) and of 2c+1 (high nibble).
// Piece i: 16 bytes (one 16-byte load) of chunk i/2 -> 16 values of each of the two sub-blocks.
struct W_q4_k {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 144, PIECES = 8, RUNS = 2, RUN = 16;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void decode(const u8* block, int piece, Piece<RUNS, RUN>& out) {
        const int chunk = piece >> 1, first = (piece & 1) * 16;
        const u32 packed = *reinterpret_cast<const u32*>(block);
        const float d = half_bits_to_float(static_cast<u16>(packed & 0xFFFFu));
        const float dmin = half_bits_to_float(static_cast<u16>(packed >> 16));
        const uint4 bytes = *reinterpret_cast<const uint4*>(block + 16 + chunk * 32 + first);
        const u32 words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                out.q[4 * w + k] = small_uint_to_float<0>((words[w] >> (8 * k)) & 0x0F);
                out.q[16 + 4 * w + k] = small_uint_to_float<0>((words[w] >> (8 * k + 4)) & 0x0F);
            }
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            float scale, min;
            k_scale_min(block + 4, 2 * chunk + run, scale, min);
            out.scale[run] = d * scale;
            out.min[run] = dmin * min;
            out.col[run] = chunk * 64 + run * 32 + first;
        }
    }
};

// Q5_K: 176 bytes: fp16 d, fp16 dmin, 12 bytes of scales/mins, 32 bytes qh, 128 bytes of nibbles laid
// out as in Q4_K. The fifth bit of value b of sub-block j is bit j of qh[b].
struct W_q5_k {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 176, PIECES = 8, RUNS = 2, RUN = 16;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void decode(const u8* block, int piece, Piece<RUNS, RUN>& out) {
        const int chunk = piece >> 1, first = (piece & 1) * 16;
        const u32 packed = *reinterpret_cast<const u32*>(block);
        const float d = half_bits_to_float(static_cast<u16>(packed & 0xFFFFu));
        const float dmin = half_bits_to_float(static_cast<u16>(packed >> 16));
        const uint4 bytes = *reinterpret_cast<const uint4*>(block + 48 + chunk * 32 + first);
        const uint4 high = *reinterpret_cast<const uint4*>(block + 16 + first);
        const u32 words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
        const u32 high_words[4] = {high.x, high.y, high.z, high.w};
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 h = high_words[w] >> (8 * k);
                out.q[4 * w + k] =
                    small_uint_to_float<0>(((words[w] >> (8 * k)) & 0x0F) | (((h >> (2 * chunk)) & 1) << 4));
                out.q[16 + 4 * w + k] =
                    small_uint_to_float<0>(((words[w] >> (8 * k + 4)) & 0x0F) | (((h >> (2 * chunk + 1)) & 1) << 4));
            }
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            float scale, min;
            k_scale_min(block + 4, 2 * chunk + run, scale, min);
            out.scale[run] = d * scale;
            out.min[run] = dmin * min;
            out.col[run] = chunk * 64 + run * 32 + first;
        }
    }
};

// Q6_K: 210 bytes: 128 bytes ql (low nibbles), 64 bytes qh (2-bit tops), 16 int8 scales, fp16 d.
// Two halves of 128 values; in half h, for b in 0..31: value b uses low(ql[b]) and qh[b] bits 0-1,
// value 32+b low(ql[32+b]) and bits 2-3, value 64+b high(ql[b]) and bits 4-5, value 96+b high(ql[32+b])
// and bits 6-7; q is 6 bits minus 32, and value v of the half has scale scales[8h + v/16].
// Piece i: half i/8, bytes b = 4(i%8) .. b+3 -> 4 values in each of the four rows.
// Blocks are only 2-byte aligned: every load here is 16 bits.
struct W_q6_k {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210, PIECES = 16, RUNS = 4, RUN = 4;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void decode(const u8* block, int piece, Piece<RUNS, RUN>& out) {
        const int half = piece >> 3, first = (piece & 7) * 4;
        const u8* ql = block + half * 64;
        const u8* qh = block + 128 + half * 32;
        const i8* scales = reinterpret_cast<const i8*>(block + 192 + half * 8);
        const float d = half_bits_to_float(load_u16(block + 208));
        const u32 low_a = load_u32_from_u16s(ql + first), low_b = load_u32_from_u16s(ql + 32 + first);
        const u32 high = load_u32_from_u16s(qh + first);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 a = (low_a >> (8 * k)) & 0xFF, b = (low_b >> (8 * k)) & 0xFF, h = (high >> (8 * k)) & 0xFF;
            out.q[0 + k] = small_uint_to_float<32>((a & 0x0F) | ((h & 3) << 4));
            out.q[4 + k] = small_uint_to_float<32>((b & 0x0F) | (((h >> 2) & 3) << 4));
            out.q[8 + k] = small_uint_to_float<32>((a >> 4) | (((h >> 4) & 3) << 4));
            out.q[12 + k] = small_uint_to_float<32>((b >> 4) | (((h >> 6) & 3) << 4));
        }
#pragma unroll
        for (int row = 0; row < 4; ++row) {
            out.scale[row] = d * static_cast<float>(scales[2 * row + first / 16]);
            out.min[row] = 0.0f;
            out.col[row] = half * 128 + row * 32 + first;
        }
    }
};

// Q8_0: 34 bytes for 32 values: fp16 d, 32 int8. Piece i: values 8i..8i+7 (2-byte aligned loads).
struct W_q8_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34, PIECES = 4, RUNS = 1, RUN = 8;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void decode(const u8* block, int piece, Piece<RUNS, RUN>& out) {
        const u8* q = block + 2 + piece * 8;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            // Flipping the sign bit maps int8 q to the unsigned q + 128.
            const u32 word = load_u32_from_u16s(q + 4 * k) ^ 0x80808080u;
#pragma unroll
            for (int b = 0; b < 4; ++b) out.q[4 * k + b] = small_uint_to_float<128>((word >> (8 * b)) & 0xFF);
        }
        out.scale[0] = half_bits_to_float(load_u16(block));
        out.min[0] = 0.0f;
        out.col[0] = piece * 8;
    }
};

// Q5_0: 22 bytes for 32 values: fp16 d, 4 bytes of high bits (bit j: the fifth bit of value j), 16 bytes of
// nibbles (byte j: value j low, value 16 + j high); value = d * (q - 16). Blocks are only 2-byte aligned,
// so every load is made of 16-bit ones. Piece i: 8 nibbles of half i / 2 (low or high) from bytes
// 8 * (i % 2) .. + 7 -> values 16 * (i / 2) + 8 * (i % 2) .. + 7. (llama.cpp's fallback for Q4_K rows that
// are not a multiple of 256, e.g. Gemma-4-26B-A4B's 704-wide expert down products.)
struct W_q5_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 22, PIECES = 4, RUNS = 1, RUN = 8;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void decode(const u8* block, int piece, Piece<RUNS, RUN>& out) {
        const int half = piece >> 1, part = piece & 1;
        const u32 high = load_u32_from_u16s(block + 2) >> (16 * half + 8 * part);
        const u8* qs = block + 6 + 8 * part;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const u32 word = load_u32_from_u16s(qs + 4 * k);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 nibble = (word >> (8 * b + 4 * half)) & 0x0F;
                const u32 fifth = (high >> (4 * k + b)) & 1;
                out.q[4 * k + b] = small_uint_to_float<16>(nibble | (fifth << 4));
            }
        }
        out.scale[0] = half_bits_to_float(load_u16(block));
        out.min[0] = 0.0f;
        out.col[0] = 16 * half + 8 * part;
    }
};

// Plain float weights: a "block" of 8 values, one 16- or 32-byte load.
template <typename T> struct FloatWeights {
    static constexpr int BLOCK_VALUES = 8, BLOCK_BYTES = 8 * sizeof(T), PIECES = 1, RUNS = 1, RUN = 8;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void decode(const u8* block, int, Piece<RUNS, RUN>& out) {
        ActivationLoad<T, 8>::load(reinterpret_cast<const T*>(block), out.q);
        out.scale[0] = 1.0f;
        out.min[0] = 0.0f;
        out.col[0] = 0;
    }
};
typedef FloatWeights<f32> W_f32;
typedef FloatWeights<f16> W_f16;
typedef FloatWeights<bf16> W_bf16;
