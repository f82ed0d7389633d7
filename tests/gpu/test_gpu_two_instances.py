"""Two processes on one GPU, each with a pool and a limit (issue: GPU proof):
one grows while the other shrinks; the driver's cudaMemGetInfo, the shared
records and `kvctl list` agree; nothing leaks after both exit."""

from __future__ import annotations

import pytest

from kvcached import _C
from limits_helpers import Worker, kvctl, kvctl_list_json, remove_records, unique_prefix
from vmm_helpers import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

DEV = "cuda:0"
PAGE = 2 << 20
LAYERS = 2
BPP = PAGE * LAYERS * 2  # 8 MiB of device memory per kvcached page


def _device_used() -> int:
    info = _C.backend_info(DEV)
    return info["total_bytes"] - info["free_bytes"]


def _records(names):
    return {n: _C.MemInfoTracker.open(n).snapshot() for n in names}


def test_two_instances_share_one_gpu():
    prefix = unique_prefix()
    names = [prefix + "a", prefix + "b"]
    base = _device_used()
    cfg = dict(pages=128, device=DEV, page=PAGE, min_reserved=0, max_reserved=0, budget_bytes=96 * BPP, scope=prefix)
    a, b = Worker(name=names[0], **cfg), Worker(name=names[1], **cfg)
    try:
        assert a.call("alloc", n=4)["ok"] and b.call("alloc", n=4)["ok"]
        start = _device_used()
        recs = _records(names)
        mapped0 = sum(r.used + r.prealloc for r in recs.values())
        assert mapped0 == 8 * BPP

        # A grows while B shrinks, in steps; at each step the driver, the
        # records and kvctl agree on the change.
        b_held = 4
        for step in range(1, 6):
            assert a.call("alloc", n=8)["ok"]
            if b_held:
                b.call("free", n=1)
                b_held -= 1
            recs = _records(names)
            mapped = sum(r.used + r.prealloc for r in recs.values())
            assert mapped == (4 + 8 * step + b_held) * BPP
            assert _device_used() - start == mapped - mapped0
            listed = {r["name"]: r for r in kvctl_list_json() if r["name"] in names}
            assert {n: listed[n]["used"] + listed[n]["prealloc"] for n in names} == {
                n: r.used + r.prealloc for n, r in recs.items()
            }
            assert all(listed[n]["state"] == "alive" for n in names)

        # A limit below A's need: A stops growing (a miss, not a crash).
        assert kvctl("limit", names[0], str(44 * BPP)).returncode == 0
        assert not a.call("alloc", n=8)["ok"]
        assert a.call("query")["mapped"] <= 44
        # The budget (96 pages) is shared: B can take what A does not hold.
        assert b.call("alloc", n=30)["ok"]
        assert sum(r.used + r.prealloc for r in _records(names).values()) <= 96 * BPP
    finally:
        for w in (a, b):
            try:
                w.exit()
            except Exception:
                w.kill()
        remove_records(prefix)
    # Both processes are gone: their contexts, pages and zero pages with them.
    assert _device_used() - base < 64 << 20
    assert not [n for n in _C.list_mem_info_records() if n.startswith(prefix)]
