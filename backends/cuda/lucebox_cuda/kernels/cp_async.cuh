// Asynchronous global -> shared copies (cp.async, sm_80 and later) and the shared-memory layout of a
// streamed GGUF block: what the streamed matrix-vector kernels (matvec_pipe.cu, matvec_stream.cu) share.
#pragma once
#include "common.cuh"

__device__ __forceinline__ u32 shared_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// 16 bytes global -> shared, bypassing L1; bytes past `source_bytes` (1..16) are written as zeros.
__device__ __forceinline__ void copy_async_16(u32 destination, const void* source, int source_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(destination), "l"(source),
                 "r"(source_bytes)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` of this thread's committed copy groups are still in flight.
template <int pending> __device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// One row's GGUF block as copied: whole 16-byte chunks. Blocks that are not a multiple of 16 bytes start
// at an even offset 0..14 inside their first chunk, so they need (bytes + 14) rounded up to chunks.
template <class W> struct StreamedBlock {
    static constexpr bool OVERFETCH = W::BLOCK_BYTES % 16 != 0;
    static constexpr int CHUNKS = OVERFETCH ? (W::BLOCK_BYTES + 14 + 15) / 16 : W::BLOCK_BYTES / 16;
    static constexpr int ROW_STRIDE = 16 * CHUNKS;
};
