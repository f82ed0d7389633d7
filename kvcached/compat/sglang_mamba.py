"""SGLang's mamba (linear-attention) state tensors over kvcached pages (upstream's
``alloc_mamba_states``).

One mamba slot is one block. Its bytes in each layer form a *cell*: the conv
states one after another, then the temporal state, each aligned to its
element size; the cell is padded to the smallest divisor of the page size
that holds it, so every page holds whole cells and ``num_slots`` blocks are
really deliverable. Layouts (the manager: ``num_kv_buffers=1``, block = cell):

* per-layer: one range per layer, ``[slot][cell]``; ``conv_state[k][layer]``
  and ``temporal_state[layer]`` are ``(num_slots, *shape)`` views;
* contiguous: one range ``[slot][layer][cell]``; ``conv_state[k]`` and
  ``temporal_state`` are ``(num_mamba_layers, num_slots, *shape)`` views, the
  shape of SGLang's own ``MambaPool`` buffers.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

from kvcached import _C, vmm_ops
from kvcached.errors import InvalidArgumentError
from kvcached.integration import kv_views


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def smallest_divisor_at_least(n: int, lower: int) -> int:
    """The smallest divisor of ``n`` that is >= ``lower`` (``n`` itself at worst)."""
    best, i = n, 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if lower <= d < best:
                    best = d
        i += 1
    return best


def alloc(
    num_slots: int, num_layers: int, cache_params: Any, device: str, group_id: int
) -> Tuple[int, Any, Any, Dict[str, Any]]:
    """Creates the group's tensors; returns (cell bytes, conv_state, temporal_state, layout_info)."""
    import torch

    if int(num_slots) <= 0 or int(num_layers) <= 0:
        raise InvalidArgumentError(f"num_slots {num_slots} and num_mamba_layers {num_layers} must be positive")
    conv_shapes = [tuple(int(d) for d in s) for s in cache_params.shape.conv]
    temporal_shape = tuple(int(d) for d in cache_params.shape.temporal)
    conv_dtype, ssm_dtype = cache_params.dtype.conv, cache_params.dtype.temporal
    conv_item, ssm_item = kv_views._itemsize(conv_dtype), kv_views._itemsize(ssm_dtype)
    offsets: List[int] = []
    end = 0
    for shape in conv_shapes:
        end = _align(end, conv_item)
        offsets.append(end)
        end += math.prod(shape) * conv_item
    temporal_offset = _align(end, ssm_item)
    raw_cell = _align(temporal_offset + math.prod(temporal_shape) * ssm_item, max(conv_item, ssm_item))
    page = int(_C.config()["page_size"])
    if raw_cell > page:
        raise InvalidArgumentError(
            f"a mamba slot needs {raw_cell} bytes per layer, more than the page ({page} bytes); "
            f"raise KVCACHED_PAGE_SIZE to at least {raw_cell} (a multiple of the backend granularity)"
        )
    cell = smallest_divisor_at_least(page, raw_cell)
    kv_views.unit_views(int(num_slots), cell, 1, torch.int8, device, int(num_layers), group_id)
    raw = vmm_ops.get_raw_kv_tensors(group_id)
    contiguous = bool(_C.config()["contiguous_layout"])
    n, layers = int(num_slots), int(num_layers)

    def view(flat: Any, shape: Tuple[int, ...], dtype: Any, offset: int, per_layer: bool) -> Any:
        item = kv_views._itemsize(dtype)
        if cell % item:
            raise InvalidArgumentError(f"a cell of {cell} bytes is not a whole number of {item}-byte elements")
        inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        t = flat.view(dtype)
        if per_layer:
            return torch.as_strided(t, (n, *shape), (cell // item, *inner), offset // item)
        return torch.as_strided(t, (layers, n, *shape), (cell // item, layers * cell // item, *inner), offset // item)

    if contiguous:
        conv: Any = [view(raw[0], s, conv_dtype, offsets[k], False) for k, s in enumerate(conv_shapes)]
        temporal: Any = view(raw[0], temporal_shape, ssm_dtype, temporal_offset, False)
    else:
        conv = [
            [view(raw[i], s, conv_dtype, offsets[k], True) for i in range(layers)] for k, s in enumerate(conv_shapes)
        ]
        temporal = [view(raw[i], temporal_shape, ssm_dtype, temporal_offset, True) for i in range(layers)]
    info = {
        "cell_size": cell,
        "num_slots": n,
        "num_mamba_layers": layers,
        "conv_offsets": offsets,
        "temporal_offset": temporal_offset,
        "is_contiguous": contiguous,
    }
    return cell, conv, temporal, info
