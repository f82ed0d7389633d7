"""The router's HTTP front: one OpenAI-compatible endpoint over every model.

``POST`` to an API route (``FORWARDED``: completions, chat completions,
embeddings, ...; the path normalised first, never an engine's admin endpoint)
goes to the ``model``'s engine, without hop-by-hop headers or those the client's
``Connection`` names, the response passed through as it arrives (streams stay
streams: server-sent events are forwarded chunk by chunk). Malformed input (a
bare CR/LF in a header, a bad ``Content-Length``, a body that is not JSON or is
nested too deep) gets a 4xx, never a traceback; stalled clients are bounded
(``READ_DEADLINE_S``, ``CLIENT_TIMEOUT_S``, ``MAX_CONNECTIONS``, ``MAX_INFLIGHT_BODY``).
``GET /v1/models`` lists the configured models with their state, ``GET
/health`` says the router is up, ``GET /metrics`` is ``RouterMetrics``.
Standard library only (``ThreadingHTTPServer`` + ``http.client``): one thread
per connection, which suits a handful of engines and keeps the package free
of dependencies.
"""

from __future__ import annotations

import http.client
import json
import logging
import posixpath
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

from kvcached.http_guard import DEADLINES, ConnectionCap, cut
from kvcached.quota import Quota
from kvcached.router.peer_check import CheckedConnection, EngineSockets, NotTheEngine
from kvcached.router.router import Router

log = logging.getLogger("kvcached.router")

MAX_BODY = 64 << 20  # a request body larger than this is refused (413)
# Clients that stall cannot hold the router: each request's line, headers and body must have
# arrived READ_DEADLINE_S after the router started waiting for it (an idle keep-alive
# connection is closed then too), a silent client is dropped after CLIENT_TIMEOUT_S, at most
# MAX_CONNECTIONS connections are served at once (more are closed at once), and the bodies
# being read or forwarded together hold at most MAX_INFLIGHT_BODY bytes (more: 503).
READ_DEADLINE_S = 30.0
CLIENT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 512
MAX_INFLIGHT_BODY = 256 << 20
# What _forward returns when there is no HTTP status to pass on.
NOT_REACHED = -1  # the engine's process never read the request: it may be sent again after a restart
NO_ANSWER = 0  # the engine had the request and stopped without answering: never sent again
NOT_OURS = -2  # another process holds the engine's port: nothing was sent (docs/SECURITY.md H8)
# Connection-level headers are not forwarded (RFC 9110 7.6.1); lengths are set anew.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}


# The API routes forwarded to an engine (POST, with a "model"); anything else, the engines'
# admin endpoints (/sleep, /wake_up, ...) among them, is not reachable through the router.
FORWARDED = frozenset(
    ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank", "/v1/score")
)


def forwarded_path(raw: str) -> str:
    """The path a POST goes to, normalised (``/v1/../sleep`` is ``/sleep``), or "" when it is not
    an API route the router serves. The query string is kept."""
    path, sep, query = raw.partition("?")
    norm = posixpath.normpath(path) if path.startswith("/") else ""
    return norm + sep + query if norm in FORWARDED else ""


def forwarded_headers(headers) -> dict:  # type: ignore[no-untyped-def]
    """The client's headers an engine gets: hop-by-hop ones and those the client's
    ``Connection`` header names dropped (RFC 9110 7.6.1)."""
    named = {t.strip().lower() for v in headers.get_all("Connection", []) for t in v.split(",")}
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in named}


class _LineRecorder:
    """The request's reader while its headers are parsed, keeping the raw lines: the parser
    splits a bare CR into two headers, so only the bytes tell a header smuggled in that way."""

    def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
        self.f = f
        self.lines: list = []

    def readline(self, size: int = -1) -> bytes:
        line = self.f.readline(size)
        self.lines.append(line)
        return line

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.f, name)


def _bare_line_break(lines: list) -> bool:
    """A CR inside a header line (not its CRLF end), or a folded continuation line: either
    would reach the engine as a header of the client's choosing."""
    return any(b"\r" in ln.rstrip(b"\r\n") or ln[:1] in (b" ", b"\t") for ln in lines)


