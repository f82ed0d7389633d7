"""The runtime snapshot of an engine interface (``interfaces.observability_snapshot``)."""

from __future__ import annotations

from kvcached import _C, config
from kvcached.integration import runtime
from kvcached.observability import RuntimeSnapshot, build_runtime_snapshot


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
