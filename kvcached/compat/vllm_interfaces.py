"""The upstream kvcached API for vLLM: init, KV tensors, block manager, snapshots, shutdown.

Every parameter keeps upstream's position and default (docs/COMPAT.md lists
where ours differ and why); what we add is keyword-only.

Worker process::

    init_kvcached(tp_rank, world_size, pp_rank, is_worker=True)   # device: cuda:N, or cpu
    caches = alloc_kv_cache((2, num_blocks, block_size, heads, head_dim),
                            block_size, dtype, device, num_layers)

Scheduler process (the same process when the worker runs in it)::

    init_kvcached(tp_rank=0, world_size=world_size)
    manager = get_kv_cache_manager(num_blocks, block_size, cell_size, num_layers)

``cell_size`` is the bytes of one token in one K (or V) buffer of one layer
(``heads * head_dim * itemsize``), or in the single buffer for MLA and the
FlashInfer layout (``2 * heads * head_dim * itemsize`` there, with
``num_kv_buffers=1``). With ``device="cpu"`` everything runs on the host
backend. The manager gets a record (``kvctl list``) in the device budget
unless ``own_segment=False``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from kvcached import kv_views, pool_registry
from kvcached.compat import runtime, snapshots, vllm_kv
from kvcached.compat.upstream_manager import KVCacheManager
from kvcached.utils import configure_logging

ENGINE = "vllm"


def init_kvcached(
    tp_rank: int = 0,
    world_size: int = 1,
    pp_rank: int = 0,
    is_worker: bool = False,
    device: Optional[str] = None,
    async_sched: bool = False,
    *,
    tp_size: Optional[int] = None,
) -> None:
    """Initializes kvcached in this vLLM process (idempotent for the same device).

    ``tp_size`` is the older upstream name of ``world_size``. ``device``
    defaults to the current CUDA device, or "cpu" without one.
    """
    configure_logging()
    if tp_size is not None:
        world_size = tp_size
    runtime.init(ENGINE, int(tp_rank), int(world_size), bool(is_worker), device, bool(async_sched), int(pp_rank))


def shutdown_kvcached() -> None:
    """Shuts down the managers made here, the worker listener and the data plane."""
    runtime.shutdown()
    pool_registry.clear_registered_kv_cache_pools(integration=ENGINE)


def should_use_worker_ipc() -> bool:
    """True in a scheduler that maps through worker processes (upstream's name)."""
    st = runtime.state()
    return st.engine == ENGINE and st.device is not None and not st.is_worker


def get_world_size() -> int:
    """The world size given to init_kvcached; raises ShutdownError before it."""
    return runtime.require(ENGINE).world_size


def alloc_kv_cache(
    kvcache_shape: Sequence[int],
    block_size: int,
    dtype: Any,
    device: str,
    num_layers: int,
    attention_type: str = "MHA",
    kv_layout: str = "NHD",
    group_id: int = 0,
    kernel_block_size: Optional[int] = None,
    return_meta: bool = False,
) -> Any:
    """Creates the KV tensors of one KV group; returns one tensor per layer.

    ``kvcache_shape`` is the attention backend's logical shape:
    (2, num_blocks, block_size, heads, head_dim) (FlashAttention),
    (num_blocks, 2, block_size, heads, head_dim) (FlashInfer), or
    (num_blocks, block_size, head_dim) with attention_type="MLA". Memory is
    mapped only where the manager hands out blocks; the rest reads zeros.

    Upstream's additions (``kvcached.compat.vllm_kv``): ``kernel_block_size``
    gives views indexed by kernel block; ``attention_type="HYBRID_LINEAR"``
    returns ``(views, raw_info)`` with K and V interleaved per kernel block
    in one buffer (manager: ``num_kv_buffers=1``); ``return_meta`` appends the
    dict ``build_kv_views`` needs. Raises InvalidArgumentError for shapes,
    layouts or block sizes that cannot sit on kvcached pages, naming one that can.
    """
    runtime.require(ENGINE)
    shp = vllm_kv.Shape(kvcache_shape, block_size, attention_type)
    info = None
    if shp.atype == vllm_kv.HYBRID or shp.ratio(kernel_block_size) > 1 or return_meta:
        tensors, kv, block_bytes, num_blocks, info = vllm_kv.alloc(
            kvcache_shape, block_size, dtype, device, num_layers, attention_type, kv_layout, group_id, kernel_block_size
        )
    else:
        tensors, kv, block_bytes, num_blocks = kv_views.vllm_views(
            kvcache_shape, block_size, dtype, device, num_layers, attention_type, kv_layout, group_id
        )
    runtime.record_geometry(group_id, runtime.GroupGeometry(int(num_layers), kv, block_bytes, num_blocks, "tensors"))
    out: Tuple[Any, ...] = (tensors,) + (() if info is None else (info,))
    if return_meta:
        out += (vllm_kv.meta(group_id, num_blocks, int(num_layers), dtype),)
    return out[0] if len(out) == 1 else out


def build_kv_views(
    raw_kv_tensors: List[Any],
    kvcache_shape: Tuple[int, ...],
    block_size: int,
    dtype: Any,
    attention_type: str,
    num_blocks_per_layer: int,
    gpu_mem_bytes_per_layer_k_or_v: int,
    num_layers: int,
    kernel_block_size: Optional[int] = None,
) -> Tuple[List[Any], int]:
    """Views of another KV group over memory made by ``alloc_kv_cache(..., return_meta=True)``
    (pass its meta's fields); returns ``(views, bytes of one block over every K/V buffer)``."""
    from kvcached import _C

    shp = vllm_kv.Shape(kvcache_shape, block_size, attention_type)
    ratio = shp.ratio(kernel_block_size)
    contiguous = bool(_C.config()["contiguous_layout"])
    views = vllm_kv.views(
        raw_kv_tensors, shp, ratio, dtype, num_blocks_per_layer, gpu_mem_bytes_per_layer_k_or_v, num_layers, contiguous
    )
    kv = 1 if shp.form == "mla" else 2
    return views, kv * shp.block_size * shp.token_elems * kv_views._itemsize(dtype)


def get_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    cell_size: int,
    num_layers: int,
    num_kv_buffers: Optional[int] = None,
    group_id: int = 0,
    pool_name: Optional[str] = None,
    *,
    reserve_null_block: bool = True,
    defer_physical_release: bool = False,
    own_segment: Optional[bool] = None,
    map_fn: Optional[Callable[[List[int]], None]] = None,
    unmap_fn: Optional[Callable[[List[int]], None]] = None,
) -> KVCacheManager:
    """The block manager of one KV group, for vLLM's scheduler.

    Block 0 is vLLM's null block and is held by the manager
    (``reserve_null_block``). ``num_kv_buffers`` defaults to the group's
    tensors (upstream's 2 if none were created in this process).
    ``pool_name`` is upstream's label of the pool. The record: by default one
    named for the instance (``kvctl list``; upstream's ``_<k>`` suffix when
    taken) in the device budget; ``own_segment=True`` names it ``pool_name``;
    False: none. ``map_fn``/``unmap_fn`` map in worker processes (default: the
    fan-out when world_size > 1, else this process).
    """
    st = runtime.require(ENGINE)
    return runtime.make_manager(
        num_blocks, block_size, cell_size, num_layers, reserve_null_block, num_kv_buffers, group_id, st.world_size,
        defer_physical_release=defer_physical_release, pool_name=pool_name, own_segment=own_segment, map_fn=map_fn,
        unmap_fn=unmap_fn,
    )  # fmt: skip


# Upstream's snapshot calls of this interface (kvcached.compat.snapshots).
_snapshots = snapshots.EngineSnapshots(ENGINE)
observability_snapshot = _snapshots.observability_snapshot
observability_snapshot_dict = _snapshots.observability_snapshot_dict
kv_cache_pool_snapshots = _snapshots.kv_cache_pool_snapshots
kv_cache_pool_snapshot_dicts = _snapshots.kv_cache_pool_snapshot_dicts
