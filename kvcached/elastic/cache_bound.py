"""The prefix-cache bound (``KVCACHED_MAX_CACHED_TOKENS``), one rule for every engine.

Prefix caching holds blocks after their requests finish, and a page with one
cached block left cannot be released. Above the bound, unlocked cached
entries are evicted down to 90% of it, so that the next frees do not walk the
cache again at once. The engines evict by their own policy (whole pages first
in vLLM, SGLang's radix LRU); this module only says how much.
"""

from __future__ import annotations

from typing import Optional

from kvcached import config


def max_cached_tokens() -> Optional[int]:
    """The bound in tokens, or None (unbounded: unset, empty or -1)."""
    return config.max_cached_tokens()


def cache_excess_tokens(cached_tokens: int, evictable_tokens: int, bound: Optional[int]) -> int:
    """Tokens to evict now: 0 within the bound, else down to 90% of it (at most the evictable ones)."""
    if bound is None or cached_tokens <= bound:
        return 0
    return max(0, min(cached_tokens - bound * 9 // 10, evictable_tokens))
