"""UserLock: an exclusive lock among one user's processes, kept in /dev/shm.

/dev/shm is world-writable, so any local user can create a file under the
name a lock wants (a DoS: the lock's owner cannot open it, nor remove it,
the directory being sticky). So a lock has ``NAMES`` candidate files, and
its holder flocks *every* one of them that this user owns, creating the first
free name when it owns none; then it checks that the set it owns did not
change meanwhile (else it starts over). Another user can squat names but never
create, remove or lock a file this user owns, and this user's files only ever
get added, so any two holders share at least one file: mutual exclusion holds
while fewer than all ``NAMES`` names are squatted. When all are, the lock
refuses with a message naming them.

Waits are bounded: a file that stays locked for ``wait_s`` (its holder stopped
with SIGSTOP, say) raises TimeoutError instead of hanging the caller.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from typing import List, Optional, Tuple

from kvcached.errors import InvalidArgumentError

NAMES = 4
DEFAULT_WAIT_S = 5.0


class UserLock:
    """One lock; ``base`` is the path of its first file (``.lock`` suffix)."""

    def __init__(self, base: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        stem = base[: -len(".lock")] if base.endswith(".lock") else base
        self.paths = [base] + [f"{stem}.{k}.lock" for k in range(1, NAMES)]
        self.wait_s = float(wait_s)
        self._uid = os.geteuid()

    def acquire(self) -> List[int]:
        """Locks; returns the open descriptors to hand to ``release``."""
        deadline = time.monotonic() + self.wait_s
        while True:
            fds = [fd for fd in (self._open(p, create=False) for p in self.paths) if fd is not None]
            if not fds:
                self._create_one()
                continue  # scan again: take every file of ours, not only the new one
            try:
                for fd in fds:
                    self._flock(fd, deadline)
                if sorted(self._ids(fds)) == sorted(self._owned_ids()):
                    return fds
            except BaseException:
                self.release(fds)
                raise
            self.release(fds)  # a file of ours appeared meanwhile: take it too

    @staticmethod
    def release(fds: List[int]) -> None:
        for fd in fds:
            os.close(fd)  # drops its flock

    # ---- pieces -------------------------------------------------------------
    def _open(self, path: str, create: bool) -> Optional[int]:
        """An fd of ``path`` if it is a regular file of this user (created with ``create``)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        except OSError:
            return None  # absent, another user's, a link, ...
        st = os.fstat(fd)
        if st.st_uid != self._uid or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd

    def _create_one(self) -> None:
        for p in self.paths:
            fd = self._open(p, create=True)
            if fd is not None:
                os.close(fd)
                return
        if not self._owned_ids():
            squatted = [p for p in self.paths if os.path.lexists(p)]
            if len(squatted) == len(self.paths):
                raise InvalidArgumentError(
                    f"every name of the lock {self.paths[0]} is taken by another user's file ({', '.join(squatted)}); "
                    "ask root to remove them"
                )

    def _owned_ids(self) -> List[Tuple[int, int]]:
        out = []
        for p in self.paths:
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_uid == self._uid and stat.S_ISREG(st.st_mode):
                out.append((st.st_dev, st.st_ino))
        return out

    @staticmethod
    def _ids(fds: List[int]) -> List[Tuple[int, int]]:
        return [(st.st_dev, st.st_ino) for st in map(os.fstat, fds)]

    def _flock(self, fd: int, deadline: float) -> None:
        delay = 20e-6
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EINTR):
                    raise
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.paths[0]} stayed locked for {self.wait_s:g} s (its holder is stopped or stuck?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
