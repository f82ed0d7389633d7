"""Two-phase UNMAP across real worker processes: PREPARE everywhere, then COMMIT
(ambiguous results retried, never aborted) or ABORT (every page back, data
intact). After each case the workers are queried for the same state everywhere
and no leaked handle."""

from __future__ import annotations

import os
import re
import socket
import time
import uuid

import pytest

from kvcached import _C
from kvcached.errors import BackendError, StateConsistencyError
from kvcached.ipc import protocol
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.ipc.protocol import Cmd
from kvcached.ipc.transport import FrameReader
from kvcached.testing.ipc_worker import WorkerGroup, consistency_problems, handle_baselines

PAGE = 64 * 1024
T = 0.3
OFFS = [PAGE, 2 * PAGE, 9 * PAGE]
KEEP = [0, 4 * PAGE]  # mapped before, not part of the UNMAP


def new_name() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check(c: TPCoordinator, expected, base) -> None:
    problems = consistency_problems(c.query(), expected, base)
    assert not problems, problems


def tx_of(exc: BaseException) -> int:
    return int(re.search(r"transaction (\d+)", str(exc)).group(1))


def mapped_group(name: str, tp: int = 2, **kw):
    g = WorkerGroup(name, tp, **kw).start()
    c = TPCoordinator(tp, ipc_name=name, timeout=T)
    base = handle_baselines(c.query())
    c.map(KEEP + OFFS)
    return g, c, base


def finish(g: WorkerGroup, c: TPCoordinator) -> None:
    """Closes both and checks that every worker that was still alive stopped cleanly."""
    c.close()
    already_dead = {k for k, p in g.procs.items() if p.poll() is not None}
    codes = g.stop()
    g.close()
    assert all(rc == 0 for k, rc in codes.items() if k not in already_dead), (codes, g.outputs)


def test_prepare_failure_aborts_every_rank() -> None:
    name = new_name()
    # Rank 1's PREPARE fails at its second backend unmap: the first page is already
    # unmapped there and must come back, on rank 1 by its data plane, elsewhere by ABORT.
    env = {(0, 1): {"KVCACHED_IPC_FAULT_INJECT": "prepare:1:backend=unmap:2"}}
    g, c, base = mapped_group(name, 3, env=env)
    try:
        with pytest.raises(
            BackendError, match=r"rank 1 \(pp 0\).*aborted on every rank, every offset is still mapped"
        ) as ei:
            c.unmap(OFFS)
        check(c, KEEP + OFFS, base)
        assert c.tx_outcome(tx_of(ei.value)) == ["aborted"] * 3
        c.unmap(OFFS)  # one fault only: now it goes through
        check(c, KEEP, base)
        assert c.tx_outcome(c.last_tx) == ["committed"] * 3
    finally:
        finish(g, c)


def test_rank_dies_during_prepare_fails_closed() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 3, env={(0, 2): {"KVCACHED_IPC_FAULT_INJECT": "prepare:1:exit"}})
    try:
        with pytest.raises(StateConsistencyError, match=r"PREPARE.*rank 2 \(pp 0\).*ABORT not confirmed on rank 2"):
            c.unmap(OFFS)
        assert g.wait_exit((0, 2)) == 17
        states = c.query()
        assert [s.rank for s in states if not s.reachable] == [2]
        # The survivors were aborted: every page is back.
        survivors = [s for s in states if s.reachable]
        assert not consistency_problems(survivors, KEEP + OFFS, base), survivors
        assert c.quarantined == set(OFFS)
        with pytest.raises(StateConsistencyError, match=r"refuses work \(fail closed\).*ABORT not confirmed"):
            c.unmap(KEEP)
    finally:
        finish(g, c)
    # The dead worker left its socket behind; the next start of the instance removes it.
    assert os.path.exists(socket_path(2, 0, name))
    with WorkerGroup(name, 1) as g2:
        assert not os.path.exists(socket_path(2, 0, name))
    assert g2.returncodes == {(0, 0): 0}
    assert not os.path.exists(socket_root(name))


def test_lost_commit_reply_is_retried_not_aborted() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 2, env={(0, 1): {"KVCACHED_IPC_FAULT_INJECT": "commit:1:drop"}})
    try:
        c.unmap(OFFS)  # rank 1 committed and dropped the reply; the retry finds it committed
        check(c, KEEP, base)
        assert c.tx_outcome(c.last_tx) == ["committed", "committed"]
        assert c.failure is None
    finally:
        finish(g, c)


