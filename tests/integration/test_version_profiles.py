"""The version profiles (kvcached/integration/{vllm,sglang}/profile.py) are the one
table each engine's integration is keyed by: a release whose seams did not move is one
line, and README's version table and CI's matrix say what the profiles say."""

from __future__ import annotations

import importlib
import os
import re

from repo_paths import ROOT

README = os.path.join(ROOT, "README.md")


def test_a_new_minor_whose_seams_did_not_move_is_one_line_of_the_profile(monkeypatch):
    """profile.MINORS is the one table: a minor added with the newest's seams extends the
    supported range, every patch of that shape and the contracts' versions; nothing else."""
    from kvcached.integration.vllm import profile, versions

    before = {p.name: p.versions for p in versions.all_patches()}
    monkeypatch.setitem(profile.MINORS, "0.35", profile._like("0.34", source="0.35.0"))  # the one line
    try:
        v = importlib.reload(versions)
        assert str(v.SUPPORTED) == ">=0.26,<0.36" and v.CHECKED_MINORS[-1] == "0.35"
        assert profile.sources()[-1] == "0.35.0" and profile.ci_versions() == ["0.26.0", "0.29.0", "0.32.0"]
        for p in v.all_patches():
            if (0, 34, 0) in before[p.name]:
                assert (0, 35, 0) in p.versions and p.versions.low == before[p.name].low, p.name
            else:
                assert p.versions == before[p.name], p.name
        # A patch of another shape breaks on 0.35 as it does on 0.34, for the same reason.
        assert v.KNOWN_BREAKS[("block_owner_none_0_29", "0.35")] == v.KNOWN_BREAKS[("block_owner_none_0_29", "0.34")]
    finally:
        monkeypatch.undo()
        importlib.reload(versions)


def test_readme_version_table_has_the_profiles_rows():
    """README's vLLM rows: every release the contracts read, once; "CPU engine in CI" on
    exactly the profile's CI releases; the default matrix quoted as the profile says."""
    from kvcached.integration.vllm import profile

    readme = open(README).read()
    rows = [ln.split("|")[2:4] for ln in readme.splitlines() if ln.startswith("| vLLM |")]
    listed = [v.strip() for cell, _ in rows for v in cell.split(",")]
    assert sorted(listed) == sorted(profile.sources()), "README's vLLM rows differ from profile.MINORS"
    in_ci = sorted(v.strip() for cell, what in rows if "CPU engine in CI" in what for v in cell.split(","))
    assert in_ci == sorted(profile.ci_versions())
    m = re.search(r"`KVCACHED_VLLM_VERSIONS` \(default `([^`]*)`", readme)
    assert m and m.group(1).split() == profile.ci_versions()


def test_a_new_sglang_release_whose_seams_did_not_move_is_one_line_of_the_profile(monkeypatch):
    from kvcached.integration.sglang import patches, profile

    before = {p.name: p.versions for p in patches.all_patches()}
    monkeypatch.setitem(profile.RELEASES, "0.5.24", profile._like("0.5.23"))  # the one line
    try:
        v = importlib.reload(patches)
        assert str(v.SUPPORTED) == ">=0.5.15,<0.5.25" and v.CHECKED_VERSIONS[-1] == "0.5.24"
        for p in v.all_patches():
            if (0, 5, 23) in before[p.name]:
                assert (0, 5, 24) in p.versions and p.versions.low == before[p.name].low, p.name
            else:
                assert p.versions == before[p.name], p.name
        assert v.KNOWN_BREAKS[("sglang-pool-names", "0.5.24")] == v.KNOWN_BREAKS[("sglang-pool-names", "0.5.23")]
    finally:
        monkeypatch.undo()
        importlib.reload(patches)


def test_readme_sglang_ci_row_is_the_profiles():
    from kvcached.integration.sglang import profile

    readme = open(README).read()
    rows = [ln.split("|")[2:4] for ln in readme.splitlines() if ln.startswith("| SGLang |")]
    in_ci = [v.strip() for cell, what in rows if "CPU engine in CI" in what for v in cell.split(",")]
    assert in_ci == profile.ci_versions()
    m = re.search(r"`KVCACHED_SGLANG_VERSIONS`, default `([^`]*)`", readme)
    assert m and m.group(1).split() == profile.ci_versions()
