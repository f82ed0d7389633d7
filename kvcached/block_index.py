"""BlockIndex: which free blocks sit on which held page, and which page to take them from.

This is the placement half of ``BlockManager`` (the other half, the per-block
ledger and the reserve of ``try_to_reserve``, is ``block_ledger.py``; pages
come from ``page_supply.py`` and go through ``page_release.py``). It knows nothing of memory: a
page is "held" when the manager acquired it from the page allocator, and the
index only files its free block ids.

Structures:

* ``held[pid]``: a ``Page`` per held page, the stack of its free block ids
  (``pop()`` yields the lowest id).
* ``buckets[k]``: the open held pages with exactly ``k >= 1`` free blocks; bit
  ``k`` of ``mask`` is set iff ``buckets[k]`` is non-empty, so "the smallest
  bucket that fits n" and "the largest bucket" are two integer operations.
* ``nfree``: free blocks on open held pages (what alloc can take without a page).
* ``unheld_caps[c]``: pages within the target that are not held, by block
  capacity (``available_size`` counts the emptiest ones the allocator could
  hand out); ``unheld_version`` changes whenever it does.
* ``tail``: the buffer's last page when it holds fewer blocks than a page can
  (else -1). The allocator hands out its reserve, then free pages lowest id
  first, so a free tail comes last: ``mappable_blocks`` leaves it out of the
  worst case until every unheld page would be taken.

A page is *open* while its id is below ``target_pages`` (the resize target);
a closed page hands out nothing and is released once it drains.

Invariants (``check()`` raises ``StateConsistencyError`` naming the broken one):

  I1 bucket      every page in ``buckets[k]`` is held, open and has k free blocks;
                 every open held page with k >= 1 free blocks is in ``buckets[k]``
                 and in no other bucket; closed pages are in no bucket.
  I2 mask        bit k of ``mask`` is set iff ``buckets[k]`` is non-empty.
  I3 nfree       ``nfree`` is the sum of the free blocks of the open held pages.
  I4 page        a page's free ids are distinct, lie in its block range and number
                 at most its capacity, which is the geometry's; ``open`` agrees
                 with the target.
  I5 unheld      ``unheld_caps`` counts exactly the unheld pages below the target.

The public attributes are read by ``BlockManager`` on its hot path; only the
manager (under its lock) and tests of this module may change them.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from kvcached._C import StateConsistencyError
from kvcached.block_geometry import BlockGeometry
from kvcached.errors import InvalidArgumentError


class Page(list):
    """Free block ids of one held page (a stack; ``pop()`` yields the lowest).

    ``cap`` is the number of usable blocks on the page, so ``cap - len(page)``
    blocks are live. ``open`` is False for pages past the resize target: they
    hand out nothing and are released once they drain.
    """

    __slots__ = ("pid", "cap", "open")


class BlockIndex:
    """Free blocks of the held pages of one pool, filed for placement (see the module doc)."""

    def __init__(self, geometry: BlockGeometry) -> None:
        self.geometry = geometry
        self.caps = geometry.caps
        self.block_mem_size = geometry.block_mem_size
        self.page_size = geometry.page_size
        self.held: Dict[int, Page] = {}
        self.buckets: List[Dict[int, Page]] = [dict() for _ in range(geometry.max_blocks_per_page + 1)]
        self.mask = 0
        self.nfree = 0
        self.target_pages = geometry.num_pages
        self.unheld_caps: Dict[int, int] = {}
        self.unheld_version = 0
        last = geometry.num_pages - 1
        self.tail = last if self.caps[last] < geometry.max_blocks_per_page else -1
        self._mappable_cache: Tuple[int, int, int, int] = (-1, -1, 0, 0)  # (pages, version, tail left out, blocks)
        self.recount_unheld()

    # ------------------------------------------------------------ hot path
    # BlockManager.alloc and free inline these two (a call costs as much as the
    # rest of an alloc(1)+free(1) pair): a change here goes there too.

    def take_one(self) -> int:
        """Takes one free block from the fullest open page that has one; -1 when none has."""
        m = self.mask
        if not m:
            return -1
        k = (m & -m).bit_length() - 1
        bucket = self.buckets[k]
        pid, page = bucket.popitem()
        if not bucket:
            m ^= 1 << k
        b = page.pop()
        if k > 1:
            self.buckets[k - 1][pid] = page
            m |= 1 << (k - 1)
        self.mask = m
        self.nfree -= 1
        return b

    def put_one(self, b: int) -> Optional[Page]:
        """Files free block ``b`` back on its (held) page; returns the page if that emptied it."""
        page = self.held[b * self.block_mem_size // self.page_size]
        k = len(page)
        page.append(b)
        if page.open:
            pid = page.pid
            if k:
                bucket = self.buckets[k]
                del bucket[pid]
                if not bucket:
                    self.mask ^= 1 << k
            k += 1
            self.nfree += 1
            self.buckets[k][pid] = page
            self.mask |= 1 << k
        else:
            k += 1
        return page if k == page.cap else None

    # ------------------------------------------------------------- batches

    def take(self, rest: int, out: List[int]) -> int:
        """Appends up to ``rest`` free blocks of open pages to ``out``; returns how many are still missing.

        The smallest page that holds the whole remainder, else the page with
        the most free blocks, repeatedly: one request's blocks share pages.
        """
        buckets = self.buckets
        while rest and self.mask:
            m = self.mask
            hi = m >> rest
            k = rest + (hi & -hi).bit_length() - 1 if hi else m.bit_length() - 1
            bucket = buckets[k]
            pid, page = bucket.popitem()
            if not bucket:
                self.mask = m ^ (1 << k)
            t = k if k < rest else rest
            chunk = page[k - t :]
            del page[k - t :]
            chunk.reverse()
            out.extend(chunk)
            rest -= t
            self.nfree -= t
            if k > t:
                buckets[k - t][pid] = page
                self.mask |= 1 << (k - t)
        return rest

    def take_run(self, n: int, fresh: List[int]) -> List[int]:
        """Takes a run of ``n`` blocks: as many as they hold on the ``fresh`` pages
        (just acquired; adopted and shelved here), the rest on held pages (``take``).

        Fresh pages are mapped anyway: one request's run lies on few pages, and
        the page count mapped is the same as filling held pages first. Raises
        StateConsistencyError when held pages have fewer free blocks than ``nfree``.
        """
        taken: List[int] = []
        on_fresh = min(n, sum(self.caps[pid] for pid in fresh))
        if self.take(n - on_fresh, taken):
            raise StateConsistencyError("KVCacheManager: held pages had fewer free blocks than counted")
        for pid in fresh:
            page = self.adopt(pid)
            t = min(on_fresh, page.cap)
            self.take_from(page, t, taken)
            on_fresh -= t
            self.shelve(page)
        return taken

    def take_from(self, page: Page, t: int, out: List[int]) -> None:
        """Appends the ``t`` lowest free blocks of a page not yet shelved (a fresh one) to ``out``."""
        k = len(page)
        chunk = page[k - t :]
        del page[k - t :]
        chunk.reverse()
        out.extend(chunk)

    def put(self, ids: List[int]) -> List[Page]:
        """Files free blocks back on their pages; returns the pages this emptied."""
        held, B, P = self.held, self.block_mem_size, self.page_size
        touched: Dict[int, int] = {}
        for b in ids:
            page = held[b * B // P]
            if page.pid not in touched:
                touched[page.pid] = len(page)
            page.append(b)
        buckets = self.buckets
        emptied = []
        for pid, k in touched.items():
            page = held[pid]
            k2 = len(page)
            if page.open:
                if k:
                    bucket = buckets[k]
                    del bucket[pid]
                    if not bucket:
                        self.mask ^= 1 << k
                self.nfree += k2 - k
                buckets[k2][pid] = page
                self.mask |= 1 << k2
            if k2 == page.cap:
                emptied.append(page)
        return emptied

    # --------------------------------------------------------------- pages

    def adopt(self, pid: int) -> Page:
        """Registers a freshly acquired page with all its blocks free (not yet shelved)."""
        first, end = self.geometry.block_range(pid)
        page = Page(range(end - 1, first - 1, -1))
        page.pid = pid
        page.cap = end - first
        page.open = pid < self.target_pages
        self.held[pid] = page
        if page.open:
            self.unheld_caps[page.cap] -= 1
            self.unheld_version += 1
        return page

    def shelve(self, page: Page) -> None:
        """Files an open page into the bucket of its free-block count."""
        k = len(page)
        if page.open and k:
            self.buckets[k][page.pid] = page
            self.mask |= 1 << k
            self.nfree += k

    def unshelve(self, page: Page) -> None:
        """Takes an open page out of its bucket (and its free blocks out of nfree)."""
        if not page.open:
            return
        k = len(page)
        bucket = self.buckets[k]
        if bucket.pop(page.pid, None) is not None:
            if not bucket:
                self.mask ^= 1 << k
            self.nfree -= k

    def drop(self, pages: List[Page]) -> List[int]:
        """Forgets released pages (unshelve them first); returns their ids."""
        pids = []
        for page in pages:
            del self.held[page.pid]
            if page.pid < self.target_pages:
                self.unheld_caps[page.cap] = self.unheld_caps.get(page.cap, 0) + 1
            pids.append(page.pid)
        self.unheld_version += 1
        return pids

    def clear(self) -> List[int]:
        """Forgets every held page (shutdown); returns their ids."""
        pids = list(self.held)
        self.held.clear()
        for b in self.buckets:
            b.clear()
        self.mask = 0
        self.nfree = 0
        self.recount_unheld()
        return pids

    def set_target(self, target: int) -> List[Page]:
        """Opens pages below ``target`` and closes those at or past it; returns the
        pages it closed that hold no live block (the caller releases or retires them)."""
        self.target_pages = target
        closed_empty = []
        for pid, page in self.held.items():
            if pid >= target and page.open:
                self.unshelve(page)
                page.open = False
                if len(page) == page.cap:
                    closed_empty.append(page)
            elif pid < target and not page.open:
                page.open = True
                self.shelve(page)
        self.recount_unheld()
        return closed_empty

    def recount_unheld(self) -> None:
        caps: Dict[int, int] = {}
        held = self.held
        for pid in range(self.target_pages):
            if pid not in held:
                c = self.caps[pid]
                caps[c] = caps.get(c, 0) + 1
        self.unheld_caps = caps
        self.unheld_version += 1

    # ------------------------------------------------------------- counts

    def live_blocks(self) -> int:
        return sum(p.cap - len(p) for p in self.held.values())

    def occupancy(self, page_ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """Live blocks (allocated, reserved or null) per page: every held page's,
        or those of ``page_ids`` (0 for a page not held)."""
        held = self.held
        if page_ids is None:
            return {pid: p.cap - len(p) for pid, p in held.items()}
        out = {}
        for pid in page_ids:
            pid = operator.index(pid)
            if not 0 <= pid < self.geometry.num_pages:
                raise InvalidArgumentError(f"page id {pid} is out of range [0, {self.geometry.num_pages})")
            p = held.get(pid)
            out[pid] = p.cap - len(p) if p is not None else 0
        return out

    def unheld_blocks(self) -> int:
        """Blocks on the unheld pages within the target."""
        return sum(cap * cnt for cap, cnt in self.unheld_caps.items())

    def mappable_blocks(self, pages: int, is_reserved: Optional[Callable[[int], bool]] = None) -> int:
        """Blocks on the ``pages`` unheld pages an allocation could map next, counting the
        ones with the fewest blocks (worst case), but for ``tail``: free (``is_reserved``
        says it is not in the reserve) it comes after every other unheld page, so it counts
        only when all of them would be taken. Without ``is_reserved`` it counts as any page."""
        tail = self.tail
        skip = 0  # the tail's capacity, when the tail is left out
        if (
            tail >= 0
            and is_reserved is not None
            and tail < self.target_pages
            and tail not in self.held
            and pages < sum(self.unheld_caps.values())
            and not is_reserved(tail)
        ):
            skip = self.caps[tail]
        cached_pages, version, cached_skip, blocks = self._mappable_cache
        if cached_pages == pages and version == self.unheld_version and cached_skip == skip:
            return blocks
        blocks, left = 0, pages
        for cap in sorted(self.unheld_caps):
            cnt = self.unheld_caps[cap] - (cap == skip)
            if cnt <= 0:
                continue
            take = cnt if cnt < left else left
            blocks += take * cap
            left -= take
            if not left:
                break
        self._mappable_cache = (pages, self.unheld_version, skip, blocks)
        return blocks

    # ---------------------------------------------------------- invariants

    def check(self) -> None:
        """Verifies I1-I5 of the module doc; raises StateConsistencyError naming the broken one."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StateConsistencyError(f"BlockIndex invariant broken: {what}")

        geo = self.geometry
        mask = 0
        for k, bucket in enumerate(self.buckets):
            if bucket:
                mask |= 1 << k
            for pid, page in bucket.items():
                need(k >= 1 and len(page) == k, f"I1 bucket: page {pid} filed under {k} but has {len(page)} free")
                need(page.open and self.held.get(pid) is page, f"I1 bucket: page {pid} in bucket {k} is not held open")
        need(mask == self.mask, f"I2 mask: mask {self.mask:#x}, buckets say {mask:#x}")
        nfree = 0
        for pid, page in self.held.items():
            first, end = geo.block_range(pid)
            need(page.pid == pid and page.cap == end - first, f"I4 page: page {pid} has id {page.pid} cap {page.cap}")
            need(len(set(page)) == len(page), f"I4 page: a block of page {pid} is free twice")
            need(len(page) <= page.cap, f"I4 page: page {pid} has {len(page)} free of {page.cap}")
            need(all(first <= b < end for b in page), f"I4 page: page {pid} lists a block of another page")
            need(
                page.open == (pid < self.target_pages),
                f"I4 page: page {pid} open={page.open}, target {self.target_pages}",
            )
            if page.open:
                if len(page):
                    need(
                        self.buckets[len(page)].get(pid) is page,
                        f"I1 bucket: page {pid} with {len(page)} free is not filed",
                    )
                nfree += len(page)
            else:
                need(all(pid not in b for b in self.buckets), f"I1 bucket: closed page {pid} is filed")
        need(nfree == self.nfree, f"I3 nfree: nfree {self.nfree}, open pages hold {nfree} free blocks")
        caps: Dict[int, int] = {}
        for pid in range(self.target_pages):
            if pid not in self.held:
                caps[self.caps[pid]] = caps.get(self.caps[pid], 0) + 1
        have = {c: n for c, n in self.unheld_caps.items() if n}
        need(have == caps, f"I5 unheld: unheld_caps {have}, unheld pages give {caps}")
