"""Lucebox CUDA backend: GGUF-native kernels for NVIDIA GPUs, compiled at run time with NVRTC.

Importing this package is cheap and touches no GPU; `lucebox_cuda.backend` holds the ops.
"""

__version__ = "0.1.0"
