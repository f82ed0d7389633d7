"""The one writer of an instance's limit: write it to the record, wait for the
owner to apply it, say what happened.

Every limit change from outside the owner's watcher comes through
``write_limit``: ``kvctl limit`` and ``kvcached.control`` (a record by name)
and upstream's ``KVCacheManager.set_memory_limit`` (its own pool's record).
The record is the limit's one home; its owner (``InstanceLimits``) is the one
reader that turns it into the allocator's cap, and acknowledges each revision
it applied (``applied_revision``), which is what the writer waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from kvcached.limits.records import RecordView
from kvcached.units import format_size

# How often the writer looks for the owner's acknowledgement while it waits
# (the owner's watcher is woken by the write and answers within milliseconds).
_POLL_S = 0.002


@dataclass(frozen=True)
class LimitWrite:
    """What one ``write_limit`` did.

    ``revision``: the record's revision after the write; -1 when the
    compare-and-set lost (nothing written). ``acked``: the owner applied it (or
    a later revision) within the wait. ``snapshot``: the record as last read,
    after the wait (or after the lost compare-and-set).
    """

    revision: int
    acked: bool
    snapshot: Any

    @property
    def written(self) -> bool:
        return self.revision >= 0


def revision_acked(applied: int, written: int) -> bool:
    """True when the owner applied revision ``written`` or a later one (32-bit counters, modulo wrap)."""
    return ((int(applied) - int(written)) & 0xFFFFFFFF) < 0x80000000


def write_limit(
    tracker: Any, limit_bytes: int, *, expected_revision: Optional[int] = None, wait_s: float
) -> LimitWrite:
    """Writes ``limit_bytes`` to the record ``tracker`` maps and waits up to
    ``wait_s`` for its owner to apply it.

    ``expected_revision``: write only if the record is still at this revision
    (compare-and-set); None writes unconditionally. The caller validates the
    limit (``validate_limit``); the extension refuses what no record can hold
    (InvalidArgumentError, nothing written).
    """
    expected = -1 if expected_revision is None else int(expected_revision)
    new_rev = int(tracker.set_limit(int(limit_bytes), expected))
    if new_rev < 0:
        return LimitWrite(-1, False, tracker.snapshot())
    deadline = time.monotonic() + max(0.0, float(wait_s))
    while True:
        snap = tracker.snapshot()
        acked = revision_acked(snap.applied_revision, new_rev)
        if acked or time.monotonic() >= deadline:
            return LimitWrite(new_rev, acked, snap)
        time.sleep(_POLL_S)


def validate_limit(limit_bytes: object, rec: RecordView, *, allow_zero: bool = False) -> Optional[str]:
    """Why ``limit_bytes`` cannot be the limit of ``rec`` (None if it can).

    0 (nothing new is mapped) is allowed with ``allow_zero`` (the Python API,
    as upstream's); the command line refuses it as a likely typo."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int):
        return f"limit must be an integer number of bytes, got {limit_bytes!r}"
    if limit_bytes < 0 or (limit_bytes == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        return f"limit must be {bound} bytes, got {limit_bytes}; to stop an instance, stop its engine"
    if rec.device_bytes > 0 and limit_bytes > rec.device_bytes:
        return (
            f"limit {format_size(limit_bytes)} exceeds the usable memory of {rec.device} "
            f"({format_size(rec.device_bytes)}); use at most {format_size(rec.device_bytes)}"
        )
    if not rec.alive:
        return f"instance {rec.name!r} is dead (pid {rec.owner_pid}); remove it with `kvctl delete {rec.name}`"
    if rec.engine == "job":  # kvcached.borrowing: nobody applies a limit there
        return f"{rec.name!r} is a borrower (engine job), not an engine: its memory is its job's; end the borrow"
    return None
