"""Undoing a failed ``allocate_slots`` (pure bookkeeping: no vLLM import).

``get_num_free_blocks`` is a snapshot: another process can take the memory
between vLLM's count and the allocation, and then ``get_new_blocks`` raises
``PoolShortage`` half-way through ``allocate_slots``. The call's changes to
one single-type manager (blocks attached to the request, its cached-block
count, new block ids, a partial prefix hit) are recorded before the call
(``snapshot``) and put back (``rollback``), so the request looks as if the
call had returned None: the scheduler then preempts, as with a full pool.
"""

from __future__ import annotations

from typing import Any, Tuple

_MISSING = object()


def snapshot(m: Any, rid: str) -> Tuple[Any, ...]:
    blocks = m.req_to_blocks.get(rid)
    partial = getattr(m, "_partial_hit_reqs", {})
    return (
        None if blocks is None else len(blocks),
        m.num_cached_block.get(rid, _MISSING),
        len(getattr(m, "new_block_ids", ())),
        partial.get(rid, _MISSING),
    )


def rollback(m: Any, rid: str, snap: Tuple[Any, ...], pool: Any) -> None:
    """Puts one single-type manager back to its state before the failed call:
    blocks the call attached are released (touched hits back to evictable,
    new blocks back to the ledger) and its bookkeeping restored."""
    n_blocks, n_cached, n_new_ids, partial = snap
    blocks = m.req_to_blocks.get(rid)
    partials = getattr(m, "_partial_hit_reqs", None)
    if partial is not _MISSING and partials is not None and rid not in partials:
        idx, src = partial
        if blocks is not None and idx < len(blocks) and blocks[idx] is not src:
            # The copy-on-write of a partial prefix hit ran before the shortage;
            # it rewrote the block table in place, which cannot be undone here.
            raise RuntimeError(
                f"kvcached: a physical shortage hit request {rid} after a copy-on-write of its partial prefix "
                "hit; the allocation cannot be rolled back. Give the instance a higher limit (kvctl limit)"
            )
    if blocks is not None:
        keep = n_blocks or 0
        extra = blocks[keep:]
        del blocks[keep:]
        if extra:
            pool.free_blocks(reversed(extra))
        if n_blocks is None and not blocks:
            del m.req_to_blocks[rid]
    if n_cached is _MISSING:
        m.num_cached_block.pop(rid, None)
    else:
        m.num_cached_block[rid] = n_cached
    ids = getattr(m, "new_block_ids", None)
    if ids is not None:
        del ids[n_new_ids:]
    if partials is not None:
        if partial is _MISSING:
            partials.pop(rid, None)
        else:
            partials[rid] = partial
