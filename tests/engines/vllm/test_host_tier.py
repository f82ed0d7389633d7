"""Give-back with vLLM's host tier (``--kv-offloading-size``): kvcached's ElasticBlockPool
evicts the cached pages whose blocks the tier holds (or is storing) first
(``kvcached/integration/vllm/host_tier.py``).

vLLM's own ``CPUOffloadingManager`` (its scheduler-side bookkeeping runs on any
platform; only the copies need a GPU) stores and completes the keys the connector
would, over the real elastic pool of test_block_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

from test_block_pool import _hash, pool  # noqa: F401  (the fixture)

PER_PAGE = 8  # blocks of a 64 KiB page in the fixture


def _manager(blocks: int = 64, **kw):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(blocks, **kw)  # num_blocks (0.26) / num_chunks (0.32)


def _view(manager, blocks_per_chunk: int = 1):
    from kvcached.integration.vllm.host_tier import HostTierView

    config = SimpleNamespace(blocks_per_chunk=blocks_per_chunk, kv_group_configs=())
    sched = SimpleNamespace(manager=manager, config=config)
    return HostTierView.of_connector(SimpleNamespace(connector_scheduler=sched))


def _ctx():
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id="r")


def _store(manager, blocks, complete: bool = True) -> None:
    keys = [b.block_hash for b in blocks]  # the connector's OffloadKey: the same bytes
    for _ in range(3):  # store_threshold >= 2 admits a key seen that often (0.32 counts offers here)
        out = manager.prepare_store(keys, _ctx())
        assert out is not None
        if out.keys_to_store:
            break
    assert sorted(out.keys_to_store) == sorted(keys)
    if complete:
        manager.complete_store(keys, _ctx())


def _whole_pages(pool, n_pages: int):  # noqa: F811
    """Blocks of ``n_pages`` pages the pool handed out whole (page 0 holds the null block), hashed."""
    got = pool.get_new_blocks(PER_PAGE * (n_pages + 1))
    by_page = {}
    for b in got:
        by_page.setdefault(b.block_id // PER_PAGE, []).append(b)
    pages = [blocks for blocks in by_page.values() if len(blocks) == PER_PAGE][:n_pages]
    assert len(pages) == n_pages
    rest = [b for b in got if all(b not in p for p in pages)]
    pool.free_blocks(rest)  # unhashed: straight back
    for i, blocks in enumerate(pages):
        for j, b in enumerate(blocks):
            _hash(pool, b, b"p%d-%d" % (i, j))
    return pages


def test_the_offload_key_of_a_block_is_its_gpu_hash():
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
    from vllm.v1.kv_offload.base import make_offload_key

    for g in (0, 1, 7):
        assert make_offload_key(b"h" * 32, g) == make_block_hash_with_group_id(BlockHash(b"h" * 32), g)


def test_state_follows_the_managers_stores_without_side_effects(pool):  # noqa: F811
    from vllm.v1.kv_offload.base import LookupResult

    from kvcached.integration.vllm.host_tier import ABSENT, HELD, PENDING, UNKNOWN

    m = _manager(store_threshold=2)  # lookup() counts (admission) here: the view must not
    view = _view(m)
    [page] = _whole_pages(pool, 1)
    a, b, c = page[:3]
    for x in (b, c, b, c):  # requests looked them up twice (0.26 admits by lookups)
        assert m.lookup(x.block_hash, _ctx()) == LookupResult.MISS
    assert [view.state(x) for x in (a, b, c)] == [ABSENT] * 3
    _store(m, [b], complete=False)
    _store(m, [c])
    counts = dict(getattr(m, "counts", None) or {})
    assert [view.state(x) for x in (a, b, c)] == [ABSENT, PENDING, HELD]
    assert dict(getattr(m, "counts", None) or {}) == counts  # the view's look-ups were not counted
    want = {ABSENT: LookupResult.MISS, PENDING: LookupResult.HIT_PENDING, HELD: LookupResult.HIT}
    for x in (a, b, c):  # the manager's own answer agrees (these lookups count; the view's did not)
        assert m.lookup(x.block_hash, _ctx()) == want[view.state(x)]
    assert view.state(pool.null_block) == UNKNOWN  # no hash
    assert _view(m, blocks_per_chunk=2).state(c) == UNKNOWN  # a block inside a chunk has no key
    assert _view(SimpleNamespace()) is None  # a manager without a readable policy: order unchanged


def test_give_back_evicts_the_pages_the_host_tier_keeps_first(pool):  # noqa: F811
    from kvcached.integration.vllm.host_tier import ABSENT, HELD, PENDING

    pool._max_cached = None  # no cache bound: only the give-back below evicts
    m = _manager()
    pool.host_tier = _view(m)
    old, stored, storing = _whole_pages(pool, 3)
    _store(m, stored)
    _store(m, storing, complete=False)
    for blocks in (old, stored, storing):  # freed in this order: ``old`` is the LRU page
        pool.free_blocks(blocks)
    assert pool.free_block_queue.num_free_blocks == 3 * PER_PAGE

    def cached(blocks):
        return [b.block_hash is not None for b in blocks]

    # A limit a page lower: the page the tier holds goes, not the older one it does not.
    assert pool.evict_cached(PER_PAGE, whole_pages_first=True, only_whole_pages=True) == PER_PAGE
    assert cached(stored) == [False] * PER_PAGE and cached(old) == [True] * PER_PAGE
    assert dict(pool.host_tier.dropped) == {HELD: PER_PAGE}
    # Then the page still being stored (its store keeps it; the fence keeps its page mapped).
    assert pool.evict_cached(PER_PAGE, whole_pages_first=True, only_whole_pages=True) == PER_PAGE
    assert cached(storing) == [False] * PER_PAGE and cached(old) == [True] * PER_PAGE
    # A peer's want takes the rest: the prefix the tier lacks is dropped, and counted.
    assert pool.evict_cached(PER_PAGE, whole_pages_first=True, only_whole_pages=True) == PER_PAGE
    assert cached(old) == [False] * PER_PAGE
    assert dict(pool.host_tier.dropped) == {HELD: PER_PAGE, PENDING: PER_PAGE, ABSENT: PER_PAGE}


def test_without_a_host_tier_give_back_stays_lru(pool):  # noqa: F811
    pool._max_cached = None
    assert pool.host_tier is None
    old, new = _whole_pages(pool, 2)
    pool.free_blocks(old)
    pool.free_blocks(new)
    assert pool.evict_cached(PER_PAGE, whole_pages_first=True, only_whole_pages=True) == PER_PAGE
    assert all(b.block_hash is None for b in old) and all(b.block_hash is not None for b in new)


def test_attach_gives_the_pool_the_connectors_view(pool):  # noqa: F811
    from kvcached.integration.vllm import offload
    from kvcached.integration.vllm.versions import apply_installed

    apply_installed(("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",))
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    c = object.__new__(OffloadingConnector)  # its constructor wants a whole engine config
    m = _manager()
    c.connector_scheduler = SimpleNamespace(
        manager=m, config=SimpleNamespace(blocks_per_chunk=1, kv_group_configs=()), meta=None
    )
    scheduler = SimpleNamespace(connector=c, vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)))
    offload.attach(scheduler, pool)
    assert pool.host_tier is not None and pool.host_tier._policy is m._policy


def test_the_connectors_config_has_the_fields_the_view_reads():
    """The connector's own config classes carry the fields the view reads."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as s

    def fields(cls):  # a dataclass (0.26) or a NamedTuple (0.32)
        return getattr(cls, "_fields", None) or tuple(cls.__dataclass_fields__)

    assert "blocks_per_chunk" in fields(s.SchedulerOffloadConfig)
    assert "hashes_per_chunk" in fields(s.GroupOffloadConfig)
