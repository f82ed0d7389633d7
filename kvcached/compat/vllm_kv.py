"""vLLM KV views that only upstream's ``alloc_kv_cache`` arguments ask for.

* ``kernel_block_size``: vLLM may split a block of ``block_size`` tokens into
  ``block_size // kernel_block_size`` kernel blocks; the views are then
  indexed by kernel block, ``(2, N * r, kernel_block_size, heads, head_dim)``.
  A block's bytes stay where the manager expects them, so a strided view
  exists only where kernel blocks are evenly spaced: NHD in the per-layer
  layout (FlashInfer's shape then keeps K and V in separate halves, as
  upstream's does). Anything else is refused, naming the fix.
* ``attention_type="HYBRID_LINEAR"``: one buffer per layer with K and V
  interleaved per kernel block (``[kb: K | V]``), so a linear-attention
  (mamba) layer can read the same bytes per virtual block. Returns
  ``(views, raw_info)`` as upstream.
* ``return_meta``: the raw buffers and sizes ``build_kv_views`` needs to cut
  another group's views over the same memory (heterogeneous models).

Byte layout per layer (``S``: bytes of one K/V buffer), per-layer ranges:
K block ``b`` at ``b * blk``, V at ``S + b * blk``; contiguous (compound)
ranges: chunk ``c`` of layer ``i`` at ``(c * layers + i) * chunk`` with the
chunk the block (or, hybrid, the K+V kernel block).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvcached import _C, kv_views, vmm_ops
from kvcached.errors import InvalidArgumentError

HYBRID = "HYBRID_LINEAR"


class Shape:
    """A vLLM kvcache_shape read: form, blocks, tokens per block, per-token dims."""

    def __init__(self, kvcache_shape: Sequence[int], block_size: int, attention_type: str) -> None:
        shape = kv_views._positive_shape(kvcache_shape, "kvcache_shape")
        self.atype = str(attention_type).upper()
        if self.atype not in ("MHA", "GQA", "MLA", HYBRID):
            raise InvalidArgumentError(f"attention_type {attention_type!r} is not one of MHA, GQA, MLA, {HYBRID}")
        if self.atype == "MLA":
            if len(shape) != 3:
                raise InvalidArgumentError(f"MLA expects (num_blocks, block_size, head_dim), got {shape}")
            self.form, (self.num_blocks, bs), self.token = "mla", shape[:2], shape[2:]
        else:
            if len(shape) != 5 or 2 not in shape[:2]:
                raise InvalidArgumentError(
                    f"{self.atype} expects (2, num_blocks, block_size, heads, head_dim) or "
                    f"(num_blocks, 2, block_size, heads, head_dim), got {shape}"
                )
            self.form = "kv_major" if shape[0] == 2 else "kv_inner"
            self.num_blocks = shape[1] if self.form == "kv_major" else shape[0]
            bs, self.token = shape[2], shape[3:]
        if bs != int(block_size):
            raise InvalidArgumentError(
                f"block_size {block_size} does not match the block dimension {bs} of kvcache_shape"
            )
        self.block_size = bs
        self.token_elems = math.prod(self.token)

    def ratio(self, kernel_block_size: Optional[int]) -> int:
        k = self.block_size if kernel_block_size is None else int(kernel_block_size)
        if k <= 0 or self.block_size % k:
            raise InvalidArgumentError(
                f"block_size ({self.block_size}) must be a multiple of kernel_block_size ({kernel_block_size})"
            )
        return self.block_size // k


def views(
    raw: List[Any],
    shp: Shape,
    ratio: int,
    dtype: Any,
    num_blocks: int,
    buffer_bytes: int,
    num_layers: int,
    contiguous: bool,
) -> List[Any]:
    """Per-layer views of ``shp`` at kernel-block granularity over the group's raw ranges."""
    import torch

    item = kv_views._itemsize(dtype)
    kbs = shp.block_size // ratio
    kernel = kbs * shp.token_elems  # elements of one kernel block of K (or V)
    tok = [shp.token_elems // shp.token[0], 1] if len(shp.token) == 2 else [1]
    n = num_blocks * ratio
    if shp.atype == HYBRID:  # [kb: K | V] per kernel block
        if contiguous:
            step, base = num_layers * 2 * kernel, [i * 2 * kernel for i in range(num_layers)]
            flat = [raw[0].view(dtype)] * num_layers
        else:
            step, base, flat = 2 * kernel, [0] * num_layers, [t.view(dtype) for t in raw]
        if shp.form == "kv_major":
            size, stride = (2, n, kbs, *shp.token), (kernel, step, *([shp.token_elems] + tok))
        else:
            size, stride = (n, 2, kbs, *shp.token), (step, kernel, *([shp.token_elems] + tok))
        return [torch.as_strided(f, size, stride, b) for f, b in zip(flat, base)]
    kv = 1 if shp.form == "mla" else 2
    if contiguous:
        if ratio > 1:
            raise InvalidArgumentError(
                f"kernel_block_size {kbs} != block_size {shp.block_size} needs the per-layer layout: "
                "set KVCACHED_CONTIGUOUS_LAYOUT=false"
            )
        # Chunk = one block: block b of layer i, buffer k at (b * layers * kv + i * kv + k) * block.
        v_step, b_step = kernel, num_layers * kv * kernel
        flat, base = [raw[0].view(dtype)] * num_layers, [i * kv * kernel for i in range(num_layers)]
    else:
        v_step, b_step = buffer_bytes // item, kernel
        flat, base = [t.view(dtype) for t in raw], [0] * num_layers
    if shp.form == "mla":
        size, stride = (n, kbs, *shp.token), (b_step, shp.token_elems, *tok)
    elif shp.form == "kv_major":
        size, stride = (2, n, kbs, *shp.token), (v_step, b_step, shp.token_elems, *tok)
    else:
        size, stride = (n, 2, kbs, *shp.token), (b_step, v_step, shp.token_elems, *tok)
    return [torch.as_strided(f, size, stride, b) for f, b in zip(flat, base)]


def alloc(
    kvcache_shape: Sequence[int],
    block_size: int,
    dtype: Any,
    device: str,
    num_layers: int,
    attention_type: str,
    kv_layout: str,
    group_id: int,
    kernel_block_size: Optional[int],
) -> Tuple[List[Any], int, int, int, Optional[Dict[str, Any]]]:
    """The cases ``kv_views.vllm_views`` does not cover (ratio > 1, hybrid).

    Returns (views, num_kv_buffers, block_mem_size, num_blocks, raw_info or None).
    """
    shp = Shape(kvcache_shape, block_size, attention_type)
    ratio = shp.ratio(kernel_block_size)
    if str(kv_layout).upper() != "NHD":
        raise InvalidArgumentError(
            f"kv_layout {kv_layout!r} with kernel_block_size or {HYBRID}: only NHD keeps kernel blocks evenly spaced"
        )
    item = kv_views._itemsize(dtype)
    block = shp.block_size * shp.token_elems * item  # one block of K (or V)
    contiguous = bool(_C.config()["contiguous_layout"])
    n = shp.num_blocks
    if shp.atype == HYBRID:
        kv, unit_bytes, units = 1, 2 * block // ratio, n * ratio  # a kernel block of K and V
        kv_views.check_block_geometry(n, shp.block_size, 2 * block // shp.block_size)
    else:
        kv = 1 if shp.form == "mla" else 2
        unit_bytes, units = block, n
        kv_views.check_block_geometry(n, shp.block_size, block // shp.block_size)
    kv_views.unit_views(units, unit_bytes, kv, dtype, device, num_layers, group_id)
    raw = vmm_ops.get_raw_kv_tensors(group_id)
    buffer_bytes = int(_C.group_info(group_id)["buffer_size"])
    out = views(raw, shp, ratio, dtype, n, buffer_bytes, num_layers, contiguous)
    block_mem = block * (2 if shp.atype == HYBRID else 1)
    info = None
    if shp.atype == HYBRID:
        info = {
            "buffers": [raw[0].view(_int8())] if contiguous else [t.view(_int8())[: n * block_mem] for t in raw],
            "num_blocks": n,
            "page_size_bytes": block_mem,
            "block_stride_bytes": num_layers * block_mem if contiguous else block_mem,
            "num_pools": num_layers,
            "is_contiguous": contiguous,
        }
    return out, kv, block_mem, n, info


def meta(group_id: int, num_blocks: int, num_layers: int, dtype: Any) -> Dict[str, Any]:
    """What ``build_kv_views`` needs to cut another group's views over this group's memory."""
    return {
        "raw_kv_tensors": vmm_ops.get_raw_kv_tensors(group_id),
        "num_blocks_per_layer": num_blocks,
        "gpu_mem_bytes_per_layer_k_or_v": int(_C.group_info(group_id)["buffer_size"]),
        "num_layers": num_layers,
        "dtype": dtype,
    }


def _int8() -> Any:
    import torch

    return torch.int8
