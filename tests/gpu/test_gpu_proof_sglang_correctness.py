"""The SGLang correctness step's pool sizes (scripts/gpu_proof/sglang_correctness.py), checked
without a GPU: native-small, the control under a limit, holds as many tokens as kvcached-limit's
limit does, also with an FP8 KV cache (``--kv`` counts model-dtype bytes, a limit mapped bytes)."""

from __future__ import annotations

import os
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_proof"))
sglang_correctness = pytest.importorskip("sglang_correctness")


@pytest.mark.parametrize(
    "extra, cpu, expected",
    [
        ([], False, 2),
        ([], True, 4),
        (["--kv-cache-dtype", "fp8_e4m3"], False, 1),
        (["--kv-cache-dtype=fp8_e5m2"], True, 1),
        (["--kv-cache-dtype", "auto"], False, 2),
        (["--page-size", "16", "--kv-cache-dtype"], False, 2),  # no value: the model's dtype
    ],
)
def test_a_kv_element_is_one_byte_with_an_fp8_cache_else_the_models(extra, cpu, expected):
    assert sglang_correctness.kv_dtype_bytes(extra, cpu) == expected
