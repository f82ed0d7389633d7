"""Physical memory follows mapping exactly; addresses never move; unmapped
memory reads zeros from the shared zero page."""

from __future__ import annotations

import pytest
import torch

from vmm_helpers import live_handles, physical_bytes

LAYERS, KV = 3, 2


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
def test_resident_memory_follows_mapped_pages(vmm, device, page_size, contiguous):
    vmm.shutdown_kvcached()
    vmm.init_kvcached(device, page_size=page_size, contiguous_layout=contiguous)
    pages = 8
    layers = vmm.create_kv_tensors(pages * page_size, 2, device, LAYERS, KV)
    per_page = page_size * LAYERS * KV
    base = physical_bytes(device)

    offsets = [i * page_size for i in (0, 3, 5)]
    vmm.map_to_kv_tensors(offsets)
    assert physical_bytes(device) - base == 3 * per_page
    # Touching the mapped pages commits nothing new: memory was committed at map.
    for t in layers:
        t[:, 0].fill_(1)
        t[:, 3].fill_(2)
        t[:, 5].fill_(3)
    if device != "cpu":
        torch.cuda.synchronize()
    assert physical_bytes(device) - base == 3 * per_page

    vmm.unmap_from_kv_tensors(offsets[:2])
    assert physical_bytes(device) - base == 1 * per_page
    vmm.unmap_from_kv_tensors(offsets[2:])
    assert physical_bytes(device) == base


def test_addresses_stable_and_zero_page(vmm, device, page_size):
    layers = vmm.create_kv_tensors(4 * page_size, 4, device, 2, 2)
    raw = vmm.get_raw_kv_tensors()
    ptrs = [t.data_ptr() for t in layers] + [t.data_ptr() for t in raw]
    for t in layers:
        assert int(t.abs().sum()) == 0  # all of it reads the zero page

    vmm.map_to_kv_tensors([page_size])
    for t in layers:
        t[:, 1].fill_(7)
        assert int(t[:, 1].sum()) == 7 * t[:, 1].numel()
        assert int(t[:, 0].abs().sum()) == 0
    vmm.unmap_from_kv_tensors([page_size])
    for t in layers:
        assert int(t.abs().sum()) == 0  # the data is gone, the zero page is back
    vmm.map_to_kv_tensors([page_size])
    for t in layers:
        assert int(t[:, 1].abs().sum()) == 0  # a fresh page is zeroed
    assert [t.data_ptr() for t in layers] + [t.data_ptr() for t in vmm.get_raw_kv_tensors()] == ptrs


def test_tensors_outlive_shutdown_safely(vmm, device, page_size):
    layers = vmm.create_kv_tensors(2 * page_size, 4, device, 1, 2)
    before = live_handles(device)
    vmm.map_to_kv_tensors([0])
    layers[0][:, 0].fill_(5)
    vmm.shutdown_kvcached()
    # Physical pages are gone; the range still reads zeros and is not freed under us.
    assert live_handles(device) <= before
    assert int(layers[0].abs().sum()) == 0
    del layers
    vmm.init_kvcached(device, page_size=page_size)


def test_kv_tensors_created_and_info(vmm, device, page_size):
    assert not vmm.kv_tensors_created()
    vmm.create_kv_tensors(3 * page_size + 1, 1, device, 2, 2)
    assert vmm.kv_tensors_created()
    info = vmm.group_info()
    assert info["num_pages"] == 4  # rounded up to whole pages
    assert info["buffer_size"] == 4 * page_size
    assert info["bytes_per_page"] == page_size * 2 * 2


def test_torch_ops_are_registered(vmm, device, page_size):
    layers = torch.ops.kvcached.create_kv_tensors(4 * page_size, 2, device, 2)
    assert len(layers) == 2 and layers[0].shape[0] == 2
    assert torch.ops.kvcached.kv_tensors_created(0)
    torch.ops.kvcached.map_to_kv_tensors([page_size])
    layers[1][:, 1].fill_(6)
    assert int(layers[1][:, 1].min()) == 6
    torch.ops.kvcached.unmap_from_kv_tensors([page_size])
    assert int(layers[1].abs().sum()) == 0
