"""Upstream's shorthand arguments of ``KVCacheManager``, turned into the
collaborators a ``BlockManager`` is handed (``kvcached.manager_setup``).

Upstream's constructor takes ``world_size`` (map through the worker fan-out
above 1), ``map_fn``/``unmap_fn``, ``own_segment`` + ``engine`` (a record of
its own) and ``async_sched`` (a device sync before pages are unmapped), and
gives every manager a record. ``build_collaborators`` is the one place that
resolves them; ``auto_record`` is that always-present record.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from kvcached.errors import InvalidArgumentError
from kvcached.manager_setup import Barrier, LimitsFactory, Mapper, device_sync_barrier, limits_factory

MapFn = Callable[[List[int]], None]


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
