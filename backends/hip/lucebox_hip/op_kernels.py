"""The accept checks of the Triton op kernels on the hip backend: the cuda backend's own check, behind a switch.

Triton's AMD backend compiles the same kernels for the cards it supports; where it does not (or a Triton
kernel misbehaves on a card no one here could test), `LUCEBOX_HIP_TRITON=0` sends those ops to their torch
references while the hiprtc kernels keep running. `accepts_<op>` for every op in `lucebox_hip.plugin`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lucebox_cuda import norm_kernels, op_kernels
from lucebox_cuda.plugin import COMMIT_KERNEL_OPS, NORM_KERNEL_OPS

TRITON_ENV = "LUCEBOX_HIP_TRITON"


def triton_enabled() -> bool:
    return os.environ.get(TRITON_ENV, "1") != "0"


def __getattr__(name: str) -> Callable[..., bool]:
    op = name.removeprefix("accepts_")
    if op == name:
        raise AttributeError(name)
    if op in COMMIT_KERNEL_OPS:  # imported here: it imports Triton, which listing the plugins must not need
        from lucebox_cuda import triton_commit as module
    else:
        module = norm_kernels if op in NORM_KERNEL_OPS else op_kernels
    check = getattr(module, name)  # AttributeError if no such op

    def accepts(ops: Any, *args: Any, **kwargs: Any) -> bool:
        return triton_enabled() and check(ops, *args, **kwargs)

    accepts.__name__ = accepts.__qualname__ = name
    return accepts
