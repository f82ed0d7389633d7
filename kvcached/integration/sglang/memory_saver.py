"""Scheduler seam: SGLang's memory saver (``--enable-memory-saver``) over kvcached's KV pools.

``Engine.release_memory_occupation(tags)`` (HTTP ``POST /release_memory_occupation``)
reaches every scheduler's ``SchedulerWeightUpdaterManager.release_memory_occupation``:
with the server idle, it marks the tags in ``offload_tags`` and, per tag, pauses
torch_memory_saver's region (``kv_cache``: then ``flush_cache``, which resets the radix
cache and clears the allocators; ``weights``: the model's state stashed first;
``cuda_graph``), then synchronises the device. ``resume_memory_occupation(tags)``
resumes the regions and unmarks the tags. No tags means all three.

kvcached's KV pools are not in the ``kv_cache`` region: their buffers are FTensors
(``pool.py`` overrides the buffer creation; the region only wraps SGLang's own
``torch`` allocations, and kvcached maps pages through the driver, not through the
allocator torch_memory_saver hooks). Pausing that region therefore frees only what
SGLang allocated there itself (the request-to-token table), as without kvcached,
and the KV memory is kvcached's to give back. So the updater is followed here, its
calls unchanged:

* after a release with ``kv_cache`` in ``offload_tags``: the flush has freed every
  block (the scheduler hook released the emptied pages), the device is
  synchronised, so the process's ``ElasticInstance`` sleeps: every pool capped at 0
  until the resume, nothing mapped, not even the padding slot's page (or a hybrid's
  dummy state slot's): the first allocation after the resume maps it first;
* after a resume that took ``kv_cache`` out of ``offload_tags``: the instance wakes,
  the limits apply again (one written meanwhile included), pages are mapped on demand.

Releasing ``weights`` or ``cuda_graph`` alone leaves the KV cache as it is, as SGLang
means the tags. A release that fails leaves kvcached where ``offload_tags`` says
(SGLang's idle assertion comes before any tag is marked); a resume that fails
leaves the KV asleep. The KV views keep their addresses, so CUDA graphs captured
on them stay valid.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

from kvcached.integration.patch_base import wrap_method

logger = logging.getLogger("kvcached.integration.sglang")

KV_TAG = "kv_cache"  # SGLang's GPU_MEMORY_TYPE_KV_CACHE


def kv_released(updater: Any) -> bool:
    """SGLang's own view: the updater has the ``kv_cache`` memory released."""
    return KV_TAG in (getattr(updater, "offload_tags", None) or ())


def follow(updater: Any) -> None:
    """kvcached's KV pools to SGLang's view: asleep exactly while ``kv_cache`` is released."""
    from kvcached.integration.sglang import scheduler_hooks
    from kvcached.integration.sglang.pool import elastic_groups, instance

    if not elastic_groups():
        return
    inst = instance()
    if kv_released(updater):
        if inst.asleep:
            return
        scheduler_hooks.release_all()  # spare slots back, every emptied page released (nothing runs)
        left = inst.sleep()
        logger.info("kvcached: %s KV cache released (asleep); %d KiB still mapped", inst.name, left >> 10)
    elif inst.asleep:
        inst.wake()
        logger.info("kvcached: %s KV cache resumed (pages mapped on demand)", inst.name)


def patch_weight_updater(module: ModuleType) -> None:
    """``SchedulerWeightUpdaterManager.release_memory_occupation`` / ``resume_memory_occupation``:
    SGLang's call, then kvcached follows ``offload_tags`` (also after a failure)."""

    def make(orig: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return orig(self, *args, **kwargs)
            finally:
                follow(self)

        return call

    cls = module.SchedulerWeightUpdaterManager
    wrap_method(cls, "release_memory_occupation", make)
    wrap_method(cls, "resume_memory_occupation", make)
