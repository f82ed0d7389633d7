"""An opt-in event trace of how memory moves between instances: ``KVCACHED_TRACE=DIR``.

Each process appends JSON lines to its own file ``DIR/kvcached-<pid>.jsonl``
(the folder is created 0700, the file 0600: records name instances and sizes of
a user's engines). A line::

    {"t_ns": 123, "pid": 42, "instance": "kvcached_vllm_7", "event": "map", "pages": 3, "ms": 0.41}

``t_ns`` is ``time.monotonic_ns()``: CLOCK_MONOTONIC is one clock for every
process of a Linux host, so the files of the engines sharing a device budget
merge into one timeline (``python -m kvcached.bench burst --trace DIR``). An
event with ``ms`` is stamped when the work ended; it started ``ms`` earlier.

Unset (the default) every hook costs one check of the module-level ``ON``: hot
paths test it themselves before building anything; others call ``start()``
(0 when off) and ``end(...)``, which returns at once for a 0. The variable is
read when this module is first imported (every engine process inherits it from
its parent), not per event: ``configure()`` changes it later (tests).

Writing never disturbs the engine: one ``os.write`` per line on an ``O_APPEND``
descriptor (lines of threads and processes do not interleave), and an error
turns the trace off with one warning instead of raising into a scheduler.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional

from kvcached import config

logger = logging.getLogger(__name__)

ON: bool = False  # the only thing a hook reads when tracing is off
_dir: Optional[str] = None
_fd = -1
_pid = 0  # the process that opened _fd: a forked child opens its own file
_lock = threading.Lock()

FILE_PREFIX = "kvcached-"
FILE_SUFFIX = ".jsonl"


def configure(directory: Optional[str]) -> None:
    """Traces into ``directory`` from now on (None: tracing off). The file is opened at the first event."""
    global ON, _dir
    with _lock:
        _close_locked()
        _dir = directory or None
        ON = _dir is not None


def _close_locked() -> None:
    global _fd, _pid
    if _fd >= 0 and _pid == os.getpid():
        try:
            os.close(_fd)
        except OSError:
            pass
    _fd, _pid = -1, 0


def path_of(pid: int, directory: Optional[str] = None) -> str:
    """The trace file of process ``pid``."""
    return os.path.join(directory or _dir or ".", f"{FILE_PREFIX}{pid}{FILE_SUFFIX}")


def _open_locked() -> int:
    global _fd, _pid
    pid = os.getpid()
    if _fd >= 0 and _pid == pid:
        return _fd
    _fd = -1  # inherited over fork: the parent's file is not ours to write
    assert _dir is not None
    # An existing folder is left as it is (it may be a shared one such as /tmp); one we
    # create is the owner's only.
    os.makedirs(_dir, mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    _fd = os.open(path_of(pid, _dir), flags, 0o600)
    _pid = pid
    return _fd


def event(name: str, instance: str = "", **fields: Any) -> None:
    """Appends one event (no-op when tracing is off). ``fields``: small numbers (bytes, pages, blocks, ms)."""
    global ON
    if not ON:
        return
    rec: Dict[str, Any] = {"t_ns": time.monotonic_ns(), "pid": os.getpid(), "instance": instance, "event": name}
    rec.update(fields)
    line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
    try:
        with _lock:
            os.write(_open_locked(), line)
    except OSError as e:
        ON = False  # the trace is a diagnostic: an engine must not fail for it
        logger.warning("kvcached: KVCACHED_TRACE=%s: cannot write the trace (%s); tracing is off", _dir, e)


def start() -> int:
    """A start time for ``end`` (``time.monotonic_ns()``), or 0 when tracing is off."""
    return time.monotonic_ns() if ON else 0


def end(name: str, t0: int, instance: str = "", **fields: Any) -> None:
    """The event of work begun at ``t0`` (from ``start``), with its duration as ``ms``; no-op for ``t0 == 0``."""
    if t0:
        event(name, instance, ms=round((time.monotonic_ns() - t0) / 1e6, 3), **fields)


def read(directory: str) -> List[Dict[str, Any]]:
    """Every event of every process's file in ``directory``, in time order.

    A line cut short (a process killed mid-write) or not JSON is skipped: the
    rest of the timeline is still worth reading."""
    events: List[Dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(directory, f"{FILE_PREFIX}*{FILE_SUFFIX}"))):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "t_ns" in rec and "event" in rec:
                    events.append(rec)
    events.sort(key=lambda r: r["t_ns"])
    return events


configure(config.trace_dir())
