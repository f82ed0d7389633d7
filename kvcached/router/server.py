"""``serve``: the router's endpoint bound, its engines started, every child
stopped again on SIGTERM/SIGINT (or when the endpoint stops)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
from typing import Optional

from kvcached.router.config import ConfigError, RouterConfig
from kvcached.router.proxy import RouterServer
from kvcached.router.router import Router, check_port_free

log = logging.getLogger("kvcached.router")


def bind(config: RouterConfig) -> RouterServer:
    """The endpoint, bound before any engine starts (a port in use stops nothing)."""
    check_port_free(config.host, config.port, "router")
    try:
        return RouterServer((config.host, config.port), Router(config))
    except OSError as e:
        raise ConfigError(f"router: cannot listen on {config.host}:{config.port} ({e.strerror})") from None


def serve(config: RouterConfig, host: Optional[str] = None, port: Optional[int] = None) -> int:
    """Runs the router until SIGTERM/SIGINT; returns the exit status."""
    if host is not None or port is not None:
        config = dataclasses.replace(config, host=host or config.host, port=config.port if port is None else port)
    server = bind(config)
    router = server.router

    def on_signal(signum: int, _frame: object) -> None:
        log.info("router: %s received; stopping every engine", signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        router.start()
        h, p = server.server_address[:2]
        print(f"kvcached router: listening on http://{h}:{p} for {', '.join(router.engines)}", flush=True)
        server.serve_forever(poll_interval=0.2)
    finally:
        router.shutdown()
        server.server_close()
        for s, handler in old.items():
            signal.signal(s, handler)
    print("kvcached router: stopped", file=sys.stderr, flush=True)
    return 0
