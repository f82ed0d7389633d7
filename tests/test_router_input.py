"""Hostile or malformed input at the router's front (issue 34, items 4 and 5): a 4xx, never a
traceback; nothing a client should not control reaches the engine. Real router, real sockets,
a real stand-in engine process that reports what it received (tests/test_router_standin.py)."""

from __future__ import annotations

import json
import socket

from router_helpers import BOUND_S, complete, request

MODEL = "alpha"


def raw(port: int, head: str, body: bytes = b"") -> bytes:
    """Sends a hand-written request (bytes as given); the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as s:
        s.sendall(head.encode("latin-1") + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def post(port: int, body: bytes, path: str = "/v1/completions", extra: str = "", length=None) -> bytes:
    n = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}Content-Length: {n}\r\n\r\n"
    return raw(port, head, body)


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def engine_calls(r) -> list:
    return json.loads(request(r.router.engines[MODEL].port, "GET", "/stats")[2])["calls"]


def test_bodies_that_break_a_json_parser_get_400(running):
    r = running([{"name": MODEL}])
    r.ready()
    deep = b'{"model": "alpha", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"model": "alpha", "n": ' + b"9" * 5000 + b"}"
    for body in (deep, huge, b"\xff\xfe not utf-8", b"[1, 2"):
        answer = post(r.port, body)
        assert status(answer) == 400 and b"not JSON" in answer, answer[:200]
    assert engine_calls(r) == []  # nothing reached the engine
    assert complete(r.port, MODEL)[0] == 200  # and the router serves on


def test_a_content_length_that_is_not_ascii_digits_gets_400(running):
    r = running([{"name": MODEL}])
    r.ready()
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    for bad in ("\u00b2", "1e3", "-1", " 12"):
        answer = post(r.port, body, length=bad)
        assert status(answer) in (400, 411), (bad, answer[:200])
    assert status(post(r.port, body, length="9" * 40)) == 413
    assert engine_calls(r) == []


def test_a_bare_cr_in_a_header_is_refused(running):
    r = running([{"name": MODEL}])
    r.ready()
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    answer = post(r.port, body, extra="X-Note: a\rInjected: yes\r\n")
    assert status(answer) == 400 and b"bare CR" in answer
    answer = post(r.port, body, extra="X-Note: a\r\n Injected: yes\r\n")  # obsolete line folding
    assert status(answer) == 400 and b"folded" in answer
    assert engine_calls(r) == []


def test_headers_named_in_connection_are_not_forwarded(running):
    r = running([{"name": MODEL}])
    r.ready()
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    answer = post(r.port, body, extra="Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nX-Kept: 2\r\n")
    assert status(answer) == 200
    stats = json.loads(request(r.router.engines[MODEL].port, "GET", "/stats")[2])
    got = {k.lower(): v for k, v in stats["headers"].items()}
    assert "x-secret" not in got and "connection" not in got and got.get("x-kept") == "2"


def test_only_the_api_routes_are_forwarded_after_normalising_the_path(running):
    r = running([{"name": MODEL}])
    r.ready()
    body = json.dumps({"model": MODEL}).encode()
    for path in ("/v1/../sleep?level=1", "/v1/../../wake_up", "/sleep?level=1", "/v1/admin", "//v1/completions/.."):
        assert status(post(r.port, body, path=path)) == 404, path
    assert engine_calls(r) == []  # the engine's admin endpoints stayed out of reach
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    assert status(post(r.port, body, path="/v1/./completions")) == 200
    assert engine_calls(r) == ["/v1/completions"]
