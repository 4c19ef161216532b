"""Lucebox's AMD backend: the CUDA backend's shared kernel sources built with hiprtc for the device's gfx target."""

__all__: list[str] = []
