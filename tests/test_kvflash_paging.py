"""KVFlash's paging machinery at depth (issue #15): what a decode token costs the host planner, where paged
chunks live, and when `qk` reselects.

What is proved here, on the cache alone (CPU; the side stream is proved by scripts/kvflash_gpu_check.py on a
GPU, which also runs here on the CPU):
- a decode token over thousands of paged-out chunks plans without iterating the host chunks, and, inside a
  chunk, without iterating the resident table either;
- after random appends and rollbacks (speculative verification's pattern) every resident chunk's pool rows
  and every paged chunk's host record hold exactly the rows written, the pool is compact with the tail on
  top and the device table maps each resident position to its row (what "slot <= position" masking needs);
- paged chunks live in arena records allocated a slab at a time and reused once freed;
- `qk` recalls a chunk `tau` tokens after the query turns to it, inside a chunk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CountingDict
from lucebox_core.kv import KVLayerShape
from lucebox_core.kvflash import CHUNK, KVFlashCache

SMALL = {0: KVLayerShape(1, 32, 32), 3: KVLayerShape(1, 32, 32)}


def _decode(cache, tokens, gen):
    for _ in range(tokens):
        cache.ensure_room(1)
        for layer, shape in SMALL.items():
            cache.append(layer, torch.randn(1, shape.kv_heads, shape.k_head_dim, generator=gen),
                         torch.randn(1, shape.kv_heads, shape.v_head_dim, generator=gen))


def test_a_decode_token_over_thousands_of_paged_chunks_scans_neither_the_host_chunks_nor_the_table():
    cache = KVFlashCache(SMALL, 2100 * CHUNK, pool=256)
    zeros = {layer: torch.zeros(CHUNK, s.kv_heads, s.k_head_dim) for layer, s in SMALL.items()}
    for _ in range(2000):
        cache.ensure_room(CHUNK)
        for layer in SMALL:
            cache.append(layer, zeros[layer], zeros[layer])
    assert cache.info()["host_chunks"] == 2000 - 4
    gen = torch.Generator().manual_seed(0)
    cache._host = CountingDict(cache._host)
    _decode(cache, 1, gen)  # a chunk boundary: one chunk leaves (lru: no host chunk is looked at)
    cache._where = CountingDict(cache._where)
    _decode(cache, CHUNK - 1, gen)  # the rest of that chunk: the tail is in place every token
    assert cache._host.visited == 0
    assert cache._where.visited == 0
    assert cache.length == 2001 * CHUNK and cache.info()["host_chunks"] == 2001 - 4


def _check_rows(cache, truth):
    """Every resident chunk's pool rows and every paged chunk's host record equal what was written, and the
    resident chunks fill the pool from slot 0 with the tail's chunk on top."""
    length = cache.length
    held = cache.resident_positions()
    assert len(held) == cache._valid_rows(length)  # compact: the rows a query at `length` sees, no hole
    assert held[-1] == length - 1 and len(set(held)) == len(held)
    # The device table recorded steps read: each resident position's slot is where its row sits.
    assert cache.attention_position(torch.tensor(held)).tolist() == list(range(len(held)))
    if length % CHUNK:
        assert held[-(length % CHUNK):] == list(range(length - length % CHUNK, length))  # the tail on top
    for layer in SMALL:
        keys, values = cache.gather(layer, cache.pool_tokens)
        index = torch.tensor(held)
        assert torch.equal(keys[:len(held)], truth[layer][0][index])
        assert torch.equal(values[:len(held)], truth[layer][1][index])
    for chunk in cache._host:
        rows = cache.host_rows(chunk)
        for layer in SMALL:
            span = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
            assert torch.equal(rows[f"{layer}.k"], truth[layer][0][span])
            assert torch.equal(rows[f"{layer}.v"], truth[layer][1][span])


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_random_appends_and_rollbacks_keep_every_row_where_the_mask_expects_it(policy):
    context = 40 * CHUNK
    cache = KVFlashCache(SMALL, context, pool=384, policy=policy, tau=16)
    gen = torch.Generator().manual_seed(7)
    truth = {layer: (torch.zeros(context, s.kv_heads, s.k_head_dim), torch.zeros(context, s.kv_heads, s.v_head_dim))
             for layer, s in SMALL.items()}
    for step in range(120):
        length = cache.length
        if step % 3 == 2 and length:  # a verify's rejected nodes: back by up to two chunks
            cache.rollback(max(0, length - int(torch.randint(1, 2 * CHUNK, (1,), generator=gen))))
        else:
            tokens = min(int(torch.randint(1, cache.max_pass + 1, (1,), generator=gen)), context - length)
            if not tokens:
                break
            cache.ensure_room(tokens)
            for layer, s in SMALL.items():
                k = torch.randn(tokens, s.kv_heads, s.k_head_dim, generator=gen)
                v = torch.randn(tokens, s.kv_heads, s.v_head_dim, generator=gen)
                truth[layer][0][length:length + tokens], truth[layer][1][length:length + tokens] = k, v
                cache.append(layer, k, v)
                if policy == "qk":
                    cache.observe_query(layer, torch.randn(1, 1, s.kv_heads, s.k_head_dim, generator=gen))
        cache.ensure_room(0)
        _check_rows(cache, truth)
    assert cache.info()["pages_out"] > 10
    if policy == "qk":
        assert cache.info()["pages_in"] > 0


