"""Elastic SGLang KV pools: the K/V buffers are views of kvcached FTensors.

``ElasticMHATokenToKVPool`` and ``ElasticMLATokenToKVPool`` subclass SGLang's
pools and change only how the buffers are carved (the seam SGLang's platform
interface names: ``_create_buffers``). Everything else (writes, reads, data
pointer tables, CPU copies) is SGLang's own code over our tensors.

Layout, per layer (the native pool's, see ``MHATokenToKVPool._create_buffers_normal``):
one address range ``[K rows | V rows]``; K is ``(size + page_size, H, D)`` with
strides ``(H*D, D, 1)`` and V the same shape ``V_OFFSET`` bytes after K, where
``V_OFFSET`` is a whole number of SGLang pages (paged kernels that address V
from K's base by block offsets keep working). The native pool pads the rows to
a page multiple; we pad further, to a multiple of the kvcached page, because
the data plane maps K and V of a layer at the same page offset. When the
native padding is already page aligned the offset is identical to SGLang's.
The addresses are reserved once, never move and stay valid for the pool's life;
physical pages come and go underneath.

One KV pool is one kvcached group with its own ``KVCacheManager`` (a block is
one SGLang page: ``page_size`` tokens, one token at page size 1; block 0 is
SGLang's padding slot and stays mapped) and its own shared-memory record
(``kvctl list``/``kvctl limit``). The manager retires emptied pages instead of
unmapping them at once; the process's ``kvcached.elastic.ElasticInstance``
(``instance()``) holds every pool, and its release fence, driven by the
scheduler hooks, releases them when no queued batch can read them any more
(overlap scheduling, see ``scheduler_hooks``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable, List, Optional, Tuple

from kvcached import _C, naming
from kvcached.block_geometry import page_size_for_block
from kvcached.compat import runtime, sglang_interfaces
from kvcached.compat.upstream_manager import KVCacheManager
from kvcached.devices import normalize_device
from kvcached.elastic import ElasticInstance, ElasticPool
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import manager_of
from kvcached.integration.sglang import conflicts

logger = logging.getLogger("kvcached.integration.sglang")

ENGINE = "sglang"
# How long emptied pages stay mapped (and reusable) after no batch can read
# them any more, while the scheduler is busy: a growing decode batch or the
# next requests usually take them back first, and mapping a page again costs
# far more than keeping it for a moment.
RELEASE_GRACE_S = 1.0


class ElasticGroup(ElasticPool):
    """One elastic SGLang pool (one KV group): the manager and record, plus the
    FTensor views SGLang addresses."""

    def __init__(
        self,
        *,
        group_id: int,
        ordinal: int,
        manager: KVCacheManager,
        page_tokens: int,
        row_bytes: int,
        buffer_rows: int,
        k_views: List[Any],
        v_views: List[Any],
        pool_class: str = "",
    ) -> None:
        super().__init__(manager)
        self.group_id = group_id
        self.ordinal = ordinal  # pools made in this process, 0-based
        self.page_tokens = page_tokens  # SGLang page size
        self.row_bytes = row_bytes  # bytes of one token in one K (or V) buffer of one layer
        self.buffer_rows = buffer_rows  # rows of the FTensor views (>= size + page_size)
        self.k_views = k_views
        self.v_views = v_views
        self.record_name = self.name
        self.pool_class = pool_class
        self.data_ptrs: Tuple[int, ...] = tuple(t.data_ptr() for t in k_views + v_views)
        # Allocators that keep freed slots locally (page size 1): drained before
        # pages are released at idle or when over the limit.
        self.drains: List[Callable[[], int]] = []

    @property
    def holes(self) -> int:
        """Blocks below num_blocks that straddle a kvcached page (never handed out)."""
        geo = self.manager.geometry
        return geo.num_blocks - geo.num_usable_blocks

    def drain(self) -> int:
        """Hands slots the allocators keep locally back to the manager."""
        return sum(d() for d in self.drains)

    def release_all_retired(self) -> int:
        """Releases every emptied page (only when no batch can read them)."""
        return self.release_retired_pages_through(self.capture_physical_release_marker())


_lock = threading.RLock()
_groups: List[ElasticGroup] = []
_instance: Optional[ElasticInstance] = None


def elastic_groups() -> List[ElasticGroup]:
    """The elastic pools built in this process (scheduler hooks and reports read them)."""
    with _lock:
        return list(_groups)


def instance() -> ElasticInstance:
    """This scheduler process's elastic runtime: every pool, one release fence."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = ElasticInstance(naming.instance_name(ENGINE), grace_s=RELEASE_GRACE_S)
        return _instance


