"""The installed package: the .pth hook at the site-packages root, an extension
that never links the CUDA driver, and a cheap interpreter start."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

import kvcached
from kvcached import _C

INSTALLED = os.path.realpath(kvcached.__file__).startswith(os.path.realpath(sysconfig.get_paths()["purelib"]))


@pytest.mark.skipif(not INSTALLED, reason="kvcached is not installed as a wheel (editable or source tree)")
def test_pth_hook_at_site_packages_root():
    pth = os.path.join(sysconfig.get_paths()["purelib"], "kvcached_autopatch.pth")
    assert os.path.isfile(pth)
    with open(pth) as f:
        assert f.read().strip() == "import kvcached.autopatch"


def test_interpreter_start_stays_cheap():
    # With the hook installed, a plain interpreter imports kvcached but neither
    # torch nor the extension.
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print('torch' in sys.modules, 'kvcached._C' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["False", "False"]


def test_extension_does_not_link_the_driver():
    ldd = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True)
    assert ldd.returncode == 0, ldd.stderr
    for lib in ("libcuda", "libamdhip64", "libtorch", "libc10", "libcudart"):
        assert lib not in ldd.stdout


def test_cuda_device_without_driver_says_what_to_do():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(_C.KvcachedError, match="use device='cpu'|does not exist"):
        _C.backend_info("cuda:0")
