"""BlockLedger: the state of every block id of one BlockManager.

``states[b]`` is one of ``FREE`` (not handed out: free on a held page, on an
unheld page, or a hole of the geometry), ``OUT`` (handed out by alloc; free()
accepts it), ``NULL`` (the reserved null block; never freed) or ``RESERVED``
(set aside by try_to_reserve; handed out first by the next alloc, in the order
of ``reserved``). Where a FREE block sits is the BlockIndex's business; the
ledger only answers "may this id be freed?" and checks the two agree.

Invariants (``check()`` raises ``StateConsistencyError`` naming the broken one):

  L1 free      every free block filed on a held page is FREE here, and every
               block of a held page is filed free or not FREE (none lost).
  L2 out       no block is OUT, NULL or RESERVED on a page that is not held.
  L3 reserved  ``reserved`` lists exactly the RESERVED blocks, each once.
  L4 empty     a held page with no live block is one the caller may keep empty
               (retired until a release marker, or parked in its grace).
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, Iterable, List

from kvcached.block_index import BlockIndex, Page
from kvcached.errors import InvalidArgumentError, StateConsistencyError

FREE = 0
OUT = 1
NULL = 2
RESERVED = 3


class BlockLedger:
    """Per-block states and the ids set aside by try_to_reserve (see the module doc)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.states = bytearray(num_blocks)
        self.reserved: List[int] = []

    def mark(self, ids: Iterable[int], state: int) -> None:
        states = self.states
        for b in ids:
            states[b] = state

    def validate_free(self, block_ids: Iterable[int]) -> List[int]:
        """Marks ids FREE if every one is OUT (and appears once); else changes
        nothing and raises InvalidArgumentError saying which and why."""
        if isinstance(block_ids, (str, bytes)):
            raise InvalidArgumentError(f"block ids must be integers, got {block_ids!r}")
        try:
            items = block_ids if isinstance(block_ids, (list, tuple)) else list(block_ids)
        except TypeError:
            raise InvalidArgumentError(f"block ids must be a list of integers, got {block_ids!r}") from None
        try:
            # operator.index(True) is 1: a stray flag must not free block 1.
            if any(b.__class__ is bool for b in items):
                raise TypeError
            ids = [operator.index(b) for b in items]
        except TypeError:
            raise InvalidArgumentError(f"block ids must be integers, got {block_ids!r}") from None
        states = self.states
        n = self.num_blocks
        done = 0
        try:
            for b in ids:
                if not 0 <= b < n:
                    raise InvalidArgumentError(f"block id {b} is out of range [0, {n})")
                s = states[b]
                if s != OUT:
                    if s == NULL:
                        raise InvalidArgumentError(f"block {b} is the null block; it is never freed")
                    if s == RESERVED:
                        raise InvalidArgumentError(
                            f"block {b} is reserved by try_to_reserve; release it with free_reserved()"
                        )
                    raise InvalidArgumentError(f"block {b} is not allocated (freed twice, or never allocated)")
                states[b] = FREE
                done += 1
        except InvalidArgumentError:
            for b in ids[:done]:
                states[b] = OUT
            raise
        return ids

    def take_reserved(self, n: int) -> List[int]:
        """Hands out the first ``n`` reserved ids (marked OUT)."""
        out = self.reserved[:n]
        del self.reserved[:n]
        self.mark(out, OUT)
        return out

    def release_reserved(self) -> List[int]:
        """Marks every reserved id FREE and returns them."""
        ids, self.reserved = self.reserved, []
        self.mark(ids, FREE)
        return ids

    def hold_null(self, index: BlockIndex) -> None:
        """Block 0 becomes the null block, on page 0 just acquired (adopted into ``index`` here)."""
        page = index.adopt(0)
        page.pop()  # block 0: pop() yields the lowest id
        self.states[0] = NULL
        index.shelve(page)

    def drop_null(self, index: BlockIndex) -> List[Page]:
        """Block 0 is a free id of page 0 again (``BlockManager.release_null_page``); returns
        the pages that emptied, page 0 among them (the caller releases it)."""
        self.states[0] = FREE
        return index.put([0])

    def free_all_on(self, index: BlockIndex) -> List[int]:
        """Marks every OUT or RESERVED block of the held pages FREE (not the null block); returns them."""
        states = self.states
        ids = []
        for pid in index.held:
            first, end = index.geometry.block_range(pid)
            for b in range(first, end):
                if states[b] == OUT or states[b] == RESERVED:
                    states[b] = FREE
                    ids.append(b)
        self.reserved = []
        return ids

    def reset(self) -> None:
        """Forgets every id (shutdown): stale ids then fail validation. In place:
        the manager's fast path holds ``states``."""
        self.states[:] = bytes(self.num_blocks)
        self.reserved = []

    def snapshot(self) -> Dict[str, List[int]]:
        states = self.states
        return {
            "allocated": [b for b, s in enumerate(states) if s == OUT],
            "reserved": list(self.reserved),  # in the order alloc hands them out
            "null": [b for b, s in enumerate(states) if s == NULL],
        }

    def check(self, index: BlockIndex, may_keep_empty: Callable[[int], bool]) -> None:
        """Verifies L1-L4 against ``index``; raises StateConsistencyError naming the broken one."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StateConsistencyError(f"BlockLedger invariant broken: {what}")

        states = self.states
        on_held = set()
        for pid, page in index.held.items():
            first, end = index.geometry.block_range(pid)
            bad = [b for b in page if states[b] != FREE]
            need(
                not bad,
                f"L1 free: block {bad[:1]} is filed free on page {pid} but marked {states[bad[0]] if bad else ''}",
            )
            live = sum(1 for b in range(first, end) if states[b] != FREE)
            need(live + len(page) == page.cap, f"L1 free: page {pid} lost a block ({live} live + {len(page)} free)")
            on_held.update(range(first, end))
            if not live:
                need(may_keep_empty(pid), f"L4 empty: page {pid} holds no block but is kept")
        stray = [b for b, s in enumerate(states) if s != FREE and b not in on_held]
        need(not stray, f"L2 out: block {stray[:1]} is handed out but its page is not held")
        marked = sorted(b for b, s in enumerate(states) if s == RESERVED)
        need(
            sorted(self.reserved) == marked and len(set(self.reserved)) == len(self.reserved),
            "L3 reserved: the reserve list and the blocks marked reserved differ",
        )
