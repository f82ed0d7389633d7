"""The standalone exporter (``kvctl metrics``): ``/metrics`` over HTTP for every
kvcached instance of this user on the machine, read from the shared records.

Bounded: at most ``MAX_CONNECTIONS`` connections are served at once (more are
closed at once), each is closed ``REQUEST_DEADLINE_S`` after it was accepted
whatever it sends (a client dripping a byte at a time cannot hold a slot), one
silent for ``REQUEST_TIMEOUT_S`` sooner, and scrapes are serialized (one pass
over /dev/shm at a time).
Loopback by default. SIGTERM or SIGINT stop it cleanly (exit status 0).
"""

from __future__ import annotations

import signal
import socket
import socketserver
import threading
from typing import Any, Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvcached.http_guard import DEADLINES, ConnectionCap, cut
from kvcached.metrics.collector import KvcachedCollector

MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 10.0  # silence on a connection (the socket timeout of each read)
REQUEST_DEADLINE_S = 10.0  # a connection's whole life: its request read and its scrape sent
METRICS_PATH = "/metrics"


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # the socket timeout of each connection
    disable_nagle_algorithm = True  # headers and body are separate writes (see kvcached.router.proxy)
    default_request_version = "HTTP/1.1"  # a status line even for an unparsable request line

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds would flood the log


class _Server(ConnectionCap, socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    max_connections = MAX_CONNECTIONS
    # Connections beyond the cap are accepted and closed, not reset by a full listen queue
    # (socketserver's default of 5 drops a burst).
    request_queue_size = 2 * MAX_CONNECTIONS

    def __init__(self, addr: Any, handler: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        token = DEADLINES.add(REQUEST_DEADLINE_S, lambda: cut(request))
        try:
            super().process_request_thread(request, client_address)
        finally:
            DEADLINES.cancel(token)


def _only_metrics(app: Callable) -> Callable:
    lock = threading.Lock()

    def wrapped(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in (METRICS_PATH, METRICS_PATH + "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"kvcached exporter: the metrics are at /metrics\n"]
        with lock:
            return app(environ, start_response)

    return wrapped


def make_registry(prefix: str = "") -> CollectorRegistry:
    """A registry holding only the kvcached collector (instances named ``prefix*``)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvcachedCollector(prefix=prefix))
    return reg


def start_server(host: str, port: int, prefix: str = "") -> _Server:
    """Binds ``host:port`` (port 0: any free one, see ``server_address``) and serves in a daemon thread."""
    server = make_server(host, port, _only_metrics(make_wsgi_app(make_registry(prefix))), _Server, _Handler)
    threading.Thread(target=server.serve_forever, name="kvcached-metrics", daemon=True).start()
    return server


def run(host: str, port: int, prefix: str = "", on_ready: Optional[Callable[[_Server], None]] = None) -> None:
    """Serves until SIGTERM or SIGINT, then stops the server and returns."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    server = start_server(host, port, prefix)
    try:
        if on_ready is not None:
            on_ready(server)
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()
        for s, h in previous.items():
            signal.signal(s, h)
