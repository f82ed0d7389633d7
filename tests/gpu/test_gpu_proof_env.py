"""The GPU proof's engines get the settings a step gives them (scripts/gpu_proof/common.py),
checked without a GPU. Until 12-06 the `-ro` steps set KVCACHED_ZERO_PAGE=ro for a script
whose engines start without the caller's KVCACHED_* variables, so they ran read-write."""

from __future__ import annotations

import os
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_proof"))
common = pytest.importorskip("common")


def test_a_steps_kvcached_settings_reach_its_kvcached_engines_only(monkeypatch):
    monkeypatch.setenv("KVCACHED_ZERO_PAGE", "ro")
    monkeypatch.setenv("KVCACHED_ALLOW_UNSUPPORTED", "1")
    monkeypatch.setenv("KVCACHED_KEEP_NULL_PAGE", "true")  # three-keep
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "DEBUG")  # not a step setting: the engine's own
    env = common.engine_env(True, "proof_kvcached_1", False, 0.3)
    assert env["KVCACHED_ZERO_PAGE"] == "ro" and env["KVCACHED_ALLOW_UNSUPPORTED"] == "1"
    assert env["KVCACHED_KEEP_NULL_PAGE"] == "true"
    assert env["KVCACHED_LOG_LEVEL"] == "INFO" and env["ENABLE_KVCACHED"] == "true"
    native = common.engine_env(False, "proof_native_1", False, 0.3)
    assert not any(k.startswith(("KVCACHED_", "ENABLE_KVCACHED")) for k in native)


def test_an_explicit_setting_wins_over_the_steps(monkeypatch):
    monkeypatch.setenv("KVCACHED_ZERO_PAGE", "ro")
    env = common.engine_env(True, "proof_kvcached_1", False, 0.3, KVCACHED_ZERO_PAGE="rw")
    assert env["KVCACHED_ZERO_PAGE"] == "rw"
