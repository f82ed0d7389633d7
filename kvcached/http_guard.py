"""Bounds shared by kvcached's hand-written HTTP servers (the router's front, the metrics
exporter): at most a number of connections served at once, and deadlines that end a
connection whatever its client does (one byte every few seconds keeps a socket timeout
from ever firing).

Deadlines are kept by one thread per process, not a timer thread per request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import sys
import threading
import time
from typing import Any, Callable, List, Set, Tuple


class ConnectionCap:
    """Mixin for a ``socketserver.ThreadingMixIn`` server: at most ``max_connections`` handled
    at once; one more is closed at once rather than queued (a queue would let stalled
    clients hold every later one)."""

    max_connections = 64
    _slots: Any = None

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots is None:  # serve_forever's thread only: no race
            self._slots = threading.BoundedSemaphore(self.max_connections)
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up, resets or is cut at its deadline is no error (socketserver
        printed a traceback to stderr for each: anyone could fill it); anything else is a bug,
        logged with its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        logging.getLogger("kvcached.http").error(
            "handling a request from %s failed: %r", client_address, exc, exc_info=True
        )


def cut(conn: socket.socket) -> None:
    """Ends ``conn`` from another thread: its pending and next reads and writes fail."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class Deadlines:
    """Calls ``fn`` when its deadline passes, unless cancelled first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._cancelled: Set[int] = set()
        self._ids = itertools.count()
        self._thread: Any = None

    def add(self, seconds: float, fn: Callable[[], None]) -> int:
        """Schedules ``fn`` in ``seconds``; returns the token that cancels it."""
        with self._cond:
            token = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + seconds, token, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcached-http-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def cancel(self, token: int) -> None:
        with self._cond:
            self._cancelled.add(token)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due, token, fn = self._heap[0]
                    if token in self._cancelled:
                        heapq.heappop(self._heap)
                        self._cancelled.discard(token)
                        continue
                    wait = due - time.monotonic()
                    if wait <= 0:
                        heapq.heappop(self._heap)
                        break
                    self._cond.wait(wait)
            fn()  # outside the lock


DEADLINES = Deadlines()
