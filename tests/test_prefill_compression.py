"""PFlash's scoring and selection arithmetic, against plain loops written from Lucebox's description."""

import math

import pytest
import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.prefill_compression import (CompressionConfig, anchor_chunks, keep_ratio_for, parse_curve,
                                              select_spans, tail_scores)


def _naive_scores(queries, keys, pool):
    """Loop by loop: softmax of each tail query over the keys it may see, max over heads, max over layers,
    mean over the tail, then the mean of each position's window of `pool` (the positions that exist)."""
    heads, tail, dim = queries[0].shape
    length = keys[0].shape[1]
    best = [[0.0] * length for _ in range(tail)]
    for q, k in zip(queries, keys):
        group = heads // k.shape[0]
        for h in range(heads):
            for t in range(tail):
                position = length - tail + t
                logits = [float(q[h, t].double() @ k[h // group, s].double()) / math.sqrt(dim)
                          for s in range(position + 1)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for s, w in enumerate(weights):
                    best[t][s] = max(best[t][s], w / total)
    mean = [sum(best[t][s] for t in range(tail)) / tail for s in range(length)]
    half = pool // 2
    return [sum(mean[max(0, s - half) : s + half + 1]) / len(mean[max(0, s - half) : s + half + 1])
            for s in range(length)]


def test_tail_scores_match_the_loops():
    generator = torch.Generator().manual_seed(0)
    queries = [torch.randn(4, 3, 8, generator=generator) for _ in range(2)]
    keys = [torch.randn(2, 40, 8, generator=generator) * 2 for _ in range(2)]  # GQA: 2 query heads a KV head
    ours = tail_scores(queries, keys, pool=5)
    assert torch.allclose(ours.double(), torch.tensor(_naive_scores(queries, keys, 5), dtype=torch.float64), atol=1e-6)


def test_tail_scores_refuse_mismatched_shapes():
    with pytest.raises(LuceboxError, match="do not fit"):
        tail_scores([torch.randn(3, 2, 8)], [torch.randn(2, 10, 8)])


def test_keep_ratio_is_linear_between_curve_points():
    config = CompressionConfig(curve=parse_curve(["1000:0.5", "3000:0.1"]))
    assert keep_ratio_for(500, config) == 0.5 and keep_ratio_for(5000, config) == 0.1
    assert keep_ratio_for(2000, config) == pytest.approx(0.3)
    assert keep_ratio_for(10**6, CompressionConfig(keep_ratio=0.2)) == 0.2
    with pytest.raises(LuceboxError, match="TOKENS:RATIO"):
        parse_curve(["lots"])
    with pytest.raises(LuceboxError, match="increasing"):
        CompressionConfig(curve=((3000, 0.1), (1000, 0.5)))


def test_anchors_mark_the_chunks_of_rare_query_ngrams():
    config = CompressionConfig(chunk=8, anchor_query_tokens=12, anchor_radius=1, anchor_max_hits=2)
    ids = list(range(1000, 1100))  # no repeats anywhere
    ids[41:45] = [7, 7, 8, 9]  # the needle's key, once, in chunk 5
    ids[90:94] = [7, 7, 8, 9]  # the question repeats it
    assert anchor_chunks(ids, config) == {4, 5, 6}
    for start in (3, 13, 23):  # three more occurrences: too common to anchor
        ids[start : start + 4] = [7, 7, 8, 9]
    assert anchor_chunks(ids, config) == set()


def test_selection_keeps_head_tail_then_the_best_chunks_in_order():
    config = CompressionConfig(chunk=4, keep_ratio=0.5, head_chunks=1, tail_chunks=1)
    scores = torch.zeros(40)  # 10 chunks: keep 5
    scores[12:16] = 3.0  # chunk 3
    scores[20:24] = 2.0  # chunk 5
    scores[24:28] = 1.0  # chunk 6
    scores[8:12] = 0.5  # chunk 2
    spans = select_spans(scores, config)
    # head chunk 0, tail chunk 9, then chunks 3, 5, 6 (adjacent 5 and 6 merged)
    assert spans == [(0, 4), (12, 16), (20, 28), (36, 40)]


def test_head_and_tail_shrink_in_proportion_to_the_budget():
    config = CompressionConfig(chunk=1, keep_ratio=0.1, head_chunks=8, tail_chunks=24)
    spans = select_spans(torch.rand(100, generator=torch.Generator().manual_seed(1)), config)
    kept = sum(end - start for start, end in spans)
    assert kept == 10  # floor(100 * 0.1)
    assert spans[0][0] == 0 and spans[0][1] >= 2 and spans[-1][1] == 100  # 9 * 8/32 = 2 head, 7 tail


def test_protected_spans_survive_whole():
    config = CompressionConfig(chunk=4, keep_ratio=0.1, head_chunks=0, tail_chunks=0)
    scores = torch.zeros(80)
    scores[40:44] = 1.0
    spans = select_spans(scores, config, protected=[(9, 22)])  # tool definitions, say
    covered = {i for start, end in spans for i in range(start, end)}
    assert set(range(9, 22)) <= covered and set(range(40, 44)) <= covered


# -- the chat's structure and FlowKV ------------------------------------------------------------------------

from lucebox_core.chat_compression import ChatCompressor, Piece, plan_messages  # noqa: E402


class FirstWords:
    """A compression policy a plugin might register: keep each unprotected text's first three words. It
    records what it was handed, so the test can see which pieces were protected."""

    def __init__(self):
        self.calls: list[list[Piece]] = []

    def compress(self, pieces):
        self.calls.append(pieces)
        return [p.text if p.protected else " ".join(p.text.split()[:3]) for p in pieces]


LONG = "word " * 50


def _chat():
    return [
        {"role": "system", "content": "You are terse. " + LONG},
        {"role": "user", "content": "first question " + LONG},
        {"role": "assistant", "content": "first answer " + LONG},
        {"role": "user", "content": "read the file"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "file body " + LONG},
        {"role": "user", "content": "second question " + LONG},
        {"role": "assistant", "content": "second answer " + LONG},
        {"role": "user", "content": "last question " + LONG},
    ]


def test_only_aged_free_text_may_be_compressed():
    assert plan_messages(_chat(), hot_window=2) == [False, True, True, True, False, False, True, False, False]
    assert plan_messages(_chat(), hot_window=0) == [False, True, True, True, False, False, True, True, False]


def test_flowkv_compresses_each_aged_message_once_and_reuses_it():
    policy = FirstWords()
    chats = ChatCompressor(policy, mode="always", hot_window=2, name="first-words")
    chat = _chat()
    first = chats.apply(chat)
    assert [m["content"] for m in first[1:4]] == ["first question word", "first answer word", "read the file"]
    assert first[0] is chat[0] and first[5] is chat[5] and first[8] is chat[8]  # untouched: the same objects
    [pieces] = policy.calls
    assert [p.protected for p in pieces] == [not c for c in plan_messages(chat, 2)]
    # The next turn: one more answer and question; what aged before is reused, only messages 7 and 8 are new.
    later = chat + [{"role": "assistant", "content": "third answer " + LONG}, {"role": "user", "content": "again?"}]
    second = chats.apply(later)
    assert [m["content"] for m in second[:7]] == [m["content"] for m in first[:7]]  # the prompt extends turn 1's
    assert second[7]["content"] == "second answer word" and second[8]["content"] == "last question word"
    assert [p.protected for p in policy.calls[1]].count(False) == 2
    assert policy.calls[1][1].text == "first question word"  # reused pieces are shown as compressed
    described = chats.describe()
    assert described["messages"] == 6 and described["reused"] == 4 and described["compression_ratio"] < 0.2


def test_modes_and_thresholds():
    chats = ChatCompressor(FirstWords(), mode="auto", threshold=1000)
    assert not chats.wanted(999) and chats.wanted(1000)
    assert ChatCompressor(FirstWords(), mode="always").wanted(1)
    assert not ChatCompressor(FirstWords(), mode="off").wanted(10**9)
    with pytest.raises(LuceboxError, match="--prefill-compression"):
        ChatCompressor(FirstWords(), mode="sometimes")
