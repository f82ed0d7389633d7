"""Start-up behaviour: the entry point, version check, idempotent patches, refusals.

The two ``launch_server`` runs here stop before any model is loaded (a few
seconds of imports each): SGLang's own command line, as a user would type it.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(os.path.dirname(HERE), "sglang_stubs")


def _server_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "SGLANG_")) and k != "ENABLE_KVCACHED"}
    env["PYTHONPATH"] = STUBS + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", ENABLE_KVCACHED="true", KVCACHED_IPC_NAME=f"kvcached_sglang_refuse_{os.getpid()}")
    env.update(extra)
    return env


def _launch(model: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--max-total-tokens",
        "2048",
        "--port",
        "1",
        *flags,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvcached"]
    assert len(eps) == 1 and eps[0].value == "kvcached.integration.sglang.plugin:register"
    assert eps[0].load().__module__ == "kvcached.integration.sglang.plugin"


def test_activation_is_idempotent(monkeypatch) -> None:
    monkeypatch.setenv("ENABLE_KVCACHED", "1")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "kvcached_sglang_unit_idem")
    import importlib

    from sglang.srt.managers import scheduler as sched_mod

    from kvcached.integration.patch_base import WRAPPED
    from kvcached.integration.sglang import plugin
    from kvcached.integration.sglang.allocator import ElasticPagedTokenToKVPoolAllocator

    plugin.activate()
    plugin.register()
    plugin.activate()
    m = plugin.patch_manager()
    # Every patch whose range holds the installed SGLang applied (once its module is
    # imported), the others skipped.
    want = {p.name: "applied" if m.version in p.versions else "skipped" for p in m.patches}
    for p in m.patches:
        if want[p.name] == "applied":
            importlib.import_module(p.target_module)
    assert {k: v.status for k, v in m.results.items()} == want
    applied = {name for name, status in want.items() if status == "applied"}
    assert "sglang-scheduler" in applied and len(applied) >= 7
    for name in ("__init__", "run_batch", "process_batch_result", "on_idle", "flush_cache"):
        fn = sched_mod.Scheduler.__dict__[name]
        assert not hasattr(getattr(fn, WRAPPED), WRAPPED), f"{name} wrapped twice"
    # The builder of this release constructs the elastic allocator by name.
    builder = next(p.target_module for p in m.patches if p.name.startswith("sglang-allocators") and p.name in applied)
    assert importlib.import_module(builder).PagedTokenToKVPoolAllocator is ElasticPagedTokenToKVPoolAllocator
    assert hasattr(sched_mod.Scheduler, "kvcached_report")


def test_unsupported_version_stops_with_one_line(monkeypatch) -> None:
    monkeypatch.setenv("ENABLE_KVCACHED", "1")
    from kvcached.integration.sglang import plugin

    monkeypatch.setattr(plugin, "_manager", None)
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.14")
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("kvcached supports sglang ")
    assert "sglang >=0.5.15,<0.5.24" in msg and "0.5.14 is installed" in msg and "ENABLE_KVCACHED" in msg


def test_unsupported_version_stops_launch_server(tiny_model, tmp_path) -> None:
    """The real command with an SGLang that reports another version (set before SGLang starts)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    # sitecustomize runs at interpreter start, before launch_server loads the plugins.
    (fake / "sitecustomize.py").write_text("import sglang\nsglang.__version__ = '0.5.99'\n")
    env = _server_env(KVCACHED_AUTOPATCH="0")
    env["PYTHONPATH"] = str(fake) + os.pathsep + env["PYTHONPATH"]
    cp = _launch(tiny_model, env=env)
    assert cp.returncode != 0
    lines = [ln for ln in (cp.stdout + cp.stderr).splitlines() if "kvcached supports sglang" in ln]
    assert lines and "0.5.99 is installed" in lines[0], (cp.stdout + cp.stderr)[-3000:]
    assert "Load weight begin" not in cp.stdout + cp.stderr  # stopped before any model was loaded


# --enable-memory-saver is served with kvcached (test_memory_saver.py).
@pytest.mark.parametrize(
    "flags,env,needle",
    [
        ([], {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1"}, "kvcached: SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1"),
    ],
)
def test_refuses_sglang_memory_managers(tiny_model, flags, env, needle) -> None:
    cp = _launch(tiny_model, *flags, env=_server_env(**env))
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0
    assert needle in out and "unset ENABLE_KVCACHED" in out, out[-3000:]


def test_server_args_conflicts_name_the_flag() -> None:
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    from kvcached.integration.sglang.conflicts import UnsupportedConfigurationError, server_args_conflicts

    fields = {f.name for f in dataclasses.fields(ServerArgs)} if dataclasses.is_dataclass(ServerArgs) else None

    def conflicts_of(**kw):
        # Until 0.5.18 ServerArgs validates while it is built (patched: it refuses there).
        try:
            args = ServerArgs(model_path="dummy", device="cpu", **kw)
        except UnsupportedConfigurationError as e:
            return [e]
        return server_args_conflicts(args)

    assert conflicts_of() == []
    assert conflicts_of(enable_memory_saver=True) == []  # served: memory_saver.py
    checked = 0
    for kw, flag in (
        (dict(speculative_algorithm="EAGLE"), "--speculative-algorithm"),
        (dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(enable_unified_memory=True), "--enable-unified-memory"),
        (dict(enable_page_major_kv_layout=True), "--enable-page-major-kv-layout"),
    ):
        if fields is not None and not set(kw) <= fields:
            continue  # not a flag of this SGLang release
        found = conflicts_of(**kw)
        assert len(found) == 1 and flag in str(found[0]) and "ENABLE_KVCACHED" in str(found[0]), (kw, found)
        checked += 1
    assert checked >= 3


@pytest.fixture
def kv_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "4096")
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_sglang_unit_{os.getpid()}")
    yield monkeypatch
    from kvcached.integration.sglang.pool import shutdown_all

    shutdown_all()


def test_pool_refuses_post_capture_arena_and_contiguous_layout(kv_env, kvcached_patches) -> None:
    from kvcached.integration.sglang.conflicts import UnsupportedConfigurationError
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, shutdown_all

    kw = dict(
        page_size=16, dtype=torch.float16, head_num=2, head_dim=32, layer_num=2, device="cpu", enable_memory_saver=False
    )
    if "post_capture_active" in inspect.signature(ElasticMHATokenToKVPool.__init__).parameters:  # 0.5.16+
        with pytest.raises(UnsupportedConfigurationError, match="post-capture"):
            ElasticMHATokenToKVPool(2032, post_capture_active=True, **kw)
    with pytest.raises(UnsupportedConfigurationError, match="v_head_dim"):
        ElasticMHATokenToKVPool(2032, v_head_dim=16, **kw)
    shutdown_all()
    kv_env.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true")
    with pytest.raises(UnsupportedConfigurationError, match="KVCACHED_CONTIGUOUS_LAYOUT"):
        ElasticMHATokenToKVPool(2032, **kw)
