"""The engine interfaces (vLLM, SGLang): KV tensors in the engines' shapes as
views over kvcached memory, managers that match them, and the checks that
keep a layout bug from looking like a full pool."""

from __future__ import annotations

import pytest
import torch

from kvcached import _C
from kvcached.errors import InvalidArgumentError, ShutdownError
from kvcached.integration.sglang import interfaces as si
from kvcached.integration.vllm import interfaces as vi

# 4 layers: with K and V a compound page is 8 pages, a power of two (see the
# report on cuMemAddressReserve alignment for other layer counts on CUDA).
LAYERS = 4


@pytest.fixture(params=[False, True], ids=["per-layer", "contiguous"])
def contiguous(request):
    return request.param


@pytest.fixture
def env(device, page_size, contiguous, monkeypatch):
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(page_size))
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "1" if contiguous else "0")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    _C.clear_faults()
    yield device
    vi.shutdown_kvcached()
    si.shutdown_kvcached()
    if _C.is_initialized():
        _C.shutdown_kvcached()


def byte_span(t: torch.Tensor):
    """First and last byte address a (strided) tensor touches."""
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size() - 1


def page_of_address(addr: int, group_id: int = 0):
    """(layer or -1, kv buffer or -1, page id) of an address in the group's tensors."""
    info = _C.group_info(group_id)
    raws = [torch.utils.dlpack.from_dlpack(c) for c in _C.raw_kv_tensors(group_id)]
    P, buf = info["page_size"], info["buffer_size"]
    if info["contiguous_layout"]:
        off = addr - raws[0].data_ptr()
        assert 0 <= off < raws[0].numel()
        return -1, -1, off // (P * info["num_layers"] * info["num_kv_buffers"])
    for layer, r in enumerate(raws):
        off = addr - r.data_ptr()
        if 0 <= off < r.numel():
            return layer, off // buf, (off % buf) // P
    raise AssertionError("address outside the KV tensors")


def assert_block_on_one_page(block_view: torch.Tensor, page: int):
    lo, hi = byte_span(block_view)
    a, b = page_of_address(lo), page_of_address(hi)
    assert a == b, f"block spans {a} .. {b}"
    assert a[2] == page


