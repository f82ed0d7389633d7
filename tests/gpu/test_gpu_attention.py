"""Real attention kernels over elastic KV on the GPU (issue: GPU proof).

KV written and read by torch SDPA and by our Triton paged-decode kernel over
elastic tensors gives results identical to a cudaMalloc'd buffer of the same
layout, with pages mapped and unmapped between steps; and unmapping a page a
queued kernel still reads is a real hazard that deferred release prevents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vmm_helpers import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

DEV = "cuda:0"
PAGE = 2 << 20
L, H, KVH, D, BLOCK = 2, 8, 4, 128, 16
DTYPE = torch.float16
BLOCK_BYTES = BLOCK * KVH * D * 2  # 16 KiB: 128 blocks per 2 MiB page
BPP = PAGE // BLOCK_BYTES
NB = 4 * BPP


@pytest.fixture
def vmm():
    from kvcached import _C, vmm_ops

    _C.clear_faults()
    yield vmm_ops
    vmm_ops.shutdown_kvcached()


def _elastic(vmm, contiguous: bool):
    vmm.shutdown_kvcached()
    vmm.init_kvcached(DEV, page_size=PAGE, contiguous_layout=contiguous)
    layers = vmm.create_kv_tensors(NB * BLOCK_BYTES, DTYPE, DEV, L, 2, chunk_bytes=BLOCK_BYTES)
    return [(t[0].view(NB, BLOCK, KVH, D), t[1].view(NB, BLOCK, KVH, D)) for t in layers]


def _native(contiguous: bool):
    if contiguous:  # vLLM's block-outermost layout: [block][layer][kv][...]
        buf = torch.zeros(NB, L, 2, BLOCK, KVH, D, device=DEV, dtype=DTYPE)
        return [(buf[:, i, 0], buf[:, i, 1]) for i in range(L)]
    return [tuple(torch.zeros(2, NB, BLOCK, KVH, D, device=DEV, dtype=DTYPE).unbind(0)) for _ in range(L)]


def _block_tables(blocks, seq_lens):
    per_seq, it = [], iter(blocks)
    for n in seq_lens:
        per_seq.append([next(it) for _ in range(-(-n // BLOCK))])
    width = max(len(b) for b in per_seq)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in per_seq], dtype=torch.int32, device=DEV)
    return per_seq, bt


def _write(kvs, blocks, gen):
    idx = torch.tensor(blocks, device=DEV)
    for layer in kvs:
        for kv_el in layer:
            kv_el[idx] = torch.randn((len(blocks), BLOCK, KVH, D), generator=gen, device=DEV, dtype=DTYPE)


def _copy(src, dst, blocks):
    idx = torch.tensor(blocks, device=DEV)
    for (ks, vs), (kd, vd) in zip(src, dst):
        kd[idx] = ks[idx]
        vd[idx] = vs[idx]


def _sdpa(q, k_cache, v_cache, per_seq, seq_lens):
    outs = []
    for b, (blocks, n) in enumerate(zip(per_seq, seq_lens)):
        k = k_cache[torch.tensor(blocks, device=DEV)].reshape(-1, KVH, D)[:n].transpose(0, 1)
        v = v_cache[torch.tensor(blocks, device=DEV)].reshape(-1, KVH, D)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True)
        outs.append(o.squeeze(1))
    return torch.stack(outs).float()


def _map_pages_of(vmm, blocks, mapped):
    pages = sorted({b // BPP for b in blocks} - mapped)
    if pages:
        vmm.map_to_kv_tensors([p * PAGE for p in pages])
    mapped.update(pages)


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "block-outermost"])
def test_attention_over_elastic_kv_matches_native(vmm, contiguous):
    pytest.importorskip("triton")
    from kvcached.bench.paged_decode import paged_decode

    gen = torch.Generator(device=DEV).manual_seed(0)
    el, nat = _elastic(vmm, contiguous), _native(contiguous)
    # Blocks in shuffled order within pages; the longest sequence alone on
    # page 2, so that finishing it empties a page.
    rng = torch.Generator().manual_seed(1)
    pages = [[p * BPP + int(i) for i in torch.randperm(BPP, generator=rng)] for p in range(NB // BPP)]
    order = pages[0][:10] + pages[2][:19] + pages[1][:4]
    seq_lens = [37, 100, 300, 64]
    per_seq, bt = _block_tables(order, seq_lens)
    used = [b for s in per_seq for b in s]
    mapped: set = set()
    _map_pages_of(vmm, used, mapped)
    _write(el, used, gen)
    _copy(el, nat, used)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)

    def check(per_seq, bt, sl, seq_lens):
        q = torch.randn((len(seq_lens), H, D), generator=gen, device=DEV, dtype=DTYPE)
        for (ke, ve), (kn, vn) in zip(el, nat):
            out_el = paged_decode(q, ke, ve, bt, sl)
            out_nat = paged_decode(q, kn, vn, bt, sl)
            assert torch.equal(out_el, out_nat)
            ref_el = _sdpa(q, ke, ve, per_seq, seq_lens)
            assert torch.equal(ref_el, _sdpa(q, kn, vn, per_seq, seq_lens))
            torch.testing.assert_close(out_el, ref_el, atol=2e-3, rtol=2e-3)

    check(per_seq, bt, sl, seq_lens)

    # Step 2: the longest sequence finishes; pages holding none of the live
    # blocks are unmapped, a new sequence gets blocks on unmapped pages.
    live = [b for i, s in enumerate(per_seq) if i != 2 for b in s]
    free_pages = sorted(mapped - {b // BPP for b in live})
    assert free_pages, "the geometry should free at least one page"
    vmm.unmap_from_kv_tensors([p * PAGE for p in free_pages])
    mapped -= set(free_pages)
    for ke, _ in el:
        for p in free_pages:
            assert int(ke[p * BPP : (p + 1) * BPP].abs().sum()) == 0  # the zero page again
    fresh = pages[3][: -(-200 // BLOCK)]
    _map_pages_of(vmm, fresh, mapped)
    _write(el, fresh, gen)
    _copy(el, nat, fresh)
    seq_lens2 = [37, 100, 200, 64]
    per_seq2 = [per_seq[0], per_seq[1], fresh, per_seq[3]]
    width = max(len(b) for b in per_seq2)
    bt2 = torch.tensor([b + [0] * (width - len(b)) for b in per_seq2], dtype=torch.int32, device=DEV)
    check(per_seq2, bt2, torch.tensor(seq_lens2, dtype=torch.int32, device=DEV), seq_lens2)


def _one_seq(vmm):
    """Elastic per-layer KV, one 512-token sequence on page 1 of layer 0."""
    el = _elastic(vmm, False)
    blocks = list(range(BPP, BPP + 512 // BLOCK))
    bt = torch.tensor([blocks], dtype=torch.int32, device=DEV)
    sl = torch.tensor([512], dtype=torch.int32, device=DEV)
    q = torch.randn((1, H, D), device=DEV, dtype=DTYPE, generator=torch.Generator(device=DEV).manual_seed(3))
    return el, blocks, bt, sl, q


def test_unmap_under_queued_kernel_is_a_hazard(vmm):
    pytest.importorskip("triton")
    from kvcached.bench.paged_decode import paged_decode

    el, blocks, bt, sl, q = _one_seq(vmm)
    k, v = el[0]
    vmm.map_to_kv_tensors([PAGE])
    _write(el[:1], blocks, torch.Generator(device=DEV).manual_seed(4))
    ref = paged_decode(q, k, v, bt, sl)
    torch.cuda.synchronize()

    torch.cuda._sleep(500_000_000)  # keep the stream busy (~0.25 s)
    out = paged_decode(q, k, v, bt, sl)  # queued behind the sleep
    vmm.unmap_from_kv_tensors([PAGE])  # returns at once: cuMemUnmap does not wait
    torch.cuda.synchronize()
    assert not torch.allclose(out, ref), "the queued kernel should have read the zero page"


def test_deferred_release_waits_for_queued_kernels(vmm, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")  # no reserve: an empty page is unmapped
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    from kvcached.bench.paged_decode import paged_decode
    from kvcached.kv_cache_manager import KVCacheManager

    el, _, _, sl, q = _one_seq(vmm)
    k, v = el[0]
    mgr = KVCacheManager(NB, BLOCK, KVH * D * 2, L, defer_physical_release=True, page_size=PAGE)
    try:
        ids = mgr.alloc(512 // BLOCK)
        assert ids is not None and len({i // BPP for i in ids}) == 1  # page-affine: one page
        bt = torch.tensor([ids], dtype=torch.int32, device=DEV)
        _write(el[:1], ids, torch.Generator(device=DEV).manual_seed(4))
        ref = paged_decode(q, k, v, bt, sl)
        torch.cuda.synchronize()
        mapped_before = mgr.get_mapped_memory_size()

        torch.cuda._sleep(500_000_000)
        out = paged_decode(q, k, v, bt, sl)
        done = torch.cuda.Event()
        done.record()
        mgr.free(ids)  # the scheduler's view: blocks free at once ...
        marker = mgr.capture_physical_release_marker()
        assert mgr.get_mapped_memory_size() == mapped_before  # ... but the page stays mapped
        done.synchronize()  # the engine's fence: every batch that could read it finished
        mgr.release_retired_pages_through(marker)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        assert mgr.get_mapped_memory_size() == 0  # released once the fence passed
    finally:
        mgr.shutdown()
