"""Hostile or malformed input at the router's front (issue 34, items 4 and 5): a 4xx, never a
traceback; nothing a client should not control reaches the engine. Real router, real sockets,
a real stand-in engine process that reports what it received (tests/router/test_router_standin.py)."""

from __future__ import annotations

import json
import socket
import time

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


# ------------------------------------------------- clients that stall (issue 34, item 3)
def _closed_within(sock: socket.socket, bound: float) -> bool:
    """The router closed ``sock`` (EOF or reset) within ``bound`` seconds."""
    sock.settimeout(bound)
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def test_requests_that_never_finish_arriving_are_cut_at_the_deadline(running, monkeypatch):
    """300 connections stalling their body kept 300 threads past 30 s; a bare GET without its
    blank line got no answer and no close. Each request now has READ_DEADLINE_S to arrive."""
    from kvcached.router import proxy

    monkeypatch.setattr(proxy, "READ_DEADLINE_S", 1.0)
    r = running([{"name": MODEL}])
    r.ready()
    stalled = []
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", r.port), timeout=BOUND_S)
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line
        else:
            head = f'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{"model": "{MODEL}"'
            s.sendall(head.encode())  # a tenth of the body
        stalled.append(s)
    try:
        assert complete(r.port, MODEL)[0] == 200  # served meanwhile
        assert all(_closed_within(s, BOUND_S) for s in stalled)
        assert engine_calls(r) == ["/v1/completions"]  # no stalled body was forwarded
    finally:
        for s in stalled:
            s.close()


def test_connections_over_the_cap_are_closed_and_serving_resumes(running, monkeypatch):
    from kvcached.router import proxy

    monkeypatch.setattr(proxy, "MAX_CONNECTIONS", 4)
    r = running([{"name": MODEL}])
    r.ready()
    idle = [socket.create_connection(("127.0.0.1", r.port), timeout=BOUND_S) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", r.port), timeout=BOUND_S)
        assert _closed_within(extra, BOUND_S)  # every slot taken: closed unanswered
        extra.close()
    finally:
        for s in idle:
            s.close()
    for _ in range(200):  # the idle handlers see the close and free their slots
        try:
            if complete(r.port, MODEL)[0] == 200:
                break
        except (ConnectionError, OSError):
            pass
    else:
        raise AssertionError("the router did not serve again after the idle connections closed")


def test_bodies_in_flight_are_capped_in_bytes(running, monkeypatch):
    """Six stalled 64 MiB bodies took the router from 23 to 387 MiB: the bodies being read
    or forwarded together are capped; past it a request gets 503 at once."""
    from kvcached.router import proxy

    monkeypatch.setattr(proxy, "MAX_INFLIGHT_BODY", 1 << 20)
    r = running([{"name": MODEL}])
    r.ready()
    big = 700 << 10
    first = socket.create_connection(("127.0.0.1", r.port), timeout=BOUND_S)
    first.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n\r\n".encode() + b"{")
    try:
        for _ in range(200):  # until the router is reading the first body
            if r.server.bodies.used == big:
                break
            time.sleep(0.01)
        answer = post(r.port, b" " * 10, length=big)  # a second one would pass the cap
        assert status(answer) == 503 and b"too many request bodies" in answer
        assert complete(r.port, MODEL)[0] == 200  # small ones still fit
    finally:
        first.close()
