"""Worker seam: vLLM's KV buffer backed by a kvcached FTensor, and the worker's listener.

vLLM 0.29-0.34's ``allocate_kv_cache`` makes one int8 buffer with ``torch.zeros`` (every
byte committed) and cuts per-layer views from it with vLLM's own strides. The
wrapper here makes the same buffer, same size, as a view of one FTensor (a
stable virtual range that reads zeros where nothing is mapped) and then cuts
the views exactly as vLLM does, with vLLM's ``create_kv_cache_views``: shapes,
strides, layout (LBHNC, BLHNC, ...) and offsets are vLLM's. Physical pages are
mapped only when the scheduler's ``ElasticBlockPool`` hands out blocks on them.

vLLM 0.26-0.28 have no ``allocate_kv_cache``: each model runner makes one
buffer per ``KVCacheTensor`` itself (V1 ``GPUModelRunner._allocate_kv_cache_tensors``,
also the CPU runner's; V2 ``gpu/attn_utils._allocate_kv_cache``). Both are
replaced by ``elastic_raw_tensors`` (the buffers as page-aligned regions of one
FTensor), and the views vLLM then cuts are checked to put blocks outermost,
which is where the plan (``kv_layout.read_shared_by_tensors``) expects them.

``WorkerKV`` owns that FTensor and the listener that serves the scheduler's
map/unmap requests for it with ``worker_executor.PlannedExecutor``; it closes
at exit, or when a second engine in this process makes a new one.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from kvcached import naming, vmm_ops
from kvcached.devices import normalize_device
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import WRAPPED, original, wrap_method
from kvcached.integration.vllm.kv_layout import KVLayoutPlan, refuse_unproven_on_device
from kvcached.integration.vllm.worker_executor import PlannedExecutor

logger = logging.getLogger("vllm.kvcached")

GROUP = 0  # the FTensor group holding vLLM's KV buffer in a worker process


class WorkerKV:
    """The KV buffer of this worker process and the listener serving it."""

    current: Optional[WorkerKV] = None
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
    def start(cls, plan: KVLayoutPlan, device: str, rank: int, pp_rank: int, ipc_name: str) -> WorkerKV:
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
    return naming.dp_name(naming.instance_name("vllm"), dp_rank, dp_size)


def device_string(device: Any) -> str:
    """torch.device / str -> 'cpu' or 'cuda:N' (what kvcached's backends take)."""
    try:
        return normalize_device(device)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{e}; or unset ENABLE_KVCACHED") from None


# ------------------------------------------------------- allocate_kv_cache


def _start_worker_kv(kv_cache_config: Any, device: Any) -> Tuple[KVLayoutPlan, WorkerKV]:
    """The plan of ``kv_cache_config`` and this worker's FTensor + listener for it."""
    plan = KVLayoutPlan.for_engine(kv_cache_config)
    refuse_unproven_on_device(kv_cache_config, device_string(device))
    tp, pp, dp, dp_size = _parallel_ranks()
    kv = WorkerKV.start(plan, device_string(device), tp, pp, instance_name(dp, dp_size))
    logger.info(
        "kvcached: KV buffer of %.1f MiB is virtual (%s); rank %d pp %d serves %s",
        plan.buffer_size / (1 << 20),
        plan,
        tp,
        pp,
        kv.listener.path if kv.listener else "-",
    )
    return plan, kv


def num_blocks_of_tensor(kv_cache_config: Any, tensor: Any) -> int:
    """vLLM 0.30-0.34: blocks a KVCacheTensor holds (``KVCacheConfig.num_blocks_of``)."""
    return int(kv_cache_config.num_blocks_of(tensor))


def num_blocks_uniform(kv_cache_config: Any, tensor: Any) -> int:
    """vLLM 0.29: every KVCacheTensor holds ``kv_cache_config.num_blocks`` blocks."""
    return int(kv_cache_config.num_blocks)


# Which of the two this vLLM has (versions.py: kv_blocks_per_tensor / kv_blocks_uniform_0_29).
blocks_of: Callable[[Any, Any], int] = num_blocks_of_tensor


def _elastic_allocate(
    orig: Callable[..., Dict[str, Any]],
    kv_cache_config: Any,
    device: Any,
    layout: Any,
    kernel_block_sizes: Optional[List[int]] = None,
) -> Dict[str, Any]:
    if not kv_cache_config.kv_cache_tensors:
        return orig(kv_cache_config, device, layout, kernel_block_sizes)
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    plan, kv = _start_worker_kv(kv_cache_config, device)
    buf_size = plan.buffer_size
    if current_platform.is_rocm():  # vLLM pads the ROCm buffer to 4 KiB (allocate_kv_cache)
        buf_size = -(-buf_size // 4096) * 4096
        if buf_size > plan.mapped_size:
            raise InvalidArgumentError(f"KV buffer of {buf_size} B exceeds the mapped range {plan.mapped_size} B")
    buf = kv.raw[:buf_size]

    # From here on exactly vLLM's loop (vllm/v1/worker/utils.py, 0.29-0.33).
    kv_caches: Dict[str, Any] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        layer_name = tensor.layers[0]
        group_id, group = next(
            (gid, g) for gid, g in enumerate(kv_cache_config.kv_cache_groups) if layer_name in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        num_blocks = blocks_of(kv_cache_config, tensor)
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(buf, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches


def _wrap_allocate(orig: Callable[..., Dict[str, Any]]) -> Callable[..., Dict[str, Any]]:
    # A module-level function, not a method: patch_base.wrap_method does not apply.
    @functools.wraps(orig)
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None, allocate=None):  # type: ignore[no-untyped-def]
        # vLLM 0.34 passes allocate= (None unless its extensible KV cache, which
        # kvcached turns off at config time, allocates the buffer).
        if allocate is not None:
            raise InvalidArgumentError(
                f"kvcached: vLLM passed its own KV buffer allocator ({getattr(allocate, '__qualname__', allocate)}, "
                "e.g. the extensible KV cache); kvcached backs the KV buffer itself: pass "
                "--no-enable-extensible-kv-cache or unset ENABLE_KVCACHED"
            )
        return _elastic_allocate(orig, kv_cache_config, device, layout, kernel_block_sizes)

    setattr(allocate_kv_cache, WRAPPED, orig)
    return allocate_kv_cache


def patch_allocate_kv_cache(utils: ModuleType, importers: Iterable[str] = ()) -> None:
    """Wraps ``vllm.v1.worker.utils.allocate_kv_cache`` and the by-name copies that the
    already imported modules among ``importers`` bound."""
    cur = utils.allocate_kv_cache
    if getattr(cur, WRAPPED, None) is None:
        utils.allocate_kv_cache = _wrap_allocate(cur)
    for name in importers:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "allocate_kv_cache"):
            rebind_allocate_kv_cache(mod)


def rebind_allocate_kv_cache(module: ModuleType) -> None:
    """Points ``module.allocate_kv_cache`` (bound by name at import) at the wrapper."""
    utils = importlib.import_module("vllm.v1.worker.utils")
    if getattr(utils.allocate_kv_cache, WRAPPED, None) is None:
        utils.allocate_kv_cache = _wrap_allocate(utils.allocate_kv_cache)
    if not hasattr(module, "allocate_kv_cache"):
        raise AttributeError(f"{module.__name__} no longer imports allocate_kv_cache by name")
    if original(module.allocate_kv_cache) is original(utils.allocate_kv_cache):
        module.allocate_kv_cache = utils.allocate_kv_cache


# ------------------------------------------- vLLM 0.26-0.28: runner-owned buffers


def elastic_raw_tensors(kv_cache_config: Any, device: Any) -> Dict[str, Any]:
    """What vLLM 0.26-0.28's runners allocate (``GPUModelRunner._allocate_kv_cache_tensors``,
    V2 ``gpu/attn_utils._allocate_kv_cache``): ``{layer: int8 buffer of the tensor's size}``,
    every layer of a tensor's ``shared_by`` on the same buffer. Here each buffer is a
    page-aligned region of this worker's FTensor (``kv_layout.read_shared_by_tensors``)."""
    plan, kv = _start_worker_kv(kv_cache_config, device)
    raw: Dict[str, Any] = {}
    for tensor, placement in zip(kv_cache_config.kv_cache_tensors, plan.placements):
        region = kv.raw[placement.offset : placement.offset + int(tensor.size)]
        for layer_name in tensor.shared_by:
            raw[layer_name] = region
    return raw


def check_blocks_outermost(kv_caches: Dict[str, Any], kv_cache_config: Any) -> None:
    """vLLM's views of runner-owned buffers must put block ``b`` at ``b * block bytes``
    (the plan's assumption): blocks outermost, possibly split into kernel blocks.
    K/V-first layouts (ROCm attention's ``(2, num_blocks, ...)``) are refused in one line."""
    import torch

    plan = KVLayoutPlan.for_engine(kv_cache_config)
    # One placement per KVCacheTensor (read_shared_by_tensors), each with its
    # own block size (layers of different head sizes).
    block_bytes = {
        layer: p.block_bytes for t, p in zip(kv_cache_config.kv_cache_tensors, plan.placements) for layer in t.shared_by
    }
    for name, view in kv_caches.items():
        # A Mamba layer's value is its state tensors (conv, SSM), each a view with
        # block b at b * block bytes of the same buffer.
        for t in view if isinstance(view, (list, tuple)) else (view,):
            if not isinstance(t, torch.Tensor):
                continue
            n0 = int(t.shape[0]) if t.dim() else 0
            split = n0 // plan.num_blocks if n0 and n0 % plan.num_blocks == 0 else 0
            if not split or int(t.stride(0)) * t.element_size() * split != block_bytes.get(name, plan.block_bytes):
                raise InvalidArgumentError(
                    f"kvcached: the KV cache view of {name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) "
                    "does not put blocks outermost, so kvcached cannot tell which pages hold a block; choose a "
                    "blocks-first attention backend (FlashAttention, FlashInfer, Triton) or unset ENABLE_KVCACHED"
                )


def keep_state_views(kv_caches: Dict[str, Any], raw: Dict[str, Any]) -> None:
    """vLLM 0.27+: a Mamba layer's value is a slice of its buffer (0.27-0.28: a ``[B, 1, 1, C]``
    page view the layer unpacks itself): nothing to move."""


def rebase_state_views(kv_caches: Dict[str, Any], raw: Dict[str, Any]) -> None:
    """vLLM 0.26 cuts a Mamba layer's state views with ``torch.as_strided(raw.view(dtype),
    storage_offset=...)``: an offset from the start of the *storage*, which is the layer's
    own buffer natively but kvcached's one FTensor here (``elastic_raw_tensors`` hands out
    regions of it). Left as is, every Mamba layer reads and writes the first region (wrong
    tokens from the first one on). Each state view found before its layer's region is moved
    by the region's offset, in place (the runner keeps these tensor objects); one that
    still leaves its region is an error."""
    for name, view in kv_caches.items():
        region = raw.get(name)
        if region is None or not isinstance(view, (list, tuple)):
            continue
        start, end = region.data_ptr(), region.data_ptr() + region.numel() * region.element_size()
        for t in view:
            if t.data_ptr() < start:
                shift, rest = divmod(region.storage_offset() * region.element_size(), t.element_size())
                if rest:
                    raise InvalidArgumentError(
                        f"kvcached: the state view of {name} cannot be moved to its buffer (offset {rest} B off its "
                        "element size); unset ENABLE_KVCACHED for this model"
                    )
                t.as_strided_(t.shape, t.stride(), t.storage_offset() + shift)
            last = t.data_ptr() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
            if not start <= t.data_ptr() <= last < end:
                raise InvalidArgumentError(
                    f"kvcached: the state view of {name} (shape {tuple(t.shape)}) does not lie in its KV buffer; "
                    "unset ENABLE_KVCACHED for this model"
                )


# Which of the two this vLLM needs (versions.py: mamba_state_views_as_strided_0_26).
fix_state_views: Callable[[Dict[str, Any], Dict[str, Any]], None] = keep_state_views


def patch_runner_v1_kv_buffer(module: ModuleType) -> None:
    """vLLM 0.26-0.28 V1 runner (``GPUModelRunner``, inherited by ``CPUModelRunner``)."""

    def make_allocate(orig: Callable) -> Callable:
        def _allocate_kv_cache_tensors(self, kv_cache_config):  # type: ignore[no-untyped-def]
            if not kv_cache_config.kv_cache_tensors:
                return orig(self, kv_cache_config)
            return elastic_raw_tensors(kv_cache_config, self.device)

        return _allocate_kv_cache_tensors

    def make_reshape(orig: Callable) -> Callable:
        def _reshape_kv_cache_tensors(self, kv_cache_raw_tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
            kv_caches = orig(self, kv_cache_raw_tensors, *args, **kwargs)
            if self.kv_cache_config.kv_cache_tensors:
                fix_state_views(kv_caches, kv_cache_raw_tensors)
                check_blocks_outermost(kv_caches, self.kv_cache_config)
            return kv_caches

        return _reshape_kv_cache_tensors

    wrap_method(module.GPUModelRunner, "_allocate_kv_cache_tensors", make_allocate)
    wrap_method(module.GPUModelRunner, "_reshape_kv_cache_tensors", make_reshape)


def patch_runner_v2_kv_buffer(module: ModuleType) -> None:
    """vLLM 0.26-0.28 V2 runner (``vllm.v1.worker.gpu.attn_utils``; ``init_kv_cache``
    calls both functions through this module's globals)."""
    allocate, reshape = module._allocate_kv_cache, module._reshape_kv_cache

    @functools.wraps(allocate)
    def _allocate_kv_cache(kv_cache_config, shared_layers, device):  # type: ignore[no-untyped-def]
        if not kv_cache_config.kv_cache_tensors:
            return allocate(kv_cache_config, shared_layers, device)
        return elastic_raw_tensors(kv_cache_config, device)

    @functools.wraps(reshape)
    def _reshape_kv_cache(*args, **kwargs):  # type: ignore[no-untyped-def]
        kv_caches = reshape(*args, **kwargs)
        kv_cache_config = kwargs.get("kv_cache_config")  # init_kv_cache passes it by keyword
        if kv_cache_config is None:
            raise InvalidArgumentError(
                "kvcached: vLLM's V2 runner cut KV views without naming its KV cache config, so kvcached "
                "cannot check them; unset ENABLE_KVCACHED"
            )
        if kv_cache_config.kv_cache_tensors:
            raw = kwargs["kv_cache_raw_tensors"] if "kv_cache_raw_tensors" in kwargs else args[1]
            fix_state_views(kv_caches, raw)
            check_blocks_outermost(kv_caches, kv_cache_config)
        return kv_caches

    setattr(_allocate_kv_cache, WRAPPED, allocate)
    setattr(_reshape_kv_cache, WRAPPED, reshape)
    module._allocate_kv_cache = _allocate_kv_cache
    module._reshape_kv_cache = _reshape_kv_cache
