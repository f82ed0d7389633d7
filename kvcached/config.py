"""Environment configuration, read once per call site (never at import time).

Names follow the upstream kvcached project so existing deployments keep working.
"""

from __future__ import annotations

import os

MiB = 1 << 20
DEFAULT_PAGE_SIZE = 2 * MiB


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={v!r} is not a boolean; use true/false or 1/0")


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v, 0)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def enabled() -> bool:
    return _env_bool("ENABLE_KVCACHED", False)


def page_size() -> int:
    return _env_int("KVCACHED_PAGE_SIZE", DEFAULT_PAGE_SIZE)


def contiguous_layout() -> bool:
    return _env_bool("KVCACHED_CONTIGUOUS_LAYOUT", False)


def min_reserved_pages() -> int:
    return _env_int("KVCACHED_MIN_RESERVED_PAGES", 5)


def max_reserved_pages() -> int:
    return _env_int("KVCACHED_MAX_RESERVED_PAGES", 10)


def page_prealloc_enabled() -> bool:
    return _env_bool("KVCACHED_PAGE_PREALLOC_ENABLED", True)
