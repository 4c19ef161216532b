// fp32 operations rounded as Triton 3.x lowers them on NVIDIA GPUs, for kernels that stand in for a Triton
// kernel's arithmetic (ffn_persistent.cu for add + RMSNorm and the SwiGLU, moe_matvec_mma.cu's SwiGLU kinds): a
// value computed here gets the Triton kernel's bits wherever the inputs and the order of operations are the same.
// From the PTX Triton emits for `a * tl.sigmoid(a)` and `1.0 / tl.sqrt(s / n + eps)` on fp32: `/` is
// `div.full.f32`, `tl.sqrt` is `sqrt.approx.ftz.f32`, and `tl.sigmoid(x)` is 1 / (1 + 2^((0 - x) * log2(e))) with
// `ex2.approx.f32`. CUDA's own `/`, `sqrtf` and `expf` are correctly rounded or more accurate, so they differ in
// a last bit now and then, and a bf16 rounding after them may then differ too. NVIDIA only (PTX): not a HIP source.
#pragma once
#include "common.cuh"

__device__ __forceinline__ float triton_div(float a, float b) {
    float out;
    asm("div.full.f32 %0, %1, %2;" : "=f"(out) : "f"(a), "f"(b));
    return out;
}

__device__ __forceinline__ float triton_sqrt(float a) {
    float out;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(a));
    return out;
}

__device__ __forceinline__ float triton_sigmoid(float x) {
    const float scaled = __fmul_rn(__fsub_rn(0.0f, x), 1.4426950408889634f);  // log2(e) as fp32: 0x3FB8AA3B
    float power;
    asm("ex2.approx.f32 %0, %1;" : "=f"(power) : "f"(scaled));
    return triton_div(1.0f, __fadd_rn(power, 1.0f));
}

// silu(g) = g * sigmoid(g), rounded to the activation type X as the SwiGLU kernel rounds it before the product.
template <class X> __device__ __forceinline__ float triton_silu_rounded(float g) {
    return to_float(from_float<X>(__fmul_rn(triton_sigmoid(g), g)));
}

// `tl.exp` on fp32: 2^(x * log2(e)) with `ex2.approx.f32`, as in the sigmoid above.
__device__ __forceinline__ float triton_exp(float x) {
    const float scaled = __fmul_rn(x, 1.4426950408889634f);
    float power;
    asm("ex2.approx.f32 %0, %1;" : "=f"(power) : "f"(scaled));
    return power;
}
