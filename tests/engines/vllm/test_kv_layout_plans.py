"""vLLM 0.29+'s own KV layouts for real models' specs, read by kvcached's plan.

No model and no engine: vLLM's planner (``get_kv_cache_config_from_groups``) is
called with a config namespace, as the engine core calls it.

* A real Qwen3-Next-80B at TP 1 (bfloat16 state: attention and gated-delta-net
  blocks evened out to 1,114,112 B, which divides no page) in the default
  layer-outermost layout: vLLM starts each layer region mid-page, so a logical
  page touches about 21 physical pages for 12 layer regions, and the ledger had
  to charge that. Through the engine core's patched ``get_kv_cache_configs``
  (``kv_regions_page_aligned``) it is exactly 12, with the same usable blocks.
* A dense Llama-3-8B shape whose block count is not a multiple of the blocks a page
  holds (almost any KV size): 62 pages charged per logical page for 32 layers, now 32.
* The six layouts: the four that keep a layer's block one run are planned;
  LHBNC and BHLNC (heads outside the blocks) are refused in one line.

Skipped unless vLLM is 0.29+ (0.26-0.28 lay buffers end to end, page aligned)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

MiB = 1 << 20


@pytest.fixture(scope="module")
def vllm_planner():
    """vLLM's planner module; the plan reads 0.29+ tensors and serves Mamba state, as
    the installed version's patches make it (undone after, leaving no patch marks)."""
    import vllm

    from kvcached.integration.patch_base import parse_version
    from kvcached.integration.vllm import kv_layout, versions

    if parse_version(vllm.__version__) not in versions.V029_034:
        pytest.skip(f"vLLM {vllm.__version__}: KVCacheTensor(size, shared_by): buffers laid page aligned already")
    planner = None
    for name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):  # 0.33 moved it
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "get_kv_cache_config_from_groups"):
            planner = mod
            break
    assert planner is not None, "vLLM has no get_kv_cache_config_from_groups"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_layout.KVLayoutPlan, "tensor_reader", staticmethod(kv_layout.read_layer_tensors))
        mp.setattr(kv_layout, "SUPPORTED_SPECS", (*kv_layout.SUPPORTED_SPECS, "MambaSpec"))
        yield planner


def _config(planner, groups, layout: str, memory: int = 20 << 30):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    vc = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout],
            kv_cache_layout=layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
    )
    return planner.get_kv_cache_config_from_groups(vc, groups, memory)


def _qwen3_next_80b_groups(planner, ssm_dtype=None):
    """48 layers, every 4th full attention (2 KV heads x 256), the rest gated-delta-net
    (conv state 8192 x 3, recurrent state 32 x 128 x 128, bfloat16), blocks evened out
    as vLLM's hybrid config does (attention block size rounded up to cover the state)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    ssm_dtype = ssm_dtype or torch.bfloat16
    state = 8192 * 3 * 2 + 32 * 128 * 128 * ssm_dtype.itemsize
    per_token = 2 * 256 * 2 * 2
    tokens = -(-state // per_token)  # ceil
    block_size = -(-tokens // 16) * 16
    specs = {}
    for i in range(48):
        if i % 4 == 3:
            specs[f"layers.{i}"] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
            )
        else:
            specs[f"layers.{i}"] = MambaSpec(
                block_size=block_size,
                shapes=((8192, 3), (32, 128, 128)),
                dtypes=(torch.bfloat16, ssm_dtype),
                page_size_padded=block_size * per_token,
            )
    return planner._get_kv_cache_groups_uniform_page_size(specs)


@pytest.mark.parametrize("page_mib", [4, 16])
def test_a_real_qwen3_next_is_charged_one_page_per_layer_region(vllm_planner, page_mib, monkeypatch):
    from kvcached.integration.vllm.kv_layout import KVLayoutPlan
    from kvcached.integration.vllm.kv_regions import patch_kv_cache_configs

    page = page_mib * MiB
    groups = _qwen3_next_80b_groups(vllm_planner)
    assert len(groups) == 4 and {len(g.layer_names) for g in groups} == {12}
    native = _config(vllm_planner, groups, "LBHNC")
    assert native.kv_cache_tensors[0].block_stride == 1114112
    as_vllm_made_it = KVLayoutPlan.from_kv_cache_config(native, page)
    assert as_vllm_made_it.physical_pages_per_logical_page() > 12  # regions start mid-page

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(page))
    core = SimpleNamespace(get_kv_cache_configs=lambda *a: [_config(vllm_planner, groups, "LBHNC")])
    patch_kv_cache_configs(core)
    (aligned,) = core.get_kv_cache_configs(None, [], [0])
    plan = KVLayoutPlan.from_kv_cache_config(aligned, page)
    assert plan.physical_pages_per_logical_page() == 12
    assert all(len(plan.physical_pages(p)) == 12 for p in range(plan.num_logical_pages))
    assert plan.num_logical_pages * 12 * page <= plan.mapped_size  # the ledger never holds more than exists
    assert plan.geometry.num_pages == as_vllm_made_it.geometry.num_pages  # the same usable blocks
    # vLLM's views of the padded layout: layer l of block b where the plan says.
    t = aligned.kv_cache_tensors[0]
    assert t.layer_stride % page == 0 and t.offset == 0 and t.size == 12 * t.layer_stride


def test_a_dense_model_whose_blocks_do_not_fill_whole_pages_is_charged_one_page_per_layer(vllm_planner, monkeypatch):
    """A Llama-3-8B shape (32 layers, 64 KiB blocks, 32 a page) with 20.7 GiB of KV:
    vLLM's 10,598 blocks leave each layer region 6 blocks past a page boundary from the
    last, so most regions start mid-page; every logical page was charged 62 pages for
    32 layers (the limit and the device budget nearly doubled)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvcached.integration.vllm.kv_layout import KVLayoutPlan
    from kvcached.integration.vllm.kv_regions import patch_kv_cache_configs

    specs = {
        f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        for i in range(32)
    }
    groups = vllm_planner._get_kv_cache_groups_uniform_spec(specs)
    memory = int(20.7 * (1 << 30))
    native = _config(vllm_planner, groups, "LBHNC", memory)
    assert native.num_blocks == 10598
    assert KVLayoutPlan.from_kv_cache_config(native, 2 * MiB).physical_pages_per_logical_page() == 62

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(2 * MiB))
    core = SimpleNamespace(get_kv_cache_configs=lambda *a: [_config(vllm_planner, groups, "LBHNC", memory)])
    patch_kv_cache_configs(core)
    (aligned,) = core.get_kv_cache_configs(None, [], [0])
    assert KVLayoutPlan.from_kv_cache_config(aligned, 2 * MiB).physical_pages_per_logical_page() == 32


