"""A kvcached instance in its own process, for the limits tests.

    python tests/helpers/limits_worker.py '<json config>'

Config: name, pages (virtual pages per K/V buffer), budget_bytes (0: no device
budget), scope, min_reserved, max_reserved, device (default "cpu"), page
(default 64 KiB). It creates KV tensors on that device, a PageAllocator and InstanceLimits, prints one JSON line
{"ready": ...}, then serves one JSON command per stdin line and answers one
JSON line each:

  {"op": "alloc", "n": N}      reserve + alloc_pages; {"ok": bool, "ids": [...]}
  {"op": "free", "n": N}       frees the N most recent pages
  {"op": "query"}              counters and the allocator's cap
  {"op": "short", "need": B}   note_shortage(B); {"published": bool}
  {"op": "clear"}              clear_want()
  {"op": "churn", "seconds": S, "seed": K, "max_pages": M}
                               random alloc/free for S seconds; returns stats
  {"op": "exit"}               clean shutdown (the record is unlinked)
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvcached import _C
from kvcached.errors import OutOfMemoryError
from kvcached.limits import DeviceBudget, InstanceLimits

PAGE = 64 * 1024
LAYERS = 2


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pages = int(cfg.get("pages", 32))
    device = cfg.get("device", "cpu")
    page = int(cfg.get("page", PAGE))
    _C.init_kvcached(device, page, False)
    _C.create_kv_tensors(pages * page, LAYERS, 2, 0)
    pa = _C.PageAllocator(
        LAYERS,
        pages * page,
        page,
        min_reserved=int(cfg.get("min_reserved", 0)),
        max_reserved=int(cfg.get("max_reserved", 2)),
    )
    budget = None
    if cfg.get("budget_bytes"):
        budget = DeviceBudget(device, int(cfg["budget_bytes"]), scope=cfg.get("scope", ""))
    limits = InstanceLimits.for_page_allocator(
        pa,
        engine="test",
        device=device,
        name=cfg["name"],
        budget=budget,
        limit_bytes=cfg.get("limit_bytes"),
        quantum_bytes=cfg.get("quantum_bytes"),
    )
    held: list = []

    def alloc(n: int) -> bool:
        try:
            limits.admit_pages(n)
            held.extend(pa.alloc_pages(n))
            return True
        except OutOfMemoryError:
            return False

    def free(n: int) -> None:
        n = min(n, len(held))
        if n:
            ids = [held.pop() for _ in range(n)]
            pa.free_pages(ids)
            limits.on_free()

    def query() -> dict:
        return {
            "pid": _pid(),
            "name": limits.name,
            "mapped": pa.get_num_mapped_pages(),
            "inuse": pa.get_num_inuse_pages(),
            "reserved": pa.get_num_reserved_pages(),
            "mem_limit": pa.mem_limit(),
            "cap": limits.cap,
            "limit": limits.limit,
            "applied_revision": limits.applied_revision,
            "bpp": pa.bytes_per_page,
            "held": list(held),
            "mapped_offsets": sorted(_C.mapped_offsets()),
        }

    print(json.dumps({"ready": query()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "alloc":
            ok = alloc(int(cmd["n"]))
            out = {"ok": ok, "ids": held[-int(cmd["n"]) :] if ok else []}
        elif op == "free":
            free(int(cmd["n"]))
            out = {"ok": True}
        elif op == "query":
            out = query()
        elif op == "short":
            out = {"published": limits.note_shortage(int(cmd.get("need", 0)))}
        elif op == "clear":
            limits.clear_want()
            out = {"ok": True}
        elif op == "churn":
            rng = random.Random(int(cmd["seed"]))
            end = time.monotonic() + float(cmd["seconds"])
            stats = {"allocs": 0, "misses": 0, "frees": 0, "max_held": 0}
            while time.monotonic() < end:
                # Bias to grow until near max_pages, then to shrink: both paths run.
                grow = rng.random() < (0.7 if len(held) < int(cmd["max_pages"]) else 0.2)
                if grow:
                    if alloc(rng.randint(1, 4)):
                        stats["allocs"] += 1
                    else:
                        stats["misses"] += 1
                        free(rng.randint(1, 3))  # a scheduler preempts on a miss
                else:
                    free(rng.randint(1, 4))
                    stats["frees"] += 1
                stats["max_held"] = max(stats["max_held"], len(held))
                time.sleep(0.0005)
            out = stats
        elif op == "exit":
            free(len(held))
            limits.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)


def _pid() -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    main()
