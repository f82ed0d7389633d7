"""Elastic Mamba / linear-attention state for SGLang's hybrid models (Qwen3-Next,
Qwen3.5, Nemotron-H, Falcon-H1, ...).

SGLang keeps such a model's recurrent state beside the request-to-token pool
(``HybridReqToTokenPool``): a ``MambaPool`` with, per state kind, one tensor
``(num_mamba_layers, size + 1, *shape)`` (slot 0: the dummy slot padded requests
write to), and a ``MambaSlotAllocator`` that hands out one slot per request and
per state the prefix cache keeps. Here:

* ``ElasticMambaPool`` is SGLang's class with the same ``State`` shapes, but its
  tensors are strided views of one kvcached group. A slot's state of every layer
  is one block, ``[slot][layer][conv states..., temporal state]`` (slot-major, as
  SGLang's own envelope layout; the kernels read the slot and layer strides from
  the tensors), padded to a divisor of the kvcached page so every page holds
  whole slots. A slot larger than a page stops start-up naming the page size.
* ``ElasticMambaSlotAllocator`` hands slots out from that group's
  ``KVCacheManager``: a slot's page is mapped when the slot is taken, and
  released through the instance's fence when its last slot is freed (the
  scheduler hooks drive it, as for the KV pools). ``available_size()`` is the
  logical count SGLang's idle leak check adds up; ``schedulable_available_size()``
  (what admission reads) is what can be mapped now under the limit.

The state group is a pool of the process's ``ElasticInstance`` beside the
attention pool: its own record (``<name>_g<group>``, ``kvctl list`` / ``limit``),
the same device budget, release fence and idle give-back. SGLang clears a slot
before a request uses it (``mamba_needs_clear``), so fresh pages need no zeroing.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import torch
from sglang.srt.mem_cache import memory_pool as _memory_pool
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.memory_pool import MambaPool

from kvcached import _C, kv_views, vmm_ops
from kvcached.compat.sglang_mamba import StateLayout, smallest_divisor_at_least
from kvcached.integration.sglang import conflicts
from kvcached.integration.sglang import pool as _pool

logger = logging.getLogger("kvcached.integration.sglang")

_INT64 = torch.int64

# MambaPool options that add per-slot buffers (or another layout) kvcached does not map.
_UNSUPPORTED_OPTIONS = {
    "speculative_num_draft_tokens": "speculative decoding keeps per-draft-token state buffers",
    "enable_linear_replayssm": "--enable-linear-replayssm keeps ring buffers per slot",
    "enable_linear_replayssm_spec": "--enable-linear-replayssm-spec keeps ring buffers per slot",
    "envelope_layout": "--mamba-envelope-layout lays the state out itself (kvcached's layout is slot-major already)",
}


def _refuse_options(device: Any, kwargs: dict) -> None:
    for name, why in _UNSUPPORTED_OPTIONS.items():
        if kwargs.get(name) not in (None, False):
            raise conflicts.refuse(f"the Mamba state pool: {why}", "drop that option to serve with kvcached")
    # As for vLLM's state blocks: proven on the CPU engines only (the family table says where).
    conflicts.refuse_unproven_on_device(MambaPool.__name__, device)
    if str(device).startswith("cpu") and getattr(_memory_pool, "_cpu_has_amx_support", False):
        raise conflicts.refuse(
            "SGLang's AMX CPU kernels re-lay the Mamba conv state (_init_amx_conv_state)",
            "serve without kvcached on an AMX CPU",
        )


class ElasticMambaPool(MambaPool):
    """MambaPool over kvcached: SGLang's shapes and methods, slots mapped on demand."""

    kvcached_group: Optional[_pool.ElasticGroup] = None

    def __init__(self, *, size: int, cache_params: Any, mamba_layer_ids: Any, device: str, **kwargs: Any) -> None:
        _refuse_options(device, kwargs)
        # SGLang's own constructor sets every attribute of this release; at size 0
        # its state tensors hold only the dummy slot, and are replaced below (its
        # "Mamba Cache is allocated ... size: 0" line is held back: ours follows).
        quiet = logging.getLogger(MambaPool.__module__)
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            super().__init__(
                size=0, cache_params=cache_params, mamba_layer_ids=mamba_layer_ids, device=device, **kwargs
            )
        finally:
            quiet.setLevel(level)
        self.size = int(size)
        self.kvcached_group, conv, temporal = create_state_group(self, cache_params, len(mamba_layer_ids))
        self.mamba_cache = self.State(conv=conv, temporal=temporal)
        # Decisions 0.5.2x caches from the tensors (the fused CUDA slot kernels want
        # contiguous conv state): made on the size-0 ones, they must be made again.
        for cached in ("_conv_fuse_ok", "_conv_slot_desc"):
            self.__dict__.pop(cached, None)
        self.mem_usage = self.mamba_cache.mem_usage_bytes() / (1 << 30)


