"""Exception types of kvcached. Each says what went wrong and what to do.

They are defined by the extension (so C++ and Python raise the same types) and
re-exported here. Recoverable pressure (OutOfMemoryError) is kept apart from
lost consistency (StateConsistencyError, after which the pool refuses work).
"""

import operator

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

_INT64_MAX = (1 << 63) - 1


def int_arg(name: str, value: object, minimum: int = 0) -> int:
    """An integer argument checked as the extension checks its own (SECURITY.md A1): a bool,
    a float or a string is refused (pybind would cast True to 1, or raise an untyped
    TypeError), as is a value beyond 64 bits or below ``minimum``. Numpy and torch integer
    scalars are integers. Raises InvalidArgumentError naming ``name``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v > _INT64_MAX:
        raise InvalidArgumentError(f"{name} is outside the 64-bit integer range")
    if v < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {v}")
    return v


__all__ = [
    "BackendError",
    "InvalidArgumentError",
    "KvcachedError",
    "KVCachePoolExhausted",
    "OutOfMemoryError",
    "ShutdownError",
    "StateConsistencyError",
    "int_arg",
]
