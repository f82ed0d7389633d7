"""The worker listener against slow, hoarding and greedy same-uid clients
(docs/SECURITY.md, promises I1-I3): a frame must be whole within the frame
timeout of its first byte; idle connections make room for new ones (the
coordinator reconnects when its own was evicted); memory per connection is
what was received, once, and bounded for the listener as a whole."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kvcached import vmm_ops
from kvcached.ipc import listener as listener_mod
from kvcached.ipc import protocol
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.listener import WorkerListener
from kvcached.ipc.paths import socket_path
from kvcached.ipc.protocol import Cmd
from kvcached.ipc.transport import FrameReader
from kvcached.testing.ipc_worker import WorkerGroup

PAGE = 64 * 1024


def new_name() -> str:
    return f"s{os.getpid()}-{uuid.uuid4().hex[:8]}"


def serve(frame_timeout: float):
    name = new_name()
    return WorkerListener(0, 0, name, frame_timeout=frame_timeout).start(), TPCoordinator(1, ipc_name=name, timeout=5.0)


@pytest.fixture
def served(plane):
    lst, coord = serve(0.3)
    yield lst, coord
    coord.close()
    assert lst.stop()


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)  # blocking: waits for room in the backlog (a timeout would make it EAGAIN)
    s.settimeout(10.0)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def ping(s: socket.socket, rid: int) -> None:
    s.sendall(protocol.frame(Cmd.PING, rid))
    assert FrameReader(s).read(10.0, 10.0)[:2] == (protocol.OK | Cmd.PING, rid)


def _wait(pred, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.01)


# ---- I1: one deadline for the whole frame ------------------------------------------


def test_a_trickled_frame_is_cut_at_the_frame_timeout(served) -> None:
    """40 bytes, one every 50 ms, with a 0.3 s frame timeout: each byte comes
    well within the timeout, the frame never does. It is dropped unserved."""
    lst, coord = served
    frame = protocol.frame(Cmd.MAP, 9, protocol.offsets_body(0, 1, [0, PAGE]))
    assert len(frame) == 48
    s = raw(lst.path)
    sent = 0
    try:
        for b in frame:
            s.sendall(bytes([b]))
            sent += 1
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert closed_by_peer(s)
    s.close()
    assert sent < len(frame)  # cut before the end: nothing was mapped
    assert vmm_ops.group_info(0)["mapped_pages"] == 0
    _wait(lambda: lst.rejections["truncated"] == 1, "the cut frame was not counted")
    coord.map([0])  # everyone else is served as before
    assert vmm_ops.group_info(0)["mapped_pages"] == 1


# ---- I2: connection caps with idle eviction -----------------------------------------


def test_idle_connections_from_other_processes_cannot_lock_the_coordinator_out(served) -> None:
    """MAX_CONNECTIONS idle connections from several processes: new ones evict
    the longest idle of those that never spoke; the coordinator keeps working."""
    lst, coord = served
    coord.map([0])
    per = listener_mod.MAX_PER_PEER
    hoarder = (
        "import socket, sys, time\n"
        "socks = []\n"
        f"for _ in range({per}):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1]); socks.append(s)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    procs = []
    try:
        for _ in range(listener_mod.MAX_CONNECTIONS // per + 1):
            p = subprocess.Popen(
                [sys.executable, "-c", hoarder, lst.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            procs.append(p)
            assert p.stdout.readline().strip() == "held"
        _wait(lambda: lst.rejections["evicted-idle"] >= per, "no idle connection was evicted")
        assert lst.rejections["too-many-connections"] == 0
        coord.map([PAGE])  # its connection spoke: it is not the one evicted
        assert vmm_ops.group_info(0)["mapped_pages"] == 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_coordinator_reconnects_after_its_idle_connection_was_evicted(served) -> None:
    """One process may hold MAX_PER_PEER connections. Busier ones of the same
    process push out the coordinator's idle one; its next request finds the
    connection closed before sending anything, reconnects and succeeds."""
    lst, coord = served
    coord.map([0])
    socks = []
    try:
        for i in range(listener_mod.MAX_PER_PEER):
            s = raw(lst.path)
            ping(s, 100 + i)  # spoke more recently than the coordinator
            socks.append(s)
        _wait(lambda: lst.rejections["evicted-idle"] == 1, "the coordinator's connection was not evicted")
        coord.map([PAGE])
        assert vmm_ops.group_info(0)["mapped_pages"] == 2
        assert lst.rejections["evicted-idle"] == 2  # its reconnect evicted the longest idle of the others
    finally:
        for s in socks:
            s.close()


def test_connections_in_a_frame_are_never_evicted_and_a_full_listener_refuses(plane) -> None:
    lst, coord = serve(30.0)
    socks = []
    try:
        for _ in range(listener_mod.MAX_PER_PEER):
            s = raw(lst.path)
            s.sendall(struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Cmd.PING, 0, 1)[:10])  # half a header
            socks.append(s)
        _wait(lambda: len([c for c in lst._conns.values() if c.reader.in_frame]) == len(socks), "frames not started")
        extra = raw(lst.path)
        assert closed_by_peer(extra)  # refused: nothing idle to evict
        extra.close()
        assert lst.rejections["too-many-connections"] == 1 and lst.rejections["evicted-idle"] == 0
        assert all(c.reader.in_frame for c in lst._conns.values())  # the frames in progress were kept
    finally:
        for s in socks:
            s.close()
        coord.close()
        assert lst.stop()


# ---- I3: memory --------------------------------------------------------------------


def _rss_kib(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_nearly_complete_large_frames_cost_what_they_bring_within_a_listener_bound() -> None:
    """20 connections each send all but the last byte of a MAX_BODY frame and
    stall. Before: ~10 MiB each (+200 MB). Now the bodies in progress share
    FRAME_BUDGET (the rest are refused 'busy'), received once into their buffer."""
    name = new_name()
    group = WorkerGroup(name, 1, noop=True, common_env={"KVCACHED_IPC_TIMEOUT": "60"}).start()
    try:
        pid = group.procs[(0, 0)].pid
        path = socket_path(0, 0, name)
        base = _rss_kib(pid, "VmRSS")
        body = protocol.MAX_BODY
        head = struct.pack("<HBBIQ", protocol.MAGIC, protocol.VERSION, Cmd.MAP, body, 1)
        chunk = b"\0" * (1 << 20)
        socks, outcomes = [raw(path) for _ in range(20)], []

        def flood(s: socket.socket) -> None:
            try:
                s.sendall(head)
                left = body - 1
                while left:
                    n = min(left, len(chunk))
                    s.sendall(chunk[:n])
                    left -= n
                outcomes.append("stalled")
            except OSError:
                outcomes.append("refused")

        threads = [threading.Thread(target=flood, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(outcomes) == 20
        stalled = outcomes.count("stalled")
        assert 1 <= stalled <= listener_mod.FRAME_BUDGET // body  # the rest were refused at once
        grown_mib = (_rss_kib(pid) - base) / 1024
        print(f"listener peak RSS growth: {grown_mib:.1f} MiB for 20 x {body >> 20} MiB frames ({stalled} taken)")
        assert grown_mib < 2 * listener_mod.FRAME_BUDGET / (1 << 20) + 16, grown_mib
        for s in socks:
            s.close()
    finally:
        group.stop()
