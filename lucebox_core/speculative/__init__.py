"""Speculative decoding: DFlash drafter, chain and DDTree verification, lossless acceptance."""

from .loop import (
    SPEC_TYPES,
    ForcedStep,
    SpeculativeBlock,
    SpeculativeDecoder,
    forced_accept_counts,
)

__all__ = ["SPEC_TYPES", "ForcedStep", "SpeculativeBlock", "SpeculativeDecoder", "forced_accept_counts"]
