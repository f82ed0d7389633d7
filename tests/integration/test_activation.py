"""Which engine's patches activate in which process (issue 20): an engine's
patches activate only in a process that runs that engine, never because
another engine imports it as a library. Subprocesses with fake ``vllm`` and
``sglang`` packages on PYTHONPATH; the real engines are in tests/engines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from repo_paths import TESTS

KVCACHED_ENV = ("ENABLE_KVCACHED", "KVCACHED_")


def _run(code: str, env_extra: dict, path: str, argv: list = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(KVCACHED_ENV)}
    env.update(env_extra)
    env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = argv if argv is not None else [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _real_distribution(name: str) -> bool:
    """Whether this interpreter sees an installed distribution ``name`` (the GPU box
    carries a real vLLM on every process's path)."""
    from importlib import metadata

    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _fakes(root, vllm_version="0.33.0", sglang_version="0.5.23", vllm_meta=True):
    """A fake ``sglang`` whose model code imports ``vllm._custom_ops`` (as SGLang's
    rotary embedding does) and a fake ``vllm`` (``vllm_version`` None: no
    ``__version__``; ``vllm_meta`` False: no distribution metadata either)."""
    v = root / "vllm"
    v.mkdir(parents=True)
    (v / "__init__.py").write_text("" if vllm_version is None else f"__version__ = {vllm_version!r}\n")
    (v / "_custom_ops.py").write_text("def rotary_embedding(*a):\n    raise RuntimeError('stub')\n")
    (v / "entrypoints.py").write_text("import vllm\nprint('vllm entry point ran')\n")
    if vllm_meta and vllm_version is not None:
        d = root / f"vllm-{vllm_version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_version}\n")
    s = root / "sglang"
    (s / "srt").mkdir(parents=True)
    (s / "__init__.py").write_text(f"__version__ = {sglang_version!r}\n")
    (s / "srt" / "__init__.py").write_text("")
    (s / "srt" / "rotary.py").write_text("from vllm._custom_ops import rotary_embedding\n")
    (s / "launch_server.py").write_text(
        "import sglang.srt.rotary\nfrom kvcached.integration.sglang import plugin\n"
        "from kvcached.integration.vllm import plugin as vp\n"
        "print('sglang', plugin.activated_by(), 'vllm', len(vp.manager().results) if vp._manager else None)\n"
    )
    return str(root)


REPORT = """
    from kvcached.integration.sglang import plugin as sp
    from kvcached.integration.vllm import plugin as vp
    print("sglang", sp.activated_by(), "vllm", None if vp._manager is None else vp._manager.version)
"""


def test_sglang_importing_vllm_without_metadata_does_not_activate_vllm(tmp_path):
    # A `vllm` source checkout on PYTHONPATH: no __version__ reachable, no metadata.
    path = _fakes(tmp_path, vllm_version=None, vllm_meta=False)
    code = "from kvcached import autopatch\nautopatch.install()\nimport sglang.srt.rotary\n" + textwrap.dedent(REPORT)
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sglang", "autopatch", "vllm", "None"], out.stdout + out.stderr
    assert "Traceback" not in out.stderr


def test_sglang_importing_an_out_of_range_vllm_is_not_refused(tmp_path):
    path = _fakes(tmp_path, vllm_version="0.29.0")
    code = "from kvcached import autopatch\nautopatch.install()\nimport sglang.srt.rotary\n" + textwrap.dedent(REPORT)
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sglang", "autopatch", "vllm", "None"], out.stdout + out.stderr