@pytest.mark.parametrize(
    "layout, planned",
    [("LBHNC", True), ("LBNHC", True), ("BLHNC", True), ("BLNHC", True), ("LHBNC", False), ("BHLNC", False)],
)
def test_layouts_with_heads_outside_the_blocks_are_refused_in_one_line(vllm_planner, layout, planned):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvcached.errors import InvalidArgumentError
    from kvcached.integration.vllm.kv_layout import KVLayoutPlan

    specs = {
        f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16) for i in (0, 1)
    }
    groups = vllm_planner._get_kv_cache_groups_uniform_spec(specs)
    cfg = _config(vllm_planner, groups, layout, memory=64 << 20)
    if planned:
        plan = KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)
        assert plan.physical_pages_per_logical_page() == 2
    else:
        with pytest.raises(InvalidArgumentError, match="heads outside the blocks.*VLLM_KV_CACHE_LAYOUT=LBHNC"):
            KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)


def test_a_state_block_larger_than_the_default_page_gets_a_page_that_holds_it(vllm_planner, monkeypatch):
    """Issue 29, item 3: a real Qwen3-Next with its recurrent state in float32 (2 MiB + the
    conv state a layer: blocks of 2.1 MiB) used to stop start-up asking for KVCACHED_PAGE_SIZE.
    Unset, the page is chosen from the spec (a multiple of 2 MiB holding a block on every page,
    at least 90% used), the same in the engine core, scheduler and workers; set, it is kept
    and a block larger than it is refused in one line naming the size to use."""
    from kvcached.block_geometry import GOOD_UTILIZATION, page_utilization
    from kvcached.errors import InvalidArgumentError
    from kvcached.integration.vllm.kv_layout import KVLayoutPlan, page_size_for
    from kvcached.integration.vllm.kv_regions import patch_kv_cache_configs

    groups = _qwen3_next_80b_groups(vllm_planner, ssm_dtype=torch.float32)
    monkeypatch.delenv("KVCACHED_PAGE_SIZE", raising=False)
    monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB", raising=False)
    native = _config(vllm_planner, groups, "LBHNC")
    block = native.kv_cache_tensors[0].block_stride
    assert block > 2 * MiB
    page = page_size_for(native)
    assert page % (2 * MiB) == 0 and page >= block and page_utilization(page, block) >= GOOD_UTILIZATION
    core = SimpleNamespace(get_kv_cache_configs=lambda *a: [_config(vllm_planner, groups, "LBHNC")])
    patch_kv_cache_configs(core)
    (aligned,) = core.get_kv_cache_configs(None, [], [0])
    assert page_size_for(aligned) == page  # what the workers and the scheduler compute from it
    plan = KVLayoutPlan.for_engine(aligned)
    assert plan.page_size == page and plan.physical_pages_per_logical_page() == 12
    assert aligned.kv_cache_tensors[0].layer_stride % page == 0

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(2 * MiB))  # the user's choice is kept
    assert page_size_for(native) == 2 * MiB
    with pytest.raises(InvalidArgumentError, match="KVCACHED_PAGE_SIZE="):
        KVLayoutPlan.for_engine(native)