class RouterServer(ConnectionCap, ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # A burst's clients connect at once: socketserver's listen queue of 5 resets the
    # rest (3 of 64 on the H200). The kernel caps it at net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, address: Any, router: Router) -> None:
        self.router = router
        self.max_connections = MAX_CONNECTIONS
        self.bodies = Quota(MAX_INFLIGHT_BODY)  # request body bytes in flight
        super().__init__(address, RouterHandler)


class RouterHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvcached-router"
    # Headers, body and each streamed chunk are separate writes: with Nagle on, each
    # waited for the client's delayed ACK (40 ms a request; python -m kvcached.bench router).
    disable_nagle_algorithm = True
    # An unparsable request line was answered HTTP/0.9-style (a bare HTML body, no
    # status line): a client gets "HTTP/1.1 400" instead (tests/router/test_fault_campaign_edges.py).
    default_request_version = "HTTP/1.1"
    server: RouterServer
    timeout = CLIENT_TIMEOUT_S  # each read from or write to the client
    _not_ours: NotTheEngine  # why _forward returned NOT_OURS

    def handle_one_request(self) -> None:
        # The deadline of this request's arrival; read_done() ends it once the body is in.
        self._deadline = DEADLINES.add(READ_DEADLINE_S, lambda: cut(self.connection))
        try:
            super().handle_one_request()
        finally:
            DEADLINES.cancel(self._deadline)

    def read_done(self) -> None:
        DEADLINES.cancel(self._deadline)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    # -- replies -------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str = "application/json", extra: Optional[Dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: Optional[Dict] = None) -> None:
        self._send(status, json.dumps(obj).encode(), extra=extra)

    def _error(self, status: int, message: str, etype: str, code: Optional[str] = None, extra=None) -> None:
        """An OpenAI-style error body."""
        self._json(status, {"error": {"message": message, "type": etype, "param": None, "code": code}}, extra)

    def parse_request(self) -> bool:
        rec = _LineRecorder(self.rfile)
        self.rfile = rec  # type: ignore[assignment]
        try:
            ok = super().parse_request()
        finally:
            self.rfile = rec.f
        if ok and _bare_line_break(rec.lines):
            self.close_connection = True
            self._error(400, "a header holds a bare CR or is folded over lines", "invalid_request_error")
            return False
        return ok

    # -- routes --------------------------------------------------------------
    def do_GET(self) -> None:
        self.read_done()
        router = self.server.router
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._json(200, {"status": "ok", "models": {n: e.state for n, e in router.engines.items()}})
        elif path == "/v1/models":
            now = int(time.time())
            data = [
                {"id": n, "object": "model", "created": now, "owned_by": "kvcached-router", "state": e.state}
                for n, e in router.engines.items()
            ]
            self._json(200, {"object": "list", "data": data})
        elif path == "/metrics":
            text = router.metrics.render(router.engines.values()).encode()
            self._send(200, text, "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._error(404, f"no route GET {path}", "not_found_error")

    def do_POST(self) -> None:
        router = self.server.router
        path = forwarded_path(self.path)
        if not path:
            self.close_connection = True  # its body is not read: it must not be taken for a request
            self._error(404, f"no route POST {self.path}", "not_found_error")
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            self._error(411, "a Content-Length header is required", "invalid_request_error")
            return
        if not (length.isascii() and length.isdigit()):  # "²" is a digit to str.isdigit
            self.close_connection = True
            self._error(400, "Content-Length must be a decimal number of bytes", "invalid_request_error")
            return
        if len(length) > 20 or int(length) > MAX_BODY:
            self.close_connection = True
            self._error(413, f"request body over {MAX_BODY} bytes", "invalid_request_error")
            return
        self.path = path
        n = int(length)
        if not self.server.bodies.take(n):
            self.close_connection = True
            self._error(
                503, "the router is reading or forwarding too many request bodies; retry", "service_unavailable",
                extra={"Retry-After": "1"},
            )  # fmt: skip
            return
        try:
            self._post_body(router, n)
        finally:
            self.server.bodies.give(n)

    def _post_body(self, router: Router, n: int) -> None:
        body = self.rfile.read(n)
        if len(body) < n:  # the client closed or the deadline cut it
            self.close_connection = True
            return
        self.read_done()
        try:
            req = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep, an integer too long
            self._error(400, "the request body is not JSON this router reads", "invalid_request_error")
            return
        model = req.get("model") if isinstance(req, dict) else None
        if not isinstance(model, str) or not model:
            self._error(400, "the request names no model ('model')", "invalid_request_error", "model_not_found")
            return
        if model not in router.engines:
            known = ", ".join(sorted(router.engines))
            self._error(
                404, f"model {model!r} is not served here; known: {known}", "invalid_request_error", "model_not_found"
            )
            return
        self._route(model, body)

    def _route(self, model: str, body: bytes) -> None:
        router = self.server.router
        engine = router.engines[model]
        for attempt in (0, 1):
            if not router.acquire(model):
                status = 503
                router.metrics.request(model, status)
                self._error(
                    status,
                    f"model {model!r} is not serving within {router.config.wake_timeout_s:g} s (state {engine.state})",
                    "service_unavailable",
                    extra={"Retry-After": "10"},
                )
                return
            host, port, sockets = engine.endpoint()
            try:
                status = self._forward(model, host, port, sockets, body)
            finally:
                router.release(model)
            # The engine was gone before the request reached it: wait for its restart once.
            # A request it had received is never sent again: it may be what stopped it.
            if status != NOT_REACHED or attempt == 1 or not engine.check_exited():
                break
        if status == NOT_OURS:
            engine.refused(sockets, self._not_ours)  # logged there, with the port and who holds it
            router.metrics.request(model, 502)
            self._error(
                502,
                f"the engine of model {model!r} is not reachable: another process holds its port; "
                "nothing was sent to it (the router's log names it)",
                "bad_gateway",
            )
        elif status == NO_ANSWER:
            engine.check_exited(wait_s=1.0)  # a crash: restarted now, not at the next health check
            router.metrics.request(model, 502)
            self._error(
                502,
                f"the engine of model {model!r} stopped while handling this request; "
                "it was not sent again (it may be what stopped the engine)",
                "bad_gateway",
            )
        elif status == NOT_REACHED:
            router.metrics.request(model, 502)
            self._error(502, f"the engine of model {model!r} did not answer", "bad_gateway")

    def _forward(self, model: str, host: str, port: int, sockets: Optional[EngineSockets], body: bytes) -> int:
        """Sends the request on and streams the answer back; its status, NOT_REACHED when
        the engine's process did not read it (no connection, or reset unread), NO_ANSWER
        when it read it and gave no status (nothing was sent to the client then, nor counted),
        NOT_OURS when the connection reached another process (nothing sent; ``_not_ours``)."""
        if sockets is None:  # never started
            return NOT_REACHED
        headers = forwarded_headers(self.headers)
        headers["Content-Length"] = str(len(body))
        # Checked once connected, before the request goes out: the port may be someone else's.
        conn = CheckedConnection(host, port, sockets, self.server.router.config.request_timeout_s)
        try:
            try:
                conn.connect()
            except NotTheEngine as e:
                self._not_ours = e
                return NOT_OURS
            except OSError:
                return NOT_REACHED
            try:
                conn.request("POST", self.path, body=body, headers=headers)
                resp = conn.getresponse()
            except http.client.RemoteDisconnected:
                return NO_ANSWER  # closed cleanly without an answer: the engine had read it
            except (ConnectionResetError, BrokenPipeError):
                # Reset by the kernel: the engine's process died with the request unread (still
                # in the listen backlog or the socket buffer), e.g. killed just before it.
                return NOT_REACHED
            except (OSError, http.client.HTTPException):
                return NO_ANSWER
            # Counted before the answer goes out: a client that has read all of it (and
            # then reads /metrics) finds it counted.
            self.server.router.metrics.request(model, resp.status)
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            if resp.length is not None:  # a sized body: same size
                self.send_header("Content-Length", str(resp.length))
                self.end_headers()
                self._copy(resp, chunked=False)
            else:  # a stream: re-chunked as it arrives
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._copy(resp, chunked=True)
            return resp.status
        finally:
            conn.close()

    def _copy(self, resp: http.client.HTTPResponse, chunked: bool) -> None:
        try:
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as e:
            # The engine died mid-answer or the client went away: end this connection
            # (an unterminated chunked body tells the client the answer is incomplete).
            log.warning("%s: response cut off: %s", self.path, e)
            self.close_connection = True
