"""The model family table (kvcached/integration/families.py) is the one place a family is
declared: README's family table, the family engine tests' cases, the tiny models, vLLM's
served spec classes and both engines' refusals say what it says."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from types import SimpleNamespace

import pytest

from kvcached.errors import InvalidArgumentError
from kvcached.integration import families
from repo_paths import ROOT

README = os.path.join(ROOT, "README.md")


def test_readme_family_table_is_the_tables():
    """README's table is rendered from the family table: regenerate it with
    ``python3 kvcached/integration/families.py readme`` after editing an entry."""
    text = open(README).read()
    assert families.README_START in text and families.README_END in text, "README lost the family table markers"
    block = text[text.index(families.README_START) : text.index(families.README_END) + len(families.README_END)]
    assert block == families.readme_section(), (
        "README.md's family table differs from kvcached/integration/families.py; regenerate it with\n"
        "  python3 kvcached/integration/families.py readme"
    )


def test_every_family_is_named_once_and_every_spec_class_marks_one_family():
    keys = [f.key for f in families.FAMILIES]
    assert len(keys) == len(set(keys))
    specs = [s for f in families.FAMILIES for s in f.vllm_specs]
    assert len(specs) == len(set(specs)), "a vLLM spec class marks one family (its refusal names that family)"
    for f in families.FAMILIES:
        for engine in families.ENGINES:
            for device in families.DEVICES:
                st = f.status(engine, device)
                assert st.state in (families.PROVEN, families.CLASSES, families.NOT_RUN, families.REFUSED), f.key
                assert not st.ci or (device == "cpu" and st.state == families.PROVEN), (f.key, engine, device)
                assert st.state != families.PROVEN or st.releases(engine), (f.key, engine, device)


def test_ci_claims_are_releases_ci_runs():
    """A status proven "in CI" names only releases the engine's profile runs in CI."""
    from kvcached.integration.sglang import profile as sglang_profile
    from kvcached.integration.vllm import profile as vllm_profile

    in_ci = {
        "vllm": {".".join(v.split(".")[:2]) for v in vllm_profile.ci_versions()},
        "sglang": set(sglang_profile.ci_versions()),
    }
    for f in families.FAMILIES:
        for engine in families.ENGINES:
            st = f.status(engine, "cpu")
            if st.ci:
                assert set(st.releases(engine)) <= in_ci[engine], (f.key, engine, st.releases(engine))


def test_every_builder_is_a_tiny_model_and_every_tiny_model_a_familys():
    from kvcached.testing import tiny_families

    named = {b for f in families.FAMILIES for b in f.builders}
    assert named == set(tiny_families.BUILDERS), "a builder no family names, or a family without its builder"
    for f in families.FAMILIES:
        for case in f.cases:
            assert case.engine in families.ENGINES and case.builder in f.builders, (f.key, case)


def test_the_tiny_family_command_builds_each_engines_layout(monkeypatch, tmp_path):
    """``--sglang`` reaches the builder: vLLM's tiny Qwen3-Next does not load in SGLang (no
    ``full_attention_interval``, dense MLPs), so the GPU step of SGLang builds its own."""
    from kvcached.testing import tiny_families

    calls = []
    monkeypatch.setattr(tiny_families, "build_tiny_family", lambda path, family, **kw: calls.append(kw) or path)
    for flags in ([], ["--sglang"]):
        assert tiny_families.main(["qwen3_next", str(tmp_path), "--gpu-shapes", *flags]) == 0
    assert [(kw["sglang"], kw["gpu_shapes"]) for kw in calls] == [(False, True), (True, True)]


def _workload_keys(path: str) -> set:
    """The keys of the dict literal assigned to ``WORKLOADS`` in a test module."""
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(getattr(t, "id", None) == "WORKLOADS" for t in targets) and isinstance(node.value, ast.Dict):
            return {ast.literal_eval(k) for k in node.value.keys}
    raise AssertionError(f"{path} has no WORKLOADS dict")


@pytest.mark.parametrize("engine", families.ENGINES)
def test_the_family_tests_have_a_workload_for_every_case(engine):
    """The family engine tests run the table's cases (``families.cases``); each needs its workload."""
    keys = _workload_keys(f"tests/engines/{engine}/test_model_families.py")
    assert keys == set(families.cases(engine))


def test_vllm_serves_the_spec_classes_of_the_families_it_serves():
    from kvcached.integration.vllm import kv_layout, versions

    served = {s for f in families.FAMILIES if f.served("vllm") for s in f.vllm_specs}
    by_patch = {s for f in families.FAMILIES for s in f.vllm_specs if f.vllm_patches}
    assert set(families.vllm_served_specs()) == served - by_patch
    assert set(families.vllm_served_specs()) <= set(kv_layout.SUPPORTED_SPECS) <= served
    patches = {p.name for p in versions.all_patches()}
    for f in families.FAMILIES:
        assert set(f.vllm_patches) <= patches, f.key
        for p in f.vllm_patches:
            assert families.vllm_specs_of_patch(p) == f.vllm_specs


def test_seam_notes_name_every_spec_class_vllm_refuses():
    notes = open(os.path.join(ROOT, "docs/notes/vllm_seams.md")).read()
    refused = [s for f in families.FAMILIES if not f.served("vllm") for s in f.vllm_specs]
    assert refused and [s for s in refused if f"`{s}`" not in notes] == []


def _spec(name: str, **kw) -> object:
    return type(name, (SimpleNamespace,), {})(page_size_bytes=64 << 10, block_size=128, **kw)


