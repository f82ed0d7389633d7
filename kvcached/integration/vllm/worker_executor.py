"""The vLLM worker's executor: the scheduler's logical pages on the FTensor's physical pages.

The scheduler (EngineCore, another process) maps and unmaps *logical pages*
(byte offsets ``p * page_size`` in its block ledger) through ``kvcached.ipc``.
In this worker a logical page is every physical page of vLLM's KV buffer that
holds its blocks, in every layer (``kv_layout.KVLayoutPlan.physical_pages``).
Where layer regions are not page aligned, two neighbouring logical pages share
a physical page: it is mapped with the first of them and unmapped with the
last, so this executor counts references per physical page.

It supplies only the page hooks of ``kvcached.ipc.executor.VmmExecutor``;
the transaction bookkeeping (MAP history, idempotent repeats, exact rollback,
prepared unmaps given back on ABORT) is the base class's. The data plane keeps
the all-or-nothing map and the two-phase unmap.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from kvcached import vmm_ops
from kvcached.errors import InvalidArgumentError
from kvcached.integration.vllm.kv_layout import KVLayoutPlan
from kvcached.ipc.executor import VmmExecutor
from kvcached.ipc.protocol import WorkerState


class PlannedExecutor(VmmExecutor):
    """Serves the scheduler's logical pages on this worker's FTensor pages.

    A logical page maps every physical page in ``plan.physical_pages(p)``; a
    physical page shared by two logical pages is mapped while either is and
    unmapped with the last.
    """

    def __init__(self, plan: KVLayoutPlan) -> None:
        super().__init__()
        self.plan = plan
        self._P = plan.page_size
        self._mapped: Set[int] = set()  # logical pages mapped (or held by a prepared unmap)
        self._refs: Dict[int, int] = {}  # physical page -> mapped logical pages using it

    # ---- page hooks ------------------------------------------------------------------

    def map_pages(self, group: int, offsets: Sequence[int]) -> Tuple[List[int], int]:
        logical = self._logical(offsets)
        new = [p for p in logical if p not in self._mapped]
        phys = self._unused(new)
        if phys:
            vmm_ops.map_to_kv_tensors([ph * self._P for ph in phys], group)  # all or nothing
        self._count(new, +1)
        return [p * self._P for p in new], len(logical) - len(new)

    def unmap_pages(self, group: int, offsets: Sequence[int]) -> None:
        # A later PREPARE/COMMIT may have unmapped some of them already.
        pages = [o // self._P for o in offsets if o // self._P in self._mapped]
        phys = self._last_users(pages)
        if phys:
            vmm_ops.unmap_from_kv_tensors([ph * self._P for ph in phys], group)
        self._count(pages, -1)

    def stage_unmap(self, group: int, tx: int, offsets: Sequence[int]) -> Optional[Any]:
        logical = self._logical(offsets)
        missing = [p for p in logical if p not in self._mapped]
        if missing:
            raise InvalidArgumentError(f"offset {missing[0] * self._P} is not mapped; nothing to unmap")
        phys = self._last_users(logical)
        # The data plane records the transaction (also with no page to
        # release), refuses a PREPARE after ABORT and keeps the handles.
        vmm_ops.prepare_unmap_from_kv_tensors(tx, [ph * self._P for ph in phys], group)
        self._count(logical, -1)
        return logical  # ABORT gives these references back

    def abort_unmap(self, group: int, tx: int, staged: Optional[Any]) -> None:
        vmm_ops.abort_unmap_from_kv_tensors(tx, group)
        if staged is not None:
            self._count(staged, +1)

    # ---- state -----------------------------------------------------------------------

    def query(self, group: int) -> WorkerState:
        state = super().query(group)
        with self._lock:
            state.mapped_offsets = sorted(p * self._P for p in self._mapped)
            state.units_per_page = self.plan.physical_pages_per_logical_page()
        return state

    def mapped_logical_pages(self) -> List[int]:
        with self._lock:
            return sorted(self._mapped)

    def physical_references(self) -> Dict[int, int]:
        """Physical page -> how many mapped (or prepared) logical pages use it."""
        with self._lock:
            return dict(self._refs)

    # ---- translation and reference counts (no data-plane call) -----------------------

    def _logical(self, offsets: Sequence[int]) -> List[int]:
        out = []
        for o in offsets:
            o = int(o)
            if o < 0 or o % self._P:
                raise InvalidArgumentError(f"offset {o} is not a multiple of the page size {self._P}")
            out.append(o // self._P)
        if len(set(out)) != len(out):
            raise InvalidArgumentError("an offset appears twice in one request")
        return out

    def _unused(self, pages: Sequence[int]) -> List[int]:
        """Physical pages that ``pages`` need and no mapped logical page uses yet."""
        fresh: List[int] = []
        seen = set()
        for p in pages:
            for ph in self.plan.physical_pages(p):
                if self._refs.get(ph, 0) == 0 and ph not in seen:
                    seen.add(ph)
                    fresh.append(ph)
        return fresh

    def _last_users(self, pages: Sequence[int]) -> List[int]:
        """Physical pages whose last users are all among ``pages``."""
        drop: Dict[int, int] = {}
        for p in pages:
            for ph in self.plan.physical_pages(p):
                drop[ph] = drop.get(ph, 0) + 1
        return sorted(ph for ph, n in drop.items() if self._refs.get(ph, 0) == n)

    def _count(self, pages: Sequence[int], delta: int) -> None:
        refs = self._refs
        for p in pages:
            for ph in self.plan.physical_pages(p):
                n = refs.get(ph, 0) + delta
                if n:
                    refs[ph] = n
                else:
                    refs.pop(ph, None)
            if delta > 0:
                self._mapped.add(p)
            else:
                self._mapped.discard(p)
