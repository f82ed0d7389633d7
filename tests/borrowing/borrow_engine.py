"""An engine with a prefix cache in its own process, for tests/borrowing/test_borrow.py.

    python tests/borrowing/borrow_engine.py '<json config>'

Config: name, scope, budget_bytes, blocks (default 256), quantum_bytes. It runs
the engine-neutral elastic runtime as the engine adapters do: a KVCacheManager
(host backend, 4 blocks of 32 KiB per 128 KiB page, 2 layers, one buffer: 256
KiB of budget per page) with its own record in a scoped device budget, an
ElasticInstance, and an IdleWatcher whose actions run on the engine thread,
vLLM's ``idle_return_memory`` in small: on a peer's want evict the whole
cache and give back, over a lowered limit evict cached pages down to it; one
log line per give-back. Requests:

  {"op": "cache", "pages": N}  requests of N pages in all ran and finished: their blocks stay as prefix cache
  {"op": "run", "pages": N}    N pages of blocks held by running requests (the engine is busy while any run)
  {"op": "step"}               one decode step: every running request takes one more block; a request
                               that cannot get one is preempted (its blocks freed), as vLLM's scheduler does
  {"op": "finish"}             every running request ends (blocks freed, not cached)
  {"op": "query"}              mapped pages, blocks cached / running, give-backs, preemptions
  {"op": "exit"}

One JSON answer per request; the engine thread serves requests and idle actions in turn.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading

from kvcached import _C
from kvcached.elastic import ElasticInstance, ElasticPool, IdleAction
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.limits import DeviceBudget, InstanceLimits

KiB = 1 << 10
PAGE = 128 * KiB
BLOCKS_PER_PAGE = 4


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(message)s")
    blocks = int(cfg.get("blocks", 256))
    _C.init_kvcached("cpu", PAGE, False)
    _C.create_kv_tensors(blocks * 32 * KiB, 2, 1, 0)
    budget = DeviceBudget("cpu", int(cfg["budget_bytes"]), scope=cfg["scope"])

    def limits(pa):  # noqa: ANN001, ANN202
        return InstanceLimits.for_page_allocator(
            pa, engine="test", device="cpu", name=cfg["name"], budget=budget, quantum_bytes=cfg.get("quantum_bytes")
        )

    m = KVCacheManager(
        blocks, 16, 2 * KiB, 2, reserve_null_block=True, num_kv_buffers=1, defer_physical_release=True, limits=limits
    )
    pool = ElasticPool(m)
    inst = ElasticInstance(cfg["name"], [pool])
    cached: list = []  # block ids of finished requests, kept as prefix cache
    running: list = []  # one list of block ids per running request
    counts = {"give_backs": 0, "given_pages": 0, "preempted": 0}
    work: queue.Queue = queue.Queue()
    log = logging.getLogger("borrow_engine")

    def query() -> dict:
        return {
            "name": pool.name,
            "mapped": pool.mapped_pages(),
            "cached": len(cached),
            "running": sum(map(len, running)),
            "bpp": pool.bytes_per_page,
            "limit": pool.limits.limit,
            **counts,
        }

    def alloc(n_blocks: int):  # noqa: ANN202
        return m.alloc(n_blocks) if n_blocks > 0 else []

    def idle(act: IdleAction) -> None:
        before = pool.mapped_pages()
        if act & IdleAction.GIVE_TO_PEERS:
            m.free(cached)
            cached.clear()
        elif act & IdleAction.SHRINK_TO_LIMIT:
            while cached and pool.pages_over_limit() > 0:
                m.free(cached[-BLOCKS_PER_PAGE:])
                del cached[-BLOCKS_PER_PAGE:]
        inst.give_back()
        given = before - pool.mapped_pages()
        if given > 0:
            counts["give_backs"] += 1
            counts["given_pages"] += given
            why = "wanted by a peer" if act & IdleAction.GIVE_TO_PEERS else "over its limit"
            log.info("kvcached: idle %s gave back %d of %d mapped pages (%s)", pool.name, given, before, why)

    def handle(cmd: dict) -> dict:
        op = cmd["op"]
        if op == "cache":
            ids = alloc(int(cmd["pages"]) * BLOCKS_PER_PAGE)
            if ids is None:
                return {"ok": False}
            cached.extend(ids)
        elif op == "run":
            ids = alloc(int(cmd["pages"]) * BLOCKS_PER_PAGE)
            if ids is None:
                return {"ok": False}
            running.append(ids)
        elif op == "step":
            for req in list(running):
                got = alloc(1)
                if got is None:  # preempt the newest request, as vLLM does
                    victim = running.pop()
                    m.free(victim)
                    counts["preempted"] += 1
                    if victim is req:
                        continue
                    got = alloc(1)
                if got is not None:
                    req.extend(got)
            inst.fence.idle()  # the step finished: emptied pages go
            pool.limits.on_free()
        elif op == "finish":
            for req in running:
                m.free(req)
            running.clear()
            inst.fence.idle()
        elif op == "exit":
            inst.close()
            m.shutdown()
            return {"ok": True, "exit": True}
        return {"ok": True, **query()}

    def engine_loop() -> None:
        while True:
            kind, item = work.get()
            if kind == "idle":
                try:
                    idle(item)
                finally:
                    watcher.done()
                continue
            out = handle(item)
            print(json.dumps(out), flush=True)
            if out.get("exit"):
                return

    watcher = inst.start_idle_watch(
        busy=lambda: bool(running), has_memory=lambda: pool.mapped_pages() > 0, schedule=lambda a: work.put(("idle", a))
    )
    t = threading.Thread(target=engine_loop, daemon=True)
    t.start()
    print(json.dumps({"ready": query()}), flush=True)
    for line in sys.stdin:
        work.put(("cmd", json.loads(line)))
        if json.loads(line)["op"] == "exit":
            break
    else:
        work.put(("cmd", {"op": "exit"}))  # stdin closed: shut down as on "exit"
    t.join(30)


if __name__ == "__main__":
    main()
