"""The upstream kvcached API for SGLang: init, KV buffers, token/page manager, shutdown.

Every SGLang TP worker owns its pool, its KV buffers and its manager, so the
manager maps in its own process (world_size 1 for the ledger), whatever the
engine's TP size::

    init_kvcached(tp_rank, tp_size, pp_rank, device="cuda:0")   # or "cpu"
    k_buffers, v_buffers = alloc_kv_cache((size + page_size, heads, head_dim),
                                          dtype, device, num_layers, page_size)
    manager = get_kv_cache_manager(num_blocks=(size + page_size) // page_size,
                                   block_size=page_size,
                                   cell_size=heads * head_dim * itemsize,
                                   num_layers=num_layers)

A manager block is one SGLang page (``page_size`` tokens; one token when
page_size is 1); token ``t`` of block ``b`` is row ``b * page_size + t`` of
the buffers. Block 0 is held as SGLang's padding slot.

Every parameter keeps upstream's position and default (docs/COMPAT.md lists
where ours differ and why); what we add is keyword-only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from kvcached import kv_views, pool_registry
from kvcached.compat import runtime, snapshots
from kvcached.compat.upstream_manager import KVCacheManager
from kvcached.utils import configure_logging

ENGINE = "sglang"


def init_kvcached(
    tp_rank: int = 0,
    world_size: int = 1,
    pp_rank: int = 0,
    device: Optional[str] = None,
    async_sched: bool = False,
    *,
    is_worker: bool = True,
    tp_size: Optional[int] = None,
    page_size: Optional[int] = None,
) -> None:
    """Initializes kvcached in this SGLang worker process (idempotent).

    The TP size is recorded only: SGLang's ranks never map for each other
    (upstream starts a TP listener; ours needs none). ``is_worker`` is
    accepted for older callers: every SGLang rank is its own worker.
    ``page_size``: the data plane's page (default ``KVCACHED_PAGE_SIZE``), taken
    by the first call of the process.
    """
    configure_logging()
    if tp_size is not None:
        world_size = tp_size
    world_size = int(world_size)
    # Each rank is its own scheduler+worker: initialize the data plane here and
    # start no fan-out listener.
    runtime.init(ENGINE, 0, 1, True, device, bool(async_sched), int(pp_rank), page_size)
    runtime.state().tp_rank = int(tp_rank)
    runtime.state().world_size = world_size


def shutdown_kvcached() -> None:
    """Shuts down the managers made here and the data plane."""
    runtime.shutdown()
    pool_registry.clear_registered_kv_cache_pools(integration=ENGINE)


def alloc_kv_cache(
    kvcache_shape: Sequence[int],
    dtype,
    device: str = "cuda",
    num_layers: int = 1,
    page_size: int = 1,
    attention_type: str = "MHA",
    kv_layout: str = "NHD",
    group_id: int = 0,
) -> Union[Tuple[List[object], List[object]], List[object]]:
    """Creates per-layer token buffers of shape ``kvcache_shape`` = (num_tokens, heads, head_dim).

    MHA/GQA: returns (k_buffers, v_buffers), one tensor per layer each.
    MLA: returns kv_buffers (one per layer; shape (num_tokens, 1, latent_dim)).
    Rows of unmapped pages read zeros until the manager hands their block out.
    """
    runtime.require(ENGINE)
    if str(device).startswith("cuda") and ":" not in str(device):
        device = runtime.state().device  # SGLang passes "cuda" for the current device
    k, v, block_bytes, num_blocks = kv_views.sglang_views(
        kvcache_shape, dtype, device, num_layers, page_size, attention_type, kv_layout, group_id
    )
    kv = 2 if v else 1
    runtime.record_geometry(group_id, runtime.GroupGeometry(int(num_layers), kv, block_bytes, num_blocks, "tensors"))
    return (k, v) if v else k


def get_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    cell_size: int,
    num_layers: int,
    reserve_null_block: bool = True,
    num_kv_buffers: Optional[int] = None,
    group_id: int = 0,
    pool_name: Optional[str] = None,
    *,
    own_segment: Optional[bool] = None,
) -> KVCacheManager:
    """The manager of this rank's pool: blocks are SGLang pages of ``block_size`` tokens.

    ``num_kv_buffers`` defaults to the group's tensors (upstream's 2 if none
    were created here). The record: as vLLM's ``get_kv_cache_manager``.
    """
    runtime.require(ENGINE)
    return runtime.make_manager(
        num_blocks, block_size, cell_size, num_layers, reserve_null_block, num_kv_buffers, group_id, 1,
        pool_name=pool_name, own_segment=own_segment,
    )  # fmt: skip


def alloc_mamba_states(
    *,
    num_slots: int,
    num_mamba_layers: int,
    cache_params: Any,
    device: str,
    group_id: int = 0,
) -> Tuple[Any, Any, Dict[str, Any]]:
    """Mamba conv and temporal state tensors over kvcached pages (one slot = one block);
    see ``kvcached.compat.sglang_mamba``. Returns (conv_state, temporal_state, layout_info)."""
    from kvcached.compat import sglang_mamba

    runtime.require(ENGINE)
    if str(device).startswith("cuda") and ":" not in str(device):
        device = runtime.state().device
    cell, conv, temporal, info = sglang_mamba.alloc(num_slots, num_mamba_layers, cache_params, device, group_id)
    runtime.record_geometry(group_id, runtime.GroupGeometry(int(num_mamba_layers), 1, cell, int(num_slots), "tensors"))
    return conv, temporal, info


# Upstream's snapshot calls of this interface (kvcached.compat.snapshots).
_snapshots = snapshots.EngineSnapshots(ENGINE)
observability_snapshot = _snapshots.observability_snapshot
observability_snapshot_dict = _snapshots.observability_snapshot_dict
kv_cache_pool_snapshots = _snapshots.kv_cache_pool_snapshots
kv_cache_pool_snapshot_dicts = _snapshots.kv_cache_pool_snapshot_dicts
