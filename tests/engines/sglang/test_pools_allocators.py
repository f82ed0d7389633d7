"""Proof 5: our pools and allocators beside SGLang's own classes, on the CPU.

Same configuration, built twice: SGLang's ``MHATokenToKVPool`` /
``MLATokenToKVPool`` / allocators, and ours. The buffers must have the same
shapes, strides, dtypes and K/V placement; the allocators, driven by the same
call sequence SGLang's scheduler makes (extend, decode, prefix reuse, free
groups, segment frees, flush), must give the same results: after every call
the same number of slots, ``None`` at the same point when the pool is full,
the same ``available_size()``, and the same page structure (slot ``i`` of a
request sits at offset ``i % page_size`` of one page per ``page_size`` slots,
prefix continuations exactly where SGLang puts them). Which free page ids are
picked differs by design: SGLang takes the head of its free list, kvcached
puts one request's pages on as few kvcached pages as it can (so freeing the
request empties whole pages). Data written through SGLang's own
``set_kv_buffer`` reads back identically from both pools, and kvcached pages
are mapped for live slots and unmapped after release.
"""

from __future__ import annotations

import random
import time
from typing import Dict, List, Optional

import pytest
import torch
from sglang_versions import NATIVE_PAGED_ON_CPU, UNIT_PAGE, sglang_version

PAGE = UNIT_PAGE  # the kvcached page of unit_kvcached_env: 32 tokens of the tiny model's rows
ROW_HEADS, ROW_DIM = 2, 32
DT = torch.float16


pytestmark = pytest.mark.usefixtures("unit_kvcached_env")


