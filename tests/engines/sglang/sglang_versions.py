"""What differs between the SGLang releases the engine tests run on (0.5.15 ... 0.5.23), and the
unit tests' page size."""

from __future__ import annotations

from typing import Tuple

# SGLang before 0.5.22 places paged slots with Triton kernels only: its own paged
# allocator cannot run on a CPU (kvcached's can; it has a torch path).
NATIVE_PAGED_ON_CPU = (0, 5, 22)

# The kvcached page of the pool and allocator tests (conftest's unit_kvcached_env).
UNIT_PAGE = 4096


def sglang_version() -> Tuple[int, int, int]:
    """The installed SGLang as a version tuple, e.g. (0, 5, 15)."""
    import sglang

    from kvcached.integration.patch_base import parse_version

    return parse_version(sglang.__version__)
