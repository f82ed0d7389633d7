"""WorkerListener: the one socket a worker process serves map/unmap requests on.

Threads: one accepts; each connection gets its own handler thread, which reads a
frame, runs it, replies, in order. The coordinator keeps one persistent
connection, so its requests on one rank run strictly in arrival order (a
rollback sent after a timed-out MAP runs after that MAP). Requests from several
connections meet in the executor, which serialises what must be atomic.

Admission: the peer's uid (SO_PEERCRED) must be ours; the directory is 0700 as
well, so this is the second line. Bad input (malformed, truncated or oversized
frames, unknown commands, a foreign uid) is rejected; each kind of rejection is
logged once per listener (counts in ``rejections``) so a misbehaving client
cannot flood the log, and the listener keeps serving everyone else. A frame
whose header is bad ends its connection (the stream cannot be resynchronised);
a well-framed request that cannot be served gets an ERROR reply.

Bounds (a same-uid client that leaks or hoards connections must not lock the
coordinator out): at most MAX_CONNECTIONS connections, MAX_PER_PEER of them
from one process (SO_PEERCRED pid). A new connection over either cap evicts an
idle one (no frame in progress or running; one that never sent a valid frame
first, else the longest idle) and is refused only when none is idle. The
coordinator reconnects when it finds its own connection evicted. Every frame
must be complete within the frame timeout of its first byte, and the bodies of
the frames being received may announce FRAME_BUDGET bytes together.

Shutdown (``stop``): stop accepting, wake the accept thread,
shut down the read side of every connection (a handler inside a data-plane call
finishes it and still sends its reply: in-flight calls drain), join all threads,
and only then unlink the socket and remove empty directories. If the threads do
not finish in time, ``stop`` returns False and leaves the socket for a retry:
the KV tensors must not be destroyed under a running call.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, Optional

from kvcached._C import ERROR_KIND_BACKEND as _C_BACKEND
from kvcached._C import ERROR_KIND_INVALID_ARGUMENT as _C_INVALID
from kvcached._C import inject_fault
from kvcached.errors import InvalidArgumentError
from kvcached.ipc import faults, paths, protocol, settings
from kvcached.ipc.executor import VmmExecutor
from kvcached.ipc.protocol import Cmd, ProtocolError
from kvcached.ipc.transport import ConnectionClosed, FrameBudget, FrameReader, peer_credentials

log = logging.getLogger("kvcached.ipc")

MAX_CONNECTIONS = 64
MAX_PER_PEER = 8
FRAME_BUDGET = 2 * protocol.MAX_BODY


class _Conn:
    """One accepted connection and what eviction needs to know of it."""

    def __init__(self, sock: socket.socket, pid: int, reader: FrameReader) -> None:
        self.sock = sock
        self.pid = pid
        self.reader = reader
        self.thread: Optional[threading.Thread] = None
        self.idle_since: Optional[float] = time.monotonic()  # None while a request runs
        self.spoke = False  # sent a valid frame
        self.evicted = False

    def idle(self) -> bool:
        return not self.evicted and self.idle_since is not None and not self.reader.in_frame


class WorkerListener:
    """Serves the requests of a TP/PP coordinator for this worker process."""

    def __init__(
        self,
        rank: int,
        pp_rank: int = 0,
        ipc_name: Optional[str] = None,
        executor: Optional[VmmExecutor] = None,
        frame_timeout: Optional[float] = None,
    ) -> None:
        self.rank = int(rank)
        self.pp_rank = int(pp_rank)
        self.ipc_name = settings.ipc_name() if ipc_name is None else ipc_name
        self.path = paths.socket_path(self.rank, self.pp_rank, self.ipc_name)
        self.root = paths.socket_root(self.ipc_name)
        self._executor = executor if executor is not None else VmmExecutor()
        self._frame_timeout = settings.ipc_timeout() if frame_timeout is None else float(frame_timeout)
        self._uid = os.geteuid()
        self._sock: Optional[socket.socket] = None
        self._inode: Optional[tuple] = None
        self._stop = threading.Event()
        self._accept_thread: Optional[threading.Thread] = None
        self._conns: Dict[socket.socket, _Conn] = {}
        self._frame_budget = FrameBudget(FRAME_BUDGET)
        self._conns_lock = threading.Lock()
        self._logged: set = set()
        self._log_lock = threading.Lock()
        self.rejections: collections.Counter[str] = collections.Counter()
        self._handlers: Dict[int, Callable[[bytes], bytes]] = {
            Cmd.HELLO: self._hello,
            Cmd.PING: self._ping,
            Cmd.MAP: self._map,
            Cmd.ROLLBACK_MAP: self._rollback_map,
            Cmd.PREPARE: self._prepare,
            Cmd.COMMIT: self._commit,
            Cmd.ABORT: self._abort,
            Cmd.TX_OUTCOME: self._tx_outcome,
            Cmd.KV_CREATED: self._kv_created,
            Cmd.QUERY: self._query,
        }

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> WorkerListener:
        """Binds the socket (removing stale ones a crash left) and starts serving.
        Raises InvalidArgumentError if a live listener already serves this rank."""
        if self._sock is not None:
            raise InvalidArgumentError(f"listener for {self.path} is already started")
        faults.arm_from_env()
        with paths.locked_root(self.root):
            stage_dir = os.path.dirname(self.path)
            if stage_dir != self.root:
                paths.ensure_private_dir(stage_dir)
            if os.path.exists(self.path) and paths.is_live(self.path):
                raise InvalidArgumentError(
                    f"rank {self.rank} (pp {self.pp_rank}) of IPC instance {self.ipc_name!r} is already served at "
                    f"{self.path}; give each engine its own KVCACHED_IPC_NAME"
                )
            paths.remove_stale(self.root, keep_dir=stage_dir)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(self.path)
                os.chmod(self.path, 0o600)
                sock.listen(16)
            except BaseException:
                sock.close()
                raise
            st = os.lstat(self.path)
            self._inode = (st.st_dev, st.st_ino)
        self._sock = sock
        self._stop.clear()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kvcached-ipc-accept-pp{self.pp_rank}-w{self.rank}", daemon=True
        )
        self._accept_thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._accept_thread is not None and self._accept_thread.is_alive()

    def stop(self, timeout: float = 5.0) -> bool:
        """Drains and stops. True when everything is joined and the socket removed;
        False if a handler is still busy after ``timeout`` s (call again later)."""
        if self._sock is None:
            return True
        deadline = time.monotonic() + timeout
        self._stop.set()
        with self._conns_lock:
            conns = [(c.sock, c.thread) for c in self._conns.values()]
        # Stop reading, keep writing: a handler inside a call still sends its reply.
        for c, _ in conns:
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
            if self._accept_thread.is_alive():
                self._wake_accept()
                self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        with self._conns_lock:
            conns = [(c.sock, c.thread) for c in self._conns.values()]
        for c, _ in conns:  # connections accepted while we were stopping
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for _, t in conns:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = (self._accept_thread is not None and self._accept_thread.is_alive()) or any(
            t.is_alive() for _, t in conns
        )
        if busy:
            log.warning("IPC listener %s: a call is still running after %.1f s; socket kept", self.path, timeout)
            return False
        self._sock.close()
        with paths.locked_root(self.root):
            paths.remove_socket(self.path, self._inode)
        self._sock = None
        self._accept_thread = None
        return True

    def _wake_accept(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect(self.path)
        except OSError:
            pass
        finally:
            s.close()

    def __enter__(self) -> WorkerListener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- connections ---------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        with self._log_lock:
            self.rejections[reason] += 1
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning(
                "IPC listener %s rejected input (%s): %s [further ones counted, not logged]", self.path, reason, detail
            )

    def _accept_loop(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError as e:
                if self._stop.is_set():
                    return
                # E.g. EMFILE: the pending connection stays queued, so back off
                # instead of spinning on it.
                self._reject("accept-failed", str(e))
                time.sleep(0.05)
                continue
            if self._stop.is_set():
                conn.close()
                return
            try:
                pid, uid, _ = peer_credentials(conn)
            except OSError as e:
                self._reject("peer-credentials", str(e))
                conn.close()
                continue
            if uid != self._uid:
                self._reject("foreign-uid", f"connection from pid {pid} uid {uid}; only uid {self._uid} may connect")
                conn.close()
                continue
            with self._conns_lock:
                if not self._make_room(pid):
                    conn.close()
                    continue
                c = _Conn(conn, pid, FrameReader(conn, budget=self._frame_budget))
                c.thread = threading.Thread(
                    target=self._serve,
                    args=(c,),
                    daemon=True,
                    name=f"kvcached-ipc-conn-pp{self.pp_rank}-w{self.rank}",
                )
                self._conns[conn] = c
            c.thread.start()

    def _make_room(self, pid: int) -> bool:
        """Under the caps, or an idle connection evicted to get there (caller
        holds the lock); False: the new connection is refused."""
        live = [c for c in self._conns.values() if not c.evicted]
        mine = [c for c in live if c.pid == pid]
        if len(mine) >= MAX_PER_PEER:
            pool, why = mine, f"pid {pid} has {len(mine)} connections (at most {MAX_PER_PEER} per process)"
        elif len(live) >= MAX_CONNECTIONS:
            pool, why = live, f"{len(live)} open connections (at most {MAX_CONNECTIONS})"
        else:
            return True
        idle = [c for c in pool if c.idle()]
        if not idle:
            self._reject("too-many-connections", f"{why}, none idle; refused a new one from pid {pid}")
            return False
        victim = min(idle, key=lambda c: (c.spoke, c.idle_since))
        victim.evicted = True
        self._reject("evicted-idle", f"{why}: closed an idle connection of pid {victim.pid}")
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its handler sees EOF and ends
        except OSError:
            pass
        return True

    def _serve(self, c: _Conn) -> None:
        conn, reader = c.sock, c.reader
        try:
            while True:
                c.idle_since = time.monotonic()
                try:
                    cmd, req_id, body = reader.read(None, self._frame_timeout)
                except ConnectionClosed:
                    return
                except ProtocolError as e:
                    if not c.evicted:
                        self._reject(e.reason, str(e))
                    return
                except OSError:
                    return
                c.idle_since, c.spoke = None, True
                handler = self._handlers.get(cmd)
                if handler is None:
                    self._reject("unknown-command", f"command {cmd}")
                    reply = protocol.frame(
                        protocol.ERROR,
                        req_id,
                        protocol.error_body(_C_INVALID, f"unknown command {cmd}"),
                    )
                    if not self._send(conn, reply):
                        return
                    continue
                action = faults.take(cmd)
                if action is not None and action.kind == "delay":
                    time.sleep(action.seconds)  # a slow call: stop() must wait for it like for a real one
                elif action is not None and action.kind == "backend":
                    inject_fault(action.backend_op, action.backend_nth, 1)
                reply = self._run(handler, cmd, req_id, body)
                if action is not None and action.kind == "drop":
                    return
                if action is not None and action.kind == "exit":
                    os._exit(17)
                if not self._send(conn, reply):
                    return
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)
            conn.close()

    def _run(self, handler: Callable[[bytes], bytes], cmd: int, req_id: int, body: bytes) -> bytes:
        try:
            return protocol.frame(protocol.OK | cmd, req_id, handler(body))
        except ProtocolError as e:
            self._reject(e.reason, f"{Cmd(cmd).name}: {e}")
            return protocol.frame(protocol.ERROR, req_id, protocol.error_body(_C_INVALID, str(e)))
        except Exception as e:  # every failure goes back to the coordinator with its kind
            kind = protocol.kind_of(e)
            if kind == _C_BACKEND and not isinstance(e, protocol.KIND_TO_ERROR[_C_BACKEND]):
                # Not a kvcached error: a bug on this side. Say it once with the traceback.
                with self._log_lock:
                    first = "internal" not in self._logged
                    self._logged.add("internal")
                if first:
                    log.exception("IPC listener %s: %s failed unexpectedly", self.path, Cmd(cmd).name)
            msg = f"rank {self.rank} (pp {self.pp_rank}): {type(e).__name__}: {e}"
            return protocol.frame(protocol.ERROR, req_id, protocol.error_body(kind, msg))

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> bool:
        try:
            conn.sendall(data)
            return True
        except OSError:
            return False

    # ---- commands --------------------------------------------------------------------

    def _hello(self, body: bytes) -> bytes:
        protocol.expect_empty(body)
        return protocol.hello_reply(self.rank, self.pp_rank, os.getpid())

    def _ping(self, body: bytes) -> bytes:
        protocol.expect_empty(body)
        return b""

    def _map(self, body: bytes) -> bytes:
        group, tx, offsets = protocol.parse_offsets_body(body)
        return protocol.map_reply(*self._executor.map(group, tx, offsets))

    def _rollback_map(self, body: bytes) -> bytes:
        group, tx = protocol.parse_group_tx_body(body)
        return protocol.u32_reply(self._executor.rollback_map(group, tx))

    def _prepare(self, body: bytes) -> bytes:
        group, tx, offsets = protocol.parse_offsets_body(body)
        self._executor.prepare(group, tx, offsets)
        return b""

    def _commit(self, body: bytes) -> bytes:
        self._executor.commit(*protocol.parse_group_tx_body(body))
        return b""

    def _abort(self, body: bytes) -> bytes:
        self._executor.abort(*protocol.parse_group_tx_body(body))
        return b""

    def _tx_outcome(self, body: bytes) -> bytes:
        return protocol.u8_reply(self._executor.tx_outcome(*protocol.parse_group_tx_body(body)))

    def _kv_created(self, body: bytes) -> bytes:
        return protocol.u8_reply(int(self._executor.kv_created(protocol.parse_group_body(body))))

    def _query(self, body: bytes) -> bytes:
        return protocol.encode_state(self._executor.query(protocol.parse_group_body(body)))
