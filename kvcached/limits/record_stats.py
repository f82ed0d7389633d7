"""What InstanceLimits adds to its record's statistics (record version 2,
csrc/include/kvcached/mem_info_tracker.hpp): requests the engine could not
place, by cause, and give-backs. The page allocator counts maps and unmaps
itself, in C++.

Refusals arrive once per request not placed, possibly many per scheduling
step: they are kept here and added to the shared record in one atomic add per
batch (when the cause is judged again, when a step places everything, at
close), never one shared-memory write per request. On a version-1 record
every add is a no-op.
"""

from __future__ import annotations

from typing import Any

REFUSED_LIMIT = "refused_limit"
REFUSED_BUDGET = "refused_budget"


class RecordStats:
    """Batches the refusal counts of one record and adds its give-backs."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self._cause = ""  # "": the last check found memory there: not counted
        self._pending = 0

    def refused(self) -> None:
        """One request not placed, under the cause of the last ``judged``."""
        self._pending += 1

    def judged(self, cause: str) -> None:
        """A new check found ``cause`` (REFUSED_LIMIT, REFUSED_BUDGET or ""):
        what was counted under the previous one goes to the record first."""
        self.flush()
        self._cause = cause

    def flush(self) -> None:
        n, self._pending = self._pending, 0
        if n > 0 and self._cause:
            self._tracker.add_counter(self._cause, n)

    def gave_back(self, nbytes: int) -> None:
        """A give-back that unmapped ``nbytes`` (counted only when > 0)."""
        if nbytes > 0:
            self._tracker.add_counter("give_backs", 1)
            self._tracker.add_counter("given_back_bytes", int(nbytes))
