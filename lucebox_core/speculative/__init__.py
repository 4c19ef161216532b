"""Speculative decoding: the decoder that binds a drafter and a verifier to a target, DFlash, chain and DDTree
verification, lossless acceptance."""

from .loop import (
    ForcedStep,
    SpeculativeBlock,
    SpeculativeDecoder,
    TreeVerifier,
    Verdict,
    forced_accept_counts,
)

__all__ = ["ForcedStep", "SpeculativeBlock", "SpeculativeDecoder", "TreeVerifier", "Verdict", "forced_accept_counts"]
