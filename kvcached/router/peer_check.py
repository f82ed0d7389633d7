"""Is the far end of a connection to an engine's port the engine the router started?

An engine listens on 127.0.0.1:<port>, and the port is in its command line for
every local user to read. Whoever binds it first (the engine is slow to start,
or has died) would get the router's health checks, prompts and Authorization
headers. So every connection the router opens to an engine is checked once it
is established and before a byte is sent on it (``CheckedConnection``):

* the socket at the other end of *this* connection (found by its addresses,
  ``tcp_table.far_end``) must be this user's: the kernel gives it the uid of
  whoever created its listener or accepted it, which another user cannot forge;
* every socket listening on the port must be an open fd of the engine process
  or one of its descendants, and must have been verified so *before* this
  connection was started. A listener that held the port from before the
  connect until after it is the only one that can have taken the connection
  (no other can bind the port meanwhile), so a socket swapped in between the
  check and the connect cannot be the one holding it: what is checked is the
  established connection, not the port, and there is no window to race. A
  listener seen for the first time is verified (a scan of the engine's fds,
  once per listener) and the connection is made again.

Per connection this costs three sock_diag queries (``tcp_table``: the far end,
the IPv4 and the IPv6 listeners of the port), 50-90 us median on a 2-core host
with 6,000-15,000 sockets, and no fd scan; docs/SECURITY.md H8.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

from kvcached.router.tcp_table import SYN_RECV, TIME_WAIT, TcpSocket, far_end, listeners


class NotTheEngine(ConnectionError):
    """The port is held by a process other than the engine (or its descendants). A
    ConnectionError, so code that does not know it still treats it as "no engine there";
    ``sockets`` is the check (the engine's start) that refused."""

    def __init__(self, port: int, sockets: EngineSockets, uid: Optional[int], pid: Optional[int]) -> None:
        self.port, self.sockets, self.uid, self.pid = port, sockets, uid, pid
        who = ", ".join(x for x in (f"pid {pid}" if pid else "", f"uid {uid}" if uid is not None else "") if x)
        super().__init__(
            f"port {port} on 127.0.0.1 is held by {who or 'another process'}, not by engine pid {sockets.pid} "
            "that the router started; nothing was sent to it (stop that process or give the model another port)"
        )


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has socket ``inode`` open (False when it cannot be read)."""
    target = f"socket:[{inode}]"
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in reversed(names):  # a server's newest fds (its sockets) come last
        try:
            if os.readlink(f"{fd_dir}/{name}") == target:
                return True
        except OSError:
            continue
    return False


def _stat(pid: int) -> Optional[Tuple[int, int, int]]:
    """(ppid, session, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # the name may hold blanks and ")"
    return int(fields[1]), int(fields[3]), int(fields[19])


def _pids() -> Iterator[int]:
    return (int(n) for n in os.listdir("/proc") if n.isdigit())


def descendants(root: int) -> List[int]:
    """The processes below ``root``: by parent, or still in its session (one whose
    parent died was re-parented, but keeps the session ``root`` started)."""
    parent: Dict[int, int] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None:
            parent[pid] = st[0] if st[1] != root else root
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c != root]
        found += kids
        frontier += kids
    return found


def socket_holder(inode: int) -> Optional[int]:
    """Any process that has socket ``inode`` open (for the log; all of /proc, so only
    when refusing). None when none that this user may inspect has it."""
    for pid in _pids():
        if holds_socket(pid, inode):
            return pid
    return None


def _holds(pid: int, inode: int, start: Optional[int] = None) -> bool:
    """``holds_socket``, and ``pid`` was the same process (start time) before and after."""
    before = _stat(pid)
    if before is None or (start is not None and before[2] != start):
        return False
    if not holds_socket(pid, inode):
        return False
    after = _stat(pid)
    return after is not None and after[2] == before[2]


class EngineSockets:
    """The check for the connections to one engine process (one per start of it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        st = _stat(pid)
        self.start = None if st is None else st[2]  # with the pid: this process, not a later one
        self.uid = os.geteuid()
        self._verified: Dict[int, int] = {}  # listener inode -> monotonic ns when it was verified
        self._lock = threading.Lock()

    def _in_tree(self, inode: int) -> bool:
        """Whether the engine or a descendant has socket ``inode`` open. Each process's
        start time is read before and after its fds, so a pid reused meanwhile does not
        count; descendants are looked for only while the engine itself is still this one."""
        if self.start is None:
            return False
        if _holds(self.pid, inode, self.start):
            return True
        kids = descendants(self.pid)
        root = _stat(self.pid)
        if root is None or root[2] != self.start:
            return False
        return any(_holds(pid, inode) for pid in kids)

    def _refuse(self, port: int, sock: TcpSocket) -> NotTheEngine:
        """The error naming who holds ``sock``: a connection still queued has no fd yet,
        so then the process holding the listener of the same uid is named."""
        inodes = [sock.inode] if sock.inode else [s.inode for s in listeners(port) if s.uid == sock.uid]
        holders = [socket_holder(i) for i in inodes]
        return NotTheEngine(port, self, sock.uid, next((p for p in holders if p), None))

    def check(self, conn: socket.socket, started_ns: int) -> bool:
        """Checks ``conn``, connected at or after ``started_ns`` (``time.monotonic_ns``).
        True: it reaches this engine. False: a listener was seen for the first time and
        is now verified; connect again. Raises NotTheEngine (someone else holds the
        port) or ConnectionError (the connection closed before it could be checked)."""
        here = conn.getsockname()[:2]
        peer = conn.getpeername()[:2]
        port = peer[1]
        far = far_end(here, peer)
        if far is None or far.state == TIME_WAIT:
            raise ConnectionError(f"the connection to port {port} closed before it was checked")
        if far.state != SYN_RECV and far.uid != self.uid:  # (a SYN_RECV one has no uid yet)
            raise self._refuse(port, far)  # another user's listener, or process, has this connection
        held = listeners(port, peer[0])
        if not held:
            raise ConnectionError(f"nothing listens on port {port} any more")
        fresh = False
        for s in held:
            with self._lock:
                seen = self._verified.get(s.inode)
            if seen is not None and seen < started_ns:
                continue
            if seen is None:
                if s.uid != self.uid or not self._in_tree(s.inode):
                    raise self._refuse(port, s)
                with self._lock:
                    self._verified[s.inode] = time.monotonic_ns()
            fresh = True  # verified after this connect began: it may not have been the one that took it
        return not fresh


class CheckedConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` to an engine, checked (``EngineSockets.check``) once it is
    connected and before any request goes out on it."""

    def __init__(self, host: str, port: int, sockets: EngineSockets, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.sockets = sockets

    def connect(self) -> None:
        for _ in range(2):
            started = time.monotonic_ns()
            super().connect()
            try:
                if self.sockets.check(self.sock, started):
                    return
            except BaseException:
                self.close()
                raise
            self.close()  # its listener is verified now; a new connection can be proven
        raise ConnectionError(f"the listener on port {self.port} changed while it was checked; try again")
