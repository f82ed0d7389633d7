"""Threads mapping and unmapping concurrently (the GIL is released in every
driver call); the ledger stays exact."""

from __future__ import annotations

import threading

from kvcached import _C
from vmm_helpers import live_handles


def test_concurrent_map_unmap(vmm, device, page_size):
    pages = 32
    layers = vmm.create_kv_tensors(pages * page_size, 4, device, 2, 2)
    base = live_handles(device)
    errors = []

    def worker(ids):
        try:
            for _ in range(20):
                vmm.map_to_kv_tensors([i * page_size for i in ids])
                for t in layers:
                    t[:, ids[0]].fill_(ids[0])
                vmm.unmap_from_kv_tensors([i * page_size for i in ids])
            vmm.map_to_kv_tensors([i * page_size for i in ids])
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(list(range(k, pages, 4)),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert vmm.group_info()["mapped_pages"] == pages
    assert live_handles(device) - base == pages * 2 * 2


def test_page_allocator_threads_and_prefetch(vmm, device, page_size):
    vmm.create_kv_tensors(64 * page_size, 4, device, 2, 2)
    pa = _C.PageAllocator(2, 64 * page_size, page_size, min_reserved=4, max_reserved=8)
    errors, lock, held = [], threading.Lock(), []

    def worker():
        try:
            for n in range(1, 40):
                ids = pa.alloc_pages(1 + n % 3)
                with lock:
                    held.extend(ids)
                pa.free_pages(ids)
                with lock:
                    for i in ids:
                        held.remove(i)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not held
    pa.stop_prealloc_thread()
    assert pa.get_num_inuse_pages() == 0
    assert pa.get_num_mapped_pages() == pa.get_num_reserved_pages() == vmm.group_info()["mapped_pages"]
    assert pa.get_num_reserved_pages() <= 8
