"""The kvcached series in an engine's own ``/metrics`` (vLLM's API server, SGLang's HTTP server).

``register_engine_collector(engine)`` is called once in the engine's
processes when kvcached is active. It shows the records of this engine's
instance (``KVCACHED_IPC_NAME`` and its sub-instances, kvcached.naming rule 3)
plus the device totals, so an existing scrape config needs no change.

Two registries serve an engine's /metrics, and the collector joins both:
  - the default ``prometheus_client.REGISTRY`` (vLLM with one API server);
  - a ``CollectorRegistry`` given to ``multiprocess.MultiProcessCollector``
    when PROMETHEUS_MULTIPROC_DIR is set (SGLang always, vLLM with
    ``--api-server-count`` > 1 or a user-set directory); both engines build it
    per app at server start, so ``MultiProcessCollector.__init__`` is wrapped
    to register the collector on the registry it is given.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional

from kvcached import naming
from kvcached.metrics.collector import KvcachedCollector

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_collector: Optional[KvcachedCollector] = None


def _register(registry: Any, collector: KvcachedCollector) -> None:
    try:
        registry.register(collector)
    except ValueError:  # already there (duplicate series names): nothing to add
        pass


def _hook_multiprocess(collector: KvcachedCollector) -> None:
    from prometheus_client import multiprocess

    cls = multiprocess.MultiProcessCollector
    if getattr(cls.__init__, "_kvcached_hook", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, registry: Any, *args: Any, **kwargs: Any) -> None:
        original(self, registry, *args, **kwargs)
        if registry is not None:
            _register(registry, collector)

    __init__._kvcached_hook = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def register_engine_collector(engine: str, registry: Any = None) -> Optional[KvcachedCollector]:
    """Adds the kvcached series of this engine's instance to the engine's /metrics.

    Idempotent; returns the collector, or None when ``prometheus_client`` is
    not installed (the engine then has no /metrics either; logged once).
    ``registry``: where to register (default: prometheus_client.REGISTRY).
    """
    global _collector
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        logger.info("kvcached: prometheus_client is not installed; no kvcached metrics in the engine's /metrics")
        return None
    with _lock:
        if _collector is None:
            base = naming.instance_name(engine)
            _collector = KvcachedCollector(select=functools.partial(naming.belongs_to, base), guarded=True)
            _hook_multiprocess(_collector)
        _register(REGISTRY if registry is None else registry, _collector)
        return _collector


def register_engine_collector_quietly(engine: str) -> None:
    """``register_engine_collector`` for an engine's activation: a failure is
    logged once and never raised (metrics must not stop an engine)."""
    try:
        register_engine_collector(engine)
    except Exception as e:  # noqa: BLE001 - any failure: the engine serves without these series
        logger.warning("kvcached: no kvcached series in the engine's /metrics (%s: %s)", type(e).__name__, e)
