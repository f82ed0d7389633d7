"""Priority borrows: engines' limits lowered so their running requests make room.

A borrow with ``priority=True`` that is still short once idle memory came back
(``reservation.PRIORITY_GRACE_S``) lowers engines' limits through the limit
path operators use (``kvcached.control.set_instance_memory_limit``, a
compare-and-set on the record's revision). An engine whose limit drops below
what it maps stops mapping, evicts cached blocks over it and preempts running
requests as they need blocks (vLLM, SGLang: a preemption, never a crash), so
its held bytes fall to the limit and the borrower takes them.

Whom: every live member of the budget but borrowers (engine ``job``) and this
process's own records, largest holder first, each cut to ``held - what is
still lacking`` (floored at 0), until the cuts cover the lack; an engine cut
before counts with what it still owes. Checked again at every want renewal.

Restoring: at release each engine gets back the limit it had before its first
cut, written only if its record still shows the limit this borrow wrote (same
revision): a limit changed since, by an operator or another priority borrow,
is theirs and left as it is (logged). Stacked priority borrows on one engine
therefore restore only in last-in, first-out order.

The borrower killed while limits are lowered: a guardian process
(``python -m kvcached.borrowing.guard``, its own session, so a signal to the
job's process group does not reach it) is told every cut before it is
written; when the borrower's end of the pipe closes without a "done", it
restores them by the same rule. Only if the guardian dies too (SIGKILL of
both, the OOM killer) do the limits stay lowered: ``kvctl list`` shows them
and ``kvctl limit`` restores them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from kvcached.units import format_size

logger = logging.getLogger("kvcached.borrow")

_REVISION_MASK = 0xFFFFFFFF


@dataclass
class Cut:
    """One engine's limit as this borrow changed it: ``original`` before the
    first cut; ``limit`` at ``revision`` the last write."""

    original: int
    limit: int
    revision: int


def restore_cut(name: str, cut: Cut, wait_s: float = 0.0) -> str:
    """Writes ``cut.original`` back to ``name`` if its record still shows
    ``cut.limit`` at ``cut.revision``; returns what happened, in words."""
    from kvcached import _C
    from kvcached.control import set_instance_memory_limit

    try:
        snap = _C.MemInfoTracker.open(name).snapshot()
    except _C.KvcachedError:
        return "gone"
    if not snap.owner_alive:
        return "dead"
    if snap.revision != cut.revision or snap.limit != cut.limit:
        return f"changed since (limit {format_size(snap.limit)}, revision {snap.revision}): left as it is"
    r = set_instance_memory_limit(cut.original, revision=cut.revision, name=name, wait_s=wait_s)
    return "restored" if r.written else f"{r.status}: {r.message}"


_live_cuts: weakref.WeakSet[LimitCuts] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child must not hold a guardian's pipe open: the guardian would
    # then not see the borrower die while the child lives.
    for cuts in list(_live_cuts):
        cuts._leave_guard()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LimitCuts:
    """The limits one borrow lowered, and the guardian that restores them if it dies."""

    def __init__(self, borrower: str) -> None:
        self.borrower = borrower
        self._cuts: Dict[str, Cut] = {}
        self._guard: Optional[subprocess.Popen] = None
        _live_cuts.add(self)

    def _leave_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None and guard.stdin is not None:
            try:
                guard.stdin.close()
            except OSError:
                pass

    @property
    def names(self) -> List[str]:
        return sorted(self._cuts)

    def cover(self, lacking: int, budget: Any) -> int:
        """Lowers limits until the cuts cover ``lacking`` bytes; returns the bytes newly cut."""
        me = os.getpid()
        engines = [r for r in budget.members(exclude=self.borrower) if r.engine != "job" and r.owner_pid != me]
        owed = sum(max(0, r.held - r.limit) for r in engines if r.name in self._cuts)
        need = lacking - owed
        cut_now = 0
        for r in sorted(engines, key=lambda r: r.held, reverse=True):
            if need <= 0:
                break
            current = min(r.limit, r.held)
            take = min(need, current)
            if take > 0 and self._lower(r, current - take):
                need -= take
                cut_now += take
        return cut_now

    def _lower(self, rec: Any, new_limit: int) -> bool:
        from kvcached.control import set_instance_memory_limit

        prev = self._cuts.get(rec.name)
        original = prev.original if prev is not None else rec.limit
        intent = Cut(original, new_limit, (rec.revision + 1) & _REVISION_MASK)
        self._tell_guard({**self._cuts, rec.name: intent})  # before the write: a death right after it is covered
        r = set_instance_memory_limit(new_limit, revision=rec.revision, name=rec.name, wait_s=0)
        if not r.written:  # another writer won, or the engine is gone: leave it to the next round
            self._tell_guard(self._cuts)
            return False
        self._cuts[rec.name] = Cut(original, new_limit, int(r.revision))
        logger.info(
            "kvcached: borrow %s (priority) lowered the limit of %s to %s (from %s; restored when it ends)",
            self.borrower,
            rec.name,
            format_size(new_limit),
            format_size(original),
        )
        return True

    def restore(self) -> None:
        """Restores every lowered limit still as this borrow left it; stops the guardian."""
        for name, cut in sorted(self._cuts.items()):
            what = restore_cut(name, cut)
            if what not in ("restored", "gone", "dead"):  # an engine that ended has no limit to restore
                logger.warning("kvcached: borrow %s: the limit of %s not restored: %s", self.borrower, name, what)
        self._cuts.clear()
        guard, self._guard = self._guard, None
        if guard is not None:
            try:
                guard.stdin.write('{"done": true}\n')
                guard.stdin.close()
                guard.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass  # it exits on its own once the pipe is closed

    def _tell_guard(self, cuts: Dict[str, Cut]) -> None:
        """Sends the guardian the whole table (starting it at the first cut)."""
        try:
            if self._guard is None:
                self._guard = subprocess.Popen(
                    [sys.executable, "-m", "kvcached.borrowing.guard", self.borrower],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,  # a signal to the job's process group does not reach it
                )
            table = {n: [c.original, c.limit, c.revision] for n, c in cuts.items()}
            self._guard.stdin.write(json.dumps({"cuts": table}) + "\n")
            self._guard.stdin.flush()
        except (OSError, ValueError) as e:
            logger.warning(
                "kvcached: borrow %s: no guardian for its lowered limits (%s); if it dies, restore them with "
                "kvctl limit",
                self.borrower,
                e,
            )
