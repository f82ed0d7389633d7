"""Exception types of kvcached. Each says what went wrong and what to do.

They are defined by the extension (so C++ and Python raise the same types) and
re-exported here. Recoverable pressure (OutOfMemoryError) is kept apart from
lost consistency (StateConsistencyError, after which the pool refuses work).
"""

from kvcached._C import (  # noqa: F401
    BackendError,
    InvalidArgumentError,
    KvcachedError,
    OutOfMemoryError,
    ShutdownError,
    StateConsistencyError,
)

# Upstream-compatible name used by engine adapters for an allocation miss.
KVCachePoolExhausted = OutOfMemoryError

__all__ = [
    "BackendError",
    "InvalidArgumentError",
    "KvcachedError",
    "KVCachePoolExhausted",
    "OutOfMemoryError",
    "ShutdownError",
    "StateConsistencyError",
]
