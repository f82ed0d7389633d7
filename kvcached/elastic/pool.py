"""ElasticPool: one KV group's ledger and the limits it answers to.

The ``KVCacheManager`` hands out blocks over kvcached pages; the instance
limits (``kvcached.limits.InstanceLimits``, the pool's record in /dev/shm)
say how much it may map: the operator's ``kvctl limit`` and the device budget
shared with the other instances. This class answers the questions both
engines' adapters ask of that pair.
"""

from __future__ import annotations

from typing import Any, List, Optional


class ElasticPool:
    """A manager and its (optional) instance limits."""

    def __init__(self, manager: Any, limits: Any = None, name: str = "") -> None:
        self.manager = manager
        self.limits = limits if limits is not None else getattr(manager, "limits", None)
        self.name = name or (self.limits.name if self.limits is not None else getattr(manager, "pool_name", ""))
        self.bytes_per_page = int(manager.bytes_per_page)
        self.released_pages = 0  # emptied pages released through this pool (deferred release)
        self._cap_before_sleep: Optional[int] = None  # a pool without limits: its cap before sleep()

    # ---- deferred release (the fence drives these) --------------------------

    def capture_physical_release_marker(self) -> int:
        return int(self.manager.capture_physical_release_marker())

    def release_retired_pages_through(self, marker: int) -> int:
        n = int(self.manager.release_retired_pages_through(marker) or 0)
        self.released_pages += n
        return n

    # ---- what the pool maps -------------------------------------------------

    def mapped_pages(self) -> int:
        return int(self.manager.page_allocator.get_num_mapped_pages())

    def live_pages(self) -> int:
        """Pages that still hold a block (emptied, retired or parked pages excluded)."""
        return sum(1 for n in self.manager.get_page_occupancy().values() if n > 0)

    def limit_bytes(self) -> Optional[int]:
        """The operator's limit, or None when the pool has no record or no limit."""
        if self.limits is None:
            return None
        limit = int(self.limits.limit)
        return None if limit < 0 else limit

    def _pages_beyond_limit(self, pages: int) -> int:
        """Of ``pages`` pages, how many lie beyond the limit (0 within it or with none)."""
        limit = self.limit_bytes()
        if limit is None:
            return 0
        over = pages * self.bytes_per_page - limit
        return -(-over // self.bytes_per_page) if over > 0 else 0

    def pages_over_limit(self) -> int:
        """Pages mapped beyond the limit (a lowered ``kvctl limit``); 0 when within it."""
        return self._pages_beyond_limit(self.mapped_pages())

    def live_pages_over_limit(self) -> int:
        """Pages with live blocks beyond the limit: only evicting cached blocks can return these."""
        return self._pages_beyond_limit(self.live_pages())

    # ---- peers sharing the device budget -------------------------------------

    def peers_wanting(self) -> List[str]:
        """Other live instances of the device budget whose load misses memory now."""
        budget = None if self.limits is None else self.limits.budget
        return [] if budget is None else [r.name for r in budget.wanting(exclude=self.limits.name)]

    def tokens_per_page(self) -> int:
        """Tokens (of every layer) one page of this pool holds (1 when unknown)."""
        cell = int(getattr(self.manager, "cell_size", 0) or 0)
        return max(1, int(self.manager.page_size) // cell) if cell > 0 else 1

    def pages_wanted_by_peers(self) -> int:
        """This pool's pages that would cover what the other live instances of the device
        budget lack now (their wants, in bytes: page sizes differ between models)."""
        budget = None if self.limits is None else self.limits.budget
        if budget is None:
            return 0
        wanted = sum(r.wanted for r in budget.wanting(exclude=self.limits.name))
        return -(-wanted // self.bytes_per_page)

    def note_shortage(self, need_tokens: int = 0) -> None:
        """A request needing ``need_tokens`` more tokens (0: one page) was not placed.
        The need must be the request's, not one page: an engine stops admitting a
        request that needs several pages while one more page would still fit, and
        a want of one page would then never be published."""
        if self.limits is None:
            return
        pages = -(-max(0, int(need_tokens)) // self.tokens_per_page())
        # +1: the engine places blocks, not tokens; its first block may need a fresh page
        # while the tokens alone would fit the room left (a want of 0 would never be published).
        self.limits.note_shortage((pages + 1) * self.bytes_per_page if pages else 0)

    def clear_want(self) -> None:
        if self.limits is not None:
            self.limits.clear_want()

    # ---- giving memory back -------------------------------------------------

    def give_back(self, null_page: bool = False) -> None:
        """Returns what holds no block: the mapped reserve, parked pages and unused budget;
        with ``null_page`` (no step in flight), the null block's page too when nothing
        else is left (``release_null_page``). (Emptied pages a step may still read are
        the fence's, not this.)"""
        if null_page:
            self.manager.release_null_page()
        self.manager.trim()
        if self.limits is not None:
            self.limits.release_slack(0)

    # ---- the engine's own sleep ----------------------------------------------

    def sleep(self) -> None:
        """Cap 0 until ``wake`` (the record keeps the operator's limit, see
        ``InstanceLimits.set_asleep``), then the reserve and parked pages go."""
        if self.limits is not None:
            self.limits.set_asleep(True)
        elif self._cap_before_sleep is None:
            self._cap_before_sleep = int(self.manager.page_allocator.mem_limit())
            self.manager.set_mem_limit(0)
        self.manager.trim()

    def wake(self) -> None:
        """The cap the pool had before ``sleep`` (the limit as it is now)."""
        if self.limits is not None:
            self.limits.set_asleep(False)
        elif self._cap_before_sleep is not None:
            cap, self._cap_before_sleep = self._cap_before_sleep, None
            self.manager.set_mem_limit(cap)
        self.manager.capacity_changed()  # the engine may allocate at once: no count from before the wake
