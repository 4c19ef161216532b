// Shared by every Lucebox CUDA kernel. NVRTC compiles these with no system or toolkit headers at all,
// so the few types and conversions needed are defined here; what CUDA and HIP spell differently (16-bit
// conversions, shuffles) is in portable.cuh, so the HIP backend builds these same sources.
#pragma once
#include "portable.cuh"

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Activation storage types: a kernel templated on one of these reads and writes that dtype and
// computes in fp32. The 16-bit ones are kept as raw bits so that no toolkit header is needed.
typedef float f32;
struct f16 { u16 bits; };
struct bf16 { u16 bits; };

// Spark's routing counts, kept inside the paged expert products: the first block of each routed pair (of the
// first stack, in the pair kernels) adds one to `counts[expert]`, the layer's row of the counts the host reads
// back between steps. In the product's own launch, not a separate one a layer (Laguna-XS.2: 39 launches and
// ~0.11 ms a step on the H200). Null `counts`: nothing counted.
__device__ __forceinline__ void count_routed_pair(unsigned long long* counts, long long expert, bool first) {
    if (counts != nullptr && first && blockIdx.x == 0 && threadIdx.x == 0)
        atomicAdd(counts + expert, 1ull);
}

__device__ __forceinline__ float half_bits_to_float(u16 bits) { return lucebox_half_bits_to_float(bits); }

__device__ __forceinline__ float bf16_bits_to_float(u16 bits) {
    return __uint_as_float(static_cast<u32>(bits) << 16);
}

__device__ __forceinline__ float to_float(f32 v) { return v; }
__device__ __forceinline__ float to_float(f16 v) { return half_bits_to_float(v.bits); }
__device__ __forceinline__ float to_float(bf16 v) { return bf16_bits_to_float(v.bits); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ f32 from_float<f32>(float v) { return v; }
template <> __device__ __forceinline__ f16 from_float<f16>(float v) { return f16{lucebox_float_to_half_bits(v)}; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float v) { return bf16{lucebox_float_to_bf16_bits(v)}; }

// Unaligned-safe little-endian loads of GGUF block fields (blocks of 34 or 210 bytes are only 2-byte
// aligned, so wider loads would fault).
__device__ __forceinline__ u16 load_u16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ u32 load_u32_from_u16s(const u8* p) {
    return static_cast<u32>(load_u16(p)) | (static_cast<u32>(load_u16(p + 2)) << 16);
}

// Exact fp32 value of an unsigned integer below 2^23, minus `bias`, without the conversion unit (I2F runs
// at a quarter of the FMA rate or less and would bound the whole matrix-vector product): the integer is
// placed in the mantissa of 2^23 and 2^23 + bias is subtracted, both exact.
template <int bias> __device__ __forceinline__ float small_uint_to_float(u32 v) {
    return __uint_as_float(0x4B000000u | v) - (8388608.0f + static_cast<float>(bias));
}

// `count` consecutive activations (count 2, 4 or a multiple of 8), widened to fp32 with vector loads: the
// first element's index must be a multiple of `count` (of 8 for larger counts).
template <typename T, int count> struct ActivationLoad;

template <int count> struct ActivationLoad<f32, count> {
    static __device__ __forceinline__ void load(const f32* p, float* out) {
        if (count == 2) {
            float2 v = *reinterpret_cast<const float2*>(p);
            out[0] = v.x; out[1] = v.y;
        } else {
#pragma unroll
            for (int k = 0; k < count; k += 4) {
                float4 v = *reinterpret_cast<const float4*>(p + k);
                out[k] = v.x; out[k + 1] = v.y; out[k + 2] = v.z; out[k + 3] = v.w;
            }
        }
    }
};

template <typename T> __device__ __forceinline__ float bits_to_float(u16 bits);
template <> __device__ __forceinline__ float bits_to_float<f16>(u16 bits) { return half_bits_to_float(bits); }
template <> __device__ __forceinline__ float bits_to_float<bf16>(u16 bits) { return bf16_bits_to_float(bits); }

template <typename T> __device__ __forceinline__ void unpack_pair(u32 word, float* out) {
    out[0] = bits_to_float<T>(static_cast<u16>(word & 0xFFFFu));
    out[1] = bits_to_float<T>(static_cast<u16>(word >> 16));
}

template <typename T, int count> struct HalfActivationLoad {
    static __device__ __forceinline__ void load(const T* p, float* out) {
        if (count == 2) {
            unpack_pair<T>(*reinterpret_cast<const u32*>(p), out);
        } else if (count == 4) {
            uint2 v = *reinterpret_cast<const uint2*>(p);
            unpack_pair<T>(v.x, out); unpack_pair<T>(v.y, out + 2);
        } else {
#pragma unroll
            for (int k = 0; k < count; k += 8) {
                uint4 v = *reinterpret_cast<const uint4*>(p + k);
                unpack_pair<T>(v.x, out + k); unpack_pair<T>(v.y, out + k + 2);
                unpack_pair<T>(v.z, out + k + 4); unpack_pair<T>(v.w, out + k + 6);
            }
        }
    }
};
template <int count> struct ActivationLoad<f16, count> : HalfActivationLoad<f16, count> {};
template <int count> struct ActivationLoad<bf16, count> : HalfActivationLoad<bf16, count> {};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = LUCEBOX_WARP / 2; offset > 0; offset >>= 1) v += lucebox_shfl_xor(v, offset);
    return v;
}
