"""AllocRetry: a failed PyTorch allocation borrows what it lacked from kvcached's
engines and runs again. UNTESTED ON A GPU: only the core (the message parsed,
the borrow grown, the retry) runs in the CPU tests, with a stand-in error.

    retry = torch_alloc_retry("cuda:0")
    loss = retry(train_step, batch)      # OOM -> borrow "Tried to allocate X" more -> again
    ...
    retry.release()                      # or `with torch_alloc_retry(...) as retry:`

On ``torch.cuda.OutOfMemoryError`` (or ``oom_types``) it reads how much the
allocation tried to get (PyTorch's "Tried to allocate 2.00 GiB"), borrows that
much more, rounded up to ``granule`` (one Reservation per AllocRetry, grown
each time: ``kvctl list`` shows one job), and calls the function again, at
most ``max_retries`` times. The borrowed bytes stay held until ``release()``
(or the process ends): PyTorch's caching allocator keeps what it got.

What it cannot do: the budget counts kvcached's engines and borrowers only.
Memory this process used before its first OOM (CUDA context, model weights)
must fit the part of the device the budget leaves out (1 -
``KVCACHED_GPU_UTILIZATION``) or be borrowed up front with ``reserve``.
A borrow that cannot be had re-raises PyTorch's error, the kvcached error as
its cause.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Tuple, Type, TypeVar

from kvcached.borrowing.reservation import DEFAULT_TIMEOUT_S, Reservation, reserve
from kvcached.errors import InvalidArgumentError, OutOfMemoryError, int_arg

T = TypeVar("T")
_TRIED = re.compile(r"Tried to allocate ([0-9]+(?:\.[0-9]+)?) ?(B|bytes|KiB|MiB|GiB|TiB)\b")
_UNIT = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
GRANULE = 2 << 20  # PyTorch's large-segment rounding


def tried_bytes(message: str) -> Optional[int]:
    """The bytes a PyTorch out-of-memory message says it tried to allocate (None: not said)."""
    m = _TRIED.search(message)
    if m is None:
        return None
    return int(float(m.group(1)) * _UNIT[m.group(2)] + 0.5)


class AllocRetry:
    """Runs a function, borrowing what its out-of-memory errors lacked (module doc)."""

    def __init__(
        self,
        device: object = "cuda",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        granule: int = GRANULE,
        name: Optional[str] = None,
        priority: bool = False,
        budget: Any = None,
        oom_types: Optional[Tuple[Type[BaseException], ...]] = None,
    ) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.max_retries = int_arg("max_retries", max_retries, minimum=0)
        self.granule = int_arg("granule", granule, minimum=1)
        self.name = name
        self.priority = priority
        self.budget = budget
        self._oom_types = oom_types
        self.reservation: Optional[Reservation] = None

    @property
    def nbytes(self) -> int:
        """Bytes borrowed so far."""
        return 0 if self.reservation is None else self.reservation.nbytes

    def _types(self) -> Tuple[Type[BaseException], ...]:
        if self._oom_types is None:
            import torch  # only here: importing kvcached stays light

            self._oom_types = (torch.cuda.OutOfMemoryError,)
        return self._oom_types

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        types = self._types()
        for attempt in range(self.max_retries + 1):
            try:
                return fn(*args, **kwargs)
            except types as e:
                if attempt == self.max_retries:
                    raise
                need = tried_bytes(str(e))
                if need is None:
                    raise
                try:
                    self._borrow(-(-need // self.granule) * self.granule)
                except (OutOfMemoryError, InvalidArgumentError) as why:
                    raise e from why
        raise AssertionError("unreachable")

    def _borrow(self, extra: int) -> None:
        if self.reservation is None or self.reservation.released:
            self.reservation = reserve(
                extra,
                self.device,
                timeout_s=self.timeout_s,
                name=self.name,
                priority=self.priority,
                budget=self.budget,
            )
        else:
            self.reservation.grow(extra, self.timeout_s)

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` retried as ``self(fn, ...)`` (a decorator)."""

        def run(*args: Any, **kwargs: Any) -> T:
            return self(fn, *args, **kwargs)

        run.__name__ = getattr(fn, "__name__", "run")
        run.__doc__ = fn.__doc__
        return run

    def release(self) -> None:
        """Gives back everything borrowed (engines may grow into it again)."""
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def __enter__(self) -> AllocRetry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def torch_alloc_retry(device: object = "cuda", **kwargs: Any) -> AllocRetry:
    """An AllocRetry for ``device`` (keyword arguments as AllocRetry's). Untested on a GPU."""
    return AllocRetry(device, **kwargs)
