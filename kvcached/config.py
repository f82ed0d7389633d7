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


def capacity_ttl_s() -> float:
    """How long KVCacheManager.available_size may reuse its reading of the data
    plane's free pages and the device's free memory when this manager did not
    change pages in between (KVCACHED_CAPACITY_TTL_MS, default 10 ms; 0: read
    every time). A limit change by another thread is seen within this time."""
    ms = _env_int("KVCACHED_CAPACITY_TTL_MS", 10)
    if ms < 0:
        raise ValueError(f"KVCACHED_CAPACITY_TTL_MS={ms} must be >= 0")
    return ms / 1000.0
