"""The vLLM integration's engine-independent parts, with the real data plane:
the interpreter-start hook, the patch manager, the KV layout plan, the
worker-side executor and the execution fence. The real-engine proof is in
tests/engines/vllm (run with the vLLM venv by scripts/test_engines.sh)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest

from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import (
    BasePatch,
    PatchError,
    PatchManager,
    UnsupportedVersionError,
    VersionRange,
    parse_version,
)
from kvcached.integration.vllm.kv_layout import KVLayoutPlan, Placement, read_layer_tensors
from kvcached.integration.vllm.kv_regions import align_layer_regions

KiB, MiB = 1 << 10, 1 << 20


def _run(code: str, env_extra: dict, path: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENABLE_KVCACHED", "KVCACHED_"))}
    env.update(env_extra)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


# ------------------------------------------------------------ autopatch hook

FINDER = "import sys; print(any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))"


@pytest.mark.parametrize(
    "env, expect",
    [
        ({}, "False"),
        ({"ENABLE_KVCACHED": "true"}, "True"),  # ENABLE_KVCACHED alone is enough
        ({"ENABLE_KVCACHED": "1", "KVCACHED_AUTOPATCH": "1"}, "True"),
        ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "0"}, "False"),
        ({"ENABLE_KVCACHED": "false"}, "False"),
    ],
)
def test_hook_is_installed_at_interpreter_start_only_when_enabled(env, expect):
    import kvcached

    installed = os.path.realpath(kvcached.__file__).startswith(
        os.path.realpath(__import__("sysconfig").get_paths()["purelib"])
    )
    if not installed:
        pytest.skip("kvcached is not installed as a wheel: no .pth at interpreter start")
    out = _run(FINDER, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expect


def test_post_import_hook_runs_after_the_module_body_and_again_after_reload(tmp_path):
    pkg = tmp_path / "fakeeng"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("def f():\n    return 'orig'\nLOADED = True\n")
    out = _run(
        """
        import importlib
        from kvcached import autopatch
        from kvcached.integration.patch_base import mark
        seen = []
        def hook(m):
            assert m.LOADED                      # the body ran before the hook
            if mark(m, "p"):                      # idempotent per module body
                m.f = lambda: "patched"
            seen.append(m.__name__)
        autopatch.register_post_import_hook("fakeeng.sub.mod", hook)
        import fakeeng.sub.mod as mod
        assert mod.f() == "patched", mod.f()
        importlib.reload(mod)                     # fresh functions: patched again
        assert mod.f() == "patched", mod.f()
        seen2 = []
        autopatch.register_post_import_hook("fakeeng.sub.mod", lambda m: seen2.append(1))  # already loaded: now
        print(len(seen), len(seen2), mod.__loader__.exec_module.__qualname__)
        """,
        {},
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    n, n2, qual = out.stdout.split()
    assert (n, n2) == ("2", "1")
    assert "PostImport" not in qual  # the loader's own method is back


def _fake_vllm(root, version: str) -> str:
    pkg = root / f"v{version}" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return str(root / f"v{version}")


def test_unsupported_vllm_stops_at_import_with_one_line_naming_the_range(tmp_path):
    from kvcached.integration.vllm.versions import SUPPORTED

    path = _fake_vllm(tmp_path, "0.25.0")
    code = """
        from kvcached import autopatch
        autopatch.install()   # what the .pth does at interpreter start
        import vllm
        print("imported")
    """
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 1 and "imported" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # SystemExit: no traceback
    assert lines[0].startswith(f"kvcached supports vLLM {SUPPORTED} but vLLM 0.25.0 is installed")
    assert "unset ENABLE_KVCACHED" in lines[0] and "KVCACHED_ALLOW_UNSUPPORTED=1" in lines[0]
    # The plugin entry point (no import hook) stops the same way.
    out = _run(
        "import vllm\nfrom kvcached.integration.vllm import plugin\nplugin.register()",
        {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "0"},
        path,
    )
    assert out.returncode == 1 and f"kvcached supports vLLM {SUPPORTED}" in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr
    # Without kvcached enabled the same vLLM imports.
    out = _run(code.replace("autopatch.install()", "pass"), {}, path)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr


def test_allow_unsupported_patches_anyway_with_one_warning(tmp_path):
    from kvcached.integration.vllm import versions

    code = """
        from kvcached import autopatch
        autopatch.install()
        import vllm
        from kvcached.integration.vllm import plugin
        plugin.register()   # a second activation: no second warning
        m = plugin.manager()
        print(".".join(map(str, m.patch_version)), sorted({r.status for r in m.results.values()}))
    """
    env = {"ENABLE_KVCACHED": "true", "KVCACHED_ALLOW_UNSUPPORTED": "1"}
    out = _run(code, env, _fake_vllm(tmp_path, "0.25.0"))
    assert out.returncode == 0, out.stderr
    low = ".".join(map(str, versions.SUPPORTED.low))
    assert out.stdout.split()[0] == low  # the patches of the nearest supported version
    warnings = [ln for ln in out.stderr.splitlines() if "KVCACHED_ALLOW_UNSUPPORTED" in ln]
    assert len(warnings) == 1, out.stderr
    assert "the seams of vLLM 0.25 were never checked" in warnings[0]
    # Above the range: the newest minor's patches.
    out = _run(code, env, _fake_vllm(tmp_path, "0.99.1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "0.34.0" and "the seams of vLLM 0.99 were never checked" in out.stderr
    # A typo in the switch stops start-up.
    out = _run(code, {**env, "KVCACHED_ALLOW_UNSUPPORTED": "yess"}, _fake_vllm(tmp_path / "t", "0.25.0"))
    assert out.returncode != 0 and "KVCACHED_ALLOW_UNSUPPORTED='yess' is not a boolean" in out.stderr


def test_unsupported_warning_names_the_seams_known_to_break_on_a_checked_minor():
    """A checked minor outside the range (as 0.29 would be if the range started at
    0.30): the warning names the applied patches whose contracts fail there."""
    from kvcached.integration.vllm import versions

    text = versions.unsupported_warning("0.29.0", (0, 29, 0), (0, 30, 0))
    applied = {p.name for p in versions.all_patches() if (0, 30, 0) in p.versions}
    broken = sorted(p for (p, m) in versions.KNOWN_BREAKS if m == "0.29" and p in applied)
    assert broken == ["block_owner_by_reference", "kv_blocks_per_tensor"]
    assert f"known to fail on vLLM 0.29: {', '.join(broken)}" in text
    # Every checked minor is supported now: each one's patches all fit it.
    for minor in versions.CHECKED_MINORS:
        v = (0, int(minor.split(".")[1]), 0)
        assert v in versions.SUPPORTED
        assert "every seam contract of these patches holds" in versions.unsupported_warning(minor, v, v)


def test_supported_vllm_activates_and_names_the_instance(tmp_path):
    path = _fake_vllm(tmp_path, "0.33.0")
    out = _run(
        """
        import os
        from kvcached import autopatch
        autopatch.install()
        import vllm
        from kvcached.integration.vllm import plugin
        plugin.register()   # the entry point: idempotent after the hook
        m = plugin.manager()
        print(os.environ["KVCACHED_IPC_NAME"] == "kvcached_vllm_%d" % os.getpid())
        print(sorted({r.status for r in m.results.values()}))
        print(m.results["cpu_worker_startup_check_0_32"].status)
        """,
        {"ENABLE_KVCACHED": "true"},
        path,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "True"
    assert lines[1] == "['pending', 'skipped']"  # engine modules not imported; the 0.32-only patch skipped
    assert lines[2] == "skipped"


def test_plugin_entry_point_warns_when_the_import_hook_is_missing(tmp_path):
    path = _fake_vllm(tmp_path, "0.32.0")
    code = """
        import vllm
        from kvcached.integration.vllm import plugin
        plugin.register()   # vLLM's plugin loader calls this in every process
        print(sorted({r.status for r in plugin.manager().results.values()}))
    """
    out = _run(code, {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "0"}, path)
    assert out.returncode == 0, out.stderr
    assert "ENABLE_KVCACHED is set but the interpreter-start hook is missing (KVCACHED_AUTOPATCH=0)" in out.stderr
    assert out.stdout.strip() == "['pending', 'skipped']"  # patched from the entry point anyway (0.34's skipped)
    out = _run(code.replace("print(sorted", "print(len(plugin.manager().results), sorted"), {}, path)
    assert out.returncode == 0 and out.stdout.startswith("0 "), out.stdout + out.stderr  # not enabled: nothing


# ------------------------------------------------------------- patch manager


def _manager(version: str, spec: str = ">=0.32,<0.34") -> PatchManager:
    return PatchManager("Eng", VersionRange.parse(spec), lambda: version)


def test_version_parsing_and_ranges():
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("v0.33") == (0, 33, 0)
    r = VersionRange.parse(">=0.32,<0.34")
    assert (0, 32, 0) in r and (0, 33, 9) in r
    assert (0, 31, 9) not in r and (0, 34, 0) not in r
    assert str(r) == ">=0.32,<0.34"
    assert r.clamp((0, 29, 1)) == (0, 32, 0) and r.clamp((0, 35, 2)) == (0, 33, 0) and r.clamp((0, 33, 4)) == (0, 33, 4)
    for bad in ("0.32", ">=0.34,<0.32", "<0.3"):
        with pytest.raises(ValueError):
            VersionRange.parse(bad)


def test_patches_apply_once_in_range_and_when_their_module_loads():
    hooks = {}
    calls = []
    mod = types.ModuleType("fake_target")
    m = _manager("0.32.1")
    m.register_patch(BasePatch("a", "fake_target", VersionRange.parse(">=0.32,<0.34"), lambda mm: calls.append("a")))
    m.register_patch(BasePatch("b", "fake_target", VersionRange.parse(">=0.33,<0.34"), lambda mm: calls.append("b")))
    m.activate(lambda name, fn: hooks.setdefault(name, []).append(fn))
    m.activate(lambda name, fn: hooks.setdefault(name, []).append(fn))  # second activation: no new hooks
    assert m.results["a"].status == "pending" and m.results["b"].status == "skipped"
    assert len(hooks["fake_target"]) == 1
    hooks["fake_target"][0](mod)
    hooks["fake_target"][0](mod)  # the .pth hook and the plugin both fire: applied once
    assert calls == ["a"]
    assert m.results["a"].status == "applied"
    assert "applied: a" in m.summary() and "skipped: b" in m.summary()
    with pytest.raises(ValueError):
        m.register_patch(BasePatch("a", "x", VersionRange.parse(">=0.32,<0.34"), lambda mm: None))


def test_unsupported_version_and_failing_patch_messages():
    with pytest.raises(UnsupportedVersionError, match=r"supports Eng >=0.32,<0.34 but Eng 0.34.0 is installed"):
        _manager("0.34.0").activate(lambda n, f: None)
    m = _manager("0.34.0")  # allowed anyway: the patches of the nearest supported version (0.33)
    m.register_patch(BasePatch("old", "t", VersionRange.parse(">=0.32,<0.33"), lambda mm: None))
    m.register_patch(BasePatch("new", "t", VersionRange.parse(">=0.33,<0.34"), lambda mm: None))
    m.activate(lambda n, f: None, allow_unsupported=True)
    assert (m.version, m.patch_version) == ((0, 34, 0), (0, 33, 0))
    assert m.results["old"].status == "skipped" and m.results["new"].status == "pending"

    def broken(mm):
        raise AttributeError("BlockPool")

    m = _manager("0.32.0")
    m.register_patch(BasePatch("swap_pool", "t", VersionRange.parse(">=0.32,<0.34"), broken, "swap the pool"))
    hooks = {}
    m.activate(lambda name, fn: hooks.setdefault(name, fn))
    with pytest.raises(
        PatchError, match=r"patch 'swap_pool' \(swap the pool\) failed on t of Eng 0.32.0: AttributeError"
    ):
        hooks["t"](types.ModuleType("t"))
    assert m.results["swap_pool"].status == "failed"


def test_vllm_034_gets_its_own_patches_and_older_ones_do_not():
    from kvcached.integration.vllm import versions

    def active(v):
        return {p.name for p in versions.all_patches() if v in p.versions}

    only_034 = {
        "block_owner_weakref",
        "extensible_kv_cache_off",
        "allocate_kv_cache_by_name:vllm.v1.worker.cpu.attn_utils",
    }
    assert only_034 <= active((0, 34, 0)) and not only_034 & active((0, 33, 0))
    assert "block_owner_by_reference" in active((0, 30, 0)) and "block_owner_by_reference" not in active((0, 34, 1))
    assert "cpu_worker_startup_check_0_32" in active((0, 30, 0)) and (0, 26, 0) in versions.CPU_STARTUP_CHECK


def test_extensible_kv_cache_is_turned_off_when_unset_and_refused_when_asked_for():
    from kvcached.integration.vllm.config_patches import UnsupportedConfiguration, patch_extensible_kv_cache_off

    settled = []

    class VllmConfig:  # vLLM 0.34's shape (config/vllm.py)
        def __init__(self, requested):
            self.cache_config = SimpleNamespace(enable_extensible_kv_cache=requested)

        def _resolve_extensible_kv_cache(self):
            c = self.cache_config
            if getattr(c, "_extensible_kv_cache_resolved", False):
                return
            c._extensible_kv_cache_resolved = True
            if c.enable_extensible_kv_cache is None:
                c.enable_extensible_kv_cache = True  # vLLM's CUDA default
            settled.append(c.enable_extensible_kv_cache)

    patch_extensible_kv_cache_off(types.SimpleNamespace(VllmConfig=VllmConfig))
    for requested in (None, False):
        vc = VllmConfig(requested)
        vc._resolve_extensible_kv_cache()
        assert vc.cache_config.enable_extensible_kv_cache is False
    assert settled == [False, False]
    vc = VllmConfig(True)
    with pytest.raises(UnsupportedConfiguration, match=r"--enable-extensible-kv-cache") as e:
        vc._resolve_extensible_kv_cache()
    assert "\n" not in str(e.value) and not isinstance(e.value, ValueError)  # pydantic would wrap a ValueError
    vc.cache_config._extensible_kv_cache_resolved = True  # settled once: derived configs are left alone
    vc._resolve_extensible_kv_cache()


def test_allocate_kv_cache_wrapper_takes_allocate_none_and_refuses_an_allocator():
    from kvcached.integration.vllm import worker_kv

    calls = []

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None, allocate=None):
        calls.append(allocate)
        return {}

    wrapped = worker_kv._wrap_allocate(allocate_kv_cache)
    empty = SimpleNamespace(kv_cache_tensors=[])  # no tensors: vLLM's own function runs
    assert wrapped(empty, "cpu", "LBHNC", None, allocate=None) == {} and calls == [None]

    def extensible_allocate(n):
        return None

    with pytest.raises(InvalidArgumentError, match=r"extensible_allocate.*--no-enable-extensible-kv-cache") as e:
        wrapped(empty, "cpu", "LBHNC", [16], allocate=extensible_allocate)
    assert "\n" not in str(e.value) and calls == [None]


def test_vllm_patch_table_covers_every_seam():
    from kvcached.integration.vllm import versions

    names = {p.name: p for p in versions.all_patches()}
    for needed in (
        "elastic_block_pool",
        "scheduler_lifecycle",
        "allocate_slots_rollback",
        "worker_allocate_kv_cache",
        "cpu_worker_capacity",
        "gpu_worker_capacity",
        "cpu_worker_startup_check_0_32",
        "engine_core_idle_return",
        "runner_v1_kv_buffer_0_28",
        "runner_v2_kv_buffer_0_28",
    ):
        assert needed in names
    for mod in versions.ALLOCATE_KV_CACHE_IMPORTERS:
        assert f"allocate_kv_cache_by_name:{mod}" in names
    assert (0, 32, 0) in names["cpu_worker_startup_check_0_32"].versions
    assert (0, 33, 0) not in names["cpu_worker_startup_check_0_32"].versions


def test_every_supported_minor_gets_exactly_one_patch_per_seam_shape():
    """Where vLLM changed a seam, each shape has its own patch: every supported minor
    gets exactly one of them (a gap would run a patch on a shape it was not written for)."""
    from kvcached.integration.vllm import versions

    shapes = {
        "block owner": {"block_owner_none_0_29", "block_owner_by_reference", "block_owner_weakref"},
        "KVCacheTensor": {"kv_tensors_shared_by_0_28", "kv_tensors_by_layers"},
        "KV buffer": {"runner_v1_kv_buffer_0_28", "worker_allocate_kv_cache"},
    }
    for minor in range(26, 35):
        active = {p.name for p in versions.all_patches() if (0, minor, 0) in p.versions}
        for seam, names in shapes.items():
            assert len(active & names) == 1, (minor, seam, active & names)
        # The V2 runner has its own patch where the runners allocate; blocks per tensor where allocate_kv_cache does.
        assert ("runner_v2_kv_buffer_0_28" in active) == (minor <= 28)
        assert len(active & {"kv_blocks_uniform_0_29", "kv_blocks_per_tensor"}) == (minor >= 29)
        assert ("no_reuse_watchers_0_29" in active) == (minor <= 29)


# -------------------------------------------------------------- layout plan


def test_plan_lbhnc_tiny_llama_is_one_page_per_layer():
    # The tiny model as vLLM lays it out on CPU: 512 blocks of 64 KiB, layer 1 at 32 MiB.
    plan = KVLayoutPlan(64 * MiB, 512, 64 * KiB, 128, 2 * MiB, [Placement(0, 2, 32 * MiB, 64 * KiB, 64 * KiB)])
    assert plan.num_logical_pages == 16 and plan.cell_size == 512
    assert plan.physical_pages(0) == (0, 16)
    assert plan.physical_pages(15) == (15, 31)
    assert plan.physical_pages_per_logical_page() == 2
    with pytest.raises(InvalidArgumentError):
        plan.physical_pages(16)


def test_plan_block_outermost_maps_consecutive_pages():
    # BLHNC: one block = both layers' 64 KiB, block stride 128 KiB, layer stride 64 KiB.
    plan = KVLayoutPlan(64 * MiB, 512, 64 * KiB, 128, 2 * MiB, [Placement(0, 2, 64 * KiB, 128 * KiB, 64 * KiB)])
    assert plan.physical_pages(0) == (0, 1)
    assert plan.physical_pages(3) == (6, 7)


def test_plan_unaligned_layer_regions_share_pages():
    # 10 blocks of 48 KiB per layer: layer 1 starts at 480 KiB, inside page 3 (128 KiB pages).
    plan = KVLayoutPlan(960 * KiB, 10, 48 * KiB, 16, 128 * KiB, [Placement(0, 2, 480 * KiB, 48 * KiB, 48 * KiB)])
    # Page geometry: blocks that straddle a 128 KiB boundary are skipped.
    first, end = plan.geometry.block_range(0)
    assert (first, end) == (0, 2)
    assert plan.physical_pages(0) == (0, 3, 4)  # layer 1's blocks 0-1 span 480-576 KiB
    shared = set(plan.physical_pages(plan.num_logical_pages - 1)) & set(plan.physical_pages(0))
    assert shared == {3}  # layer 0's tail and layer 1's head


def _layer_outer_config(num_blocks: int, block: int, groups: int, layers: int) -> SimpleNamespace:
    """What vLLM 0.29+ gives a hybrid model in a layer-outermost layout (Qwen3-Next:
    attention and state groups of evened-out blocks): per group one tensor of
    ``layers`` layers, layer l at l * num_blocks * block, the groups aliased from byte 0."""
    spec = SimpleNamespace(page_size_bytes=block, block_size=16, num_kv_heads=2)
    gs = [SimpleNamespace(layer_names=[f"g{g}.l{i}" for i in range(layers)], kv_cache_spec=spec) for g in range(groups)]
    size = layers * num_blocks * block
    tensors = [
        SimpleNamespace(size=size, layers=g.layer_names, layer_stride=num_blocks * block, block_stride=block, offset=0)
        for g in gs
    ]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=gs)


def _plan(cfg: SimpleNamespace, page: int) -> KVLayoutPlan:
    size, placements, tokens = read_layer_tensors(cfg.kv_cache_tensors, cfg.kv_cache_groups, cfg.num_blocks, page)
    return KVLayoutPlan(size, cfg.num_blocks, max(p.block_bytes for p in placements), tokens, page, placements)


def test_aligned_layer_regions_make_every_logical_page_one_physical_page_per_layer():
    # A real Qwen3-Next-80B's block at TP 1 (bf16 state: 1,114,112 B), 4 MiB pages:
    # 3 layers per group, 4 groups aliased. Unaligned, most layers' blocks of a logical
    # page straddle two physical pages and the ledger charges that worst case.
    page, block, n = 4 * MiB, 1114112, 40
    cfg = _layer_outer_config(n, block, groups=4, layers=3)
    before = _plan(cfg, page)
    assert before.physical_pages_per_logical_page() > 3
    usable = before.geometry.block_range(before.num_logical_pages - 1)[1]

    assert align_layer_regions(cfg, page) is True
    after = _plan(cfg, page)
    for t in cfg.kv_cache_tensors:
        assert t.offset == 0 and t.layer_stride % page == 0 and t.layer_stride >= n * block
        assert t.size == 3 * t.layer_stride  # one size for all (one buffer), the groups still aliased
    assert after.physical_pages_per_logical_page() == 3
    assert all(len(after.physical_pages(p)) == 3 for p in range(after.num_logical_pages))
    # The same blocks are usable: the page geometry is the block's, not the layout's.
    assert after.geometry.block_range(after.num_logical_pages - 1)[1] == usable
    # The ledger's capacity is now what the buffer holds, never more.
    assert after.num_logical_pages * 3 * page <= after.mapped_size
    assert align_layer_regions(cfg, page) is False  # aligned already: nothing moves


def test_aligned_layer_regions_keep_tensors_of_one_group_one_after_another():
    # One group over two geometries (Gemma 4: global layers of twice the local block).
    page, n = 128 * KiB, 10
    spec = SimpleNamespace(page_size_bytes=48 * KiB, block_size=16, num_kv_heads=2)
    g = SimpleNamespace(layer_names=["a0", "a1", "b0"], kv_cache_spec=spec)
    a = SimpleNamespace(size=0, layers=["a0", "a1"], layer_stride=n * 48 * KiB, block_stride=48 * KiB, offset=0)
    b = SimpleNamespace(
        size=0, layers=["b0"], layer_stride=n * 24 * KiB, block_stride=24 * KiB, offset=2 * n * 48 * KiB
    )
    a.size = b.size = b.offset + n * 24 * KiB
    cfg = SimpleNamespace(num_blocks=n, kv_cache_tensors=[a, b], kv_cache_groups=[g])
    assert align_layer_regions(cfg, page) is True
    assert (a.layer_stride, b.offset, b.layer_stride) == (4 * page, 8 * page, 2 * page)
    assert a.size == b.size == 10 * page


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"layer_stride": 1114112, "block_stride": 3 * 1114112}, id="block-outermost"),
        pytest.param({"offset": 4096}, id="offsets-not-vllm-s"),
        pytest.param({"host_resident": True}, id="host-resident"),
    ],
)
def test_layouts_that_are_not_vllm_s_layer_outermost_one_are_left_as_they_are(change):
    cfg = _layer_outer_config(40, 1114112, groups=1, layers=3)
    t = cfg.kv_cache_tensors[0]
    for k, v in change.items():
        setattr(t, k, v)
    before = dict(vars(t))
    assert align_layer_regions(cfg, 4 * MiB) is False
    assert vars(t) == before


def test_the_engine_core_hands_out_aligned_configs(monkeypatch):
    from kvcached.integration.vllm.kv_regions import patch_kv_cache_configs

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(4 * MiB))
    cfgs = [_layer_outer_config(40, 1114112, groups=2, layers=3)]
    core = types.SimpleNamespace(get_kv_cache_configs=lambda vllm_config, specs, memory: cfgs)
    patch_kv_cache_configs(core)
    assert core.get_kv_cache_configs(None, [], [0]) is cfgs
    assert all(t.layer_stride % (4 * MiB) == 0 for t in cfgs[0].kv_cache_tensors)


def test_every_logical_page_is_charged_the_most_any_of_them_maps():
    # 43 blocks of 24 KiB per layer, 128 KiB pages: layer 1 starts 8 KiB into a page, so
    # whether a logical page's run crosses a boundary changes from page to page; the
    # three logical pages once sampled (0, n/2, n-2) all need 2 pages, others 3.
    plan = KVLayoutPlan(
        2 * 43 * 24 * KiB, 43, 24 * KiB, 16, 128 * KiB, [Placement(0, 2, 43 * 24 * KiB, 24 * KiB, 24 * KiB)]
    )
    most = max(len(plan.physical_pages(p)) for p in range(plan.num_logical_pages))
    assert most == 3 and plan.physical_pages_per_logical_page() == most


def test_plan_refuses_what_it_cannot_back():
    with pytest.raises(InvalidArgumentError, match="reaches byte"):
        KVLayoutPlan(1 * MiB, 512, 64 * KiB, 128, 2 * MiB, [Placement(0, 2, 32 * MiB, 64 * KiB, 64 * KiB)])
    with pytest.raises(InvalidArgumentError, match="smaller than the plan's block size"):
        KVLayoutPlan(64 * MiB, 512, 64 * KiB, 128, 2 * MiB, [Placement(0, 1, 0, 32 * KiB, 32 * KiB)])
    spec = FullAttentionSpec(page_size_bytes=64 * KiB, block_size=128, has_layer_views=True)
    cfg = SimpleNamespace(
        num_blocks=512,
        kv_cache_tensors=[
            SimpleNamespace(
                size=64 * MiB,
                layers=["l0", "l1"],
                layer_stride=32 * MiB,
                block_stride=64 * KiB,
                offset=0,
                host_resident=True,
            )
        ],
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )
    with pytest.raises(InvalidArgumentError, match="host-resident"):
        KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)
    cfg.kv_cache_tensors[0].host_resident = False
    plan = KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)
    assert plan.physical_pages(1) == (1, 17)


@pytest.mark.parametrize(
    "layer_stride, block_stride",
    [
        pytest.param(32 * MiB, 4 * KiB, id="LHBNC"),  # vLLM 0.32's strides: 4 heads, 2,048 blocks of 16 KiB
        pytest.param(4 * KiB, 32 * KiB, id="BHLNC"),
    ],
)
def test_plan_refuses_layouts_with_heads_outside_the_blocks_in_one_line(layer_stride, block_stride):
    # A layer's block is then one run per KV head: mapping the pages of its first run
    # would leave the other heads' bytes unmapped.
    spec = FullAttentionSpec(page_size_bytes=16 * KiB, block_size=16, has_layer_views=True)
    t = SimpleNamespace(
        size=64 * MiB, layers=["l0", "l1"], layer_stride=layer_stride, block_stride=block_stride, offset=0
    )
    cfg = SimpleNamespace(
        num_blocks=2048,
        kv_cache_tensors=[t],
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )
    with pytest.raises(InvalidArgumentError, match="heads outside the blocks.*VLLM_KV_CACHE_LAYOUT=LBHNC"):
        KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)


def _shared_by_config(num_blocks: int, block_bytes: int, **tensor) -> SimpleNamespace:
    """A vLLM 0.26-0.28 KV cache config: one KVCacheTensor(size, shared_by) per layer."""
    spec = FullAttentionSpec(page_size_bytes=block_bytes, block_size=16)
    tensors = [
        SimpleNamespace(
            **{"size": num_blocks * block_bytes, "shared_by": [f"l{i}"], "offset": 0, "block_stride": 0, **tensor}
        )
        for i in range(2)
    ]
    groups = [SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def test_plan_of_vllm_026_buffers_lays_them_end_to_end_page_aligned(monkeypatch):
    from kvcached.integration.vllm import kv_layout

    monkeypatch.setattr(KVLayoutPlan, "tensor_reader", staticmethod(kv_layout.read_shared_by_tensors))
    # 10 blocks of 48 KiB per layer: 480 KiB, padded to 512 KiB (128 KiB pages).
    plan = KVLayoutPlan.from_kv_cache_config(_shared_by_config(10, 48 * KiB), 128 * KiB)
    assert [p.offset for p in plan.placements] == [0, 512 * KiB]
    assert plan.buffer_size == plan.mapped_size == 1 * MiB and plan.block_tokens == 16
    assert plan.physical_pages(0) == (0, 4)  # blocks 0-1 of each layer: one page per layer, none shared
    last = plan.num_logical_pages - 1
    assert not set(plan.physical_pages(last)) & set(plan.physical_pages(0))
    with pytest.raises(InvalidArgumentError, match=r"packed KV layout.*DeepSeek V4") as e:
        KVLayoutPlan.from_kv_cache_config(_shared_by_config(10, 48 * KiB, block_stride=96 * KiB), 128 * KiB)
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidArgumentError, match=r"has 1 B, not 10 blocks x 49152 B"):
        KVLayoutPlan.from_kv_cache_config(_shared_by_config(10, 48 * KiB, size=1), 128 * KiB)


def test_views_of_runner_buffers_must_put_blocks_outermost():
    torch = pytest.importorskip("torch")
    from kvcached.integration.vllm import kv_layout, worker_kv

    cfg = _shared_by_config(8, 8 * KiB)
    old = KVLayoutPlan.tensor_reader
    KVLayoutPlan.tensor_reader = staticmethod(kv_layout.read_shared_by_tensors)
    try:
        raw = torch.zeros(8 * 8 * KiB, dtype=torch.int8)
        blocks_first = raw.view(torch.float32).view(8, 2, 16, 64)  # (B, H, N, 2*D): FlashAttention, CPU
        split = raw.view(torch.float32).view(16, 2, 8, 64)  # kernel blocks of half a block
        hnd = raw.view(torch.float32).view(8, 16, 2, 64).permute(0, 2, 1, 3)  # a stride order, blocks still first
        worker_kv.check_blocks_outermost({"l0": blocks_first, "l1": split, "l2": hnd, "m": [raw]}, cfg)
        kv_first = raw.view(torch.float32).view(2, 8, 16, 2, 32)  # ROCm attention: (2, B, N, H, D)
        with pytest.raises(InvalidArgumentError, match=r"view of l1 .* does not put blocks outermost") as e:
            worker_kv.check_blocks_outermost({"l0": blocks_first, "l1": kv_first}, cfg)
        assert "\n" not in str(e.value) and "unset ENABLE_KVCACHED" in str(e.value)
    finally:
        KVLayoutPlan.tensor_reader = old


def _vllm_026_state_views(raw, num_blocks: int, page: int, shapes, dtype):
    """vLLM 0.26's runner code for a MambaSpec layer (``_reshape_kv_cache_tensors``)."""
    import torch

    views, offset = [], 0
    for shape in shapes:
        size = dtype.itemsize
        stride = torch.empty((num_blocks, *shape)).stride()
        views.append(
            torch.as_strided(
                raw.view(dtype), (num_blocks, *shape), (page // size, *stride[1:]), storage_offset=offset // size
            )
        )
        offset += stride[0] * size
    return views


def test_vllm_026_state_views_are_moved_onto_their_layers_buffer():
    """0.26 cuts state views at offsets from the storage's start: on kvcached's one
    FTensor every Mamba layer would alias the first buffer. ``rebase_state_views`` moves
    each onto its own region; the blocks-outermost check then accepts them."""
    torch = pytest.importorskip("torch")
    from kvcached.integration.vllm import kv_layout, worker_kv

    blocks, page = 8, 8 * KiB
    cfg = _shared_by_config(blocks, page)
    old = KVLayoutPlan.tensor_reader
    KVLayoutPlan.tensor_reader = staticmethod(kv_layout.read_shared_by_tensors)
    try:
        ftensor = torch.zeros(2 * blocks * page, dtype=torch.int8)
        raw = {"l0": ftensor[: blocks * page], "l1": ftensor[blocks * page :]}  # elastic_raw_tensors' regions
        shapes = [(3, 16), (4, 8, 8)]  # conv, SSM
        caches = {name: _vllm_026_state_views(r, blocks, page, shapes, torch.float32) for name, r in raw.items()}
        assert caches["l1"][0].data_ptr() == ftensor.data_ptr()  # the bug: l1 aliases l0's buffer
        ids = [id(t) for t in caches["l1"]]
        worker_kv.rebase_state_views(caches, raw)
        assert [id(t) for t in caches["l1"]] == ids  # moved in place: the runner keeps these objects
        for views in caches.values():
            for i, v in enumerate(views):
                v[5].fill_(1.0 + i)
        l0, l1 = (r.view(blocks, page).view(torch.float32) for r in raw.values())
        assert torch.equal(l0, l1) and l0[5].sum() == 3 * 16 + 2 * 4 * 8 * 8 and l0[4].sum() == 0
        worker_kv.check_blocks_outermost(caches, cfg)
        worker_kv.rebase_state_views(caches, raw)  # already in place: unchanged
        assert caches["l1"][0].data_ptr() == raw["l1"].data_ptr()
        too_big = {"l0": [raw["l0"].view(torch.float32).as_strided((blocks, 4096), (page // 4, 1))]}
        with pytest.raises(InvalidArgumentError, match="state view of l0 .* does not lie in its KV buffer") as e:
            worker_kv.rebase_state_views(too_big, raw)
        assert "\n" not in str(e.value)
    finally:
        KVLayoutPlan.tensor_reader = old


def _spec_class(name: str) -> type:
    """A stand-in for a vLLM KV cache spec class (the plan reads the class name and attributes)."""
    return type(name, (SimpleNamespace,), {})


FullAttentionSpec = _spec_class("FullAttentionSpec")


def _kv_config(*group_specs) -> SimpleNamespace:
    groups = [SimpleNamespace(layer_names=[f"g{i}.l0"], kv_cache_spec=s) for i, s in enumerate(group_specs)]
    tensors = [
        SimpleNamespace(size=64 * MiB, layers=g.layer_names, layer_stride=0, block_stride=64 * KiB, offset=0)
        for g in groups
    ]
    return SimpleNamespace(num_blocks=512, kv_cache_tensors=tensors, kv_cache_groups=groups)


@pytest.mark.parametrize(
    "specs, match",
    [
        (("ChunkedLocalAttentionSpec",), r"^kvcached does not support chunked local attention yet \(KV cache spec Ch"),
        (("MambaSpec",), r"Mamba / linear-attention state yet \(KV cache spec MambaSpec\)"),
        (("SinkFullAttentionSpec",), "attention sinks"),
        (("SlidingWindowMLASpec",), "sliding-window MLA attention"),
        (
            ("SomeFutureSpec",),
            r"a KV cache type other than full and sliding-window attention yet \(KV cache spec SomeFutureSpec\)",
        ),
        (
            ("FullAttentionSpec", "MambaSpec"),
            r"Mamba / linear-attention state yet \(KV cache spec MambaSpec in a model of 2 KV cache groups \(",
        ),
    ],
)
def test_plan_refuses_kv_cache_kinds_not_proven_in_one_line(specs, match):
    kw = dict(page_size_bytes=64 * KiB, block_size=128)
    cfg = _kv_config(*(_spec_class(n)(**kw) for n in specs))
    with pytest.raises(InvalidArgumentError, match=match) as e:
        KVLayoutPlan.from_kv_cache_config(cfg, 2 * MiB)
    assert "\n" not in str(e.value) and "unset ENABLE_KVCACHED" in str(e.value)
    # The same layers as one full-attention group (or MLA; or wrapped in UniformTypeKVCacheSpecs) are backed.
    for name in ("FullAttentionSpec", "MLAAttentionSpec"):
        KVLayoutPlan.from_kv_cache_config(_kv_config(_spec_class(name)(**kw)), 2 * MiB)
    uniform = _spec_class("UniformTypeKVCacheSpecs")(kv_cache_specs={"g0.l0": FullAttentionSpec(**kw)}, **kw)
    KVLayoutPlan.from_kv_cache_config(_kv_config(uniform), 2 * MiB)
    # Local + global layers (two groups sharing the pool, aliasing the same bytes) are backed.
    sliding = _spec_class("SlidingWindowSpec")(sliding_window=64, **kw)
    plan = KVLayoutPlan.from_kv_cache_config(_kv_config(FullAttentionSpec(**kw), sliding), 2 * MiB)
    assert plan.physical_pages(1) == (1,)  # both groups' block 32 live on the same page


def test_a_hybrid_buffer_counts_the_tokens_of_its_attention_layer():
    """vLLM 0.26-0.28 share one buffer between a Mamba layer and an attention layer (their
    pages evened out). Its blocks hold the attention layer's 144 tokens, not the state's
    block_size (the model length), whichever layer ``shared_by`` names first."""
    from kvcached.integration.vllm.kv_layout import read_shared_by_tensors

    page = 147456
    mamba = _spec_class("MambaSpec")(page_size_bytes=page, block_size=4096)
    attention = FullAttentionSpec(page_size_bytes=page, block_size=144, num_kv_heads=4)
    groups = [
        SimpleNamespace(layer_names=["l0", "l2"], kv_cache_spec=mamba),
        SimpleNamespace(layer_names=["l1", "l3"], kv_cache_spec=attention),
    ]
    tensors = [SimpleNamespace(size=100 * page, shared_by=[f"l{i}", f"l{i + 1}"], block_stride=0) for i in (0, 2)]
    size, placements, block_tokens = read_shared_by_tensors(tensors, groups, 100, 2 * MiB)
    assert block_tokens == 144 and [p.offset for p in placements] == [0, size // 2]


def test_a_gpu_worker_refuses_state_kinds_not_proven_on_a_gpu(monkeypatch, caplog):
    """Mamba / GDN state is proven on the CPU engines; on a GPU a Qwen3-Next gave other
    tokens than native with the same schedule. A CUDA worker fails closed in one line naming
    the way out; the CPU serves it; KVCACHED_ALLOW_UNSUPPORTED=1 tries it with a warning.
    Sliding-window layers (Gemma 3), refused on a GPU while one limit run differed, are served
    since five limit runs were identical (docs/GPU.md, 2026-12-06)."""
    from kvcached.integration.vllm.kv_layout import refuse_unproven_on_device

    monkeypatch.delenv("KVCACHED_ALLOW_UNSUPPORTED", raising=False)
    kw = dict(page_size_bytes=64 * KiB, block_size=128)
    hybrid = _kv_config(FullAttentionSpec(**kw), _spec_class("MambaSpec")(**kw))
    with pytest.raises(InvalidArgumentError, match=r"Mamba / linear-attention state on a GPU yet \(on the H200") as e:
        refuse_unproven_on_device(hybrid, "cuda:0")
    assert "\n" not in str(e.value) and "unset ENABLE_KVCACHED" in str(e.value)
    assert "KVCACHED_ALLOW_UNSUPPORTED=1" in str(e.value)
    refuse_unproven_on_device(hybrid, "cpu")
    refuse_unproven_on_device(_kv_config(FullAttentionSpec(**kw)), "cuda:0")
    gemma3 = _kv_config(FullAttentionSpec(**kw), _spec_class("SlidingWindowSpec")(sliding_window=512, **kw))
    refuse_unproven_on_device(gemma3, "cuda:0")
    refuse_unproven_on_device(gemma3, "cpu")
    monkeypatch.setenv("KVCACHED_ALLOW_UNSUPPORTED", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.kvcached"):
        refuse_unproven_on_device(hybrid, "cuda:1")
    assert "not proven there" in caplog.text and "cuda:1" in caplog.text


@pytest.mark.parametrize(
    "name, inside, outside",
    [("mamba_state_shared_by_0_28", "0.26.0", "0.29.0"), ("mamba_state_0_29", "0.29.0", "0.28.2")],
)
def test_mamba_state_is_backed_where_its_version_patch_applies(monkeypatch, name, inside, outside):
    """``mamba_state_shared_by_0_28`` / ``mamba_state_0_29`` serve MambaSpec groups: state
    blocks are blocks of the same pool, at their layer's block address. Pages evened out
    by vLLM tie; the plan's tokens per block are the attention group's (a state block's
    ``block_size`` is the model length, no cached tokens)."""
    from kvcached.integration.vllm import kv_layout, versions

    monkeypatch.setattr(kv_layout, "SUPPORTED_SPECS", kv_layout.SUPPORTED_SPECS)
    patch = next(p for p in versions.all_patches() if p.name == name)
    assert parse_version(inside) in patch.versions and parse_version(outside) not in patch.versions
    mamba = _spec_class("MambaSpec")(page_size_bytes=64 * KiB, block_size=4096)
    attention = FullAttentionSpec(page_size_bytes=64 * KiB, block_size=128, num_kv_heads=4)
    with pytest.raises(InvalidArgumentError, match="Mamba"):
        KVLayoutPlan.from_kv_cache_config(_kv_config(mamba, attention), 2 * MiB)
    patch.apply(types.ModuleType("vllm.v1.kv_cache_interface"))
    plan = KVLayoutPlan.from_kv_cache_config(_kv_config(mamba, attention), 2 * MiB)
    assert plan.block_tokens == 128 and plan.physical_pages(1) == (1,)
    patch.apply(types.ModuleType("vllm.v1.kv_cache_interface"))  # idempotent
    assert kv_layout.SUPPORTED_SPECS.count("MambaSpec") == 1


def _vllm_config(**over) -> SimpleNamespace:
    vc = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(enable_sleep_mode=False),
        cache_config=SimpleNamespace(kv_offloading_size=None, kv_offloading_backend="native"),
        kv_transfer_config=None,
    )
    for path, value in over.items():
        obj, attr = path.split("__")
        setattr(getattr(vc, obj) if obj != "vc" else vc, attr, value)
    return vc


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"model_config__enable_sleep_mode": True, "model_config__sleep_mode_backend": "criu"},
            r"sleep mode with the 'cumem' backend only, not 'criu'",
        ),
        # vLLM turns --kv-offloading-size into a connector itself: the offload option is the one named.
        ({"cache_config__kv_offloading_size": 4.0}, r"KV offloading \(--kv-offloading-size\) with vLLM's native"),
        (
            {
                "cache_config__kv_offloading_size": 4.0,
                "vc__kv_transfer_config": SimpleNamespace(kv_connector="SimpleCPUOffloadConnector"),
            },
            "VLLM_USE_SIMPLE_KV_OFFLOAD=1",
        ),
        (
            {
                "cache_config__kv_offloading_size": 4.0,
                "cache_config__kv_offloading_backend": "lmcache",
                "vc__kv_transfer_config": SimpleNamespace(kv_connector="LMCacheMPConnector"),
            },
            "the 'lmcache' backend",
        ),
        ({"vc__kv_transfer_config": SimpleNamespace(kv_connector="X")}, r"KV connector 'X' \(kv_transfer_config\)"),
        ({"parallel_config__decode_context_parallel_size": 2}, "decode_context_parallel_size > 1"),
    ],
)
def test_configurations_kvcached_cannot_serve_stop_start_up_in_one_line(over, match):
    from kvcached.integration.vllm.backend import refuse_unsupported

    refuse_unsupported(_vllm_config())  # the defaults are served
    refuse_unsupported(_vllm_config(model_config__enable_sleep_mode=True))  # sleep mode with cumem too
    offloading = SimpleNamespace(kv_connector="OffloadingConnector")  # --kv-offloading-size N, native: fenced
    refuse_unsupported(_vllm_config(cache_config__kv_offloading_size=4.0, vc__kv_transfer_config=offloading))
    with pytest.raises(InvalidArgumentError, match=match) as e:
        refuse_unsupported(_vllm_config(**over))
    assert "\n" not in str(e.value)


def test_bad_configuration_is_refused_while_the_scheduler_is_built_before_any_page(monkeypatch):
    from kvcached.integration.vllm import backend

    made = []
    monkeypatch.setattr("kvcached.compat.upstream_manager.KVCacheManager", lambda *a, **k: made.append(1))
    bad = _vllm_config(model_config__enable_sleep_mode=True, model_config__sleep_mode_backend="criu")
    ctx = backend.PoolContext(bad, _kv_config(FullAttentionSpec()))
    with pytest.raises(InvalidArgumentError, match="sleep mode"):
        backend.VllmBackend.create(ctx, 512)
    ctx = backend.PoolContext(_vllm_config(), _kv_config(_spec_class("MambaSpec")(page_size_bytes=1, block_size=1)))
    with pytest.raises(InvalidArgumentError, match="Mamba"):
        backend.VllmBackend.create(ctx, 512)
    assert not made


# -------------------------------------------------------- worker executor


@pytest.fixture
def host_plane():
    from kvcached import _C, vmm_ops

    _C.clear_faults()
    vmm_ops.init_kvcached("cpu", page_size=128 * KiB, contiguous_layout=False)
    yield vmm_ops
    _C.clear_faults()
    vmm_ops.shutdown_kvcached()


def test_executor_maps_logical_pages_with_shared_physical_pages(host_plane):
    from kvcached import _C
    from kvcached.integration.vllm.worker_executor import PlannedExecutor
    from vmm_helpers import physical_bytes

    P = 128 * KiB
    plan = KVLayoutPlan(960 * KiB, 10, 48 * KiB, 16, P, [Placement(0, 2, 480 * KiB, 48 * KiB, 48 * KiB)])
    host_plane.create_kv_tensors(plan.mapped_size, 1, "cpu", num_layers=1, num_kv_buffers=1)
    ex = PlannedExecutor(plan)
    base = physical_bytes("cpu")
    last = plan.num_logical_pages - 1

    def mapped():
        return sorted(o // P for o in _C.mapped_offsets(0))

    assert ex.map(0, 1, [0]) == (1, 0)
    assert mapped() == [0, 3, 4]
    assert ex.map(0, 2, [last * P]) == (1, 0)
    assert mapped() == sorted(set(plan.physical_pages(0)) | set(plan.physical_pages(last)))
    assert physical_bytes("cpu") - base == len(mapped()) * P  # the OS agrees
    assert ex.map(0, 2, [last * P]) == (1, 0)  # a repeated MAP is answered from history
    # Unmapping page 0 keeps the physical page it shares with the last one.
    ex.prepare(0, 10, [0])
    ex.abort(0, 10)  # undo: everything mapped again, data intact
    assert mapped() == sorted(set(plan.physical_pages(0)) | set(plan.physical_pages(last)))
    with pytest.raises(Exception, match="abort"):
        ex.prepare(0, 10, [0])  # a PREPARE after ABORT is refused
    ex.prepare(0, 11, [0])
    ex.prepare(0, 11, [0])  # repeated PREPARE: idempotent
    ex.commit(0, 11)
    ex.commit(0, 11)
    assert 3 in mapped() and 0 not in mapped()
    assert ex.mapped_logical_pages() == [last]
    with pytest.raises(InvalidArgumentError, match="not mapped"):
        ex.prepare(0, 12, [0])
    # A rolled-back MAP undoes exactly what it mapped, and a late MAP is refused.
    ex.map(0, 3, [0, last * P])
    assert ex.rollback_map(0, 3) == 1
    assert ex.mapped_logical_pages() == [last]
    with pytest.raises(InvalidArgumentError, match="rolled back"):
        ex.map(0, 3, [0])
    ex.prepare(0, 13, [last * P])
    ex.commit(0, 13)
    assert mapped() == [] and physical_bytes("cpu") == base
    state = ex.query(0)
    assert state.created and state.mapped_offsets == []


def test_planned_executor_maps_a_shared_physical_page_once_and_unmaps_it_with_its_last_user(monkeypatch):
    # Through the executor's page hooks only: a recording data plane sees which
    # physical pages each request really maps or unmaps.
    from kvcached import vmm_ops
    from kvcached.integration.vllm.worker_executor import PlannedExecutor

    P = 128 * KiB
    plan = KVLayoutPlan(960 * KiB, 10, 48 * KiB, 16, P, [Placement(0, 2, 480 * KiB, 48 * KiB, 48 * KiB)])
    a, b = 0, plan.num_logical_pages - 1
    assert set(plan.physical_pages(a)) & set(plan.physical_pages(b)) == {3}
    calls = []

    def recorder(op):
        def call(*args):
            offsets = next((x for x in args if isinstance(x, list)), [])
            calls.append((op, sorted(o // P for o in offsets)))

        return call

    for op in (
        "map_to_kv_tensors",
        "unmap_from_kv_tensors",
        "prepare_unmap_from_kv_tensors",
        "commit_unmap_from_kv_tensors",
        "abort_unmap_from_kv_tensors",
    ):
        monkeypatch.setattr(vmm_ops, op, recorder(op.split("_")[0]))
    ex = PlannedExecutor(plan)

    assert ex.map(0, 1, [a * P]) == (1, 0)
    assert ex.map(0, 2, [b * P]) == (1, 0)
    assert calls == [("map", [0, 3, 4]), ("map", [6, 7])]  # the shared page 3 is mapped once
    assert ex.physical_references()[3] == 2
    assert ex.map(0, 2, [b * P]) == (1, 0)  # a repeated tx: answered from history
    assert ex.map(0, 3, [a * P, b * P]) == (0, 2)  # both mapped already
    assert len(calls) == 2

    # Releasing a keeps page 3 (b still uses it); ABORT gives the references back.
    ex.prepare(0, 10, [a * P])
    ex.prepare(0, 10, [a * P])  # repeated PREPARE: nothing more reaches the data plane
    with pytest.raises(InvalidArgumentError, match="other offsets"):
        ex.prepare(0, 10, [b * P])
    assert calls[2:] == [("prepare", [0, 4])]
    ex.abort(0, 10)
    assert ex.mapped_logical_pages() == [a, b] and ex.physical_references()[3] == 2
    ex.prepare(0, 11, [a * P])
    ex.commit(0, 11)
    ex.commit(0, 11)  # the data plane answers a repeated COMMIT; the references stay
    assert calls[-3:] == [("prepare", [0, 4]), ("commit", []), ("commit", [])]
    assert ex.mapped_logical_pages() == [b] and ex.physical_references() == {3: 1, 6: 1, 7: 1}
    # Releasing b, the last user of page 3, releases it.
    ex.prepare(0, 12, [b * P])
    ex.commit(0, 12)
    assert ("prepare", [3, 6, 7]) in calls[-2:]
    assert ex.mapped_logical_pages() == [] and ex.physical_references() == {}

    # A rolled-back MAP unmaps exactly what it mapped, once; a late repeat is refused.
    del calls[:]
    assert ex.map(0, 5, [a * P, b * P]) == (2, 0)
    assert ex.rollback_map(0, 5) == 2
    assert ex.rollback_map(0, 5) == 0
    assert calls == [("map", [0, 3, 4, 6, 7]), ("unmap", [0, 3, 4, 6, 7])]
    with pytest.raises(InvalidArgumentError, match="rolled back"):
        ex.map(0, 5, [a * P])
    assert ex.physical_references() == {}


# --------------------------------------------------- allocate_slots rollback


class _Pool:
    def __init__(self):
        self.freed = []

    def free_blocks(self, blocks):
        self.freed.extend(blocks)


def test_allocate_slots_rollback_restores_the_request_exactly():
    from collections import defaultdict

    from kvcached.integration.vllm.slot_rollback import rollback as _rollback
    from kvcached.integration.vllm.slot_rollback import snapshot as _snapshot

    m = SimpleNamespace(req_to_blocks=defaultdict(list), num_cached_block={}, new_block_ids=[], _partial_hit_reqs={})
    m.req_to_blocks["r"] = ["b1", "b2"]
    m.num_cached_block["r"] = 1
    m.new_block_ids.extend([1, 2])
    snap = _snapshot(m, "r")
    # The failed call attached a touched hit and a new block, then ran out.
    m.req_to_blocks["r"].extend(["hit", "new"])
    m.num_cached_block["r"] = 3
    m.new_block_ids.append(9)
    m.req_to_blocks["fresh"].append("x")  # another request is not touched
    pool = _Pool()
    _rollback(m, "r", snap, pool)
    assert m.req_to_blocks["r"] == ["b1", "b2"] and m.num_cached_block["r"] == 1 and m.new_block_ids == [1, 2]
    assert pool.freed == ["new", "hit"]  # tail first, like vLLM's free
    # A waiting request that had nothing: its entries disappear again.
    snap = _snapshot(m, "w")
    m.req_to_blocks["w"].extend(["h"])
    m.num_cached_block["w"] = 1
    m._partial_hit_reqs["w"] = (0, "h")
    _rollback(m, "w", snap, pool)
    assert "w" not in m.req_to_blocks and "w" not in m.num_cached_block and "w" not in m._partial_hit_reqs


def test_plan_of_layers_with_different_block_sizes_pages_by_the_smallest_block():
    # Gemma-4 style: one layer of 64 KiB blocks (global, head 64) and one of 32 KiB
    # blocks (local, head 32), each its own tensor, layer-outermost, 128 KiB pages.
    big, small = 64 * KiB, 32 * KiB
    n = 16
    placements = [Placement(0, 1, 0, big, big), Placement(n * big, 1, 0, small, small)]
    plan = KVLayoutPlan(n * (big + small), n, small, 128, 128 * KiB, placements)
    assert plan.geometry.max_blocks_per_page == 4  # the smallest block sets the page geometry
    # Logical page 1 = blocks 4-7: 256 KiB of the big layer (pages 2-3) and one whole
    # page of the small one (page 9); no page is shared with a neighbouring logical page.
    assert plan.physical_pages(1) == (2, 3, 9)
    assert plan.physical_pages(0) == (0, 1, 8)
    assert plan.physical_pages_per_logical_page() == 3  # 1.5 pages of each layer's 2: exact


def test_a_block_larger_than_a_page_is_refused_naming_the_page_size_to_use():
    spec = FullAttentionSpec(page_size_bytes=256 * KiB, block_size=128, has_layer_views=True)
    cfg = SimpleNamespace(
        num_blocks=8,
        kv_cache_tensors=[
            SimpleNamespace(size=2 * MiB, layers=["g0.l0"], layer_stride=0, block_stride=256 * KiB, offset=0)
        ],
        kv_cache_groups=[SimpleNamespace(layer_names=["g0.l0"], kv_cache_spec=spec)],
    )
    with pytest.raises(InvalidArgumentError, match=r"does not fit in a page; .*KVCACHED_PAGE_SIZE=262144") as e:
        KVLayoutPlan.from_kv_cache_config(cfg, 128 * KiB)
    assert "\n" not in str(e.value)


def test_a_group_of_layers_of_different_head_sizes_reads_block_sizes_from_its_tensors():
    # vLLM's scheduler config names one arbitrary layer's spec (64 KiB blocks) for a
    # group whose layers 1 and 3 have 128 KiB blocks (Gemma 4 with the hybrid manager
    # off, as vLLM 0.32 lays it out): the plan must be the workers' plan all the same.
    n, small, big = 24, 64 * KiB, 128 * KiB
    collapsed = FullAttentionSpec(page_size_bytes=small, block_size=128, has_layer_views=True)
    names = ["l0", "l2", "l1", "l3"]
    tensors = [
        SimpleNamespace(size=n * 3 * 2 * small, layers=names[:2], layer_stride=n * small, block_stride=small, offset=0),
        SimpleNamespace(
            size=n * 3 * 2 * small, layers=names[2:], layer_stride=n * big, block_stride=big, offset=2 * n * small
        ),
    ]
    cfg = SimpleNamespace(
        num_blocks=n,
        kv_cache_tensors=tensors,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=collapsed)],
    )
    plan = KVLayoutPlan.from_kv_cache_config(cfg, 128 * KiB)
    assert [p.block_bytes for p in plan.placements] == [small, big]
    assert plan.geometry.max_blocks_per_page == 2  # pages cut by the smallest block
    # Logical page 2 = blocks 4-5: layer 0 at 256 KiB (page 2), layer 2 at 1792 KiB (page
    # 14), layer 1 at 3 MiB + 512 KiB (pages 28-29), layer 3 at 6 MiB + 512 KiB (52-53).
    assert plan.physical_pages(2) == (2, 14, 28, 29, 52, 53)
    assert plan.physical_pages_per_logical_page() == 6  # what the worker maps for it: exact
    # The same tensors in a block-outermost layout cannot be read: refused in one line.
    for t in tensors:
        t.layer_stride, t.block_stride = t.block_stride, 6 * small
    with pytest.raises(InvalidArgumentError, match="different KV head sizes in a block-outermost"):
        KVLayoutPlan.from_kv_cache_config(cfg, 128 * KiB)
