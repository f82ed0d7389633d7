"""Upstream's import path of the SGLang API: every public name of ``kvcached.compat.sglang_interfaces``
(upstream's positions and defaults over our implementation, docs/COMPAT.md)."""

from kvcached.compat.sglang_interfaces import *  # noqa: F403 (the module's names, as before it moved)
