"""Offload seam: vLLM's native KV offloading (``--kv-offloading-size``, the ``OffloadingConnector``).

vLLM 0.26-0.32 (the same protocol in each, read from their sources): the
connector's scheduler side numbers transfer jobs and sends them to the workers
in the step's ``OffloadingConnectorMetadata`` (``store_jobs`` / ``load_jobs``:
job id -> ``TransferJob(req_id, src_spec, dst_spec)``, the GPU side a
``GPULoadStoreSpec`` of block ids). A worker submits a store at the start of the
next step and lets it run across later steps; each worker reports a job it has
finished in a later step's ``KVConnectorOutput.kv_connector_worker_meta``
(``OffloadingWorkerMetadata.completed_jobs``: job id -> workers, summed over the
workers); a job is done when all ``world_size`` workers reported it. vLLM frees a
finished request's blocks at once (``request_finished`` returns False) and builds
the request's last store jobs at the *next* schedule, reading blocks already
freed; it only flushes a pending store when one of its blocks is handed out
again. Its own fence protects block reuse, not the memory under a free block.

kvcached's fence therefore takes the jobs in (``kvcached.elastic.transfers``):

* ``build_connector_meta``: every job of the step holds its GPU blocks until done;
  the blocks a finished request left (``request_finished*``) are held from its
  end until this call has built its last jobs;
* ``update_connector_output``: the completions reported by the workers end the
  holds; blocks vLLM freed meanwhile go to the ledger only now, their pages
  empty and the step fence releases them after the steps that follow;
* a job that never finishes keeps its pages mapped (``KVCACHED_TRANSFER_TIMEOUT``
  names it once, in one error line). A worker whose transfer fails stops the
  engine (vLLM asserts ``success``): its pages die with the process.

The patch wraps the ``OffloadingConnector`` class (every call passes through
when the connector is not attached to a kvcached pool); ``attach`` is called by
the Scheduler patch once the scheduler, its connector and its pool exist.
Other connectors (``SimpleCPUOffloadConnector``, LMCache, NIXL, ...) stay
refused at start-up (``backend.refuse_unsupported``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable, Iterable, List

from kvcached.config import transfer_timeout_s
from kvcached.elastic.transfers import TransferHolds
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import call_after
from kvcached.integration.vllm.host_tier import HostTierView

logger = logging.getLogger("vllm.kvcached")

# The connector class names kvcached fences (kv_transfer_config.kv_connector).
FENCED_CONNECTORS = ("OffloadingConnector",)
_MARK = "_kvcached_offload_fenced"
_ATTR = "_kvcached_offload"


def gpu_block_ids(job: Any) -> List[int]:
    """The GPU blocks a ``TransferJob`` reads (store: src) or writes (load: dst)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    out: List[int] = []
    for spec in (getattr(job, "src_spec", None), getattr(job, "dst_spec", None)):
        if isinstance(spec, GPULoadStoreSpec):
            out += [int(b) for b in spec.block_ids]
    return out


def _flat(block_ids: Any) -> Iterable[int]:
    """``request_finished``'s ``list[int]`` or ``request_finished_all_groups``' tuple of lists."""
    for x in block_ids or ():
        if isinstance(x, (list, tuple)):
            yield from (int(b) for b in x)
        else:
            yield int(x)


class OffloadFence:
    """The holds of one scheduler's offloading connector on its ElasticBlockPool."""

    def __init__(self, pool: Any, workers: int) -> None:
        self.pool = pool
        self.workers = max(1, int(workers))
        self.holds = TransferHolds(transfer_timeout_s(), name=getattr(pool.backend, "name", ""))

    def request_finished(self, block_ids: Any) -> None:
        self.holds.hold_until_built(_flat(block_ids))

    def built(self, meta: Any) -> None:
        h = self.holds
        for kind, jobs in (("store", getattr(meta, "store_jobs", None)), ("load", getattr(meta, "load_jobs", None))):
            for job_id, job in (jobs or {}).items():
                h.begin(job_id, gpu_block_ids(job), self.workers, kind)
        self.pool.release_held(h.built())
        h.overdue()

    def completed(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        done = getattr(meta, "completed_jobs", None)
        if not done:
            return
        free: List[int] = []
        for job_id, count in done.items():
            free += self.holds.finished(job_id, int(count))
        self.pool.release_held(free)


def _fence_of(connector: Any) -> Any:
    return getattr(connector, _ATTR, None)


def _after_fenced(cls: type, name: str, call: Callable[..., None]) -> None:
    """``cls.name``, then ``call(fence, result, *args, **kwargs)`` when the connector is attached."""

    def after(self: Any, out: Any, *args: Any, **kwargs: Any) -> None:
        f = _fence_of(self)
        if f is not None:
            call(f, out, *args, **kwargs)

    call_after(cls, name, after)


def patch_offloading_connector(module: ModuleType) -> None:
    """``OffloadingConnector``: its jobs and completions feed the pool's holds (when attached)."""
    cls = module.OffloadingConnector
    _after_fenced(cls, "build_connector_meta", lambda f, meta, *_a, **_k: f.built(meta))
    _after_fenced(cls, "update_connector_output", lambda f, _out, connector_output: f.completed(connector_output))
    for name in ("request_finished", "request_finished_all_groups"):
        if name in cls.__dict__:
            _after_fenced(cls, name, lambda f, _out, request, block_ids, *_a, **_k: f.request_finished(block_ids))
    setattr(cls, _MARK, True)


def attach(scheduler: Any, pool: Any) -> None:
    """After the Scheduler was built: its offloading connector's jobs hold the pool's blocks.
    A connector kvcached does not fence stops start-up (it would copy pages the fence may unmap)."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return
    name = type(connector).__name__
    if name not in FENCED_CONNECTORS or not getattr(type(connector), _MARK, False):
        raise InvalidArgumentError(
            f"kvcached does not support the KV connector {name}: it copies blocks outside the scheduler's "
            f"steps and kvcached's release fence does not know its jobs (fenced: {', '.join(FENCED_CONNECTORS)}); "
            "unset ENABLE_KVCACHED or use --kv-offloading-size with the native backend"
        )
    workers = int(getattr(scheduler.vllm_config.parallel_config, "world_size", 1) or 1)
    fence = OffloadFence(pool, workers)
    setattr(connector, _ATTR, fence)
    pool.transfers = fence.holds
    pool.host_tier = HostTierView.of_connector(connector)
    logger.info(
        "kvcached: %s: offload copies (%s) fenced: a page is unmapped only after they finish", pool.backend.name, name
    )
