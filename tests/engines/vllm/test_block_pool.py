"""ElasticBlockPool's BlockPool contract, with vLLM's own classes and the real
kvcached path (manager -> IPC coordinator -> worker listener -> FTensor), all
in this process: no engine start, so every branch is cheap to reach.

The KV buffer is laid out as the installed vLLM lays it out (2 layers, 64
blocks of 8 KiB per layer: one LBHNC buffer from 0.29, one buffer per layer
before); pages are 64 KiB, so 8 blocks per page and one logical page maps 2
physical pages (one per layer). The installed version's own pool and layout
patches (versions.py) are applied first, as activation would."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

P = 64 << 10
N_BLOCKS = 64


def _kv_tensors(block_bytes: int) -> list:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if "shared_by" in KVCacheTensor.__dataclass_fields__:  # vLLM 0.26-0.28: one buffer per layer
        return [KVCacheTensor(size=N_BLOCKS * block_bytes, shared_by=[layer]) for layer in ("l0", "l1")]
    return [
        KVCacheTensor(
            size=2 * N_BLOCKS * block_bytes,
            layers=["l0", "l1"],
            layer_stride=N_BLOCKS * block_bytes,
            block_stride=block_bytes,
        )
    ]


@pytest.fixture
def pool(monkeypatch):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcached.integration.vllm.backend import building_pools
    from kvcached.integration.vllm.block_pool import ElasticBlockPool
    from kvcached.integration.vllm.kv_layout import KVLayoutPlan
    from kvcached.integration.vllm.versions import apply_installed
    from kvcached.integration.vllm.worker_kv import WorkerKV

    apply_installed(("vllm.v1.core.block_pool", "vllm.v1.kv_cache_interface"))  # as activation would
    name = f"kvt_pool_{os.getpid()}"
    for k, v in dict(
        KVCACHED_IPC_NAME=name,
        KVCACHED_PAGE_SIZE=str(P),
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES="0",
        KVCACHED_HOST_MEMORY_BUDGET="64M",
        KVCACHED_MAX_CACHED_TOKENS="64",
    ).items():
        monkeypatch.setenv(k, v)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    B = spec.page_size_bytes
    kvc = KVCacheConfig(
        num_blocks=N_BLOCKS,
        kv_cache_tensors=_kv_tensors(B),
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
    )
    worker = WorkerKV.start(KVLayoutPlan.from_kv_cache_config(kvc, P), "cpu", 0, 0, name)
    vc = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, data_parallel_rank=0
        ),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        device_config=SimpleNamespace(device=torch.device("cpu")),
        kv_transfer_config=None,
    )
    with building_pools(vc, kvc):
        p = ElasticBlockPool(
            num_gpu_blocks=N_BLOCKS, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True
        )
    p.worker = worker
    yield p
    p.close()
    worker.close()
    WorkerKV.current = None


def _hash(pool, blk, tag: bytes) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(tag), 0), blk, num_tokens=16)


def _mapped(pool) -> list:
    return pool.worker.executor.mapped_logical_pages()


def test_without_context_the_coordinator_gets_a_native_pool():
    from vllm.v1.core.block_pool import BlockPool

    from kvcached.integration.vllm.block_pool import ElasticBlockPool

    p = ElasticBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    assert type(p) is BlockPool and p.get_num_free_blocks() == 7


def test_blocks_come_from_mapped_pages_and_return_their_memory(pool):
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == N_BLOCKS - 1 and _mapped(pool) == [0]  # the null block's page
    got = pool.get_new_blocks(10)
    ids = [b.block_id for b in got]
    assert len(set(ids)) == 10 and 0 not in ids and all(b.ref_cnt == 1 for b in got)
    pages = sorted({i // 8 for i in ids} | {0})
    assert _mapped(pool) == pages  # the worker maps exactly the pages holding live blocks
    assert pool.get_num_free_blocks() == N_BLOCKS - 11
    assert 0 < pool.get_usage() < 1
    pool.free_blocks(reversed(got))  # unhashed: straight back to the ledger
    assert all(b.ref_cnt == 0 for b in got)
    assert _mapped(pool) == [0] and pool.get_num_free_blocks() == N_BLOCKS - 1 and pool.get_usage() == 0


def test_cached_blocks_stay_mapped_count_as_free_and_are_hit_by_touch(pool):
    got = pool.get_new_blocks(3)
    for i, b in enumerate(got):
        _hash(pool, b, b"h%d" % i)
    pool.free_blocks(got)
    assert pool.free_block_queue.num_free_blocks == 3  # evictable, data kept
    assert pool.get_num_free_blocks() == N_BLOCKS - 1
    assert {b.block_id // 8 for b in got} <= set(_mapped(pool))
    from vllm.v1.core.kv_cache_utils import BlockHash

    hit = pool.get_cached_block(BlockHash(b"h1"), [0])
    assert hit == [got[1]]
    pool.touch(hit)  # a prefix hit takes it off the evictable queue
    assert got[1].ref_cnt == 1 and pool.free_block_queue.num_free_blocks == 2
    pool.free_blocks(hit)
    assert pool.reset_prefix_cache() is True
    assert pool.free_block_queue.num_free_blocks == 0 and all(b.block_hash is None for b in got)
    assert _mapped(pool) == [0]
    assert any(type(e).__name__ == "AllBlocksCleared" for e in pool.take_events())


def test_bounded_cache_evicts_whole_pages_first(pool):
    # KVCACHED_MAX_CACHED_TOKENS=64: 4 cached blocks of 16 tokens at most.
    a = pool.get_new_blocks(8)  # fills one page (8 blocks)
    b = pool.get_new_blocks(4)
    for i, blk in enumerate(a + b):
        _hash(pool, blk, b"c%d" % i)
    pool.free_blocks(a[:4])  # oldest, on a page that keeps 4 live blocks
    pool.free_blocks(b)
    pool.free_blocks(a[4:])  # now page of `a` is all evictable: it goes first, whole
    assert pool.free_block_queue.num_free_blocks * 16 <= 64
    kept = {blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()}
    assert kept <= {blk.block_id for blk in b}, "a scattered victim was chosen over a whole page"
    assert a[0].block_id // 8 not in _mapped(pool)  # its memory went back
    assert any(type(e).__name__ == "BlockRemoved" for e in pool.take_events())


def test_a_lowered_limit_shows_as_fewer_free_blocks_and_returns_cached_pages(pool):
    from kvcached.control import set_instance_memory_limit

    got = pool.get_new_blocks(8)
    for i, blk in enumerate(got):
        _hash(pool, blk, b"l%d" % i)
    pool.free_blocks(got)
    name = pool.backend.name
    r = set_instance_memory_limit(2 * P * 2, name=name)  # 2 logical pages of 2 x 64 KiB
    assert r in ("applied", "deferred"), r.message
    # Counting returns the whole-page cache over the limit; what is left fits.
    pool._next_return_scan = 0.0
    pool._avail_until = 0.0  # the count's refresh (at most 100 ms later in an engine)
    free = pool.get_num_free_blocks()
    assert pool.free_block_queue.num_free_blocks == 0
    assert _mapped(pool) == [0]
    assert free <= 15  # page 0 (7 free) + one more page: the limit, not the virtual capacity
    with pytest.raises(ValueError):
        pool.get_new_blocks(free + 1)


def test_a_limit_below_the_pages_holding_live_blocks_gives_no_block_until_they_fit(pool):
    """A lowered limit must be reached while requests still decode: while the
    pages holding live blocks exceed it the pool has no free block at all (so
    vLLM preempts), and counting resumes as soon as what is left fits."""
    from kvcached.control import set_instance_memory_limit

    got = pool.get_new_blocks(24)
    by_page: dict = {}
    for b in got:
        by_page.setdefault(b.block_id // 8, []).append(b)
    held = sorted(by_page)
    assert len(held) >= 3  # page 0 (null block) + the pages of 24 blocks
    r = set_instance_memory_limit(2 * P * 2, name=pool.backend.name)  # page 0 + one more
    assert r in ("applied", "deferred"), r.message
    pool._avail_until = 0.0  # the count's refresh (at most 100 ms later in an engine)
    assert pool.get_num_free_blocks() == 0  # free slots on held pages are not handed out either
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    keep = [p for p in held if p != 0][0]
    for page in held:
        if page not in (0, keep):
            assert pool.get_num_free_blocks() == 0  # still over: keep preempting
            pool.free_blocks(by_page[page])  # a preempted request's blocks
    free = pool.get_num_free_blocks()
    assert 0 < free <= 8 + 7 - len(by_page.get(0, [])) - len(by_page[keep])  # what fits under the limit
    assert sorted(_mapped(pool)) == sorted({0, keep})
    pool.free_blocks(by_page[keep] + by_page.get(0, []))


def test_an_allocation_overtaken_by_another_process_raises_pool_shortage_and_leaks_nothing(pool, monkeypatch):
    from kvcached.integration.vllm.block_pool import PoolShortage

    before = (pool.get_num_free_blocks(), pool.num_in_use_blocks(), _mapped(pool))
    monkeypatch.setattr(pool.manager, "alloc", lambda n: None)  # the memory vanished after the count
    with pytest.raises(PoolShortage):
        pool.get_new_blocks(4)
    monkeypatch.undo()
    assert (pool.get_num_free_blocks(), pool.num_in_use_blocks(), _mapped(pool)) == before


def test_evict_first_puts_freed_cached_blocks_at_the_front_of_the_evictable_queue(pool):
    # vLLM 0.34 frees blocks another tier already holds with evict_first=True.
    old = pool.get_new_blocks(2)
    new = pool.get_new_blocks(2)
    for i, blk in enumerate(old + new):
        _hash(pool, blk, b"e%d" % i)
    pool.free_blocks(old)
    pool.free_blocks(new, evict_first=True)
    order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert order == [b.block_id for b in new + old]  # oldest-evicted first: the evict_first ones
    assert pool.evict_cached(2) == 2
    assert {b.block_id for b in pool.free_block_queue.get_all_free_blocks()} == {b.block_id for b in old}


@pytest.mark.parametrize("weak", [False, True])
def test_blocks_of_another_pool_are_forwarded_by_reference_or_weakref(pool, monkeypatch, weak):
    import gc
    import weakref

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    if "pool" not in KVCacheBlock.__dataclass_fields__:
        pytest.skip("vLLM <= 0.29: blocks do not name their pool (block_owner_none_0_29): nothing to forward")

    from kvcached.integration.vllm import block_pool as bp

    other = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    mine = pool.get_new_blocks(1)
    theirs = other.get_new_blocks(2)
    if weak:  # vLLM 0.34's shape, on the installed vLLM: blocks hold weakref.ref(pool)
        monkeypatch.setattr(bp.ElasticBlockPool, "foreign_owner", staticmethod(bp.owner_by_weakref))
        pool._weak_self = weakref.ref(pool)
        for b in pool.blocks:
            b.pool = pool._weak_self
        for b in other.blocks:
            b.pool = weakref.ref(other)
    seen = []
    monkeypatch.setattr(other, "free_blocks", lambda blocks, **kw: seen.append(([b.block_id for b in blocks], kw)))
    pool.free_blocks(mine + theirs, evict_first=True)
    assert seen == [([b.block_id for b in theirs], {"evict_first": True})]
    assert pool.num_in_use_blocks() == 0  # its own block came back
    pool.free_blocks(theirs)  # without evict_first nothing extra is passed (vLLM < 0.34 pools)
    assert seen[-1] == ([b.block_id for b in theirs], {})
    if weak:  # a collected owner: vLLM drops its blocks, so does the pool
        for b in theirs:
            b.pool = weakref.ref(BlockPool(num_gpu_blocks=2, enable_caching=False, hash_block_size=16))
        gc.collect()
        pool.free_blocks(theirs)
        assert len(seen) == 2


_WANTING_PEER = """
import sys, time
from kvcached import _C
t = _C.MemInfoTracker.create(sys.argv[1], "t", 0, 0, 1 << 20, 1 << 20)
t.set_wanted(int(sys.argv[2]))
print("ok", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("keep_null_page", [False, True])
def test_an_idle_pool_gives_a_peer_the_pages_it_wants_first_then_the_rest(pool, monkeypatch, tmp_path, keep_null_page):
    """A peer lacking one page: the idle pool evicts, unmaps and releases one page's
    budget before it evicts the rest of its cache (which it still gives: the same
    memory as before, the wanting peer's part sooner). The null block's page goes last,
    with the blocks cached beside the null block (KVCACHED_KEEP_NULL_PAGE: both stay)."""
    import subprocess
    import sys

    from kvcached import trace
    from kvcached.elastic import IdleAction

    if keep_null_page:
        monkeypatch.setenv("KVCACHED_KEEP_NULL_PAGE", "true")
    monkeypatch.setattr(pool, "_max_cached", None)  # the fixture's bound off: an unbounded cache
    beside_null = pool.get_new_blocks(3)  # on page 0, beside the null block: the oldest cached blocks
    got = pool.get_new_blocks(32)  # 4 whole pages
    assert {b.block_id // 8 for b in beside_null} == {0} and 0 not in {b.block_id // 8 for b in got}
    for i, blk in enumerate(beside_null + got):
        _hash(pool, blk, b"w%d" % i)
    pool.free_blocks(beside_null)
    pool.free_blocks(got)
    assert pool.free_block_queue.num_free_blocks == 35 and len(_mapped(pool)) == 5
    bpp = pool.backend.pool.bytes_per_page
    peer = subprocess.Popen(
        [sys.executable, "-c", _WANTING_PEER, f"kvt_wanting_{os.getpid()}", str(bpp)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert peer.stdout.readline().strip() == "ok"
        assert pool.backend.pool.pages_wanted_by_peers() == 1
        trace.configure(str(tmp_path / "trace"))
        try:
            pool.idle_return_memory(IdleAction.GIVE_TO_PEERS)
        finally:
            trace.configure(None)
    finally:
        peer.stdin.close()
        peer.wait(30)
    events = [(e["event"], e.get("blocks", e.get("pages"))) for e in trace.read(str(tmp_path / "trace"))]
    evicted = [(i, n) for i, (ev, n) in enumerate(events) if ev == "evicted"]
    # The wanted page first (not page 0, though its blocks are the oldest), then the rest.
    assert [n for _, n in evicted] == ([8, 24] if keep_null_page else [8, 27]), events
    released = next(i for i, (ev, _) in enumerate(events) if ev == "grant_released")
    assert evicted[0][0] < released < evicted[1][0], events  # its budget went before the rest was evicted
    if keep_null_page:
        assert pool.free_block_queue.num_free_blocks == 3 and _mapped(pool) == [0]
        return
    # All given, and the null block's page too (nothing else left, nothing in flight).
    assert pool.free_block_queue.num_free_blocks == 0 and _mapped(pool) == []
    got = pool.get_new_blocks(2)
    assert 0 not in [b.block_id for b in got] and _mapped(pool)[0] == 0  # page 0 comes back first
    pool.free_blocks(got)
