"""A paged-attention decode kernel in Triton that reads K/V through a block
table, with arbitrary block strides, so it runs unchanged over per-layer,
block-outermost (compound) and native ``cudaMalloc`` layouts.

Shapes: ``q`` (batch, heads, dim); ``k_cache``/``v_cache`` (num_blocks,
block_size, kv_heads, dim) with unit stride on ``dim``; ``block_table``
(batch, max_blocks) int32; ``seq_lens`` (batch,) int32. Returns (batch, heads,
dim) in float32. One program per (sequence, head); online softmax over blocks.

Not used by serving (the engines bring their own kernels): it is the kernel of
``python -m kvcached.bench attention`` and tests/gpu/test_gpu_attention.py, which
prove that elastic KV reads the same as native memory under a real kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(
    Q,
    K,
    V,
    BT,
    SL,
    O,
    s_qb,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_btb,
    s_ob,
    s_oh,
    scale,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK)
    q = tl.load(Q + b * s_qb + h * s_qh + d).to(tl.float32)
    seq_len = tl.load(SL + b)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK)):
        blk = tl.load(BT + b * s_btb + i).to(tl.int64)
        mask = i * BLOCK + t < seq_len
        k = tl.load(K + blk * s_kb + t[:, None] * s_kt + kvh * s_kh + d[None, :], mask=mask[:, None], other=0.0)
        v = tl.load(V + blk * s_vb + t[:, None] * s_vt + kvh * s_vh + d[None, :], mask=mask[:, None], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        s = tl.where(mask, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    tl.store(O + b * s_ob + h * s_oh + d, acc / l)


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    batch, heads, dim = q.shape
    _, block, kv_heads, kdim = k_cache.shape
    if kdim != dim or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or heads % kv_heads:
        raise ValueError("paged_decode: K/V must be (blocks, block_size, kv_heads, dim) with unit stride on dim")
    out = torch.empty((batch, heads, dim), device=q.device, dtype=torch.float32)
    _paged_decode[(batch, heads)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        1.0 / math.sqrt(dim),
        GROUP=heads // kv_heads,
        BLOCK=block,
        D=dim,
    )
    return out
