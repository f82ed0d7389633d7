"""Read-only snapshots of the engine integration and of each live KV pool
(upstream's ``kvcached.observability``: same schema, field names and meanings).

``KVCacheManager.observability_snapshot()`` takes a pool's snapshot under the
manager's lock (one consistent instant); ``build_kv_cache_pool_snapshot``
also accepts any manager-like object with upstream's attributes. The
snapshots are policy-free: reading them changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional

from kvcached.pool_registry import get_registered_kv_cache_pools

SCHEMA_VERSION = "kvcached.observability.v1"


@dataclass(frozen=True)
class RuntimeSnapshot:
    """What an engine interface was initialized with in this process."""

    schema_version: str
    engine: str
    initialized: bool
    device: Optional[str]
    world_size: int
    pp_rank: int
    async_sched: bool
    contiguous_layout: bool
    is_worker: Optional[bool] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KVCachePoolSnapshot:
    """One KV pool. Block counts overlap (do not sum them): ``allocated_blocks``
    are handed out (reserved and null blocks included), ``reserved_blocks`` the
    part set aside by ``try_to_reserve``, ``available_blocks`` what ``alloc``
    would give now (reserved ones included). ``*_pages`` count physical pages of
    the page allocator (``reserved_pages``: its mapped reserve, unrelated to
    reserved blocks). ``virtual_per_layer_bytes`` covers every K/V buffer of one
    layer; ``mapped_bytes`` the pages holding blocks, over all layers and buffers.
    """

    schema_version: str
    pool_type: str
    integration: Optional[str]
    pool_name: Optional[str]
    group_id: int
    num_layers: int
    num_kv_buffers: int
    page_size_bytes: int
    block_size_bytes: int
    total_blocks: int
    available_blocks: int
    allocated_blocks: int
    reserved_blocks: int
    available_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    null_block_reserved: bool
    virtual_per_layer_bytes: int
    virtual_total_bytes: int
    mapped_bytes: int
    total_pages: Optional[int]
    free_pages: Optional[int]
    inuse_pages: Optional[int]
    reserved_pages: Optional[int]
    available_physical_pages: Optional[int]
    effective_free_pages: Optional[int]
    in_shrink: bool
    shrink_target_blocks: Optional[int]
    resize_target_bytes: Optional[int]

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def get_capabilities() -> Dict[str, Any]:
    """The observability surface this package exposes (JSON-serializable)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "features": {
            "runtime_snapshot": True,
            "kv_cache_pool_snapshot": True,
            "registered_kv_cache_pool_snapshots": True,
            "read_only": True,
            "policy_control": False,
        },
        "pool_snapshot_fields": [f.name for f in fields(KVCachePoolSnapshot)],
        "runtime_snapshot_fields": [f.name for f in fields(RuntimeSnapshot)],
    }


def build_runtime_snapshot(
    *,
    engine: str,
    initialized: bool,
    device: Optional[str],
    world_size: int,
    pp_rank: int,
    async_sched: bool,
    contiguous_layout: bool,
    is_worker: Optional[bool] = None,
) -> RuntimeSnapshot:
    return RuntimeSnapshot(
        SCHEMA_VERSION, engine, initialized, device, world_size, pp_rank, async_sched, contiguous_layout, is_worker
    )


def _call(obj: Any, name: str) -> Optional[int]:
    fn = getattr(obj, name, None)
    return None if fn is None else int(fn())


def _attr(obj: Any, name: str) -> int:
    return int(getattr(obj, name, None) or 0)


