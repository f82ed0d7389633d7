"""The snapshot calls of the engine interfaces (upstream's ``interfaces.observability_snapshot``
and its three siblings), for either engine."""

from __future__ import annotations

from typing import Any, Dict, List

from kvcached import _C, config
from kvcached.compat import runtime
from kvcached.observability import (
    KVCachePoolSnapshot,
    RuntimeSnapshot,
    build_runtime_snapshot,
    get_registered_kv_cache_pool_snapshot_dicts,
    get_registered_kv_cache_pool_snapshots,
)


def runtime_snapshot(engine: str) -> RuntimeSnapshot:
    """What ``engine``'s ``init_kvcached`` set up in this process (defaults before it)."""
    st = runtime.state()
    on = st.engine == engine and st.device is not None
    return build_runtime_snapshot(
        engine=engine,
        initialized=on,
        device=st.device if on else None,
        world_size=st.world_size if on else 1,
        pp_rank=st.pp_rank if on else 0,
        async_sched=st.async_sched if on else False,
        contiguous_layout=bool(_C.config()["contiguous_layout"]) if _C.is_initialized() else config.contiguous_layout(),
        is_worker=st.is_worker if on else False,
    )


class EngineSnapshots:
    """Upstream's four snapshot calls of one engine's interface (each interface
    hands on the bound methods of its own instance under these names)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine

    def observability_snapshot(self) -> RuntimeSnapshot:
        """A read-only snapshot of this process's integration state for the engine."""
        return runtime_snapshot(self.engine)

    def observability_snapshot_dict(self) -> Dict[str, Any]:
        return self.observability_snapshot().to_dict()

    def kv_cache_pool_snapshots(self) -> List[KVCachePoolSnapshot]:
        """Read-only snapshots of the engine's live KV pools in this process."""
        return get_registered_kv_cache_pool_snapshots(integration=self.engine)

    def kv_cache_pool_snapshot_dicts(self) -> List[Dict[str, Any]]:
        return get_registered_kv_cache_pool_snapshot_dicts(integration=self.engine)
