"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one ahead of it on the stream
is still finishing, and waits for that kernel's writes only where it first needs them.

Why: a decode step is hundreds of small kernels (Laguna-XS.2: ~520 a token on the H200, most of them 1-10 us),
and each pays its launch, its blocks' start and its first memory latency after the previous one has drained.
With PDL the next kernel's blocks are already resident and past their prologue when the previous kernel ends;
the matrix-vector kernels even have their first weight blocks in flight, since weights never depend on the
previous kernel (`lucebox_wait_prior_grid` sits after those loads in `matvec_mma_body.cuh`).

The contract, for every kernel launched with the attribute: it executes `griddepcontrol.wait` (NVRTC kernels:
`lucebox_wait_prior_grid()` in `portable.cuh`; Triton kernels: `triton_ops.grid_dependency` under their `PDL`
constexpr) before it reads anything an earlier kernel wrote and before it writes anything an earlier kernel
may still read; and it lets the next kernel launch early (`griddepcontrol.launch_dependents`). Only the launches
that go through `nvrtc.launch(pdl=True)` or pass `triton_options()` carry the attribute, and only kernels
written to that contract do. Torch's own kernels (copies, sampling) launch as usual and serialise as usual.

Used only by launches inside a static step (`lucebox_core.static_step.inside_static_step`: the decode step and
the verify pass, whose hundreds of small kernels it is for; in their warm-up as in their recording, so that
the recording finds every kernel variant built and loaded), on devices of compute capability 9.0 or more with
the CUDA toolkit's PTX (never on the CPU, where Triton's interpreter runs, nor on a ROCm build);
`LUCEBOX_PDL=0` switches it off (an A/B switch).
Session 22 on the H200 (Laguna-XS.2 Q4_K_M, tg128): 337 -> 362 tok/s; as shipped, inside static steps (session
23): 315.6 -> 344.9 on Laguna-XS.2, 287.6 -> 329.1 on the 35B-A3B, 100.2 -> 105.8 on the 27B; every family's
decode step and verify pass to the bit as without it (tests/test_fused_decode_gpu.py). Not in a prefill: its
large kernels lost to it (pp512 6521 -> 4425 tok/s), the next kernel's early blocks holding SMs while the tail
of the one ahead ran.
"""

from __future__ import annotations

import functools
import os

import torch

from lucebox_core.static_step import inside_static_step

ENV_SWITCH = "LUCEBOX_PDL"
MIN_CAPABILITY = (9, 0)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def enabled(device: torch.device) -> bool:
    """Whether a launch on `device` now uses PDL: not switched off, inside a static step, a CUDA (not ROCm)
    device of capability 9.0+."""
    if (os.environ.get(ENV_SWITCH, "1") != "1" or device.type != "cuda" or getattr(torch.version, "hip", None)
            or not inside_static_step()):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def triton_options(tensor: torch.Tensor) -> dict[str, bool]:
    """A Triton launch's PDL arguments for a kernel on `tensor`'s device: its `PDL` constexpr (the wait and the
    early trigger compiled in) and Triton's `launch_pdl` option, together or not at all."""
    if enabled(tensor.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
