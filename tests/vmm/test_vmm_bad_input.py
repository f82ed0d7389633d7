"""Bad input: a Python exception that says what was wrong and what is allowed,
and no state change."""

from __future__ import annotations

import pytest

from kvcached import _C
from kvcached.errors import InvalidArgumentError, ShutdownError


@pytest.fixture
def ready(vmm, device, page_size):
    layers = vmm.create_kv_tensors(4 * page_size, 2, device, 2, 2)
    vmm.map_to_kv_tensors([page_size])
    return layers


def _state():
    info = _C.group_info()
    return info["mapped_pages"], info["prepared_pages"], tuple(_C.mapped_offsets()), info["failed"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda v, p: v.map_to_kv_tensors([p // 2]), "not a multiple of the page size"),
        (lambda v, p: v.map_to_kv_tensors([-p]), "not a multiple of the page size"),
        (lambda v, p: v.map_to_kv_tensors([4 * p]), "out of range: each K/V buffer holds"),
        (lambda v, p: v.map_to_kv_tensors([0, 0]), "appears twice"),
        (lambda v, p: v.map_to_kv_tensors([0, p]), "already mapped \\(double map\\)"),
        (lambda v, p: v.unmap_from_kv_tensors([2 * p]), "is not mapped; nothing to unmap"),
        (lambda v, p: v.unmap_from_kv_tensors([p, 2 * p]), "is not mapped; nothing to unmap"),
        (lambda v, p: v.prepare_unmap_from_kv_tensors(1, [0]), "is not mapped"),
        (lambda v, p: v.commit_unmap_from_kv_tensors(12345), "unknown transaction"),
        (lambda v, p: v.create_kv_tensors(p, 2, "cpu" if v else "", 1), "already created|initialized for"),
        (lambda v, p: v.map_to_kv_tensors([0], group_id=3), "group 3 are not created"),
        (lambda v, p: v.map_to_kv_tensors([0], group_id=-1), "group_id must be >= 0"),
    ],
)
def test_rejected_without_state_change(vmm, page_size, ready, call, message):
    before = _state()
    with pytest.raises(InvalidArgumentError, match=message):
        call(vmm, page_size)
    assert _state() == before


def test_page_size_must_be_granularity_multiple(vmm, device):
    vmm.shutdown_kvcached()
    gran = _C.backend_info(device)["granularity"]
    with pytest.raises(InvalidArgumentError, match=f"not a multiple of the .* granularity {gran}; use a multiple"):
        vmm.init_kvcached(device, page_size=gran + gran // 2)
    with pytest.raises(InvalidArgumentError, match="granularity"):
        vmm.init_kvcached(device, page_size=0)
    assert not _C.is_initialized()
    vmm.init_kvcached(device, page_size=gran)


def test_reinit_with_other_config_refused_while_tensors_exist(vmm, device, page_size, ready):
    with pytest.raises(InvalidArgumentError, match="call shutdown_kvcached\\(\\) first"):
        vmm.init_kvcached(device, page_size=page_size * 2)
    vmm.init_kvcached(device, page_size=page_size)  # same configuration: a no-op
    assert _C.group_info()["mapped_pages"] == 1


def test_create_argument_checks(vmm, device, page_size):
    with pytest.raises(InvalidArgumentError, match="size must be > 0"):
        vmm.create_kv_tensors(0, 2, device, 1)
    with pytest.raises(InvalidArgumentError, match="num_layers must be >= 1"):
        vmm.create_kv_tensors(page_size, 2, device, 0)
    with pytest.raises(InvalidArgumentError, match="num_kv_buffers must be 1"):
        vmm.create_kv_tensors(page_size, 2, device, 1, 3)
    with pytest.raises(InvalidArgumentError, match="dtype_size 3 is not supported"):
        vmm.create_kv_tensors(page_size, 3, device, 1)
    with pytest.raises(InvalidArgumentError, match="must divide the page size"):
        vmm.create_kv_tensors(page_size, 2, device, 1, chunk_bytes=page_size // 3 + 1)
    assert not vmm.kv_tensors_created()


def test_use_after_shutdown(vmm, device, page_size, ready):
    vmm.shutdown_kvcached()
    for call in (
        lambda: vmm.map_to_kv_tensors([0]),
        lambda: vmm.unmap_from_kv_tensors([page_size]),
        lambda: vmm.create_kv_tensors(page_size, 2, device, 1),
    ):
        with pytest.raises(ShutdownError, match="call init_kvcached\\(\\) first"):
            call()
    assert not vmm.kv_tensors_created()
    vmm.init_kvcached(device, page_size=page_size)


@pytest.mark.parametrize(
    "dev, message",
    [("tpu", "unknown device 'tpu'"), ("cuda:x", "index must be a non-negative integer"), ("cpu:1", "only 'cpu'")],
)
def test_bad_device_strings(dev, message):
    with pytest.raises(InvalidArgumentError, match=message):
        _C.backend_info(dev)


def test_bad_fault_specs():
    with pytest.raises(InvalidArgumentError, match="unknown backend operation 'mop'"):
        _C.inject_fault("mop", 1)
    with pytest.raises(InvalidArgumentError, match="nth must be >= 1"):
        _C.inject_fault("map", 0)


def test_page_allocator_rejects_bad_frees(vmm, device, page_size):
    vmm.create_kv_tensors(4 * page_size, 2, device, 2, 2)
    pa = _C.PageAllocator(2, 4 * page_size, page_size, enable_prealloc=False)
    ids = pa.alloc_pages(2)
    with pytest.raises(InvalidArgumentError, match="not in use \\(double free\\?\\)"):
        pa.free_pages([ids[0], 3])
    assert pa.get_num_inuse_pages() == 2
    pa.free_page(ids[0])
    with pytest.raises(InvalidArgumentError, match="not in use"):
        pa.free_page(ids[0])
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        pa.free_pages([ids[1], ids[1]])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        pa.free_page(99)
    with pytest.raises(InvalidArgumentError, match="exceeds the virtual capacity"):
        pa.resize(8 * page_size)
    with pytest.raises(InvalidArgumentError, match="n must be >= 1"):
        pa.alloc_pages(0)
    assert pa.get_num_inuse_pages() == 1


def _dev() -> str:
    return _C.config()["device"]


# Values pybind's own casters turned into an untyped TypeError (or, for a bool,
# silently into 1): every integer argument is checked and named instead.
BAD_INTEGERS = [
    (lambda v, pa, t: v.map_to_kv_tensors([2**64]), "offsets is outside the 64-bit integer range"),
    (lambda v, pa, t: v.map_to_kv_tensors([0.0]), "offsets must be an integer, got float"),
    (lambda v, pa, t: v.map_to_kv_tensors([True]), "offsets must be an integer, got bool"),
    (lambda v, pa, t: v.map_to_kv_tensors("0"), "offsets must be a sequence of integers"),
    (lambda v, pa, t: v.map_to_kv_tensors(5), "offsets must be a sequence of integers"),
    (lambda v, pa, t: v.unmap_from_kv_tensors([None]), "offsets must be an integer, got NoneType"),
    (lambda v, pa, t: v.prepare_unmap_from_kv_tensors(2**70, [0]), "tx_id is outside the 64-bit"),
    (lambda v, pa, t: _C.commit_unmap_from_kv_tensors(1.5), "tx_id must be an integer"),
    (lambda v, pa, t: v.map_to_kv_tensors([0], group_id=2**40), "group_id must be <="),
    (lambda v, pa, t: pa.set_mem_limit(2**63), "memory limit .* outside the 64-bit integer range"),
    (lambda v, pa, t: pa.set_mem_limit(-2), "memory limit .* must be >= -1"),
    (lambda v, pa, t: pa.set_mem_limit(1e9), "must be an integer, got float"),
    (lambda v, pa, t: pa.alloc_pages(-1), "n must be >= 0"),
    (lambda v, pa, t: pa.free_pages([True]), "page ids must be an integer, got bool"),
    (lambda v, pa, t: pa.free_page(False), "page id must be an integer, got bool"),
    (lambda v, pa, t: pa.resize(2**64), "mem_size_per_layer is outside the 64-bit"),
    (lambda v, pa, t: t.set_limit(2**63), "limit is outside the 64-bit"),
    (lambda v, pa, t: t.set_limit(1, 2**32), "expected_revision must be <= 4294967295"),
    (lambda v, pa, t: t.set_limit(1, True), "expected_revision must be an integer, got bool"),
    (lambda v, pa, t: t.set_granted(-1), "granted bytes must be >= 0"),
    # Python-side arguments that pybind would have cast (issue 34, item 11).
    (lambda v, pa, t: v.create_kv_tensors(-1, 2, _dev(), 2), "size must be >= 0, got -1"),
    (lambda v, pa, t: v.create_kv_tensors(1.5, 2, _dev(), 2), "size must be an integer, got float"),
    (lambda v, pa, t: v.create_kv_tensors(0, 2, _dev(), True), "num_layers must be an integer, got bool"),
    (lambda v, pa, t: v.create_kv_tensors(0, 2, _dev(), 2, group_id=-1), "group_id must be >= 0"),
    (lambda v, pa, t: v.init_kvcached(_dev(), page_size=-65536), "page_size must be >= 0, got -65536"),
    (lambda v, pa, t: v.init_kvcached(_dev(), page_size=True), "page_size must be an integer, got bool"),
    (lambda v, pa, t: v.init_kvcached(_dev(), contiguous_layout=1), "contiguous_layout must be True"),
]


@pytest.mark.parametrize(
    "call, message", BAD_INTEGERS, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD_INTEGERS)]
)
def test_integer_arguments_are_checked_and_typed(vmm, page_size, ready, call, message):
    import uuid

    pa = _C.PageAllocator(2, 4 * page_size, page_size, 2)
    t = _C.MemInfoTracker.create(f"kvt{uuid.uuid4().hex[:8]}_bad", "t", 0, 0, page_size, page_size)
    try:
        before = (_state(), pa.mem_limit(), t.snapshot().revision, t.snapshot().limit)
        with pytest.raises(InvalidArgumentError, match=message):
            call(vmm, pa, t)
        assert (_state(), pa.mem_limit(), t.snapshot().revision, t.snapshot().limit) == before
    finally:
        t.unlink()


def test_numpy_and_torch_integers_are_accepted(vmm, page_size, ready):
    import numpy as np
    import torch

    vmm.map_to_kv_tensors(np.array([0, 2 * page_size], dtype=np.int64))
    vmm.unmap_from_kv_tensors(torch.tensor([0, 2 * page_size]))
    assert _C.mapped_offsets() == [page_size]


def test_manager_arguments_of_the_wrong_type_are_named(vmm, device, page_size):
    """KVCacheManager.free(None) and set_mem_limit(1.5) raised a plain TypeError (issue 34, item 11)."""
    from kvcached.kv_cache_manager import KVCacheManager

    vmm.create_kv_tensors(8 * page_size, 1, device, 1, 1)
    m = KVCacheManager(8, 1, page_size // 4, 1, num_kv_buffers=1)
    try:
        ids = m.alloc(2)
        before = (m.available_size(), m.page_allocator.mem_limit())
        for call, message in (
            (lambda: m.free(None), "block ids must be a list of integers, got None"),
            (lambda: m.free(7), "block ids must be a list of integers, got 7"),
            (lambda: m.set_mem_limit(1.5), "must be an integer, got float"),
            (lambda: m.set_mem_limit(True), "must be an integer, got bool"),
        ):
            with pytest.raises(InvalidArgumentError, match=message):
                call()
        assert (m.available_size(), m.page_allocator.mem_limit()) == before
        m.free(ids)
    finally:
        m.shutdown()


def test_a_bool_is_not_a_block_id():
    """operator.index(True) is 1: KVCacheManager.free([True]) must not free block 1."""
    from kvcached.block_ledger import OUT, BlockLedger

    ledger = BlockLedger(4)
    ledger.mark([0, 1], OUT)
    for bad in ([True], [False], [1, True], (b for b in [True])):
        with pytest.raises(InvalidArgumentError, match="block ids must be integers"):
            ledger.validate_free(bad)
        assert list(ledger.states) == [OUT, OUT, 0, 0]
    assert ledger.validate_free(b for b in [1]) == [1]  # any iterable of integers still works
