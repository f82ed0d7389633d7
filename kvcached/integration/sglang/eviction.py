"""Evicting SGLang's prefix cache until a kvcached condition holds, on every supported SGLang.

SGLang's own "evict until the allocation fits" (``evict_for_alloc`` with an
``allocation_reclaim_satisfied`` predicate) exists only from 0.5.23, and
``supports_prefix_sharing()`` only from 0.5.22. ``tree_cache.evict(EvictParams(num_tokens=n))``
(LRU over unlocked leaves) is in every 0.5.15+ release, so the loops here are built on it
alone: evict a step, check, repeat, stop when nothing more can go.
"""

from __future__ import annotations

from typing import Any, Callable


def prefix_sharing(tree_cache: Any) -> bool:
    """A radix (prefix-sharing) cache whose unlocked entries can be evicted.

    0.5.22 added ``supports_prefix_sharing()``; before it the only cache
    without sharing was the chunk cache (``is_chunk_cache()``).
    """
    if tree_cache is None:
        return False
    sharing = getattr(tree_cache, "supports_prefix_sharing", None)
    return bool(sharing()) if sharing is not None else not tree_cache.is_chunk_cache()


def evictable_tokens(tree_cache: Any) -> int:
    """Unlocked attention-KV tokens. A Mamba hybrid's radix cache counts its KV and state
    pools apart (``MambaRadixCache.evictable_size`` raises): its KV count is ``full_``."""
    mamba = tree_cache.supports_mamba()
    return int(tree_cache.full_evictable_size() if mamba else tree_cache.evictable_size())


def protected_tokens(tree_cache: Any) -> int:
    """Locked attention-KV tokens (see ``evictable_tokens``)."""
    mamba = tree_cache.supports_mamba()
    return int(tree_cache.full_protected_size() if mamba else tree_cache.protected_size())


def evict_tokens(tree_cache: Any, num_tokens: int) -> int:
    """Evicts up to ``num_tokens`` unlocked tokens (SGLang's LRU policy); returns how many went."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if num_tokens <= 0:
        return 0
    res = tree_cache.evict(EvictParams(num_tokens=int(num_tokens)))
    return int(getattr(res, "num_tokens_evicted", 0) or 0)


def evict_until(tree_cache: Any, satisfied: Callable[[], bool], step: Callable[[], int]) -> int:
    """Evicts ``step()`` tokens at a time until ``satisfied()`` or nothing is evictable; returns tokens evicted."""
    if not prefix_sharing(tree_cache):
        return 0
    evicted = 0
    while not satisfied():
        n = min(evictable_tokens(tree_cache), max(1, int(step())))
        if n <= 0:
            break
        got = evict_tokens(tree_cache, n)
        if got <= 0:
            break
        evicted += got
    return evicted
