"""What a BlockManager is handed, and what it checks before it maps anything.

``BlockManager`` maps nothing, owns no record and knows no device API: an
engine adapter builds its three collaborators and passes them in::

    BlockManager(
        num_blocks, block_size, cell_size, num_layers,
        reserve_null_block=True, num_kv_buffers=1, group_id=0, defer_physical_release=True,
        mapper=coordinator,                                   # .map(offsets) / .unmap(offsets)
        limits=limits_factory(engine="vllm", device=device, name=name, group_id=0),
        release_barrier=None,                                 # or device_sync_barrier(device)
        page_size=page, device=device,
    )

The rest checks what the manager is given against the data plane: its device,
page size, block geometry, reserve bounds and KV tensors. Upstream's shorthand
arguments (``world_size`` fan-out, ``map_fn``/``unmap_fn``, ``own_segment``,
its always-present record) become these collaborators in
``kvcached.compat.manager_args``.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Callable, List, Optional, Protocol, Tuple

from kvcached.block_geometry import GOOD_UTILIZATION, BlockGeometry, better_page_size
from kvcached.errors import InvalidArgumentError, ShutdownError

logger = logging.getLogger(__name__)

Barrier = Callable[[], None]
# Takes the manager's PageAllocator, returns an attached kvcached.limits.InstanceLimits.
LimitsFactory = Callable[[Any], Any]


class Mapper(Protocol):
    """Maps/unmaps page offsets in every process holding the KV tensors, all or nothing
    (``kvcached.ipc.coordinator.TPCoordinator`` is one)."""

    def map(self, offsets: List[int]) -> None: ...

    def unmap(self, offsets: List[int]) -> None: ...


def device_sync_barrier(device: str) -> Barrier:
    """A barrier that waits for every kernel queued on ``device`` (``cuda:N``), so an
    empty page is not unmapped while a queued batch may still read it."""

    def barrier() -> None:
        import torch

        torch.cuda.synchronize(device)  # explicit device: the caller may be a helper thread

    return barrier


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


def default_device(device: Optional[str]) -> Optional[str]:
    """``device``, else the device of this process's data plane (None without one)."""
    from kvcached import _C

    if device is None and _C.is_initialized():
        device = _C.config()["device"]
    return device


def resolve_page_size(page_size: Optional[int], local: bool) -> int:
    """The page size: given, else the data plane's, else ``KVCACHED_PAGE_SIZE``; a
    manager mapping in this process (``local``) must use the data plane's, which
    must be initialized (ShutdownError)."""
    from kvcached import _C, config

    if local and not _C.is_initialized():
        raise ShutdownError(
            "kvcached is not initialized in this process: call init_kvcached(device) "
            "(kvcached.vmm_ops or the engine interface) before creating a KVCacheManager"
        )
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


def block_geometry(num_blocks: int, block_size: int, cell_size: int, page_size: int) -> BlockGeometry:
    """Where the blocks lie on pages. A block that cannot sit on a page raises
    upstream's ``KVCachedConfigError``; blocks that fill pages poorly are
    logged, naming a page size they would fill well."""
    from kvcached.utils import KVCachedConfigError

    try:
        geo = BlockGeometry(num_blocks, block_size, cell_size, page_size)
    except InvalidArgumentError as e:
        raise KVCachedConfigError(str(e)) from None  # upstream's type for a block that cannot sit on pages
    if geo.utilization < GOOD_UTILIZATION:
        size, used = better_page_size(geo.block_mem_size, page_size)
        logger.warning(
            "kvcached: blocks of %d B fill %.0f%% of each %d KiB page (a block straddling a page boundary is "
            "never used); KVCACHED_PAGE_SIZE=%d would fill %.0f%%",
            geo.block_mem_size,
            100 * geo.utilization,
            page_size >> 10,
            size,
            100 * used,
        )
    return geo
