"""Process-wide state behind the engine interfaces (vLLM, SGLang).

One engine process initializes kvcached once, creates its KV tensors once
per KV group, and builds one KVCacheManager per group. This module remembers
what was set up so that the interfaces can be called in either order
(tensors first in SGLang and vLLM workers, manager first in a vLLM scheduler)
and still check that the manager's block geometry matches the tensors'; a
mismatch is a layout bug and is raised as such, never turned into an
"out of memory".
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

from kvcached import _C, config, vmm_ops
from kvcached.compat.manager_args import AUTO, auto_record, build_collaborators
from kvcached.compat.upstream_manager import KVCacheManager
from kvcached.devices import normalize_device
from kvcached.errors import InvalidArgumentError, ShutdownError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupGeometry:
    """What a KV group's tensors (or its manager) assume about blocks."""

    num_layers: int
    num_kv_buffers: int
    block_mem_size: int  # bytes of one block in one K/V buffer of one layer
    num_blocks: int
    source: str  # "tensors" or "manager": who recorded it first


@dataclass
class _State:
    engine: str = ""
    device: Optional[str] = None
    local: bool = False  # the data plane is initialized in this process
    tp_rank: int = 0
    world_size: int = 1
    pp_rank: int = 0
    is_worker: bool = False
    async_sched: bool = False


_lock = threading.RLock()
_state = _State()
_groups: Dict[int, GroupGeometry] = {}
_managers: weakref.WeakSet[KVCacheManager] = weakref.WeakSet()
_listener = None


def init(
    engine: str,
    tp_rank: int,
    world_size: int,
    is_worker: bool,
    device: Optional[str],
    async_sched: bool,
    pp_rank: int,
    page_size: Optional[int] = None,
) -> None:
    """Initializes kvcached for this process; repeated calls with the same device are no-ops.
    ``page_size`` (default ``KVCACHED_PAGE_SIZE``) is the data plane's page, for the process.

    The data plane is initialized here unless this is a scheduler-only
    process of a multi-worker engine (world_size > 1 and not a worker): that
    process maps through the worker fan-out and needs no device context.
    A worker of a multi-worker engine also starts its fan-out listener.
    """
    global _listener
    if world_size < 1 or tp_rank < 0 or tp_rank >= world_size:
        raise InvalidArgumentError(f"tp_rank {tp_rank} is not a rank of world_size {world_size}")
    dev = normalize_device(device)
    with _lock:
        if _state.device is not None:
            if dev != _state.device:
                raise InvalidArgumentError(
                    f"kvcached is already initialized for {_state.device!r} by {_state.engine}; "
                    f"call shutdown_kvcached() before initializing it for {dev!r}"
                )
            return
        local = is_worker or world_size == 1
        if local:
            _C.init_kvcached(dev, int(page_size or config.page_size()), config.contiguous_layout())
        if is_worker and world_size > 1:
            from kvcached import tp_ipc_util

            _listener = tp_ipc_util.start_worker_listener_thread(tp_rank, pp_rank)
        _state.__init__(engine, dev, local, tp_rank, world_size, pp_rank, bool(is_worker), bool(async_sched))
        logger.info(
            "kvcached initialized for %s on %s (rank %d/%d, pp %d, %s)",
            engine,
            dev,
            tp_rank,
            world_size,
            pp_rank,
            "worker" if is_worker else "scheduler",
        )


def shutdown() -> None:
    """Shuts down every manager made here, the fan-out listener and the data plane."""
    global _listener
    with _lock:
        if _state.device is None:
            return
        for m in list(_managers):
            m.shutdown()
        _managers.clear()
        if _listener is not None:
            _listener.stop()
            _listener = None
        if _state.local and _C.is_initialized():
            vmm_ops.shutdown_kvcached()  # warns about memory the driver would not release
        _groups.clear()
        _state.__init__()


def state() -> _State:
    """The current settings (read only by convention)."""
    return _state


