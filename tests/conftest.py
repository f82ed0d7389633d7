"""Shared fixtures. Every data-plane test runs on the host backend, and again on
the CUDA backend (marker ``gpu``) where a GPU is present; it skips cleanly
without one."""

from __future__ import annotations

import pytest

from vmm_helpers import cuda_available

MiB = 1 << 20


DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param(
        "cuda:0",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def page_size(device: str) -> int:
    # Host pages may be any multiple of the OS page; GPU pages of the 2 MiB granularity.
    return 64 * 1024 if device == "cpu" else 2 * MiB


@pytest.fixture
def vmm(device: str, page_size: int):
    """The data plane initialized for `device`; shut down and faults cleared after."""
    from kvcached import _C, vmm_ops

    _C.clear_faults()
    vmm_ops.init_kvcached(device, page_size=page_size, contiguous_layout=False)
    yield vmm_ops
    _C.clear_faults()
    vmm_ops.shutdown_kvcached()