def test_sglang_entry_point_decides_even_when_vllm_is_imported_first(tmp_path):
    # `python -m sglang.launch_server`: the entry point names the engine; the
    # import order does not matter. The .pth hook is stood in for by sitecustomize.
    path = _fakes(tmp_path, vllm_version="0.29.0")
    (tmp_path / "sitecustomize.py").write_text("from kvcached import autopatch\n")
    (tmp_path / "sglang" / "launch_server.py").write_text(
        "from kvcached import autopatch\nautopatch.install()\nimport vllm._custom_ops\nimport sglang.srt.rotary\n"
        + textwrap.dedent(REPORT)
    )
    out = _run("", {"ENABLE_KVCACHED": "true"}, path, argv=[sys.executable, "-m", "sglang.launch_server"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sglang", "autopatch", "vllm", "None"], out.stdout + out.stderr
    # vllm imported at interpreter start, before runpy imports `sglang`: the command line decides.
    (tmp_path / "sitecustomize.py").write_text("from kvcached import autopatch\nimport vllm._custom_ops\n")
    out = _run("", {"ENABLE_KVCACHED": "true"}, path, argv=[sys.executable, "-m", "sglang.launch_server"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sglang", "autopatch", "vllm", "None"], out.stdout + out.stderr


def test_dash_m_engine_reads_the_command_line():
    from kvcached.autopatch import _dash_m_engine

    py = "python"
    assert _dash_m_engine([py, "-m", "sglang.launch_server", "--model", "x"]) == "sglang"
    assert _dash_m_engine([py, "-X", "dev", "-u", "-mvllm.entrypoints.openai.api_server"]) == "vllm"
    assert _dash_m_engine([py, "-m", "pytest", "-m", "vllm"]) is None
    assert _dash_m_engine([py, "-c", "x", "-m", "vllm"]) is None
    assert _dash_m_engine([py, "script.py", "-m", "vllm"]) is None
    assert _dash_m_engine([]) is None


def test_a_vllm_process_activates_vllm_and_not_sglang_it_imports(tmp_path):
    path = _fakes(tmp_path, vllm_version="0.33.0", sglang_version="0.1.0")  # sglang out of range: never checked
    code = "from kvcached import autopatch\nautopatch.install()\nimport vllm\nimport sglang\n" + textwrap.dedent(REPORT)
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sglang", "None", "vllm", "(0,", "33,", "0)"], out.stdout + out.stderr
    # `python -m vllm....`: the entry point decides, whatever was imported before.
    (tmp_path / "vllm" / "entrypoints.py").write_text(
        "from kvcached import autopatch\nimport sglang\nautopatch.install()\nimport vllm\n" + textwrap.dedent(REPORT)
    )
    out = _run("", {"ENABLE_KVCACHED": "true"}, path, argv=[sys.executable, "-m", "vllm.entrypoints"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:4] == ["sglang", "None", "vllm", "(0,"], out.stdout + out.stderr


def test_entry_point_engine_by_module_console_script_and_script_path(tmp_path):
    from kvcached import autopatch

    path = _fakes(tmp_path)
    code = "import sys\nfrom kvcached import autopatch\nprint(autopatch.entry_point_engine())\n"
    out = _run(code, {}, path)
    assert out.stdout.strip() == "None", out.stderr  # -c: decided by import order
    script = tmp_path / "bin" / "vllm"  # a console script such as `vllm serve`
    script.parent.mkdir()
    script.write_text(code)
    out = _run("", {}, path, argv=[sys.executable, str(script), "serve"])
    assert out.stdout.strip() == "vllm", out.stderr
    (tmp_path / "sglang" / "srt" / "runner.py").write_text(code)  # a script inside the package
    out = _run("", {}, path, argv=[sys.executable, str(tmp_path / "sglang" / "srt" / "runner.py")])
    assert out.stdout.strip() == "sglang", out.stderr
    assert autopatch.entry_point_engine() is None  # pytest


def test_spawned_child_of_an_sglang_entry_point_leaves_vllm_alone(tmp_path):
    # SGLang's scheduler is a multiprocessing spawn child: it inherits the
    # parent's argv and re-imports its __main__ as __mp_main__.
    path = _fakes(tmp_path, vllm_version="0.29.0")
    (tmp_path / "sglang" / "launch_server.py").write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp

            def child():
                from kvcached import autopatch
                autopatch.install()
                import vllm._custom_ops
                import sglang.srt.rotary
                from kvcached.integration.vllm import plugin as vp
                from kvcached.integration.sglang import plugin as sp
                print("child", autopatch.entry_point_engine(), sp.activated_by(), vp._manager, flush=True)

            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                p = ctx.Process(target=child)
                p.start()
                p.join()
                raise SystemExit(p.exitcode)
            """
        )
    )
    out = _run("", {"ENABLE_KVCACHED": "true"}, path, argv=[sys.executable, "-m", "sglang.launch_server"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "sglang", "autopatch", "None"], out.stdout + out.stderr


def test_vllm_plugin_entry_point_activates_whatever_the_import_order(tmp_path):
    # vllm.general_plugins runs only in vLLM processes: it activates directly.
    path = _fakes(tmp_path, vllm_version="0.33.0")
    code = (
        "from kvcached import autopatch\nautopatch.install()\nimport sglang.srt.rotary\n"
        "from kvcached.integration.vllm import plugin\nplugin.register()\n" + textwrap.dedent(REPORT)
    )
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[2:4] == ["vllm", "(0,"], out.stdout + out.stderr


def test_version_falls_back_to_metadata_then_one_line_naming_the_fix(tmp_path):
    code = "from kvcached import autopatch\nautopatch.install()\nimport vllm\n" + textwrap.dedent(REPORT)
    # No __version__, metadata present: the metadata's version.
    root = tmp_path / "meta"
    path = _fakes(root, vllm_version="0.33.0")
    (root / "vllm" / "__init__.py").write_text("")
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[2:] == ["vllm", "(0,", "33,", "0)"], out.stdout + out.stderr
    # Neither: one line naming the fix, no traceback (vLLM and SGLang alike).
    if _real_distribution("vllm"):
        pytest.skip("a real vLLM distribution is installed here: its metadata answers for the fake package")
    path = _fakes(tmp_path / "none", vllm_version=None, vllm_meta=False)
    out = _run(code, {"ENABLE_KVCACHED": "true"}, path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("kvcached: cannot tell the vLLM version") and "pip install -e ." in lines[0]
    (tmp_path / "none" / "sglang" / "__init__.py").write_text("")
    out = _run(code.replace("import vllm", "import sglang"), {"ENABLE_KVCACHED": "true"}, path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("kvcached: cannot tell the SGLang version")


def test_test_stub_marker_still_keeps_the_stub_inactive(tmp_path):
    stubs = os.path.join(TESTS, "engines", "sglang_stubs")
    code = "from kvcached import autopatch\nautopatch.install()\nimport vllm._custom_ops\n" + textwrap.dedent(REPORT)
    out = _run(code, {"ENABLE_KVCACHED": "true"}, stubs)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[2:] == ["vllm", "None"], out.stdout + out.stderr
