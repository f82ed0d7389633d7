"""Removing what crashed instances left behind: dead records and socket directories.

vLLM's default shutdown SIGKILLs its EngineCore and workers, and any engine
can die at any instruction; their records (/dev/shm) and socket directories
stay. A new instance clears this user's dead ones at start
(``cleanup_dead_instances``); the process that started an engine clears its
own at exit (``cleanup_instance``); ``kvctl cleanup`` does the former by hand.
Liveness is re-checked by the data plane before a record is deleted.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from typing import Dict, List, Optional

from kvcached import naming
from kvcached.errors import InvalidArgumentError

logger = logging.getLogger("kvcached.elastic")


def cleanup_dead_instances(prefix: str = "", failed: Optional[Dict[str, str]] = None) -> List[str]:
    """Deletes records whose owner died (names starting with ``prefix``) and
    socket directories nobody serves (what a killed engine leaves behind), for
    this user. Returns the records deleted; ``failed`` (if given) receives
    name -> why for each dead record of this user that is still there.

    Another user's records are left alone (root's cleanup covers everyone's).
    """
    from kvcached import _C
    from kvcached.ipc import paths
    from kvcached.limits.records import list_records

    uid = os.geteuid()
    deleted: List[str] = []
    for r in list_records():
        if r.alive or not r.name.startswith(prefix) or (uid != 0 and r.owner_uid != uid):
            continue
        try:
            _C.delete_mem_info_record(r.name, False)  # re-checks liveness: a restarted owner is kept
            deleted.append(r.name)
            logger.info("kvcached: removed the record of dead instance %s", r.name)
        except _C.KvcachedError as e:
            if failed is not None:
                failed[r.name] = str(e)
    for root in glob.glob(os.path.join(paths.BASE_DIR, "kvcached-tp-*")):
        try:
            st = os.lstat(root)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(root) or os.path.islink(root):
            continue
        _remove_socket_root(root)
    return deleted


def _remove_socket_root(root: str) -> bool:
    """Removes the stale sockets of ``root`` and the folder if then empty, under its lock;
    False if the lock or the folder could not be had (another user's, or gone)."""
    from kvcached.ipc import paths

    try:
        with paths.locked_root(root):
            paths.remove_stale(root)
            try:
                os.rmdir(root)
            except OSError:
                pass  # a worker is still listening there (dying)
    except (OSError, InvalidArgumentError):
        return False
    return True


def cleanup_instance(base: str, wait_s: float = 10.0) -> None:
    """Removes the record and socket directory of instance ``base`` (and its
    sub-instances: ``_dp<k>`` engines, ``_pp/_tp`` ranks, ``_g`` groups) once their owners are dead.

    Run at exit of the process that started the engine (API server / LLM
    script): vLLM's default shutdown (``--shutdown-timeout 0``) SIGKILLs the
    EngineCore and workers, so they cannot clean up themselves. Owners that
    are still alive after ``wait_s`` (dying) are left to the next start.
    """
    from kvcached import _C
    from kvcached.ipc import paths
    from kvcached.limits.records import list_records

    deadline = time.monotonic() + wait_s
    names = {base} | {r.name for r in list_records() if naming.belongs_to(base, r.name)}
    for name in sorted(names):
        while True:
            rec = next((r for r in list_records() if r.name == name), None)
            if rec is None:
                break
            if not rec.alive:  # dead, or killed and not yet reaped by this process
                try:
                    _C.delete_mem_info_record(name, False)  # re-checks liveness
                except _C.KvcachedError:
                    pass
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        root = paths.socket_root(name)
        while os.path.isdir(root):
            if not _remove_socket_root(root):
                break
            if not os.path.isdir(root) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