def test_paged_chunks_live_in_arena_records_allocated_a_slab_at_a_time_and_reused():
    cache = KVFlashCache(SMALL, 300 * CHUNK, pool=256)
    arena = cache._arena
    zeros = {layer: torch.zeros(CHUNK, s.kv_heads, s.k_head_dim) for layer, s in SMALL.items()}

    def fill(chunks):
        for _ in range(chunks):
            cache.ensure_room(CHUNK)
            for layer in SMALL:
                cache.append(layer, zeros[layer], zeros[layer])

    fill(4 + 100)
    assert arena.records_per_slab > 1 and arena.records_in_use == 100
    slabs = -(-100 // arena.records_per_slab)
    assert len(arena.slabs) == slabs  # a slab per many chunks, not an allocation per chunk (and layer)
    assert cache.host_bytes == 100 * CHUNK * 2 * 2 * 32 * 4 and cache.info()["host_reserved_bytes"] >= cache.host_bytes
    cache.rollback(50 * CHUNK)  # host chunks 50 .. 99 dropped at the next plan: their records are free
    fill(50)  # as many chunks paged out again: into the freed records
    assert arena.records_in_use == len(cache._host) == 49 + 50 - 3 and len(arena.slabs) == slabs


def test_qk_recalls_a_chunk_tau_tokens_after_the_query_turns_to_it_inside_a_chunk():
    cache = KVFlashCache(SMALL, 40 * CHUNK, pool=256, policy="qk", tau=8)
    gen = torch.Generator().manual_seed(3)
    for chunk in range(6):  # chunk 1's keys point along +x; no query seen yet: it leaves first
        cache.ensure_room(CHUNK)
        for layer, s in SMALL.items():
            k = torch.randn(CHUNK, s.kv_heads, s.k_head_dim, generator=gen)
            if chunk == 1:
                k[..., 0] += 8.0
            cache.append(layer, k, torch.randn(CHUNK, s.kv_heads, s.v_head_dim, generator=gen))
    _decode(cache, 1, gen)  # into chunk 6
    assert 1 in cache._host
    for layer, s in SMALL.items():
        query = torch.zeros(1, 1, s.kv_heads, s.k_head_dim)
        query[..., 0] = 1.0
        cache.observe_query(layer, query)
    _decode(cache, 8, gen)  # tau tokens later, well inside chunk 6
    assert cache.length % CHUNK == 9 and 1 in cache._where and cache.info()["pages_in"] >= 1


@pytest.mark.slow
def test_the_gpu_check_script_runs_on_the_cpu(tiny_target_and_draft, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "kvflash_gpu_check.py"
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(script), "-m", str(tiny_target_and_draft[0]), "--device", "cpu",
                           "--pool", "256", "--depth-pools", "3", "-n", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["round_trip"]["mismatches"] == 0 and summary["round_trip"]["chunks"] > 0
    assert [row["kv"] for row in summary["decode"]] == ["full", "kvflash lru"]
    assert all(row["token_ms_median"] > 0 for row in summary["decode"])
    assert summary["decode"][1]["depth"] == 3 * 256 and summary["decode"][1]["host_chunks"] > 0
