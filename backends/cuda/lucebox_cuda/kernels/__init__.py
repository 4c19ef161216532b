"""CUDA C++ kernel sources (read as package data and compiled with NVRTC; see `lucebox_cuda.nvrtc`)."""
