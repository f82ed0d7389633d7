"""PP-aware fan-out with real worker processes: socket layout per stage, a
coordinator for all stages or one, and the socket root's life cycle (private,
empty after a clean exit, crash leftovers removed by the next start)."""

from __future__ import annotations

import os
import signal
import stat
import uuid

import pytest

from kvcached.errors import InvalidArgumentError
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.testing.ipc_worker import WorkerGroup, consistency_problems, handle_baselines

PAGE = 64 * 1024


def new_name() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


def test_pp2_layout_and_fanout(monkeypatch) -> None:
    name = new_name()
    root = socket_root(name)
    with WorkerGroup(name, tp=2, pp=2) as g:
        assert sorted(os.listdir(root)) == ["pp1", "w0.sock", "w1.sock"]
        assert sorted(os.listdir(os.path.join(root, "pp1"))) == ["w0.sock", "w1.sock"]
        assert socket_path(1, 1, name) == os.path.join(root, "pp1", "w1.sock")
        for d in (root, os.path.join(root, "pp1")):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        for k in (0, 1):
            for r in (0, 1):
                st = os.stat(socket_path(r, k, name))
                assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600

        # pp_rank=-1 with KVCACHED_PP_SIZE=2: every stage.
        monkeypatch.setenv("KVCACHED_PP_SIZE", "2")
        with TPCoordinator(2, ipc_name=name, timeout=5.0) as every:
            states = every.query()
            assert sorted((s.pp_rank, s.rank) for s in states) == [(0, 0), (0, 1), (1, 0), (1, 1)]
            base = handle_baselines(states)
            every.map([0, 3 * PAGE])
            assert not consistency_problems(every.query(), [0, 3 * PAGE], base)

            # One stage only: the other keeps its pages.
            with TPCoordinator(2, pp_size=2, pp_rank=1, ipc_name=name, timeout=5.0) as stage1:
                stage1.unmap([3 * PAGE])
            by_stage = {}
            for s in every.query():
                by_stage.setdefault(s.pp_rank, []).append(s)
            assert not consistency_problems(by_stage[0], [0, 3 * PAGE], base)
            assert not consistency_problems(by_stage[1], [0], base)
            every.unmap([0])
            with TPCoordinator(2, pp_size=2, pp_rank=0, ipc_name=name, timeout=5.0) as stage0:
                stage0.unmap([3 * PAGE])
            assert not consistency_problems(every.query(), [], base)
    assert all(rc == 0 for rc in g.returncodes.values()), g.returncodes
    assert not os.path.exists(root)


def test_bad_pp_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        TPCoordinator(2, pp_size=2, pp_rank=2, ipc_name=new_name())
    with pytest.raises(InvalidArgumentError):
        TPCoordinator(0, ipc_name=new_name())


def test_crash_leftovers_are_removed_by_the_next_start() -> None:
    name = new_name()
    root = socket_root(name)
    g = WorkerGroup(name, tp=2, pp=2).start()
    for key in list(g.procs):
        g.procs[key].send_signal(signal.SIGKILL)
        g.wait_exit(key)
    g.close()
    # kill -9: nobody unlinked anything.
    assert sorted(os.listdir(root)) == ["pp1", "w0.sock", "w1.sock"]
    with WorkerGroup(name, tp=1, pp=1) as g2:
        assert os.listdir(root) == ["w0.sock"]  # stale sockets and the empty stage dir are gone
        with TPCoordinator(1, pp_size=1, ipc_name=name, timeout=5.0) as c:
            c.map([PAGE])
            c.unmap([PAGE])
    assert g2.returncodes == {(0, 0): 0}
    assert not os.path.exists(root)
