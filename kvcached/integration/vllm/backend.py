"""The scheduler-side kvcached state of one vLLM instance (EngineCore process).

While vLLM's ``Scheduler`` is being built, its coordinator constructs the
``BlockPool``; the patched name builds an ``ElasticBlockPool``, which calls
``VllmBackend.create`` here. That

* removes what crashed instances left behind (``kvcached.elastic.cleanup``);
* builds the ``KVCacheManager`` over the KV buffer's logical pages
  (``kv_layout``) with the worker fan-out (``kvcached.ipc.TPCoordinator``) as
  its mapper: the workers are separate processes, even at TP=1 on CPU;
* gives it the instance's record and limit (``kvctl list`` / ``kvctl limit``),
  so every page it maps is admitted by the shared device budget;
* wraps both in a ``kvcached.elastic.ElasticInstance``: the release fence
  (a page is released only after every step that could read it finished),
  wants to peers, and idle give-back.

The pool learns which scheduler it belongs to through ``building_pools``:
vLLM constructs the pool by class name deep inside the Scheduler, so the
Scheduler patch opens that context around its constructor (tests and the
benchmark open it themselves).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from kvcached import naming
from kvcached.devices import normalize_device
from kvcached.elastic import ElasticInstance, ElasticPool
from kvcached.elastic.cleanup import cleanup_dead_instances
from kvcached.errors import InvalidArgumentError

logger = logging.getLogger("vllm.kvcached")


@dataclass
class PoolContext:
    """What the block pool needs from the Scheduler being built."""

    vllm_config: Any
    kv_cache_config: Any


_ctx = threading.local()


@contextlib.contextmanager
def building_pools(vllm_config: Any, kv_cache_config: Any) -> Iterator[PoolContext]:
    """The next ``ElasticBlockPool`` built in this thread belongs to this scheduler."""
    ctx = PoolContext(vllm_config, kv_cache_config)
    _ctx.value = ctx
    try:
        yield ctx
    finally:
        _ctx.value = None


def take_pool_context() -> Optional[PoolContext]:
    """The context of the Scheduler being built in this thread (consumed: one pool per scheduler)."""
    ctx = getattr(_ctx, "value", None)
    _ctx.value = None
    return ctx


def _device_of(vllm_config: Any) -> str:
    return normalize_device(getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu")


def refuse_unsupported(vllm_config: Any) -> None:
    """Configurations kvcached cannot serve stop start-up with one line naming the option
    (called while the Scheduler is built, before any KV page is mapped)."""
    pc = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, attr, 1) or 1) > 1:
            raise InvalidArgumentError(f"kvcached does not support {attr} > 1 yet; unset ENABLE_KVCACHED")
    model = getattr(vllm_config, "model_config", None)
    sleep_backend = getattr(model, "sleep_mode_backend", "cumem") or "cumem"
    if getattr(model, "enable_sleep_mode", False) and sleep_backend != "cumem":
        # The cumem backend offloads only what vLLM allocated in its pool (sleep_mode.py);
        # others save and restore device state, which would include kvcached's mappings.
        raise InvalidArgumentError(
            f"kvcached supports vLLM's sleep mode with the 'cumem' backend only, not {sleep_backend!r} "
            "(sleep_mode_backend): it would save and restore KV memory kvcached maps; use cumem or unset "
            "ENABLE_KVCACHED"
        )
    refuse_connector(vllm_config)


def refuse_connector(vllm_config: Any) -> None:
    """KV connectors copy blocks outside the scheduler's steps. vLLM's native offloading
    (``--kv-offloading-size``, backend ``native``: the ``OffloadingConnector``) is fenced
    (``offload.py``); every other connector stops start-up."""
    from kvcached.integration.vllm.offload import FENCED_CONNECTORS

    cache = getattr(vllm_config, "cache_config", None)
    offloading = getattr(cache, "kv_offloading_size", None) is not None
    backend = getattr(cache, "kv_offloading_backend", "native") if offloading else None
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None and not offloading:
        return
    connector = getattr(ktc, "kv_connector", None)
    if connector in FENCED_CONNECTORS:
        return
    if offloading:
        why = (
            "VLLM_USE_SIMPLE_KV_OFFLOAD=1 picks SimpleCPUOffloadConnector, whose copies kvcached does not fence; "
            "unset it"
            if connector == "SimpleCPUOffloadConnector"
            else f"the {backend!r} backend ({connector}) copies blocks outside the scheduler's steps and kvcached "
            "does not fence its copies; use --kv-offloading-backend native"
        )
        raise InvalidArgumentError(
            f"kvcached supports KV offloading (--kv-offloading-size) with vLLM's native OffloadingConnector only: "
            f"{why}, or unset ENABLE_KVCACHED"
        )
    raise InvalidArgumentError(
        f"kvcached does not support the KV connector {connector!r} (kv_transfer_config): it reads blocks outside "
        "the scheduler's steps, so a page could be unmapped under a transfer; kvcached fences "
        f"{', '.join(FENCED_CONNECTORS)} (--kv-offloading-size N) only; unset ENABLE_KVCACHED"
    )


class VllmBackend:
    """Layout plan, manager, limits, worker fan-out and elastic runtime of one vLLM instance's KV pool."""

    def __init__(self, plan: Any, manager: Any, coordinator: Any, name: str) -> None:
        self.plan = plan
        self.manager = manager
        self.limits = manager.limits
        self.coordinator = coordinator
        self.name = name
        self.pool = ElasticPool(manager, self.limits, name)
        self.instance = ElasticInstance(name, [self.pool])
        self.fence = self.instance.fence
        self._closed = False

    @classmethod
    def create(cls, ctx: PoolContext, num_blocks: int) -> VllmBackend:
        from kvcached.compat.upstream_manager import KVCacheManager
        from kvcached.integration.patch_base import summary_of
        from kvcached.integration.vllm.kv_layout import KVLayoutPlan
        from kvcached.ipc.coordinator import TPCoordinator
        from kvcached.manager_setup import limits_factory

        vc = ctx.vllm_config
        refuse_unsupported(vc)
        plan = KVLayoutPlan.for_engine(ctx.kv_cache_config)
        page = plan.page_size
        if plan.num_blocks != num_blocks:
            raise InvalidArgumentError(
                f"kvcached: the block pool has {num_blocks} blocks but the KV cache config {plan.num_blocks}"
            )
        pc = vc.parallel_config
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        name = naming.dp_name(naming.instance_name("vllm"), dp_rank, dp_size)
        device = _device_of(vc)
        cleanup_dead_instances()
        coordinator = TPCoordinator(tp, pp_size=pp, pp_rank=-1, ipc_name=name, group_id=0)
        try:
            manager = KVCacheManager(
                num_blocks,
                plan.block_tokens,
                plan.cell_size,
                plan.physical_pages_per_logical_page(),
                world_size=tp * pp,
                pp_rank=-1,
                reserve_null_block=True,  # vLLM's null block 0: never freed; its page goes only idle
                num_kv_buffers=1,
                group_id=0,
                pool_name=name,
                defer_physical_release=True,  # released by the fence, after every step that could read a page
                mapper=coordinator,  # the workers map: separate processes, even at TP=1
                # The instance's record: kvctl shows and caps it; every page
                # the manager maps is admitted by the shared device budget.
                limits=limits_factory(engine="vllm", device=device, name=name, group_id=0),
                release_barrier=None,  # the fence orders release after execution
                page_size=page,
                device=device,
            )
        except BaseException:
            coordinator.close()
            raise
        backend = cls(plan, manager, coordinator, name)
        logger.info(
            "kvcached: instance %s on %s, %d blocks (%d tokens each) over %d pages of %d KiB x %d; limit %.1f MiB. %s",
            name,
            device,
            num_blocks,
            plan.block_tokens,
            plan.num_logical_pages,
            page >> 10,
            plan.physical_pages_per_logical_page(),
            backend.limits.limit / (1 << 20),
            summary_of("vLLM"),
        )
        return backend

    def after_free(self) -> None:
        self.fence.after_free()

    def pages_over_limit(self) -> int:
        return self.pool.pages_over_limit()

    def live_pages_over_limit(self) -> int:
        """Pages still holding a block beyond the limit (emptied pages excluded:
        they go at the next fence)."""
        return self.pool.live_pages_over_limit()

    def close(self) -> None:
        """Removes the record and closes the connections. The workers are gone
        or going (vLLM stops them first), so nothing is unmapped remotely:
        their pages die with them."""
        if self._closed:
            return
        self._closed = True
        self.instance.close()
        try:
            self.limits.close()
        finally:
            self.coordinator.close()
