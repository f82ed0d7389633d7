"""KVCACHED_ZERO_PAGE=ro: the zero page behind every unmapped unit is read-only, so a write
into unmapped KV memory faults instead of changing what all unmapped memory reads.

Each case runs in its own process: on the host backend a fault kills it with SIGSEGV; on a
GPU (an H100, 2026-12-05) the driver kills it with SIGSEGV too, or the kernel fails with an
illegal address and the process's CUDA context is lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

PAGE = 64 << 10


def prelude(device: str, page: int) -> str:
    dev = "cuda:0" if device == "cuda" else "cpu"
    return f"""
import torch
import kvcached.vmm_ops as vmm
vmm.init_kvcached("{dev}", page_size={page})
a, b = vmm.create_kv_tensors(4 * {page}, 2, "{dev}", 2, 2)
sync = torch.cuda.synchronize if "{dev}" != "cpu" else (lambda: None)
"""


def run(body: str, zero_page: str | None, device: str = "cpu", page: int = PAGE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_ZERO_PAGE"}  # kvcached as this process has it
    if zero_page is not None:
        env["KVCACHED_ZERO_PAGE"] = zero_page
    code = prelude(device, page) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_shared_zero_page_is_why_the_option_exists():
    # Read-write (the default), a write into one tensor's unmapped memory shows up in another
    # tensor's unmapped memory: every unmapped unit is the same physical page.
    p = run(
        """
        a[:, 0].fill_(1)
        print(int(b[:, 3].abs().sum()))
        """,
        None,
    )
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) > 0


def test_read_only_zero_page_reads_zeros_maps_writable_pages_and_faults_on_a_stray_write(device, page_size):
    p = run(
        f"""
        assert int(a.abs().sum()) == 0 and int(b.abs().sum()) == 0
        vmm.map_to_kv_tensors([{page_size}])
        a[:, 1].fill_(7)                   # a mapped page is writable
        assert int(a[:, 1].sum()) == 7 * a[:, 1].numel()
        vmm.unmap_from_kv_tensors([{page_size}])
        assert int(a.abs().sum()) == 0     # read-only zeros again
        print("ok", flush=True)
        a[:, 1].fill_(1)                   # unmapped again: this write must fault
        sync()
        print("not reached", flush=True)
        """,
        "ro",
        device,
        page_size,
    )
    assert p.stdout.split() == ["ok"], (p.stdout, p.stderr)
    if device == "cpu":
        assert p.returncode == -signal.SIGSEGV
    else:
        assert p.returncode == -signal.SIGSEGV or (p.returncode != 0 and "illegal" in p.stderr.lower()), p.stderr


@pytest.mark.parametrize("value", ["rw", ""])
def test_rw_and_unset_are_the_default(value):
    p = run("a[:, 0].fill_(1)\nprint('wrote')", value)
    assert p.returncode == 0 and p.stdout.strip() == "wrote", p.stderr


def test_a_bad_value_is_one_line_naming_the_fix():
    p = run("", "readonly")
    assert p.returncode != 0
    line = [x for x in p.stderr.splitlines() if "KVCACHED_ZERO_PAGE" in x]
    assert line and "neither rw nor ro" in line[-1] and "unset it" in line[-1], p.stderr
