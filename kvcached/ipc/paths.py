"""Where the worker sockets live, and keeping that place private and clean.

Layout (names: kvcached.naming, rule 5), one root per instance and user::

    /tmp/kvcached-tp-<name>-<hash>/w<rank>.sock          pipeline stage 0
    /tmp/kvcached-tp-<name>-<hash>/pp<k>/w<rank>.sock    stage k >= 1

``<name>`` is KVCACHED_IPC_NAME reduced to safe characters; ``<hash>`` covers the
exact name and the uid, so distinct names never share a root and two users do
not collide in /tmp. Every directory is created 0700 and must be owned by us: a
root planted by another user is refused, not used.

Concurrency: listeners of one instance start and stop at the same time. All
changes under a root happen while holding flock() on the root directory itself
(no lock file is left behind), and a holder re-checks that the directory it
locked is still the one at the path (a stopping peer may have removed it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from typing import Iterator, List, Optional

from kvcached import naming
from kvcached.errors import InvalidArgumentError

log = logging.getLogger("kvcached.ipc")

BASE_DIR = "/tmp"
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_PROBE_TIMEOUT_S = 0.5


def socket_root(ipc_name: Optional[str] = None) -> str:
    """The socket directory of an instance (not created); its name is kvcached.naming's rule 5."""
    name = naming.ipc_name() if ipc_name is None else ipc_name
    if not name:
        raise InvalidArgumentError("the IPC name must not be empty; set KVCACHED_IPC_NAME")
    return os.path.join(BASE_DIR, naming.socket_dir_name(name))


def socket_path(rank: int, pp_rank: int = 0, ipc_name: Optional[str] = None) -> str:
    """The socket of worker ``rank`` in pipeline stage ``pp_rank``."""
    if rank < 0 or pp_rank < 0:
        raise InvalidArgumentError(f"rank {rank} and pp_rank {pp_rank} must be >= 0")
    root = socket_root(ipc_name)
    d = root if pp_rank == 0 else os.path.join(root, naming.stage_dir_name(pp_rank))
    path = os.path.join(d, naming.socket_file_name(rank))
    if len(path.encode()) > _UNIX_PATH_MAX:
        raise InvalidArgumentError(f"socket path {path!r} is longer than {_UNIX_PATH_MAX} bytes")
    return path


def ensure_private_dir(path: str) -> None:
    """Creates ``path`` 0700 or checks that the existing one is ours and private.

    Raises InvalidArgumentError for a symlink, a non-directory or a directory of
    another user (someone could read or replace our sockets there)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"socket directory {path!r} exists and is not a directory; remove it")
    if st.st_uid != os.geteuid():
        raise InvalidArgumentError(
            f"socket directory {path!r} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}); "
            "remove it or choose another KVCACHED_IPC_NAME"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        # Ours but too open (e.g. made by hand): tighten instead of failing the start.
        log.warning("socket directory %s had mode %o; setting 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


@contextlib.contextmanager
def locked_root(root: str) -> Iterator[None]:
    """Creates the root if needed and holds its flock for the block."""
    for _ in range(1000):
        ensure_private_dir(root)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # removed between mkdir and open by a stopping peer
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.lstat(root)
            except FileNotFoundError:
                continue
            if held.st_nlink == 0 or (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
                continue  # we locked a directory that was removed meanwhile
            yield
            return
        finally:
            os.close(fd)
    raise InvalidArgumentError(f"could not lock socket directory {root!r}: it keeps being replaced")


def _socket_files(root: str) -> List[str]:
    out = []
    for d in [root] + [os.path.join(root, e) for e in _pp_dirs(root)]:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        out.extend(os.path.join(d, n) for n in names if n.endswith(".sock"))
    return out


def _pp_dirs(root: str) -> List[str]:
    try:
        return [e for e in os.listdir(root) if naming.is_stage_dir_name(e)]
    except FileNotFoundError:
        return []


def is_live(path: str) -> bool:
    """True when a listener accepts connections at ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(_PROBE_TIMEOUT_S)
    try:
        s.connect(path)
        return True
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        # EAGAIN (backlog full) or a timeout: someone is there.
        return True
    finally:
        s.close()


def remove_stale(root: str, keep_dir: Optional[str] = None) -> int:
    """Removes sockets nobody listens on and empty stage directories under ``root``
    (left by a crash). Caller holds ``locked_root(root)``. Returns files removed."""
    removed = 0
    for path in _socket_files(root):
        if not is_live(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    for e in _pp_dirs(root):
        d = os.path.join(root, e)
        if d != keep_dir:
            with contextlib.suppress(OSError):
                os.rmdir(d)  # only succeeds when empty
    if removed:
        log.info("removed %d stale socket(s) under %s", removed, root)
    return removed


def remove_socket(path: str, inode: Optional[tuple]) -> None:
    """Unlinks our socket (only if it is still the one we bound: a successor may
    have replaced it) and then the stage directory and root if they are empty.
    Caller holds ``locked_root``."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if inode is None or (st.st_dev, st.st_ino) == inode:
            os.unlink(path)
    root = os.path.dirname(path)
    if naming.is_stage_dir_name(os.path.basename(root)):
        with contextlib.suppress(OSError):
            os.rmdir(root)
        root = os.path.dirname(root)
    with contextlib.suppress(OSError):
        os.rmdir(root)
