"""The IPC wire format and its small pieces, without worker processes: framing
limits, bodies, error kinds, worker state, fault specs, settings, socket paths."""

from __future__ import annotations

import socket
import struct

import pytest

from kvcached import _C
from kvcached.errors import (
    BackendError,
    InvalidArgumentError,
    OutOfMemoryError,
    ShutdownError,
    StateConsistencyError,
)
from kvcached.ipc import faults, protocol, settings
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.ipc.protocol import Cmd, ProtocolError, WorkerState
from kvcached.ipc.transport import ConnectionClosed, FrameReader


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_frames_survive_any_split(pair) -> None:
    a, b = pair
    frames = [
        protocol.frame(Cmd.MAP, 1, protocol.offsets_body(3, 99, [0, 1 << 40, 65536])),
        protocol.frame(Cmd.PING, 2),
        protocol.frame(Cmd.COMMIT, 3, protocol.group_tx_body(0, -5)),
    ]
    data = b"".join(frames)
    r = FrameReader(b)
    a.sendall(data)  # several frames in one write
    got = [r.read(1.0, 1.0) for _ in frames]
    for byte in data:  # and one byte per write
        a.sendall(bytes([byte]))
    got += [r.read(1.0, 1.0) for _ in frames]
    for cmd, rid, body in (got[0], got[3]):
        assert (cmd, rid) == (Cmd.MAP, 1)
        assert protocol.parse_offsets_body(body) == (3, 99, [0, 1 << 40, 65536])
    assert got[1] == (Cmd.PING, 2, b"") == got[4]
    assert protocol.parse_group_tx_body(got[2][2]) == (0, -5)
    a.close()
    with pytest.raises(ConnectionClosed):
        r.read(1.0, 1.0)


def test_nonblocking_reader_times_out_and_reads(pair) -> None:
    a, b = pair
    r = FrameReader(b, nonblocking=True, spin_s=20e-6)
    with pytest.raises(TimeoutError):
        r.read(0.05, 0.05)
    r2 = FrameReader(a, nonblocking=True)
    big = protocol.frame(Cmd.MAP, 7, protocol.offsets_body(0, 1, list(range(0, 100000))))
    import threading

    t = threading.Thread(target=r2.send, args=(big, 5.0))
    t.start()  # larger than the socket buffer: send must wait for the reader
    cmd, rid, body = r.read(5.0, 5.0)
    t.join()
    assert (cmd, rid) == (Cmd.MAP, 7) and len(protocol.parse_offsets_body(body)[2]) == 100000


@pytest.mark.parametrize(
    "header, reason",
    [
        (struct.pack("<HBBIQ", 0x1234, 1, 2, 0, 1), "malformed"),
        (struct.pack("<HBBIQ", protocol.MAGIC, 9, 2, 0, 1), "version"),
        (struct.pack("<HBBIQ", protocol.MAGIC, 1, 2, protocol.MAX_BODY + 1, 1), "oversized"),
    ],
)
def test_bad_headers_are_refused_before_the_body(pair, header, reason) -> None:
    a, b = pair
    a.sendall(header)
    with pytest.raises(ProtocolError) as ei:
        FrameReader(b).read(1.0, 1.0)
    assert ei.value.reason == reason


def test_truncated_frames(pair) -> None:
    a, b = pair
    a.sendall(protocol.frame(Cmd.MAP, 1, protocol.offsets_body(0, 1, [0]))[:20])
    r = FrameReader(b)
    with pytest.raises(ProtocolError, match="truncated"):
        r.read(1.0, 0.05)  # started, then stalled
    a.close()
    with pytest.raises(ProtocolError, match="truncated"):
        r.read(1.0, 1.0)  # started, then closed


def test_bodies_are_checked() -> None:
    with pytest.raises(ProtocolError, match="malformed-body"):
        protocol.parse_offsets_body(b"\0" * 5)
    body = protocol.offsets_body(0, 1, [0, 8])
    with pytest.raises(ProtocolError, match="does not match"):
        protocol.parse_offsets_body(body[:-1])
    with pytest.raises(ProtocolError):
        protocol.parse_group_tx_body(b"\0" * 11)
    with pytest.raises(ProtocolError):
        protocol.expect_empty(b"x")
    with pytest.raises(InvalidArgumentError, match="64-bit"):
        protocol.offsets_body(0, 1, [1 << 64])
    with pytest.raises(InvalidArgumentError, match="exceed"):
        protocol.offsets_body(0, 1, range(protocol.MAX_OFFSETS + 1))


