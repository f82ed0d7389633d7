"""The worker listener in this process (host backend): bad input from any client
is rejected and logged once while the coordinator keeps being served; only our
uid gets in; the socket root is private; shutdown drains running calls before
it removes anything; a crash's leftovers are cleaned by the next start."""

from __future__ import annotations

import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
import uuid

import pytest

from kvcached import _C, vmm_ops
from kvcached.errors import BackendError, InvalidArgumentError
from kvcached.ipc import faults, protocol
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.executor import NullExecutor, VmmExecutor
from kvcached.ipc.listener import WorkerListener
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.ipc.protocol import Cmd
from kvcached.ipc.transport import FrameReader

PAGE = 64 * 1024
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def new_name() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def served(plane):
    name = new_name()
    lst = WorkerListener(0, 0, name, frame_timeout=0.3).start()
    coord = TPCoordinator(1, ipc_name=name, timeout=5.0)
    yield lst, coord
    coord.close()
    assert lst.stop()
    assert not os.path.exists(socket_root(name))


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(path)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def header(cmd: int, body_len: int, magic: int = protocol.MAGIC, version: int = protocol.VERSION) -> bytes:
    return struct.pack("<HBBIQ", magic, version, cmd, body_len, 1)


def warnings_about(caplog, reason: str):
    return [r for r in caplog.records if r.levelno == logging.WARNING and f"({reason})" in r.getMessage()]


def test_bad_input_is_rejected_logged_once_and_serving_goes_on(served, caplog) -> None:
    lst, coord = served
    coord.map([0])  # the coordinator's persistent connection exists before the noise
    caplog.set_level(logging.WARNING, logger="kvcached.ipc")
    closing = {
        "malformed": header(Cmd.PING, 0, magic=0xDEAD),
        "version": header(Cmd.PING, 0, version=7),
        "oversized": header(Cmd.MAP, protocol.MAX_BODY + 1),
        "truncated": header(Cmd.MAP, 100) + b"\0" * 10,  # then silence: frame_timeout ends it
    }
    for _ in range(2):
        for reason, data in closing.items():
            s = raw(lst.path)
            s.sendall(data)
            assert closed_by_peer(s), reason
            s.close()
        s = raw(lst.path)  # EOF in the middle of a header
        s.sendall(b"\x56\x4b\x01")
        s.close()
        # Well framed but not servable: an ERROR reply, and the connection stays usable.
        s = raw(lst.path)
        r = FrameReader(s)
        s.sendall(header(0x42, 0))
        cmd, _, body = r.read(5.0, 5.0)
        assert cmd == protocol.ERROR and protocol.parse_error_body(body)[0] == _C.ERROR_KIND_INVALID_ARGUMENT
        s.sendall(protocol.frame(Cmd.MAP, 5, b"\0" * 5))
        cmd, _, body = r.read(5.0, 5.0)
        kind, msg = protocol.parse_error_body(body)
        assert cmd == protocol.ERROR and kind == _C.ERROR_KIND_INVALID_ARGUMENT and "too short" in msg
        s.sendall(protocol.frame(Cmd.PING, 6))
        assert r.read(5.0, 5.0)[:2] == (protocol.OK | Cmd.PING, 6)
        s.close()
    deadline = time.monotonic() + 5
    while lst.rejections["truncated"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lst.rejections == {
        "malformed": 2,
        "version": 2,
        "oversized": 2,
        "truncated": 4,
        "unknown-command": 2,
        "malformed-body": 2,
    }
    for reason in lst.rejections:
        assert len(warnings_about(caplog, reason)) == 1, reason
    coord.map([PAGE])
    assert vmm_ops.group_info(0)["mapped_pages"] == 2
    assert lst.running


def test_orderly_probes_are_not_rejections(served) -> None:
    lst, coord = served
    for _ in range(3):
        raw(lst.path).close()  # what a starting peer's liveness probe does
    coord.ping()
    assert not lst.rejections


def run_as_nobody(path: str) -> str:
    """Connects from a forked child that dropped to uid nobody and sends a PING.
    Returns EACCES (could not reach the socket), EOF (refused) or ANSWERED."""
    nobody = pwd.getpwnam("nobody")
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only system calls, then _exit
        result = b"ERROR"
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(path)
                try:
                    s.sendall(protocol.frame(Cmd.PING, 1))
                    result = b"EOF" if s.recv(64) == b"" else b"ANSWERED"
                except (BrokenPipeError, ConnectionResetError):  # closed before or after the PING
                    result = b"EOF"
            except PermissionError:
                result = b"EACCES"
        finally:
            os.write(wfd, result)
            os._exit(0)
    os.close(wfd)
    try:
        out = os.read(rfd, 64).decode()
    finally:
        os.close(rfd)
        os.waitpid(pid, 0)
    return out


@needs_root
def test_another_uid_is_kept_out(served, caplog) -> None:
    lst, coord = served
    caplog.set_level(logging.WARNING, logger="kvcached.ipc")
    # First line: the 0700 directory.
    assert run_as_nobody(lst.path) == "EACCES"
    # Second line, with the directory opened by mistake: SO_PEERCRED.
    os.chmod(lst.root, 0o711)
    os.chmod(lst.path, 0o666)
    try:
        assert run_as_nobody(lst.path) == "EOF"
        assert run_as_nobody(lst.path) == "EOF"
    finally:
        os.chmod(lst.path, 0o600)
        os.chmod(lst.root, 0o700)
    assert lst.rejections["foreign-uid"] == 2
    assert len(warnings_about(caplog, "foreign-uid")) == 1
    coord.map([0])
    assert vmm_ops.group_info(0)["mapped_pages"] == 1


@needs_root
def test_a_root_owned_by_another_user_is_refused(plane) -> None:
    name = new_name()
    root = socket_root(name)
    os.mkdir(root, 0o700)
    os.chown(root, pwd.getpwnam("nobody").pw_uid, -1)
    try:
        with pytest.raises(InvalidArgumentError, match="belongs to uid"):
            WorkerListener(0, 0, name).start()
    finally:
        os.rmdir(root)


def test_a_loose_root_is_made_private(plane) -> None:
    name = new_name()
    root = socket_root(name)
    os.mkdir(root)
    os.chmod(root, 0o755)
    lst = WorkerListener(0, 0, name).start()
    try:
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(lst.path).st_mode) == 0o600
    finally:
        assert lst.stop()
    assert not os.path.exists(root)


