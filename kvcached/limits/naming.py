"""Names of instance records in /dev/shm.

An engine runs its scheduler and workers as several processes of one process
group, so every process of one instance derives the same name without talking
to the others: ``KVCACHED_IPC_NAME`` when set, else upstream's
``kvcached_<engine>_<pgid>``. A KV group other than 0 that needs its own limit
gets ``<name>_g<group>``.
"""

from __future__ import annotations

import os
from typing import Optional

ENV_IPC_NAME = "KVCACHED_IPC_NAME"
# The record keeps names in a 128-byte field with a terminating NUL.
MAX_NAME_LEN = 127


def validate_name(name: str) -> str:
    """Returns ``name`` if it can name a record, else raises ValueError saying why.

    A name is 1-127 characters of printable ASCII without ``/`` or whitespace
    (it is a file name in /dev/shm and a word on a kvctl command line).
    """
    if not isinstance(name, str) or not name:
        raise ValueError("instance name is empty; set KVCACHED_IPC_NAME or pass a name")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(f"instance name {name[:20]!r}... is {len(name)} characters; use at most {MAX_NAME_LEN}")
    if name in (".", "..") or any(c == "/" or not c.isprintable() or c.isspace() or ord(c) > 126 for c in name):
        raise ValueError(f"instance name {name!r} is invalid; use printable ASCII without '/' or spaces")
    return name


def default_instance_name(engine: str, pgid: Optional[int] = None) -> str:
    """Upstream's derived name, ``kvcached_<engine>_<pgid>`` (pgid: this process group)."""
    return validate_name(f"kvcached_{engine}_{os.getpgid(0) if pgid is None else pgid}")


def instance_name(engine: str) -> str:
    """The name of this process's instance: ``KVCACHED_IPC_NAME`` or the derived one."""
    env = os.environ.get(ENV_IPC_NAME)
    if env:
        return validate_name(env)
    return default_instance_name(engine)


def group_record_name(name: str, group_id: int = 0) -> str:
    """The record of KV group ``group_id`` of instance ``name`` (group 0 is the instance itself)."""
    if group_id < 0:
        raise ValueError(f"group_id must be >= 0, got {group_id}")
    return validate_name(name if group_id == 0 else f"{name}_g{group_id}")