def is_elastic_pool(kvcache: Any) -> bool:
    """True for an elastic pool, an SWA composite whose sub-pools are all elastic, or a
    Mamba hybrid's ``HybridLinearKVPool`` whose attention leaf and state pool both are."""
    if kvcache is None:
        return False
    if getattr(kvcache, "kvcached_group", None) is not None:
        return True
    if type(kvcache).__name__ == "HybridLinearKVPool":
        subs = [getattr(kvcache, n, None) for n in ("full_kv_pool", "mamba_pool")]
    else:
        subs = [getattr(kvcache, n, None) for n in ("full_kv_pool", "swa_kv_pool")]
    return all(getattr(s, "kvcached_group", None) is not None for s in subs)


def group_of(kvcache: Any) -> Optional[ElasticGroup]:
    """The KV group a token allocator over ``kvcache`` hands out from: the pool's own, or a
    Mamba hybrid's attention leaf's (its state pool has its own slot allocator)."""
    grp = getattr(kvcache, "kvcached_group", None)
    if grp is None and type(kvcache).__name__ == "HybridLinearKVPool" and is_elastic_pool(kvcache):
        grp = kvcache.full_kv_pool.kvcached_group
    return grp


def shutdown_all() -> None:
    """Closes every record and manager made here and the data plane (tests, exit)."""
    with _lock:
        global _instance
        for g in _groups:
            g.manager.shutdown()  # removes the pool's record
        _groups.clear()
        if _instance is not None:
            _instance.close()
            _instance = None
    sglang_interfaces.shutdown_kvcached()


def _device_str(device: Any) -> str:
    try:
        return normalize_device(device)
    except InvalidArgumentError:
        raise conflicts.refuse(
            f"the KV cache is on {device}, a device kvcached has no backend for", "use a CUDA or CPU device"
        ) from None


