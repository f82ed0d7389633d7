"""Config-time patches: settled in the process that builds the ``VllmConfig``
(the API server or the ``LLM`` process), before any engine process starts.

* vLLM 0.34's *extensible KV cache* (``CacheConfig.enable_extensible_kv_cache``)
  reserves the KV buffer's address range with driver virtual memory and commits
  pages itself; it is on by default on CUDA/ROCm. kvcached backs that same
  buffer, and two owners of one buffer's pages cannot both be right: when the
  option is unset it is turned off here, before vLLM settles it
  (``VllmConfig._resolve_extensible_kv_cache``); when the user asked for it,
  start-up stops with one line naming the option.

The error is a ``RuntimeError``, not kvcached's ``InvalidArgumentError`` (a
``ValueError``): pydantic would wrap a ``ValueError`` raised while the config
is validated into a multi-line ``ValidationError``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from kvcached.integration.patch_base import wrap_method


class UnsupportedConfiguration(RuntimeError):
    """A vLLM option kvcached cannot serve with, found while the config is built."""


def _resolve_without_extensible_kv_cache(vllm_config: Any) -> None:
    cache = vllm_config.cache_config
    if getattr(cache, "_extensible_kv_cache_resolved", False):
        return
    if cache.enable_extensible_kv_cache:
        raise UnsupportedConfiguration(
            "kvcached does not combine with vLLM's extensible KV cache (--enable-extensible-kv-cache / "
            "enable_extensible_kv_cache=True): both would own the KV buffer's memory; kvcached already maps "
            "KV pages on demand, so drop the option or unset ENABLE_KVCACHED"
        )
    cache.enable_extensible_kv_cache = False


def patch_extensible_kv_cache_off(module: ModuleType) -> None:
    """``vllm.config.vllm``: the extensible KV cache is off (unset) or refused (asked for)."""

    def make(orig: Callable) -> Callable:
        def _resolve_extensible_kv_cache(self: Any) -> None:
            _resolve_without_extensible_kv_cache(self)
            orig(self)

        return _resolve_extensible_kv_cache

    wrap_method(module.VllmConfig, "_resolve_extensible_kv_cache", make)
