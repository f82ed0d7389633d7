"""Property-based test of KVCacheManager against a simple model, over the
real host backend (memfd pages, real mmap): random sequences of
alloc/free/reserve/resize/trim/clear/limit/deferred release/null page release, with map and
unmap failures injected at random points.

After every step: no id is out twice, none is lost, the manager's pages and
the C++ allocator and the data plane's mapping table agree, and mapped pages
== pages holding a live block + the reserve (+ emptied pages waiting for a
release marker). A failed or refused call changes nothing in the ledger.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcached import _C, vmm_ops
from kvcached.errors import BackendError, InvalidArgumentError
from kvcached.kv_cache_manager import KVCacheManager
from manager_helpers import check_invariants, out_ids, snapshot

PAGE = 64 * 1024
LAYERS = 2
TOKENS = 16

# (tokens per block, bytes per token): 4 blocks per page, 8 per page, and
# 3-ish per page with straddling blocks skipped (MLA-like rows).
GEOMETRIES = [(TOKENS, PAGE // (4 * TOKENS)), (TOKENS, PAGE // (8 * TOKENS)), (TOKENS, 1152)]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = None

    @initialize(
        geometry=st.sampled_from(GEOMETRIES),
        pages=st.integers(2, 6),
        max_reserved=st.integers(0, 3),
        defer=st.booleans(),
        null=st.booleans(),
        park=st.booleans(),
    )
    def setup(self, geometry, pages, max_reserved, defer, null, park):
        block_size, cell = geometry
        _C.clear_faults()
        if _C.is_initialized():
            vmm_ops.shutdown_kvcached()
        vmm_ops.init_kvcached("cpu", page_size=PAGE, contiguous_layout=False)
        os.environ["KVCACHED_MIN_RESERVED_PAGES"] = "0"
        os.environ["KVCACHED_MAX_RESERVED_PAGES"] = str(max_reserved)
        block = block_size * cell
        num_blocks = pages * PAGE // block
        vmm_ops.create_kv_tensors(num_blocks * block, 2, "cpu", LAYERS, 2)
        self.m = KVCacheManager(
            num_blocks,
            block_size,
            cell,
            LAYERS,
            reserve_null_block=null,
            defer_physical_release=defer,
            # Parked pages on or off; a grace far past the test, so that only the
            # rules below (trim, release_parked, limit, resize) end it: deterministic.
            empty_page_grace_s=3600.0 if park else 0,
        )
        self.live = []  # allocations the model holds, each a list of ids
        self.reserved = 0
        self.limit = -1
        self.markers = []

    def teardown(self) -> None:
        _C.clear_faults()
        if self.m is not None:
            self.m.shutdown()
        if _C.is_initialized():
            vmm_ops.shutdown_kvcached()
        os.environ.pop("KVCACHED_MIN_RESERVED_PAGES", None)
        os.environ.pop("KVCACHED_MAX_RESERVED_PAGES", None)

    # ------------------------------------------------------------- helpers

    def _model_ids(self):
        return [b for g in self.live for b in g]

    def _exact(self) -> bool:
        # Without a memory limit available_size is exact: what alloc gives.
        return self.limit < 0

    # --------------------------------------------------------------- rules

    @rule(n=st.integers(1, 40))
    def alloc(self, n):
        m = self.m
        avail = m.available_size()
        before = snapshot(m)
        reserved = m.snapshot()["reserved"]
        got = m.alloc(n)
        if got is None:
            assert n > avail or not self._exact(), f"alloc({n}) refused with {avail} available"
            assert snapshot(m) == before
            return
        assert n <= avail or not self._exact()
        assert len(got) == n and len(set(got)) == n
        assert not set(got) & set(self._model_ids())
        # Reserved ids first, then none past the resize target.
        k = min(n, len(reserved))
        assert got[:k] == reserved[:k]
        for b in got[k:]:
            assert m.get_page_id(b) < m.stats()["target_pages"]
        self.reserved -= k
        self.live.append(got)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), part=st.booleans())
    def free(self, i, part):
        g = self.live[i % len(self.live)]
        if part and len(g) > 1:
            self.m.free(g[: len(g) // 2])
            g[:] = g[len(g) // 2 :]
        else:
            self.m.free(g)
            self.live.remove(g)

    @rule(i=st.integers(0, 10**6), twice=st.booleans())
    def bad_free(self, i, twice):
        m = self.m
        before = snapshot(m)
        ids = self._model_ids()
        if ids and twice:
            b = ids[i % len(ids)]
            bad = [b, b]
        else:
            bad = [i % (m.num_blocks + 5)]
            if bad[0] in ids:
                return
        try:
            m.free(bad)
        except InvalidArgumentError:
            pass
        else:
            raise AssertionError(f"free({bad}) was accepted")
        assert snapshot(m) == before

    @rule(n=st.integers(1, 12))
    def reserve(self, n):
        before = snapshot(self.m)
        if self.m.try_to_reserve(n):
            self.reserved = max(self.reserved, n)
        else:
            assert snapshot(self.m) == before
        assert self.m.stats()["reserved_blocks"] == self.reserved

    @rule()
    def free_reserved(self):
        self.m.free_reserved()
        self.reserved = 0

    @rule(pages=st.integers(0, 6))
    def resize(self, pages):
        m = self.m
        size = min(pages, m.geometry.num_pages) * PAGE
        full = m.resize(size)
        target = m.stats()["target_pages"]
        assert full == all(pid < target for pid in m.get_page_occupancy())

    @rule()
    def trim(self):
        self.m.trim()
        assert self.m.page_allocator.get_num_reserved_pages() == 0

    @rule()
    def release_parked(self):
        n = self.m.release_parked()
        assert self.m.stats()["parked_pages"] == 0
        assert n >= 0

    @rule()
    def release_null_page(self):
        m = self.m
        held = m.null_block is not None
        live_pages = {pid for pid, n in m.get_page_occupancy().items() if n}
        only = live_pages <= {0} and not self.live and not self.reserved and not m.snapshot()["retired"]
        released = m.release_null_page()
        # Released exactly when the null block is held and nothing else is (parked pages go first).
        assert released == (held and only), (held, only)
        if released:
            assert m.null_block is None and m.page_allocator.get_num_inuse_pages() == 0

    @rule()
    def clear(self):
        self.m.clear()
        self.live = []
        self.reserved = 0

    @rule(pages=st.integers(-1, 6))
    def limit(self, pages):
        self.limit = pages
        self.m.set_mem_limit(-1 if pages < 0 else pages * self.m.bytes_per_page)

    @rule()
    def capture(self):
        self.markers.append(self.m.capture_physical_release_marker())

    @precondition(lambda self: self.markers)
    @rule(i=st.integers(0, 10**6))
    def release(self, i):
        m = self.m
        marker = self.markers[i % len(self.markers)]
        retired_before = m.snapshot()["retired"]
        n = m.release_retired_pages_through(marker)
        released = set(retired_before) - set(m.get_page_occupancy())
        assert len(released) == n
        for pid in released:
            assert retired_before[pid] <= marker

    @rule(op=st.sampled_from(["create", "map", "set_access"]), nth=st.integers(1, 6), n=st.integers(1, 40))
    def alloc_with_map_fault(self, op, nth, n):
        m = self.m
        before = snapshot(m)
        reserved = m.snapshot()["reserved"]
        _C.inject_fault(op, nth)
        try:
            got = m.alloc(n)
        except BackendError:
            after = snapshot(m)
            # The ledger is exactly as before; pages rolled back are free or in the reserve.
            for key in ("owned", "pages", "reserved", "nfree", "target", "retired", "parked", "inuse", "logical"):
                assert after[key] == before[key], key
            assert m.snapshot()["reserved"] == reserved
            return
        finally:
            _C.clear_faults()
        if got is None:
            assert snapshot(m) == before
            return
        self.reserved -= min(n, len(reserved))
        self.live.append(got)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), nth=st.integers(1, 3))
    def free_with_unmap_fault(self, i, nth):
        g = self.live.pop(i % len(self.live))
        _C.inject_fault("unmap", nth)
        try:
            self.m.free(g)  # an unmap the data plane rolled back keeps the page mapped, in the reserve
        finally:
            _C.clear_faults()

    # ---------------------------------------------------------- invariants

    @invariant()
    def ledger_matches_model(self):
        if self.m is None:
            return
        m = self.m
        ids = self._model_ids()
        assert len(ids) == len(set(ids)), "an id is out twice"
        expected = set(ids) | set(m.snapshot()["reserved"]) | (set(m.null_block or []))
        assert out_ids(m) == expected, "an id was lost or leaked"
        assert m.stats()["reserved_blocks"] == self.reserved
        check_invariants(m)
        if self.limit < 0:
            assert m.available_size() == m.logical_free_size()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=int(os.environ.get("KVCACHED_HYPOTHESIS_EXAMPLES", "120")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
