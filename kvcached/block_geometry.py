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
a block size and a page size that work.
"""

from __future__ import annotations

import math
import operator
from typing import List, Tuple

from kvcached.errors import InvalidArgumentError


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    try:
        value = operator.index(value)  # also numpy / torch integer scalars
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}") from None
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _every_page_holds_a_block(page_size: int, block_mem_size: int) -> bool:
    # The first block start inside a page sits at most (block - gcd) bytes past
    # the page start, and that worst offset occurs on some page; a whole block
    # fits after it iff page >= 2*block - gcd.
    if page_size % block_mem_size == 0:
        return True
    return page_size >= 2 * block_mem_size - math.gcd(page_size, block_mem_size)


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
    k = 1
    while not (_every_page_holds_a_block(k * page_size, block) and k * page_size >= block):
        k += 1
    exact = next((m for m in range(k, 4 * k + 64) if (m * page_size) % block == 0), None)
    if exact is not None and exact <= 2 * k:
        k = exact
    tips.append(f"KVCACHED_PAGE_SIZE={k * page_size} ({k} x {page_size})")
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
    )

    def __init__(self, num_blocks: int, block_size: int, cell_size: int, page_size: int) -> None:
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.cell_size = _positive_int("cell_size", cell_size)
        self.page_size = _positive_int("page_size", page_size)
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
