"""The router reaches only the engine it started (issue 34, item 1; docs/SECURITY.md H8):
an impostor that holds an engine's port (bound before the engine, or after it died),
as this user or as another one, gets nothing from the router, not even a health check,
and the client gets an error, not its answer. Also the socket lookups underneath
(``kvcached.router.tcp_table``, both ways) and the ownership check
(``kvcached.router.peer_check``) on their own. Real router, real stand-in engine
processes (tests/router/test_router_standin.py), a real impostor process."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvcached.router import tcp_table
from kvcached.router.peer_check import EngineSockets, NotTheEngine, descendants
from kvcached.router.supervisor import free_port
from router_helpers import BOUND_S, complete, request, wait_for

OTHER_UID = 64001  # as in test_security_users.py: no passwd entry needed

# Binds the port (as ``uid`` when >= 0, dropped to before the socket exists, so the kernel
# records that uid), prints "ready", then answers every request 200 like an engine would and
# prints every byte it receives as a JSON line.
IMPOSTOR = textwrap.dedent(
    r"""
    import json, os, socket, sys, threading, time
    port, uid = int(sys.argv[1]), int(sys.argv[2])
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 60
    while True:  # the engine's process may still be exiting
        try:
            srv.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    srv.listen(64)
    lock = threading.Lock()
    answer = json.dumps({"model": "alpha", "impostor": True, "choices": [{"text": "impostor"}]}).encode()
    def serve(c):
        buf = b""
        with c:
            while True:
                try:
                    data = c.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with lock:
                    print(json.dumps({"received": data.decode("latin-1")}), flush=True)
                buf += data
                while b"\r\n\r\n" in buf:
                    buf = buf.split(b"\r\n\r\n", 1)[1]
                    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    c.sendall(head % len(answer) + answer)
    print("ready", flush=True)
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)


