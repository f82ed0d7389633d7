"""Where vLLM's KV blocks lie in its one KV buffer, in kvcached pages.

vLLM 0.29-0.34 allocate one int8 buffer of ``size`` bytes and cut per-layer
views from it. Each ``KVCacheTensor(size, layers, layer_stride, block_stride,
offset)`` says: layer ``l``'s block ``b`` starts at byte
``offset + l * layer_stride + b * block_stride`` and is ``block_bytes`` long
(the spec's ``page_size_bytes``). Layer-outermost layouts (LBHNC, the only
one CPU attention accepts) give each layer a contiguous region; block-
outermost ones (BLHNC, ...) make a block one run of all layers' bytes.

Models with several KV geometries give several tensors. Layers of different
head sizes in one group (``UniformTypeKVCacheSpecs``: e.g. Gemma 4's global
layers) have blocks of different ``block_bytes``, one tensor per geometry.
Several KV cache groups (local + global layers, each group its own block
table) share one block pool: vLLM gives their tensors the same bytes ("groups
alias from byte 0"), a block id being held by one group at a time. Either way
the plan is the union of the placements, each with its own block size; the
ledger's page geometry is that of the *smallest* block, so a logical page is
one page of the smallest tensor and, where the larger blocks are multiples of
it, whole pages of the others (Gemma 4: 64 and 128 KiB blocks, 1 + 2 pages).
Cut by the largest block instead, two logical pages would share each page of
the smaller tensor and each be charged for it. The largest block must still
fit in a page (start-up names the page size to use otherwise).

kvcached backs that buffer with one FTensor of the same size, so vLLM's own
views (and strides) stay exactly as it made them. The scheduler's block
ledger (``KVCacheManager``) thinks in *logical pages*: logical page ``p``
holds the blocks ``BlockGeometry.block_range(p)`` (``page_size /
block_bytes`` consecutive block ids). ``KVLayoutPlan.physical_pages(p)`` are
the FTensor pages that hold those blocks' bytes in every layer and tensor:
in LBHNC with page-aligned layer regions that is one page per layer, in
BLHNC ``num_layers`` consecutive pages. Regions that are not page aligned make
neighbouring logical pages share a physical page; the worker counts
references for that (``worker_executor``), and the ledger must charge each
logical page its worst case. So the engine core's configs get page-aligned
layer regions before anyone sees them (``align_layer_regions``, patch
``kv_regions_page_aligned``): vLLM's own strides would put a layer's region
mid-page wherever a block does not divide the page (hybrid and MLA blocks).

vLLM 0.26-0.28 allocate one buffer per ``KVCacheTensor(size, shared_by)``
instead (``read_shared_by_tensors``): kvcached lays those buffers end to end,
page aligned, in one FTensor, and each becomes a placement of one layer.

Pure arithmetic on plain attributes: no vLLM or torch import, so the same
plan is built in the scheduler and in every worker and tested without vLLM
(``patch_kv_cache_configs`` rebinds a vLLM name; it imports nothing of it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from kvcached import config
from kvcached.block_geometry import BlockGeometry, page_size_for_block, page_utilization
from kvcached.errors import InvalidArgumentError
from kvcached.integration import families

logger = logging.getLogger("vllm.kvcached")


@dataclass(frozen=True)
class Placement:
    """One KVCacheTensor: its layers' blocks in the buffer."""

    offset: int
    num_layers: int
    layer_stride: int
    block_stride: int
    block_bytes: int


