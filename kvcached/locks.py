"""Upstream kvcached's ``kvcached.locks``: lock protocols and no-op stand-ins,
and ``TokenLock``, the lock of our manager.

Upstream's KVCacheManager takes a no-op lock under synchronous scheduling;
ours always takes a real one (``TokenLock``: its uncontended fast entry is one
C list operation), so the no-op ones exist for code written against upstream
that builds its own objects with them.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Protocol


class LockLike(Protocol):
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None: ...


class ConditionLike(LockLike, Protocol):
    def wait(self, timeout: Optional[float] = None) -> bool: ...

    def wait_for(self, predicate: Callable[[], bool], timeout: Optional[float] = None) -> bool: ...

    def notify(self, n: int = 1) -> None: ...

    def notify_all(self) -> None: ...


class NoOpLock:
    """A lock that never blocks (the interface of ``threading.RLock``)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        pass


class NoOpCondition:
    """A condition whose waits return at once (``wait_for`` evaluates the predicate once)."""

    def __init__(self, lock: LockLike) -> None:
        self.lock = lock

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def wait_for(self, predicate: Callable[[], bool], timeout: Optional[float] = None) -> bool:
        return predicate()

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.lock.__exit__(exc_type, exc_val, exc_tb)


class TokenLock:
    """A mutex whose uncontended non-blocking entry costs one ``list.pop``.

    Whoever popped the one token of ``_token`` holds the lock; nobody else
    touches what it guards. Two ways in:

    * ``try_enter()`` (``list.pop``: IndexError when the token is out) and
      ``leave(True)`` (``list.append``): the manager's alloc and free, called
      on every scheduling step. ``threading.Lock.acquire`` parses its
      arguments on every call and costs as much as the rest of an
      alloc(1)+free(1) fast path; a bound ``pop``/``append`` pair costs a
      quarter of it. A caller whose ``try_enter`` fails falls back to ``with``.
    * ``acquire()``/``release()``/``with``: every other holder. They queue on a
      ``threading.Lock`` first, so at most one of them waits for the token,
      and only for a holder that came in by ``try_enter``; that holder blocks
      on nothing of this lock, so the token comes back. The waiter polls it
      (``sleep(0)`` first, backing off to 1 ms: a try_enter holder that maps or
      unmaps a page holds it that long), no busy spin.

    Not reentrant (like ``threading.Lock``). Each of the list operations is
    atomic under the GIL, and on a free-threaded build (per-object locks).
    """

    __slots__ = ("_token", "_mutex", "try_enter", "leave")

    def __init__(self) -> None:
        self._token: List[bool] = [True]
        self._mutex = threading.Lock()
        self.try_enter = self._token.pop
        self.leave = self._token.append

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._mutex.acquire(blocking, timeout):
            return False
        take = self._token.pop
        delay = 0.0
        while True:
            try:
                take()
                return True
            except IndexError:
                if not blocking:
                    self._mutex.release()
                    return False
                time.sleep(delay)
                delay = min(delay * 2 or 1e-6, 1e-3)

    def release(self) -> None:
        if self._token:
            raise RuntimeError("release of an unlocked TokenLock")
        self._token.append(True)
        self._mutex.release()

    def locked(self) -> bool:
        return not self._token

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.release()


__all__ = ["ConditionLike", "LockLike", "NoOpCondition", "NoOpLock", "TokenLock"]
