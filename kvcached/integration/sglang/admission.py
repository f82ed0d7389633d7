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
  logical count, not mappable under the limit or the device budget), and each
  admitted prefill's tokens are set aside as the adder takes them (0.5.21+:
  ``prefill_budget``), so a limit lowered before ``alloc_extend`` cannot fail it;
* ``patch_check_decode_mem`` (0.5.15-0.5.18): ``ScheduleBatch.check_decode_mem``
  asks the allocator's ``check_decode_capacity``, as 0.5.19 does, so a decode
  step that does not fit retracts requests instead of crashing in ``alloc``.

And on every release, ``patch_retract_to_limit``: while running requests hold
pages over a lowered limit, SGLang's own retract loop gives them back.

When requests wait, ``tokens_wanted`` says how much the load needs, for the want
published to idle peers sharing the device budget (``scheduler_hooks.note_waiting``).
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

    from kvcached.integration.sglang.allocator import _ElasticAllocatorMixin

    def make_update(orig: Callable) -> Callable:
        def _update_prefill_budget(self: Any, prefix_len: int, extend_input_len: int, *a: Any, **k: Any) -> Any:
            # Before the first request, the offset holds the mixed decode tokens alone.
            admitted = getattr(self, "_kvcached_admitted", None)
            admitted = self.cur_rem_token_offset if admitted is None else admitted
            out = orig(self, prefix_len, extend_input_len, *a, **k)
            self._kvcached_admitted = admitted + self.ceil_paged_tokens(extend_input_len)
            alloc = self.token_to_kv_pool_allocator
            if isinstance(alloc, _ElasticAllocatorMixin):
                alloc.set_aside_admitted(self._kvcached_admitted)
            return out

        return _update_prefill_budget

    wrap_method(mod.PrefillAdder, "_update_prefill_budget", make_update)


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


def patch_retract_to_limit(mod: ModuleType) -> None:
    """Every release: while the allocator is ``shrinking()`` (live pages over a lowered limit),
    the decode check fails for any selection of more than one request. SGLang's retract loop
    (``retract_decode``: least progressed first, back to the waiting queue, their KV freed)
    then retracts until the check passes, i.e. until the pages fit; its last request keeps
    running, since SGLang aborts one that fails the check alone."""
    from kvcached.integration.sglang.allocator import _ElasticAllocatorMixin

    def make(orig: Callable) -> Callable:
        def check_decode_mem(self: Any, selected_indices: Any = None) -> bool:
            alloc = self.token_to_kv_pool_allocator
            if isinstance(alloc, _ElasticAllocatorMixin) and alloc.shrinking():
                if (len(self.reqs) if selected_indices is None else len(selected_indices)) > 1:
                    return False
            return orig(self, selected_indices)

        return check_decode_mem

    wrap_method(mod.ScheduleBatch, "check_decode_mem", make)


# Waiting requests summed for a want (the queue may be long; the want saturates at the limit).
_WANT_SCAN = 256


def tokens_wanted(scheduler: Any, queue: Any) -> int:
    """Tokens the load needs beyond what it holds: every waiting request whole, and what
    the running ones still grow by. SGLang admits a request only when its prompt and the
    running requests' remaining outputs fit, so a request can wait while one more page
    (or its own size) still maps: asking for less would never reach an idle peer."""
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or ()
    # Only the requests that could start: past max_running_requests, memory is not why they wait.
    startable = int(getattr(scheduler, "max_running_requests", 0) or _WANT_SCAN) - len(running)
    try:
        need = sum(_left(r) for r in running)
        for i, r in enumerate(queue):
            if i >= min(_WANT_SCAN, startable):
                break
            need += len(r.origin_input_ids) + len(r.output_ids) + _left(r)
        return need
    except (AttributeError, TypeError):
        return 0  # an unexpected request object: one page


def _left(req: Any) -> int:
    return max(0, int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids))