class KVLayoutPlan:
    """Logical kvcached pages of vLLM's KV buffer and the physical pages behind them."""

    # How a KVCacheConfig's tensors are read: ``read_layer_tensors`` (vLLM 0.29+)
    # or ``read_shared_by_tensors`` (0.26-0.28); versions.py picks per version.
    tensor_reader: Callable[..., Tuple[int, List[Placement], int]]

    def __init__(
        self,
        buffer_size: int,
        num_blocks: int,
        block_bytes: int,
        block_tokens: int,
        page_size: int,
        placements: Sequence[Placement],
    ) -> None:
        if buffer_size <= 0 or num_blocks <= 0 or block_bytes <= 0 or page_size <= 0:
            raise InvalidArgumentError(
                f"KV layout: buffer {buffer_size} B, {num_blocks} blocks of {block_bytes} B, "
                f"page {page_size} B must all be positive"
            )
        if not placements:
            raise InvalidArgumentError("KV layout: no KV cache tensor to back")
        for p in placements:
            if p.block_bytes < block_bytes:
                raise InvalidArgumentError(
                    f"KV layout: a tensor's {p.block_bytes}-byte blocks are smaller than the plan's block size "
                    f"{block_bytes} B (the smallest block of the pool)"
                )
            last = p.offset + (p.num_layers - 1) * p.layer_stride + (num_blocks - 1) * p.block_stride + p.block_bytes
            if p.offset < 0 or p.layer_stride < 0 or p.block_stride <= 0 or last > buffer_size:
                raise InvalidArgumentError(
                    f"KV layout: a tensor (offset {p.offset}, layer stride {p.layer_stride}, block stride "
                    f"{p.block_stride}, {p.num_layers} layers) reaches byte {last} of a {buffer_size}-byte buffer"
                )
        self.buffer_size = int(buffer_size)
        self.num_blocks = int(num_blocks)
        self.block_bytes = int(block_bytes)
        self.page_size = int(page_size)
        self.placements: Tuple[Placement, ...] = tuple(placements)
        # The manager's geometry: tokens x cell bytes = block bytes. A padded
        # block that is not a whole number of token cells is one 1-token "cell".
        if block_tokens > 0 and block_bytes % block_tokens == 0:
            self.block_tokens, self.cell_size = int(block_tokens), block_bytes // int(block_tokens)
        else:
            self.block_tokens, self.cell_size = 1, self.block_bytes
        self.geometry = BlockGeometry(self.num_blocks, self.block_tokens, self.cell_size, self.page_size)
        self.num_logical_pages = self.geometry.num_pages
        self.mapped_size = -(-self.buffer_size // self.page_size) * self.page_size
        self._memo: Dict[int, Tuple[int, ...]] = {}
        self._per_page: Optional[int] = None
        self.num_layers = sum(p.num_layers for p in self.placements)

    @classmethod
    def for_engine(cls, kv_cache_config: Any) -> KVLayoutPlan:
        """The plan of a vLLM ``KVCacheConfig`` with this engine's page size (``page_size_for``)."""
        return cls.from_kv_cache_config(kv_cache_config, page_size_for(kv_cache_config))

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, page_size: int) -> KVLayoutPlan:
        """The plan of a vLLM ``KVCacheConfig``; its tensors are read by ``tensor_reader``
        (one reader per shape of vLLM's ``KVCacheTensor``, picked per version by ``versions.py``)."""
        tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
        if not tensors:
            raise InvalidArgumentError("kvcached: this model has no KV cache tensors; unset ENABLE_KVCACHED")
        refuse_unsupported_model(kv_cache_config)
        groups = list(kv_cache_config.kv_cache_groups)
        num_blocks = int(kv_cache_config.num_blocks)
        buffer_size, placements, block_tokens = cls.tensor_reader(tensors, groups, num_blocks, int(page_size))
        largest = max(p.block_bytes for p in placements)
        # Pages are cut by the smallest block; a block larger than a page is refused
        # the way a single-size pool's is (the constructor names the page size to use).
        unit = largest if largest > page_size else min(p.block_bytes for p in placements)
        return cls(buffer_size, num_blocks, unit, block_tokens, int(page_size), placements)

    # ------------------------------------------------------------------ pages

    def physical_pages(self, logical_page: int) -> Tuple[int, ...]:
        """FTensor page indices holding the bytes of ``logical_page``'s blocks (sorted)."""
        got = self._memo.get(logical_page)
        if got is not None:
            return got
        if not 0 <= logical_page < self.num_logical_pages:
            raise InvalidArgumentError(f"logical page {logical_page} is out of range [0, {self.num_logical_pages})")
        out = tuple(sorted(self._pages_of(logical_page)))
        self._memo[logical_page] = out
        return out

    def _pages_of(self, logical_page: int) -> set:
        first, end = self.geometry.block_range(logical_page)
        P = self.page_size
        pages: set = set()
        if end <= first:
            return pages
        for pl in self.placements:
            bb, bs, ls, L = pl.block_bytes, pl.block_stride, pl.layer_stride, pl.num_layers
            if bs > bb and ls <= bb and (L - 1) * ls + bb >= bs:
                # Block-outermost, each block one run of all its layers: the blocks are one run.
                runs: Iterable[Tuple[int, int]] = (
                    (pl.offset + first * bs, pl.offset + (end - 1) * bs + (L - 1) * ls + bb),
                )
            elif bs <= bb:  # blocks of a layer are contiguous: one run per layer
                runs = ((pl.offset + i * ls + first * bs, pl.offset + i * ls + (end - 1) * bs + bb) for i in range(L))
            else:
                runs = (
                    (pl.offset + i * ls + b * bs, pl.offset + i * ls + b * bs + bb)
                    for i in range(L)
                    for b in range(first, end)
                )
            for start, stop in runs:
                pages.update(range(start // P, (stop - 1) // P + 1))
        return pages

    def physical_pages_per_logical_page(self) -> int:
        """Physical pages a full logical page needs, the most over all of them (the
        manager charges every logical page this: its layer count). Where regions are not
        page aligned, logical pages differ; a sample could miss the largest and under-charge."""
        if self._per_page is None:
            self._per_page = max(1, max(len(self._pages_of(p)) for p in range(self.num_logical_pages)))
        return self._per_page

    def __repr__(self) -> str:
        return (
            f"KVLayoutPlan({self.buffer_size} B buffer, {self.num_blocks} blocks x {self.block_bytes} B, "
            f"{len(self.placements)} tensor(s) / {self.num_layers} layers, page {self.page_size} B, "
            f"{self.num_logical_pages} logical pages)"
        )


# ------------------------------------------------------------- page size

_chosen_logged: set = set()


def page_size_for(kv_cache_config: Any) -> int:
    """The page size of an engine's KV buffer: ``block_geometry.page_size_for_block`` of its
    largest block (a real hybrid model's state block, Qwen3-Next or Qwen3.5, may be larger
    than the default 2 MiB page: ``vllm serve`` of such a model needs no variable). A pure
    function of the config: the engine core (region alignment), the scheduler and every
    worker compute the same page from the same config."""
    page = config.page_size()
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    if config.page_size_set() or not tensors:
        return page
    groups = list(kv_cache_config.kv_cache_groups)
    _, placements, _ = KVLayoutPlan.tensor_reader(tensors, groups, int(kv_cache_config.num_blocks), page)
    largest = max(p.block_bytes for p in placements)
    chosen = page_size_for_block(largest)
    if chosen != page and chosen not in _chosen_logged:
        _chosen_logged.add(chosen)
        logger.info(
            "kvcached: blocks of %d B are larger than the default %d KiB page: pages of %d KiB (%.0f%% used); "
            "set KVCACHED_PAGE_SIZE to choose another",
            largest,
            page >> 10,
            chosen >> 10,
            100 * page_utilization(chosen, largest),
        )
    return chosen


# ---------------------------------------------------------- tensor readers

Read = Tuple[int, List[Placement], int]  # (buffer bytes, placements, tokens per block of the largest block)


def _tokens_of_largest(specs: List[Any]) -> int:
    """Tokens per block of the spec with the largest block: the geometry unit's too (one
    group's tensors share a block size in tokens; vLLM evens out groups' bytes). On a tie
    (the evened-out pages of a hybrid model's groups) an attention spec's: a Mamba state
    block's ``block_size`` counts no cached tokens."""
    spec = max(specs, key=lambda s: (int(s.page_size_bytes), hasattr(s, "num_kv_heads")))
    return int(getattr(spec, "block_size", 0) or 0)


def read_layer_tensors(tensors: Sequence[Any], groups: List[Any], num_blocks: int, page_size: int) -> Read:
    """vLLM 0.29-0.34: ``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``,
    every tensor a placement in one shared buffer of ``size`` bytes."""
    sizes = {int(t.size) for t in tensors}
    if len(sizes) != 1:
        raise InvalidArgumentError(f"kvcached: KV cache tensors of different sizes {sorted(sizes)} (vLLM expects one)")
    placements: List[Placement] = []
    specs: List[Any] = []
    tensors_of_group: Dict[int, int] = {}
    for t in tensors:
        g = _group_index(groups, t.layers[0])
        tensors_of_group[g] = tensors_of_group.get(g, 0) + 1
    for t in tensors:
        if getattr(t, "host_resident", False):
            raise InvalidArgumentError(
                "kvcached: host-resident KV tensors (HiSparse) are not supported; unset ENABLE_KVCACHED"
            )
        spec = _spec_of(groups, t.layers[0])
        if not getattr(spec, "has_layer_views", True):
            raise InvalidArgumentError(
                f"kvcached: the KV spec {type(spec).__name__} of {t.layers[0]} has no per-layer block views, "
                "so its block addresses are unknown; unset ENABLE_KVCACHED for this model"
            )
        block_bytes = int(spec.page_size_bytes)
        if tensors_of_group[_group_index(groups, t.layers[0])] > 1:
            # One group over tensors of different geometry (layers of different
            # head sizes). The scheduler's config names one arbitrary layer's
            # spec for the whole group (vLLM's generate_scheduler_kv_cache_config
            # drops UniformTypeKVCacheSpecs), so the block size is read from the
            # tensor itself, the same way in the scheduler and in the workers.
            interleaved = len(t.layers) > 1 and int(t.block_stride) * num_blocks > int(t.layer_stride)
            past_end = int(t.offset) + int(t.block_stride) * num_blocks > int(t.size)
            if interleaved or past_end:  # a block's bytes are not one run of this tensor's layer
                raise InvalidArgumentError(
                    f"kvcached does not support layers of different KV head sizes in a block-outermost KV cache "
                    f"layout (tensor of {t.layers[0]}); use a layer-outermost layout (VLLM_KV_CACHE_LAYOUT=LBHNC) "
                    "or unset ENABLE_KVCACHED for this model"
                )
            block_bytes = int(t.block_stride)
        elif int(t.block_stride) < block_bytes or (len(t.layers) > 1 and int(t.layer_stride) < block_bytes):
            # LHBNC / BHLNC (ROCm backends opt in): a layer's block is one run per KV
            # head, spread over the buffer; pages mapped for the block's first run
            # would leave the other heads' bytes unmapped.
            raise InvalidArgumentError(
                f"kvcached does not support KV cache layouts with the heads outside the blocks (tensor of "
                f"{t.layers[0]}: block stride {t.block_stride} B, layer stride {t.layer_stride} B, blocks of "
                f"{block_bytes} B: LHBNC or BHLNC); use VLLM_KV_CACHE_LAYOUT=LBHNC or unset ENABLE_KVCACHED"
            )
        placements.append(
            Placement(
                int(getattr(t, "offset", 0)),
                len(t.layers),
                int(t.layer_stride),
                int(t.block_stride),
                block_bytes,
            )
        )
        specs.append(spec)
    return sizes.pop(), placements, _tokens_of_largest(specs)


def read_shared_by_tensors(tensors: Sequence[Any], groups: List[Any], num_blocks: int, page_size: int) -> Read:
    """vLLM 0.26-0.28: ``KVCacheTensor(size, shared_by, offset, block_stride)``, each
    tensor its own buffer of ``num_blocks`` blocks, block ``b`` at ``b * page_size_bytes``
    (blocks outermost: every CUDA and CPU attention backend; the worker checks vLLM's
    views, ``worker_kv.check_blocks_outermost``). kvcached puts the buffers one after
    another in one range, each at a page boundary: one placement of one "layer" each."""
    placements: List[Placement] = []
    specs: List[Any] = []
    offset = 0
    for t in tensors:
        if int(getattr(t, "block_stride", 0) or 0) > 0:
            raise InvalidArgumentError(
                f"kvcached does not support vLLM's packed KV layout yet (KVCacheTensor shared by {t.shared_by[0]} "
                "has a block_stride: DeepSeek V4 or --enable-cross-layers-blocks); unset ENABLE_KVCACHED"
            )
        spec = _spec_of(groups, t.shared_by[0])
        # Each buffer holds num_blocks blocks, so its size gives the block size.
        # Not the spec's: the scheduler's config names one arbitrary layer's spec
        # for a group of layers of different head sizes (UniformTypeKVCacheSpecs).
        block_bytes = int(t.size) // num_blocks or int(spec.page_size_bytes)
        if int(t.size) != num_blocks * block_bytes:
            raise InvalidArgumentError(
                f"kvcached: the KV cache tensor of {t.shared_by[0]} has {t.size} B, not {num_blocks} blocks x "
                f"{block_bytes} B; unset ENABLE_KVCACHED for this model"
            )
        placements.append(Placement(offset, 1, 0, block_bytes, block_bytes))
        offset += -(-int(t.size) // page_size) * page_size
        # Every layer's spec: a hybrid's buffer is shared by a state layer and an
        # attention layer, and the tokens per block are the attention layer's.
        specs.extend(_spec_of(groups, name) for name in t.shared_by)
    return offset, placements, _tokens_of_largest(specs)


KVLayoutPlan.tensor_reader = staticmethod(read_layer_tensors)  # type: ignore[assignment]


# KV cache spec classes kvcached backs, from the family table (``families.py``). Full
# attention keeps every block until its request frees it; sliding window frees the
# blocks that left the window through ``BlockPool.free_blocks`` while the request runs
# (the elastic pool returns them like any freed block), with its own block table per
# group. Mamba / gated-delta-net state (``MambaSpec``) is added per vLLM version by the
# patches its family names (``serve_specs_of_patch``): from 0.29 a state block lies at its
# layer's block address like a KV block, vLLM evens its page out with the attention
# pages, and a request's state blocks come from and go back to the one pool. Other
# classes (R-SWA, chunked local, attention sinks, hidden-state caches, ...) are refused:
# they free, size or write blocks in ways no test on a real engine has checked.
SUPPORTED_SPECS: Tuple[str, ...] = families.vllm_served_specs()


def serve_spec(name: str) -> None:
    """Back one more spec class from now on."""
    global SUPPORTED_SPECS
    if name not in SUPPORTED_SPECS:
        SUPPORTED_SPECS = (*SUPPORTED_SPECS, name)


def serve_specs_of_patch(patch: str) -> None:
    """Back the spec classes of the families served by the version patch ``patch`` (e.g.
    ``mamba_state_0_29``: Mamba / gated-delta-net state blocks), once it applies."""
    for name in families.vllm_specs_of_patch(patch):
        serve_spec(name)


def _specs_of(spec: Any) -> List[Any]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def _groups_and_kinds(kv_cache_config: Any) -> Tuple[List[Any], List[str]]:
    """The config's KV cache groups and the spec class names in them, sorted."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    return groups, sorted({type(s).__name__ for g in groups for s in _specs_of(g.kv_cache_spec)})


def refuse_unsupported_model(kv_cache_config: Any) -> None:
    """One line naming the model feature when a KV cache group is of a kind
    kvcached has not been proven on (Mamba state, chunked local attention,
    R-SWA, ...). Several groups of supported kinds (Gemma's local + global
    layers) share the one block pool and are served."""
    groups, kinds = _groups_and_kinds(kv_cache_config)
    for kind in kinds:
        if kind not in SUPPORTED_SPECS:
            # The feature of the family the class marks, for the one line that names it.
            feature = families.vllm_spec_features().get(
                kind, "a KV cache type other than full and sliding-window attention"
            )
            hybrid = f" in a model of {len(groups)} KV cache groups ({', '.join(kinds)})" if len(groups) > 1 else ""
            raise InvalidArgumentError(
                f"kvcached does not support {feature} yet (KV cache spec {kind}{hybrid}); "
                "unset ENABLE_KVCACHED for this model"
            )


# Spec kinds served on one device kind but refused on another come from the family table
# (``families.refused_on``): on the H200 (docs/GPU.md) a small Qwen3-Next with kvcached gave
# other greedy tokens than native in 29, 0 and 19 of 200 sequences in three runs, each with
# native's schedule, where two native runs agreed on all 200; until that is explained, a GPU
# worker fails closed on Mamba state.
def refuse_unproven_on_device(kv_cache_config: Any, device: str) -> None:
    """One line when a KV cache group is of a kind not yet proven on ``device``'s kind
    (``families.refused_on``; Mamba state on a CUDA / ROCm device);
    ``KVCACHED_ALLOW_UNSUPPORTED=1`` serves it anyway, with one warning."""
    kind = families.device_kind(device)
    unproven = families.refused_on("vllm", kind)
    for spec in _groups_and_kinds(kv_cache_config)[1]:
        if spec not in unproven:
            continue
        feature, why = unproven[spec]
        if config.allow_unsupported():
            logger.warning(
                "kvcached: KVCACHED_ALLOW_UNSUPPORTED=1: serving %s on %s, not proven there: %s", feature, device, why
            )
            continue
        raise InvalidArgumentError(
            f"kvcached does not support {feature} on {families.DEVICE_WORDS[kind]} yet ({why}); unset "
            "ENABLE_KVCACHED for this model, or KVCACHED_ALLOW_UNSUPPORTED=1 to try it anyway"
        )


def _group_index(groups: List[Any], layer_name: str) -> int:
    for i, g in enumerate(groups):
        if layer_name in g.layer_names:
            return i
    raise InvalidArgumentError(f"kvcached: layer {layer_name} of a KV cache tensor is in no KV cache group")


def _spec_of(groups: List[Any], layer_name: str) -> Any:
    for g in groups:
        if layer_name in g.layer_names:
            spec = g.kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            if isinstance(inner, dict) and layer_name in inner:
                spec = inner[layer_name]
            return spec
    raise InvalidArgumentError(f"kvcached: layer {layer_name} of a KV cache tensor is in no KV cache group")