def pool_snapshot(
    m: Any,
    *,
    integration: Optional[str],
    pages: Dict[str, Optional[int]],
    available_blocks: int,
    allocated_blocks: int,
    reserved_blocks: int,
    mapped_bytes: int,
    in_shrink: bool,
    shrink_target_blocks: Optional[int],
    resize_target_bytes: Optional[int],
) -> KVCachePoolSnapshot:
    """The snapshot of pool ``m`` from counts already read (the byte fields are derived here).

    ``pages``: total_pages, free_pages, inuse_pages, reserved_pages,
    available_physical_pages (each None when unknown).
    """
    layers, kv = _attr(m, "num_layers"), _attr(m, "num_kv_buffers")
    block = _attr(m, "block_mem_size")
    per_block = block * layers * kv
    free, reserve, phys = pages["free_pages"], pages["reserved_pages"], pages["available_physical_pages"]
    effective = None if free is None or reserve is None or phys is None else min(free, phys + reserve)
    avail, alloced = max(int(available_blocks), 0), max(int(allocated_blocks), 0)
    per_layer = _attr(m, "mem_size") * kv
    return KVCachePoolSnapshot(
        schema_version=SCHEMA_VERSION,
        pool_type="kv_cache",
        integration=integration,
        pool_name=getattr(m, "pool_name", None),
        group_id=_attr(m, "group_id"),
        num_layers=layers,
        num_kv_buffers=kv,
        page_size_bytes=_attr(m, "page_size"),
        block_size_bytes=block,
        total_blocks=_attr(m, "num_blocks"),
        available_blocks=avail,
        allocated_blocks=alloced,
        reserved_blocks=reserved_blocks,
        available_bytes=avail * per_block,
        allocated_bytes=alloced * per_block,
        reserved_bytes=reserved_blocks * per_block,
        null_block_reserved=getattr(m, "null_block", None) is not None,
        virtual_per_layer_bytes=per_layer,
        virtual_total_bytes=per_layer * layers,
        mapped_bytes=int(mapped_bytes),
        total_pages=pages["total_pages"],
        free_pages=free,
        inuse_pages=pages["inuse_pages"],
        reserved_pages=reserve,
        available_physical_pages=phys,
        effective_free_pages=effective,
        in_shrink=bool(in_shrink),
        shrink_target_blocks=shrink_target_blocks,
        resize_target_bytes=resize_target_bytes,
    )


def build_kv_cache_pool_snapshot(manager: Any, *, integration: Optional[str] = None) -> KVCachePoolSnapshot:
    """A snapshot of ``manager``: ours (its own ``observability_snapshot``), or any
    manager-like object with upstream's attributes and page-allocator getters."""
    own = getattr(manager, "_observability_counts", None)
    if own is not None:
        return pool_snapshot(manager, integration=integration, **own())
    pa = manager.page_allocator
    state = pa.get_page_state() if callable(getattr(pa, "get_page_state", None)) else None
    keys = ("total_pages", "free_pages", "inuse_pages", "reserved_pages")
    getters = ("get_num_total_pages", "get_num_free_pages", "get_num_inuse_pages", "get_num_reserved_pages")
    if state is None:
        pages = {k: _call(pa, g) for k, g in zip(keys, getters)}
    else:
        pages = {k: int(state[k]) for k in keys}
    pages["available_physical_pages"] = _call(pa, "get_avail_physical_pages")
    inuse = pages["inuse_pages"]
    if state is None or inuse is None:
        mapped = int(manager.get_mapped_memory_size("bytes"))
    else:
        mapped = inuse * _attr(manager, "page_size") * _attr(manager, "num_layers") * _attr(manager, "num_kv_buffers")
    return pool_snapshot(
        manager,
        integration=integration,
        pages=pages,
        available_blocks=int(manager.available_size()),
        allocated_blocks=int(manager._get_num_alloced_blocks()),
        reserved_blocks=len(getattr(manager, "reserved_blocks", [])),
        mapped_bytes=mapped,
        in_shrink=bool(getattr(manager, "in_shrink", False)),
        shrink_target_blocks=getattr(manager, "target_num_blocks", None),
        resize_target_bytes=_call(pa, "get_resize_target"),
    )


def _snapshot_one(manager: Any, integration: Optional[str]) -> KVCachePoolSnapshot:
    take = getattr(manager, "observability_snapshot", None)
    if take is None:
        return build_kv_cache_pool_snapshot(manager, integration=integration)
    return take(integration=integration)


def get_registered_kv_cache_pool_snapshots(*, integration: Optional[str] = None) -> List[KVCachePoolSnapshot]:
    """Snapshots of the live registered pools (of one integration), sorted by integration, name, group."""
    snaps = [_snapshot_one(m, tag) for m, tag in get_registered_kv_cache_pools(integration=integration)]
    return sorted(snaps, key=lambda s: (s.integration or "", s.pool_name or "", s.group_id))


def get_registered_kv_cache_pool_snapshot_dicts(*, integration: Optional[str] = None) -> List[Dict[str, Any]]:
    """``get_registered_kv_cache_pool_snapshots`` as JSON-serializable dicts."""
    return [s.to_dict() for s in get_registered_kv_cache_pool_snapshots(integration=integration)]
