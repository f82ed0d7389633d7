"""What a KVCacheManager is handed: its mapper, its limits and its release barrier.

``KVCacheManager`` maps nothing, owns no record and knows no device API: an
engine adapter builds these three collaborators and passes them in::

    KVCacheManager(
        num_blocks, block_size, cell_size, num_layers,
        reserve_null_block=True, num_kv_buffers=1, group_id=0, defer_physical_release=True,
        mapper=coordinator,                                   # .map(offsets) / .unmap(offsets)
        limits=limits_factory(engine="vllm", device=device, name=name, group_id=0),
        release_barrier=None,                                 # or device_sync_barrier(device)
        page_size=page, device=device,
    )

``build_collaborators`` is the one place that turns the older convenience
arguments (``world_size`` fan-out, ``map_fn``/``unmap_fn``, ``own_segment`` +
``engine``, ``async_sched``) into those objects; ``KVCacheManager`` calls it so
existing callers keep working unchanged.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, List, Optional, Protocol, Tuple

from kvcached.errors import InvalidArgumentError

MapFn = Callable[[List[int]], None]
Barrier = Callable[[], None]
# Takes the manager's PageAllocator, returns an attached kvcached.limits.InstanceLimits.
LimitsFactory = Callable[[Any], Any]


class Mapper(Protocol):
    """Maps/unmaps page offsets in every process holding the KV tensors, all or nothing
    (``kvcached.ipc.coordinator.TPCoordinator`` is one)."""

    def map(self, offsets: List[int]) -> None: ...

    def unmap(self, offsets: List[int]) -> None: ...


class FunctionMapper:
    """A Mapper over two functions (the older ``map_fn``/``unmap_fn`` arguments)."""

    def __init__(self, map_fn: MapFn, unmap_fn: MapFn) -> None:
        self.map = map_fn
        self.unmap = unmap_fn


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


# release_barrier=AUTO: the older rule (see build_collaborators).
AUTO: Any = _Auto()


def device_sync_barrier(device: str) -> Barrier:
    """A barrier that waits for every kernel queued on ``device`` (``cuda:N``), so an
    empty page is not unmapped while a queued batch may still read it."""

    def barrier() -> None:
        import torch

        torch.cuda.synchronize(device)  # explicit device: the caller may be a helper thread

    return barrier


def fanout_mapper(world_size: int, pp_rank: int, group_id: int) -> Mapper:
    """The process-wide worker fan-out of ``kvcached.tp_ipc_util`` for (world, stage, group)."""
    try:
        from kvcached.tp_ipc_util import get_coordinator
    except ImportError as e:
        raise InvalidArgumentError(
            f"world_size={world_size} needs the worker fan-out (kvcached.tp_ipc_util), which failed to import: {e}; "
            "or pass mapper="
        ) from None
    return get_coordinator(world_size, pp_rank, group_id)


def limits_factory(
    *, engine: str, device: str, name: Optional[str] = None, group_id: int = 0, **kwargs: Any
) -> LimitsFactory:
    """``limits=`` for a pool with its own record (``kvctl`` shows and caps it; the
    device budget is shared): ``InstanceLimits.for_page_allocator`` bound to these
    arguments, called by the manager with its PageAllocator before anything is mapped."""
    from kvcached.limits import InstanceLimits

    return functools.partial(
        InstanceLimits.for_page_allocator, engine=engine, device=device, name=name, group_id=group_id, **kwargs
    )


# Upstream's default segment name probes ``<name>_1`` .. ``<name>_99`` when taken.
_AUTO_SUFFIXES = 99


def auto_record(*, engine: str, device: str, group_id: int, budget: Any = None) -> LimitsFactory:
    """``limits=`` of a manager whose caller did not choose (upstream's always-present
    record): named for the instance (``kvcached.naming``), or upstream's
    ``<name>_<k>`` when a live process holds that name; ``budget``: None (outside
    any device budget) or ``"env"`` (the device budget, as the engines' pools)."""
    from kvcached.errors import InvalidArgumentError as Invalid
    from kvcached.limits import InstanceLimits
    from kvcached.naming import instance_name

    base = instance_name(engine)

    def make(pa: Any) -> Any:
        for k in range(_AUTO_SUFFIXES + 1):
            candidate = base if k == 0 else f"{base}_{k}"
            try:
                return InstanceLimits.for_page_allocator(
                    pa, engine=engine, device=device, name=candidate, group_id=group_id, budget=budget
                )
            except Invalid as e:
                if "belongs to live process" not in str(e) or k == _AUTO_SUFFIXES:
                    raise
        raise AssertionError("unreachable")

    return make


def build_collaborators(
    *,
    world_size: int,
    pp_rank: int,
    group_id: int,
    async_sched: bool,
    defer_physical_release: bool,
    own_segment: bool,
    map_fn: Optional[MapFn],
    unmap_fn: Optional[MapFn],
    engine: str,
    device: Optional[str],
    pool_name: Optional[str],
    mapper: Optional[Mapper],
    limits: Optional[LimitsFactory],
    release_barrier: Any,
) -> Tuple[Optional[Mapper], Optional[LimitsFactory], Optional[Barrier]]:
    """Resolves the older convenience arguments into (mapper, limits, release_barrier).

    * mapper: ``mapper``; else ``map_fn``/``unmap_fn``; else the fan-out when
      ``world_size > 1``; else None (this process maps).
    * limits: ``limits``; else with ``own_segment`` a record named ``pool_name``
      for ``engine`` on ``device``; else None.
    * release_barrier: as given; with AUTO, a device synchronisation when
      ``async_sched``, no deferred release, this process maps and the device is
      CUDA (a queued batch may still read a page being unmapped); else None.
    """
    if (map_fn is None) != (unmap_fn is None):
        raise InvalidArgumentError("give both map_fn and unmap_fn, or neither")
    if mapper is not None and map_fn is not None:
        raise InvalidArgumentError("give mapper= or map_fn/unmap_fn, not both")
    if limits is not None and own_segment:
        raise InvalidArgumentError("give limits= or own_segment=True, not both")
    if mapper is None and map_fn is not None:
        mapper = FunctionMapper(map_fn, unmap_fn)
    if mapper is None and world_size > 1:
        mapper = fanout_mapper(world_size, pp_rank, group_id)
    if limits is None and own_segment:
        if device is None:
            raise InvalidArgumentError("own_segment needs device= when the data plane is not initialized here")
        limits = limits_factory(engine=engine, device=device, name=pool_name, group_id=group_id)
    if release_barrier is AUTO:
        release_barrier = None
        if async_sched and not defer_physical_release and mapper is None and str(device).startswith("cuda"):
            release_barrier = device_sync_barrier(str(device))
    return mapper, limits, release_barrier


def resolve_page_size(page_size: Optional[int], local: bool) -> int:
    """The page size: given, else the data plane's, else ``KVCACHED_PAGE_SIZE``; a
    manager mapping in this process must use the data plane's."""
    from kvcached import _C, config

    if page_size is None:
        page_size = _C.config()["page_size"] if _C.is_initialized() else config.page_size()
    try:
        size = operator.index(page_size)
    except TypeError:
        size = 0
    if isinstance(page_size, bool) or size <= 0:
        raise InvalidArgumentError(f"page_size must be a positive integer, got {page_size!r}")
    page_size = size
    if local and page_size != _C.config()["page_size"]:
        raise InvalidArgumentError(
            f"page_size {page_size} differs from the data plane's {_C.config()['page_size']}; "
            "pass the page size given to init_kvcached"
        )
    return page_size


def reserve_bounds() -> Tuple[int, int]:
    """(min, max) pages of the mapped reserve, from KVCACHED_MIN/MAX_RESERVED_PAGES."""
    from kvcached import config

    lo, hi = config.min_reserved_pages(), config.max_reserved_pages()
    if lo < 0 or hi < lo:
        raise InvalidArgumentError(
            f"KVCACHED_MIN_RESERVED_PAGES={lo} / KVCACHED_MAX_RESERVED_PAGES={hi}: need 0 <= min <= max"
        )
    return lo, hi


def check_tensors(group_id: int, num_layers: int, num_kv_buffers: int, mem_size: int, what: str) -> None:
    """Raises InvalidArgumentError unless this process's KV tensors of ``group_id``
    exist and hold ``num_layers`` x ``num_kv_buffers`` buffers of ``mem_size`` bytes."""
    from kvcached import _C

    if not _C.kv_tensors_created(group_id):
        raise InvalidArgumentError(
            f"KV tensors of group {group_id} do not exist yet: create them "
            "(alloc_kv_cache / create_kv_tensors) before allocating blocks"
        )
    info = _C.group_info(group_id)
    if info["num_layers"] != num_layers or info["num_kv_buffers"] != num_kv_buffers or info["buffer_size"] < mem_size:
        raise InvalidArgumentError(
            f"KV tensors of group {group_id} ({info['num_layers']} layers x {info['num_kv_buffers']} buffers of "
            f"{info['buffer_size']} bytes) do not match this manager ({num_layers} layers x {num_kv_buffers} "
            f"buffers of {mem_size} bytes for {what})"
        )
