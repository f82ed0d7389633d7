"""A thread-safe count of something in flight (bytes, frames) under a fixed limit:
what an IPC listener's frame bodies and the router's request bodies may announce
together. ``take`` what does not fit is refused rather than waited for."""

from __future__ import annotations

import threading


class Quota:
    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Counts ``n`` more; False (nothing counted) when that would pass the limit."""
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