def create_state_group(pool: MambaPool, cache_params: Any, num_layers: int) -> Any:
    """The group, manager and record of a Mamba pool; returns (group, conv views, temporal view)."""
    lay = StateLayout(cache_params)
    raw_entry = num_layers * lay.cell
    device, ranks = _pool.start_group(pool.device, raw_entry)
    page = int(_C.config()["page_size"])
    if raw_entry > page:
        raise conflicts.refuse(
            f"one Mamba slot holds {raw_entry} bytes of state ({num_layers} layers x {lay.cell}), more than "
            f"the kvcached page ({page} bytes)",
            f"raise KVCACHED_PAGE_SIZE to at least {raw_entry} (a multiple of the backend granularity, 2 MiB on a GPU)",
        )
    entry = smallest_divisor_at_least(page, raw_entry)
    num_slots = pool.size + 1  # slot 0: SGLang's dummy slot, the manager's null block (always mapped)
    views: List[Any] = []

    def make_views(gid: int) -> Tuple[List[Any], List[Any]]:
        kv_views.unit_views(num_slots, entry, 1, torch.int8, device, 1, gid)
        raw = vmm_ops.get_raw_kv_tensors(gid)[0]
        views.extend(lay.views(raw, (num_layers, num_slots), lay.cell, entry))
        return [raw], []

    # SGLang builds the state pool first; group 0 (the record named KVCACHED_IPC_NAME)
    # stays the attention KV's, the state's record is <name>_g<group>.
    grp = _pool.add_group(
        type(pool).__name__,
        ranks,
        first_gid=1,
        make_views=make_views,
        num_blocks=num_slots,
        block_tokens=1,
        row_bytes=entry,
        num_layers=1,
        kv=1,
        buffer_rows=num_slots,
    )
    mgr = grp.manager
    logger.info(
        "kvcached: elastic %s %r: %d slots of %d bytes (%d layers), %.1f MiB virtual, record %s",
        grp.pool_class,
        grp.group_id,
        pool.size,
        entry,
        num_layers,
        mgr.geometry.num_pages * mgr.bytes_per_page / (1 << 20),
        grp.record_name,
    )
    conv, temporal = views
    return grp, conv, temporal


class ElasticMambaSlotAllocator(MambaSlotAllocator):
    """MambaSlotAllocator over the state group's KVCacheManager (one block per slot).

    Slots are taken per request, not per token, so every call goes to the manager
    (no local free list); the held slots are remembered only to answer
    ``free_slots`` (SGLang's leak report reads it)."""

    def __init__(self, group: _pool.ElasticGroup, size: int, device: str) -> None:
        self.kvcached_group = group
        self._mgr = group.manager
        self._held: set = set()
        # The scheduler's prefix cache (scheduler_hooks.after_init): its unlocked states
        # are evicted when a slot cannot be mapped (a limit lowered since admission).
        self.kvcached_tree_cache: Any = None
        super().__init__(size=size, device=device)  # calls clear()

    def available_size(self) -> int:
        # Logical, as SGLang's own: slots not handed out (the idle leak check adds it up).
        return self.size - len(self._held)

    def schedulable_available_size(self) -> int:
        """Slots that can be taken now: free on mapped pages, or on pages the limit lets map."""
        return min(self.available_size(), self._mgr.available_size())

    def _do_alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size <= 0:
            return torch.empty((0,), dtype=_INT64, device=self.device)
        ids = self._mgr.alloc(need_size)
        if ids is None and self._evict_states(need_size):
            ids = self._mgr.alloc(need_size)
        if ids is None:
            return None  # SGLang's own answer for a full pool
        self._held.update(ids)
        return torch.tensor(ids, dtype=_INT64, device=self.device)

    def _evict_states(self, need_size: int) -> bool:
        """Admission counted these slots as free, but they cannot be mapped now (the limit or
        the device budget fell since): evicts unlocked cached states (SGLang's LRU) to free
        slots on mapped pages. True if any went."""
        tree = self.kvcached_tree_cache
        if tree is None or not tree.supports_mamba() or tree.mamba_evictable_size() <= 0:
            return False
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        res = tree.evict(EvictParams(mamba_num=int(need_size)))
        return int(getattr(res, "mamba_num_evicted", 0) or 0) > 0

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            ids = free_index.reshape(-1).tolist()
            self._mgr.free(ids)  # refuses a double free before anything changes
            self._held.difference_update(ids)

    def clear(self) -> None:
        # Flush (and construction): every slot back; pages retire until the fence releases them.
        self._alloc_iter = None
        self._mgr.clear()
        self._held.clear()

    @property
    def free_slots(self) -> torch.Tensor:
        held = self._held
        free = [s for s in range(1, self.size + 1) if s not in held]
        return torch.tensor(free, dtype=_INT64, device=self.device)

    @free_slots.setter
    def free_slots(self, value: Any) -> None:
        pass  # SGLang's own clear() would rebuild its list; the manager is the list here


def bind_allocator(req_pool: Any) -> None:
    """After ``HybridReqToTokenPool._init_mamba_pool``: an elastic state pool gets the elastic
    slot allocator (SGLang built its own free list, sized for the same slots)."""
    mp = getattr(req_pool, "mamba_pool", None)
    grp = getattr(mp, "kvcached_group", None)
    if grp is None:
        return
    for side in ("short_conv_pool", "ngram_pool"):
        if getattr(getattr(req_pool, side, None), "enabled", False):
            raise conflicts.refuse(
                f"the model keeps per-slot side state ({side}) kvcached does not map", "serve it without kvcached"
            )
    if getattr(req_pool, "mamba_ckpt_pool", None) is not None:
        raise conflicts.refuse("--enable-int8-mamba-checkpoint keeps a second state pool", "drop that option")
    req_pool.mamba_allocator = ElasticMambaSlotAllocator(grp, size=mp.size, device=req_pool.device)
