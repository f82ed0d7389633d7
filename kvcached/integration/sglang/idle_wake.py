"""SGLang's ``--sleep-on-idle`` with kvcached: an idle engine that sleeps still wakes for us.

With the option an idle scheduler blocks in ``IdleSleeper.maybe_sleep`` (a zmq poll of
its request sockets, up to 1 s) and runs its ``on_idle``, where kvcached's idle hooks
give memory to a wanting peer or meet a lowered limit, only after the poll returns. This
patch adds a pipe to that poll; the scheduler's ``ElasticInstance.wake_idle_loop`` (a peer's want,
an applied limit: the limits' watcher thread) writes a byte to it, so the hooks run at
once instead of up to a second later. The byte is drained after each poll.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Optional

from kvcached.integration.patch_base import wrap_method

_PIPE = "_kvcached_wake_pipe"  # (read fd, write fd) on an IdleSleeper


def patch_idle_sleeper(mod: ModuleType) -> None:
    """``IdleSleeper`` polls a pipe of ours too (see the module doc)."""
    import zmq

    def make_init(init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self.poller.register(r, zmq.POLLIN)
            setattr(self, _PIPE, (r, w))

        return __init__

    def make_sleep(sleep: Callable) -> Callable:
        def maybe_sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = sleep(self, *args, **kwargs)
            pipe = getattr(self, _PIPE, None)
            if pipe is not None:
                _drain(pipe[0])
            return out

        return maybe_sleep

    wrap_method(mod.IdleSleeper, "__init__", make_init)
    wrap_method(mod.IdleSleeper, "maybe_sleep", make_sleep)


def waker_of(sleeper: Any) -> Optional[Callable[[], None]]:
    """What wakes ``sleeper`` (a scheduler's ``idle_sleeper``; None: it has no pipe of ours)."""
    pipe = getattr(sleeper, _PIPE, None)
    if pipe is None:
        return None
    fd = pipe[1]

    def wake() -> None:
        try:
            os.write(fd, b"\0")
        except OSError:  # full (a wake is pending anyway) or closed at exit: nothing to do
            pass

    return wake


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:  # empty (EAGAIN)
        pass
