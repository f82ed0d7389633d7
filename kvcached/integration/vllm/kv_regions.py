"""vLLM 0.29+'s KV layer regions moved to page boundaries, in the engine core.

vLLM lays a layer-outermost KV cache as one region per layer, back to back; where
the blocks do not fill whole pages, each region starts mid-page and a logical
page touches twice the physical pages it should (the ledger had to charge
that). ``patch_kv_cache_configs`` wraps the engine core's ``get_kv_cache_configs``
(bound there by name) so the configs the workers and the scheduler get start
every region on a page (``align_layer_regions``): more virtual bytes, no more
physical memory. The page is the engine's (``kv_layout.page_size_for``).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Dict, List, Tuple

from kvcached.integration.vllm.kv_layout import _group_index, page_size_for

logger = logging.getLogger("vllm.kvcached")


def align_layer_regions(kv_cache_config: Any, page_size: int) -> bool:
    """Starts every layer region of a layer-outermost 0.29+ KV cache config on a page
    boundary, in place (every worker and the scheduler get this config); True if it
    moved any.

    vLLM puts layer ``l`` of a tensor at ``offset + l * layer_stride`` with
    ``layer_stride = num_blocks * block_stride``. Where a block does not divide the
    page (hybrid models' evened-out blocks, MLA) the regions start mid-page, so the
    blocks of one logical page touch two physical pages in most layers: the ledger
    must charge that worst case for every logical page (up to 2x what the device
    holds, and 2x the pages for a page mapped alone). Padded to whole pages (virtual
    bytes: kvcached maps only what blocks use), every logical page is exactly one
    physical page per layer region. vLLM cuts its views from the tensors' strides
    and offsets, so they follow. Left as it is: block-outermost layouts (a block is
    one run of all layers: nothing to align), host-resident tensors, and offsets
    that are not vLLM's "layers one after another, groups aliased from byte 0"."""
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    if not tensors or num_blocks <= 0 or not all(hasattr(t, "layer_stride") for t in tensors):
        return False
    P = int(page_size)
    ends: Dict[int, int] = {}  # group -> end of its tensors as vLLM laid them
    plan: List[Tuple[Any, int]] = []
    for t in tensors:
        if getattr(t, "host_resident", False) or int(t.block_stride) * num_blocks > int(t.layer_stride):
            return False
        g = _group_index(groups, t.layers[0])
        if int(t.offset) != ends.get(g, 0):
            return False
        ends[g] = int(t.offset) + len(t.layers) * int(t.layer_stride)
        plan.append((t, g))
    if all(int(t.offset) % P == 0 and int(t.layer_stride) % P == 0 for t in tensors):
        return False
    new_ends: Dict[int, int] = {}
    for t, g in plan:
        t.layer_stride = -(-int(t.layer_stride) // P) * P
        t.offset = new_ends.get(g, 0)
        new_ends[g] = t.offset + len(t.layers) * t.layer_stride
    size = max(max(new_ends.values()), max(int(t.size) for t in tensors))
    for t in tensors:
        t.size = size
    return True


def patch_kv_cache_configs(core: ModuleType) -> None:
    """``vllm.v1.engine.core.get_kv_cache_configs`` (bound there by name, 0.29+): the
    configs it returns go to the workers and the scheduler only after
    ``align_layer_regions``."""
    orig = core.get_kv_cache_configs

    @functools.wraps(orig)
    def get_kv_cache_configs(*args: Any, **kwargs: Any) -> Any:
        configs = orig(*args, **kwargs)
        for c in configs:
            page = page_size_for(c)
            before = max((int(t.size) for t in c.kv_cache_tensors), default=0)
            if align_layer_regions(c, page):
                logger.info(
                    "kvcached: KV layer regions moved to %d KiB page boundaries (%d blocks of %d B do not fill "
                    "whole pages): virtual KV buffer %.1f -> %.1f MiB, no more physical memory",
                    page >> 10,
                    c.num_blocks,
                    int(c.kv_cache_tensors[0].block_stride),
                    before / (1 << 20),
                    int(c.kv_cache_tensors[0].size) / (1 << 20),
                )
        return configs

    core.get_kv_cache_configs = get_kv_cache_configs
