"""Engine seam: vLLM's sleep mode (``--enable-sleep-mode``) over kvcached's KV buffer.

vLLM's sleep is driven from the EngineCore: ``EngineCore.sleep(level)`` pauses
the scheduler (aborting, draining or preempting requests, then resetting the
prefix cache) and calls ``model_executor.sleep(level)``; every worker then
synchronises its device and has its sleep-mode backend (``CuMemAllocator``)
offload the ``weights`` pool to host memory (level 1) or discard it (level 2)
and discard the ``kv_cache`` pool. ``wake_up(tags)`` restores the pools named
(``weights``, ``kv_cache``; all by default) and resumes scheduling once none
sleeps. vLLM 0.31+ can also discard only the KV cache
(``EngineCore.release_kv_cache_memory`` -> ``model_executor.discard(("kv_cache",))``).
The executor's ``sleeping_tags`` says what sleeps.

kvcached's KV buffer is not in that pool: its virtual range and pages are
mapped by kvcached's own backend (``cuMemCreate`` / ``cuMemMap``, not the
torch allocator the pool hooks), so the allocator offloads only the weights
and discards only what vLLM itself allocated under the ``kv_cache`` tag
(attention metadata buffers), exactly as without kvcached. What the pool would
have freed (the KV memory) is kvcached's to give back, so the EngineCore's
executor is followed here, its calls unchanged:

* when ``kv_cache`` starts sleeping (``sleep(level)`` of either level, or
  ``discard`` of ``kv_cache``), every cached block is evicted (the pause has
  reset the prefix cache already; this keeps the pool consistent with KV
  contents that count as gone) and the instance sleeps
  (``ElasticInstance.sleep``): every emptied page released, the pool capped at
  0 until the wake, so nothing stays mapped, not even the page of vLLM's null block
  (no step runs before a wake and an allocation, which maps that page first).
  That runs after the workers' own sleep returned: they synchronised the
  device, so no step can still read a page;
* when ``kv_cache`` stops sleeping (``wake_up()`` or ``wake_up(["kv_cache"])``),
  the instance wakes: the limit applies again (one written while asleep
  included) and pages are mapped on demand by the next steps. ``wake_up(["weights"])``
  alone leaves the KV asleep and scheduling paused, as vLLM means it.

Fail closed: a sleep that finds blocks still held by requests (the pause did
not free them) is refused before anything changed, in one line. A sleep or
wake the workers fail leaves kvcached's state where vLLM's ``sleeping_tags``
say it is (the error reaches the caller). Nothing in the worker changes: the
KV views keep their addresses (CUDA graphs captured on them stay valid), and
a quantized cache zeroed after a wake (``post_kv_cache_wake_up``) writes zeros
over pages that read zeros anyway.

vLLM's sleep-mode backends other than ``cumem`` (registered by plugins:
process checkpoint, CRIU) are refused at start-up with kvcached
(``backend.refuse_unsupported``): they save and restore device state kvcached
maps behind their back.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import wrap_method
from kvcached.integration.vllm.block_pool import ElasticBlockPool

logger = logging.getLogger("vllm.kvcached")

KV_TAG = "kv_cache"  # vLLM's tag of the KV cache's memory (sleep, discard, wake_up)


class SleepRefused(InvalidArgumentError):
    """A sleep kvcached cannot do without losing blocks a request still holds."""


def kv_sleeping(executor: Any) -> bool:
    """vLLM's own view: the executor's ``kv_cache`` pool sleeps."""
    return KV_TAG in (getattr(executor, "sleeping_tags", None) or ())


def check_no_blocks_held(pool: ElasticBlockPool, what: str) -> None:
    """Refuses (one line, nothing changed) while a request still holds KV blocks."""
    held = pool.num_in_use_blocks()
    if held:
        raise SleepRefused(
            f"kvcached: cannot {what} while requests hold {held} KV blocks; sleep with mode 'abort' or 'wait' "
            "(vLLM's default pause frees them first), or finish the requests"
        )


def sleep_kv(pool: ElasticBlockPool) -> int:
    """The KV contents count as gone: evicts every cached block and puts the instance to
    sleep (cap 0, every emptied page released, the null block's too). Returns the bytes
    still mapped."""
    if pool.backend.instance.asleep:
        return pool.backend.instance.mapped_bytes()
    check_no_blocks_held(pool, "give the KV cache back")
    evicted = pool.evict_cached(pool.free_block_queue.num_free_blocks)
    left = pool.backend.instance.sleep()
    pool._avail_until = 0.0  # recount: nothing can be mapped now
    logger.info(
        "kvcached: %s KV cache asleep (%d cached blocks evicted); %d KiB still mapped",
        pool.backend.name,
        evicted,
        left >> 10,
    )
    return left


def wake_kv(pool: ElasticBlockPool) -> None:
    """The KV cache is awake: the limit applies again and pages are mapped on demand."""
    if not pool.backend.instance.asleep:
        return
    pool.backend.instance.wake()
    pool._avail_until = 0.0
    logger.info("kvcached: %s KV cache awake (pages mapped on demand)", pool.backend.name)


def follow(executor: Any, pool: ElasticBlockPool) -> None:
    """kvcached's KV state to vLLM's: asleep exactly while ``kv_cache`` sleeps."""
    if kv_sleeping(executor):
        sleep_kv(pool)
    else:
        wake_kv(pool)


def bind_executor(executor: Any, pool: ElasticBlockPool) -> None:
    """Wraps this executor's ``sleep``, ``wake_up`` and, where it has one (vLLM 0.31+),
    ``discard`` (instance attributes shadow the class's, as ``count_steps`` does for the
    scheduler): vLLM's call runs unchanged, then kvcached follows ``sleeping_tags``."""

    def guard_then_follow(orig: Callable[..., Any], what: str, tags_going: Callable[..., bool]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if tags_going(*args, **kwargs) and not kv_sleeping(executor):
                check_no_blocks_held(pool, what)
            try:
                return orig(*args, **kwargs)
            finally:
                # Also after a failure: the executor's tags say what vLLM now believes
                # (its discard marks the tags even when a worker failed).
                follow(executor, pool)

        return call

    executor.sleep = guard_then_follow(executor.sleep, "sleep", lambda *a, **k: True)
    executor.wake_up = guard_then_follow(executor.wake_up, "wake up", lambda *a, **k: False)
    if callable(getattr(executor, "discard", None)):  # vLLM 0.31+ (engine_core_kv_discard)

        def discarding_kv(tags: Any = (), *a: Any, **k: Any) -> bool:
            return KV_TAG in tuple(k.get("tags", tags) or ())

        executor.discard = guard_then_follow(executor.discard, "discard the KV cache", discarding_kv)


def patch_engine_core_sleep(module: ModuleType) -> None:
    """``EngineCore.__init__``: an EngineCore whose scheduler has an elastic pool binds
    its executor's sleep calls to it."""

    def make(init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            pool = getattr(getattr(getattr(self, "scheduler", None), "kv_cache_manager", None), "block_pool", None)
            executor = getattr(self, "model_executor", None)
            if isinstance(pool, ElasticBlockPool) and executor is not None:
                bind_executor(executor, pool)

        return __init__

    wrap_method(module.EngineCore, "__init__", make)
