"""The hooks `lucebox-hip` implements. Listing plugins imports only this module and probes cheaply: hip-python
is looked up, never imported, until the probe has a ROCm device in hand."""

from __future__ import annotations

import importlib.util
import os

from lucebox_core import KernelBackend, OpKernel, hookimpl
from lucebox_cuda.plugin import COMMIT_KERNEL_OPS, FAMILY_KERNEL_OPS, GENERIC_KERNEL_OPS, NORM_KERNEL_OPS

# The gfx families the shared sources are compile-checked for in CI (RDNA3 gfx110x, RDNA3.5 gfx115x, RDNA4
# gfx120x; wave32). Another target (CDNA's wave64, RDNA2) may well work, the kernels being written for
# 32-lane logical warps, but nothing checks it: LUCEBOX_HIP_ANY_TARGET=1 lets it run anyway.
SUPPORTED_FAMILIES = ("gfx11", "gfx12")
ANY_TARGET_ENV = "LUCEBOX_HIP_ANY_TARGET"
# The ops whose kernel is one of the shared sources built by hiprtc (the others are Triton kernels).
HIPRTC_OPS = ("linear", "embedding", "fuse_rows", "rms_norm", "moe_experts")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of returning None
        return False


def availability() -> tuple[bool, str]:
    """Whether this process can run the HIP kernels, and if not, why (never raises)."""
    if not _installed("hip"):
        return False, "hip-python is not installed (pip install hip-python, the version of your ROCm)"
    if not _installed("torch"):
        return False, "torch is not installed"
    import torch

    if not getattr(torch.version, "hip", None):
        built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        return False, f"torch {torch.__version__} is not a ROCm build ({built_for}); AMD GPUs need torch's ROCm wheels"
    if not torch.cuda.is_available():
        return False, f"no AMD GPU visible to torch {torch.__version__} (HIP {torch.version.hip}); check HIP_VISIBLE_DEVICES"
    from .backend import device_target

    target = device_target(torch.device("cuda", torch.cuda.current_device()))
    if not target.startswith(SUPPORTED_FAMILIES) and os.environ.get(ANY_TARGET_ENV) != "1":
        return False, (f"{torch.cuda.get_device_name()} is {target}; the kernels are checked for "
                       f"{', '.join(f + 'xx' for f in SUPPORTED_FAMILIES)} ({ANY_TARGET_ENV}=1 runs them anyway)")
    try:
        from .hiprtc import hiprtc_version

        hiprtc_version()
    except Exception as exc:  # libhiprtc missing, or a hip-python built for another ROCm
        return False, f"hiprtc cannot be loaded: {exc} (install ROCm's hiprtc, and hip-python of the same version)"
    return True, ""


@hookimpl
def lucebox_kernel_backends():
    return [
        KernelBackend(
            name="hip",
            factory="lucebox_hip.backend:HipBackend",
            priority=100,  # above torch (0); the cuda backend steps aside on a ROCm build of torch
            availability=availability,
            description="GGUF kernels shared with the cuda backend, hiprtc-compiled for the device's gfx target; "
                        "Triton where it supports the card; torch ops elsewhere",
        )
    ]


@hookimpl
def lucebox_op_kernels():
    """The cuda backend's op kernels, every one: the same functions, on a `HipBackend` (whose launches go through
    HIP). The Triton ones take `lucebox_hip.op_kernels`' accept checks, which LUCEBOX_HIP_TRITON=0 turns off."""
    records = []
    for op in GENERIC_KERNEL_OPS + FAMILY_KERNEL_OPS + NORM_KERNEL_OPS + COMMIT_KERNEL_OPS:
        module = ("lucebox_cuda.norm_kernels" if op in NORM_KERNEL_OPS else
                  "lucebox_cuda.triton_commit" if op in COMMIT_KERNEL_OPS else "lucebox_cuda.op_kernels")
        shared = op in HIPRTC_OPS
        records.append(OpKernel(
            op=op, backend="hip", kernel=f"{module}:{op}",
            accepts=f"{module}:accepts_{op}" if shared else f"lucebox_hip.op_kernels:accepts_{op}",
            description="hiprtc: the shared GGUF kernels" if shared else "Triton"))
    return records
