"""kvcached.naming: the one rule set for instance, record and socket names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached import naming
from kvcached.ipc import paths


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)


def test_instance_name_default_and_env(no_env, monkeypatch):
    assert naming.instance_name("vllm") == f"kvcached_vllm_{os.getpid()}" == naming.default_instance_name("vllm")
    assert naming.default_instance_name("sglang", 42) == "kvcached_sglang_42"
    monkeypatch.setenv("KVCACHED_IPC_NAME", "my_model")
    assert naming.instance_name("sglang") == "my_model"
    monkeypatch.setenv("KVCACHED_IPC_NAME", "bad name")
    with pytest.raises(ValueError, match="invalid"):
        naming.instance_name("vllm")


def test_ensure_instance_name_exports_it_to_children(no_env):
    name = naming.ensure_instance_name("vllm")
    try:
        assert name == f"kvcached_vllm_{os.getpid()}" == os.environ["KVCACHED_IPC_NAME"]
        # A child (spawned, another pid) derives the same name.
        out = subprocess.run(
            [sys.executable, "-c", "from kvcached import naming; print(naming.ensure_instance_name('vllm'))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == name
        assert naming.ensure_instance_name("vllm") == name  # idempotent
    finally:
        os.environ.pop("KVCACHED_IPC_NAME", None)


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 128, "has space", "..", ".", "caf\u00e9", "tab\t", None])
def test_validate_name_refuses(bad):
    with pytest.raises(ValueError):
        naming.validate_name(bad)


def test_validate_name_accepts():
    for ok in ("a", "x" * naming.MAX_NAME_LEN, "kvcached_vllm_1_dp2_g1", "model-7b.v2"):
        assert naming.validate_name(ok) == ok


def test_sub_instance_suffixes():
    assert naming.group_name("m", 0) == "m"
    assert naming.group_name("m", 2) == "m_g2"
    assert naming.dp_name("m", 0, 1) == "m"
    assert naming.dp_name("m", 0, 2) == "m_dp0"
    assert naming.dp_name("m", 3, 4) == "m_dp3"
    assert naming.rank_name("m") == "m"
    assert naming.rank_name("m", tp_rank=1) == "m_tp1"
    assert naming.rank_name("m", pp_rank=2) == "m_pp2"
    assert naming.rank_name("m", tp_rank=3, pp_rank=1) == "m_pp1_tp3"
    # Suffixes compose in the documented order.
    assert naming.group_name(naming.dp_name("m", 1, 2), 1) == "m_dp1_g1"
    assert naming.is_dp_name("m", "m") and naming.is_dp_name("m", "m_dp12")
    assert not naming.is_dp_name("m", "m_dp") and not naming.is_dp_name("m", "mm_dp1")
    assert not naming.is_dp_name("m.x", "mAx_dp1")  # the base is literal, not a pattern
    for sub in ("m", "m_dp1", "m_g2", "m_dp1_g2", "m_pp1", "m_tp3", "m_pp1_tp3_g1"):
        assert naming.belongs_to("m", sub), sub
    for other in ("mm", "m_x", "m_g", "m_g1_dp1", "m_tp1_pp1", "n_dp1", "m_dp1x"):
        assert not naming.belongs_to("m", other), other


@pytest.mark.parametrize(
    "call",
    [
        lambda: naming.group_name("m", -1),
        lambda: naming.dp_name("m", -1, 2),
        lambda: naming.dp_name("m", 2, 2),
        lambda: naming.rank_name("m", -1),
        lambda: naming.group_name("m", True),
        lambda: naming.group_name("m", 1.0),
        lambda: naming.group_name("x" * 127, 1),
    ],
)
def test_sub_instance_refuses(call):
    with pytest.raises(ValueError):
        call()


def test_upstream_default_ipc_name(no_env, monkeypatch):
    # tp_ipc_util's callers without an engine keep upstream's "kvcached".
    assert naming.ipc_name() == naming.DEFAULT_IPC_NAME == "kvcached"
    monkeypatch.setenv("KVCACHED_IPC_NAME", "from-env")
    assert naming.ipc_name() == "from-env"


def test_socket_names(no_env, monkeypatch):
    root = paths.socket_root("inst/1 x")
    base = os.path.basename(root)
    assert os.path.dirname(root) == paths.BASE_DIR
    assert base == naming.socket_dir_name("inst/1 x") and base.startswith("kvcached-tp-inst_1_x-")
    # Distinct names never share a directory, even when their safe forms match.
    assert naming.socket_dir_name("inst/1 x") != naming.socket_dir_name("inst_1_x")
    assert len(naming.socket_dir_name("y" * 127)) <= len("kvcached-tp--") + 40 + 10
    assert paths.socket_path(3, 0, "n") == os.path.join(paths.socket_root("n"), "w3.sock")
    assert paths.socket_path(3, 2, "n") == os.path.join(paths.socket_root("n"), "pp2", "w3.sock")
    assert naming.is_stage_dir_name("pp7") and not naming.is_stage_dir_name("pp") and not naming.is_stage_dir_name("w1")
    # The default socket root follows the default IPC name.
    assert paths.socket_root() == paths.socket_root("kvcached")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "other")
    assert paths.socket_root() == paths.socket_root("other")


def test_tp_ipc_util_default_name_still_works(no_env):
    from kvcached import tp_ipc_util

    assert tp_ipc_util.get_worker_socket_path(0) == paths.socket_path(0, 0, "kvcached")


def test_limits_reexports():
    import kvcached.limits as limits

    assert limits.instance_name is naming.instance_name
    assert limits.group_record_name("m", 3) == "m_g3"
