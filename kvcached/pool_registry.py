"""The live KV pools of this process (upstream's ``kvcached.pool_registry``).

Every ``KVCacheManager`` (``kvcached.compat.upstream_manager``) registers
itself when built and leaves at ``shutdown()``; the registry holds weak
references only, so it never keeps a pool alive. ``integration`` tags the
engine that built it (``vllm``, ``sglang``; None for a pool built directly). Readers:
``kvcached.observability`` (snapshots) and ``kvcached.control`` (a process's
limit split across its pools).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

_pools: Dict[int, Tuple[weakref.ref[Any], Optional[str]]] = {}
_lock = threading.RLock()


def register_kv_cache_pool(manager: Any, *, integration: Optional[str] = None) -> None:
    """Registers a live pool (again: updates its tag) without extending its lifetime."""
    key = id(manager)

    def _gone(ref: Any) -> None:
        with _lock:
            cur = _pools.get(key)
            if cur is not None and cur[0] is ref:
                del _pools[key]

    ref = weakref.ref(manager, _gone)
    with _lock:
        _pools[key] = (ref, integration)


def unregister_kv_cache_pool(manager: Any) -> None:
    """Forgets one pool (its shutdown); unknown pools are ignored."""
    with _lock:
        cur = _pools.get(id(manager))
        if cur is not None and cur[0]() is manager:
            del _pools[id(manager)]


def clear_registered_kv_cache_pools(*, integration: Optional[str] = None) -> None:
    """Forgets every registered pool, or those of one integration."""
    with _lock:
        if integration is None:
            _pools.clear()
            return
        for key in [k for k, (_, tag) in _pools.items() if tag == integration]:
            del _pools[key]


def get_registered_kv_cache_pools(*, integration: Optional[str] = None) -> List[Tuple[Any, Optional[str]]]:
    """``(manager, integration)`` of every live registered pool (of one integration, if given)."""
    with _lock:
        entries = list(_pools.values())
    out = []
    for ref, tag in entries:
        if integration is not None and tag != integration:
            continue
        manager = ref()
        if manager is not None:
            out.append((manager, tag))
    return out


__all__ = [
    "clear_registered_kv_cache_pools",
    "get_registered_kv_cache_pools",
    "register_kv_cache_pool",
    "unregister_kv_cache_pool",
]
