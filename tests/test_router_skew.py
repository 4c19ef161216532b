"""`lucebox synth --router-skew F`: MoE routers biased toward a fixed hot set of each layer's experts. The share
of routed picks landing in the hot set is measured through the real model (its routing counted by Spark's
profile, every expert resident), on tiny laguna (sigmoid router) and qwen35moe (softmax router) files."""

import numpy as np
import pytest
import torch

from lucebox_core import cli
from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.ggufio import GGUFFile
from lucebox_core.synthetic import ROUTER_SUFFIX, hot_count, hot_share, router_skew_scale

SKEW = 0.6  # reachable by the tiny files (16 experts top-4, 8 experts top-2); the full-size ones reach 0.99


def _routing_counts(path) -> torch.Tensor:
    """Picks per (MoE layer, expert) over a 256-token random prompt, counted by Spark with every expert resident."""
    assembled = build_engine(EngineOptions(model=str(path), ctx_size=300, spark=True, spark_vram=str(1 << 40)))
    prompt = torch.randint(10, 5000, (256,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = assembled.engine
    engine.prefill(engine.new_sequence(), prompt)
    assert assembled.spark.describe()["residency"] == 1.0
    return assembled.spark.profile.counts


def _hot_sets(path, top_k: int) -> list[set[int]]:
    """Each MoE layer's hot set read back from the file: its router's rows of largest norm. (Lucebox's own
    reader: it leaves the metadata undecoded, where gguf's GGUFReader parses qwen35moe's 248k-token vocabulary
    into Python objects, most of this test's time.)"""
    gguf_file = GGUFFile(path)
    routers = sorted((name for name in gguf_file.tensors if name.endswith(ROUTER_SUFFIX)),
                     key=lambda name: int(name.split(".")[1]))
    sets = []
    for name in routers:
        norms = np.linalg.norm(gguf_file.tensor(name).dequantize(torch.float64).numpy(), axis=1)
        sets.append(set(np.argsort(-norms)[: hot_count(len(norms), top_k)].tolist()))
    return sets


@pytest.mark.slow  # two synths, two loads and two 256-token prefills a family: ~4-8 s on 2 cores
@pytest.mark.parametrize(("arch", "top_k"), [("laguna", 4), ("qwen35moe", 2)])
def test_a_skewed_router_sends_most_picks_to_its_hot_set(tmp_path, arch, top_k):
    shares = {}
    for skew in (None, SKEW):
        path = tmp_path / f"{arch}-{skew}.gguf"
        extra = [] if skew is None else ["--router-skew", str(skew)]
        assert cli.main(["synth", "--arch", arch, "--size", "tiny", "--type", "q8_0", "--seed", "3", "-o",
                         str(path), *extra]) == 0
        counts = _routing_counts(path)
        hot = _hot_sets(path, top_k)
        in_hot = sum(int(counts[layer, sorted(experts)].sum()) for layer, experts in enumerate(hot))
        shares[skew] = in_hot / int(counts.sum())
    experts = counts.shape[1]
    uniform = hot_count(experts, top_k) / experts
    # Without skew the largest-norm rows take a little more than their share (a longer row, larger logits);
    # with it, about F: the hot sets are per layer (different experts), drawn by the seed.
    assert shares[None] < uniform + 0.12, shares
    assert shares[SKEW] > SKEW - 0.08, shares
    assert len({frozenset(h) for h in hot}) > 1  # not the same hot set in every layer


def test_the_row_scale_hits_the_asked_share_and_out_of_reach_is_refused():
    scale = router_skew_scale(0.9, 256, 8)
    assert 1 < scale < 10 and abs(hot_share(scale, 256, 8) - 0.9) < 0.01
    with pytest.raises(ValueError, match=r"out of reach for 8 experts top-2 \(hot set 3\)"):
        router_skew_scale(0.9, 8, 2)
    with pytest.raises(ValueError, match="out of reach"):
        router_skew_scale(0.2, 256, 8)  # below the hot set's own share: no skew toward it gives that


def test_synth_refuses_a_skew_it_cannot_write(tmp_path, capsys):
    assert cli.main(["synth", "--arch", "qwen35", "--size", "tiny", "--router-skew", "0.9", "-o",
                     str(tmp_path / "dense.gguf")]) != 0
    assert "--router-skew: the qwen35 writer has no MoE routers" in capsys.readouterr().err
    assert cli.main(["synth", "--arch", "qwen35moe", "--size", "tiny", "--router-skew", "0.95", "-o",
                     str(tmp_path / "moe.gguf")]) != 0
    assert "out of reach" in capsys.readouterr().err
    assert not (tmp_path / "moe.gguf").exists() and not (tmp_path / "dense.gguf").exists()
