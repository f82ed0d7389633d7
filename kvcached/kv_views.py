"""Engine-shaped KV tensors as views over kvcached's FTensors.

The data plane gives, per layer, ``num_kv_buffers`` buffers at stable
virtual addresses. An engine wants its own shape on top: vLLM a block-major
5-D tensor (or 3-D for MLA), SGLang one token-major buffer for K and one for
V. These views never copy and never move; the bytes of engine block ``b``
(``unit`` here: a block for vLLM, a token for SGLang) are at byte
``b * unit_bytes`` of its layer's K/V buffer in the per-layer layout, which
is exactly where KVCacheManager expects them, so a block handed out by the
manager lies inside one mapped page. In the contiguous (compound) layout the
interleave unit is the engine unit, so the same holds per compound page.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from kvcached import _C, vmm_ops
from kvcached.block_geometry import BlockGeometry
from kvcached.errors import InvalidArgumentError


def _itemsize(dtype) -> int:
    import torch

    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _positive_shape(shape: Sequence[int], what: str) -> Tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a tuple of positive integers, got {shape!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise InvalidArgumentError(f"{what} must be a tuple of positive integers, got {shape!r}")
    return dims


def check_block_geometry(num_blocks: int, block_tokens: int, token_bytes: int) -> BlockGeometry:
    """Refuses (with a geometry that works) blocks that cannot sit on kvcached pages."""
    return BlockGeometry(num_blocks, block_tokens, token_bytes, _C.config()["page_size"])


def unit_views(
    num_units: int,
    unit_bytes: int,
    num_kv_buffers: int,
    dtype,
    device: str,
    num_layers: int,
    group_id: int,
) -> List[object]:
    """Creates the group's tensors; returns per layer a (kv, num_units, unit_elems) view.

    ``unit_bytes`` is the interleave unit of the contiguous layout and must
    divide the page size there; the per-layer layout accepts any unit.
    """
    cfg = _C.config()
    page = cfg["page_size"]
    contiguous = cfg["contiguous_layout"]
    itemsize = _itemsize(dtype)
    if unit_bytes % itemsize:
        raise InvalidArgumentError(f"a unit of {unit_bytes} bytes is not a whole number of {itemsize}-byte elements")
    if contiguous and page % unit_bytes:
        raise InvalidArgumentError(
            f"the contiguous layout interleaves layers in units of {unit_bytes} bytes (one vLLM block, or one "
            "SGLang token), "
            f"which must divide the page size {page}; use KVCACHED_CONTIGUOUS_LAYOUT=false, or a block size "
            f"whose bytes divide {page}"
        )
    size = num_units * unit_bytes
    layers = vmm_ops.create_kv_tensors(
        size,
        dtype,
        device,
        num_layers,
        num_kv_buffers=num_kv_buffers,
        group_id=group_id,
        chunk_bytes=unit_bytes if contiguous else None,
    )
    unit_elems = unit_bytes // itemsize
    out = []
    for t in layers:
        if contiguous:
            v = t[:, :num_units]
        else:
            # One contiguous range per layer: [K | V]; cut whole units from each.
            v = t.reshape(num_kv_buffers, -1)[:, : num_units * unit_elems].view(num_kv_buffers, num_units, unit_elems)
        out.append(v)
    return out


def vllm_views(
    kvcache_shape: Sequence[int],
    block_size: int,
    dtype,
    device: str,
    num_layers: int,
    attention_type: str,
    kv_layout: str,
    group_id: int,
) -> Tuple[List[object], int, int, int]:
    """Per-layer vLLM KV caches; returns (tensors, num_kv_buffers, block_mem_size, num_blocks).

    Shapes (logical, as the attention backend declares them):
      FlashAttention  (2, num_blocks, block_size, heads, head_dim)   K/V-major
      FlashInfer      (num_blocks, 2, block_size, heads, head_dim)   K and V in one block
      MLA             (num_blocks, block_size, head_dim)             one buffer
    ``kv_layout`` "NHD" stores each block as (block_size, heads, head_dim);
    "HND" as (heads, block_size, head_dim), returned permuted to the logical
    shape (vLLM's stride-order convention).
    """
    shape = _positive_shape(kvcache_shape, "kvcache_shape")
    atype = str(attention_type).upper()
    layout = str(kv_layout).upper()
    if atype not in ("MHA", "GQA", "MLA"):
        raise InvalidArgumentError(f"attention_type {attention_type!r} is not one of MHA, GQA, MLA")
    if layout not in ("NHD", "HND"):
        raise InvalidArgumentError(f"kv_layout {kv_layout!r} is not NHD or HND")
    block_size = int(block_size)
    itemsize = _itemsize(dtype)
    if atype == "MLA":
        if len(shape) != 3:
            raise InvalidArgumentError(f"MLA expects (num_blocks, block_size, head_dim), got {shape}")
        num_blocks, bs, dim = shape
        _check_bs(bs, block_size)
        per_block = (bs, dim)
        kv, block_bytes, form = 1, bs * dim * itemsize, "mla"
    else:
        if len(shape) != 5:
            raise InvalidArgumentError(
                f"{atype} expects (2, num_blocks, block_size, heads, head_dim) or "
                f"(num_blocks, 2, block_size, heads, head_dim), got {shape}"
            )
        if shape[0] == 2:
            _, num_blocks, bs, heads, dim = shape
            kv, form = 2, "kv_major"
        elif shape[1] == 2:
            num_blocks, _, bs, heads, dim = shape
            kv, form = 1, "kv_inner"
        else:
            raise InvalidArgumentError(f"no K/V dimension of size 2 at position 0 or 1 in {shape}")
        _check_bs(bs, block_size)
        per_block = (bs, heads, dim) if layout == "NHD" else (heads, bs, dim)
        if form == "kv_inner":
            per_block = (2,) + per_block
        block_bytes = math.prod(per_block) * itemsize
    check_block_geometry(num_blocks, bs, block_bytes // bs)
    units = unit_views(num_blocks, block_bytes, kv, dtype, device, num_layers, group_id)
    out = []
    for u in units:
        t = u.view(kv, num_blocks, *per_block)
        if form == "kv_major":
            if layout == "HND":
                t = t.permute(0, 1, 3, 2, 4)  # (2, B, H, N, D) -> logical (2, B, N, H, D)
        else:
            t = t[0]
            if form == "kv_inner" and layout == "HND":
                t = t.permute(0, 1, 3, 2, 4)  # (B, 2, H, N, D) -> logical (B, 2, N, H, D)
        out.append(t)
    return out, kv, block_bytes, num_blocks


def sglang_views(
    kvcache_shape: Sequence[int],
    dtype,
    device: str,
    num_layers: int,
    page_size: int,
    attention_type: str,
    kv_layout: str,
    group_id: int,
) -> Tuple[List[object], List[object], int, int]:
    """Per-layer SGLang token buffers; returns (k_or_kv, v, block_mem_size, num_blocks).

    ``kvcache_shape`` is (num_tokens, heads, head_dim) per buffer; one
    manager block is one SGLang page of ``page_size`` tokens. MHA/GQA give
    separate K and V lists; MLA gives one list (and an empty V list).
    """
    shape = _positive_shape(kvcache_shape, "kvcache_shape")
    atype = str(attention_type).upper()
    if atype not in ("MHA", "GQA", "MLA"):
        raise InvalidArgumentError(f"attention_type {attention_type!r} is not one of MHA, GQA, MLA")
    if str(kv_layout).upper() != "NHD":
        raise InvalidArgumentError(
            f"kv_layout {kv_layout!r}: SGLang token pools are (num_tokens, heads, head_dim), i.e. NHD"
        )
    if len(shape) != 3:
        raise InvalidArgumentError(f"SGLang expects (num_tokens, heads, head_dim), got {shape}")
    page_size = int(page_size)
    if page_size <= 0:
        raise InvalidArgumentError(f"page_size must be a positive number of tokens, got {page_size}")
    num_tokens, heads, dim = shape
    if num_tokens < page_size:
        raise InvalidArgumentError(f"{num_tokens} tokens are fewer than one page of {page_size} tokens")
    token_bytes = heads * dim * _itemsize(dtype)
    num_blocks = num_tokens // page_size
    check_block_geometry(num_blocks, page_size, token_bytes)
    kv = 1 if atype == "MLA" else 2
    units = unit_views(num_tokens, token_bytes, kv, dtype, device, num_layers, group_id)
    views = [u.view(kv, num_tokens, heads, dim) for u in units]
    if kv == 1:
        return [v[0] for v in views], [], page_size * token_bytes, num_blocks
    return [v[0] for v in views], [v[1] for v in views], page_size * token_bytes, num_blocks


def _check_bs(bs: int, block_size: int) -> None:
    if bs != block_size:
        raise InvalidArgumentError(f"block_size {block_size} does not match the block dimension {bs} of kvcache_shape")
