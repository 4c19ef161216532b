"""The hooks `lucebox-cuda` implements. Listing plugins imports only this module and probes cheaply."""

from __future__ import annotations

import importlib.util

from lucebox_core import KernelBackend, hookimpl

# Compute capability the kernels need: bf16 conversions (`cvt.rn.bf16.f32`) arrived with sm_80.
MIN_CAPABILITY = (8, 0)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of returning None
        return False


def availability() -> tuple[bool, str]:
    """Whether this process can run the CUDA kernels, and if not, why (never raises)."""
    if not _installed("cuda.bindings"):
        return False, "cuda-python is not installed (pip install cuda-bindings nvidia-cuda-nvrtc)"
    if not _installed("torch"):
        return False, "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        return False, f"no CUDA GPU visible to torch {torch.__version__} ({built_for})"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return False, (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}; "
                       f"the kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    try:
        from .nvrtc import nvrtc_version

        nvrtc_version()
    except Exception as exc:  # the NVRTC library itself is missing or broken
        return False, f"NVRTC cannot be loaded: {exc} (pip install nvidia-cuda-nvrtc)"
    return True, ""


@hookimpl
def lucebox_kernel_backends():
    return [
        KernelBackend(
            name="cuda",
            factory="lucebox_cuda.backend:CudaBackend",
            priority=100,  # above torch (0): chosen whenever a usable NVIDIA GPU is present
            availability=availability,
            description="GGUF-native CUDA kernels (NVRTC-compiled for the device's sm_XY); torch ops elsewhere",
        )
    ]
