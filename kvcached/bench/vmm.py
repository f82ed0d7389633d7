"""python -m kvcached.bench vmm: map/unmap throughput through kvcached beside
the raw backend calls, in the same run, for 2 MiB and compound handles.

Paths compared per handle size:
  raw            create+map+set_access / unmap+release: the driver's limit
  raw+zero       the same, plus swapping the shared zero page out and back in
                 (the exact driver sequence kvcached runs, with no bookkeeping)
  raw+zero/layout  that sequence in kvcached's layout and order: one reservation per
                 layer and K/V, each page offset mapped in all of them before the
                 next (2 MiB handles only; one Python call per handle): what the
                 layout costs the driver, apart from kvcached's bookkeeping
  kvcached       map_to_kv_tensors / unmap_from_kv_tensors, one call per batch
  kvcached/page  one call per page offset (the PageAllocator slow path)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from typing import Callable, Dict, List, Tuple

from kvcached import _C, vmm_ops
from kvcached.bench._table import print_table

MiB = 1 << 20
GiB = 1 << 30


def _timed(fn: Callable[[], object]) -> Tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _raw(dev: str, handle: int, n: int, repeats: int, with_zero: bool) -> Tuple[List[float], List[float]]:
    b = _C.RawBackend(dev)
    va = b.reserve(handle * n, handle)
    zero = 0
    if with_zero:
        zero = b.create(handle)
        b.fill(va, handle, n, zero)
    maps, unmaps = [], []
    try:
        for _ in range(repeats):
            t, hs = _timed(lambda: b.map_pages(va, handle, n, zero))
            maps.append(t)
            t, _ = _timed(lambda: b.unmap_pages(va, handle, hs, zero))
            unmaps.append(t)
    finally:
        if with_zero:
            b.clear(va, handle, n)
            b.release(zero, handle)
        b.free_reservation(va, handle * n)
    return maps, unmaps


def _raw_layout(dev: str, handle: int, tensors: int, pages: int, repeats: int) -> Tuple[List[float], List[float]]:
    b = _C.RawBackend(dev)
    vas = [b.reserve(handle * pages, handle) for _ in range(tensors)]
    zero = b.create(handle)
    for va in vas:
        b.fill(va, handle, pages, zero)
    units = [va + p * handle for p in range(pages) for va in vas]  # page-major, as kvcached maps
    maps, unmaps = [], []
    try:
        for _ in range(repeats):
            t, hs = _timed(lambda: [b.map_pages(u, handle, 1, zero) for u in units])
            maps.append(t)
            t, _ = _timed(lambda: [b.unmap_pages(u, handle, h, zero) for u, h in zip(units, hs)])
            unmaps.append(t)
    finally:
        for va in vas:
            b.clear(va, handle, pages)
            b.free_reservation(va, handle * pages)
        b.release(zero, handle)
    return maps, unmaps


def _ours(dev: str, page: int, layers: int, pages: int, contiguous: bool, repeats: int, per_page: bool):
    _C.init_kvcached(dev, page, contiguous)
    try:
        _C.create_kv_tensors(pages * page, layers, 2, 0)
        offsets = [i * page for i in range(pages)]
        maps, unmaps = [], []
        for _ in range(repeats):
            if per_page:
                t, _ = _timed(lambda: [_C.map_to_kv_tensors([o], 0) for o in offsets])
                maps.append(t)
                t, _ = _timed(lambda: [_C.unmap_from_kv_tensors([o], 0) for o in offsets])
            else:
                t, _ = _timed(lambda: _C.map_to_kv_tensors(offsets, 0))
                maps.append(t)
                t, _ = _timed(lambda: _C.unmap_from_kv_tensors(offsets, 0))
            unmaps.append(t)
        return maps, unmaps
    finally:
        vmm_ops.shutdown_kvcached()  # warns about memory the driver would not release


def run(dev: str, page: int, layers: int, pages: int, repeats: int) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    kv = 2
    for kind, contiguous in (("2MiB" if page == 2 * MiB else f"{page // 1024}KiB", False), ("compound", True)):
        handle = page * layers * kv if contiguous else page
        handles = pages if contiguous else pages * layers * kv
        results = {
            "raw": _raw(dev, handle, handles, repeats, False),
            "raw+zero": _raw(dev, handle, handles, repeats, True),
        }
        if not contiguous:  # a compound handle spans the layers already: one reservation, as raw's
            results["raw+zero/layout"] = _raw_layout(dev, handle, layers * kv, pages, repeats)
        results["kvcached"] = _ours(dev, page, layers, pages, contiguous, repeats, False)
        results["kvcached/page"] = _ours(dev, page, layers, pages, contiguous, repeats, True)
        raw_map = statistics.median(results["raw"][0])
        raw_unmap = statistics.median(results["raw"][1])
        for path, (maps, unmaps) in results.items():
            m, u = statistics.median(maps), statistics.median(unmaps)
            rows.append(
                {
                    "handle": kind,
                    "handle_MiB": handle / MiB,
                    "path": path,
                    "handles": handles,
                    "map_us/handle": m / handles * 1e6,
                    "map_GiB/s": handles * handle / GiB / m,
                    "unmap_us/handle": u / handles * 1e6,
                    "unmap_GiB/s": handles * handle / GiB / u,
                    "map_vs_raw": raw_map / m,
                    "unmap_vs_raw": raw_unmap / u,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvcached.bench vmm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu (host backend) or cuda:N")
    p.add_argument("--page-size", type=int, default=2 * MiB)
    p.add_argument("--layers", type=int, default=None, help="default: 4 on cpu, 32 on GPU")
    p.add_argument("--pages", type=int, default=None, help="page offsets per map; default: 16 on cpu, 32 on GPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    gpu = a.device != "cpu"
    layers = a.layers or (32 if gpu else 4)
    pages = a.pages or (32 if gpu else 16)
    rows = run(a.device, a.page_size, layers, pages, a.repeats)
    info = _C.backend_info(a.device)
    meta = {
        "benchmark": "vmm",
        "device": a.device,
        "backend": info["name"],
        "host": platform.node(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "layers": layers,
        "kv_buffers": 2,
        "pages": pages,
        "repeats": a.repeats,
        "note": "medians over repeats; *_vs_raw > 1 means faster than the raw driver loop",
    }
    print_table(rows, None, a.json, meta)  # the rows' keys, in order
    return 0