def test_a_live_rank_cannot_be_taken_over(served) -> None:
    lst, coord = served
    with pytest.raises(InvalidArgumentError, match="already served"):
        WorkerListener(0, 0, lst.ipc_name).start()
    coord.ping()  # the first one is untouched


def test_stale_sockets_and_stage_dirs_are_removed(plane) -> None:
    name = new_name()
    root = socket_root(name)
    os.mkdir(root, 0o700)
    os.mkdir(os.path.join(root, "pp2"), 0o700)
    os.mkdir(os.path.join(root, "pp5"), 0o700)
    for p in (socket_path(3, 0, name), socket_path(0, 2, name), socket_path(0, 0, name)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(p)  # bound, never unlinked: what a killed worker leaves
        s.close()
    lst = WorkerListener(0, 0, name).start()
    try:
        assert os.listdir(root) == ["w0.sock"]
    finally:
        assert lst.stop()
    assert not os.path.exists(root)


def test_stop_drains_a_running_call(served) -> None:
    lst, coord = served
    faults.arm("map:1:delay=0.5")
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, coord.map, [PAGE]))
    t0 = time.monotonic()
    t.start()
    _wait_until_worker_runs(Cmd.MAP)
    assert lst.stop(5.0) is True
    t.join()
    assert time.monotonic() - t0 >= 0.5
    assert errors == []  # the call finished and its reply went out before the socket closed
    assert vmm_ops.group_info(0)["mapped_pages"] == 1
    assert not os.path.exists(lst.path)


def test_stop_keeps_the_socket_while_a_call_outlasts_it(served) -> None:
    lst, coord = served
    faults.arm("map:1:delay=1.0")
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, coord.map, [PAGE]))
    t.start()
    _wait_until_worker_runs(Cmd.MAP)
    assert lst.stop(0.2) is False
    assert os.path.exists(lst.path)
    t.join()
    assert errors == []
    assert lst.stop(5.0) is True
    assert not os.path.exists(lst.path)


def _wait_until_worker_runs(cmd: int, timeout: float = 10.0) -> None:
    """Waits until the worker has taken the request (a fixed sleep races a loaded machine)."""
    end = time.monotonic() + timeout
    while faults.seen(cmd) < 1:
        assert time.monotonic() < end, "the request never reached the worker"
        time.sleep(0.005)


def _catch(errors, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # reported to the test thread
        errors.append(e)


class _Buggy(VmmExecutor):
    def map(self, group, tx, offsets):
        raise RuntimeError("a bug in the worker")


def test_an_unexpected_exception_is_a_backend_error(plane, caplog) -> None:
    name = new_name()
    caplog.set_level(logging.ERROR, logger="kvcached.ipc")
    lst = WorkerListener(0, 0, name, executor=_Buggy()).start()
    try:
        with TPCoordinator(1, ipc_name=name, timeout=5.0) as c:
            for _ in range(2):
                with pytest.raises(BackendError, match="RuntimeError: a bug in the worker"):
                    c.map([0])
            assert c.failure is None  # answered and nothing was mapped: not a consistency issue
            c.ping()
        assert len([r for r in caplog.records if "failed unexpectedly" in r.getMessage()]) == 1
    finally:
        assert lst.stop()


def test_map_history_is_bounded_and_rollback_is_exact(plane) -> None:
    ex = VmmExecutor(history=2)
    assert ex.map(0, 1, [0, PAGE]) == (2, 0)
    assert ex.map(0, 2, [PAGE, 2 * PAGE]) == (1, 1)
    assert ex.map(0, 2, [PAGE, 2 * PAGE]) == (1, 1)  # repeat: nothing more happens
    assert ex.rollback_map(0, 2) == 1  # only what tx 2 newly mapped
    assert sorted(_C.mapped_offsets(0)) == [0, PAGE]
    assert ex.rollback_map(0, 2) == 0
    ex.map(0, 3, [3 * PAGE])
    ex.map(0, 4, [4 * PAGE])
    assert ex.rollback_map(0, 1) == 0  # forgotten (bounded): a no-op, recorded as rolled back
    with pytest.raises(InvalidArgumentError, match="rolled back"):
        ex.map(0, 1, [5 * PAGE])
    assert sorted(_C.mapped_offsets(0)) == [0, PAGE, 3 * PAGE, 4 * PAGE]


def test_null_executor_keeps_the_bookkeeping_of_a_real_worker() -> None:
    # Its page hooks do nothing; map history, rollback and refusals are VmmExecutor's.
    ex = NullExecutor(history=2)
    assert ex.map(0, 1, [0, PAGE]) == (2, 0)
    assert ex.map(0, 1, [0, PAGE]) == (2, 0)
    assert ex.rollback_map(0, 1) == 2
    assert ex.rollback_map(0, 1) == 0
    with pytest.raises(InvalidArgumentError, match="rolled back"):
        ex.map(0, 1, [0])
    ex.prepare(0, 7, [0])
    ex.commit(0, 7)
    ex.abort(0, 8)
    assert ex.kv_created(0) and ex.query(0).created
