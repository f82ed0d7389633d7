"""vLLM 0.26-0.28's runner-owned KV buffers, called for real on CPU tensors.

In those versions each model runner allocates its KV buffers itself; kvcached
replaces that allocation (``runner_v1_kv_buffer_0_28``, ``runner_v2_kv_buffer_0_28``)
and checks the views vLLM then cuts. The V2 runner is the GPU default in 0.26
and never runs in a CPU engine, so its two functions are called here as its
``init_kv_cache`` calls them, with the real shapes and stride orders of the GPU
attention backends (FlashAttention, Triton): a block written through vLLM's
view must land on exactly the FTensor pages the scheduler's plan maps for it.
ROCm attention's K/V-first layout is refused in one line. A Mamba hybrid's state
views (cut from the storage's start in 0.26) land on their own layer's buffer.
The V1 runner (the CPU engine's) runs end to end in test_offline_llm.py,
test_servers.py and test_model_families.py.

Skipped unless the installed vLLM is 0.26-0.28."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

P = 64 << 10  # kvcached page: 8 blocks of 8 KiB
N_BLOCKS = 64
LAYERS = ("l0", "l1")


@pytest.fixture
def v026(monkeypatch):
    import vllm

    from kvcached.integration.patch_base import parse_version
    from kvcached.integration.vllm import versions
    from kvcached.integration.vllm.versions import apply_installed
    from kvcached.integration.vllm.worker_kv import WorkerKV

    v = parse_version(vllm.__version__)
    if v not in versions.V026_028:
        pytest.skip(f"vLLM {vllm.__version__}: the runners call allocate_kv_cache (worker_allocate_kv_cache)")
    for k, val in dict(
        KVCACHED_IPC_NAME=f"kvt_runner_{os.getpid()}",
        KVCACHED_PAGE_SIZE=str(P),
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES="0",
    ).items():
        monkeypatch.setenv(k, val)
    apply_installed(("vllm.v1.kv_cache_interface", "vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.gpu_model_runner"))
    yield
    if WorkerKV.current is not None:
        WorkerKV.current.close()
        WorkerKV.current = None


def _config():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    B = spec.page_size_bytes  # 8 KiB
    tensors = [KVCacheTensor(size=N_BLOCKS * B, shared_by=[layer]) for layer in LAYERS]
    return KVCacheConfig(
        num_blocks=N_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)]
    )


def _hybrid_config():
    """Attention layers l0, l1 and Mamba layers m0, m1 (conv + SSM state padded to the
    attention page), one buffer per position shared by both groups, as vLLM builds it."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    B = attn.page_size_bytes  # 8 KiB
    mamba = MambaSpec(
        block_size=16, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32), page_size_padded=B
    )
    tensors = [KVCacheTensor(size=N_BLOCKS * B, shared_by=[a, m]) for a, m in (("l0", "m0"), ("l1", "m1"))]
    groups = [KVCacheGroupSpec(list(LAYERS), attn), KVCacheGroupSpec(["m0", "m1"], mamba)]
    return KVCacheConfig(num_blocks=N_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _v2_views(backend_name: str, cfg=None):
    """The V2 runner's init_kv_cache, its two patched steps: allocate, then reshape."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup

    module, cls = backend_name.rsplit(".", 1)
    backend = getattr(importlib.import_module(module), cls)
    cfg = cfg or _config()
    raw = attn_utils._allocate_kv_cache(cfg, {}, torch.device("cpu"))
    groups = [AttentionGroup(backend, g.layer_names, g.kv_cache_spec, i) for i, g in enumerate(cfg.kv_cache_groups)]
    with set_current_vllm_config(VllmConfig()):  # the backends' stride orders read it
        views = attn_utils._reshape_kv_cache(
            attn_groups=groups,
            kv_cache_raw_tensors=raw,
            cache_dtype="auto",
            kernel_block_sizes=[16] * len(groups),
            shared_kv_cache_layers={},
            kv_cache_config=cfg,
        )
    return raw, views


@pytest.mark.parametrize(
    "backend",
    [
        "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
        "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
    ],
)
def test_v2_runner_buffers_are_ftensor_regions_and_blocks_land_on_the_planned_pages(v026, backend):
    from kvcached import vmm_ops
    from kvcached.integration.vllm.worker_kv import GROUP, WorkerKV

    raw, views = _v2_views(backend)
    kv = WorkerKV.current
    plan = kv.plan
    # Each layer's buffer is its page-aligned region of the one FTensor (nothing committed).
    assert [raw[layer].data_ptr() - kv.raw.data_ptr() for layer in LAYERS] == [p.offset for p in plan.placements]
    assert all(raw[layer].numel() == N_BLOCKS * plan.block_bytes for layer in LAYERS)
    assert all(views[layer].data_ptr() == raw[layer].data_ptr() for layer in LAYERS)
    # Map one logical page as the scheduler would, write its blocks through vLLM's views.
    page = 3
    first, end = plan.geometry.block_range(page)
    physical = plan.physical_pages(page)
    vmm_ops.map_to_kv_tensors([ph * P for ph in physical], GROUP)
    for i, layer in enumerate(LAYERS):
        views[layer][first:end] = float(i + 1)
    written = {ph for ph in range(plan.mapped_size // P) if kv.raw[ph * P : (ph + 1) * P].any()}
    assert written == set(physical) and len(physical) == len(LAYERS)  # one page per layer, nothing else
    assert views["l1"][first:end].eq(2.0).all() and not views["l1"][:first].any()
    vmm_ops.unmap_from_kv_tensors([ph * P for ph in physical], GROUP)
    assert not views["l0"][first:end].any()  # back on the zero page


def test_v2_runner_mamba_state_lands_in_its_own_layers_buffer(v026):
    """vLLM 0.26 cuts state views with as_strided from the storage's start (the whole
    FTensor under kvcached): moved onto each layer's region, a state block written
    through them lands on that layer's page of the block, nothing else."""
    from kvcached import vmm_ops
    from kvcached.integration.vllm.worker_kv import GROUP, WorkerKV

    raw, views = _v2_views("vllm.v1.attention.backends.flash_attn.FlashAttentionBackend", _hybrid_config())
    kv = WorkerKV.current
    plan = kv.plan

    def states(layer):  # 0.26: (conv, SSM) views; 0.27-0.28: one page view the layer unpacks
        v = views[layer]
        return list(v) if isinstance(v, (list, tuple)) else [v]

    assert states("m1")[0].data_ptr() == raw["m1"].data_ptr() == raw["l1"].data_ptr() != raw["l0"].data_ptr()
    page = 3
    first, end = plan.geometry.block_range(page)
    physical = plan.physical_pages(page)
    vmm_ops.map_to_kv_tensors([ph * P for ph in physical], GROUP)
    for i, t in enumerate(states("m1")):
        t[first:end] = i + 1
    written = {ph for ph in range(plan.mapped_size // P) if kv.raw[ph * P : (ph + 1) * P].any()}
    assert written == {physical[1]}  # m1's page only: m0 (and l0) untouched
    assert not any(t[first:end].any() for t in states("m0"))
    assert all(t[first:end].eq(i + 1).all() for i, t in enumerate(states("m1")))
    vmm_ops.unmap_from_kv_tensors([ph * P for ph in physical], GROUP)


def test_v2_runner_refuses_a_kv_first_backend_in_one_line(v026):
    from kvcached.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"does not put blocks outermost") as e:
        _v2_views("vllm.v1.attention.backends.rocm_attn.RocmAttentionBackend")  # (2, num_blocks, ...)
    assert "\n" not in str(e.value) and "unset ENABLE_KVCACHED" in str(e.value)


def test_v1_runner_allocation_is_the_same_regions(v026):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcached.integration.vllm.worker_kv import WorkerKV

    cfg = _config()
    runner = SimpleNamespace(device=torch.device("cpu"))
    raw = GPUModelRunner._allocate_kv_cache_tensors(runner, cfg)
    kv = WorkerKV.current
    assert [raw[layer].data_ptr() - kv.raw.data_ptr() for layer in LAYERS] == [p.offset for p in kv.plan.placements]
    assert all(
        raw[layer].dtype == torch.int8 and raw[layer].numel() == cfg.kv_cache_tensors[0].size for layer in LAYERS
    )
