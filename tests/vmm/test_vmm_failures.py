"""Rollback under injected backend faults: a failing map leaves nothing mapped
and no handle leaked; a failing rollback quarantines and fails closed."""

from __future__ import annotations

import pytest

from kvcached import _C
from kvcached.errors import BackendError, StateConsistencyError
from vmm_helpers import live_handles, physical_bytes

LAYERS, KV = 2, 2


def _setup(vmm, device, page_size, pages=6):
    layers = vmm.create_kv_tensors(pages * page_size, 4, device, LAYERS, KV)
    vmm.map_to_kv_tensors([0])  # a page with data that must survive everything
    for t in layers:
        t[:, 0].fill_(9)
    return layers


# Map of 3 offsets = 3 * LAYERS * KV = 12 targets; fail at the first, a middle and the last.
@pytest.mark.parametrize("op", ["create", "map", "set_access"])
@pytest.mark.parametrize("nth", [1, 6, 12])
def test_map_fault_at_each_step_rolls_back(vmm, device, page_size, op, nth):
    layers = _setup(vmm, device, page_size)
    handles, phys = live_handles(device), physical_bytes(device)
    offsets = [page_size, 2 * page_size, 4 * page_size]
    _C.inject_fault(op, nth)
    with pytest.raises(BackendError, match="rolled back, nothing is mapped"):
        vmm.map_to_kv_tensors(offsets)
    assert _C.faults_injected(op) >= 1
    assert vmm.group_info()["mapped_pages"] == 1
    assert _C.mapped_offsets() == [0]
    assert live_handles(device) == handles
    assert physical_bytes(device) == phys
    for t in layers:
        assert int(t[:, 0].min()) == 9 and int(t[:, 1:].abs().sum()) == 0
    # The pool still works.
    vmm.map_to_kv_tensors(offsets)
    assert vmm.group_info()["mapped_pages"] == 4


def test_failed_rollback_quarantines_and_fails_closed(vmm, device, page_size):
    _setup(vmm, device, page_size)
    # The 3rd target's map fails; rolling back the 2 mapped targets needs an
    # unmap, which fails too: the state is no longer known. (Each target's map
    # first unmaps the zero page: unmaps 1-3; the rollback's first is the 4th.)
    _C.inject_fault("map", 3)
    _C.inject_fault("unmap", 4, -1)
    with pytest.raises(StateConsistencyError, match="rollback failed"):
        vmm.map_to_kv_tensors([page_size])
    _C.clear_faults()
    info = vmm.group_info()
    assert info["failed"]
    for call in (
        lambda: vmm.map_to_kv_tensors([2 * page_size]),
        lambda: vmm.unmap_from_kv_tensors([0]),
        lambda: vmm.prepare_unmap_from_kv_tensors(1, [0]),
    ):
        with pytest.raises(StateConsistencyError, match="refuses work.*restart this instance"):
            call()


def test_zero_page_restore_failure_is_a_quarantined_hole(vmm, device, page_size):
    _setup(vmm, device, page_size)
    # The data map fails and so does putting the zero page back.
    _C.inject_fault("map", 1, 2)
    with pytest.raises(StateConsistencyError, match="quarantined"):
        vmm.map_to_kv_tensors([page_size])
    _C.clear_faults()
    assert vmm.group_info()["quarantined"] >= 1
    with pytest.raises(StateConsistencyError):
        vmm.map_to_kv_tensors([3 * page_size])


def test_unmap_fault_keeps_pages_and_data(vmm, device, page_size):
    layers = _setup(vmm, device, page_size)
    vmm.map_to_kv_tensors([page_size])
    for t in layers:
        t[:, 1].fill_(4)
    handles = live_handles(device)
    _C.inject_fault("unmap", 3)  # fails mid-way through the 8 targets
    with pytest.raises(BackendError, match="still mapped with its data"):
        vmm.unmap_from_kv_tensors([0, page_size])
    _C.clear_faults()
    assert live_handles(device) == handles
    for t in layers:
        assert int(t[:, 0].min()) == 9 and int(t[:, 1].min()) == 4
    vmm.unmap_from_kv_tensors([0, page_size])
    assert vmm.group_info()["mapped_pages"] == 0


