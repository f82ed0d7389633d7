"""Wire format of the scheduler <-> worker channel. Binary, fixed layouts, no pickle:
a peer can at worst make us reject a frame, never run code.

Frame = 16-byte header + body, little endian::

    magic u16 = 0x4B56 ("VK")   version u8   cmd u8   body_len u32   req_id u64

A reply echoes the request's ``req_id``; its ``cmd`` is ``OK | request cmd`` or
``ERROR``. The request id lets the coordinator skip a late reply to a request it
already gave up on (timeout) on a connection it keeps. Bodies:

  HELLO        -                          -> rank i32, pp_rank i32, pid i32
  PING         -                          -> -
  MAP          group i32, tx i64, n u32, n x offset i64   -> newly u32, already u32
  ROLLBACK_MAP group i32, tx i64          -> unmapped u32
  PREPARE      group i32, tx i64, n u32, n x offset i64   -> -
  COMMIT       group i32, tx i64          -> -
  ABORT        group i32, tx i64          -> -
  TX_OUTCOME   group i32, tx i64          -> outcome u8 (see OUTCOMES)
  KV_CREATED   group i32                  -> created u8
  QUERY        group i32                  -> WorkerState (see encode_state)
  ERROR reply: kind i32 (kvcached._C.ERROR_KIND_*), message utf-8

Limits: a body is at most MAX_BODY bytes (about one million offsets); error
messages are cut at MAX_MESSAGE bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import List, Sequence, Tuple

from kvcached import _C, errors

MAGIC = 0x4B56
VERSION = 1
HEADER = struct.Struct("<HBBIQ")
HEADER_SIZE = HEADER.size
MAX_BODY = 8 << 20
MAX_MESSAGE = 4096
MAX_OFFSETS = (MAX_BODY - 16) // 8


class Cmd(IntEnum):
    HELLO = 1
    PING = 2
    MAP = 3
    ROLLBACK_MAP = 4
    PREPARE = 5
    COMMIT = 6
    ABORT = 7
    TX_OUTCOME = 8
    KV_CREATED = 9
    QUERY = 10


OK = 0x80  # reply cmd = OK | request cmd
ERROR = 0xFF
COMMANDS = frozenset(int(c) for c in Cmd)

OUTCOMES = ("unknown", "prepared", "committed", "aborted")

_GROUP = struct.Struct("<i")
_GROUP_TX = struct.Struct("<iq")
_GROUP_TX_N = struct.Struct("<iqI")
_HELLO = struct.Struct("<iii")
_MAP_REPLY = struct.Struct("<II")
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
_KIND = struct.Struct("<i")
_STATE = struct.Struct("<BBqqqqqqI")


class ProtocolError(Exception):
    """A frame or body that does not follow this format. ``reason`` is a short
    stable tag (the listener logs each tag once)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---- error kinds ---------------------------------------------------------------

KIND_TO_ERROR = {
    _C.ERROR_KIND_INVALID_ARGUMENT: errors.InvalidArgumentError,
    _C.ERROR_KIND_OUT_OF_MEMORY: errors.OutOfMemoryError,
    _C.ERROR_KIND_STATE_CONSISTENCY: errors.StateConsistencyError,
    _C.ERROR_KIND_BACKEND: errors.BackendError,
    _C.ERROR_KIND_SHUTDOWN: errors.ShutdownError,
}
_ERROR_TO_KIND = [(cls, kind) for kind, cls in KIND_TO_ERROR.items()]


def kind_of(exc: BaseException) -> int:
    """The kvcached error kind of an exception; anything unexpected is a backend failure."""
    k = getattr(exc, "kvcached_kind", None)
    if isinstance(k, int) and k in KIND_TO_ERROR:
        return k
    for cls, kind in _ERROR_TO_KIND:
        if isinstance(exc, cls):
            return kind
    return _C.ERROR_KIND_BACKEND


def make_error(kind: int, message: str) -> Exception:
    """An exception of the kvcached type for ``kind`` carrying ``kvcached_kind``, so
    PageAllocator's Python mapper turns it back into the same C++ error kind."""
    cls = KIND_TO_ERROR.get(kind, errors.BackendError)
    if cls is errors.BackendError:
        kind = _C.ERROR_KIND_BACKEND
    exc = cls(message)
    exc.kvcached_kind = kind
    return exc


# ---- frames --------------------------------------------------------------------