@pytest.mark.parametrize(
    "kind, cls",
    [
        (_C.ERROR_KIND_INVALID_ARGUMENT, InvalidArgumentError),
        (_C.ERROR_KIND_OUT_OF_MEMORY, OutOfMemoryError),
        (_C.ERROR_KIND_STATE_CONSISTENCY, StateConsistencyError),
        (_C.ERROR_KIND_BACKEND, BackendError),
        (_C.ERROR_KIND_SHUTDOWN, ShutdownError),
    ],
)
def test_error_kinds_cross_the_wire(kind, cls) -> None:
    k, msg = protocol.parse_error_body(protocol.error_body(protocol.kind_of(cls("x")), "why ü"))
    e = protocol.make_error(k, msg)
    assert type(e) is cls and e.kvcached_kind == kind and str(e) == "why ü"

    # The PageAllocator turns the attribute back into the same C++ kind.
    def fail(offsets):
        raise protocol.make_error(kind, "from a rank")

    pa = _C.PageAllocator(1, 4 * 65536, 65536, 2, 0, 0, 0, False, map_fn=fail, unmap_fn=fail)
    with pytest.raises(cls, match="from a rank"):
        pa.alloc_pages(1)


def test_unknown_exceptions_are_backend_errors() -> None:
    assert protocol.kind_of(RuntimeError("bug")) == _C.ERROR_KIND_BACKEND
    assert type(protocol.make_error(1234, "?")) is BackendError
    long = protocol.error_body(_C.ERROR_KIND_BACKEND, "x" * 100000)
    assert len(long) == 4 + protocol.MAX_MESSAGE


def test_worker_state_round_trip() -> None:
    s = WorkerState(
        created=True,
        failed=True,
        live_handles=9,
        mapped_pages=2,
        prepared_pages=1,
        pending_transactions=1,
        quarantined=3,
        units_per_page=4,
        mapped_offsets=[0, 65536],
        failure="rollback failed",
    )
    assert protocol.decode_state(protocol.encode_state(s)) == s


def test_fault_specs() -> None:
    rules = faults.parse("map:2:drop, commit:1:delay=0.5,prepare:1:backend=unmap:3")
    assert rules[Cmd.MAP] == (2, faults.Action("drop"))
    assert rules[Cmd.COMMIT][1].seconds == 0.5
    assert rules[Cmd.PREPARE][1] == faults.Action("backend", backend_op="unmap", backend_nth=3)
    for bad in ("map:0:drop", "nosuch:1:drop", "map:1:explode", "map:1", "map:1:backend=foo:1"):
        with pytest.raises(InvalidArgumentError):
            faults.parse(bad)
    faults.arm("ping:2:drop")
    try:
        assert faults.take(Cmd.PING) is None
        assert faults.take(Cmd.PING) == faults.Action("drop")
        assert faults.take(Cmd.PING) is None  # only the nth
        assert faults.take(Cmd.MAP) is None
    finally:
        faults.clear()
    assert faults.take(Cmd.PING) is None


def test_settings_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "0.25")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "from-env")
    c = TPCoordinator(1)
    assert c.timeout == 0.25 and c.recovery_timeout == 0.25 * settings.RECOVERY_FACTOR
    assert c.ipc_name == "from-env"
    for bad in ("soon", "nan", "inf"):
        monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", bad)
        with pytest.raises(ValueError, match="KVCACHED_IPC_TIMEOUT"):
            settings.ipc_timeout()
    for none in ("0", "-1"):  # upstream's "no timeout": still bounded
        monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", none)
        assert 0 < settings.ipc_timeout() < float("inf")
    monkeypatch.setenv("KVCACHED_PP_SIZE", "0")
    with pytest.raises(ValueError, match="KVCACHED_PP_SIZE"):
        settings.pp_size()
    monkeypatch.setenv("KVCACHED_IPC_SPIN_US", "-3")
    with pytest.raises(ValueError, match="KVCACHED_IPC_SPIN_US"):
        settings.ipc_spin_s()


def test_socket_paths() -> None:
    root = socket_root("inst")
    assert root.startswith("/tmp/kvcached-tp-inst-")
    assert socket_path(3, 0, "inst") == f"{root}/w3.sock"
    assert socket_path(3, 2, "inst") == f"{root}/pp2/w3.sock"
    # Names that sanitise alike still get their own root; odd characters never escape /tmp.
    assert socket_root("a/b") != socket_root("a_b")
    assert "/" not in socket_root("../../etc")[len("/tmp/") :]
    assert len(socket_path(1023, 1023, "x" * 500)) <= 107
    with pytest.raises(InvalidArgumentError):
        socket_path(-1, 0, "inst")
    with pytest.raises(InvalidArgumentError):
        socket_root("")
