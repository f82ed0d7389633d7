"""The owner's side of trusting its own record in /dev/shm.

``create_record``: the record of an instance, under another name when another user's
file already holds the wanted one (anyone can create files in /dev/shm, and
the directory is sticky: the owner could neither open nor remove it).

``record_trusted``: whether the owner may act on what its record says now. A record
can be truncated, chowned, or written with garbage by the same user or root;
the data plane's snapshot reports that in ``problem`` (docs/SECURITY.md). The
owner then ignores limit writes and keeps the limit it enforces, logging why
once; a limit above the device's usable memory is refused the same way.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Set, Tuple

from kvcached import _C
from kvcached.errors import InvalidArgumentError
from kvcached.limits.records import SHM_DIR
from kvcached.naming import MAX_NAME_LEN
from kvcached.units import format_size

logger = logging.getLogger("kvcached.limits.instance")


def create_record(
    name: str, engine: str, device_type: int, device_index: int, total: int, limit: int
) -> Tuple[str, _C.MemInfoTracker]:
    """(the name used, the new record). Raises as MemInfoTracker.create, except
    when another user's file holds ``name``: then ``<name>.<8 hex>`` is used
    and a warning says so."""
    try:
        return name, _C.MemInfoTracker.create(name, engine, device_type, device_index, total, limit)
    except InvalidArgumentError:
        try:
            squatter = os.lstat(os.path.join(SHM_DIR, name)).st_uid
        except OSError:
            squatter = os.geteuid()
        if squatter == os.geteuid():
            raise
    alt = f"{name[: MAX_NAME_LEN - 9]}.{secrets.token_hex(4)}"
    logger.warning(
        "kvcached: the record name %s is taken by a file of uid %d (another user); this instance's record is %s: "
        "use that name with kvctl (ask root to remove /dev/shm/%s)",
        name,
        squatter,
        alt,
        name,
    )
    return alt, _C.MemInfoTracker.create(alt, engine, device_type, device_index, total, limit)


def record_trusted(snap: _C.MemInfoSnapshot, name: str, limit: int, device_bytes: int, warned: Set[str]) -> bool:
    """Whether the owner of ``name`` may apply what ``snap`` says (it enforces
    ``limit`` now). Each kind of distrust, and leaked memory, is logged once
    (``warned`` remembers which)."""

    def once(key: str, msg: str, *args: object) -> None:
        if key not in warned:
            warned.add(key)
            logger.warning(msg, *args)

    if snap.quarantined:
        once(
            "quarantined",
            "kvcached: %s of %s could not be released (a failed driver call); it stays allocated until the "
            "instance exits (kvctl list: LEAKED)",
            format_size(snap.quarantined),
            name,
        )
    if snap.problem:
        once(
            "invalid",
            "kvcached: the record of %s cannot be trusted (%s); limit writes are ignored and the instance keeps "
            "its limit of %s (restart it for a new record)",
            name,
            snap.problem,
            format_size(limit),
        )
        return False
    if snap.busy:
        return False  # a write in flight, or its writer stopped: read again at the next wake-up
    if device_bytes > 0 and snap.limit > device_bytes:
        once(
            "range",
            "kvcached: the record of %s asks for a limit of %s, above the usable memory of its device (%s); "
            "ignored (only kvctl limit / kvcached.control write limits, and they check it)",
            name,
            format_size(snap.limit),
            format_size(device_bytes),
        )
        return False
    return True
