"""UserLock: an exclusive lock among one user's processes, kept in /dev/shm.

/dev/shm is world-writable and sticky, so any local user can create a file
under a name the lock wants, and the lock's owner can then neither open nor
remove it. So the lock is not one file but every regular file of this user
named ``<stem>.lock`` or ``<stem>.<anything>.lock`` in its directory: a holder
flocks *all* of them, creating one when it owns none (the plain name if free,
else a name with 16 random hex digits that no one can take in advance), then
lists them again and starts over if the set changed meanwhile. Another user
can squat names but never create, remove or lock a file this user owns, and
this user's files only ever get added, so any two holders share at least one
file: mutual exclusion holds however many names are squatted. The lock lives
in /dev/shm with the records it guards (containers that share /dev/shm share
both; a home directory would not be shared).

Waits are bounded: a file that stays locked for ``wait_s`` (its holder stopped
with SIGSTOP, say) raises TimeoutError instead of hanging the caller.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time
from typing import Dict, List, Optional, Tuple

DEFAULT_WAIT_S = 5.0

FileId = Tuple[int, int]  # (st_dev, st_ino)


class UserLock:
    """One lock; ``base`` is the path of its plain file (``.lock`` suffix)."""

    def __init__(self, base: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.base = base
        self._dir, name = os.path.split(base)
        self._stem = name[: -len(".lock")] if name.endswith(".lock") else name
        self.wait_s = float(wait_s)
        self._uid = os.geteuid()

    @property
    def paths(self) -> List[str]:
        """The plain name and every file now in the directory that the lock
        would take if this user owned it (whoever owns it)."""
        return [self.base] + sorted(p for p in self._candidates() if p != self.base)

    def acquire(self) -> List[int]:
        """Locks; returns the open descriptors to hand to ``release``."""
        deadline = time.monotonic() + self.wait_s
        while True:
            owned = self._owned()
            if not owned:
                self._create_one()
                continue  # list again: take every file of ours, not only the new one
            fds = self._open_all(owned)
            try:
                for fd in fds:
                    self._flock(fd, deadline)
                now = set(self._owned().values())
                if now and set(self._ids(fds)) == now:
                    return fds
            except BaseException:
                self.release(fds)
                raise
            self.release(fds)  # a file of ours appeared (or went) meanwhile: take the new set

    @staticmethod
    def release(fds: List[int]) -> None:
        for fd in fds:
            os.close(fd)  # drops its flock

    # ---- pieces -------------------------------------------------------------
    def _candidates(self) -> List[str]:
        plain, prefix = self._stem + ".lock", self._stem + "."
        try:
            names = os.listdir(self._dir)
        except OSError:
            return []
        return [
            os.path.join(self._dir, n)
            for n in names
            if n == plain or (n.startswith(prefix) and n.endswith(".lock") and len(n) > len(prefix) + len(".lock"))
        ]

    def _owned(self) -> Dict[str, FileId]:
        """Path -> file id of the candidates that are regular files of this user."""
        out: Dict[str, FileId] = {}
        for p in self._candidates():
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_uid == self._uid and stat.S_ISREG(st.st_mode):
                out[p] = (st.st_dev, st.st_ino)
        return out

    def _open_all(self, owned: Dict[str, FileId]) -> List[int]:
        """One fd per distinct file (a hard link under a second name must not be
        flocked twice: the second flock would wait for the first)."""
        fds, seen = [], set()
        for p in owned:
            fd = self._open(p, create=False)
            if fd is None:
                continue  # gone or replaced meanwhile: the set check after locking sees it
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            seen.add((st.st_dev, st.st_ino))
            fds.append(fd)
        return fds

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
        """The plain name if free, else a random one (squatted names are another user's)."""
        for path in (self.base, os.path.join(self._dir, f"{self._stem}.{secrets.token_hex(8)}.lock")):
            fd = self._open(path, create=True)
            if fd is not None:
                os.close(fd)
                return
            if self._owned():
                return  # another process of this user made one meanwhile
        raise OSError(f"cannot create a lock file for {self.base} in {self._dir} (is it writable?)")

    @staticmethod
    def _ids(fds: List[int]) -> List[FileId]:
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
                raise TimeoutError(f"{self.base} stayed locked for {self.wait_s:g} s (its holder is stopped or stuck?)")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
