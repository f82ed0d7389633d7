"""Fault campaign at the edges (docs/SECURITY.md, C2): hostile clients and engine kills
at random against the router's front and the metrics exporter, and after each round
what H1-H8 promise: a well-formed request is served (once the engine is back, if it
was killed), a scrape is answered, no handler died with a traceback, and stalled
connections hold neither threads nor slots past their deadline.

A fixed seed picks the actions; every wait has a generous bound that only a hang
reaches. Real router (in this process), real stand-in engine processes, the exporter
as `kvctl metrics` in its own process, real sockets. About 20-40 s on two cores."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import threading
import urllib.request

import pytest

from metrics_helpers import Exporter
from router_helpers import BOUND_S, complete, wait_for

pytestmark = pytest.mark.slow

ROUNDS = 40
SEED = 20261205
MODEL = "alpha"


def _send(port: int, data: bytes, read: bool = True) -> bytes:
    """Sends raw bytes; the answer until the peer closes (or b"" when not ``read``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as s:
        try:
            s.sendall(data)
            if not read:
                return b""
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out
        except (ConnectionResetError, BrokenPipeError):
            return b""  # closed on us: a refusal, also fine


def _post(body: bytes, extra: str = "", length: object = None) -> bytes:
    n = len(body) if length is None else length
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {n}\r\n\r\n"
    return head.encode("latin-1") + body


def _hostile(rng: random.Random) -> bytes:
    """One malformed or hostile request (H1, H2)."""
    good = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    return rng.choice(
        [
            lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 400))),
            lambda: _post(b"[" * 100_000),
            lambda: _post(b'{"model": "alpha", "max_tokens": ' + b"9" * 5000 + b"}"),
            lambda: _post(good, length="\u00b2"),
            lambda: _post(good, length=1 << 40),
            lambda: _post(good, extra="X-A: b\rX-Injected: 1\r\n"),
            lambda: _post(good, extra="X-A: b\r\n folded\r\n"),
            lambda: _post(good, extra="Connection: close, X-Secret\r\nX-Secret: 1\r\n"),
            lambda: b"POST /v1/../sleep?level=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
            lambda: b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * rng.randint(1, 50),
            lambda: b"\xff\xfe / HTTP/1.1\r\n\r\n",
        ]
    )()


def _stream_and_hang_up(port: int) -> None:
    """A streamed request whose client goes away after the first bytes."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as s:
        s.sendall(_post(body))
        s.recv(1)


def _stall(port: int, rng: random.Random) -> socket.socket:
    """A connection that never finishes its request (H7, H5)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    s.sendall(
        rng.choice(
            [
                b"GET /health HTTP/1.1\r\nHost: x\r\n",
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",
                b"G",
            ]
        )
    )
    return s


def _closed(s: socket.socket) -> bool:
    try:
        s.settimeout(BOUND_S)
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, OSError):
        return True
    finally:
        s.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=BOUND_S) as r:
        return r.read().decode()


def _served(port: int) -> None:
    """A well-formed request is answered 200 (the engine may be restarting)."""

    def ok():
        try:
            return complete(port, MODEL)[0] == 200
        except (OSError, ValueError):
            return False

    wait_for(ok, "a well-formed request served")


def test_hostile_clients_and_engine_kills_at_random(running, monkeypatch, caplog, capfd):
    from kvcached.router import proxy

    monkeypatch.setattr(proxy, "READ_DEADLINE_S", 1.0)  # stalls at the router are cut within the campaign
    caplog.set_level(logging.WARNING)
    r = running([{"name": MODEL}], restart_backoff_s=0.05)
    r.ready()
    exp = Exporter("--prefix", f"kvt-campaign-{os.getpid()}-")
    rng = random.Random(SEED)
    stalled = []
    done = {"hostile": 0, "exporter": 0, "kill": 0, "hangup": 0, "stall": 0}
    threads_before = threading.active_count()
    try:
        for _ in range(ROUNDS):
            action = rng.choice(["hostile", "hostile", "hostile", "exporter", "kill", "hangup", "stall"])
            done[action] += 1
            if action == "hostile":
                answer = _send(r.port, _hostile(rng))
                assert not answer or answer.startswith(b"HTTP/1.1 "), answer[:200]
            elif action == "exporter":
                _send(exp.port, _hostile(rng))
            elif action == "kill":
                os.kill(r.pid(MODEL), signal.SIGKILL)
            elif action == "hangup":
                _stream_and_hang_up(r.port)
            else:
                stalled.append(_stall(rng.choice([r.port, exp.port]), rng))
            _served(r.port)
            assert "kvcached_" in _scrape(exp.port) or exp.proc.poll() is None
        assert all(_closed(s) for s in stalled)  # every stall cut at its deadline
        stalled.clear()
        wait_for(lambda: threading.active_count() <= threads_before + 8, "the router's handler threads to end")
    finally:
        for s in stalled:
            s.close()
        exp.stop()
    assert all(done.values()), done  # the seed exercised every kind of fault
    tracebacks = [rec for rec in caplog.records if rec.exc_info and rec.name.startswith("kvcached")]
    assert not tracebacks, tracebacks[0].getMessage()
    err = capfd.readouterr().err  # socketserver prints a handler's uncaught error there
    assert "Traceback" not in err, err[err.find("Traceback") - 200 :][:3000]
    assert exp.proc.returncode == 0
    assert "Traceback" not in exp.proc.stderr.read()
