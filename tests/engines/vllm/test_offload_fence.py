"""The offload fence with vLLM's own classes: ``--kv-offloading-size`` (the native
``OffloadingConnector``) and kvcached's ElasticBlockPool (real manager -> IPC ->
worker listener -> FTensor, in this process, as in test_block_pool.py).

vLLM-CPU cannot run the connector's copies (``CPUOffloadingSpec.get_worker``
refuses a non-CUDA platform), so the jobs here are the ones its scheduler side
would build: real ``OffloadingConnectorMetadata`` / ``TransferJob`` /
``GPULoadStoreSpec`` through the patched ``OffloadingConnector`` methods, and the
workers' completions as real ``OffloadingWorkerMetadata`` in a
``KVConnectorOutput``. What is checked: a page whose blocks a store or load still
copies stays mapped until every worker reported the job, however vLLM freed or
evicted the blocks meanwhile; then it is unmapped."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from test_block_pool import _hash, _mapped, pool  # noqa: F401  (the fixture)

OFFC = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"


class _Sched:
    """The connector's scheduler side: returns the metadata the test gives it."""

    def __init__(self) -> None:
        self.meta = None
        self.outputs = []

    def build_connector_meta(self, scheduler_output):
        return self.meta

    def update_connector_output(self, out):
        self.outputs.append(out)

    def request_finished(self, request):
        return False, None


@pytest.fixture
def connector(pool):  # noqa: F811
    from kvcached.integration.vllm import offload
    from kvcached.integration.vllm.versions import apply_installed

    apply_installed((OFFC,))
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    c = object.__new__(OffloadingConnector)  # its constructor wants a whole engine config
    c.connector_scheduler = _Sched()
    scheduler = SimpleNamespace(connector=c, vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=2)))
    offload.attach(scheduler, pool)
    return c


def _meta(store=None, load=None):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    def job(blocks, gpu_is_src):
        gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
        host = SimpleNamespace(block_ids=list(range(len(blocks))))  # the host side: not kvcached's
        return TransferJob(req_id="r", src_spec=gpu if gpu_is_src else host, dst_spec=host if gpu_is_src else gpu)

    return OffloadingConnectorMetadata(
        load_jobs={j: job(b, False) for j, b in (load or {}).items()},
        store_jobs={j: job(b, True) for j, b in (store or {}).items()},
    )


def _done(**jobs):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={int(k[1:]): v for k, v in jobs.items()})
    )


