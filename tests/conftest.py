"""Shared fixtures. Every data-plane test runs on the host backend, and again on
the CUDA backend (marker ``gpu``) where a GPU is present; it skips cleanly
without one.

Layout: the folders mirror the package (``tests/limits`` tests ``kvcached/limits``,
``tests/manager`` the KV cache manager and page allocator, ...); tests of a module at
the package root (``kvcached/config.py``) and of the whole package sit here. A folder's
own fixtures are in its conftest.py; the helpers tests of several folders import
(``limits_helpers``, ``metrics_helpers``, ``vmm_helpers``, ...) are in ``tests/helpers/``, put on
``sys.path`` below; a test module imports no test module of another folder. The folders
are not packages: test file names stay unique across them (pytest's default import mode
refuses two test modules of one name)."""

from __future__ import annotations

import os
import sys

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

# Tests read device memory from the driver (total - free). With lazy module
# loading, the first launch of each torch kernel allocates device memory for
# its code inside a measurement; load everything when the context starts.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402

from vmm_helpers import cuda_available  # noqa: E402

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


@pytest.fixture
def prefix():
    """A unique prefix for this test's record names (and budget scope); its records are removed after."""
    from limits_helpers import remove_records, unique_prefix

    p = unique_prefix()
    yield p
    remove_records(p)
