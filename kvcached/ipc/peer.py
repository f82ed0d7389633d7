"""The coordinator's persistent connection to one worker (kvcached.ipc.coordinator).

``Peer.connect`` checks who answers (uid by SO_PEERCRED, then rank and stage
by HELLO); ``send``/``recv`` turn every socket failure into ``Lost`` (the
request's effect is unknown), ``Closed`` (the worker had closed the connection
before the request: nothing was sent) or ``NoReply`` (no reply in time; the
connection stays). The coordinator's lock guards every Peer.

Death: the Peer keeps a handle on the process it talked to (SO_PEERCRED pid,
pinned by a pidfd; kvcached.ipc.liveness). Once that process has exited, the
next failure says so at once as ``Died`` (a Lost): a refused or missing socket
is not retried, and a reply wait ends when the process does (not at the
timeout). A live process is waited for as before, stopped or busy alike: its
listener may be restarting, its reply may be late. A socket nobody has answered
on yet (worker not started, or dead before we met it) is waited for at most
``listener_wait`` seconds.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional, Tuple

from kvcached.ipc import protocol
from kvcached.ipc.liveness import ProcessHandle
from kvcached.ipc.protocol import Cmd, ProtocolError
from kvcached.ipc.transport import ConnectionClosed, FrameReader, PeerExited, peer_credentials

_RETRY_MIN_S, _RETRY_MAX_S = 0.002, 0.05  # reconnect back-off while nobody listens


class Lost(Exception):
    """The connection is gone or unusable; the request's effect is unknown."""


class NoReply(Exception):
    """No reply in time; the connection stays (the reply may still come)."""


class Closed(Lost):
    """The worker had closed the connection before the request: nothing was sent."""


class Died(Lost):
    """The worker process this Peer talked to has exited: retrying cannot help."""


class Peer:
    """The persistent connection to one worker. Guarded by the coordinator's lock."""

    def __init__(
        self,
        rank: int,
        pp_rank: int,
        path: str,
        timeout: float,
        spin_s: float,
        next_rid,
        listener_wait: Optional[float] = None,
    ) -> None:
        self.spin_s = spin_s
        self.rank = rank
        self.pp_rank = pp_rank
        self.path = path
        self.timeout = timeout
        self.listener_wait = timeout if listener_wait is None else listener_wait
        self._next_rid = next_rid
        self.sock: Optional[socket.socket] = None
        self.reader: Optional[FrameReader] = None
        self.pid = 0
        self.process: Optional[ProcessHandle] = None  # the last process that answered HELLO
        self._watched = 0  # pid whose pidfd the current reader watches

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pp {self.pp_rank})"

    def death(self) -> Optional[str]:
        """Why this rank is known dead (its last process exited), else None."""
        if self.process is not None and self.process.exited():
            return f"its worker process (pid {self.process.pid}) died"
        return None

    def connect(self, deadline: float, wait: bool = True) -> None:
        """Connects and checks who answers. While the socket is missing or refused,
        retries (when ``wait``) until ``deadline`` if the last process is alive (its
        listener may be restarting), for ``listener_wait`` s if no process answered
        yet, and not at all once that process died (raises Died)."""
        s = self._open(deadline, wait)
        pid, uid, _ = peer_credentials(s)
        if uid != os.geteuid():
            s.close()
            raise Lost(f"{self.path} is served by uid {uid}, not by us (uid {os.geteuid()}); refusing to talk to it")
        process = ProcessHandle(pid)  # pinned before HELLO: an answer proves it was alive then
        if process.exited():  # the socket outlived the worker that listens on it (a forked child holds it)
            s.close()
            raise Died(f"its worker process (pid {pid}) died; another process still holds {self.path} open")
        self.sock, self.reader = s, FrameReader(s, nonblocking=True, spin_s=self.spin_s)
        if process.fd is not None:
            self.reader.watch(process.fd)
            self._watched = process.pid
        try:
            self.pid = self._hello(deadline)
        except BaseException:
            self.close()
            process.close()
            raise
        if self.process is not None:
            self.process.close()
        self.process = process

    def _open(self, deadline: float, wait: bool) -> socket.socket:
        """A connected socket, or Lost/Died (see ``connect``)."""
        delay = _RETRY_MIN_S
        limit = deadline if self.process is not None else min(deadline, time.monotonic() + self.listener_wait)
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.001, min(self.timeout, deadline - time.monotonic())))
                s.connect(self.path)
                return s
            except (FileNotFoundError, ConnectionRefusedError) as e:
                s.close()
                dead = self.death()
                if dead is not None:
                    raise Died(f"{dead}; nothing listens at {self.path} ({e.strerror})") from None
                if not wait or time.monotonic() + delay >= limit:
                    raise Lost(f"no listener at {self.path} ({e.strerror}): {self._why_no_listener()}") from None
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
            except OSError as e:
                s.close()
                raise Lost(f"cannot connect to {self.path}: {e}") from None

    def _why_no_listener(self) -> str:
        if self.process is None:
            return "the worker is not running (not started, or dead before we met it)"
        return f"its worker process (pid {self.process.pid}) lives but does not listen"

    def _hello(self, deadline: float) -> int:
        """The HELLO exchange on a fresh connection; returns the worker's pid."""
        rid = self._next_rid()
        self.send(protocol.frame(Cmd.HELLO, rid))
        try:
            cmd, body = self.recv(rid, max(deadline, time.monotonic() + 0.05))
        except NoReply:
            raise Lost(f"{self.path} accepted but did not answer HELLO in time") from None
        try:
            if cmd != protocol.OK | Cmd.HELLO:
                raise ProtocolError("handshake", "HELLO refused")
            rank, pp_rank, pid = protocol.parse_hello_reply(body)
        except ProtocolError as e:
            raise Lost(f"{self.path}: {e}") from None
        if (rank, pp_rank) != (self.rank, self.pp_rank):
            raise Lost(f"{self.path} is served by rank {rank} (pp {pp_rank}), expected {self.name}")
        return pid

    def close(self) -> None:
        """Closes the connection; the process handle stays, to judge later failures."""
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None

    def release(self) -> None:
        """Closes the connection and the process handle (the coordinator is closing)."""
        self.close()
        if self.process is not None:
            self.process.close()
            self.process = None

    def send(self, data: bytes) -> None:
        if self.sock is None:
            raise Lost("not connected")
        try:
            self.reader.send(data, self.timeout)
        except ConnectionClosed:
            self.close()
            raise Closed("the worker had closed the connection") from None
        except (OSError, TimeoutError) as e:
            self.close()
            raise self._lost(f"send failed: {e}") from None

    def recv(self, rid: int, deadline: float) -> Tuple[int, bytes]:
        """The reply to request ``rid``; late replies to abandoned requests are skipped."""
        if self.reader is None:
            raise Lost("not connected")
        while True:
            try:
                cmd, got, body = self.reader.read(deadline - time.monotonic(), self.timeout)
            except TimeoutError:
                raise NoReply() from None
            except PeerExited:
                self.close()
                raise Died(f"its worker process (pid {self._watched}) died") from None
            except ConnectionClosed:
                self.close()
                raise self._lost("the worker closed the connection") from None
            except (ProtocolError, OSError) as e:
                self.close()
                raise self._lost(str(e)) from None
            if got == rid:
                return cmd, body

    def _lost(self, what: str) -> Lost:
        """Lost, or Died when the process is already known gone (a clearer message)."""
        dead = self.death()
        return Lost(what) if dead is None else Died(f"{dead} ({what})")