def test_slow_commit_is_waited_for_not_aborted() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 2, env={(0, 0): {"KVCACHED_IPC_FAULT_INJECT": f"commit:1:delay={2 * T}"}})
    try:
        t0 = time.monotonic()
        c.unmap(OFFS)
        assert time.monotonic() - t0 >= 2 * T
        check(c, KEEP, base)
        assert c.tx_outcome(c.last_tx) == ["committed", "committed"]
    finally:
        finish(g, c)


def test_commit_never_confirmed_fails_closed() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 2, env={(0, 1): {"KVCACHED_IPC_FAULT_INJECT": f"commit:1:delay={6 * T}"}})
    try:
        with pytest.raises(StateConsistencyError, match=r"COMMIT .* not confirmed on rank 1 .*never aborted"):
            c.unmap(OFFS)
        tx = c.last_tx
        # Rank 0 released, rank 1 will once its slow COMMIT runs: nobody aborted.
        deadline = time.monotonic() + 6 * T + 5
        while consistency_problems(c.query(), KEEP, base) and time.monotonic() < deadline:
            time.sleep(0.05)
        check(c, KEEP, base)
        assert c.tx_outcome(tx) == ["committed", "committed"]
    finally:
        finish(g, c)


def test_slow_prepare_past_the_timeout_is_aborted() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 2, env={(0, 1): {"KVCACHED_IPC_FAULT_INJECT": f"prepare:1:delay={2 * T}"}})
    try:
        with pytest.raises(BackendError, match=r"rank 1 \(pp 0\): no answer within .*aborted on every rank") as ei:
            c.unmap(OFFS)
        check(c, KEEP + OFFS, base)  # the ABORT ran after the slow PREPARE on rank 1
        assert c.tx_outcome(tx_of(ei.value)) == ["aborted", "aborted"]
        assert c.failure is None
    finally:
        finish(g, c)


class RawClient:
    """Speaks the protocol directly, to order requests the coordinator never would."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = FrameReader(self.sock)
        self.rid = 0

    def call(self, cmd: int, body: bytes):
        self.rid += 1
        self.sock.sendall(protocol.frame(cmd, self.rid, body))
        rcmd, rid, rbody = self.reader.read(5.0, 5.0)
        assert rid == self.rid
        if rcmd == protocol.ERROR:
            return protocol.parse_error_body(rbody)
        assert rcmd == protocol.OK | cmd
        return rbody

    def close(self) -> None:
        self.sock.close()


def test_prepare_after_abort_is_refused_and_repeats_are_idempotent() -> None:
    name = new_name()
    g, c, base = mapped_group(name, 1)
    cl = RawClient(socket_path(0, 0, name))
    try:
        tx = 777
        # The global ABORT overtook this rank's PREPARE: the late PREPARE must not reopen it.
        assert cl.call(Cmd.ABORT, protocol.group_tx_body(0, tx)) == b""
        kind, msg = cl.call(Cmd.PREPARE, protocol.offsets_body(0, tx, OFFS))
        assert kind == _C.ERROR_KIND_INVALID_ARGUMENT and "aborted" in msg
        check(c, KEEP + OFFS, base)
        # PREPARE twice, COMMIT twice: the repeats change nothing.
        tx = 778
        assert cl.call(Cmd.PREPARE, protocol.offsets_body(0, tx, OFFS)) == b""
        assert cl.call(Cmd.PREPARE, protocol.offsets_body(0, tx, OFFS)) == b""
        assert cl.call(Cmd.COMMIT, protocol.group_tx_body(0, tx)) == b""
        assert cl.call(Cmd.COMMIT, protocol.group_tx_body(0, tx)) == b""
        check(c, KEEP, base)
        kind, msg = cl.call(Cmd.ABORT, protocol.group_tx_body(0, tx))
        assert kind == _C.ERROR_KIND_INVALID_ARGUMENT and "committed" in msg
        # A MAP rolled back before it arrived is refused when it does arrive.
        assert protocol.parse_u32_reply(cl.call(Cmd.ROLLBACK_MAP, protocol.group_tx_body(0, 779))) == 0
        kind, msg = cl.call(Cmd.MAP, protocol.offsets_body(0, 779, [PAGE]))
        assert kind == _C.ERROR_KIND_INVALID_ARGUMENT and "rolled back" in msg
        check(c, KEEP, base)
    finally:
        cl.close()
        finish(g, c)
