"""Upstream's import path of the vLLM API: every public name of ``kvcached.compat.vllm_interfaces``
(upstream's positions and defaults over our implementation, docs/COMPAT.md)."""

from kvcached.compat.vllm_interfaces import *  # noqa: F403 (the module's names, as before it moved)