def _mha(cls, size: int, ps: int, layers: int = 2):
    return cls(
        size,
        page_size=ps,
        dtype=DT,
        head_num=ROW_HEADS,
        head_dim=ROW_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _pools(size: int, ps: int, layers: int = 2):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool

    return _mha(MHATokenToKVPool, size, ps, layers), _mha(ElasticMHATokenToKVPool, size, ps, layers)


def _allocator(pool, size: int, ps: int, elastic: bool):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from kvcached.integration.sglang import allocator as ea

    if ps == 1:
        cls = ea.ElasticTokenToKVPoolAllocator if elastic else TokenToKVPoolAllocator
        return cls(size, DT, "cpu", pool, False)
    cls = ea.ElasticPagedTokenToKVPoolAllocator if elastic else PagedTokenToKVPoolAllocator
    return cls(size, ps, DT, "cpu", pool, False)


# --------------------------------------------------------------------------- pools
@pytest.mark.parametrize("ps,size", [(1, 2047), (16, 2032), (16, 2000), (1, 1000)])
def test_mha_pool_layout_matches_native(ps: int, size: int) -> None:
    native, ours = _pools(size, ps)
    assert type(ours).__mro__[1] is type(native)
    for layer in range(2):
        nk, nv = native.get_kv_buffer(layer)
        ok, ov = ours.get_kv_buffer(layer)
        for a, b in ((nk, ok), (nv, ov)):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            assert b.device.type == "cpu"
        row_bytes = ROW_HEADS * ROW_DIM * 2
        native_off = nv.data_ptr() - nk.data_ptr()
        our_off = ov.data_ptr() - ok.data_ptr()
        # K and V are halves of one address range, V a whole number of pages after K.
        assert our_off % (ps * row_bytes) == 0 and our_off % PAGE == 0
        if nk.untyped_storage().data_ptr() != nv.untyped_storage().data_ptr():
            continue  # SGLang 0.5.15 allocates K and V separately: nothing to compare the offset with
        if native_off % PAGE == 0:  # native padding already page aligned: identical
            assert our_off == native_off
        else:
            assert native_off < our_off < native_off + PAGE + ps * row_bytes
    # SGLang's own tables built from our buffers.
    assert torch.equal(native.data_strides, ours.data_strides)
    if hasattr(native, "_kv_buffer_descs"):  # 0.5.16+
        assert [(d.name, tuple(d.shape), d.row_bytes) for d in native._kv_buffer_descs] == [
            (d.name, tuple(d.shape), d.row_bytes) for d in ours._kv_buffer_descs
        ]
    assert native.get_contiguous_buf_infos()[1:] == ours.get_contiguous_buf_infos()[1:]
    assert ours.k_data_ptrs.tolist() == [t.data_ptr() for t in ours.k_buffer]


def test_mla_pool_layout_matches_native() -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from kvcached.integration.sglang.pool import ElasticMLATokenToKVPool

    kw = dict(
        page_size=8,
        dtype=DT,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    native = MLATokenToKVPool(1000, **kw)
    ours = ElasticMLATokenToKVPool(1000, **kw)
    for layer in range(2):
        for get in ("get_key_buffer", "get_value_buffer"):
            a, b = getattr(native, get)(layer), getattr(ours, get)(layer)
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert ours.data_ptrs.tolist() == [t.data_ptr() for t in ours.kv_buffer]
    assert native.get_contiguous_buf_infos()[1:] == ours.get_contiguous_buf_infos()[1:]
    # An MLA page of 8 rows x 96 elements x 2 bytes = 1536 bytes: every third one
    # straddles a 4 KiB page boundary. Those blocks are holes (never handed out),
    # and the allocator still reports the pool's full logical size.
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from kvcached.integration.sglang.allocator import ElasticPagedTokenToKVPoolAllocator

    a = ElasticPagedTokenToKVPoolAllocator(1000, 8, DT, "cpu", ours, False)
    n = PagedTokenToKVPoolAllocator(1000, 8, DT, "cpu", native, False)
    holes = ours.kvcached_group.holes
    assert holes > 0
    assert a.available_size() == n.available_size() == 1000
    got = a.alloc(a.physical_available_size())
    assert got is not None and len(got) == 1000 - holes * 8
    assert a.alloc(8) is None


def test_the_family_tables_pools_are_sglangs_classes() -> None:
    """The pools the family table names (``families.sglang_pools``: quoted by the refusals
    of a pool kvcached does not back) are SGLang's classes in this release; the leaf pools
    kvcached builds subclass them (the composites hold elastic leaves: ``is_elastic_pool``)."""
    from sglang.srt.mem_cache import memory_pool, swa_memory_pool

    from kvcached.integration import families
    from kvcached.integration.sglang import mamba, pool

    for name in families.sglang_pools():
        native = getattr(memory_pool, name, None) or getattr(swa_memory_pool, name, None)
        assert native is not None, name
        elastic = getattr(pool, f"Elastic{name}", None) or getattr(mamba, f"Elastic{name}", None)
        assert elastic is None or issubclass(elastic, native), name


def test_set_kv_buffer_reads_back_identically() -> None:
    """SGLang's own write path, through both pools, on slots each allocator handed out."""
    native, ours = _pools(2032, 16)
    an, ao = _allocator(native, 2032, 16, False), _allocator(ours, 2032, 16, True)
    ln, lo = an.alloc(64), ao.alloc(64)
    assert ln.shape == lo.shape and len(set(lo.tolist())) == 64

    class _Layer:
        layer_id = 1

    g = torch.Generator().manual_seed(0)
    k = torch.randn((64, ROW_HEADS, ROW_DIM), generator=g).to(DT)
    v = torch.randn((64, ROW_HEADS, ROW_DIM), generator=g).to(DT)
    native.set_kv_buffer(_Layer(), ln, k, v)
    ours.set_kv_buffer(_Layer(), lo, k, v)
    assert torch.equal(native.get_key_buffer(1)[ln], ours.get_key_buffer(1)[lo])
    assert torch.equal(native.get_value_buffer(1)[ln], ours.get_value_buffer(1)[lo])
    assert torch.equal(ours.get_key_buffer(1)[lo], k) and torch.equal(ours.get_value_buffer(1)[lo], v)


def test_fp8_pool_stores_one_byte_cells_like_native() -> None:
    """--kv-cache-dtype fp8_e4m3: SGLang stores the cells as uint8 (``store_dtype``) and
    casts on write and read; the elastic pool carves its rows in that store dtype."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool

    kw = dict(page_size=16, dtype=torch.float8_e4m3fn, head_num=ROW_HEADS, head_dim=ROW_DIM, layer_num=2)
    native = MHATokenToKVPool(2032, device="cpu", enable_memory_saver=False, **kw)
    ours = ElasticMHATokenToKVPool(2032, device="cpu", enable_memory_saver=False, **kw)
    assert ours.store_dtype == native.store_dtype and ours.store_dtype.itemsize == 1
    assert ours.kvcached_group.row_bytes == ROW_HEADS * ROW_DIM  # one byte a cell
    for layer in range(2):
        for a, b in zip(native.get_kv_buffer(layer), ours.get_kv_buffer(layer)):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    an, ao = _allocator(native, 2032, 16, False), _allocator(ours, 2032, 16, True)
    ln, lo = an.alloc(64), ao.alloc(64)

    class _Layer:
        layer_id = 1

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn((64, ROW_HEADS, ROW_DIM), generator=g).to(DT) for _ in range(2))
    native.set_kv_buffer(_Layer(), ln, k, v)
    ours.set_kv_buffer(_Layer(), lo, k, v)
    for get in ("get_key_buffer", "get_value_buffer"):
        a, b = getattr(native, get)(1)[ln], getattr(ours, get)(1)[lo]
        assert a.dtype == torch.float8_e4m3fn and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------- allocators
class Driver:
    """Drives one allocator the way SGLang's scheduler does and keeps each request's kv row."""

    def __init__(self, alloc, ps: int) -> None:
        self.a = alloc
        self.ps = ps
        self.rows: Dict[int, torch.Tensor] = {}
        self.shared: Dict[int, int] = {}  # rid -> tokens of its row owned by the prefix cache

    def extend(
        self, rid: int, n: int, prefix_of: Optional[int] = None, prefix_pages: int = 0
    ) -> Optional[torch.Tensor]:
        ps = self.ps
        prefix = (
            self.rows[prefix_of][: prefix_pages * ps].clone()
            if prefix_of is not None
            else torch.empty(0, dtype=torch.int64)
        )
        plen = len(prefix)
        if ps == 1:
            out = self.a.alloc(n)
        else:
            pl = torch.tensor([plen])
            sl = torch.tensor([plen + n])
            last = torch.tensor([int(prefix[-1]) if plen else -1])
            out = self.a.alloc_extend(pl, pl.clone(), sl, sl.clone(), last, n)
        if out is not None:
            self.rows[rid] = torch.cat([prefix, out])
            self.shared[rid] = plen
        return out

    def decode(self, rids: List[int]) -> Optional[torch.Tensor]:
        if self.ps == 1:
            out = self.a.alloc(len(rids))
        else:
            sl = torch.tensor([len(self.rows[r]) + 1 for r in rids])
            last = torch.tensor([int(self.rows[r][-1]) for r in rids])
            out = self.a.alloc_decode(sl, sl.clone(), last)
        if out is not None:
            for r, s in zip(rids, out):
                self.rows[r] = torch.cat([self.rows[r], s.view(1)])
        return out

    def finish(self, rids: List[int], keep_pages: int = 0) -> None:
        """Frees each row (minus a cached prefix) in one free group, as process_batch_result does
        (through free_segments from SGLang 0.5.17, free before)."""
        self.a.free_group_begin()
        for r in rids:
            row = self.rows.pop(r)
            # The cache keeps its prefix (and keep_pages more): free the rest.
            start = max(keep_pages * self.ps, self.shared.pop(r, 0))
            if hasattr(self.a, "free_segments"):
                self.a.free_segments([(row[start:], start)])
            else:
                self.a.free(row[start:])
        self.a.free_group_end()

    def release(self, slots: torch.Tensor) -> None:
        """An evicted prefix: whole pages, SGLang's radix-cache path (free_segment from 0.5.17, free before)."""
        if hasattr(self.a, "free_segment"):
            self.a.free_segment(slots, start_pos=0)
        else:
            self.a.free(slots)

    def check_structure(self) -> None:
        seen = set()
        cached = set(self.rows[100].tolist()) if 100 in self.rows else set()
        for rid, row in self.rows.items():
            ids = row.tolist()
            own = set(ids) if rid == 100 else set(ids) - cached  # a prefix hit shares the cached slots
            assert len(own) == len(ids) - (len(set(ids) & cached) if rid != 100 else 0), "a slot twice in a row"
            assert not (own & seen), "a slot is held by two requests"
            seen.update(own)
            assert 0 not in ids, "the padding slot was handed out"
            if self.ps > 1:
                for i, s in enumerate(ids):
                    assert s % self.ps == i % self.ps
                    assert s // self.ps == ids[i - i % self.ps] // self.ps


def _scenario(ps: int, size: int, seed: int):
    native, ours = _pools(size, ps)
    dn = Driver(_allocator(native, size, ps, False), ps)
    do = Driver(_allocator(ours, size, ps, True), ps)
    rng = random.Random(seed)

    def both(fn, *args):
        rn, ro = getattr(dn, fn)(*args), getattr(do, fn)(*args)
        assert (rn is None) == (ro is None), (fn, args)
        if rn is not None:
            assert rn.shape == ro.shape and rn.dtype == ro.dtype
        assert dn.a.available_size() == do.a.available_size()
        dn.check_structure()
        do.check_structure()
        return rn, ro

    # Phase 1: fill.
    for rid in range(4):
        both("extend", rid, 50 if rid == 0 else rng.randint(1, 70))  # request 0: >= 2 whole pages
    for _ in range(20):
        both("decode", list(range(4)))
    # Phase 2: finish some (free groups, segment frees), reuse a cached prefix, churn.
    dn_keep, do_keep = dn.rows[0][: 2 * ps].clone(), do.rows[0][: 2 * ps].clone()
    both("finish", [0], 2)  # request 0's first two pages stay "cached"
    both("finish", [1])
    dn.rows[100], do.rows[100] = dn_keep, do_keep
    both("extend", 5, 9, 100, 2)  # prefix hit on the cached pages
    next_id = 6
    for _ in range(60):
        live = [r for r in dn.rows if r != 100]
        op = rng.random()
        if op < 0.3 or not live:
            both("extend", next_id, rng.randint(1, 50))
            next_id += 1
        elif op < 0.8:
            both("decode", live)
        else:
            both("finish", [rng.choice(live)])
    # Phase 3: run the pool dry: both refuse at the same point, with nothing changed.
    while True:
        rn, _ = both("extend", next_id, 97)
        next_id += 1
        if rn is None:
            break
    both("decode", [r for r in dn.rows if r != 100])
    # Phase 4: everything back (cached prefix evicted, flush) and the counts agree.
    for r in [r for r in dn.rows if r != 100]:
        both("finish", [r])
    dn.release(dn.rows.pop(100))
    do.release(do.rows.pop(100))
    assert dn.a.available_size() == do.a.available_size()
    dn.a.clear()
    do.a.clear()
    assert dn.a.available_size() == do.a.available_size() == size // ps * ps
    return ours, do


@pytest.mark.parametrize("ps,size", [(1, 1024), (16, 1024), (16, 1000)])
def test_allocator_results_match_native(ps: int, size: int) -> None:
    if ps > 1 and sglang_version() < NATIVE_PAGED_ON_CPU:
        pytest.skip("SGLang < 0.5.22 places paged slots with Triton only: its own paged allocator has no CPU path")
    ours, do = _scenario(ps, size, seed=ps * 7 + size)
    # Every page went back: only the padding slot's page stays mapped (after release).
    grp = ours.kvcached_group
    grp.release_all_retired()
    st = grp.manager.stats()
    assert st["held_pages"] == 1 and st["mapped_pages"] == 1


def test_pages_mapped_for_live_slots_and_unmapped_after_release() -> None:
    native, ours = _pools(2032, 16)
    a = _allocator(ours, 2032, 16, True)
    m = ours.kvcached_group.manager
    base = m.stats()["mapped_pages"]
    slots = a.alloc(16 * 40)  # 40 SGLang pages = 20 kvcached pages of 2 blocks each
    st = m.stats()
    assert st["mapped_pages"] == base + 20
    # Every live slot is writable memory of its own (not the shared zero page).
    k = ours.get_key_buffer(0)
    k[slots] = torch.arange(len(slots), dtype=DT).view(-1, 1, 1).expand(-1, ROW_HEADS, ROW_DIM)
    assert torch.equal(k[slots][:, 0, 0], torch.arange(len(slots), dtype=DT))
    a.free_group_begin()
    a.free(slots)
    assert m.stats()["mapped_pages"] == base + 20  # deferred to the end of the group
    a.free_group_end()
    # Retired, still mapped: a batch in flight may read them.
    assert m.stats()["mapped_pages"] == base + 20 and m.stats()["retired_pages"] == 20
    assert ours.kvcached_group.release_all_retired() == 20
    assert m.stats()["mapped_pages"] == base
    assert int(k[slots].abs().sum()) == 0  # the zero page is back under those rows


class _EmptyTree:  # an empty prefix cache (nothing to evict)
    def supports_prefix_sharing(self):
        return True

    def supports_mamba(self):
        return False

    def evictable_size(self):
        return 0


def test_capacity_hooks_follow_the_limit_and_available_size_stays_logical() -> None:
    from kvcached.control import set_instance_memory_limit

    native, ours = _pools(2032, 16)
    a = _allocator(ours, 2032, 16, True)
    m = ours.kvcached_group.manager
    held = a.alloc(16 * 8)  # 4 kvcached pages + the padding page
    grp = ours.kvcached_group
    # What `kvctl limit` does: room for one more kvcached page (2 SGLang pages).
    r = set_instance_memory_limit(6 * m.bytes_per_page, name=grp.record_name)
    assert r.status == "applied", r
    time.sleep(0.05)  # the manager re-reads its cap at most every few ms
    assert a.available_size() == 2032 - 16 * 8  # logical: what the leak check compares
    assert a.physical_available_size() == 2 * 16 + 16  # one fresh page + block 1 of page 0

    if sglang_version() >= (0, 5, 21):  # SGLang asks the allocator for a prefill budget from 0.5.21
        budget = a.create_prefill_budget(_EmptyTree())
        assert budget.remaining_total == a.physical_available_size()
    assert a.withheld_tokens() == a.available_size() - a.physical_available_size() > 0
    assert a.check_decode_capacity(num_tokens=48, tree_cache=_EmptyTree())
    assert not a.check_decode_capacity(num_tokens=64, tree_cache=_EmptyTree())
    assert a.alloc(64) is None  # refused cleanly, nothing changed
    assert a.available_size() == 2032 - 16 * 8
    assert set_instance_memory_limit(grp.limits.record().total, name=grp.record_name).status == "applied"
    time.sleep(0.05)
    assert a.physical_available_size() == a.available_size()
    a.free(held)


@pytest.mark.parametrize("ps", [1, 16])
def test_a_limit_lowered_between_the_decode_check_and_its_alloc_cannot_fail_the_alloc(ps: int) -> None:
    """CI (SGLang 0.5.23): `kvctl limit` landed between check_decode_capacity and the
    decode step's alloc; the alloc came up short and SGLang's scheduler died ("Out of
    memory"). The check now sets the step's blocks aside, so the alloc takes them; a
    later check under the lower limit says no (the scheduler retracts), and what was set
    aside and not taken goes back at idle."""
    from kvcached.control import set_instance_memory_limit

    _, ours = _pools(2032, ps)
    a = _allocator(ours, 2032, ps, True)
    grp, m = ours.kvcached_group, ours.kvcached_group.manager
    tpp = m.page_size // m.block_mem_size * ps  # tokens per kvcached page
    held = a.alloc(2 * tpp)
    assert a.check_decode_capacity(num_tokens=tpp, tree_cache=_EmptyTree())
    mapped = m.stats()["mapped_pages"]
    r = set_instance_memory_limit((mapped - 1) * m.bytes_per_page, name=grp.record_name)  # below what is mapped
    assert r.status == "deferred", r  # in force for new pages
    time.sleep(0.05)  # the manager re-reads its cap at most every few ms
    step = a.alloc(tpp)
    assert step is not None and len(step) == tpp
    assert not a.check_decode_capacity(num_tokens=tpp, tree_cache=_EmptyTree())
    assert a.alloc(tpp) is None and m.stats()["reserved_blocks"] == 0
    assert set_instance_memory_limit(grp.limits.record().total, name=grp.record_name).status == "applied"
    time.sleep(0.05)
    assert a.check_decode_capacity(num_tokens=tpp, tree_cache=_EmptyTree())
    assert m.stats()["reserved_blocks"] == tpp // ps
    grp.drain()  # idle: what was set aside and not taken goes back
    assert m.stats()["reserved_blocks"] == 0
    a.free(step)
    a.free(held)


@pytest.mark.parametrize("ps", [1, 16])
def test_running_requests_over_a_lowered_limit_are_retracted_until_their_pages_fit(ps: int) -> None:
    """H200 (SGLang 0.5.17, docs/GPU.md 2026-12-05): a limit lowered under what running
    requests held took 7 s to be met: SGLang kept decoding into free slots of pages over it
    and the pages went only as the requests finished. Now, while live pages exceed the
    limit, nothing is admitted (physical capacity 0; the logical count is unchanged for the
    idle leak check) and the decode check fails for a selection of more than one request,
    so SGLang's retract loop frees requests until the pages fit; a lone request goes to
    SGLang's own check (it aborts one that fails alone). Freeing the requests' slots, as a
    retraction does (page size 1: into the spare list, drained here), ends the episode."""
    from types import SimpleNamespace

    from kvcached.control import set_instance_memory_limit
    from kvcached.integration.sglang.admission import patch_retract_to_limit

    _, ours = _pools(2032, ps)
    a = _allocator(ours, 2032, ps, True)
    grp, m = ours.kvcached_group, ours.kvcached_group.manager
    tpp = m.page_size // m.block_mem_size * ps  # tokens per kvcached page
    reqs = [a.alloc(tpp) for _ in range(3)]  # three running requests, a kvcached page each
    logical = a.available_size()
    assert not a.shrinking() and a.physical_available_size() > 0
    mapped = m.stats()["mapped_pages"]
    r = set_instance_memory_limit((mapped - 2) * m.bytes_per_page, name=grp.record_name)
    assert r.status == "deferred", r
    time.sleep(0.05)  # the manager re-reads its cap at most every few ms
    assert a.shrinking()
    assert a.physical_available_size() == 0 and a.withheld_tokens() == a.available_size() == logical

    # SGLang's check_decode_mem, patched as in the engine (a stand-in keeps the original's answer apart).
    mod = SimpleNamespace(ScheduleBatch=type("ScheduleBatch", (), {"check_decode_mem": lambda self, s=None: "sglang"}))
    patch_retract_to_limit(mod)
    batch = SimpleNamespace(token_to_kv_pool_allocator=a, reqs=[object()] * 3)
    check = mod.ScheduleBatch.check_decode_mem
    assert check(batch) is False and check(batch, [0, 1]) is False  # retract more
    assert check(batch, [0]) == "sglang"  # the last one: SGLang decides

    a.free(reqs.pop())  # retract_decode releases the least progressed requests
    a.free(reqs.pop())
    assert not a.shrinking() and check(batch, [0, 1, 2]) == "sglang"
    assert a.physical_available_size() > 0  # admission resumes under the limit
    a.free(reqs.pop())
    # A limit under one page: the padding slot's page never empties, so retracting cannot
    # meet it and must not stop admission for good (a request then runs on free slots there).
    assert set_instance_memory_limit(1, name=grp.record_name).status in ("applied", "deferred")
    time.sleep(0.05)
    assert not a.shrinking()
    assert set_instance_memory_limit(grp.limits.record().total, name=grp.record_name).status == "applied"


@pytest.mark.parametrize("ps", [1, 16])
def test_a_limit_lowered_between_prefill_admission_and_its_alloc_cannot_fail_the_alloc(ps: int) -> None:
    """The decode check's race at prefill admission: SGLang's own PrefillAdder admits a
    prefill by physical capacity (its budget from 0.5.21, the patched adder before), then
    `kvctl limit` lands before the batch's alloc_extend. Admission now sets the admitted
    tokens aside, so the alloc takes them; under the lower limit nothing more is mapped."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from kvcached.control import set_instance_memory_limit

    # The adder reads the process's server args (0.5.15: DSA context parallelism); SGLang's
    # own test kits publish them per test as well.
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))
    _, ours = _pools(2032, ps)
    a = _allocator(ours, 2032, ps, True)
    grp, m = ours.kvcached_group, ours.kvcached_group.manager
    tpp = m.page_size // m.block_mem_size * ps  # tokens per kvcached page
    held = a.alloc(2 * tpp)
    adder = PrefillAdder(ps, _EmptyTree(), a, SimpleNamespace(reqs=[]), 0.5, 1 << 20, None)
    assert adder.rem_total_tokens >= 2 * tpp  # admitted by physical capacity
    adder._update_prefill_budget(0, 2 * tpp, 16, False)
    assert m.stats()["reserved_blocks"] == 2 * tpp // ps
    mapped = m.stats()["mapped_pages"]
    r = set_instance_memory_limit((mapped - 1) * m.bytes_per_page, name=grp.record_name)
    assert r.status == "deferred", r
    time.sleep(0.05)  # the manager re-reads its cap at most every few ms
    prefill = a.alloc(2 * tpp)
    assert prefill is not None and len(prefill) == 2 * tpp
    assert m.stats()["mapped_pages"] == mapped and m.stats()["reserved_blocks"] == 0  # taken, nothing new mapped
    assert set_instance_memory_limit(grp.limits.record().total, name=grp.record_name).status == "applied"
    grp.drain()
    assert m.stats()["reserved_blocks"] == 0
    a.free(prefill)
    a.free(held)


def test_swa_composite_with_elastic_sub_allocators(monkeypatch) -> None:
    """The SWA composite (hybrid sliding-window models) over two elastic pools (SGLang 0.5.21+)."""
    from kvcached.integration.sglang.patches import SWA

    if sglang_version() not in SWA:
        pytest.skip(f"kvcached supports hybrid sliding-window models on SGLang {SWA} only")
    monkeypatch.setenv("ENABLE_KVCACHED", "1")
    from sglang.srt.mem_cache.allocator import swa as swa_mod
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from kvcached.integration.sglang import allocator as ea
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool
    from kvcached.integration.sglang.swa_allocator import ElasticSWATokenToKVPoolAllocator

    # The sglang-swa-allocators patch (applied by the kvcached_patches fixture).
    assert swa_mod.PagedTokenToKVPoolAllocator is ea.ElasticPagedTokenToKVPoolAllocator
    kw = dict(
        size=1024,
        size_swa=512,
        page_size=16,
        dtype=DT,
        head_num=ROW_HEADS,
        head_dim=ROW_DIM,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device="cpu",
    )
    pn = SWAKVPool(token_to_kv_pool_class=MHATokenToKVPool, **kw)
    po = SWAKVPool(token_to_kv_pool_class=ElasticMHATokenToKVPool, **kw)
    an = SWATokenToKVPoolAllocator(1024, 512, 16, DT, "cpu", pn, False)
    ao = ElasticSWATokenToKVPoolAllocator(1024, 512, 16, DT, "cpu", po, False)
    assert type(an) is SWATokenToKVPoolAllocator  # native pools still get SGLang's classes
    assert isinstance(ao.full_attn_allocator, ea.ElasticPagedTokenToKVPoolAllocator)
    assert isinstance(ao.swa_attn_allocator, ea.ElasticPagedTokenToKVPoolAllocator)
    for a in (an, ao):
        assert a.available_size() == 512 and a.full_available_size() == 1024
    pl = torch.tensor([0, 0])
    sl = torch.tensor([40, 20])
    last = torch.tensor([-1, -1])
    on = an.alloc_extend(pl, pl.clone(), sl, sl.clone(), last, 60)
    oo = ao.alloc_extend(pl, pl.clone(), sl, sl.clone(), last, 60)
    assert on.shape == oo.shape
    for a, o in ((an, on), (ao, oo)):
        swa = a.translate_loc_from_full_to_swa(o)
        assert bool((swa > 0).all()) and len(set(swa.tolist())) == 60
        assert [int(x) % 16 for x in o] == [i % 16 for i in range(40)] + [i % 16 for i in range(20)]
        # 40 + 20 tokens take 3 + 2 pages on each side.
        assert a.full_available_size() == 1024 - 80 and a.swa_available_size() == 512 - 80
    for a, o in ((an, on), (ao, oo)):
        a.free_group_begin()
        a.free_segments([(o[:40], 0)])
        a.free_segments([(o[40:], 0)])
        a.free_group_end()
    assert an.available_size() == ao.available_size() == 512
    assert an.full_available_size() == ao.full_available_size() == 1024


def test_swa_composite_with_sub_pools_of_different_head_sizes(monkeypatch) -> None:
    """Gemma 4's geometry: global layers of head size 64, sliding-window layers of 32
    (SGLang passes ``swa_head_dim``; the SWA sub-pool takes it). Each sub-pool is its own
    kvcached group with its own row size; buffers match SGLang's, and both sides map
    pages for what the composite hands out."""
    from kvcached.integration.sglang.patches import SWA

    if sglang_version() not in SWA:
        pytest.skip(f"kvcached supports hybrid sliding-window models on SGLang {SWA} only")
    monkeypatch.setenv("ENABLE_KVCACHED", "1")
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool
    from kvcached.integration.sglang.swa_allocator import ElasticSWATokenToKVPoolAllocator

    kw = dict(
        size=1024,
        size_swa=512,
        page_size=16,
        dtype=DT,
        head_num=ROW_HEADS,
        head_dim=2 * ROW_DIM,
        v_head_dim=2 * ROW_DIM,
        # As the configurator passes them (_UnifiedSWAHeadGeometry): without swa_v_head_dim
        # SGLang's SWA sub-pool would keep V at the global head size.
        swa_head_num=ROW_HEADS,
        swa_head_dim=ROW_DIM,
        swa_v_head_dim=ROW_DIM,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        device="cpu",
    )
    pn = SWAKVPool(token_to_kv_pool_class=MHATokenToKVPool, **kw)
    po = SWAKVPool(token_to_kv_pool_class=ElasticMHATokenToKVPool, **kw)
    for sub in ("full_kv_pool", "swa_kv_pool"):
        n, o = getattr(pn, sub), getattr(po, sub)
        assert (n.head_num, n.head_dim) == (o.head_num, o.head_dim)
        assert o.kvcached_group.row_bytes == o.head_num * o.head_dim * 2
        for layer in range(2):
            for a, b in zip(n.get_kv_buffer(layer), o.get_kv_buffer(layer)):
                assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    full, swa = po.full_kv_pool.kvcached_group, po.swa_kv_pool.kvcached_group
    assert full.group_id != swa.group_id and full.row_bytes == 2 * swa.row_bytes
    an = SWATokenToKVPoolAllocator(1024, 512, 16, DT, "cpu", pn, False)
    ao = ElasticSWATokenToKVPoolAllocator(1024, 512, 16, DT, "cpu", po, False)
    pl, sl, last = torch.tensor([0]), torch.tensor([200]), torch.tensor([-1])
    on = an.alloc_extend(pl, pl.clone(), sl, sl.clone(), last, 200)
    before = (full.manager.get_mapped_memory_size(), swa.manager.get_mapped_memory_size())
    oo = ao.alloc_extend(pl, pl.clone(), sl, sl.clone(), last, 200)
    assert on.shape == oo.shape
    assert an.full_available_size() == ao.full_available_size() and an.swa_available_size() == ao.swa_available_size()
    # 200 tokens: 64 KiB of head-64 rows per K/V buffer and layer, half that on the SWA side.
    grew = (full.manager.get_mapped_memory_size() - before[0], swa.manager.get_mapped_memory_size() - before[1])
    assert grew[0] > 0 and grew[1] > 0, grew