class Impostor:
    """A process (not the engine's, not its child) holding ``port``, as ``uid`` (-1: this user)."""

    def __init__(self, port: int, uid: int = -1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IMPOSTOR, str(port), str(uid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", self.proc.stderr.read()
        self.pid = self.proc.pid

    def stop(self) -> list:
        """Ends it; everything it received."""
        self.proc.kill()
        out, _ = self.proc.communicate(timeout=BOUND_S)
        return [json.loads(x)["received"] for x in out.splitlines() if x.strip()]


USERS = [
    pytest.param(-1, id="same-user"),
    pytest.param(
        OTHER_UID,
        id="other-user",
        marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
    ),
]


def _refusals(caplog, port: int) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and f"port {port} " in r.getMessage()]


def _names_the_impostor(message: str, impostor: Impostor, uid: int) -> bool:
    return f"pid {impostor.pid}" in message and (uid < 0 or f"uid {uid}" in message)


@pytest.mark.parametrize("uid", USERS)
def test_an_impostor_bound_before_the_engine_gets_nothing(running, tmp_path, monkeypatch, caplog, uid):
    caplog.set_level(logging.INFO, logger="kvcached.router")
    gate = tmp_path / "gate"
    monkeypatch.setenv("STANDIN_BIND_GATE", str(gate))  # the engine is slow to bind
    port = free_port()
    r = running([{"name": "alpha", "port": port}], wake_timeout_s=2, restart_backoff_max_s=0.5)
    impostor = Impostor(port, uid)
    try:
        # The supervisor's health check finds someone else on the port and says who (without
        # the check, the impostor's answer to /health made the model ready).
        engine = r.router.engines["alpha"]
        wait_for(lambda: _refusals(caplog, port) or engine.state == "ready", "the health check of the impostor")
        status, _, body = request(r.port, "POST", "/v1/completions", {"model": "alpha", "prompt": "secret"})
        assert status == 503 and b"impostor" not in body, body  # the model never became ready
        assert _names_the_impostor(_refusals(caplog, port)[0], impostor, uid), _refusals(caplog, port)
    finally:
        received = impostor.stop()
    assert received == []  # not a health check, not a header, not a prompt
    gate.touch()  # the impostor is gone and the engine binds: served as usual
    r.ready("alpha")
    status, out = complete(r.port, "alpha")
    assert status == 200 and out["pid"] == r.pid("alpha")


@pytest.mark.parametrize("uid", USERS)
def test_an_impostor_on_the_port_of_a_dead_engine_gets_nothing(running, tmp_path, monkeypatch, caplog, uid):
    caplog.set_level(logging.INFO, logger="kvcached.router")
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("STANDIN_BIND_GATE", str(gate))
    port = free_port()
    # The monitor looks once a minute: the request, not the supervisor, finds the engine gone.
    r = running([{"name": "alpha", "port": port}], health_interval_s=60, restart_backoff_max_s=0.5)
    r.ready("alpha")
    assert complete(r.port, "alpha")[0] == 200
    gate.unlink()  # its restart will wait
    os.kill(r.pid("alpha"), signal.SIGKILL)
    impostor = Impostor(port, uid)  # binds as soon as the dead engine's socket is gone
    try:
        status, _, body = request(r.port, "POST", "/v1/completions", {"model": "alpha", "prompt": "secret"})
        assert status == 502 and "another process holds its port" in json.loads(body)["error"]["message"], body
        assert len(body.splitlines()) == 1 and b"impostor" not in body
        assert _names_the_impostor(_refusals(caplog, port)[0], impostor, uid), _refusals(caplog, port)
    finally:
        received = impostor.stop()
    assert received == []
    gate.touch()  # handled as a crash: restarted, and served once the port is the engine's again
    r.ready("alpha")
    status, out = complete(r.port, "alpha")
    assert status == 200 and out["pid"] == r.pid("alpha")


# -- the lookups underneath, both ways ------------------------------------------------
@pytest.fixture(params=["sock_diag", "proc"])
def way(request, monkeypatch):
    monkeypatch.setattr(tcp_table, "_use_diag", request.param == "sock_diag")
    if request.param == "sock_diag":
        try:
            tcp_table.diag_listeners(1)
        except OSError as e:
            pytest.skip(f"no sock_diag here ({e})")
    return request.param


def _listening(family: int, host: str) -> socket.socket:
    s = socket.socket(family)
    try:
        s.bind((host, 0))
    except OSError as e:
        s.close()
        pytest.skip(f"cannot bind {host} ({e})")
    s.listen(8)
    return s


def _ino(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


@pytest.mark.parametrize(
    "family,host,takes_ipv4",
    [
        pytest.param(socket.AF_INET, "127.0.0.1", True, id="ipv4-loopback"),
        pytest.param(socket.AF_INET, "0.0.0.0", True, id="ipv4-any"),
        pytest.param(socket.AF_INET6, "::", True, id="ipv6-any"),
        pytest.param(socket.AF_INET6, "::1", False, id="ipv6-loopback"),
    ],
)
def test_listeners_are_found_with_their_inode_and_uid(way, family, host, takes_ipv4):
    with _listening(family, host) as s:
        port = s.getsockname()[1]
        table = tcp_table.diag_listeners(port) if way == "sock_diag" else tcp_table.proc_sockets(port)
        assert [(x.local, x.state, x.uid, x.inode) for x in table] == [
            ((host, port), tcp_table.LISTEN, os.geteuid(), _ino(s))
        ]
        assert [x.inode for x in tcp_table.listeners(port)] == ([_ino(s)] if takes_ipv4 else [])


def test_a_port_nobody_listens_on_has_no_listener_and_no_far_end(way):
    port = free_port()
    assert tcp_table.listeners(port) == []
    assert tcp_table.far_end(("127.0.0.1", 1), ("127.0.0.1", port)) is None


@pytest.mark.parametrize(
    "family,host",
    [pytest.param(socket.AF_INET, "127.0.0.1", id="ipv4"), pytest.param(socket.AF_INET6, "::", id="ipv6-dual-stack")],
)
def test_the_far_end_of_a_connection_is_queued_then_accepted(way, family, host):
    with _listening(family, host) as s, socket.create_connection(("127.0.0.1", s.getsockname()[1])) as c:
        here, peer = c.getsockname(), c.getpeername()
        queued = wait_for(lambda: tcp_table.far_end(here, peer), "the queued far end")
        assert queued.local == peer and queued.remote == here and queued.inode == 0  # no fd yet
        a, _ = s.accept()
        with a:
            far = tcp_table.far_end(here, peer)
            assert far.state == tcp_table.ESTABLISHED and far.inode == _ino(a) and far.uid == os.geteuid()


# -- the ownership check ------------------------------------------------------------
def test_a_listener_of_the_engine_passes_once_known_and_another_process_is_named(way):
    with _listening(socket.AF_INET, "127.0.0.1") as s:
        port = s.getsockname()[1]
        mine = EngineSockets(os.getpid())
        with socket.create_connection(("127.0.0.1", port)) as c:
            started = time.monotonic_ns()  # after this connect: its listener is not proven yet
            assert mine.check(c, started) is False
        started = time.monotonic_ns()
        with socket.create_connection(("127.0.0.1", port)) as c:
            assert mine.check(c, started) is True
        other = subprocess.Popen(["sleep", "60"])
        try:
            with socket.create_connection(("127.0.0.1", port)) as c, pytest.raises(NotTheEngine) as e:
                EngineSockets(other.pid).check(c, time.monotonic_ns())
        finally:
            other.kill()
            other.wait()
        assert e.value.port == port and e.value.pid == os.getpid() and e.value.uid == os.geteuid()
        assert f"port {port} " in str(e.value) and f"engine pid {other.pid}" in str(e.value)


def test_a_listener_of_a_descendant_of_the_engine_passes():
    # The engine forks; its child holds the listener (as an API server process would).
    code = "import os, socket, sys, time\nif os.fork() == 0:\n"
    code += "    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
    code += "    print(s.getsockname()[1], flush=True); time.sleep(60)\nelse:\n    time.sleep(60)\n"
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(engine.stdout.readline())
        assert descendants(engine.pid)
        check = EngineSockets(engine.pid)
        for proven in (False, True):
            started = time.monotonic_ns()
            with socket.create_connection(("127.0.0.1", port)) as c:
                assert check.check(c, started) is proven
    finally:
        for pid in descendants(engine.pid):
            os.kill(pid, signal.SIGKILL)
        engine.kill()
        engine.wait()