def frame(cmd: int, req_id: int, body: bytes = b"") -> bytes:
    if len(body) > MAX_BODY:
        raise ProtocolError("oversized", f"body of {len(body)} bytes exceeds {MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, cmd, len(body), req_id) + body


def parse_header(buf, max_body: int = MAX_BODY) -> Tuple[int, int, int]:
    """(cmd, body_len, req_id) of a header at the start of ``buf``; ProtocolError if bad."""
    magic, version, cmd, body_len, req_id = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError("malformed", f"bad magic 0x{magic:04x}")
    if version != VERSION:
        raise ProtocolError("version", f"protocol version {version}, this side speaks {VERSION}")
    if body_len > max_body:
        raise ProtocolError("oversized", f"body of {body_len} bytes exceeds {max_body}")
    return cmd, body_len, req_id


# ---- request bodies ------------------------------------------------------------


def offsets_body(group: int, tx: int, offsets: Sequence[int]) -> bytes:
    n = len(offsets)
    if n > MAX_OFFSETS:
        raise errors.InvalidArgumentError(f"{n} offsets in one message exceed the limit of {MAX_OFFSETS}")
    try:
        return _GROUP_TX_N.pack(group, tx, n) + struct.pack(f"<{n}q", *offsets)
    except struct.error as e:
        raise errors.InvalidArgumentError(f"offsets must be 64-bit integers: {e}") from None


def parse_offsets_body(body: bytes) -> Tuple[int, int, List[int]]:
    if len(body) < _GROUP_TX_N.size:
        raise ProtocolError("malformed-body", f"{len(body)} bytes is too short for group, tx, count")
    group, tx, n = _GROUP_TX_N.unpack_from(body)
    if len(body) != _GROUP_TX_N.size + 8 * n:
        raise ProtocolError("malformed-body", f"count {n} does not match a body of {len(body)} bytes")
    return group, tx, list(struct.unpack_from(f"<{n}q", body, _GROUP_TX_N.size))


def group_tx_body(group: int, tx: int) -> bytes:
    return _GROUP_TX.pack(group, tx)


def parse_group_tx_body(body: bytes) -> Tuple[int, int]:
    if len(body) != _GROUP_TX.size:
        raise ProtocolError("malformed-body", f"expected {_GROUP_TX.size} bytes (group, tx), got {len(body)}")
    return _GROUP_TX.unpack(body)


def group_body(group: int) -> bytes:
    return _GROUP.pack(group)


def parse_group_body(body: bytes) -> int:
    if len(body) != _GROUP.size:
        raise ProtocolError("malformed-body", f"expected {_GROUP.size} bytes (group), got {len(body)}")
    return _GROUP.unpack(body)[0]


def expect_empty(body: bytes) -> None:
    if body:
        raise ProtocolError("malformed-body", f"expected an empty body, got {len(body)} bytes")


# ---- reply bodies --------------------------------------------------------------


def hello_reply(rank: int, pp_rank: int, pid: int) -> bytes:
    return _HELLO.pack(rank, pp_rank, pid)


def parse_hello_reply(body: bytes) -> Tuple[int, int, int]:
    if len(body) != _HELLO.size:
        raise ProtocolError("malformed-body", "bad HELLO reply")
    return _HELLO.unpack(body)


def map_reply(newly: int, already: int) -> bytes:
    return _MAP_REPLY.pack(newly, already)


def _unpack_exact(st: struct.Struct, body: bytes, what: str) -> Tuple[int, ...]:
    if len(body) != st.size:
        raise ProtocolError("malformed-body", f"bad {what} reply")
    return st.unpack(body)


def parse_map_reply(body: bytes) -> Tuple[int, int]:
    return _unpack_exact(_MAP_REPLY, body, "MAP")  # type: ignore[return-value]


def u32_reply(n: int) -> bytes:
    return _U32.pack(n)


def parse_u32_reply(body: bytes) -> int:
    return _unpack_exact(_U32, body, "u32")[0]


def u8_reply(v: int) -> bytes:
    return _U8.pack(v)


def parse_u8_reply(body: bytes) -> int:
    return _unpack_exact(_U8, body, "u8")[0]


def error_body(kind: int, message: str) -> bytes:
    return _KIND.pack(kind) + message.encode("utf-8", "replace")[:MAX_MESSAGE]


def parse_error_body(body: bytes) -> Tuple[int, str]:
    if len(body) < _KIND.size:
        raise ProtocolError("malformed-body", "bad ERROR reply")
    return _KIND.unpack_from(body)[0], body[_KIND.size :].decode("utf-8", "replace")


@dataclass
class WorkerState:
    """One worker's view of a KV group, for consistency checks and diagnostics.

    ``mapped_offsets`` lists every offset that is mapped or held by a pending unmap
    transaction. ``units_per_page`` is the number of physical handles one mapped
    offset holds (layers x K/V buffers, or 1 in the contiguous layout).
    """

    created: bool = False
    failed: bool = False
    live_handles: int = 0
    mapped_pages: int = 0
    prepared_pages: int = 0
    pending_transactions: int = 0
    quarantined: int = 0
    units_per_page: int = 0
    mapped_offsets: List[int] = field(default_factory=list)
    failure: str = ""
    # Filled in by the coordinator, not sent:
    rank: int = -1
    pp_rank: int = -1
    reachable: bool = True


# The WorkerState fields _STATE carries, in its order (then the offset count).
_STATE_FIELDS = (
    ("created", bool),
    ("failed", bool),
    ("live_handles", int),
    ("mapped_pages", int),
    ("prepared_pages", int),
    ("pending_transactions", int),
    ("quarantined", int),
    ("units_per_page", int),
)


def encode_state(s: WorkerState) -> bytes:
    n = len(s.mapped_offsets)
    msg = s.failure.encode("utf-8", "replace")[:MAX_MESSAGE]
    head = _STATE.pack(*(int(getattr(s, name)) for name, _ in _STATE_FIELDS), n)
    return head + struct.pack(f"<{n}q", *s.mapped_offsets) + msg


def decode_state(body: bytes) -> WorkerState:
    if len(body) < _STATE.size:
        raise ProtocolError("malformed-body", "bad QUERY reply")
    *values, n = _STATE.unpack_from(body)
    end = _STATE.size + 8 * n
    if len(body) < end:
        raise ProtocolError("malformed-body", "QUERY reply shorter than its offset count")
    return WorkerState(
        **{name: kind(v) for (name, kind), v in zip(_STATE_FIELDS, values)},
        mapped_offsets=list(struct.unpack_from(f"<{n}q", body, _STATE.size)),
        failure=body[end:].decode("utf-8", "replace"),
    )
