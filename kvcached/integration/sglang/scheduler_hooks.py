"""What the SGLang scheduler does for kvcached between batches.

The policy is ``kvcached.elastic`` (one ``ElasticInstance`` per scheduler
process: the release fence, wants, idle give-back, the prefix-cache bound);
this module translates SGLang's scheduler events and radix cache into it.

Deferred physical release (overlap scheduling). SGLang's overlap loop launches
batch N+1 before it processes the result of batch N, and requests that finish
in N are freed while N+1, which may still carry them, runs on the device. A
native pool only recycles the slots; kvcached would unmap the memory under
N+1's kernels (``cuMemUnmap`` does not wait for them). So emptied pages are
only retired (they stay mapped and reusable), and released as follows:

* right after a batch is launched, the fence captures a release marker and
  the step number is stored on its result;
* when that result has been processed, the batch and every earlier one have
  finished (results are processed in launch order, after their device work):
  pages emptied before the next launched batch's marker cannot be read any
  more and may be released (``kvcached.elastic.fence``);
* while serving, they are released once that has been true for
  ``pool.RELEASE_GRACE_S`` (the device's other instances wait at most that
  long);
* when the scheduler is idle (nothing in flight), after ``flush_cache`` and
  while a pool maps more than its limit, everything safe is released at once.

The same order holds for the non-overlap loop (launch, then process).

Prefix-cache bound: after each batch, if the radix cache holds more than
``KVCACHED_MAX_CACHED_TOKENS`` tokens, unlocked entries are evicted (LRU, by
SGLang's own policy) down to 90% of the bound (``kvcached.elastic.cache_bound``).

Sharing the device budget. While requests wait and the device budget (not
this instance's limit) stops the pool from growing, the want is published in
the instance's record (``InstanceLimits.note_shortage``, after every batch and
idle turn). An idle scheduler that sees a peer's current want evicts its
unlocked prefix cache and gives back the emptied pages, the mapped reserve and
unused budget: a busy peer must not wait for an idle one's cache.

Pacing: an idle turn with requests waiting, none admitted and nothing in flight
(a limit below what they need, peers holding the budget) sleeps a little longer
each time, up to 5 ms, instead of spinning (``kvcached.elastic.stall``).

A lowered limit (``kvctl limit``): no page is mapped past it from then on, and
pages with live blocks are released as their blocks are freed. Blocks held
only by the prefix cache would keep their pages forever, so after each batch
and when idle, while a pool maps more than its limit, unlocked cache entries
are evicted until the pages still holding blocks fit under the limit.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Optional

from kvcached import trace
from kvcached.elastic import GIVE_CHUNK_PAGES, IdleAction, StallBackoff, cache_excess_tokens, give_chunks
from kvcached.elastic.cache_bound import max_cached_tokens
from kvcached.integration.patch_base import summary_of
from kvcached.integration.sglang.admission import tokens_wanted
from kvcached.integration.sglang.eviction import (
    evict_tokens,
    evict_until,
    evictable_tokens,
    prefix_sharing,
    protected_tokens,
)
from kvcached.integration.sglang.hicache import poll_allocator
from kvcached.integration.sglang.idle_wake import waker_of
from kvcached.integration.sglang.pool import elastic_groups, instance
from kvcached.integration.sglang.step_timing import step_timer

logger = logging.getLogger("kvcached.integration.sglang")

_STEP = "_kvcached_step"

# Counters for kvcached_report (this process).
_stats: Dict[str, int] = {
    "batches": 0,
    "idle_turns": 0,
    "cache_bound_evicted_tokens": 0,
    "limit_evicted_tokens": 0,
    "flushes": 0,
    "peer_evicted_tokens": 0,
}


def after_init(scheduler: Any) -> None:
    """The scheduler is built: its elastic allocators (a hybrid's state slots too) learn its
    prefix cache (they evict from it when an allocation comes up short, see ``allocator.py``),
    and an idle sleeper (``--sleep-on-idle``) is woken by the instance's wake."""
    alloc = getattr(scheduler, "token_to_kv_pool_allocator", None)
    tree = getattr(scheduler, "tree_cache", None)
    states = getattr(getattr(scheduler, "req_to_token_pool", None), "mamba_allocator", None)
    for a in (alloc, getattr(alloc, "full_attn_allocator", None), getattr(alloc, "swa_attn_allocator", None), states):
        if a is not None and hasattr(a, "kvcached_tree_cache"):
            a.kvcached_tree_cache = tree
    wake = waker_of(getattr(scheduler, "idle_sleeper", None))  # --sleep-on-idle (idle_wake.py)
    if wake is not None and elastic_groups():
        instance().add_waker(wake)


def before_launch() -> None:
    """A batch, its memory allocated, is about to run (traced only: the first one after
    a miss is when the stalled load is admitted; after the launch would add its forward)."""
    if trace.ON and elastic_groups():
        instance().traced_allocation(1)


def after_launch(result: Any) -> None:
    """Right after a batch is launched: its step number goes on ``result``."""
    if result is None or not elastic_groups():
        return
    setattr(result, _STEP, instance().fence.launched())


def after_result(scheduler: Any, result: Any) -> None:
    """The batch of ``result`` and all earlier ones have finished: release, then bound the cache."""
    _stats["batches"] += 1
    timer = step_timer()
    with timer.part("hooks"):
        step = getattr(result, _STEP, None) if result is not None else None
        if step is not None:
            instance().fence.finished(step)
        poll_allocator(getattr(scheduler, "token_to_kv_pool_allocator", None))
        tree = getattr(scheduler, "tree_cache", None)
        bound_prefix_cache(tree)
        shrink_to_limits(tree)
        note_waiting(scheduler)
        if _stall is not None:
            _stall.progress()  # a batch ran
    timer.end_step()


def nothing_in_flight(scheduler: Any) -> bool:
    return getattr(scheduler, "last_batch", None) is None and not getattr(scheduler, "result_queue", None)


def on_idle(scheduler: Any) -> None:
    _stats["idle_turns"] += 1
    poll_allocator(getattr(scheduler, "token_to_kv_pool_allocator", None))  # finished host copies
    if nothing_in_flight(scheduler):
        tree = getattr(scheduler, "tree_cache", None)
        shrink_to_limits(tree)  # emptied pages retire...
        release_all()  # ...and are released at once: nothing is in flight
        waiting = note_waiting(scheduler)
        if not waiting:
            give_back_to_peers(tree)
            yield_gil()
        stall = _stall_backoff()
        if stall is not None and waiting:  # requests wait, none was admitted, none runs
            stall.stalled(len(scheduler.waiting_queue))
        elif stall is not None:
            stall.progress()


def yield_gil() -> None:
    """Without --sleep-on-idle an idle SGLang loop spins holding the GIL: kvcached's threads
    in its process (the limits watcher acting on a peer's want or a limit write) got it back
    only at the 5 ms switch interval, at each of their calls (trace, CPU: 28-83 ms before the
    give-back began). One yield per idle turn with nothing waiting lets them run at once."""
    time.sleep(0)


_stall: Optional[StallBackoff] = None


def _stall_backoff() -> Optional[StallBackoff]:
    """This scheduler's pacing of idle turns that admit nothing (None before a pool is elastic)."""
    global _stall
    if _stall is None and instance().pools:
        _stall = StallBackoff(instance().pools[0])
    return _stall


def note_waiting(scheduler: Any) -> bool:
    """Requests wait: the pools' limits publish a want when the device budget
    is what stops them (rate-limited there); none wait: the want is withdrawn.
    Returns whether requests wait."""
    queue = getattr(scheduler, "waiting_queue", None) or ()
    waiting = bool(len(queue))
    inst = instance()
    if waiting:
        inst.note_shortage(tokens_wanted(scheduler, queue))
        retry_admission(scheduler)
    inst.end_step()
    return waiting


def retry_admission(scheduler: Any) -> None:
    """SGLang marks its running batch full when a request gets no tokens, and clears the
    mark only when its own requests finish or retract: natively no memory appears
    otherwise. Under kvcached it does (a peer gives its cache back, a limit is raised),
    so with nothing running the mark would stop admission for good. Cleared while
    requests wait: the next step tries again, stopping at the first that does not fit."""
    batch = getattr(scheduler, "running_batch", None)
    if batch is not None and getattr(batch, "batch_is_full", False):
        batch.batch_is_full = False


def give_back_to_peers(tree_cache: Any) -> int:
    """Idle: when a peer sharing the device budget wants memory, evicts the
    unlocked prefix cache and returns the emptied pages, the mapped reserve
    and unused budget. Returns tokens evicted."""
    inst = instance()
    if not inst.idle_action() & IdleAction.GIVE_TO_PEERS:
        return 0
    t0 = trace.start()
    trace.event("give_back_start", inst.name)
    before = sum(p.mapped_pages() for p in inst.pools)
    n = 0
    if prefix_sharing(tree_cache):
        # In chunks, each one's pages released before the next is evicted (see give_chunks).
        first = max((p.pages_wanted_by_peers() * p.tokens_per_page() for p in inst.pools), default=0)
        least = GIVE_CHUNK_PAGES * max((p.tokens_per_page() for p in inst.pools), default=1)
        for size in give_chunks(first, least):
            got = _evict_for_peers(tree_cache, size, inst.name) if evictable_tokens(tree_cache) > 0 else 0
            if got <= 0:
                break
            n += got
            release_all()
            inst.give_back()  # its pages count below, with every other one unmapped since `before`
    release_all()
    given = before - sum(p.mapped_pages() for p in inst.pools) + inst.give_back()
    trace.end("give_back_end", t0, inst.name, pages=given)
    if given > 0:  # one line per give-back, as vLLM's idle_return_memory logs it
        logger.info(
            "kvcached: idle %s gave back %d of %d mapped pages (wanted by a peer; %d cached tokens evicted)",
            inst.name,
            given,
            before,
            n,
        )
    return n


def _evict_for_peers(tree_cache: Any, tokens: int, name: str) -> int:
    t0 = trace.start()
    n = evict_tokens(tree_cache, tokens)
    trace.end("evicted", t0, name, tokens=n)
    _stats["peer_evicted_tokens"] += n
    return n


def after_flush(scheduler: Any, success: Any) -> None:
    if success:
        _stats["flushes"] += 1
        release_all()


def release_all() -> int:
    """Nothing in flight: spare slots back to the managers, every emptied page released."""
    for g in elastic_groups():
        g.drain()
    return instance().fence.idle()


def bound_prefix_cache(tree_cache: Any) -> int:
    """Evicts unlocked prefix-cache entries above KVCACHED_MAX_CACHED_TOKENS; returns tokens evicted."""
    bound = max_cached_tokens()
    if bound is None or not prefix_sharing(tree_cache):
        return 0
    evictable = evictable_tokens(tree_cache)
    excess = cache_excess_tokens(evictable + protected_tokens(tree_cache), evictable, bound)
    if excess <= 0:
        return 0
    n = evict_tokens(tree_cache, excess)
    _stats["cache_bound_evicted_tokens"] += n
    return n


def shrink_to_limits(tree_cache: Any) -> int:
    """Evicts unlocked prefix-cache entries while a pool maps more than its limit; returns tokens evicted."""
    if not prefix_sharing(tree_cache):
        return 0
    evicted = 0
    for g in elastic_groups():
        if g.pages_over_limit() <= 0:
            continue
        g.drain()  # spare slots may be all that keeps some pages
        instance().fence.release_due(grace_s=0.0)  # no grace period over the limit
        if evictable_tokens(tree_cache) <= 0 or g.live_pages_over_limit() <= 0:
            continue  # only emptied pages or the reserve are over: released/trimmed without evicting
        # At least the tokens of the pages over the limit must go; evicted in
        # steps of that size (LRU order) until the live pages fit. Evicted slots
        # may wait in an allocator's spare list: drained before each look.
        per_page = g.page_tokens * max(1, g.manager.page_size // g.manager.block_mem_size)
        n = evict_until(
            tree_cache,
            lambda g=g: g.drain() >= 0 and g.live_pages_over_limit() <= 0,
            lambda g=g, per_page=per_page: g.live_pages_over_limit() * per_page,
        )
        evicted += n
        _stats["limit_evicted_tokens"] += n
    return evicted


def report(scheduler: Any) -> Dict[str, Any]:
    """The scheduler's kvcached state (for ``Engine.collective_rpc("kvcached_report", path=...)``)."""
    alloc = getattr(scheduler, "token_to_kv_pool_allocator", None)
    tree = getattr(scheduler, "tree_cache", None)
    pools = []
    for g in elastic_groups():
        m = g.manager
        rec = None
        if g.limits is not None:
            r = g.limits.record()
            rec = {
                "name": r.name,
                "limit": r.limit,
                "used": r.used,
                "prealloc": r.prealloc,
                "total": r.total,
                "revision": r.revision,
                "applied_revision": getattr(r, "applied_revision", None),
            }
        pools.append(
            {
                "group_id": g.group_id,
                "pool_class": g.pool_class,
                "page_tokens": g.page_tokens,
                "row_bytes": g.row_bytes,
                "buffer_rows": g.buffer_rows,
                "holes": g.holes,
                "num_blocks": m.num_blocks,
                "kv_page_bytes": m.page_size,
                "bytes_per_page": m.bytes_per_page,
                "logical_free_blocks": m.logical_free_size(),
                "physical_available_blocks": m.available_size(),
                "mapped_bytes": m.get_mapped_memory_size(),
                "released_pages": g.released_pages,
                "stats": m.stats(),
                "data_ptrs_at_start": list(g.data_ptrs),
                "data_ptrs_now": [t.data_ptr() for t in g.k_views + g.v_views],
                "record": rec,
            }
        )
    out: Dict[str, Any] = {
        "pid": os.getpid(),
        "time": time.time(),
        "allocator_class": type(alloc).__name__ if alloc is not None else None,
        "pool_class": type(alloc.get_kvcache()).__name__ if alloc is not None else None,
        "available_size": alloc.available_size() if alloc is not None else None,
        "physical_available_size": getattr(alloc, "physical_available_size", lambda: None)(),
        "max_total_num_tokens": getattr(scheduler, "max_total_num_tokens", None),
        "evictable_size": evictable_tokens(tree) if tree is not None else None,
        "protected_size": protected_tokens(tree) if tree is not None else None,
        "max_cached_tokens": max_cached_tokens(),
        "pools": pools,
        # kvcached's vLLM patches in this process ("" when none: SGLang may import vLLM as a library).
        "vllm_patches": summary_of("vLLM"),
    }
    out.update(_stats)
    out["step_timing"] = step_timer().stats()
    return out


def kvcached_report(self: Any, path: str) -> None:
    """Scheduler method: writes ``report(self)`` as JSON to ``path`` (one file per TP rank: ``path.<rank>``)."""
    rank = int(getattr(self, "tp_rank", 0) or 0)
    target = path if rank == 0 else f"{path}.{rank}"
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report(self), f)
    os.replace(tmp, target)
