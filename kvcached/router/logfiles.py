"""The engines' log files: private to the user, never through a link.

A log directory other users can write lets them plant a symbolic link where an
engine's log will be opened, and the router (perhaps root) would append to the
link's target; a log readable by them shows prompts. So the directory is made 0700,
or must exist as a real directory of this user that no one else can write, and
each log is opened without following links, 0600, and must be a regular file of
this user.
"""

from __future__ import annotations

import os
import stat

from kvcached.router.config import ConfigError


def prepare_log_dir(path: str) -> None:
    """Creates ``path`` 0700, or checks that the existing one is safe; ConfigError otherwise."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"log_dir {path!r} is not a directory (a link or a file); point log_dir at a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"log_dir {path!r} belongs to uid {st.st_uid}, not to you; use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"log_dir {path!r} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"use a directory only you can write (chmod go-w {path})"
        )


def open_log(path: str) -> int:
    """``path`` opened for appending, created 0600, never through a link: a file descriptor.
    An existing log of this user that others could read is made 0600."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        why = "is a symbolic link" if os.path.islink(path) else e.strerror
        raise ConfigError(f"engine log {path!r} cannot be opened safely ({why}); remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(f"engine log {path!r} is not a regular file of yours; remove it")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise
