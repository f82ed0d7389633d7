"""Admission by physical capacity: what the scheduler may start when memory is the limit.

An elastic allocator's ``available_size()`` stays SGLang's logical count (the
idle leak check compares it exactly), so every place that decides whether a
prefill or the next decode step fits must read ``physical_available_size()``
instead. Where SGLang asks the allocator (``check_decode_capacity`` from
0.5.19, ``create_prefill_budget`` from 0.5.21) the allocator answers
(``allocator.py``, ``prefill_budget.py``); older releases read
``available_size()`` in the scheduler itself, and the two patches here move
those reads:

* ``patch_prefill_adder`` (SGLang 0.5.15-0.5.20): ``PrefillAdder.rem_total_tokens``
  and ``cur_rem_tokens`` lose the tokens the allocator withholds (free in the
  logical count, not mappable under the limit or the device budget);
* ``patch_check_decode_mem`` (0.5.15-0.5.18): ``ScheduleBatch.check_decode_mem``
  asks the allocator's ``check_decode_capacity``, as 0.5.19 does, so a decode
  step that does not fit retracts requests instead of crashing in ``alloc``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from kvcached.integration.patch_base import WRAPPED, wrap_method


def _withheld(allocator: Any) -> int:
    fn = getattr(allocator, "withheld_tokens", None)
    return int(fn()) if fn is not None else 0


def _wrap_property(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """``wrap_method`` for a property defined on ``cls`` itself (the getter is wrapped)."""
    prop = cls.__dict__.get(name)
    if not isinstance(prop, property) or prop.fget is None:
        raise AttributeError(f"{cls.__module__}.{cls.__qualname__}.{name} is not a property defined there")
    getter = make(prop.fget)
    setattr(getter, WRAPPED, prop.fget)
    setattr(cls, name, property(getter, prop.fset, prop.fdel, prop.__doc__))


def patch_prefill_adder(mod: ModuleType) -> None:
    """SGLang 0.5.15-0.5.20: prefill admission sees only what can be mapped now."""

    def make(fget: Callable) -> Callable:
        def remaining(self: Any) -> Any:
            return fget(self) - _withheld(self.token_to_kv_pool_allocator)

        return remaining

    for name in ("rem_total_tokens", "cur_rem_tokens"):
        _wrap_property(mod.PrefillAdder, name, make)


def patch_check_decode_mem(mod: ModuleType) -> None:
    """SGLang 0.5.15-0.5.18: the decode check asks the elastic allocator (0.5.19 does so itself)."""
    from kvcached.integration.sglang.allocator import _ElasticAllocatorMixin

    def make(orig: Callable) -> Callable:
        def check_decode_mem(self: Any, selected_indices: Any = None) -> bool:
            alloc = self.token_to_kv_pool_allocator
            if not isinstance(alloc, _ElasticAllocatorMixin):
                return orig(self, selected_indices)
            num_tokens = self.new_tokens_required_next_decode(selected_indices)
            return alloc.check_decode_capacity(num_tokens=num_tokens, tree_cache=self.tree_cache)

        return check_decode_mem

    wrap_method(mod.ScheduleBatch, "check_decode_mem", make)
