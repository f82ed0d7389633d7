"""Upstream kvcached's controller (its sleep manager and traffic monitor, copied
unchanged into tests/compat_upstream/) imported and run against this package.

The controller's only kvcached import is ``kvcached.utils.get_kvcached_logger``;
it talks to engines over vLLM's sleep API. Here that API is served by a small
HTTP endpoint whose sleep and wake-up are kvcached's own limit calls on a real
pool (``kvcached.control.set_instance_memory_limit``, upstream's call), so the
controller putting a model to sleep really returns its KV memory.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from repo_paths import TESTS

aiohttp = pytest.importorskip("aiohttp", reason="upstream's controller needs aiohttp (a test dependency)")
from aiohttp import web  # noqa: E402

from kvcached import control, pool_registry, vmm_ops  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager  # noqa: E402
from kvcached.limits.records import read_record  # noqa: E402

CONTROLLER = os.path.join(TESTS, "compat_upstream", "controller")


@pytest.fixture
def upstream_controller(monkeypatch):
    monkeypatch.syspath_prepend(CONTROLLER)  # upstream imports its siblings by bare name
    for mod in ("sleep_manager", "traffic_monitor"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    import sleep_manager
    import traffic_monitor

    assert sleep_manager.__file__.startswith(CONTROLLER)
    return sleep_manager, traffic_monitor


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    pool_registry.clear_registered_kv_cache_pools()
    vmm_ops.init_kvcached("cpu", page_size=64 << 10, contiguous_layout=False)
    vmm_ops.create_kv_tensors(64 * 4096, 2, "cpu", num_layers=2)
    m = KVCacheManager(64, 16, 256, 2, reserve_null_block=True, pool_name="m1", empty_page_grace_s=0)
    yield m
    m.shutdown()
    vmm_ops.shutdown_kvcached()


async def _serve_sleep_api(capacity: int):
    """vLLM's /sleep, /wake_up and /is_sleeping over this process's kvcached pools."""
    state = {"revision": 0, "sleeping": False}

    async def limit(nbytes: int) -> web.Response:
        state["revision"] += 1
        r = control.set_instance_memory_limit(nbytes, revision=state["revision"])
        ok = r["status"] in ("applied", "deferred")
        return web.json_response(dict(r), status=200 if ok else 500)

    async def sleep(request: web.Request) -> web.Response:
        body = await request.json()
        assert body == {"level": "1"}  # what upstream's controller sends
        state["sleeping"] = True
        return await limit(0)

    async def wake_up(request: web.Request) -> web.Response:
        state["sleeping"] = False
        return await limit(capacity)

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": state["sleeping"]})

    app = web.Application()
    app.add_routes([web.post("/sleep", sleep), web.post("/wake_up", wake_up), web.get("/is_sleeping", is_sleeping)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def test_upstream_sleep_manager_puts_a_kvcached_pool_to_sleep(upstream_controller, pool):
    sleep_manager, traffic_monitor = upstream_controller
    m = pool
    capacity = m.geometry.num_pages * m.bytes_per_page

    async def scenario() -> None:
        runner, port = await _serve_sleep_api(capacity)
        try:
            monitor = traffic_monitor.TrafficMonitor()
            cfg = sleep_manager.SleepConfig(idle_threshold_seconds=-1, min_sleep_duration=0)
            sm = sleep_manager.SleepManager(cfg, traffic_monitor=monitor)
            sm.add_vllm_model("m1", "127.0.0.1", str(port))
            await sm.start()
            req = monitor.record_request_start("m1", "/v1/completions")
            ids = m.alloc(40)  # the request's KV: three pages
            monitor.record_request_end(req)
            m.free(ids)
            assert m.get_mapped_memory_size() > 0  # the null block's page, at least
            assert sm.get_sleep_candidates() == ["m1"]
            assert await sm.put_model_to_sleep("m1", manual=True)
            assert sm.is_model_sleeping("m1") and await sm.check_model_sleep_status("m1") is True
            assert read_record(m.limits.name).limit == 0  # kvctl list shows it
            # Only the null block's page stays (a live block); nothing new is mapped.
            assert m.get_mapped_memory_size() == m.bytes_per_page and m.alloc(16) is None
            assert await sm.put_model_to_sleep("m1") is False  # already sleeping
            assert await sm.wakeup_model("m1")
            assert read_record(m.limits.name).limit == capacity and len(m.alloc(20)) == 20
            await sm.stop()
        finally:
            await runner.cleanup()
        # The engine gone: the controller reports failure (through kvcached's logger), nothing changes.
        sm.add_vllm_model("m2", "127.0.0.1", str(port))
        assert await sm.put_model_to_sleep("m2") is False and not sm.is_model_sleeping("m2")

    asyncio.run(scenario())
