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

from kvcached import _C, kv_views, vmm_ops
from kvcached.errors import InvalidArgumentError


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


class StateLayout:
    """Where one slot's state of one layer lies in its cell: the conv states one
    after another, then the temporal state, each aligned to its element size."""

    def __init__(self, cache_params: Any) -> None:
        self.conv_shapes = [tuple(int(d) for d in s) for s in cache_params.shape.conv]
        self.temporal_shape = tuple(int(d) for d in cache_params.shape.temporal)
        self.conv_dtype, self.ssm_dtype = cache_params.dtype.conv, cache_params.dtype.temporal
        conv_item, ssm_item = kv_views._itemsize(self.conv_dtype), kv_views._itemsize(self.ssm_dtype)
        self.conv_offsets: List[int] = []
        end = 0
        for shape in self.conv_shapes:
            end = _align(end, conv_item)
            self.conv_offsets.append(end)
            end += math.prod(shape) * conv_item
        self.temporal_offset = _align(end, ssm_item)
        # Bytes of one layer's state, aligned so that cells can follow each other.
        self.cell = _align(self.temporal_offset + math.prod(self.temporal_shape) * ssm_item, max(conv_item, ssm_item))

    def views(self, flat: Any, shape: Tuple[int, ...], layer_stride: int, slot_stride: int) -> Tuple[Any, Any]:
        """(conv list, temporal) strided views of the byte tensor ``flat``; ``shape`` is
        ``(num_slots,)`` (one layer per tensor) or ``(num_layers, num_slots)`` (SGLang's
        ``MambaPool.State`` shape); the strides are in bytes."""
        import torch

        def view(dtype: Any, inner: Tuple[int, ...], offset: int) -> Any:
            item = kv_views._itemsize(dtype)
            outer = (slot_stride,) if len(shape) == 1 else (layer_stride, slot_stride)
            if any(x % item for x in (*outer, offset)):
                raise InvalidArgumentError(f"a mamba state cell is not a whole number of {item}-byte elements")
            inner_strides = tuple(math.prod(inner[i + 1 :]) for i in range(len(inner)))
            strides = tuple(x // item for x in outer) + inner_strides
            return torch.as_strided(flat.view(dtype), (*shape, *inner), strides, offset // item)

        conv = [view(self.conv_dtype, s, o) for s, o in zip(self.conv_shapes, self.conv_offsets)]
        return conv, view(self.ssm_dtype, self.temporal_shape, self.temporal_offset)


def alloc(
    num_slots: int, num_layers: int, cache_params: Any, device: str, group_id: int
) -> Tuple[int, Any, Any, Dict[str, Any]]:
    """Creates the group's tensors; returns (cell bytes, conv_state, temporal_state, layout_info)."""
    import torch

    if int(num_slots) <= 0 or int(num_layers) <= 0:
        raise InvalidArgumentError(f"num_slots {num_slots} and num_mamba_layers {num_layers} must be positive")
    lay = StateLayout(cache_params)
    page = int(_C.config()["page_size"])
    if lay.cell > page:
        raise InvalidArgumentError(
            f"a mamba slot needs {lay.cell} bytes per layer, more than the page ({page} bytes); "
            f"raise KVCACHED_PAGE_SIZE to at least {lay.cell} (a multiple of the backend granularity)"
        )
    cell = smallest_divisor_at_least(page, lay.cell)
    kv_views.unit_views(int(num_slots), cell, 1, torch.int8, device, int(num_layers), group_id)
    raw = vmm_ops.get_raw_kv_tensors(group_id)
    contiguous = bool(_C.config()["contiguous_layout"])
    n, layers = int(num_slots), int(num_layers)
    conv: Any
    temporal: Any
    if contiguous:
        conv, temporal = lay.views(raw[0], (layers, n), cell, layers * cell)
    else:
        per_layer = [lay.views(raw[i], (n,), 0, cell) for i in range(layers)]
        conv = [[c[k] for c, _ in per_layer] for k in range(len(lay.conv_shapes))]
        temporal = [t for _, t in per_layer]
    info = {
        "cell_size": cell,
        "num_slots": n,
        "num_mamba_layers": layers,
        "conv_offsets": lay.conv_offsets,
        "temporal_offset": lay.temporal_offset,
        "is_contiguous": contiguous,
    }
    return cell, conv, temporal, info
