"""SGLang integration tests: run with the SGLang venv (scripts/test_engines_sglang.sh).

Under any other interpreter (the main suite's venv has no SGLang) this folder
is skipped, unless KVCACHED_REQUIRE_SGLANG=1, which the engine script sets so
that a broken SGLang install fails instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(os.path.dirname(HERE), "sglang_stubs")

_have_sglang = importlib.util.find_spec("sglang") is not None
if not _have_sglang and os.environ.get("KVCACHED_REQUIRE_SGLANG") != "1":
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config) -> None:
    if os.environ.get("KVCACHED_REQUIRE_SGLANG") == "1" and not _have_sglang:
        raise pytest.UsageError("KVCACHED_REQUIRE_SGLANG=1 but sglang is not importable in this interpreter")
    if not _have_sglang:
        return  # this folder is skipped; leave the session's sys.path alone (no stub `vllm` for others)
    # SGLang on device="cpu" imports vllm._custom_ops.rotary_embedding (never calls it);
    # the test-only stub provides it, here and in every process the tests start.
    pp = os.environ.get("PYTHONPATH", "")
    if STUBS not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = STUBS + (os.pathsep + pp if pp else "")
    import sys

    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def kvcached_patches():
    """kvcached's SGLang patches applied in this process (what an engine process gets):
    on 0.5.15 the elastic MHA pool carves its buffers through one of them."""
    os.environ["ENABLE_KVCACHED"] = "1"
    try:
        from kvcached.integration.sglang import plugin

        plugin.activate()
        return plugin.patch_manager()
    finally:
        del os.environ["ENABLE_KVCACHED"]


@pytest.fixture
def unit_kvcached_env(monkeypatch, kvcached_patches):
    """Pools and allocators built in this process: small pages, no reserve, closed after."""
    from sglang_versions import UNIT_PAGE

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(UNIT_PAGE))
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_sglang_unit_{os.getpid()}")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    yield
    from kvcached.integration.sglang.pool import shutdown_all

    shutdown_all()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, 2 KV heads, head_dim 32), built at test time."""
    from kvcached.testing.tiny_model import build_tiny_llama

    path = str(tmp_path_factory.mktemp("model") / "tiny-llama")
    build_tiny_llama(path, seed=0, vocab_size=512, hidden_size=64)
    return path
