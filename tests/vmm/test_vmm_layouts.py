"""Contiguous (compound) and per-layer layouts address the same bytes through
the same per-layer views; the compound range interleaves as documented."""

from __future__ import annotations

import pytest
import torch

LAYERS, KV, PAGES = 3, 2, 5


def _fill_and_read(vmm, device, page_size, contiguous, chunk):
    vmm.shutdown_kvcached()
    vmm.init_kvcached(device, page_size=page_size, contiguous_layout=contiguous)
    layers = vmm.create_kv_tensors(PAGES * page_size, 2, device, LAYERS, KV, chunk_bytes=chunk)
    mapped = [0, 2, 3]
    vmm.map_to_kv_tensors([p * page_size for p in mapped])
    gen = torch.Generator().manual_seed(0)
    chunks_per_page = page_size // chunk
    for t in layers:
        assert t.shape == (KV, PAGES * chunks_per_page, chunk // 2)
        for p in mapped:
            rows = slice(p * chunks_per_page, (p + 1) * chunks_per_page)
            t[:, rows] = torch.randint(-1000, 1000, t[:, rows].shape, generator=gen, dtype=torch.int16).to(device)
    out = [t.cpu().clone() for t in layers]
    return out, layers


@pytest.mark.parametrize("chunk_div", [1, 4], ids=["chunk=page", "chunk=page/4"])
def test_layouts_give_identical_per_layer_views(vmm, device, page_size, chunk_div):
    chunk = page_size // chunk_div
    per_layer, _ = _fill_and_read(vmm, device, page_size, False, chunk)
    contiguous, views = _fill_and_read(vmm, device, page_size, True, chunk)
    for a, b in zip(per_layer, contiguous):
        assert torch.equal(a, b)
    # The compound range: [chunk][layer][kv][chunk bytes].
    raw = vmm.get_raw_kv_tensors()
    assert len(raw) == 1
    base = raw[0].data_ptr()
    for layer, t in enumerate(views):
        for kv in range(KV):
            for c in (0, 3):
                expect = base + (c * LAYERS * KV + layer * KV + kv) * chunk
                assert t[kv, c].data_ptr() == expect


def test_per_layer_views_are_contiguous_buffers(vmm, device, page_size):
    layers = vmm.create_kv_tensors(PAGES * page_size, 2, device, LAYERS, KV)
    raw = vmm.get_raw_kv_tensors()
    assert len(raw) == LAYERS
    for t, r in zip(layers, raw):
        assert t.is_contiguous() and t.data_ptr() == r.data_ptr()
        assert r.numel() == KV * PAGES * page_size


def test_contiguous_maps_one_compound_handle_per_page(vmm, device, page_size):
    from kvcached import _C

    vmm.shutdown_kvcached()
    vmm.init_kvcached(device, page_size=page_size, contiguous_layout=True)
    vmm.create_kv_tensors(PAGES * page_size, 2, device, LAYERS, KV)
    creates = _C.fault_calls("create")
    vmm.map_to_kv_tensors([0, page_size])
    assert _C.fault_calls("create") - creates == 2  # per-layer would need 2 * LAYERS * KV
