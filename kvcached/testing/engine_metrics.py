"""An engine's own ``/metrics`` held against ``kvctl list --json``, for the
real-engine tests of vLLM and SGLang: both serve the kvcached_* series from the
same shared-memory record that kvctl reads, so the two must agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from typing import Any, Dict, Tuple

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def kvcached_samples(base_url: str) -> Samples:
    """The kvcached_* samples of ``{base_url}/metrics``: {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("kvcached_")
    }


def kvctl_row(name: str) -> Dict[str, Any]:
    """``kvctl list --json NAME``'s one row (the kvctl installed beside this interpreter)."""
    kvctl = os.path.join(os.path.dirname(sys.executable), "kvctl")
    r = subprocess.run([kvctl, "list", "--json", name], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise AssertionError(f"kvctl list --json {name}: rc={r.returncode}: {r.stderr.strip()}")
    (row,) = json.loads(r.stdout)
    return row


def scrape_agreeing_with_kvctl(base_url: str, name: str) -> Tuple[Samples, Dict[str, Any]]:
    """A scrape taken between two equal kvctl rows (the engine publishes at any
    moment; then it is read again): (samples, row)."""
    for _ in range(20):
        before = kvctl_row(name)
        samples = kvcached_samples(base_url)
        after = kvctl_row(name)
        before.pop("updated_ns"), after.pop("updated_ns")
        if before == after:
            return samples, after
    raise AssertionError(f"the record of {name} kept changing")


def check_scrape_agrees(samples: Samples, row: Dict[str, Any]) -> None:
    """Every kvcached_* series of the instance equals the kvctl row's field."""
    from kvcached.metrics.collector import _COUNTERS, _HISTOGRAMS, _REFUSALS

    lab = (("device", row["device"]), ("engine", row["engine"]), ("name", row["name"]))
    for metric, key in [("kvcached_limit_bytes", "limit"), ("kvcached_mapped_bytes", "mapped"),
                        ("kvcached_used_bytes", "used"), ("kvcached_reserved_bytes", "prealloc"),
                        ("kvcached_granted_bytes", "granted"), ("kvcached_held_bytes", "held")]:  # fmt: skip
        assert samples[(metric, lab)] == row[key], metric
    for stem, _, key in _COUNTERS:
        assert samples[(f"kvcached_{stem}_total", lab)] == row["counters"][key], stem
    for reason, key in _REFUSALS:
        assert samples[("kvcached_refused_allocations_total", lab + (("reason", reason),))] == row["counters"][key], key
    for hist, _ in _HISTOGRAMS:
        assert samples[(f"kvcached_{hist}_count", lab)] == row["histograms"][hist]["count"], hist
    assert samples[("kvcached_stats_valid", lab)] == 1