# ------------------------------------------------------------------ vLLM


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_vllm_flash_attention_shapes_and_pages(env, layout, page_size):
    device = env
    vi.init_kvcached(device=device)
    bs, heads, dim = 16, 4, 64
    blocks = 3 * page_size // (bs * heads * dim * 2)  # three pages
    shape = (2, blocks, bs, heads, dim)
    caches = vi.alloc_kv_cache(shape, bs, torch.float16, device, LAYERS, kv_layout=layout)
    assert len(caches) == LAYERS
    for c in caches:
        assert tuple(c.shape) == shape and c.dtype == torch.float16
        if layout == "HND":
            assert c.stride(3) > c.stride(2)  # heads outside tokens in memory
    m = vi.get_kv_cache_manager(blocks, bs, heads * dim * 2, LAYERS)
    assert m.null_block == [0] and m.num_kv_buffers == 2
    ids = m.alloc(blocks // 3 + 5)  # two pages
    for layer, c in enumerate(caches):
        for b in ids:
            for kv in (0, 1):
                assert_block_on_one_page(c[kv, b], m.get_page_id(b))
            c[:, b] = layer * 100 + b
    for layer, c in enumerate(caches):
        for b in ids:
            assert bool((c[:, b] == layer * 100 + b).all())
    # Blocks on pages the manager does not hold read the zero page.
    held = set(m.get_page_occupancy())
    unmapped = [b for b in range(blocks) if m.get_page_id(b) not in held]
    assert unmapped
    for c in caches:
        assert int(c[:, unmapped].abs().sum()) == 0
    m.free(ids)


def test_vllm_flashinfer_layout_is_one_buffer(env, contiguous):
    device = env
    vi.init_kvcached(device=device)
    blocks, bs, heads, dim = 64, 16, 2, 64
    caches = vi.alloc_kv_cache((blocks, 2, bs, heads, dim), bs, torch.bfloat16, device, LAYERS)
    assert tuple(caches[0].shape) == (blocks, 2, bs, heads, dim)
    m = vi.get_kv_cache_manager(blocks, bs, 2 * heads * dim * 2, LAYERS)
    assert m.num_kv_buffers == 1  # taken from the tensors
    ids = m.alloc(10)
    for c in caches:
        for b in ids:
            assert_block_on_one_page(c[b], m.get_page_id(b))
            c[b, 0] = 1
            c[b, 1] = 2
    assert float(caches[1][ids[0], 1].float().mean()) == 2.0
    m.free(ids)


def test_vllm_mla_blocks_that_straddle_pages_are_never_handed_out(env, contiguous, page_size):
    device = env
    vi.init_kvcached(device=device)
    bs, dim = 16, 576  # DeepSeek latent rows: 18 KiB blocks do not divide the page
    cell = dim * 2
    blocks = 4 * page_size // (bs * cell)
    if contiguous:
        with pytest.raises(InvalidArgumentError, match="must divide the page size"):
            vi.alloc_kv_cache((blocks, bs, dim), bs, torch.float16, device, LAYERS, attention_type="MLA")
        return
    caches = vi.alloc_kv_cache((blocks, bs, dim), bs, torch.float16, device, LAYERS, attention_type="MLA")
    assert tuple(caches[0].shape) == (blocks, bs, dim)
    m = vi.get_kv_cache_manager(blocks, bs, cell, LAYERS)
    assert m.num_kv_buffers == 1 and not m.geometry.exact
    ids = m.alloc(m.available_size())
    assert len(ids) == m.geometry.num_usable_blocks - 1  # all but the null block
    for c in caches:
        for b in ids:
            assert_block_on_one_page(c[b], m.get_page_id(b))
            c[b].fill_(3)  # every handed-out block is writable: its page is mapped
    m.free(ids)


def test_vllm_geometry_refused_with_a_working_one(env, page_size):
    device = env
    vi.init_kvcached(device=device)
    heads, dim = 32, 128
    bs = 2 * page_size // (heads * dim * 2)  # a block of two pages
    with pytest.raises(InvalidArgumentError, match=r"does not fit in a page; use block_size=\d+"):
        vi.alloc_kv_cache((2, 8, bs, heads, dim), bs, torch.float16, device, LAYERS)
    with pytest.raises(InvalidArgumentError, match="block_size 16 does not match"):
        vi.alloc_kv_cache((2, 8, 32, 2, 8), 16, torch.float16, device, LAYERS)
    with pytest.raises(InvalidArgumentError, match="attention_type"):
        vi.alloc_kv_cache((2, 8, 16, 2, 8), 16, torch.float16, device, LAYERS, attention_type="SWA")
    with pytest.raises(InvalidArgumentError, match="kv_layout"):
        vi.alloc_kv_cache((2, 8, 16, 2, 8), 16, torch.float16, device, LAYERS, kv_layout="NDH")
    with pytest.raises(InvalidArgumentError, match="positive"):
        vi.alloc_kv_cache((2, 0, 16, 2, 8), 16, torch.float16, device, LAYERS)


def test_manager_and_tensors_are_cross_checked_in_both_orders(env):
    device = env
    vi.init_kvcached(device=device)
    blocks, bs, heads, dim = 64, 16, 2, 32
    vi.alloc_kv_cache((2, blocks, bs, heads, dim), bs, torch.float32, device, LAYERS)
    with pytest.raises(InvalidArgumentError, match="bytes per block"):
        vi.get_kv_cache_manager(blocks, bs, heads * dim * 2, LAYERS)  # fp16 cells over fp32 tensors
    with pytest.raises(InvalidArgumentError, match="blocks"):
        vi.get_kv_cache_manager(blocks * 2, bs, heads * dim * 4, LAYERS)
    m = vi.get_kv_cache_manager(blocks, bs, heads * dim * 4, LAYERS)
    assert m.available_size() == blocks - 1
    vi.shutdown_kvcached()

    # Manager first (scheduler side), then the tensors: checked against it.
    vi.init_kvcached(device=device)
    pages_fn = []
    m = vi.get_kv_cache_manager(blocks, bs, heads * dim * 4, LAYERS, map_fn=pages_fn.append, unmap_fn=pages_fn.append)
    with pytest.raises(InvalidArgumentError, match="do not match"):
        vi.alloc_kv_cache((2, blocks, bs, heads, dim), bs, torch.float16, device, LAYERS)
    vi.shutdown_kvcached()
    with pytest.raises(ShutdownError):
        m.alloc(1)


def test_init_is_idempotent_and_checked(env):
    device = env
    with pytest.raises(ShutdownError, match="init_kvcached"):
        vi.alloc_kv_cache((2, 8, 16, 2, 8), 16, torch.float16, device, 1)
    vi.init_kvcached(device=device)
    vi.init_kvcached(device=device)  # no-op
    with pytest.raises(InvalidArgumentError, match="already initialized"):
        vi.init_kvcached(device="cuda:7" if device == "cpu" else "cpu")
    vi.shutdown_kvcached()
    with pytest.raises(InvalidArgumentError, match="tp_rank"):
        vi.init_kvcached(tp_rank=2, world_size=2, device=device)


# ----------------------------------------------------------------- SGLang


@pytest.mark.parametrize("page_tokens", [1, 16])
def test_sglang_mha_token_buffers(env, page_tokens):
    device = env
    si.init_kvcached(device=device)
    heads, dim = 2, 64
    tokens = 64 * 16 + page_tokens  # SGLang sizes pools as size + page_size
    k, v = si.alloc_kv_cache((tokens, heads, dim), torch.bfloat16, device, LAYERS, page_size=page_tokens)
    assert len(k) == len(v) == LAYERS
    assert tuple(k[0].shape) == (tokens, heads, dim) and k[0].dtype == torch.bfloat16
    m = si.get_kv_cache_manager(tokens // page_tokens, page_tokens, heads * dim * 2, LAYERS)
    assert m.null_block == [0]
    blocks = m.alloc(7)
    rows = [b * page_tokens + t for b in blocks for t in range(page_tokens)]
    for layer in range(LAYERS):
        for b in blocks:
            span = slice(b * page_tokens, (b + 1) * page_tokens)
            assert_block_on_one_page(k[layer][span], m.get_page_id(b))
            assert_block_on_one_page(v[layer][span], m.get_page_id(b))
        k[layer][rows] = 1.0
        v[layer][rows] = 2.0
    assert float(k[2][rows].float().mean()) == 1.0 and float(v[2][rows].float().mean()) == 2.0
    idle = m.available_size()
    m.free(blocks)
    assert m.available_size() == idle + 7 == m.logical_free_size()


def test_sglang_mla_single_buffer(env, contiguous):
    device = env
    si.init_kvcached(device=device)
    tokens, dim = 4096 + 1, 576
    if contiguous:  # 1152-byte latent rows cannot interleave pages of a power of two
        with pytest.raises(InvalidArgumentError, match="must divide the page size"):
            si.alloc_kv_cache((tokens, 1, dim), torch.float16, device, LAYERS, attention_type="MLA")
        return
    kv = si.alloc_kv_cache((tokens, 1, dim), torch.float16, device, LAYERS, page_size=1, attention_type="MLA")
    assert isinstance(kv, list) and len(kv) == LAYERS and tuple(kv[0].shape) == (tokens, 1, dim)
    m = si.get_kv_cache_manager(tokens, 1, dim * 2, LAYERS)
    assert m.num_kv_buffers == 1
    ids = m.alloc(100)
    for t in kv:
        t[ids] = 5.0
        for b in ids[:10]:
            assert_block_on_one_page(t[b], m.get_page_id(b))
    m.free(ids)


def test_sglang_bad_input(env):
    device = env
    si.init_kvcached(device=device)
    with pytest.raises(InvalidArgumentError, match="NHD"):
        si.alloc_kv_cache((64, 2, 8), torch.float16, device, 1, kv_layout="HND")
    with pytest.raises(InvalidArgumentError, match="page_size"):
        si.alloc_kv_cache((64, 2, 8), torch.float16, device, 1, page_size=0)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        si.alloc_kv_cache((64, 2, 8), "float16", device, 1)


def test_shutdown_stops_every_manager(env):
    device = env
    si.init_kvcached(device=device)
    si.alloc_kv_cache((1024, 2, 16), torch.float16, device, LAYERS)
    m = si.get_kv_cache_manager(1024, 1, 2 * 16 * 2, LAYERS)
    ids = m.alloc(10)
    assert m.get_mapped_memory_size() > 0
    si.shutdown_kvcached()
    assert not _C.is_initialized()
    with pytest.raises(ShutdownError):
        m.free(ids)
    si.shutdown_kvcached()  # idempotent
