"""Prometheus metrics of kvcached (``kvcached_*``), read from the shared records.

- ``KvcachedCollector``: a prometheus_client collector (kvcached.metrics.collector);
- ``register_engine_collector``: the series in an engine's /metrics (kvcached.metrics.engine);
- ``kvctl metrics``: the standalone exporter (kvcached.metrics.exporter).

Needs ``prometheus_client`` (the library vLLM and SGLang use). docs/OBSERVABILITY.md
lists every metric.
"""

from kvcached.metrics.collector import KvcachedCollector
from kvcached.metrics.engine import register_engine_collector

__all__ = ["KvcachedCollector", "register_engine_collector"]
