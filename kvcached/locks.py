"""Upstream kvcached's ``kvcached.locks``: lock protocols and no-op stand-ins.

Upstream's KVCacheManager takes a no-op lock under synchronous scheduling;
ours always takes a real one (its fast path is lock-cheap), so these exist for
code written against upstream that builds its own objects with them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol


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


__all__ = ["ConditionLike", "LockLike", "NoOpCondition", "NoOpLock"]
