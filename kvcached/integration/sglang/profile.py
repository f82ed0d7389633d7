"""SGLang's seams, release by release: the one table the SGLang integration is keyed by.

Each supported release says how the seams kvcached patches are shaped there
(``Seams``). From this table come: the supported range, each patch's version
range (a patch names the shape it needs: ``patches.py``), the known breaks of
the seam contracts outside a patch's range (``patches.KNOWN_BREAKS``), the
releases the contracts read (``tests/contracts/test_sglang_seams.py``) and CI's
engine matrix (``scripts/test_engines_sglang.sh``). docs/notes/sglang_seams.md
has the file:line evidence of each shape.

A new release whose seams did not move is one line: ``RELEASES["0.5.24"] =
_like("0.5.23")``. One whose seams moved adds the new shape here, its
description in ``SHAPES``, and the patch for it in ``patches.py``.

``python3 kvcached/integration/sglang/profile.py ci`` prints CI's releases
(standard library and ``seam_table`` only).
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
    """How one SGLang release is shaped where kvcached patches it."""

    validate: str  # ServerArgs validation: "post_init" or "resolve_once"
    builder: str  # who builds pools and allocators: "mixin" (ModelRunnerKVCacheMixin) or "configurator"
    pool_class: str  # how the pool class is chosen: "mixin" names, "names" (configurator), "resolver"
    pool_buffers: str  # "one" _create_buffers, or "normal" (_create_buffers_normal carves the plain layout)
    swa: str  # hybrid sliding window: "none" (refused), "ring" (0.5.20: no SWAPrefillBudget), "budget"
    prefill: str  # prefill admission: "adder" (PrefillAdder reads available_size) or "budget"
    decode: str  # decode admission: "check_decode_mem" or "capacity" (allocator.check_decode_capacity)
    ci: bool = False  # run for real in CI (CPU)


def _like(release: str, **changes: object) -> Seams:
    """``release``'s seams with ``changes`` (not run in CI unless ``ci`` is given)."""
    return dataclasses.replace(RELEASES[release], **{"ci": False, **changes})  # type: ignore[arg-type]


RELEASES: Dict[str, Seams] = {}
RELEASES["0.5.15"] = Seams(
    validate="post_init",
    builder="mixin",
    pool_class="mixin",
    pool_buffers="one",
    swa="none",
    prefill="adder",
    decode="check_decode_mem",
    ci=True,  # the oldest supported release
)
RELEASES["0.5.15.post1"] = _like("0.5.15")
RELEASES["0.5.16"] = _like("0.5.15.post1", builder="configurator", pool_class="names", pool_buffers="normal")
RELEASES["0.5.17"] = _like("0.5.16")  # the H200 release (pins torch 2.11)
RELEASES["0.5.18"] = _like("0.5.17")
RELEASES["0.5.19"] = _like("0.5.18", validate="resolve_once", decode="capacity")
RELEASES["0.5.20"] = _like("0.5.19", swa="ring")
RELEASES["0.5.21"] = _like("0.5.20", swa="budget", prefill="budget")
RELEASES["0.5.22"] = _like("0.5.21", pool_class="resolver")
RELEASES["0.5.23"] = _like("0.5.22", ci=True)  # the newest supported release

_NO_MIXIN = "0.5.16+: the pools are built by KVCacheConfigurator; model_runner_kv_cache_mixin is gone"
_NO_CONFIGURATOR = "0.5.15: no KVCacheConfigurator; ModelRunnerKVCacheMixin._init_pools builds the pools"

# Why a seam of one shape breaks a patch written for another (the reasons of
# patches.KNOWN_BREAKS).
SHAPES: Dict[Tuple[str, object], str] = {
    ("validate", "post_init"): "before 0.5.19: no ServerArgs.resolve_once; __post_init__ validates "
    "(sglang-conflicts-post-init)",
    ("validate", "resolve_once"): "0.5.19+: ServerArgs validates in resolve_once() (sglang-conflicts); "
    "0.5.20+ declares its fields in arg_groups/fields",
    ("builder", "mixin"): _NO_CONFIGURATOR,
    ("builder", "configurator"): _NO_MIXIN,
    ("pool_class", "mixin"): _NO_CONFIGURATOR + " (sglang-pool-names-0.5.15)",
    ("pool_class", "names"): "0.5.16-0.5.21: the configurator builds the pools by module-level name "
    "(sglang-pool-names)",
    ("pool_class", "resolver"): "0.5.22+: _resolve_kv_pool_class picks the pool class and compares it with "
    "the module's pool classes (sglang-pools)",
    ("pool_buffers", "one"): "0.5.15: _create_buffers builds buffers and pointer tables in one "
    "(sglang-pool-buffers-0.5.15)",
    ("pool_buffers", "normal"): "0.5.16+: _create_buffers carves the plain layout in _create_buffers_normal, "
    "which the elastic pool overrides",
    ("swa", "none"): "before 0.5.20: the SWA composite has no _swa_req_ring; before 0.5.21: no "
    "SWAPrefillBudget (hybrid sliding-window models are refused)",
    ("swa", "ring"): "0.5.20: no SWAPrefillBudget, the composite's prefill admission reads available_size in "
    "PrefillAdder (hybrid sliding-window models are refused)",
    ("swa", "budget"): "0.5.21+: the SWA composite's admission goes through SWAPrefillBudget",
    ("prefill", "adder"): "before 0.5.21: PrefillAdder reads available_size (sglang-prefill-adder)",
    ("prefill", "budget"): "0.5.21+: PrefillAdder asks the allocator's create_prefill_budget (ElasticPrefillBudget)",
    ("decode", "check_decode_mem"): "before 0.5.19: check_decode_mem reads available_size (sglang-check-decode-mem)",
    ("decode", "capacity"): "0.5.19+: check_decode_mem asks the allocator's check_decode_capacity",
}


def releases_where(needs: Needs) -> List[str]:
    """The supported releases whose seams have the shape ``needs`` (all for None)."""
    return seam_table.releases_where(RELEASES, needs)


def why_not(needs: Needs, release: str) -> Optional[str]:
    """Why ``release`` lacks the shape ``needs`` (None when it has it)."""
    return seam_table.why_not(RELEASES, SHAPES, needs, release)


def version_range(needs: Needs):
    """The versions of the releases with the shape ``needs`` (a patch's range)."""

    def next_patch(newest: str) -> str:
        major, minor, patch = newest.split(".")[:3]
        return f"{major}.{minor}.{int(patch) + 1}"

    return seam_table.version_range(RELEASES, needs, next_patch)


def ci_versions() -> List[str]:
    """The releases CI runs for real."""
    return [r for r, s in RELEASES.items() if s.ci]


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("ci", "releases"):
        sys.exit("usage: profile.py ci|releases")
    print(" ".join(ci_versions() if what == "ci" else list(RELEASES)))
