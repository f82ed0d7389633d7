"""Two-phase unmap: prepare+abort restores mapping and data; prepare+commit
releases; repeats are idempotent; a late prepare after abort is refused."""

from __future__ import annotations

import pytest

from kvcached import _C
from kvcached.errors import BackendError, InvalidArgumentError
from vmm_helpers import live_handles, physical_bytes


@pytest.fixture
def filled(vmm, device, page_size):
    layers = vmm.create_kv_tensors(4 * page_size, 4, device, 2, 2)
    vmm.map_to_kv_tensors([0, page_size])
    for t in layers:
        t[:, 0].fill_(3)
        t[:, 1].fill_(4)
    return layers


def _data_intact(layers) -> bool:
    return all(int(t[:, 0].min()) == 3 == int(t[:, 0].max()) and int(t[:, 1].min()) == 4 for t in layers)


def test_prepare_abort_restores_mapping_and_data(vmm, device, page_size, filled):
    handles, phys = live_handles(device), physical_bytes(device)
    vmm.prepare_unmap_from_kv_tensors(7, [0, page_size])
    assert vmm.unmap_transaction_outcome(7) == "prepared"
    assert all(int(t.abs().sum()) == 0 for t in filled)  # zero page while prepared
    assert live_handles(device) == handles  # handles retained, not released
    vmm.abort_unmap_from_kv_tensors(7)
    assert _data_intact(filled)
    assert vmm.unmap_transaction_outcome(7) == "aborted"
    assert live_handles(device) == handles and physical_bytes(device) == phys
    vmm.abort_unmap_from_kv_tensors(7)  # idempotent
    assert _data_intact(filled)


def test_prepare_commit_releases(vmm, device, page_size, filled):
    handles = live_handles(device)
    vmm.prepare_unmap_from_kv_tensors(8, [page_size])
    vmm.prepare_unmap_from_kv_tensors(8, [page_size])  # a repeated prepare is a no-op
    vmm.commit_unmap_from_kv_tensors(8)
    assert live_handles(device) == handles - 4
    vmm.commit_unmap_from_kv_tensors(8)  # idempotent
    assert live_handles(device) == handles - 4
    assert vmm.unmap_transaction_outcome(8) == "committed"
    assert _C.mapped_offsets() == [0]
    with pytest.raises(InvalidArgumentError, match="already committed"):
        vmm.abort_unmap_from_kv_tensors(8)
    with pytest.raises(InvalidArgumentError, match="already committed"):
        vmm.prepare_unmap_from_kv_tensors(8, [0])


def test_late_prepare_after_abort_is_refused(vmm, device, page_size, filled):
    vmm.abort_unmap_from_kv_tensors(11)  # the global abort reached us before the prepare
    assert vmm.unmap_transaction_outcome(11) == "aborted"
    with pytest.raises(InvalidArgumentError, match="prepare after abort is refused"):
        vmm.prepare_unmap_from_kv_tensors(11, [0])
    assert _data_intact(filled)
    with pytest.raises(InvalidArgumentError, match="was aborted"):
        vmm.commit_unmap_from_kv_tensors(11)


def test_commit_of_unknown_transaction_is_refused(vmm, filled):
    with pytest.raises(InvalidArgumentError, match="unknown transaction 99"):
        vmm.commit_unmap_from_kv_tensors(99)


def test_prepared_pages_cannot_be_touched(vmm, page_size, filled):
    vmm.prepare_unmap_from_kv_tensors(1, [0])
    with pytest.raises(InvalidArgumentError, match="pending unmap transaction"):
        vmm.map_to_kv_tensors([0])
    with pytest.raises(InvalidArgumentError, match="pending unmap transaction"):
        vmm.unmap_from_kv_tensors([0])
    with pytest.raises(InvalidArgumentError, match="another pending unmap"):
        vmm.prepare_unmap_from_kv_tensors(2, [0])
    with pytest.raises(InvalidArgumentError, match="other offsets"):
        vmm.prepare_unmap_from_kv_tensors(1, [page_size])
    vmm.abort_unmap_from_kv_tensors(1)


def test_prepare_failing_half_way_is_rolled_back(vmm, device, page_size, filled):
    handles = live_handles(device)
    _C.inject_fault("unmap", 5)  # 8 targets; fails on the 5th, after 4 were retained
    with pytest.raises(BackendError, match="still mapped with its data"):
        vmm.prepare_unmap_from_kv_tensors(21, [0, page_size])
    _C.clear_faults()
    assert _data_intact(filled)
    assert live_handles(device) == handles
    assert vmm.unmap_transaction_outcome(21) == "aborted"
    vmm.abort_unmap_from_kv_tensors(21)  # the coordinator's abort is a no-op now


def test_history_is_bounded(vmm, page_size, filled):
    for tx in range(1000, 1000 + 4097):
        vmm.abort_unmap_from_kv_tensors(tx)
    assert vmm.unmap_transaction_outcome(1000) == "unknown"
    assert vmm.unmap_transaction_outcome(1000 + 4096) == "aborted"


def test_shutdown_releases_prepared_handles(vmm, device, page_size, filled):
    handles_before_map = live_handles(device) - 8
    vmm.prepare_unmap_from_kv_tensors(5, [0])
    vmm.shutdown_kvcached()
    assert live_handles(device) <= handles_before_map + 1  # only the zero page, held by the views
    vmm.init_kvcached(device, page_size=page_size)
