"""Where engine blocks lie on kvcached pages, and which geometries are usable.

One engine block of ``block_mem_size`` bytes (per layer, per K/V buffer) sits at
byte ``block_id * block_mem_size`` of the buffer; kvcached page ``p`` covers
bytes ``[p * page_size, (p + 1) * page_size)``. A block may only be handed out
if it lies wholly inside one page: a page is mapped and unmapped as a unit, so
a block that straddles two pages could lose half of its memory while live.

When ``block_mem_size`` divides ``page_size`` every block fits. Otherwise
(e.g. MLA's 576-element latent rows) the blocks that straddle a boundary are
holes that are never handed out, and each page holds a slightly different
number of blocks. A geometry where a block is larger than a page, or where
some page would hold no whole block, is refused with a message that names
a block size and a page size that work. A geometry that works but leaves
more than a tenth of every page to skipped blocks (``page_utilization``) is
served; the manager warns once, naming a page size that fills 90%.
"""

from __future__ import annotations

import math
from typing import List, Tuple

from kvcached.errors import InvalidArgumentError, int_arg


def _every_page_holds_a_block(page_size: int, block_mem_size: int) -> bool:
    # The first block start inside a page sits at most (block - gcd) bytes past
    # the page start, and that worst offset occurs on some page; a whole block
    # fits after it iff page >= 2*block - gcd.
    if page_size % block_mem_size == 0:
        return True
    return page_size >= 2 * block_mem_size - math.gcd(page_size, block_mem_size)


def page_utilization(page_size: int, block_mem_size: int) -> float:
    """The share of a long buffer's page bytes that usable blocks fill.

    The block/page pattern repeats every ``n = block / gcd(page, block)`` pages;
    each page boundary in it but the first falls inside a block, which is
    never handed out: ``n - 1`` blocks lost per ``n`` pages."""
    n = block_mem_size // math.gcd(page_size, block_mem_size)
    return 1.0 - (block_mem_size / page_size) * (1.0 - 1.0 / n)


# A page size whose straddling blocks waste more than this is worth changing.
GOOD_UTILIZATION = 0.9


def better_page_size(block_mem_size: int, page_size: int) -> Tuple[int, float]:
    """The smallest multiple of ``page_size`` that holds this block on every page and
    fills at least ``GOOD_UTILIZATION`` of it (else the best one up to 64x), with its
    utilization."""
    k = 1
    while not (_every_page_holds_a_block(k * page_size, block_mem_size) and k * page_size >= block_mem_size):
        k += 1
    best = (k * page_size, page_utilization(k * page_size, block_mem_size))
    for m in range(k, max(64, 4 * k) + 1):
        u = page_utilization(m * page_size, block_mem_size)
        if u >= GOOD_UTILIZATION:
            return m * page_size, u
        if u > best[1]:
            best = (m * page_size, u)
    return best


def page_size_for_block(block_bytes: int) -> int:
    """The page size for an engine whose largest block (or state slot) is ``block_bytes``:
    ``KVCACHED_PAGE_SIZE`` when the user set it (a larger block is then refused, naming the
    size to use); else the default page, or where the block is larger (a real hybrid
    model's state), the smallest multiple of it that holds a block on every page and is at
    least ``GOOD_UTILIZATION`` used. A pure function of the block: every process of an
    engine computes the same page."""
    from kvcached import config  # reads the environment only

    page = config.page_size()
    if config.page_size_set() or block_bytes <= page:
        return page
    return better_page_size(int(block_bytes), page)[0]


