"""--enable-hierarchical-cache with kvcached: SGLang's own HiCacheController (patched by
kvcached) submits host<->device copies over the real elastic pool and allocator; a page
under a copy in flight stays mapped until the copy's finish event completes.

SGLang's CPU build cannot run the hierarchical cache at all (with or without kvcached):
its host pool registers its buffer with CUDA (``cudaHostRegister``) and its copy kernels
are sgl_kernel's CUDA/XPU ones. So the controller's real ``write``/``start_writing``/
``load``/``start_loading`` run here with the device streams, events, copy engine and host
pool replaced by stand-ins whose completion the test decides; everything kvcached does
(the holds, the allocator's frees, the manager's pages, the release fence) is real.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import SimpleNamespace
from typing import List

import pytest
import torch

pytestmark = pytest.mark.usefixtures("unit_kvcached_env")

DT = torch.float16
PS = 16  # SGLang page: 2 per kvcached page of the unit env


class FakeEvent:
    """A device event whose completion the test decides (``record`` starts a pending one)."""

    made: List[FakeEvent] = []

    def __init__(self, *a, **k) -> None:
        self.done = True
        FakeEvent.made.append(self)

    def record(self, *a) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def wait(self, *a) -> None:
        return None


def finish_all() -> None:
    for ev in FakeEvent.made:
        ev.done = True


class FakeDeviceModule:
    Event = FakeEvent

    @staticmethod
    def Stream():  # noqa: N802
        return SimpleNamespace(wait_stream=lambda *a: None)

    @staticmethod
    def stream(_s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return SimpleNamespace(wait_event=lambda *a: None, wait_stream=lambda *a: None)


class FakeCopyEngine:
    """0.5.23's L2TransferEngine: submits return a completion with a pending finish event."""

    def _completion(self):
        start, finish = FakeEvent(), FakeEvent()
        finish.record()
        return SimpleNamespace(start_event=start, finish_event=finish, timing_enabled=False)

    def submit_device_to_host(self, transfers):
        return self._completion()

    def submit_host_to_device(self, transfers, start_event=None, on_layer_done=None, transfer_layer_id_max=None):
        return self._completion()


class FakeHostPool:
    layout = "layer_first"
    size_per_token = 1

    def __init__(self) -> None:
        self.next = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out

    def free(self, idx) -> int:
        return len(idx)

    def backup_from_device_all_layer(self, *a, **k) -> None:
        return None

    def load_to_device_per_layer(self, *a, **k) -> None:
        return None


@pytest.fixture
def rig(monkeypatch, kvcached_patches):
    """(controller, allocator, manager, group): SGLang's HiCacheController, patched by kvcached,
    over an elastic MHA pool and paged allocator."""
    import sglang.srt.managers.cache_controller as cc

    from kvcached.integration.patch_base import WRAPPED
    from kvcached.integration.sglang import hicache
    from kvcached.integration.sglang.allocator import ElasticPagedTokenToKVPoolAllocator
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool

    assert getattr(cc.HiCacheController.start_writing, WRAPPED, None) is not None, "sglang-hicache not applied"
    monkeypatch.setattr(cc, "device_module", FakeDeviceModule)
    FakeEvent.made.clear()
    pool = ElasticMHATokenToKVPool(
        2032, page_size=PS, dtype=DT, head_num=2, head_dim=32, layer_num=2, device="cpu", enable_memory_saver=False
    )
    alloc = ElasticPagedTokenToKVPoolAllocator(2032, PS, DT, "cpu", pool, False)
    c = object.__new__(cc.HiCacheController)
    attrs = dict(
        mem_pool_device_allocator=alloc,
        mem_pool_device=pool,
        mem_pool_host=FakeHostPool(),
        page_size=PS,
        io_backend="direct",
        has_draft=False,
        device="cpu",
        layer_num=2,
        write_queue=[],
        load_queue=[],
        ack_write_queue=[],
        ack_load_queue=[],
        write_stream=FakeDeviceModule.Stream(),
        load_stream=FakeDeviceModule.Stream(),
        write_fence_stream=None,
        load_fence_stream=None,
        l2_transfer_engine=FakeCopyEngine(),
        transfer_layer_id_max=None,
        layer_done_counter=cc.LayerDoneCounter(2),
    )
    for k, v in attrs.items():
        setattr(c, k, v)
    hicache.attach(c)
    assert alloc.kvcached_transfers is not None
    return c, alloc, pool.kvcached_group.manager, pool.kvcached_group


