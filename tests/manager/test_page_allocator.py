"""The C++ PageAllocator: reserve pool, background pre-mapping, rollback,
resize and limit, over the real host backend."""

from __future__ import annotations

import time

import pytest

from kvcached import _C
from kvcached.errors import BackendError, OutOfMemoryError

PAGES = 16


@pytest.fixture
def pa_env(vmm, device, page_size):
    vmm.create_kv_tensors(PAGES * page_size, 2, device, 2, 2)
    return vmm


def _wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_reserve_pool_fast_path_and_cap(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False, min_reserved=0, max_reserved=2)
    ids = pa.alloc_pages(5)
    assert sorted(ids) == [0, 1, 2, 3, 4]  # low ids first, so a shrink can drain the tail
    pa.free_pages(ids)
    assert pa.get_num_reserved_pages() == 2
    assert pa.get_num_mapped_pages() == 2 == _C.group_info()["mapped_pages"]
    creates = _C.fault_calls("create")
    again = pa.alloc_pages(2)  # served from the reserve: no driver call
    assert _C.fault_calls("create") == creates
    pa.free_pages(again)
    assert pa.trim() == 2
    assert _C.group_info()["mapped_pages"] == 0


def test_prealloc_thread_fills_reserve(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, min_reserved=3, max_reserved=5)
    assert _wait_for(lambda: pa.get_num_reserved_pages() == 3)
    assert _C.group_info()["mapped_pages"] == 3
    ids = pa.alloc_pages(3)
    assert _wait_for(lambda: pa.get_num_reserved_pages() == 3)
    pa.free_pages(ids)
    assert pa.get_num_reserved_pages() == 5
    pa.stop_prealloc_thread()


def test_alloc_failure_rolls_back_everything(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False, max_reserved=4)
    pa.free_pages(pa.alloc_pages(2))  # two reserved pages
    assert pa.get_num_reserved_pages() == 2
    _C.inject_fault("create", 3)
    with pytest.raises(BackendError):
        pa.alloc_pages(4)  # 2 from the reserve + 2 fresh; a fresh one fails
    assert pa.get_num_reserved_pages() == 2 and pa.get_num_inuse_pages() == 0
    assert pa.get_num_mapped_pages() == 2 == _C.group_info()["mapped_pages"]
    assert len(pa.alloc_pages(4)) == 4


def test_exhaustion_is_recoverable(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False)
    ids = pa.alloc_pages(PAGES)
    with pytest.raises(OutOfMemoryError, match="no free KV page"):
        pa.alloc_page()
    pa.free_page(ids[0])
    assert pa.alloc_page() == ids[0]


def test_limit_caps_mapped_pages(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False, max_reserved=4)
    pa.set_mem_limit(3 * pa.bytes_per_page)
    assert pa.get_num_free_pages() == 3
    ids = pa.alloc_pages(3)
    with pytest.raises(OutOfMemoryError):
        pa.alloc_page()
    pa.set_mem_limit(-1)
    ids.append(pa.alloc_page())
    pa.set_mem_limit(2 * pa.bytes_per_page)  # below what is mapped: frees unmap instead of reserving
    pa.free_pages(ids)
    assert pa.get_num_mapped_pages() <= 2


def test_resize_shrinks_gradually(pa_env, page_size):
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False, max_reserved=PAGES)
    ids = pa.alloc_pages(8)
    pa.free_pages(ids[:4])  # pages 0-3 reserved, 4-7 in use
    assert not pa.resize(4 * page_size)  # pages 4-7 still hold live blocks
    assert pa.get_num_total_pages() == 4
    assert pa.get_num_inuse_pages() == 4  # nothing live was touched
    pa.free_pages(ids[4:6])  # past the target: unmapped at once
    assert _C.group_info()["mapped_pages"] == 4 + 2
    assert not pa.resize(4 * page_size)
    pa.free_pages(ids[6:])
    assert pa.resize(4 * page_size)
    assert sorted(pa.alloc_pages(4)) == [0, 1, 2, 3]
    with pytest.raises(OutOfMemoryError):
        pa.alloc_page()
    assert pa.resize(PAGES * page_size)  # grow applies at once
    assert pa.alloc_page() == 4


def test_python_mapper(pa_env, page_size):
    calls = []

    def map_fn(offsets):
        calls.append(("map", list(offsets)))
        pa_env.map_to_kv_tensors(offsets)

    def unmap_fn(offsets):
        calls.append(("unmap", list(offsets)))
        pa_env.unmap_from_kv_tensors(offsets)

    pa = _C.PageAllocator(
        2, PAGES * page_size, page_size, min_reserved=0, max_reserved=0, map_fn=map_fn, unmap_fn=unmap_fn
    )
    ids = pa.alloc_pages(2)
    pa.free_pages(ids)
    assert calls == [("map", [0, page_size]), ("unmap", [0, page_size])]
    with pytest.raises(Exception, match="cannot pre-map in the background"):
        pa.start_prealloc_thread()


def test_failed_unmap_past_the_target_is_never_handed_out(pa_env, page_size):
    # Found by the manager's state machine: a page past a shrunk target whose
    # unmap failed went back to the reserve and was allocated again.
    pa = _C.PageAllocator(2, PAGES * page_size, page_size, enable_prealloc=False, max_reserved=0)
    (pid,) = pa.alloc_pages(1)
    assert not pa.resize(0)
    _C.inject_fault("unmap", 1)
    pa.free_page(pid)  # the unmap fails and is rolled back: still mapped, unused
    _C.clear_faults()
    assert pa.get_num_mapped_pages() == 1 and pa.get_num_free_pages() == 0
    with pytest.raises(OutOfMemoryError):
        pa.alloc_page()
    assert pa.trim() == 1  # retried and released
    assert pa.get_num_mapped_pages() == 0 == _C.group_info()["mapped_pages"]
