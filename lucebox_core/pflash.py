"""The PFlash compressor: a scorer model reads the chat's text and keeps the chunks that matter.

Across tokenizers through text: the scorer's vocabulary differs from every target's, so the pieces (see
`chat_compression`) are tokenized with the scorer's own tokenizer, scored together (the question is at the
end), and each compressible piece is given back as the text of its kept tokens, in order. Protected pieces
are scored as context but never cut, and their chunks are kept whole (`select_spans(protected=...)`).

The scorer is any model with `tail_attention(token_ids, lookahead, sparse=...) -> (queries, keys)`: per scored layer,
the post-RoPE queries of the last `lookahead` tokens `[H, T, d]` and the keys of every token `[H_kv, S, d]`.
"""

from __future__ import annotations

from typing import Any

import torch

from .chat_compression import Piece
from .prefill_compression import CompressionConfig, select_spans, tail_scores


class PFlashCompressor:
    def __init__(self, scorer: Any, tokenizer: Any, config: CompressionConfig | None = None, *,
                 sparse: Any = None):
        """`sparse`: a `block_sparse.BlockSparseConfig` for the scorer's attention over long prompts
        (FlashPrefill; `--prefill-alpha`), or None for dense attention."""
        self.scorer, self.tokenizer, self.sparse = scorer, tokenizer, sparse
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
        queries, keys = self.scorer.tail_attention(torch.tensor(ids, dtype=torch.long), lookahead, sparse=self.sparse)
        scores = tail_scores(queries, keys, self.config.pool)
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
