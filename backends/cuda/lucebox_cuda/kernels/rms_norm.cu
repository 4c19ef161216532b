// RMSNorm over the last dimension in one pass over memory: y = x * rsqrt(mean(x^2) + eps) * w, in fp32,
// stored in x's dtype (the reference's order: normalise, then scale, then round once).
//
// LUCEBOX_RMS_NORM(activation, weight) defines `rms_norm_<activation>_<weight>`: one block per row, any
// block size that is a multiple of 32 up to 1024.
#include "common.cuh"

template <class X, class Wt>
__device__ __forceinline__ void rms_norm_body(const X* __restrict__ x, const Wt* __restrict__ weight,
                                              X* __restrict__ y, int n, float eps) {
    __shared__ float partial[32];
    lucebox_wait_prior_grid();
    const X* row_in = x + static_cast<i64>(blockIdx.x) * n;
    X* row_out = y + static_cast<i64>(blockIdx.x) * n;

    float squares = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = to_float(row_in[i]);
        squares = fmaf(v, v, squares);
    }
    squares = warp_sum(squares);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = squares;
    __syncthreads();
    if (warp == 0) {
        float total = lane < warps ? partial[lane] : 0.0f;
        total = warp_sum(total);
        if (lane == 0) partial[0] = total;
    }
    __syncthreads();
    const float inverse_rms = rsqrtf(partial[0] / static_cast<float>(n) + eps);

    for (int i = threadIdx.x; i < n; i += blockDim.x)
        row_out[i] = from_float<X>((to_float(row_in[i]) * inverse_rms) * to_float(weight[i]));
}

#define LUCEBOX_RMS_NORM(ACT, WEIGHT)                                                                    \
    extern "C" __global__ void rms_norm_##ACT##_##WEIGHT(const ACT* __restrict__ x,                      \
                                                         const WEIGHT* __restrict__ weight,              \
                                                         ACT* __restrict__ y, int n, float eps) {        \
        rms_norm_body<ACT, WEIGHT>(x, weight, y, n, eps);                                               \
    }
