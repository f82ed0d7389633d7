"""The Prometheus side of the metrics tests, shared by tests/metrics and tests/router
(the fault campaign scrapes the exporter): parsing a scrape, a scrape of this process's
collector, and ``kvctl metrics`` in a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from typing import Dict, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcached.metrics import KvcachedCollector
from limits_helpers import BPP

BUDGET = 8 * BPP  # the device budget of the metrics tests' instances

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def scrape(prefix: str) -> Samples:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvcachedCollector(prefix=prefix))
    return parse(generate_latest(reg).decode())


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


class Exporter:
    """`kvctl metrics` in a child process, as an operator runs it."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached.cli.kvctl", "metrics", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert "serving http://" in line, (line, self.proc.stderr.read())
        self.url = line.split()[3]
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def get(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(self.url.replace("/metrics", path), timeout=30) as r:
            return r.read().decode()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)