def require(engine: str) -> _State:
    if _state.device is None:
        raise ShutdownError(
            f"kvcached is not initialized: call kvcached.integration.{engine}.interfaces.init_kvcached() first"
        )
    return _state


def record_geometry(group_id: int, geo: GroupGeometry) -> None:
    """Records the tensors' (or the manager's) geometry, or checks it against the other side's."""
    with _lock:
        have = _groups.get(group_id)
        if have is None:
            _groups[group_id] = geo
            return
        problems = []
        if have.num_layers != geo.num_layers:
            problems.append(f"{have.num_layers} vs {geo.num_layers} layers")
        if have.num_kv_buffers != geo.num_kv_buffers:
            problems.append(f"{have.num_kv_buffers} vs {geo.num_kv_buffers} K/V buffers")
        if have.block_mem_size != geo.block_mem_size:
            problems.append(f"{have.block_mem_size} vs {geo.block_mem_size} bytes per block")
        tensors, manager = (have, geo) if have.source == "tensors" else (geo, have)
        if manager.num_blocks > tensors.num_blocks:
            problems.append(f"the manager has {manager.num_blocks} blocks but the tensors hold {tensors.num_blocks}")
        if problems:
            raise InvalidArgumentError(
                f"KV group {group_id}: the {geo.source} do not match the {have.source} recorded before "
                f"({'; '.join(problems)}); build the manager with the geometry of the tensors"
            )
        if have.source != "tensors" and geo.source == "tensors":
            _groups[group_id] = geo


def make_manager(
    num_blocks: int,
    block_size: int,
    cell_size: int,
    num_layers: int,
    reserve_null_block: bool,
    num_kv_buffers: Optional[int],
    group_id: int,
    world_size: int,
    **kwargs,
) -> KVCacheManager:
    """A KVCacheManager checked against the group's tensors and closed at shutdown().

    ``own_segment=None`` (the interfaces' default) gives the manager upstream's
    always-present record, in the device budget as the engines' pools; True a
    record named ``pool_name``; False (default here) none.
    """
    st = _state
    if num_kv_buffers is None:
        rec = _groups.get(group_id)
        num_kv_buffers = rec.num_kv_buffers if rec is not None else 2
    # The adapter, not the manager, decides how pages are mapped (here or
    # through the worker fan-out), which record admits them and what must
    # happen before one is unmapped.
    defer = bool(kwargs.pop("defer_physical_release", False))
    own_segment = kwargs.pop("own_segment", False)
    limits = kwargs.pop("limits", None)
    if own_segment is None and limits is None:
        limits = auto_record(engine=st.engine, device=st.device, group_id=int(group_id), budget="env")
    mapper, limits, barrier = build_collaborators(
        world_size=world_size,
        pp_rank=st.pp_rank,
        group_id=group_id,
        async_sched=st.async_sched,
        defer_physical_release=defer,
        own_segment=bool(own_segment),
        map_fn=kwargs.pop("map_fn", None),
        unmap_fn=kwargs.pop("unmap_fn", None),
        engine=st.engine,
        device=st.device,
        pool_name=kwargs.get("pool_name"),
        mapper=kwargs.pop("mapper", None),
        limits=limits,
        release_barrier=kwargs.pop("release_barrier", AUTO),
    )
    m = KVCacheManager(
        num_blocks,
        block_size,
        cell_size,
        num_layers,
        world_size=world_size,
        pp_rank=st.pp_rank,
        reserve_null_block=reserve_null_block,
        num_kv_buffers=num_kv_buffers,
        group_id=group_id,
        defer_physical_release=defer,
        engine=st.engine,
        device=st.device,
        mapper=mapper,
        limits=limits,
        release_barrier=barrier,
        **kwargs,
    )
    try:
        record_geometry(
            group_id, GroupGeometry(m.num_layers, m.num_kv_buffers, m.block_mem_size, m.num_blocks, "manager")
        )
    except InvalidArgumentError:
        m.shutdown()
        raise
    with _lock:
        _managers.add(m)
    return m


def managers() -> List[KVCacheManager]:
    return list(_managers)
