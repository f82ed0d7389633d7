"""What the parts of a BlockManager hold, read for tests, tools and debugging.

``stats`` (counters: kvtop, the engines' reports), ``snapshot`` (a deep copy
of the ledger: equal snapshots mean equal states) and ``check`` (every
invariant across the parts: the block index's, the ledger's against it, then
the page allocator's and the data plane's against both). Each reads the
manager's ``BlockIndex``, ``BlockLedger``, ``PageRelease`` and
``PageAllocator`` and changes nothing; the manager holds its lock around the
call, so one answer is one instant. ``check_after_every_change`` is
``KVCACHED_SANITY_CHECK``'s wrapper.
"""

from __future__ import annotations

from typing import Any, Dict

from kvcached import _C
from kvcached.block_index import BlockIndex
from kvcached.block_ledger import NULL, BlockLedger
from kvcached.errors import StateConsistencyError
from kvcached.page_release import PageRelease

# The calls that change a manager's state (checked after each in sanity mode).
CHANGING_CALLS = ("alloc", "free", "try_to_reserve", "free_reserved", "resize", "trim", "clear", "release_null_page")


def stats(index: BlockIndex, ledger: BlockLedger, release: PageRelease, pa: Any) -> Dict[str, int]:
    """The manager's counters. ``held_pages`` includes ``parked_pages`` (held,
    empty, in their grace), whose blocks ``open_free_blocks`` counts as free."""
    return {
        "held_pages": len(index.held),
        "parked_pages": len(release.parked_pids()),
        "open_free_blocks": index.nfree,
        "live_blocks": index.live_blocks(),
        "reserved_blocks": len(ledger.reserved),
        "retired_pages": len(release.retired),
        "target_pages": index.target_pages,
        "mapped_pages": pa.get_num_mapped_pages(),
        "reserve_pages": pa.get_num_reserved_pages(),
        "inuse_pages": pa.get_num_inuse_pages(),
    }


def snapshot(index: BlockIndex, ledger: BlockLedger, release: PageRelease, pa: Any) -> Dict[str, Any]:
    """A deep copy of the ledger. Equal snapshots mean the same ids out
    ("allocated", "reserved" in hand-out order, "null"), the same free blocks on
    the same held pages ("free_by_page"), and the same retired and parked
    pages, target and pages in use."""
    return {
        **ledger.snapshot(),
        "free_by_page": {pid: sorted(p) for pid, p in index.held.items()},
        "retired": dict(release.retired),
        "parked": release.parked_pids(),
        "open_free_blocks": index.nfree,
        "target_pages": index.target_pages,
        "inuse_pages": pa.get_num_inuse_pages(),
    }


def check(manager: Any, index: BlockIndex, ledger: BlockLedger, release: PageRelease, pa: Any) -> None:
    """Raises StateConsistencyError naming the first broken invariant of ``manager``.

    I1-I5 of the block index (``BlockIndex.check``), L1-L4 of the ledger
    against it (``BlockLedger.check``), then: P1 the page allocator holds
    exactly the held pages in use and maps held + reserve pages; P2 every
    parked page is held; N1 block 0 is NULL on a held page 0 exactly while the
    manager names a null block (``release_null_page`` gives it back); P3 (the
    manager maps in this process: no ``mapper``) the data plane maps as many
    pages as the allocator, every held page among them.
    """

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise StateConsistencyError(f"KVCacheManager {manager.pool_name} invariant broken: {what}")

    index.check()
    ledger.check(index, release.may_keep_empty)
    inuse, mapped, reserve = pa.get_num_inuse_pages(), pa.get_num_mapped_pages(), pa.get_num_reserved_pages()
    need(inuse == len(index.held), f"P1 pages: the allocator has {inuse} in use, {len(index.held)} held")
    need(mapped == len(index.held) + reserve, f"P1 pages: {mapped} mapped != {len(index.held)} held + {reserve}")
    need(all(pid in index.held for pid in release.parked), "P2 parked: a parked page is not held")
    if manager.null_block is not None:
        need(ledger.states[0] == NULL and 0 in index.held, "N1 null: the null block is not held on a held page 0")
    else:
        need(ledger.states[0] != NULL, "N1 null: block 0 is NULL but the manager holds no null block")
    if manager.mapper is None:
        group = manager.group_id
        plane = _C.group_info(group)["mapped_pages"]
        need(plane == mapped, f"P3 mapped: the data plane maps {plane} pages, the allocator {mapped}")
        offsets = set(_C.mapped_offsets(group))
        need({pid * manager.page_size for pid in index.held} <= offsets, "P3 mapped: a held page is not mapped")


def check_after_every_change(manager: Any) -> None:
    """Wraps ``manager``'s state-changing calls (this instance's, the class stays
    untouched: no cost when sanity mode is off) with ``check_invariants()``."""

    def checked(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            manager.check_invariants()
            return out

        return call

    for name in CHANGING_CALLS:
        if hasattr(manager, name):  # resize is upstream's (kvcached.compat.upstream_manager)
            setattr(manager, name, checked(getattr(manager, name)))
