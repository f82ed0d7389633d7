"""Worker seam: vLLM's KV buffer backed by a kvcached FTensor, and the worker's listener.

vLLM's ``allocate_kv_cache`` makes one int8 buffer with ``torch.zeros`` (every
byte committed) and cuts per-layer views from it with vLLM's own strides. The
wrapper here makes the same buffer, same size, as a view of one FTensor (a
stable virtual range that reads zeros where nothing is mapped) and then cuts
the views exactly as vLLM does, with vLLM's ``create_kv_cache_views``: shapes,
strides, layout (LBHNC, BLHNC, ...) and offsets are vLLM's. Physical pages are
mapped only when the scheduler's ``ElasticBlockPool`` hands out blocks on them.

The scheduler (EngineCore, another process) maps and unmaps through
``kvcached.ipc``: this worker serves its socket with ``PlannedExecutor``, which
turns the scheduler's logical pages into the FTensor pages that hold those
blocks in every layer (``kv_layout.KVLayoutPlan``) and counts references where
neighbouring logical pages share a physical one.

Capacity: with kvcached the KV bytes are virtual, so a worker takes its KV
capacity from the device budget (``KVCACHED_GPU_UTILIZATION`` /
``KVCACHED_HOST_MEMORY_BUDGET``) instead of the memory the device has free
right now; a second instance then starts while the first holds memory. An
explicit ``kv_cache_memory_bytes`` still wins.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvcached import config, vmm_ops
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import WRAPPED, original
from kvcached.integration.vllm.kv_layout import KVLayoutPlan
from kvcached.ipc.executor import VmmExecutor
from kvcached.ipc.protocol import WorkerState

logger = logging.getLogger("vllm.kvcached")

GROUP = 0  # the FTensor group holding vLLM's KV buffer in a worker process


# ----------------------------------------------------------------- executor


class PlannedExecutor(VmmExecutor):
    """Serves the scheduler's logical pages on this worker's FTensor pages.

    A logical page maps every physical page in ``plan.physical_pages(p)``; a
    physical page shared by two logical pages (layer regions not page
    aligned) is mapped while either is and unmapped with the last. The data
    plane keeps the all-or-nothing map and the two-phase unmap; this class
    only decides which physical pages a request touches, and keeps, per
    prepared unmap transaction, the reference changes to undo on ABORT.
    """

    def __init__(self, plan: KVLayoutPlan) -> None:
        super().__init__()
        self.plan = plan
        self._P = plan.page_size
        self._mapped: set = set()  # logical page ids mapped (or held by a prepared unmap)
        self._refs: Dict[int, int] = {}  # physical page id -> mapped logical pages using it
        self._prepared: Dict[Tuple[int, int], Tuple[List[int], List[int]]] = {}

    def _logical(self, offsets: Sequence[int]) -> List[int]:
        out = []
        for o in offsets:
            o = int(o)
            if o < 0 or o % self._P:
                raise InvalidArgumentError(f"offset {o} is not a multiple of the page size {self._P}")
            out.append(o // self._P)
        if len(set(out)) != len(out):
            raise InvalidArgumentError("an offset appears twice in one request")
        return out

    def _acquire(self, pages: Sequence[int]) -> List[int]:
        """Physical pages that ``pages`` need and nothing maps yet (no state change)."""
        fresh: List[int] = []
        seen = set()
        for p in pages:
            for ph in self.plan.physical_pages(p):
                if self._refs.get(ph, 0) == 0 and ph not in seen:
                    seen.add(ph)
                    fresh.append(ph)
        return fresh

    def _releasable(self, pages: Sequence[int]) -> List[int]:
        """Physical pages whose last user is among ``pages`` (no state change)."""
        drop: Dict[int, int] = {}
        for p in pages:
            for ph in self.plan.physical_pages(p):
                drop[ph] = drop.get(ph, 0) + 1
        return sorted(ph for ph, n in drop.items() if self._refs.get(ph, 0) == n)

    def _count(self, pages: Sequence[int], delta: int) -> None:
        refs = self._refs
        for p in pages:
            for ph in self.plan.physical_pages(p):
                n = refs.get(ph, 0) + delta
                if n:
                    refs[ph] = n
                else:
                    refs.pop(ph, None)
            if delta > 0:
                self._mapped.add(p)
            else:
                self._mapped.discard(p)

    def map(self, group: int, tx: int, offsets: Sequence[int]) -> Tuple[int, int]:
        key = (group, tx)
        with self._lock:
            prev = self._maps.get(key)
            if prev == "rolled back":
                raise InvalidArgumentError(f"map transaction {tx} was rolled back; a late MAP is refused")
            if isinstance(prev, list):
                return len(prev), len(offsets) - len(prev)
            logical = self._logical(offsets)
            new = [p for p in logical if p not in self._mapped]
            try:
                phys = self._acquire(new)
                if phys:
                    vmm_ops.map_to_kv_tensors([ph * self._P for ph in phys], group)  # all or nothing
            except Exception:
                self._remember(key, "failed")
                raise
            self._count(new, +1)
            self._remember(key, [p * self._P for p in new])
            return len(new), len(logical) - len(new)

    def rollback_map(self, group: int, tx: int) -> int:
        key = (group, tx)
        with self._lock:
            prev = self._maps.get(key)
            if isinstance(prev, list) and prev:
                pages = [o // self._P for o in prev if o // self._P in self._mapped]
                phys = self._releasable(pages)
                if phys:
                    vmm_ops.unmap_from_kv_tensors([ph * self._P for ph in phys], group)
                self._count(pages, -1)
            self._remember(key, "rolled back")
            return len(prev) if isinstance(prev, list) else 0

    def prepare(self, group: int, tx: int, offsets: Sequence[int]) -> None:
        key = (group, tx)
        with self._lock:
            logical = self._logical(offsets)
            held = self._prepared.get(key)
            if held is not None:
                if sorted(held[0]) != sorted(logical):
                    raise InvalidArgumentError(f"transaction {tx} is already prepared with other offsets")
                return  # a repeated PREPARE
            missing = [p for p in logical if p not in self._mapped]
            if missing:
                raise InvalidArgumentError(f"offset {missing[0] * self._P} is not mapped; nothing to unmap")
            phys = self._releasable(logical)
            # The data plane records the transaction (also with no page to
            # release), refuses a PREPARE after ABORT and keeps the handles.
            vmm_ops.prepare_unmap_from_kv_tensors(tx, [ph * self._P for ph in phys], group)
            self._count(logical, -1)
            self._prepared[key] = (logical, phys)

    def commit(self, group: int, tx: int) -> None:
        with self._lock:
            vmm_ops.commit_unmap_from_kv_tensors(tx, group)
            self._prepared.pop((group, tx), None)

    def abort(self, group: int, tx: int) -> None:
        with self._lock:
            vmm_ops.abort_unmap_from_kv_tensors(tx, group)
            held = self._prepared.pop((group, tx), None)
            if held is not None:
                self._count(held[0], +1)

    def query(self, group: int) -> WorkerState:
        state = super().query(group)
        with self._lock:
            state.mapped_offsets = sorted(p * self._P for p in self._mapped)
            state.units_per_page = self.plan.physical_pages_per_logical_page()
        return state

    def mapped_logical_pages(self) -> List[int]:
        with self._lock:
            return sorted(self._mapped)


# ------------------------------------------------------------ worker state


class WorkerKV:
    """The KV buffer of this worker process and the listener serving it."""

    current: Optional["WorkerKV"] = None
    _lock = threading.Lock()

    def __init__(self, plan: KVLayoutPlan, device: str, rank: int, pp_rank: int, ipc_name: str) -> None:
        import torch

        from kvcached.ipc.listener import WorkerListener

        self.plan = plan
        self.device = device
        vmm_ops.init_kvcached(device, plan.page_size, contiguous_layout=False)
        # One range, one "layer", one buffer: the offsets are byte offsets into
        # vLLM's buffer, so vLLM's own views address it unchanged.
        vmm_ops.create_kv_tensors(plan.mapped_size, 1, device, num_layers=1, num_kv_buffers=1, group_id=GROUP)
        self.raw = vmm_ops.get_raw_kv_tensors(GROUP)[0].view(torch.int8)
        self.executor = PlannedExecutor(plan)
        self.listener = WorkerListener(rank, pp_rank, ipc_name, executor=self.executor).start()
        self.ipc_name = ipc_name

    def close(self) -> None:
        """Stops the listener (drains a running call), then releases every page."""
        if self.listener is not None:
            self.listener.stop()
            self.listener = None
        try:
            vmm_ops.shutdown_kvcached()
        except Exception:  # already shut down
            pass

    @classmethod
    def start(cls, plan: KVLayoutPlan, device: str, rank: int, pp_rank: int, ipc_name: str) -> "WorkerKV":
        with cls._lock:
            if cls.current is not None:
                # A second engine in this process (tests, RLHF re-init): the old
                # one's tensors are no longer used by vLLM.
                cls.current.close()
                cls.current = None
            kv = cls(plan, device, rank, pp_rank, ipc_name)
            cls.current = kv
            return kv


def _close_at_exit() -> None:
    with WorkerKV._lock:
        if WorkerKV.current is not None:
            WorkerKV.current.close()
            WorkerKV.current = None


atexit.register(_close_at_exit)


# ------------------------------------------------------------- ranks, names


def _parallel_ranks() -> Tuple[int, int, int, int]:
    """(tp rank, pp rank, dp rank, dp size) of this worker."""
    from vllm.distributed import parallel_state as ps

    def rank(getter: str) -> Tuple[int, int]:
        try:
            g = getattr(ps, getter)()
            return int(g.rank_in_group), int(g.world_size)
        except Exception:  # group not initialised (single process)
            return 0, 1

    tp, _ = rank("get_tp_group")
    pp, _ = rank("get_pp_group")
    dp, dp_size = rank("get_dp_group")
    return tp, pp, dp, dp_size


def instance_name(dp_rank: int = 0, dp_size: int = 1) -> str:
    """The instance's name: KVCACHED_IPC_NAME (set by the first vLLM process),
    plus ``_dp<rank>`` per data-parallel engine (each has its own scheduler)."""
    from kvcached.limits.naming import instance_name as base_name

    base = base_name("vllm")
    return f"{base}_dp{dp_rank}" if dp_size > 1 else base


def device_string(device: Any) -> str:
    """torch.device / str -> 'cpu' or 'cuda:N' (what kvcached's backends take)."""
    import torch

    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type in ("cuda", "hip"):
        idx = d.index if d.index is not None else torch.cuda.current_device()
        return f"cuda:{idx}"
    raise InvalidArgumentError(f"kvcached has no backend for device {d}; unset ENABLE_KVCACHED")


# ------------------------------------------------------- allocate_kv_cache


def _elastic_allocate(
    orig: Callable[..., Dict[str, Any]],
    kv_cache_config: Any,
    device: Any,
    layout: Any,
    kernel_block_sizes: Optional[List[int]] = None,
) -> Dict[str, Any]:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return orig(kv_cache_config, device, layout, kernel_block_sizes)
    plan = KVLayoutPlan.from_kv_cache_config(kv_cache_config, config.page_size())
    buf_size = plan.buffer_size
    if current_platform.is_rocm():  # vLLM pads the ROCm buffer to 4 KiB (allocate_kv_cache)
        buf_size = -(-buf_size // 4096) * 4096
        if buf_size > plan.mapped_size:
            raise InvalidArgumentError(f"KV buffer of {buf_size} B exceeds the mapped range {plan.mapped_size} B")
    tp, pp, dp, dp_size = _parallel_ranks()
    name = instance_name(dp, dp_size)
    kv = WorkerKV.start(plan, device_string(device), tp, pp, name)
    buf = kv.raw[:buf_size]

    # From here on exactly vLLM's loop (vllm/v1/worker/utils.py, 0.32 and 0.33).
    kv_caches: Dict[str, Any] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        layer_name = tensor.layers[0]
        group_id, group = next(
            (gid, g) for gid, g in enumerate(kv_cache_config.kv_cache_groups) if layer_name in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(buf, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)
        kv_caches.update(zip(tensor.layers, views))
    logger.info(
        "kvcached: KV buffer of %.1f MiB is virtual (%s); rank %d pp %d serves %s",
        buf_size / (1 << 20), plan, tp, pp, kv.listener.path if kv.listener else "-",
    )
    return kv_caches


def _wrap_allocate(orig: Callable[..., Dict[str, Any]]) -> Callable[..., Dict[str, Any]]:
    @functools.wraps(orig)
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):  # type: ignore[no-untyped-def]
        return _elastic_allocate(orig, kv_cache_config, device, layout, kernel_block_sizes)

    setattr(allocate_kv_cache, WRAPPED, orig)
    return allocate_kv_cache


def patch_allocate_kv_cache(utils: ModuleType) -> None:
    """Wraps ``vllm.v1.worker.utils.allocate_kv_cache`` and every by-name copy already bound."""
    cur = utils.allocate_kv_cache
    if getattr(cur, WRAPPED, None) is None:
        utils.allocate_kv_cache = _wrap_allocate(cur)
    from kvcached.integration.vllm.versions import ALLOCATE_KV_CACHE_IMPORTERS

    for name in ALLOCATE_KV_CACHE_IMPORTERS:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "allocate_kv_cache"):
            rebind_allocate_kv_cache(mod)


def rebind_allocate_kv_cache(module: ModuleType) -> None:
    """Points ``module.allocate_kv_cache`` (bound by name at import) at the wrapper."""
    import importlib

    utils = importlib.import_module("vllm.v1.worker.utils")
    if getattr(utils.allocate_kv_cache, WRAPPED, None) is None:
        utils.allocate_kv_cache = _wrap_allocate(utils.allocate_kv_cache)
    if not hasattr(module, "allocate_kv_cache"):
        raise AttributeError(f"{module.__name__} no longer imports allocate_kv_cache by name")
    if original(module.allocate_kv_cache) is original(utils.allocate_kv_cache):
        module.allocate_kv_cache = utils.allocate_kv_cache


# ---------------------------------------------------------------- capacity


def virtual_capacity(device: str, consumed_bytes: int = 0) -> int:
    """KV bytes this worker may address: the device budget (what all kvcached
    instances on the device may map together), less ``consumed_bytes`` the
    model itself holds on a GPU, rounded down to whole pages."""
    from kvcached.limits.budget import usable_device_bytes

    budget = usable_device_bytes(device)
    page = config.page_size()
    cap = (budget - max(0, int(consumed_bytes))) // page * page
    if cap <= 0:
        raise InvalidArgumentError(
            f"kvcached: the device budget of {device} ({budget >> 20} MiB) leaves no room for a KV cache after "
            f"{consumed_bytes >> 20} MiB used by the model; raise KVCACHED_GPU_UTILIZATION / "
            "KVCACHED_HOST_MEMORY_BUDGET or pass --kv-cache-memory-bytes"
        )
    return cap


def _set_virtual_capacity(cache_config: Any, device: str, consumed: int = 0) -> None:
    if cache_config.kv_cache_memory_bytes is None:
        cache_config.kv_cache_memory_bytes = virtual_capacity(device, consumed)
        logger.info(
            "kvcached: KV capacity %.1f MiB from the %s budget (virtual; pages are mapped on demand)",
            cache_config.kv_cache_memory_bytes / (1 << 20), device,
        )


def patch_cpu_worker_capacity(module: ModuleType) -> None:
    cls = module.CPUWorker
    orig = cls.determine_available_memory

    @functools.wraps(orig)
    def determine_available_memory(self) -> int:  # type: ignore[no-untyped-def]
        # Virtual bytes: no comparison with the node's free memory (another
        # instance may hold it now and give it back later).
        _set_virtual_capacity(self.cache_config, "cpu")
        return int(self.cache_config.kv_cache_memory_bytes)

    setattr(determine_available_memory, WRAPPED, orig)
    cls.determine_available_memory = determine_available_memory


def patch_cpu_worker_init_capacity(module: ModuleType) -> None:
    cls = module.CPUWorker
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, vllm_config, *args, **kwargs):  # type: ignore[no-untyped-def]
        _set_virtual_capacity(vllm_config.cache_config, "cpu")
        orig(self, vllm_config, *args, **kwargs)

    setattr(__init__, WRAPPED, orig)
    cls.__init__ = __init__


def patch_gpu_worker_capacity(module: ModuleType) -> None:
    cls = module.Worker
    orig = cls.determine_available_memory

    @functools.wraps(orig)
    def determine_available_memory(self) -> int:  # type: ignore[no-untyped-def]
        used = int(getattr(getattr(self, "model_runner", None), "model_memory_usage", 0) or 0)
        _set_virtual_capacity(self.cache_config, device_string(self.device), used)
        # With kv_cache_memory_bytes set vLLM skips the free-memory profiling.
        return orig(self)

    setattr(determine_available_memory, WRAPPED, orig)
    cls.determine_available_memory = determine_available_memory
