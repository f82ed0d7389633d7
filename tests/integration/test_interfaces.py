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


# ------------------------------------------------ upstream's newer arguments


def raw_offset(t: torch.Tensor, group_id: int = 0) -> int:
    """Byte offset of a tensor's first element in the group's raw range (its layer's, per layer)."""
    layer, kv, page = page_of_address(t.data_ptr(), group_id)
    raws = [torch.utils.dlpack.from_dlpack(c) for c in _C.raw_kv_tensors(group_id)]
    return t.data_ptr() - raws[max(layer, 0)].data_ptr()


@pytest.mark.parametrize("form", ["flash_attn", "flashinfer", "mla"])
def test_vllm_kernel_blocks_index_the_same_bytes(env, contiguous, form, page_size):
    device = env
    vi.init_kvcached(device=device)
    bs, kbs, heads, dim = 16, 4, 2, 32
    blocks = 2 * page_size // (bs * heads * dim * 2)
    shape = {
        "flash_attn": (2, blocks, bs, heads, dim),
        "flashinfer": (blocks, 2, bs, heads, dim),
        "mla": (blocks, bs, dim),
    }[form]
    atype = "MLA" if form == "mla" else "MHA"
    if contiguous:
        with pytest.raises(InvalidArgumentError, match="KVCACHED_CONTIGUOUS_LAYOUT=false"):
            vi.alloc_kv_cache(shape, bs, torch.float16, device, LAYERS, atype, kernel_block_size=kbs)
        return
    with pytest.raises(InvalidArgumentError, match="multiple of kernel_block_size"):
        vi.alloc_kv_cache(shape, bs, torch.float16, device, LAYERS, atype, kernel_block_size=5)
    caches = vi.alloc_kv_cache(shape, bs, torch.float16, device, LAYERS, atype, "NHD", 0, kbs)  # upstream's order
    r = bs // kbs
    kernel = {"flash_attn": (2, blocks * r, kbs, heads, dim), "flashinfer": (blocks * r, 2, kbs, heads, dim)}
    assert tuple(caches[0].shape) == kernel.get(form, (blocks * r, kbs, dim))
    cell = (heads * dim if form != "mla" else dim) * 2
    m = vi.get_kv_cache_manager(blocks, bs, cell, LAYERS)  # K and V apart: num_kv_buffers from the tensors
    assert m.num_kv_buffers == (1 if form == "mla" else 2)
    ids = m.alloc(5)
    for c in caches:
        for b in ids:
            for j in range(r):  # kernel block b*r+j is tokens j*kbs.. of block b
                kb = b * r + j
                views = [c[kb]] if form == "mla" else ([c[0, kb], c[1, kb]] if form == "flash_attn" else list(c[kb]))
                for kv, v in enumerate(views):
                    assert_block_on_one_page(v, m.get_page_id(b))
                    assert (
                        raw_offset(v)
                        == kv * _C.group_info(0)["buffer_size"] * (form != "mla") + (b * bs + j * kbs) * cell
                    )
                    v.fill_(kv + 1)
                    assert float(v.float().mean()) == kv + 1  # mapped: the write stays
    m.free(ids)


