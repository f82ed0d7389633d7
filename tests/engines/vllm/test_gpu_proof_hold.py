"""native-held, the control of the GPU proof's limit runs (scripts/gpu_proof/correctness.py):
a native engine keeps tensors of kvcached-limit's size and offers kvcached-limit's block count,
by holding the rest of its pool. Checked on vLLM's own BlockPool: the pool then hands out and
evicts exactly what a pool of that count would, with the same block ids."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_proof"))
correctness = pytest.importorskip("correctness")


@pytest.fixture
def pool(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    p = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=p))
    monkeypatch.setattr(correctness, "_SCHEDULERS", [sched])
    return p


def test_held_pool_offers_and_hands_out_what_a_pool_of_that_count_does(pool):
    from vllm.v1.core.block_pool import BlockPool

    small = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    assert correctness.hold_blocks(6) == 10
    assert pool.get_num_free_blocks() == small.get_num_free_blocks() == 5
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [b.block_id for b in small.get_new_blocks(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 5  # the held ones never come back


def test_blocks_in_use_or_cached_are_never_held(pool):
    in_use = pool.get_new_blocks(2)
    cached = pool.blocks[15]
    cached._block_hash = b"cached"  # stands for a prefix-cache entry: not the harness's to take
    assert correctness.hold_blocks(6) == 8
    assert pool.get_num_free_blocks() == 5
    assert cached.ref_cnt == 0 and all(b.ref_cnt == 1 for b in in_use)
    assert not pool.null_block.ref_cnt
