"""The coordinator's persistent connection to one worker (kvcached.ipc.coordinator).

``Peer.connect`` checks who answers (uid by SO_PEERCRED, then rank and stage
by HELLO); ``send``/``recv`` turn every socket failure into ``Lost`` (the
request's effect is unknown), ``Closed`` (the worker had closed the connection
before the request: nothing was sent) or ``NoReply`` (no reply in time; the
connection stays). The coordinator's lock guards every Peer.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional, Tuple

from kvcached.ipc import protocol
from kvcached.ipc.protocol import Cmd, ProtocolError
from kvcached.ipc.transport import ConnectionClosed, FrameReader, peer_credentials


class Lost(Exception):
    """The connection is gone or unusable; the request's effect is unknown."""


class NoReply(Exception):
    """No reply in time; the connection stays (the reply may still come)."""


class Closed(Lost):
    """The worker had closed the connection before the request: nothing was sent."""


class Peer:
    """The persistent connection to one worker. Guarded by the coordinator's lock."""

    def __init__(self, rank: int, pp_rank: int, path: str, timeout: float, spin_s: float, next_rid) -> None:
        self.spin_s = spin_s
        self.rank = rank
        self.pp_rank = pp_rank
        self.path = path
        self.timeout = timeout
        self._next_rid = next_rid
        self.sock: Optional[socket.socket] = None
        self.reader: Optional[FrameReader] = None
        self.pid = 0

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pp {self.pp_rank})"

    def connect(self, deadline: float, wait: bool = True) -> None:
        """Connects and checks who answers. While the socket is missing or refused
        (worker not started yet, or restarting) retries until ``deadline`` when ``wait``."""
        delay = 0.002
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.001, min(self.timeout, deadline - time.monotonic())))
                s.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                s.close()
                if not wait or time.monotonic() + delay >= deadline:
                    raise Lost(f"no listener at {self.path} ({e.strerror})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as e:
                s.close()
                raise Lost(f"cannot connect to {self.path}: {e}") from None
        _, uid, _ = peer_credentials(s)
        if uid != os.geteuid():
            s.close()
            raise Lost(f"{self.path} is served by uid {uid}, not by us (uid {os.geteuid()}); refusing to talk to it")
        self.sock, self.reader = s, FrameReader(s, nonblocking=True, spin_s=self.spin_s)
        rid = self._next_rid()
        self.send(protocol.frame(Cmd.HELLO, rid))
        try:
            cmd, body = self.recv(rid, max(deadline, time.monotonic() + 0.05))
        except NoReply:
            self.close()
            raise Lost(f"{self.path} accepted but did not answer HELLO in time") from None
        try:
            if cmd != protocol.OK | Cmd.HELLO:
                raise ProtocolError("handshake", "HELLO refused")
            rank, pp_rank, self.pid = protocol.parse_hello_reply(body)
        except ProtocolError as e:
            self.close()
            raise Lost(f"{self.path}: {e}") from None
        if (rank, pp_rank) != (self.rank, self.pp_rank):
            self.close()
            raise Lost(f"{self.path} is served by rank {rank} (pp {pp_rank}), expected {self.name}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None

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
            raise Lost(f"send failed: {e}") from None

    def recv(self, rid: int, deadline: float) -> Tuple[int, bytes]:
        """The reply to request ``rid``; late replies to abandoned requests are skipped."""
        if self.reader is None:
            raise Lost("not connected")
        while True:
            try:
                cmd, got, body = self.reader.read(deadline - time.monotonic(), self.timeout)
            except TimeoutError:
                raise NoReply() from None
            except ConnectionClosed:
                self.close()
                raise Lost("the worker closed the connection") from None
            except (ProtocolError, OSError) as e:
                self.close()
                raise Lost(str(e)) from None
            if got == rid:
                return cmd, body