def _parallel_ranks() -> Tuple[int, int, int]:
    """(tp_rank, tp_size, pp_rank) of this scheduler process (0, 1, 0 outside a distributed run)."""
    try:
        from sglang.srt.distributed import (
            get_pipeline_model_parallel_rank,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return (
            int(get_tensor_model_parallel_rank()),
            int(get_tensor_model_parallel_world_size()),
            int(get_pipeline_model_parallel_rank()),
        )
    except Exception:  # no model-parallel groups (a pool built outside an engine)
        return 0, 1, 0


def buffer_rows(rows: int, page_tokens: int, row_bytes: int, kv_page_bytes: int) -> int:
    """Rows of one K (V) view: SGLang's page-padded rows, padded on to a whole
    number of kvcached pages (and of SGLang pages), so V starts page aligned."""
    padded = -(-rows // page_tokens) * page_tokens
    block = page_tokens * row_bytes
    unit_rows = (kv_page_bytes * block // math.gcd(kv_page_bytes, block)) // row_bytes
    return -(-padded // unit_rows) * unit_rows


def _record_base_name(tp_rank: int, pp_rank: int) -> str:
    """KVCACHED_IPC_NAME (set by the launching process), plus _pp<p>/_tp<r> for
    ranks other than 0: every TP/PP rank runs its own scheduler and pool."""
    from kvcached.limits import read_record

    base = naming.rank_name(naming.instance_name(ENGINE), tp_rank, pp_rank)
    try:
        rec = read_record(base)
    except Exception:  # no such record: the name is free
        return base
    if rec.alive and rec.owner_pid != os.getpid():
        # Another live process (a second engine started with the same
        # inherited name, or a data-parallel peer) owns it: keep both visible.
        alt = f"{base}_{os.getpid()}"
        logger.warning("kvcached: record %s belongs to live pid %d; this pool uses %s", base, rec.owner_pid, alt)
        return alt
    return base


def start_group(device: Any, largest_entry: int = 0) -> Tuple[str, Tuple[int, int, int]]:
    """kvcached's data plane for this scheduler process, on the pool's device: (device, ranks).
    The first pool of the process (SGLang builds a hybrid model's state pool first) sets its
    page: ``block_geometry.page_size_for_block(largest_entry)``, so a real model's state slot
    larger than the default page needs no variable."""
    dev = _device_str(device)
    tp_rank, tp_size, pp_rank = ranks = _parallel_ranks()
    page = page_size_for_block(int(largest_entry))
    sglang_interfaces.init_kvcached(tp_rank, tp_size, is_worker=True, device=dev, pp_rank=pp_rank, page_size=page)
    return dev, ranks


def add_group(
    pool_class: str,
    ranks: Tuple[int, int, int],
    *,
    first_gid: int,
    make_views: Callable[[int], Tuple[List[Any], List[Any]]],
    num_blocks: int,
    block_tokens: int,
    row_bytes: int,
    num_layers: int,
    kv: int,
    buffer_rows: int,
) -> ElasticGroup:
    """Under the pools' lock: the first free group id from ``first_gid``, its tensors
    (``make_views(gid)`` -> K views, V views), the manager with its own record (block 0
    the null block), and the group in the process's ``ElasticInstance``."""
    tp_rank, _, pp_rank = ranks
    with _lock:
        gid = first_gid
        while _C.kv_tensors_created(gid):
            gid += 1
        k_views, v_views = make_views(gid)
        # own_segment: the manager creates the pool's record (kvctl list/limit)
        # and asks the device budget before mapping fresh pages.
        mgr = runtime.make_manager(
            num_blocks,
            block_tokens,
            row_bytes,
            num_layers,
            True,
            kv,
            gid,
            1,
            defer_physical_release=True,
            own_segment=True,
            pool_name=_record_base_name(tp_rank, pp_rank),
        )
        grp = ElasticGroup(
            group_id=gid,
            ordinal=len(_groups),
            manager=mgr,
            page_tokens=block_tokens,
            row_bytes=row_bytes,
            buffer_rows=buffer_rows,
            k_views=k_views,
            v_views=v_views,
            pool_class=pool_class,
        )
        _groups.append(grp)
        instance().add_pool(grp)
    return grp


def create_group(pool: Any, *, rows: int, heads: int, dim: int, kv: int) -> ElasticGroup:
    """Creates the FTensors, the manager and the record of one pool.

    ``rows`` is SGLang's buffer row count (``size + page_size``); views of
    ``(rows, heads, dim)`` per layer (and per K/V when ``kv == 2``) are returned
    in the group.
    """
    conflicts.check_pool(pool)
    device, ranks = start_group(pool.device)
    cfg = _C.config()
    if cfg["contiguous_layout"]:
        raise conflicts.refuse(
            "KVCACHED_CONTIGUOUS_LAYOUT=true interleaves layers per token, but SGLang's K/V buffers need "
            "contiguous token rows per layer",
            "unset KVCACHED_CONTIGUOUS_LAYOUT",
        )
    ps = int(pool.page_size)
    size = int(pool.size)
    itemsize = pool.store_dtype.itemsize
    row_bytes = heads * dim * itemsize
    t_rows = buffer_rows(rows, ps, row_bytes, int(cfg["page_size"]))

    def views(gid: int) -> Tuple[List[Any], List[Any]]:
        out = sglang_interfaces.alloc_kv_cache(
            (t_rows, heads, dim),
            pool.store_dtype,
            device,
            int(pool.layer_num),
            ps,
            "MHA" if kv == 2 else "MLA",
            "NHD",
            gid,
        )
        k_full, v_full = out if kv == 2 else (out, [])
        return [t[:rows] for t in k_full], [t[:rows] for t in v_full]

    # A block is one SGLang page; pages 1..size//ps are handed out, page 0 is the
    # padding slot (the null block). Blocks past that exist only as address padding.
    grp = add_group(
        type(pool).__name__,
        ranks,
        first_gid=0,
        make_views=views,
        num_blocks=size // ps + 1,
        block_tokens=ps,
        row_bytes=row_bytes,
        num_layers=int(pool.layer_num),
        kv=kv,
        buffer_rows=t_rows,
    )
    mgr, name, gid = grp.manager, grp.record_name, grp.group_id
    virt = mgr.geometry.num_pages * mgr.bytes_per_page
    patches = manager_of("sglang")
    via = patches.activated_via if patches is not None else None
    logger.info(
        "kvcached: elastic %s %r: %d tokens (page %d), %d layers, %.1f MiB virtual, record %s (patched via %s)",
        grp.pool_class,
        gid,
        size,
        ps,
        pool.layer_num,
        virt / (1 << 20),
        name,
        via or "direct use",
    )
    return grp


def _refuse_layout(pool: Any) -> None:
    if getattr(pool, "is_quantized_kv_cache", False):
        raise conflicts.refuse(
            "quantized (fp4/mxfp8) KV pools keep scale buffers kvcached does not map",
            "use --kv-cache-dtype auto or fp8_e4m3",
        )
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise conflicts.refuse(
            f"the {layout!r} KV layout is not the token-major (NHD) layout kvcached maps",
            "unset SGLANG_USE_HND_KVCACHE / SGLANG_AITER_KV_CACHE_LAYOUT",
        )


def _mha_base():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool


def _mla_base():
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool


class ElasticMHATokenToKVPool(_mha_base()):
    """MHATokenToKVPool over kvcached: same shapes, strides and K/V placement.

    From SGLang 0.5.16 ``_create_buffers`` calls ``_create_buffers_normal`` for
    the plain layout and then builds the pointer tables itself; 0.5.15 does it
    all in ``_create_buffers`` (the ``sglang-pool-buffers-0.5.15`` patch
    installs ``create_buffers_0_5_15`` below for it).
    """

    kvcached_group: Optional[ElasticGroup] = None

    def _create_buffers(self) -> None:
        conflicts.check_pool(self)
        _refuse_layout(self)
        super()._create_buffers()  # -> _create_buffers_normal below, then the pointer tables

    def _create_buffers_normal(self) -> None:
        # The token-major (NHD) shapes of every release: rows = size + page_size.
        rows = int(self.size) + int(self.page_size)
        if self.head_dim != self.v_head_dim:
            raise conflicts.refuse(
                f"K ({self.head_dim}) and V ({self.v_head_dim}) head dims differ (v_head_dim != head_dim); "
                "kvcached maps K and V of a token at the same offset",
                "use a model whose K and V head dims are equal",
            )
        self.kvcached_group = create_group(self, rows=rows, heads=int(self.head_num), dim=int(self.head_dim), kv=2)
        self.k_buffer = list(self.kvcached_group.k_views)
        self.v_buffer = list(self.kvcached_group.v_views)


def create_buffers_0_5_15(self: Any) -> None:
    """``ElasticMHATokenToKVPool._create_buffers`` for SGLang 0.5.15: the elastic buffers,
    then the pointer tables exactly as 0.5.15's own ``_create_buffers`` builds them."""
    import numpy as np
    import torch

    conflicts.check_pool(self)
    _refuse_layout(self)
    self._create_buffers_normal()
    self.k_data_ptrs = torch.tensor([x.data_ptr() for x in self.k_buffer], dtype=torch.uint64, device=self.device)
    self.v_data_ptrs = torch.tensor([x.data_ptr() for x in self.v_buffer], dtype=torch.uint64, device=self.device)
    self.data_ptrs = torch.cat([self.k_data_ptrs, self.v_data_ptrs], dim=0)
    self.data_strides = torch.tensor(
        [np.prod(x.shape[1:]) * x.dtype.itemsize for x in self.k_buffer + self.v_buffer], device=self.device
    )


class ElasticMLATokenToKVPool(_mla_base()):
    """MLATokenToKVPool over kvcached: one latent buffer per layer, native shape."""

    kvcached_group: Optional[ElasticGroup] = None

    def _create_buffers(self) -> None:
        conflicts.check_pool(self)
        if getattr(self, "use_dsa", False):
            raise conflicts.refuse(
                "DeepSeek sparse attention (DSA) pools keep indexer buffers kvcached does not map",
                "use a model without DSA",
            )
        rows = int(self.size) + int(self.page_size)
        self.kvcached_group = create_group(self, rows=rows, heads=1, dim=int(self.kv_cache_dim), kv=1)
        self.kv_buffer = list(self.kvcached_group.k_views)
