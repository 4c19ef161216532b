// The portability layer between the CUDA (NVRTC) and HIP (hiprtc) builds of the shared kernel sources
// (common.cuh, gguf_blocks.cuh, matvec_body.cuh, matvec.cu, moe_matvec.cu, dequant.cu, rms_norm.cu).
// Everything a kernel needs that the two toolchains spell differently is here; the kernels themselves use
// only what both compilers accept as written (threadIdx, __syncthreads, fmaf, rsqrtf, __uint_as_float,
// __launch_bounds__, float4/uint4 ...).
//
// Three builds:
//   - CUDA (NVRTC, no headers): 16-bit conversions through PTX `cvt`, warp shuffles with `_sync`;
//   - HIP (hiprtc, or clang -x hip with hip_runtime.h): the generic arithmetic below, wave shuffles;
//   - CUDA with LUCEBOX_PORTABLE_GENERIC defined: the HIP build's arithmetic compiled by NVRTC, so that the
//     code an AMD card runs is checked against the torch reference on an NVIDIA GPU
//     (scripts/hip_shared_source_check.py).
//
// Warps: the kernels are written for a *logical* warp of 32 lanes (`threadIdx.x >> 5`, `& 31`, xor shuffles
// of offsets 16..1). On RDNA (gfx10+, HIP's default wave32) that is the hardware wave. On a wave64 device
// (CDNA) a wave holds two logical warps, and a shuffle of width 32 stays inside its half, so the result is
// the same; LUCEBOX_HW_WAVE says which the device has.
#pragma once

#if defined(__HIPCC__) || defined(__HIPCC_RTC__) || defined(__HIP_DEVICE_COMPILE__)
#define LUCEBOX_HIP 1
#else
#define LUCEBOX_HIP 0
#endif

#if LUCEBOX_HIP || defined(LUCEBOX_PORTABLE_GENERIC)
#define LUCEBOX_GENERIC_ARITHMETIC 1
#else
#define LUCEBOX_GENERIC_ARITHMETIC 0
#endif

#define LUCEBOX_WARP 32
#if LUCEBOX_HIP && defined(__AMDGCN_WAVEFRONT_SIZE)
#define LUCEBOX_HW_WAVE __AMDGCN_WAVEFRONT_SIZE
#elif LUCEBOX_HIP
#define LUCEBOX_HW_WAVE 64  // the host pass of clang -x hip, which compiles no kernel
#else
#define LUCEBOX_HW_WAVE 32
#endif
static_assert(LUCEBOX_HW_WAVE % LUCEBOX_WARP == 0, "a hardware wave must hold whole logical warps");

// -- warp reduction step ------------------------------------------------------------------------------

__device__ __forceinline__ float lucebox_shfl_xor(float v, int offset) {
#if LUCEBOX_HIP
    return __shfl_xor(v, offset, LUCEBOX_WARP);  // width 32: a wave64 reduces its two halves apart
#else
    return __shfl_xor_sync(0xFFFFFFFFu, v, offset);
#endif
}

// -- 16-bit floats, as raw bits -----------------------------------------------------------------------
//
// The generic conversions are exact integer and fp32 arithmetic, bit for bit what PTX `cvt` gives
// (round to nearest even, subnormals kept, overflow to infinity, NaN to the canonical 0x7FFF), so an f16 or
// bf16 activation holds the same bits whichever build wrote it.

__device__ __forceinline__ float lucebox_half_bits_to_float(unsigned short bits) {
#if LUCEBOX_GENERIC_ARITHMETIC
    const unsigned int magnitude = (bits & 0x7FFFu) << 13;
    // Scaling by 2^112 moves the exponent from fp16's bias to fp32's, exactly, subnormals included.
    float value = __uint_as_float(magnitude) * 5.192296858534828e+33f;
    if ((bits & 0x7C00u) == 0x7C00u) value = __uint_as_float(magnitude | 0x7F800000u);  // inf, NaN
    return __uint_as_float(__float_as_uint(value) | (static_cast<unsigned int>(bits & 0x8000u) << 16));
#else
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
    return out;
#endif
}

__device__ __forceinline__ unsigned short lucebox_float_to_half_bits(float v) {
#if LUCEBOX_GENERIC_ARITHMETIC
    unsigned int x = __float_as_uint(v);
    const unsigned int sign = (x >> 16) & 0x8000u;
    x &= 0x7FFFFFFFu;
    if (x > 0x7F800000u) return 0x7FFFu;  // NaN, without its sign, as `cvt` gives it
    unsigned int out;
    if (x >= 0x477FF000u) {
        out = 0x7C00u;  // 65520 and above round to infinity
    } else if (x < 0x38800000u) {
        // Below fp16's smallest normal: adding 0.5 (whose ulp is 2^-24, fp16's subnormal step) rounds the
        // value to a multiple of 2^-24 with the FPU's round-to-nearest-even; the mantissa is the result.
        out = __float_as_uint(__uint_as_float(x) + 0.5f) - 0x3F000000u;
    } else {
        // Re-bias the exponent (-112 << 23) and round the 13 dropped bits to nearest even; a carry moves into
        // the exponent as it should.
        out = (x + 0xC8000FFFu + ((x >> 13) & 1u)) >> 13;
    }
    return static_cast<unsigned short>(out | sign);
#else
    unsigned short out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(v));
    return out;
#endif
}

__device__ __forceinline__ unsigned short lucebox_float_to_bf16_bits(float v) {
#if LUCEBOX_GENERIC_ARITHMETIC
    const unsigned int x = __float_as_uint(v);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;  // NaN
    return static_cast<unsigned short>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);  // nearest even
#else
    unsigned short out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(v));
    return out;
#endif
}

// -- programmatic dependent launch (lucebox_cuda/pdl.py) ------------------------------------------------
//
// Launched with PDL, a kernel may start while the kernel ahead of it on the stream is still running. It calls
// this before it reads anything an earlier kernel wrote, and before it writes anything an earlier kernel may
// still read: the wait returns once that kernel has finished and its writes are visible (at once when the
// launch was a plain one). Then it lets the next kernel launch early. Every kernel of these sources calls it
// (the matrix-vector bodies after their first weight loads, which no kernel writes), so any of their launches
// may carry the attribute. Hopper's instructions: a no-op below sm_90 and on HIP.
__device__ __forceinline__ void lucebox_wait_prior_grid() {
#if !LUCEBOX_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