def test_release_failure_quarantines_handle_but_stays_consistent(vmm, device, page_size):
    _setup(vmm, device, page_size)
    _C.inject_fault("release", 1)
    vmm.unmap_from_kv_tensors([0])  # the page is unmapped; one handle is kept aside
    _C.clear_faults()
    info = vmm.group_info()
    assert info["mapped_pages"] == 0 and info["quarantined"] == 1 and not info["failed"]
    vmm.map_to_kv_tensors([0])


def test_fault_spec_from_environment(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "from kvcached import vmm_ops as v, _C\n"
        "v.init_kvcached('cpu', page_size=65536)\n"
        "v.create_kv_tensors(4*65536, 2, 'cpu', 1, 2)\n"
        "base = _C.fault_calls('create')\n"
        "try:\n    v.map_to_kv_tensors([0])\nexcept Exception as e:\n    print(type(e).__name__)\n"
        "print(_C.faults_injected('create'))\n"
    )
    # The zero page is the 1st create; the map's first page is the 2nd.
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_FAULT_INJECT"}
    env["KVCACHED_FAULT_INJECT"] = "create:2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["BackendError", "1"]


def test_unreleasable_memory_is_visible_and_released_at_shutdown(vmm, device, page_size):
    """Release failures keep handles aside: group_info, the process total and
    the instance record show the bytes; shutdown releases them when the driver
    lets it."""
    import uuid

    from kvcached.cli.table import records_table
    from kvcached.limits import InstanceLimits

    q0, handles0 = _C.quarantined_bytes(), live_handles(device)
    layers = vmm.create_kv_tensors(6 * page_size, 4, device, LAYERS, KV)
    pa = _C.PageAllocator(LAYERS, 6 * page_size, page_size, KV, max_reserved=0)
    lim = InstanceLimits.for_page_allocator(
        pa, engine="t", device=device, name=f"kvt{uuid.uuid4().hex[:8]}_q", budget=None
    )
    try:
        handles1 = live_handles(device)
        ids = pa.alloc_pages(3)
        _C.inject_fault("release", 1, -1)  # every release fails from now on
        pa.free_pages(ids)
        _C.clear_faults()
        leaked = 3 * LAYERS * KV * page_size  # per-layer layout: a handle per layer and K/V buffer
        assert vmm.group_info()["quarantined_bytes"] == leaked == _C.quarantined_bytes() - q0
        assert live_handles(device) - handles1 == 3 * LAYERS * KV  # still allocated
        rec = lim.record()
        assert rec.quarantined == leaked and rec.valid
        assert "could not be released" in records_table([rec])
    finally:
        lim.close()
    del layers
    vmm.shutdown_kvcached()  # retries them: the driver lets them go now
    assert _C.quarantined_bytes() == q0 and live_handles(device) == handles0
    vmm.init_kvcached(device, page_size=page_size)


def test_shutdown_says_what_it_could_not_release(vmm, device, page_size, caplog):
    import logging

    q0, handles0 = _C.quarantined_bytes(), live_handles(device)
    layers = _setup(vmm, device, page_size)
    _C.inject_fault("release", 1, -1)
    caplog.set_level(logging.WARNING, logger="kvcached.vmm_ops")
    vmm.shutdown_kvcached()
    _C.clear_faults()
    assert any("could not be released at shutdown" in r.getMessage() for r in caplog.records)
    assert _C.quarantined_bytes() > q0
    del layers  # the tensors' last user: their destructor retries, and now the release works
    assert _C.quarantined_bytes() == q0 and live_handles(device) == handles0
    vmm.init_kvcached(device, page_size=page_size)
