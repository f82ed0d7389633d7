"""The IPC tests' fixtures: the host data plane a worker listener in this process serves."""

from __future__ import annotations

import pytest

from kvcached import _C, vmm_ops
from kvcached.ipc import faults

PAGE = 64 * 1024  # the tests' page (host backend); they define the same PAGE


@pytest.fixture
def plane():
    """The host data plane with one KV group of 16 pages x 2 layers (its tensors' capsules);
    IPC and backend faults cleared and the plane shut down after."""
    _C.clear_faults()
    vmm_ops.init_kvcached("cpu", page_size=PAGE, contiguous_layout=False)
    caps = _C.create_kv_tensors(16 * PAGE, 2, 2, 0)
    yield caps
    faults.clear()
    _C.clear_faults()
    vmm_ops.shutdown_kvcached()
