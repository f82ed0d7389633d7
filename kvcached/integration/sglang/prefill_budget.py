"""Prefill budgets over physical capacity (SGLang 0.5.21+, where ``create_prefill_budget`` exists).

The elastic allocators' ``create_prefill_budget`` imports this module (SGLang's
``mem_cache/prefill_budget.py`` is new in 0.5.21; older releases are covered by
``admission.patch_prefill_adder``).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.prefill_budget import PrefillBudget, SWAPrefillBudget

from kvcached.integration.sglang.eviction import evictable_tokens


class _SetsAsideAdmitted:
    """Every admitted prefill's tokens are set aside when the budget takes them
    (``allocator.set_aside_admitted``): the count this budget is built on must still
    hold at ``alloc_extend``, after a limit lowered in between."""

    def __init__(self, allocator: Any, tree_cache: Any, *args: Any, num_mixed_decode_tokens: int = 0, **kw: Any):
        super().__init__(allocator, tree_cache, *args, num_mixed_decode_tokens=num_mixed_decode_tokens, **kw)
        self._admitted = num_mixed_decode_tokens  # tokens this turn's batch allocates at once

    def reserve(self, extend_input_len: int, max_new_tokens: int, *args: Any, **kw: Any) -> None:
        super().reserve(extend_input_len, max_new_tokens, *args, **kw)
        self._admitted += self.ceil_paged_tokens(extend_input_len) + int(kw.get("extra_tokens", 0) or 0)
        self._set_aside()

    def _set_aside(self) -> None:
        self.allocator.set_aside_admitted(self._admitted)


class ElasticPrefillBudget(_SetsAsideAdmitted, PrefillBudget):
    """PrefillBudget whose free space is what can be mapped now, not the logical count."""

    def _available_and_evictable(self) -> int:
        return self.allocator.physical_available_size() + evictable_tokens(self.tree_cache)


class ElasticSWAPrefillBudget(_SetsAsideAdmitted, SWAPrefillBudget):
    """SWAPrefillBudget over the physical capacity of both sub-pools."""

    def _available_and_evictable(self) -> int:
        a = self.allocator
        if self.all_swa:
            return a.swa_physical_available_size() + self.tree_cache.swa_evictable_size()
        return a.full_physical_available_size() + self.tree_cache.full_evictable_size()

    @property
    def remaining_swa(self) -> int:
        evictable = 0 if self.req_ring else self.tree_cache.swa_evictable_size()
        return self.allocator.swa_physical_available_size() + evictable - self.swa_offset

    def _set_aside(self) -> None:
        self.allocator.set_aside_admitted(self._admitted, swa_tokens=self.swa_offset)