def _kv_config(*specs) -> SimpleNamespace:
    groups = [SimpleNamespace(layer_names=[f"g{i}.l0"], kv_cache_spec=s) for i, s in enumerate(specs)]
    return SimpleNamespace(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("fam", [f for f in families.FAMILIES if not f.served("vllm")], ids=lambda f: f.key)
def test_vllm_refuses_a_family_refused_everywhere_naming_its_feature(fam):
    from kvcached.integration.vllm import kv_layout

    for spec in fam.vllm_specs:
        with pytest.raises(InvalidArgumentError, match=re.escape(f"does not support {fam.feature} yet")) as e:
            kv_layout.refuse_unsupported_model(_kv_config(_spec("FullAttentionSpec"), _spec(spec)))
        assert "\n" not in str(e.value)


def test_a_family_refused_on_a_device_kind_is_refused_there_by_both_engines(monkeypatch):
    """A family's state refused on a GPU for both engines (Qwen3-Next's, as it stood until
    SGLang's GPU run): refused by vLLM's worker and SGLang's state pool alike, each naming
    the table's reason; served on the CPU."""
    from kvcached.integration.sglang import conflicts
    from kvcached.integration.vllm import kv_layout

    monkeypatch.delenv("KVCACHED_ALLOW_UNSUPPORTED", raising=False)
    hybrid = dataclasses.replace(families.family("hybrid_state"), sglang_gpu=families.refused("not run on a GPU"))
    monkeypatch.setattr(families, "FAMILIES", tuple(hybrid if f.key == hybrid.key else f for f in families.FAMILIES))
    cfg = _kv_config(_spec("FullAttentionSpec"), _spec("MambaSpec"))
    with pytest.raises(InvalidArgumentError) as e:
        kv_layout.refuse_unproven_on_device(cfg, "cuda:0")
    assert f"{hybrid.feature} on a GPU yet ({hybrid.vllm_gpu.text})" in str(e.value)
    with pytest.raises(conflicts.UnsupportedConfigurationError) as e:
        conflicts.refuse_unproven_on_device("MambaPool", "cuda:0")
    assert f"{hybrid.feature} is not supported on a GPU yet ({hybrid.sglang_gpu.text})" in str(e.value)
    assert "KVCACHED_ALLOW_UNSUPPORTED=1" in str(e.value) and "\n" not in str(e.value)
    kv_layout.refuse_unproven_on_device(cfg, "cpu")
    conflicts.refuse_unproven_on_device("MambaPool", "cpu")
    conflicts.refuse_unproven_on_device("MHATokenToKVPool", "cuda:0")
    monkeypatch.setenv("KVCACHED_ALLOW_UNSUPPORTED", "1")
    conflicts.refuse_unproven_on_device("MambaPool", "cuda:0")


def test_a_gpu_status_is_per_engine(monkeypatch):
    """Qwen3-Next's state on a GPU as the table has it: SGLang's run was identical to native
    (served), vLLM's are owed on the H200 (refused); each engine reads its own cell."""
    from kvcached.integration.sglang import conflicts
    from kvcached.integration.vllm import kv_layout

    monkeypatch.delenv("KVCACHED_ALLOW_UNSUPPORTED", raising=False)
    hybrid = families.family("hybrid_state")
    assert hybrid.sglang_gpu.state == families.PROVEN and hybrid.vllm_gpu.state == families.REFUSED
    conflicts.refuse_unproven_on_device("MambaPool", "cuda:0")
    with pytest.raises(InvalidArgumentError, match=r"state on a GPU yet \(on the H200"):
        kv_layout.refuse_unproven_on_device(_kv_config(_spec("FullAttentionSpec"), _spec("MambaSpec")), "cuda:0")


def test_a_new_family_is_one_entry(monkeypatch):
    """One entry: its spec class served by vLLM (or refused naming it), its pool in SGLang's
    list, its cases in the family tests, its row in README's table, its GPU refusal."""
    from kvcached.integration.vllm import kv_layout

    new = families.Family(
        "new_family",
        "a new family (Some-Model)",
        "some new attention",
        vllm_cpu=families.ci("a tiny Some-Model"),
        vllm_gpu=families.refused("not run on a GPU"),
        sglang_cpu=families.not_run(),
        sglang_gpu=families.not_run(),
        vllm_specs=("SomeNewSpec",),
        sglang_pools=("SomeNewPool",),
        builders=("some_model",),
        cases=(families.Case("vllm", "some-model", "some_model"),),
    )
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, new))
    assert "SomeNewSpec" in families.vllm_served_specs() and "SomeNewPool" in families.sglang_pools()
    assert families.cases("vllm")["some-model"].builder == "some_model"
    row = families.readme_rows()[-1]
    assert row[0] == new.name and row[1].startswith("in CI (") and "a tiny Some-Model" in row[1]
    with pytest.raises(InvalidArgumentError, match=r"some new attention on a GPU yet \(not run on a GPU\)"):
        kv_layout.refuse_unproven_on_device(_kv_config(_spec("SomeNewSpec")), "cuda:0")
    # Refused everywhere instead: vLLM's refusal names it.
    gone = dataclasses.replace(new, vllm_cpu=families.refused())
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES[:-1], gone))
    assert "SomeNewSpec" not in families.vllm_served_specs()
    with pytest.raises(InvalidArgumentError, match=r"does not support some new attention yet \(KV cache spec SomeNew"):
        kv_layout.refuse_unsupported_model(_kv_config(_spec("SomeNewSpec")))
