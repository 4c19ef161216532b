"""How fast the GPU reads pinned host memory (zero-copy, as Spark's paged kernels read a missed expert),
against the copy engine (`cudaMemcpyAsync` host -> device) and against device memory, by bytes, blocks and
loads in flight per thread.

Spark's misses are read inside the expert products at ~25 GB/s (session 19's profile); this finds what the
bus gives a kernel shaped for it, to decide whether a miss should be read by more blocks, by wider loads in
flight, or staged first by a copy kernel. Run on the GPU machine:

    python3 scripts/zero_copy_probe.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
from lucebox_cuda import nvrtc
from lucebox_cuda.timing import median_ms

SOURCE = r"""
typedef unsigned long long u64;
// Each thread keeps UNROLL 16-byte loads in flight; a block reads a contiguous chunk of `chunk` 16-byte words
// (as a product's block reads its rows), grid-stride over chunks.
template <int UNROLL>
__device__ void read_chunks(const uint4* __restrict__ src, u64 words, u64 chunk, unsigned* sink) {
    unsigned acc = 0;
    for (u64 start = blockIdx.x * chunk; start < words; start += (u64)gridDim.x * chunk) {
        u64 end = start + chunk < words ? start + chunk : words;
        for (u64 i = start + threadIdx.x; i < end; i += (u64)blockDim.x * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                u64 j = i + (u64)u * blockDim.x;
                v[u] = j < end ? src[j] : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // never true in practice; keeps the loads
}
extern "C" __global__ void read1(const uint4* s, u64 w, u64 c, unsigned* k) { read_chunks<1>(s, w, c, k); }
extern "C" __global__ void read4(const uint4* s, u64 w, u64 c, unsigned* k) { read_chunks<4>(s, w, c, k); }
extern "C" __global__ void read8(const uint4* s, u64 w, u64 c, unsigned* k) { read_chunks<8>(s, w, c, k); }
// Copy with the same shape: host chunk -> device (a staging kernel for missed experts).
extern "C" __global__ void copy8(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 words, u64 chunk) {
    for (u64 start = blockIdx.x * chunk; start < words; start += (u64)gridDim.x * chunk) {
        u64 end = start + chunk < words ? start + chunk : words;
        for (u64 i = start + threadIdx.x; i < end; i += (u64)blockDim.x * 8) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) { u64 j = i + (u64)u * blockDim.x; if (j < end) v[u] = src[j]; }
#pragma unroll
            for (int u = 0; u < 8; ++u) { u64 j = i + (u64)u * blockDim.x; if (j < end) dst[j] = v[u]; }
        }
    }
}
"""


class ProbeProgram:
    """A `KernelProgram` look-alike for `nvrtc.compile_program`: this file's source, no headers."""

    file = "zero_copy_probe.cu"

    def source(self) -> str:
        return SOURCE

    def headers(self) -> dict[str, str]:
        return {}


def timed(run, reps: int) -> float:
    """Median milliseconds of `run()` over `reps`, after two warm-ups at the same shape."""
    run()
    return median_ms(run, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()

    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    module = nvrtc.CudaModule(nvrtc.compile_program(ProbeProgram(), f"sm_{major}{minor}"), device.index or 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    arena = 1 << 30  # reads rotate through 1 GiB so no read finds the previous one's lines in L2
    host = torch.empty(arena, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(arena, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    staging = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    sink = torch.zeros(4, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream().cuda_stream
    rows, offset = [], [0]

    def region(nbytes: int) -> int:
        offset[0] = (offset[0] + nbytes + 4096) % (arena - nbytes)
        return offset[0] - offset[0] % 256

    def kernel_run(name, base, nbytes, blocks, chunk_bytes, dst=None):
        fn = module.function(name)
        words, chunk = nbytes // 16, chunk_bytes // 16

        def run():
            at = region(nbytes)
            src = nvrtc.Pointer(base + at)
            extra = [nvrtc.Pointer(dst.data_ptr())] if dst is not None else []
            tail = [] if dst is not None else [nvrtc.Pointer(sink.data_ptr())]
            nvrtc.launch(fn, blocks, 256, [src, *extra, nvrtc.Int64(words), nvrtc.Int64(chunk), *tail],
                         stream=stream)
        return run

    for nbytes in (2 << 20, 12 << 20, 28 << 20):
        ms = timed(lambda: staging[:nbytes].copy_(host[region(nbytes):][:nbytes], non_blocking=True), args.reps)
        rows.append({"what": "memcpy H2D (copy engine)", "MiB": nbytes >> 20, "ms": ms, "GB_s": nbytes / ms / 1e6})
        for name in ("read1", "read4", "read8"):
            for blocks in (32, 64, sms, 2 * sms, 4 * sms):
                chunk = max(4096, -(-nbytes // blocks))
                ms = timed(kernel_run(name, host.data_ptr(), nbytes, blocks, chunk), args.reps)
                rows.append({"what": f"zero-copy {name}", "MiB": nbytes >> 20, "blocks": blocks, "ms": ms,
                             "GB_s": nbytes / ms / 1e6})
        for blocks in (sms, 2 * sms, 4 * sms):
            chunk = max(4096, -(-nbytes // blocks))
            ms = timed(kernel_run("copy8", host.data_ptr(), nbytes, blocks, chunk, dst=staging), args.reps)
            rows.append({"what": "copy kernel host->device", "MiB": nbytes >> 20, "blocks": blocks, "ms": ms,
                         "GB_s": nbytes / ms / 1e6})
        ms = timed(kernel_run("read8", dev.data_ptr(), nbytes, 2 * sms, max(4096, -(-nbytes // (2 * sms)))),
                   args.reps)
        rows.append({"what": "device read8", "MiB": nbytes >> 20, "blocks": 2 * sms, "ms": ms,
                     "GB_s": nbytes / ms / 1e6})
    for row in rows:
        print(f"{row['what']:28s} {row['MiB']:4d} MiB  blocks {row.get('blocks', '-')!s:>4}  "
              f"{row['ms'] * 1e3:8.1f} us  {row['GB_s']:7.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
