"""The PFlash compressor: a scorer model reads the chat's text and keeps the chunks that matter.

Across tokenizers through text: the scorer's vocabulary differs from every target's, so the pieces (see
`chat_compression`) are tokenized with the scorer's own tokenizer, scored together (the question is at the
end), and each compressible piece is given back as the text of its kept tokens, in order. Protected pieces
are scored as context but never cut, and their chunks are kept whole (`select_spans(protected=...)`).

The scorer is any model with `tail_attention(token_ids, lookahead, sparse=...) -> (queries, keys)`: per scored layer,
the post-RoPE queries of the last `lookahead` tokens `[H, T, d]` and the keys of every token `[H_kv, S, d]`. It is
handed over as such (kept loaded) or as a `scorer_park.ScorerSlot`, which may load it for each compression and
release it before the target's prefill (`from_config` decides which, from the device's free memory).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import torch

from .chat_compression import Piece
from .errors import LuceboxError
from .prefill_compression import CompressionConfig, select_spans, tail_scores


WARM_UP_TOKENS = 64


class PFlashCompressor:
    name = "pflash"

    def __init__(self, scorer: Any, tokenizer: Any, config: CompressionConfig | None = None, *,
                 sparse: Any = None):
        """`scorer`: the model, or a `ScorerSlot` holding it; `sparse`: a `block_sparse.BlockSparseConfig` for
        the scorer's attention over long prompts (FlashPrefill; `--prefill-alpha`), or None for dense attention."""
        from .scorer_park import ScorerResidency, ScorerSlot

        if not isinstance(scorer, ScorerSlot):
            device = str(getattr(getattr(scorer, "ops", None), "device", "cpu"))
            scorer = ScorerSlot(lambda: None, ScorerResidency(parked=False, reason="handed over loaded", device=device),
                                model=scorer)
        self.scorer_slot: ScorerSlot = scorer
        self.tokenizer, self.sparse = tokenizer, sparse
        self.config = config if config is not None else CompressionConfig()

    def compress(self, pieces: list[Piece]) -> list[str]:
        ids: list[int] = []
        ranges = []
        for piece in pieces:
            piece_ids = self.tokenizer.encode(piece.text, add_bos=False) if piece.text else []
            ranges.append((len(ids), len(ids) + len(piece_ids)))
            ids += piece_ids
        if not ids or all(p.protected for p in pieces):
            return [p.text for p in pieces]
        lookahead = min(self.config.lookahead, len(ids))

        def score(scorer: Any) -> torch.Tensor:  # nothing of the scorer's outlives the call (it may be parked)
            queries, keys = scorer.tail_attention(torch.tensor(ids, dtype=torch.long), lookahead, sparse=self.sparse)
            return tail_scores(queries, keys, self.config.pool).cpu()

        scores = self.scorer_slot.run(score)
        protected = [r for r, p in zip(ranges, pieces) if p.protected and r[1] > r[0]]
        kept = select_spans(scores, self.config, token_ids=ids, protected=protected)
        out = []
        for (start, end), piece in zip(ranges, pieces):
            if piece.protected:
                out.append(piece.text)
                continue
            keep = [i for s, e in kept for i in range(max(s, start), min(e, end))]
            out.append(self.tokenizer.decode([ids[i] for i in keep]))
        return out

    def describe(self) -> dict[str, Any]:
        """The scorer's residency and loads (`/props`, `/metrics`)."""
        return self.scorer_slot.describe()


def from_config(config: Any, loaded: Any) -> PFlashCompressor:
    """The builtin `pflash` prefill compressor for a server (`ServeConfig`) over the target `loaded`: the scorer
    from --prefill-drafter, else the one qwen3 GGUF beside the model; a LuceboxError saying what to pass when
    there is none, or when the file's family cannot score. Loaded once here (checked and measured), then kept
    or parked (`scorer_park.decide_residency`; `--prefill-skip-park` keeps it)."""
    from .block_sparse import BlockSparseConfig
    from .context import fit_context, kv_bytes_per_position
    from .loading import load_model
    from .prefill_compression import CompressionConfig, parse_curve
    from .scorer_park import ScorerSlot, decide_residency, scorer_kv_bytes, tensor_bytes

    settings = CompressionConfig(keep_ratio=config.prefill_keep_ratio, curve=parse_curve(config.prefill_curve))
    path = config.prefill_drafter or find_scorer_beside(loaded.path)
    if path is None:
        raise LuceboxError(f"--prefill-compression {config.prefill_compression} needs a scorer: pass --prefill-drafter "
                           f"FILE (a qwen3 GGUF such as Qwen3-0.6B) or put one beside {loaded.path}")
    # What the scorer may use: the device's free memory beside the target's weights, less the KV the target's
    # sequences will take (the engine allocates it per request, so it is not taken yet).
    target_ops = loaded.backend
    context = fit_context(loaded, parallel=getattr(config, "parallel", 1), requested=getattr(config, "ctx_size", None))
    target_kv = (kv_bytes_per_position(loaded.model) or 0) * context.size * getattr(config, "parallel", 1)
    free_bytes = target_ops.free_memory() - target_kv if hasattr(target_ops, "free_memory") else None
    scorer = load_model(path, backend=config.backend, device=config.device)
    if not hasattr(scorer.model, "tail_attention"):
        raise LuceboxError(f"--prefill-drafter {path}: a {scorer.family.name} model cannot score prompts (PFlash "
                           f"needs a model with tail_attention, e.g. the qwen3 family)")
    longest = context.size  # the longest prompt the target takes
    # One short scoring pass first, so the weights a backend dequantizes and keeps are counted as the scorer's.
    warm_up = torch.arange(WARM_UP_TOKENS, dtype=torch.long) % int(scorer.model.vocab_size)
    scorer.model.tail_attention(warm_up, min(settings.lookahead, WARM_UP_TOKENS))
    residency = decide_residency(device=str(getattr(target_ops, "device", "cpu")), free_bytes=free_bytes,
                                 weight_bytes=tensor_bytes(scorer.model),
                                 kv_bytes=scorer_kv_bytes(scorer.model, longest),
                                 skip_park=getattr(config, "prefill_skip_park", False),
                                 force_park=getattr(config, "prefill_force_park", False))

    def load_scorer() -> Any:
        return load_model(path, backend=config.backend, device=config.device).model

    tokenizer = scorer.tokenizer  # host memory: kept either way
    resident = scorer.model if not residency.parked else None
    first_load = weakref.ref(scorer.model)
    del scorer  # parked: nothing here may keep the first load alive (the slot frees it and empties the cache)
    slot = ScorerSlot(load_scorer, residency, model=resident, first_load=first_load)
    compressor = PFlashCompressor(slot, tokenizer, settings, sparse=BlockSparseConfig(alpha=config.prefill_alpha))
    compressor.name = f"pflash:{Path(path).name}"
    logging.getLogger("lucebox.prefill_compression").info(
        "PFlash scorer %s %s: %s", Path(path).name, "parked" if residency.parked else "resident", residency.reason)
    return compressor


def find_scorer_beside(model_path: Any) -> str | None:
    """The one qwen3 GGUF in the model's folder (its header read only), if there is exactly one."""
    from .ggufio import GGUFFile

    found = []
    for candidate in sorted(Path(model_path).parent.glob("*.gguf")):
        try:
            if candidate != Path(model_path) and GGUFFile(candidate).architecture == "qwen3":
                found.append(str(candidate))
        except Exception:  # not a GGUF this reads: not a scorer
            continue
    return found[0] if len(found) == 1 else None

