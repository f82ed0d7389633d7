"""The harness both engines' seam contracts run on (``test_vllm_seams.py``, ``test_sglang_seams.py``):
what is the same for vLLM and SGLang is here once, each engine's contract tables stay in its module.

``EngineSeams`` holds one engine's side: its release sources (``scripts/engine_sources.py``, cached
outside the clone; a release not cached skips the test, or fails it when
``KVCACHED_REQUIRE_SEAM_SOURCES=1``), the parsed ``Tree`` of each release (parsed once per session),
the test cases of every patch x release (``pytest.param`` ids ``<patch>-<version>``; a known break
outside the patch's range is a strict xfail with its reason), the one failure message a broken
contract gives, and the seam x version table ``python tests/contracts/test_<engine>_seams.py [-v]``
prints.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest
from seam_ast import Finding, Tree

ROOT = Path(__file__).resolve().parents[2]  # the checkout: kvcached/, scripts/

Findings = List[Tuple[str, Finding]]

_engine_sources = None


def engine_sources():
    """scripts/engine_sources.py (not a package: loaded from its path)."""
    global _engine_sources
    if _engine_sources is None:
        spec = importlib.util.spec_from_file_location("engine_sources", ROOT / "scripts" / "engine_sources.py")
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        _engine_sources = mod
    return _engine_sources


class EngineSeams:
    """One engine's side of the harness.

    ``package``: the engine's import name and source (``"vllm"``); ``label``: its name in messages
    (``"vLLM"``); ``versions``: the releases read; ``patches``: kvcached's patches for it (objects with
    ``name`` and ``versions``), called late so collection imports nothing more than it needs;
    ``known_breaks``: ``(patch, key) -> why``; ``break_key``: the key of a release in that table
    (vLLM keys its breaks by minor, SGLang by release)."""

    def __init__(
        self,
        package: str,
        label: str,
        versions: Sequence[str],
        patches: Callable[[], List[Any]],
        known_breaks: Callable[[], Dict[Tuple[str, str], str]],
        break_key: Callable[[str], str] = lambda version: version,
    ) -> None:
        self.package = package
        self.label = label
        self.versions = list(versions)
        self.patches = patches
        self.known_breaks = known_breaks
        self.break_key = break_key
        self._trees: Dict[str, Tree] = {}

    # ------------------------------------------------------------- sources

    def tree_of(self, version: str, download: Optional[bool] = None) -> Tree:
        """The parsed source tree of ``version``; skips the test when it is not cached (fails when the
        sources are required: ``KVCACHED_REQUIRE_SEAM_SOURCES=1``)."""
        if version in self._trees:
            return self._trees[version]
        es = engine_sources()
        if download is None:
            download = os.environ.get("KVCACHED_REQUIRE_SEAM_SOURCES") == "1"
        try:
            root = es.ensure_source(self.package, version, download=download)
        except es.SourceUnavailable as e:
            # Under scripts/test.sh (CI) the sources are required: a contract that cannot run fails.
            (pytest.fail if download else pytest.skip)(
                f"{self.label} {version} source not cached ({e}); "
                f"python scripts/engine_sources.py {self.package} {version}, or KVCACHED_REQUIRE_SEAM_SOURCES=1"
            )
        self._trees[version] = Tree(root, self.package)
        return self._trees[version]

    # --------------------------------------------------------------- tests

    def patch_cases(self) -> list:
        """``(patch_name, version, in_range)`` for every patch x release; a known break outside the
        patch's range is a strict xfail (the contract must fail there, with that reason)."""
        from kvcached.integration.patch_base import parse_version

        cases = []
        breaks = self.known_breaks()
        for p in self.patches():
            for v in self.versions:
                in_range = parse_version(v) in p.versions
                why = breaks.get((p.name, self.break_key(v)))
                marks = [pytest.mark.xfail(strict=True, reason=why)] if why and not in_range else []
                cases.append(pytest.param(p.name, v, in_range, id=f"{p.name}-{v}", marks=marks))
        return cases

    def assert_holds(self, findings: Findings, version: str, context: str = "") -> None:
        """Every finding ok, or one failure naming the release, the context and each broken seam."""
        bad = [f"{label}: {f}" for label, f in findings if not f.ok]
        head = f"{self.label} {version}" + (f" ({context})" if context else "")
        assert not bad, f"{head}:\n  " + "\n  ".join(bad)

    def assert_patch_holds(self, patch_name: str, version: str, in_range: bool, findings: Findings) -> None:
        state = "claimed" if in_range else "not claimed"
        self.assert_holds(findings, version, f"{state} by {patch_name}")

    # --------------------------------------------------------------- table

    def print_table(
        self,
        groups: Iterable[Tuple[str, Optional[Any], Callable[[Tree, str], Findings]]],
        argv: Sequence[str] = (),
    ) -> int:
        """The seam x version table: per group (title, the versions it claims or None when it is
        version neutral, its findings on a tree), each release OK or BROKEN with the broken seams
        (every seam with ``-v``); ``--download`` fetches sources not cached."""
        from kvcached.integration.patch_base import parse_version

        download = "--download" in argv
        verbose = "-v" in argv
        for title, claims, findings_of in groups:
            print(f"## {title}")
            for v in self.versions:
                try:
                    tree = self.tree_of(v, download=download)
                except BaseException as e:  # pytest.skip outside pytest
                    print(f"  {v}: source not cached ({e})")
                    continue
                findings = findings_of(tree, v)
                bad = [(label, f) for label, f in findings if not f.ok]
                mark = "" if claims is None else (" [in range]" if parse_version(v) in claims else " [outside]")
                print(f"  {v}{mark} {'OK' if not bad else 'BROKEN'}")
                for label, f in findings if verbose else bad:
                    print(f"      {label}: {f}")
        return 0


def run_as_script(main: Callable[[], int]) -> None:
    """``python tests/contracts/test_<engine>_seams.py``: the source tree's kvcached, then the table."""
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
