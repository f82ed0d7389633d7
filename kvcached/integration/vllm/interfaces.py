"""The upstream kvcached API for vLLM: init, KV tensors, block manager, shutdown.

Worker process::

    init_kvcached(tp_rank, world_size, is_worker=True)       # device: cuda:N, or cpu
    caches = alloc_kv_cache((2, num_blocks, block_size, heads, head_dim),
                            block_size, dtype, device, num_layers)

Scheduler process (the same process when the worker runs in it)::

    init_kvcached(tp_rank=0, world_size=world_size)
    manager = get_kv_cache_manager(num_blocks, block_size, cell_size, num_layers)

``cell_size`` is the bytes of one token in one K (or V) buffer of one layer
(``heads * head_dim * itemsize``), or in the single buffer for MLA and the
FlashInfer layout (``2 * heads * head_dim * itemsize`` there, with
``num_kv_buffers=1``). With ``device="cpu"`` everything runs on the host
backend.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from kvcached.integration import kv_views, runtime
from kvcached.kv_cache_manager import KVCacheManager

ENGINE = "vllm"


def init_kvcached(
    tp_rank: int = 0,
    world_size: int = 1,
    is_worker: bool = False,
    device: Optional[str] = None,
    async_sched: bool = False,
    pp_rank: int = 0,
    *,
    tp_size: Optional[int] = None,
) -> None:
    """Initializes kvcached in this vLLM process (idempotent).

    ``tp_size`` is the older upstream name of ``world_size``. ``device``
    defaults to the current CUDA device, or "cpu" without one.
    """
    if tp_size is not None:
        world_size = tp_size
    runtime.init(ENGINE, int(tp_rank), int(world_size), bool(is_worker), device, bool(async_sched), int(pp_rank))


def shutdown_kvcached() -> None:
    """Shuts down the managers made here, the worker listener and the data plane."""
    runtime.shutdown()


def alloc_kv_cache(
    kvcache_shape: Sequence[int],
    block_size: int,
    dtype,
    device: str,
    num_layers: int,
    attention_type: str = "MHA",
    kv_layout: str = "NHD",
    group_id: int = 0,
) -> List[object]:
    """Creates the KV tensors of one KV group; returns one tensor per layer.

    ``kvcache_shape`` is the attention backend's logical shape:
    (2, num_blocks, block_size, heads, head_dim) (FlashAttention),
    (num_blocks, 2, block_size, heads, head_dim) (FlashInfer), or
    (num_blocks, block_size, head_dim) with attention_type="MLA". Memory is
    mapped only where the manager hands out blocks; the rest reads zeros.
    Raises InvalidArgumentError for shapes, layouts or block sizes that
    cannot sit on kvcached pages, naming one that can.
    """
    runtime.require(ENGINE)
    tensors, kv, block_bytes, num_blocks = kv_views.vllm_views(
        kvcache_shape, block_size, dtype, device, num_layers, attention_type, kv_layout, group_id
    )
    runtime.record_geometry(group_id, runtime.GroupGeometry(int(num_layers), kv, block_bytes, num_blocks, "tensors"))
    return tensors


def get_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    cell_size: int,
    num_layers: int,
    reserve_null_block: bool = True,
    *,
    num_kv_buffers: Optional[int] = None,
    group_id: int = 0,
    defer_physical_release: bool = False,
    pool_name: Optional[str] = None,
    own_segment: bool = False,
    map_fn: Optional[Callable[[List[int]], None]] = None,
    unmap_fn: Optional[Callable[[List[int]], None]] = None,
) -> KVCacheManager:
    """The block manager of one KV group, for vLLM's scheduler.

    Block 0 is vLLM's null block and is held by the manager
    (``reserve_null_block``). ``num_kv_buffers`` defaults to the group's
    tensors (2 if none were created in this process). ``map_fn``/``unmap_fn``
    map in worker processes (default: the fan-out when world_size > 1, else
    this process).
    """
    st = runtime.require(ENGINE)
    return runtime.make_manager(
        num_blocks,
        block_size,
        cell_size,
        num_layers,
        reserve_null_block,
        num_kv_buffers,
        group_id,
        st.world_size,
        defer_physical_release=defer_physical_release,
        pool_name=pool_name,
        own_segment=own_segment,
        map_fn=map_fn,
        unmap_fn=unmap_fn,
    )