def suggest_geometry(block_size: int, cell_size: int, page_size: int) -> str:
    """A sentence naming a block size and a page size that work with these cells."""
    block = block_size * cell_size
    tips = []
    best = None
    for t in range(min(block_size, page_size // cell_size), 0, -1):
        if page_size % (t * cell_size) == 0:
            best = (t, "every block fits")
            break
        if best is None and _every_page_holds_a_block(page_size, t * cell_size):
            best = (t, "blocks straddling a page boundary are skipped")
    if best is not None:
        tips.append(f"block_size={best[0]} tokens ({best[0] * cell_size} bytes; {best[1]})")
    size, used = better_page_size(block, page_size)
    tips.append(f"KVCACHED_PAGE_SIZE={size} ({size // page_size} x {page_size}; blocks fill {used:.0%} of a page)")
    return "use " + " or ".join(tips)


class BlockGeometry:
    """Block <-> page arithmetic for one KV cache (all methods O(1) after init).

    Attributes:
        num_blocks: engine block ids are ``0 .. num_blocks - 1``.
        block_mem_size: bytes of one block in one K/V buffer of one layer.
        page_size: bytes of one kvcached page (per layer, per K/V buffer).
        num_pages: pages that hold at least one usable block; the manager's
            page allocator covers exactly these.
        caps: usable blocks per page (``caps[p]``).
        max_blocks_per_page: ``max(caps)``.
        num_usable_blocks: ``sum(caps)`` (< num_blocks when there are holes).
        exact: True when every block id below num_blocks is usable.
        utilization: the share of page bytes usable blocks fill (1.0 when the
            block divides the page; see ``page_utilization``).
    """

    __slots__ = (
        "num_blocks",
        "block_size",
        "cell_size",
        "block_mem_size",
        "page_size",
        "num_pages",
        "caps",
        "max_blocks_per_page",
        "num_usable_blocks",
        "exact",
        "utilization",
    )

    def __init__(self, num_blocks: int, block_size: int, cell_size: int, page_size: int) -> None:
        self.num_blocks = int_arg("num_blocks", num_blocks, minimum=1)
        self.block_size = int_arg("block_size", block_size, minimum=1)
        self.cell_size = int_arg("cell_size", cell_size, minimum=1)
        self.page_size = int_arg("page_size", page_size, minimum=1)
        block = self.block_size * self.cell_size
        self.block_mem_size = block
        where = (
            f"a block of {block} bytes (block_size {self.block_size} x cell_size {self.cell_size}) "
            f"on kvcached pages of {self.page_size} bytes"
        )
        if block > self.page_size:
            fix = suggest_geometry(self.block_size, self.cell_size, self.page_size)
            raise InvalidArgumentError(f"{where}: the block does not fit in a page; {fix}")
        if not _every_page_holds_a_block(self.page_size, block):
            raise InvalidArgumentError(
                f"{where}: some pages would hold no whole block; "
                f"{suggest_geometry(self.block_size, self.cell_size, self.page_size)}"
            )
        last = self.num_blocks - 1
        while last >= 0 and self._straddles(last):
            last -= 1
        if last < 0:  # cannot happen after the checks above (block 0 starts page 0)
            raise InvalidArgumentError(
                f"{where}: no block fits; {suggest_geometry(self.block_size, self.cell_size, self.page_size)}"
            )
        self.num_pages = last * block // self.page_size + 1
        self.caps: List[int] = []
        for p in range(self.num_pages):
            first, end = self.block_range(p)
            self.caps.append(end - first)
        self.max_blocks_per_page = max(self.caps)
        self.num_usable_blocks = sum(self.caps)
        self.exact = self.num_usable_blocks == self.num_blocks
        self.utilization = page_utilization(self.page_size, block)

    def _straddles(self, block_id: int) -> bool:
        start = block_id * self.block_mem_size
        return start // self.page_size != (start + self.block_mem_size - 1) // self.page_size

    def block_range(self, page_id: int) -> Tuple[int, int]:
        """Usable block ids of page ``page_id``: ``range(first, end)``."""
        P, B = self.page_size, self.block_mem_size
        first = -((-page_id * P) // B)
        end = min(((page_id + 1) * P) // B, self.num_blocks)
        return first, max(first, end)

    def page_of(self, block_id: int) -> int:
        """The page holding usable block ``block_id``."""
        return block_id * self.block_mem_size // self.page_size

    def is_usable(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks and not self._straddles(block_id)

    def __repr__(self) -> str:
        return (
            f"BlockGeometry(num_blocks={self.num_blocks}, block_mem_size={self.block_mem_size}, "
            f"page_size={self.page_size}, num_pages={self.num_pages}, "
            f"blocks_per_page<={self.max_blocks_per_page}, usable={self.num_usable_blocks})"
        )