def test_a_page_under_a_write_stays_mapped_until_the_copy_finishes(rig) -> None:
    from kvcached.integration.sglang.scheduler_hooks import poll_allocator

    c, alloc, m, grp = rig
    base, free0 = m.stats()["mapped_pages"], alloc.available_size()
    slots = alloc.alloc(PS * 40)  # 40 SGLang pages = 20 kvcached pages
    assert m.stats()["mapped_pages"] == base + 20
    assert c.write(slots) is not None  # SGLang's write -> start_writing: one copy in flight
    assert len(c.ack_write_queue) == 1 and alloc.kvcached_transfers.in_flight == 1
    alloc.free(slots)  # the radix cache evicts the node (or a flush of the tree) while it copies
    assert alloc.available_size() == free0  # free in SGLang's count (its idle check stays exact)
    assert m.stats()["retired_pages"] == 0  # nothing emptied: the pages stay mapped
    assert grp.release_all_retired() == 0 and m.stats()["mapped_pages"] == base + 20
    assert alloc.physical_available_size() <= m.available_size() * PS  # and cannot be handed out
    poll_allocator(alloc)  # a batch result: the copy has not finished
    assert m.stats()["mapped_pages"] == base + 20
    finish_all()  # the copy's finish event completes
    poll_allocator(alloc)
    assert alloc.kvcached_transfers.in_flight == 0
    assert m.stats()["retired_pages"] == 20  # now the pages empty, and pass the step fence
    assert grp.release_all_retired() == 20 and m.stats()["mapped_pages"] == base
    assert alloc.available_size() == free0


def test_a_free_after_the_copy_finished_goes_straight_through(rig) -> None:
    c, alloc, m, grp = rig
    base = m.stats()["mapped_pages"]
    slots = alloc.alloc(PS * 8)
    c.write(slots)
    finish_all()  # the radix cache saw the ack, then evicts: no deferral
    alloc.free(slots)
    assert alloc.kvcached_transfers.holds.stats.deferred_frees == 0
    assert grp.release_all_retired() == 4 and m.stats()["mapped_pages"] == base


def test_a_load_holds_the_slots_it_writes(rig) -> None:
    c, alloc, m, grp = rig
    base = m.stats()["mapped_pages"]
    dev = c.load(torch.arange(PS * 8, dtype=torch.int64))  # SGLang's load: device slots from kvcached
    assert dev is not None and m.stats()["mapped_pages"] == base + 4
    c.start_loading()
    assert len(c.ack_load_queue) == 1 and alloc.kvcached_transfers.in_flight == 1
    alloc.free(dev)  # e.g. the request is aborted while its prefix loads
    assert grp.release_all_retired() == 0 and m.stats()["mapped_pages"] == base + 4
    finish_all()
    alloc.free(alloc.alloc(PS))  # any later free polls the copies first
    assert grp.release_all_retired() >= 4 and m.stats()["mapped_pages"] == base


def test_a_copy_that_never_finishes_keeps_its_pages_and_is_named_once(rig, monkeypatch, caplog) -> None:
    c, alloc, m, grp = rig
    alloc.kvcached_transfers.holds.timeout_s = 0.05  # KVCACHED_TRANSFER_TIMEOUT
    base = m.stats()["mapped_pages"]
    slots = alloc.alloc(PS * 8)
    c.write(slots)
    alloc.free(slots)
    time.sleep(0.1)
    with caplog.at_level(logging.ERROR, logger="kvcached.elastic"):
        for _ in range(3):
            alloc.kvcached_transfers.poll()
    lines = [r for r in caplog.records if "KVCACHED_TRANSFER_TIMEOUT" in r.getMessage()]
    assert len(lines) == 1
    assert grp.release_all_retired() == 0 and m.stats()["mapped_pages"] == base + 4  # fail closed


def test_a_flush_waits_for_the_copies_in_flight(rig) -> None:
    c, alloc, m, grp = rig
    slots = alloc.alloc(PS * 8)
    c.write(slots)
    ev = c.ack_write_queue[-1].finish_event
    assert not ev.query()
    alloc.clear()  # flush_cache: SGLang clears its ack queues without waiting; kvcached waits
    assert ev.query() and alloc.kvcached_transfers.in_flight == 0


def test_server_args_accept_the_hierarchical_cache_with_a_host_size(kvcached_patches) -> None:
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    from kvcached.integration.sglang.conflicts import UnsupportedConfigurationError, server_args_conflicts

    if dataclasses.is_dataclass(ServerArgs) and "hicache_size" not in {f.name for f in dataclasses.fields(ServerArgs)}:
        pytest.skip("no --hicache-size in this release")

    def conflicts_of(**kw):
        try:
            args = ServerArgs(model_path="dummy", device="cpu", **kw)
        except UnsupportedConfigurationError as e:
            return [e]
        return server_args_conflicts(args)

    found = conflicts_of(enable_hierarchical_cache=True)
    assert len(found) == 1 and "--hicache-size" in str(found[0])
    assert conflicts_of(enable_hierarchical_cache=True, hicache_size=4) == []
