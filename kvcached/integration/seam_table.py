"""What the version profiles (``vllm/profile.py``, ``sglang/profile.py``) have in common:
a table of an engine's releases (oldest first), each a frozen dataclass of seam shapes,
and a patch's need for one shape of one seam.

Standard library and ``patch_base`` only, so a profile runs as a script on a machine
with nothing installed (CI's engine matrix reads it before any venv exists).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kvcached.integration.patch_base import VersionRange, parse_version

# What a patch needs: (seam, shape), or None for every supported release.
Needs = Optional[Tuple[str, object]]


def releases_where(table: Mapping[str, Any], needs: Needs) -> List[str]:
    """The releases of ``table`` whose seams have the shape ``needs`` (all for None)."""
    if needs is None:
        return list(table)
    seam, shape = needs
    return [r for r, s in table.items() if getattr(s, seam) == shape]


Shapes = Dict[Tuple[str, object], str]  # (seam, shape) -> what that shape is, for a break's reason


def why_not(table: Mapping[str, Any], shapes: Shapes, needs: Needs, release: str) -> Optional[str]:
    """Why ``release`` lacks the shape ``needs`` (its own shape's description in
    ``shapes``), or None when it has it."""
    if needs is None:
        return None
    seam, _ = needs
    have = getattr(table[release], seam)
    return None if (seam, have) == tuple(needs) else shapes[(seam, have)]


def version_range(table: Mapping[str, Any], needs: Needs, after_newest: Callable[[str], str]) -> VersionRange:
    """The versions of the releases with the shape ``needs``, from the first to just
    before the next release of another version (``after_newest(newest)`` past the table's
    end). They must be consecutive: a shape that comes back would need two ranges."""
    releases = releases_where(table, needs)
    every = list(table)
    i = every.index(releases[0]) if releases else 0
    if not releases or every[i : i + len(releases)] != releases:
        raise ValueError(f"the releases with {needs} are not consecutive: {releases}")
    last = parse_version(releases[-1])
    later = [r for r in every[i + len(releases) :] if parse_version(r) > last]
    return VersionRange.parse(f">={releases[0]},<{later[0] if later else after_newest(every[-1])}")
