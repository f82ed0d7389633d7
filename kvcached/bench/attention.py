"""python -m kvcached.bench attention (GPU): decode attention over elastic KV
beside a native cudaMalloc'd buffer of the same layout, and the map
throughput of each layout beside the compound-handle driver limit, in one run.

Layouts:
  per-layer        one range per layer [K|V]; a page offset maps layers*2 handles
  block-outermost  one range [block][layer][kv] (vLLM's BLHNC); one compound
                   handle per page offset, any block size that divides the page
  page-major       one range [page][layer][kv] with one block per page per layer
                   (upstream's contiguous default): blocks as big as a page
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from typing import Dict, List

from kvcached.bench._table import print_table

MiB = 1 << 20
GiB = 1 << 30


def _layout_views(torch, vmm, layout, dev, layers, nb, block, kvh, d, dtype, page):
    block_bytes = block * kvh * d * torch.empty((), dtype=dtype).element_size()
    contiguous = layout != "per-layer"
    vmm.init_kvcached(dev, page_size=page, contiguous_layout=contiguous)
    t = vmm.create_kv_tensors(nb * block_bytes, dtype, dev, layers, 2, chunk_bytes=block_bytes)
    el = [(x[0].view(nb, block, kvh, d), x[1].view(nb, block, kvh, d)) for x in t]
    if contiguous:
        buf = torch.zeros(nb, layers, 2, block, kvh, d, device=dev, dtype=dtype)
        nat = [(buf[:, i, 0], buf[:, i, 1]) for i in range(layers)]
    else:
        nat = [tuple(torch.zeros(2, nb, block, kvh, d, device=dev, dtype=dtype).unbind(0)) for _ in range(layers)]
    return el, nat, block_bytes


def _raw_compound_limit(dev: str, handle: int, n: int, repeats: int) -> float:
    from kvcached import _C

    b = _C.RawBackend(dev)
    va = b.reserve(handle * n, handle)
    times = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            hs = b.map_pages(va, handle, n, 0)
            times.append(time.perf_counter() - t0)
            b.unmap_pages(va, handle, hs, 0)
    finally:
        b.free_reservation(va, handle * n)
    return handle * n / GiB / statistics.median(times)


def run(dev: str, layers: int, batch: int, seq_len: int, heads: int, kvh: int, d: int, repeats: int) -> List[Dict]:
    import torch
    import triton.testing

    from kvcached import vmm_ops as vmm
    from kvcached.bench.paged_decode import paged_decode

    dtype = torch.float16
    page = 2 * MiB
    token_bytes = kvh * d * 2
    rows = []
    limit = _raw_compound_limit(dev, page * layers * 2, 16, repeats)
    for layout, block in (("per-layer", 16), ("block-outermost", 16), ("page-major", page // token_bytes)):
        blocks_per_seq = -(-seq_len // block)
        nb = batch * blocks_per_seq
        nb = -(-nb * block * token_bytes // page) * page // (block * token_bytes)  # whole pages
        el, nat, block_bytes = _layout_views(torch, vmm, layout, dev, layers, nb, block, kvh, d, dtype, page)
        pages = nb * block_bytes // page
        try:
            offsets = [p * page for p in range(pages)]
            map_times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                vmm.map_to_kv_tensors(offsets)
                map_times.append(time.perf_counter() - t0)
                if r + 1 < repeats:
                    vmm.unmap_from_kv_tensors(offsets)
            map_gibs = pages * page * layers * 2 / GiB / statistics.median(map_times)
            gen = torch.Generator(device=dev).manual_seed(0)
            for (ke, ve), (kn, vn) in zip(el, nat):
                for src, dst in ((ke, kn), (ve, vn)):
                    src.copy_(torch.randn(src.shape, generator=gen, device=dev, dtype=dtype))
                    dst.copy_(src)
            perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1))[: batch * blocks_per_seq]
            bt = perm.view(batch, blocks_per_seq).to(torch.int32).to(dev)
            sl = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
            q = torch.randn((batch, heads, d), generator=gen, device=dev, dtype=dtype)
            ke, ve = el[layers // 2]
            kn, vn = nat[layers // 2]
            assert torch.equal(paged_decode(q, ke, ve, bt, sl), paged_decode(q, kn, vn, bt, sl))
            t_el = statistics.median(
                [
                    triton.testing.do_bench(lambda: paged_decode(q, ke, ve, bt, sl), warmup=25, rep=200)
                    for _ in range(repeats)
                ]
            )
            t_nat = statistics.median(
                [
                    triton.testing.do_bench(lambda: paged_decode(q, kn, vn, bt, sl), warmup=25, rep=200)
                    for _ in range(repeats)
                ]
            )
        finally:
            del el, nat
            vmm.shutdown_kvcached()
            torch.cuda.empty_cache()
        rows.append(
            {
                "layout": layout,
                "block_tokens": block,
                "pages": pages,
                "mappings/page": layers * 2 if layout == "per-layer" else 1,
                "attn_elastic_us": t_el * 1e3,
                "attn_native_us": t_nat * 1e3,
                "attn_native/elastic": t_nat / t_el,
                "map_GiB/s": map_gibs,
                "compound_limit_GiB/s": limit,
                "map_vs_limit": map_gibs / limit,
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvcached.bench attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.device == "cpu":
        p.error("this benchmark needs a GPU (Triton kernel); use --device cuda:N")
    rows = run(a.device, a.layers, a.batch, a.seq_len, a.heads, a.kv_heads, a.head_dim, a.repeats)
    import torch

    meta = {
        "benchmark": "attention",
        "device": torch.cuda.get_device_name(a.device),
        "host": platform.node(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "workload": (
            f"decode, batch {a.batch} x {a.seq_len} tokens, {a.heads} heads / {a.kv_heads} KV heads "
            f"x {a.head_dim}, fp16, {a.layers} layers"
        ),
        "note": (
            "attn_native/elastic >= 0.98 is within 2%; "
            "map_vs_limit compares to raw create+map+access of compound handles"
        ),
    }
    print_table(rows, None, a.json, meta)  # the rows' keys, in order
    return 0
