"""The VMM operations with the upstream kvcached names.

KV tensors come from the extension as DLPack capsules over stable virtual
addresses (no copy) and are viewed here as per-layer torch tensors. Every
tensor-facing call is also registered as ``torch.ops.kvcached.<name>``.

Layouts (offsets are byte offsets into one per-layer K/V buffer):
  per-layer   one address range per layer: [K buffer | V buffer]
  contiguous  one range, [chunk][layer][kv][chunk bytes]; a page offset maps
              one compound handle of page_size * layers * kv bytes.
Both return, per layer, a tensor of shape ``(num_kv_buffers, num_chunks,
chunk_elems)``; the bytes each view addresses are identical between layouts.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple, Union

from kvcached import _C, config
from kvcached._C import PageAllocator  # noqa: F401  (upstream name)
from kvcached.devices import normalize_device
from kvcached.errors import InvalidArgumentError, int_arg

_INT_DTYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def init_kvcached(
    dev_str: Union[str, int, object] = "cuda:0",
    page_size: Optional[int] = None,
    contiguous_layout: Optional[bool] = None,
) -> None:
    """Initializes the data plane for one device ('cpu' selects the host backend).

    A string goes to the extension as given (it names what is wrong with it);
    an int or a torch.device is turned into one by kvcached.devices."""
    if contiguous_layout is not None and not isinstance(contiguous_layout, bool):
        raise InvalidArgumentError(f"contiguous_layout must be True or False, got {contiguous_layout!r}")
    _C.init_kvcached(
        dev_str if isinstance(dev_str, str) else normalize_device(dev_str),
        config.page_size() if page_size is None else int_arg("page_size", page_size),
        config.contiguous_layout() if contiguous_layout is None else contiguous_layout,
    )


def shutdown_kvcached() -> None:
    """Releases every physical page, quarantined ones too where the driver
    allows (a warning names what it does not). Tensors still held stay valid
    (zero page)."""
    left = int(_C.shutdown_kvcached())
    if left:
        logging.getLogger(__name__).warning(
            "kvcached: %d bytes of KV memory could not be released at shutdown (the driver refused); "
            "they stay allocated until this process exits",
            left,
        )


def _torch_dtype(torch, dtype: Union[int, object]):
    if isinstance(dtype, int):
        if dtype not in _INT_DTYPES:
            raise InvalidArgumentError(f"dtype_size {dtype} is not supported; use 1, 2, 4 or 8 or a torch.dtype")
        return getattr(torch, _INT_DTYPES[dtype])
    if isinstance(dtype, torch.dtype):
        return dtype
    raise InvalidArgumentError(f"dtype {dtype!r} must be an element size in bytes or a torch.dtype")


def create_kv_tensors(
    size: int,
    dtype_size: Union[int, object],
    dev_str: str,
    num_layers: int,
    num_kv_buffers: int = 2,
    group_id: int = 0,
    unified_pool: bool = False,
    *,
    chunk_bytes: Optional[int] = None,
) -> List[object]:
    """Creates the KV tensors of a group and returns one view per layer.

    ``size`` is the byte size of one K (or V) buffer of one layer, rounded up
    to the page size. ``chunk_bytes`` (default: the page size) is the
    interleave unit of the contiguous layout, normally the engine block size;
    it must divide the page size. ``unified_pool`` holds upstream's seventh
    position (K and V interleaved in one buffer per layer); here that layout is
    ``num_kv_buffers=1`` with the whole per-layer size, so True is refused
    with that fix rather than read as something else.
    """
    if unified_pool is not False:
        raise InvalidArgumentError(
            f"unified_pool={unified_pool!r}: upstream's K/V-in-one-buffer layout is num_kv_buffers=1 here "
            "(size = the whole per-layer buffer); pass that instead"
        )
    import torch

    dtype = _torch_dtype(torch, dtype_size)
    cfg = _C.config()
    if not _same_device(cfg["device"], dev_str):
        raise InvalidArgumentError(
            f"create_kv_tensors on {dev_str!r} but kvcached was initialized for {cfg['device']!r}; "
            "call init_kvcached with the same device"
        )
    size = int_arg("size", size)
    num_layers = int_arg("num_layers", num_layers, minimum=1)
    num_kv_buffers = int_arg("num_kv_buffers", num_kv_buffers, minimum=1)
    group_id = int_arg("group_id", group_id)
    page = cfg["page_size"]
    chunk = page if chunk_bytes is None else int_arg("chunk_bytes", chunk_bytes, minimum=1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if chunk <= 0 or page % chunk != 0 or chunk % itemsize != 0:
        raise InvalidArgumentError(
            f"chunk_bytes {chunk} must divide the page size {page} and be a multiple of the element size {itemsize}"
        )
    capsules = _C.create_kv_tensors(size, num_layers, num_kv_buffers, group_id)
    return _layer_views(torch, capsules, group_id, dtype, chunk)


def _same_device(a: object, b: object) -> bool:
    # A device that does not parse is not the initialized one: the caller then says so.
    try:
        return normalize_device(a) == normalize_device(b)
    except InvalidArgumentError:
        return False


def _layer_views(torch, capsules, group_id: int, dtype, chunk: int):
    info = _C.group_info(group_id)
    raw = [torch.utils.dlpack.from_dlpack(c).view(dtype) for c in capsules]
    itemsize = raw[0].element_size()
    layers, kv, buf = info["num_layers"], info["num_kv_buffers"], info["buffer_size"]
    chunk_elems = chunk // itemsize
    num_chunks = buf // chunk
    if info["contiguous_layout"]:
        flat = raw[0]
        stride = layers * kv * chunk_elems
        return [
            flat.as_strided((kv, num_chunks, chunk_elems), (chunk_elems, stride, 1), layer * kv * chunk_elems)
            for layer in range(layers)
        ]
    return [t.view(kv, num_chunks, chunk_elems) for t in raw]


def get_raw_kv_tensors(group_id: int = 0) -> List[object]:
    """The group's address ranges as flat uint8 tensors (one per layer, or one
    compound range in the contiguous layout), for engine-specific views."""
    import torch

    return [torch.utils.dlpack.from_dlpack(c) for c in _C.raw_kv_tensors(group_id)]


def kv_tensors_created(group_id: int = 0) -> bool:
    return bool(_C.kv_tensors_created(group_id))


def map_to_kv_tensors(offsets: Sequence[int], group_id: int = 0) -> None:
    """Maps every layer and K/V buffer at each offset, all or nothing."""
    _C.map_to_kv_tensors(offsets, group_id)


def map_to_kv_tensors_with_result(offsets: Sequence[int], group_id: int = 0) -> Tuple[List[int], List[int]]:
    """Idempotent map for retries: returns (newly_mapped, already_mapped)."""
    return _C.map_to_kv_tensors_with_result(offsets, group_id)


def unmap_from_kv_tensors(offsets: Sequence[int], group_id: int = 0) -> None:
    _C.unmap_from_kv_tensors(offsets, group_id)


def prepare_unmap_from_kv_tensors(tx_id: int, offsets: Sequence[int], group_id: int = 0) -> None:
    """Phase one: unmap, map the zero page back, keep the physical handles."""
    _C.prepare_unmap_from_kv_tensors(tx_id, offsets, group_id)


def commit_unmap_from_kv_tensors(tx_id: int, group_id: int = 0) -> None:
    """Phase two: release the retained handles. Repeats are no-ops."""
    _C.commit_unmap_from_kv_tensors(tx_id, group_id)


def abort_unmap_from_kv_tensors(tx_id: int, group_id: int = 0) -> None:
    """Undo phase one: map the retained handles back, data intact."""
    _C.abort_unmap_from_kv_tensors(tx_id, group_id)


def unmap_transaction_outcome(tx_id: int, group_id: int = 0) -> str:
    """'prepared', 'committed', 'aborted' or 'unknown' (bounded history)."""
    return _C.unmap_transaction_outcome(int(tx_id), group_id)


def group_info(group_id: int = 0) -> dict:
    return _C.group_info(group_id)


# Offsets, ids and group ids go to the extension as given: it checks each one
# (an integer, numpy and torch integers included; not a bool, a float or a
# string) and raises InvalidArgumentError naming the argument.

# --- torch.ops.kvcached.* -----------------------------------------------------

_torch_library = None


def register_torch_ops() -> None:
    """Registers the tensor-facing calls as torch.ops.kvcached.* (idempotent)."""
    global _torch_library
    if _torch_library is not None:
        return
    import torch

    lib = torch.library.Library("kvcached", "DEF")
    lib.define(
        "create_kv_tensors(int size, int dtype_size, str dev_str, int num_layers, "
        "int num_kv_buffers=2, int group_id=0) -> Tensor[]"
    )
    lib.define("kv_tensors_created(int group_id=0) -> bool")
    lib.define("map_to_kv_tensors(int[] offsets, int group_id=0) -> ()")
    lib.define("unmap_from_kv_tensors(int[] offsets, int group_id=0) -> ()")
    for name, fn in (
        ("create_kv_tensors", create_kv_tensors),
        ("kv_tensors_created", kv_tensors_created),
        ("map_to_kv_tensors", map_to_kv_tensors),
        ("unmap_from_kv_tensors", unmap_from_kv_tensors),
    ):
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _torch_library = lib


def _register_if_torch_loaded() -> None:
    import sys

    if "torch" in sys.modules:
        try:
            register_torch_ops()
        except Exception:  # pragma: no cover - torch without library support
            pass


_register_if_torch_loaded()
