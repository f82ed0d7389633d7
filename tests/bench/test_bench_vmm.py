"""python -m kvcached.bench vmm on the host backend: every path of both handle kinds is
measured in one run, and the layout row (the driver sequence in kvcached's layout and order)
exists where the layout differs from raw's, for 2 MiB handles, not for compound ones."""

from __future__ import annotations

import json
import subprocess
import sys


def test_vmm_bench_measures_every_path_with_the_layout_row():
    out = subprocess.run(
        [sys.executable, "-m", "kvcached.bench", "vmm", "--layers", "2", "--pages", "2", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = json.loads(out)["rows"]
    paths = {(r["handle"], r["path"]) for r in rows}
    assert paths == {
        ("2MiB", "raw"),
        ("2MiB", "raw+zero"),
        ("2MiB", "raw+zero/layout"),
        ("2MiB", "kvcached"),
        ("2MiB", "kvcached/page"),
        ("compound", "raw"),
        ("compound", "raw+zero"),
        ("compound", "kvcached"),
        ("compound", "kvcached/page"),
    }
    layout = next(r for r in rows if r["path"] == "raw+zero/layout")
    assert layout["handles"] == 2 * 2 * 2  # pages x layers x K/V, one handle each
    assert all(r["map_us/handle"] > 0 and r["unmap_us/handle"] > 0 for r in rows)
