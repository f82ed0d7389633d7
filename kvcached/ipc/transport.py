"""Socket I/O of the IPC channel: whole frames in and out, peer credentials.

Framing lives here so that both ends apply the same limits: a header is checked
before its body is read (an oversized length never allocates), and a frame that
was started must be completed within ``rest_timeout`` of its first byte (one
deadline for the whole frame: a peer trickling a byte now and then cannot park
a reader halfway through a frame). A body is received straight into a buffer of
its announced size, allocated lazily by the OS, so a frame in progress costs
about the bytes received so far, once; ``budget`` (the listener's) bounds what
all frames in progress may announce together.

Two reading modes. Blocking (the listener: one thread per connection, asleep in
recv until a request comes). Non-blocking with a short spin (the coordinator):
the scheduler waits for the replies synchronously anyway, and polling for up to
``spin_s`` before sleeping in poll() saves a sleep/wake-up per reply, which on a
VM costs an IPI and a VM exit (measured here: TP=1 round trip 65 -> 26 us). The
spin is bounded, so a slow worker costs a few tens of microseconds of CPU, not more.
A non-blocking reader may also ``watch`` the peer's pidfd (kvcached.ipc.liveness):
its wait then ends with ``PeerExited`` as soon as that process is gone, even when
the connection stays open (a forked child holding the socket).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Optional, Tuple

from kvcached.ipc.protocol import HEADER_SIZE, MAX_BODY, ProtocolError, parse_header
from kvcached.quota import Quota

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CHUNK = 64 * 1024


class ConnectionClosed(Exception):
    """The peer closed the connection between frames (an orderly end)."""


class PeerExited(Exception):
    """The watched process ended while nothing (more) was there to read."""


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded
    them at connect()/listen() time (SO_PEERCRED); they cannot be forged."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


class FrameBudget(Quota):
    """Bytes that the bodies of all frames being received may announce together
    (a listener's; thread-safe). A frame that does not fit is refused."""


class FrameReader:
    """Reads whole frames from one stream socket, and writes them (``send``).
    Not thread-safe: one reader per connection, used by one thread at a time.

    ``nonblocking=True`` puts the socket in non-blocking mode for good and waits
    with a spin of ``spin_s`` seconds followed by poll(). ``budget``: see
    FrameBudget (None: only ``max_body`` bounds a frame).
    """

    def __init__(
        self,
        sock: socket.socket,
        max_body: int = MAX_BODY,
        nonblocking: bool = False,
        spin_s: float = 0.0,
        budget: Optional[FrameBudget] = None,
    ) -> None:
        self._sock = sock
        self._max_body = max_body
        self._budget = budget
        self._buf = bytearray()  # received bytes not yet part of a frame (headers, small bodies)
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)
        self._timeout: object = object()  # the socket's current timeout (blocking mode)
        self._nonblocking = nonblocking
        self._spin_s = spin_s
        self.in_frame = False  # a frame has started and is not complete yet (read by the listener's eviction)
        self._watch: Optional[int] = None
        if nonblocking:
            sock.setblocking(False)
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def watch(self, pidfd: int) -> None:
        """Ends waits with PeerExited once ``pidfd``'s process has exited (non-blocking mode)."""
        self._watch = pidfd
        self._poll.register(pidfd, select.POLLIN)

    def read(self, first_timeout: Optional[float], rest_timeout: Optional[float]):
        """The next frame as (cmd, req_id, body); ``body`` is bytes or a bytearray.

        ``first_timeout`` bounds the wait for a frame to start (None: forever; <= 0:
        only what is already there) and raises ``TimeoutError``; ``rest_timeout``
        bounds the rest of the frame from its first byte (one deadline for the
        whole frame) and raises ProtocolError("truncated"). Raises
        ConnectionClosed on EOF between frames, ProtocolError on a bad header or
        on a frame the budget cannot take ("busy").
        """
        if not self._buf:
            self._fill(self._view, first_timeout, started=False)
        self.in_frame = True
        try:
            return self._read_started(rest_timeout)
        finally:
            self.in_frame = False

    def _read_started(self, rest_timeout: Optional[float]):
        buf = self._buf
        deadline = None
        if rest_timeout is not None:
            deadline = time.perf_counter() + max(0.0, rest_timeout)
        while len(buf) < HEADER_SIZE:
            self._fill(self._view, self._left(deadline, rest_timeout), started=True)
        cmd, body_len, req_id = parse_header(buf, self._max_body)
        end = HEADER_SIZE + body_len
        if len(buf) >= end or body_len <= _CHUNK:
            while len(buf) < end:
                self._fill(self._view, self._left(deadline, rest_timeout), started=True)
            body = bytes(buf[HEADER_SIZE:end])
            del buf[:end]
            return cmd, req_id, body
        # A large body: straight into a buffer of its size, never past its end.
        if self._budget is not None and not self._budget.take(body_len):
            raise ProtocolError("busy", f"a body of {body_len} bytes exceeds what this listener takes in at once")
        try:
            body = bytearray(body_len)
            got = len(buf) - HEADER_SIZE
            body[:got] = buf[HEADER_SIZE:]
            del buf[:]
            view = memoryview(body)
            while got < body_len:
                got += self._fill(view[got:], self._left(deadline, rest_timeout), started=True, keep=False)
        finally:
            if self._budget is not None:
                self._budget.give(body_len)
        return cmd, req_id, body

    @staticmethod
    def _left(deadline: Optional[float], rest_timeout: Optional[float]) -> Optional[float]:
        if deadline is None:
            return None
        left = deadline - time.perf_counter()
        if left <= 0:
            raise ProtocolError("truncated", f"a frame was not completed within {rest_timeout} s")
        return left

    def _fill(self, into: memoryview, timeout: Optional[float], started: bool, keep: bool = True) -> int:
        """Receives into ``into`` (appended to the frame buffer with ``keep``); returns the bytes."""
        started = started or bool(self._buf)
        try:
            n = self._recv_nb(into, timeout) if self._nonblocking else self._recv_blocking(into, timeout)
        except TimeoutError:
            if started:
                raise ProtocolError("truncated", f"a frame was not completed within {timeout} s") from None
            raise
        if n == 0:
            if started:
                raise ProtocolError("truncated", "connection closed inside a frame")
            raise ConnectionClosed()
        if keep:
            self._buf += into[:n]
        return n

    def _recv_blocking(self, into: memoryview, timeout: Optional[float]) -> int:
        if timeout is not None and timeout < 0:
            timeout = 0.0
        self._set_timeout(timeout)
        try:
            return self._sock.recv_into(into)
        except (socket.timeout, BlockingIOError):
            raise TimeoutError(f"no data within {timeout} s") from None

    def _recv_nb(self, into: memoryview, timeout: Optional[float]) -> int:
        sock = self._sock
        try:
            return sock.recv_into(into)
        except BlockingIOError:
            pass
        now = time.perf_counter()
        deadline = None if timeout is None else now + max(0.0, timeout)
        spin_end = now + self._spin_s if deadline is None else min(deadline, now + self._spin_s)
        while time.perf_counter() < spin_end:
            try:
                return sock.recv_into(into)
            except BlockingIOError:
                pass
        while True:
            if deadline is None:
                ms = -1
            else:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"no data within {timeout} s")
                ms = max(1, int(left * 1000 + 0.999))
            events = self._poll.poll(ms)
            if events:
                try:
                    return sock.recv_into(into)
                except BlockingIOError:
                    # Data sent before the exit was read above: only now is the peer gone.
                    if any(fd == self._watch for fd, _ in events):
                        raise PeerExited() from None
                    continue  # spurious wake-up

    def send(self, data: bytes, timeout: Optional[float]) -> None:
        """Writes all of ``data`` within ``timeout`` seconds (TimeoutError otherwise).

        Raises ConnectionClosed when the peer had closed the connection before
        any byte went out (the data certainly did not arrive)."""
        if not self._nonblocking:
            self._set_timeout(timeout)
            try:
                self._sock.sendall(data)
            except socket.timeout:
                raise TimeoutError(f"could not send within {timeout} s") from None
            return
        view = memoryview(data)
        deadline = None if timeout is None else time.perf_counter() + timeout
        while view:
            try:
                view = view[self._sock.send(view) :]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                if len(view) == len(data):
                    raise ConnectionClosed() from None
                raise
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                raise TimeoutError(f"could not send within {timeout} s")
            p = select.poll()
            p.register(self._sock.fileno(), select.POLLOUT)
            p.poll(-1 if left is None else max(1, int(left * 1000)))

    def _set_timeout(self, timeout: Optional[float]) -> None:
        if timeout != self._timeout:
            self._sock.settimeout(timeout)
            self._timeout = timeout