@pytest.mark.parametrize("form", ["flash_attn", "flashinfer"])
def test_vllm_hybrid_linear_interleaves_k_and_v_per_kernel_block(env, contiguous, form, page_size):
    device = env
    vi.init_kvcached(device=device)
    bs, kbs, heads, dim = 16, 8, 2, 32
    blocks = 2 * page_size // (2 * bs * heads * dim * 2)
    shape = (2, blocks, bs, heads, dim) if form == "flash_attn" else (blocks, 2, bs, heads, dim)
    caches, info = vi.alloc_kv_cache(shape, bs, torch.float16, device, LAYERS, "HYBRID_LINEAR", kernel_block_size=kbs)
    h = kbs * heads * dim * 2  # bytes of one kernel block of K (or V)
    blk = 2 * bs * heads * dim * 2
    assert info["page_size_bytes"] == blk and info["num_blocks"] == blocks and info["num_pools"] == LAYERS
    assert info["is_contiguous"] is contiguous
    assert info["block_stride_bytes"] == (LAYERS * blk if contiguous else blk)
    m = vi.get_kv_cache_manager(blocks, bs, 2 * heads * dim * 2, LAYERS, 1)  # upstream: 5th positional is kv buffers
    assert m.num_kv_buffers == 1
    ids = m.alloc(3)
    for layer, c in enumerate(caches):
        for b in ids:
            for j in range(bs // kbs):
                kb = b * (bs // kbs) + j
                k, v = (c[0, kb], c[1, kb]) if form == "flash_attn" else (c[kb, 0], c[kb, 1])
                assert raw_offset(v) - raw_offset(k) == h  # V right after K
                assert_block_on_one_page(k, m.get_page_id(b))
                assert_block_on_one_page(v, m.get_page_id(b))
                k.fill_(1 + layer)
                v.fill_(2 + layer)
            if not contiguous:  # the mamba view of the block: the pool's buffer at the block stride
                raw = info["buffers"][layer][b * blk : (b + 1) * blk].view(torch.float16)
                assert float(raw[: h // 2].float().mean()) == 1 + layer
                assert float(raw[h // 2 : h].float().mean()) == 2 + layer
    if contiguous:  # one block of every pool: the same bytes as the attention views of all layers
        per_kernel = h // 2  # elements of one kernel block of K
        expect = sum((1 + i + 2 + i) * per_kernel * (bs // kbs) for i in range(LAYERS))
        for b in ids:
            raw = info["buffers"][0][b * info["block_stride_bytes"] : (b + 1) * info["block_stride_bytes"]]
            assert float(raw.view(torch.float16).float().sum()) == expect
    m.free(ids)


def test_vllm_return_meta_and_build_kv_views_alias_the_same_memory(env, contiguous):
    device = env
    vi.init_kvcached(device=device)
    blocks, bs, heads, dim = 64, 16, 2, 32
    caches, meta = vi.alloc_kv_cache((2, blocks, bs, heads, dim), bs, torch.float16, device, LAYERS, return_meta=True)
    assert set(meta) == {
        "raw_kv_tensors",
        "num_blocks_per_layer",
        "gpu_mem_bytes_per_layer_k_or_v",
        "num_layers",
        "dtype",
    }
    # A second group (Gemma-style): another head split over the same block bytes.
    views, block_bytes = vi.build_kv_views(
        meta["raw_kv_tensors"], (2, blocks, bs, heads * 2, dim // 2), bs, torch.float16, "MHA",
        meta["num_blocks_per_layer"], meta["gpu_mem_bytes_per_layer_k_or_v"], meta["num_layers"],
    )  # fmt: skip
    assert block_bytes == 2 * bs * heads * dim * 2 and len(views) == LAYERS
    m = vi.get_kv_cache_manager(blocks, bs, heads * dim * 2, LAYERS)
    ids = m.alloc(4)
    for c, w in zip(caches, views):
        for b in ids:
            c[:, b] = float(b)
            assert byte_span(c[0, b]) == byte_span(w[0, b]) and byte_span(c[1, b]) == byte_span(w[1, b])
            assert float(w[1, b].float().mean()) == float(b)
    m.free(ids)


def test_sglang_upstream_positions_and_mamba_states(env, contiguous, page_size):
    device = env
    si.init_kvcached(0, 1, 0, device)  # upstream: (tp_rank, world_size, pp_rank, device)
    assert si.observability_snapshot().to_dict()["initialized"] is True
    conv_shapes, temporal = [(4, 8), (2, 8)], (2, 4, 4)

    class Params:  # SGLang's Mamba2CacheParams shape
        shape = type("S", (), {"conv": conv_shapes, "temporal": temporal})
        dtype = type("D", (), {"conv": torch.float16, "temporal": torch.float32})

    slots, layers = 64, 3
    conv, temp, info = si.alloc_mamba_states(
        num_slots=slots, num_mamba_layers=layers, cache_params=Params, device=device
    )
    raw = 4 * 8 * 2 + 2 * 8 * 2 + 2 * 4 * 4 * 4  # 352 bytes, padded to a divisor of the page
    assert info["cell_size"] >= raw and page_size % info["cell_size"] == 0
    assert info["conv_offsets"] == [0, 64] and info["temporal_offset"] == 96
    if contiguous:
        assert tuple(conv[0].shape) == (layers, slots, 4, 8) and tuple(temp.shape) == (layers, slots, *temporal)
        per_layer = lambda st, i: st[i]  # noqa: E731
    else:
        assert tuple(conv[0][0].shape) == (slots, 4, 8) and tuple(temp[0].shape) == (slots, *temporal)
        per_layer = lambda st, i: st[i]  # noqa: E731
    m = si.get_kv_cache_manager(slots, 1, info["cell_size"], layers, True, 1)  # 6th positional: kv buffers
    ids = m.alloc(5)
    for i in range(layers):
        for s in ids:
            assert_block_on_one_page(per_layer(temp, i)[s], m.get_page_id(s))
            per_layer(temp, i)[s] = float(i + 1)
            per_layer(conv[1], i)[s] = -1.0
    assert float(per_layer(temp, layers - 1)[ids[0]].mean()) == layers
    assert float(per_layer(conv[1], 0)[ids[-1]].float().mean()) == -1.0
    assert float(per_layer(conv[0], 0)[ids[0]].float().abs().sum()) == 0.0  # other kinds untouched
    m.free(ids)