def test_a_store_in_flight_keeps_freed_blocks_mapped_until_every_worker_finished(pool, connector):  # noqa: F811
    got = pool.get_new_blocks(8)
    ids = [b.block_id for b in got]
    pages = {i // 8 for i in ids}
    connector.connector_scheduler.meta = _meta(store={0: ids})
    assert connector.build_connector_meta(None) is connector.connector_scheduler.meta
    pool.free_blocks(got)  # the request finished: vLLM frees its blocks at once
    assert pages <= set(_mapped(pool))  # the store still reads them: nothing unmapped
    assert pool.num_in_use_blocks() == 0  # vLLM's own count: they are not vLLM's any more
    assert pool.get_num_free_blocks() == 64 - 1 - 8  # ...but cannot be handed out again
    connector.update_connector_output(_done(j0=1))  # one of two workers
    assert pages <= set(_mapped(pool))
    connector.update_connector_output(_done(j0=1))  # the second: the copy is over
    assert _mapped(pool) == [0] and pool.get_num_free_blocks() == 64 - 1
    assert len(connector.connector_scheduler.outputs) == 2  # vLLM's own handler still ran


def test_evicted_cached_blocks_wait_for_their_store(pool, connector):  # noqa: F811
    got = pool.get_new_blocks(8)
    for i, b in enumerate(got):
        _hash(pool, b, b"s%d" % i)
    ids = [b.block_id for b in got]
    connector.connector_scheduler.meta = _meta(store={5: ids})
    connector.build_connector_meta(None)
    pool.free_blocks(got)  # cached: evictable (the fixture's cache bound, 64 tokens, evicts some at once)
    pool.evict_cached(pool.free_block_queue.num_free_blocks)  # give-back (limit, peer, idle) evicts the rest...
    assert pool.free_block_queue.num_free_blocks == 0 and pool.num_in_use_blocks() == 0
    assert {i // 8 for i in ids} <= set(_mapped(pool))  # ...but the store is not done
    connector.update_connector_output(_done(j5=2))
    assert _mapped(pool) == [0]


def test_a_load_holds_the_blocks_it_writes(pool, connector):  # noqa: F811
    got = pool.get_new_blocks(4)
    ids = [b.block_id for b in got]
    connector.connector_scheduler.meta = _meta(load={1: ids})
    connector.build_connector_meta(None)
    pool.free_blocks(got)  # e.g. the request was aborted while loading
    assert {i // 8 for i in ids} <= set(_mapped(pool))
    connector.update_connector_output(_done(j1=2))
    assert _mapped(pool) == [0]


def test_a_finished_requests_blocks_wait_for_the_stores_built_one_step_later(pool, connector):  # noqa: F811
    got = pool.get_new_blocks(8)
    ids = [b.block_id for b in got]
    connector.request_finished_all_groups(SimpleNamespace(request_id="r"), (ids,))
    pool.free_blocks(got)  # freed at the request's end, its last store not yet built
    assert {i // 8 for i in ids} <= set(_mapped(pool))
    connector.connector_scheduler.meta = _meta(store={9: ids[4:]})  # the next schedule builds it
    connector.build_connector_meta(None)
    assert {i // 8 for i in ids[4:]} <= set(_mapped(pool))  # still copied
    connector.update_connector_output(_done(j9=2))
    assert _mapped(pool) == [0]


def test_a_store_that_never_finishes_keeps_its_page_and_is_named(pool, connector, caplog):  # noqa: F811
    from kvcached.integration.vllm.offload import _fence_of

    got = pool.get_new_blocks(8)
    ids = [b.block_id for b in got]
    connector.connector_scheduler.meta = _meta(store={3: ids})
    connector.build_connector_meta(None)
    pool.free_blocks(got)
    holds = _fence_of(connector).holds
    holds.timeout_s = 0.01
    import time

    time.sleep(0.02)
    connector.connector_scheduler.meta = _meta()
    with caplog.at_level(logging.ERROR, logger="kvcached.elastic"):
        connector.build_connector_meta(None)  # each step looks for late copies
    assert any("store job 3" in r.getMessage() for r in caplog.records)
    pool.backend.instance.give_back()  # an idle give-back: the page stays (fail closed)
    assert {i // 8 for i in ids} <= set(_mapped(pool))


def test_start_up_accepts_native_offloading_and_refuses_other_connectors():
    from kvcached.errors import InvalidArgumentError
    from kvcached.integration.vllm.backend import refuse_connector

    def cfg(connector, size=1.0, backend="native"):
        return SimpleNamespace(
            cache_config=SimpleNamespace(kv_offloading_size=size, kv_offloading_backend=backend),
            kv_transfer_config=None if connector is None else SimpleNamespace(kv_connector=connector),
        )

    refuse_connector(cfg(None, size=None))
    refuse_connector(cfg("OffloadingConnector"))  # --kv-offloading-size N (native)
    refuse_connector(cfg("OffloadingConnector", size=None))  # the same connector named in kv_transfer_config
    with pytest.raises(InvalidArgumentError, match="VLLM_USE_SIMPLE_KV_OFFLOAD"):
        refuse_connector(cfg("SimpleCPUOffloadConnector"))
    with pytest.raises(InvalidArgumentError, match="'lmcache' backend"):
        refuse_connector(cfg("LMCacheMPConnector", backend="lmcache"))
    with pytest.raises(InvalidArgumentError, match="NixlConnector"):
        refuse_connector(cfg("NixlConnector", size=None))


def test_attach_refuses_a_connector_it_does_not_fence(pool):  # noqa: F811
    from kvcached.errors import InvalidArgumentError
    from kvcached.integration.vllm import offload

    class NixlConnector:
        pass

    s = SimpleNamespace(connector=NixlConnector(), vllm_config=None)
    with pytest.raises(InvalidArgumentError, match="NixlConnector"):
        offload.attach(s, pool)
    offload.attach(SimpleNamespace(connector=None), pool)  # no connector: nothing to fence
    assert pool.transfers is None
