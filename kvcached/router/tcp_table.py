"""The kernel's TCP sockets on this host, looked up by port: who listens, and the far end
of a connection (uid and inode of each), for ``kvcached.router.peer_check``.

Two ways, same answers: the sock_diag netlink interface (what ``ss`` uses), which
finds one connection by its addresses and lists only the listeners of one port,
so its cost does not grow with the host's connections; and /proc/net/tcp{,6},
which the kernel prints whole on every read (22 ms per read with 2,700 sockets,
most of them TIME_WAIT of the router's own past requests, on the 2-core test
machine). /proc is used only where sock_diag is missing (a kernel without
``inet_diag``).
"""

from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

ESTABLISHED, SYN_RECV, TIME_WAIT, LISTEN = 0x01, 0x03, 0x06, 0x0A
PROC_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# A listener on one of these takes connections to 127.0.0.1 (a v6-only "::" does not,
# but neither way tells, so it counts: refusing then is the safe side).
WILDCARDS = ("0.0.0.0", "::")

Address = Tuple[str, int]


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket; IPv4-mapped IPv6 addresses (a dual-stack socket's IPv4 peers) as IPv4."""

    local: Address
    remote: Address
    state: int
    uid: int  # who created its listener, or accepted it; 0 for SYN_RECV and TIME_WAIT in sock_diag
    inode: int  # 0: no process has it as an fd yet (e.g. queued for accept)


def _ip(family: int, raw: bytes) -> str:
    if family == socket.AF_INET6 and raw[:12] == b"\0" * 10 + b"\xff\xff":  # ::ffff:a.b.c.d
        return socket.inet_ntop(socket.AF_INET, raw[12:16])
    return socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw[:16])


def listening_for(sockets: Sequence[TcpSocket], port: int, host: str) -> List[TcpSocket]:
    """Those of ``sockets`` listening on ``port`` that take connections to ``host``."""
    return [s for s in sockets if s.state == LISTEN and s.local[1] == port and s.local[0] in (host, *WILDCARDS)]


# -- sock_diag (netlink) -------------------------------------------------------
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
DIAG_MSG = struct.Struct("=BBBB4s16s16s12xIIIII")  # family, state, timer, retrans, ports, src, dst, if+cookie, ...
NO_COOKIE = b"\xff" * 8  # INET_DIAG_NOCOOKIE: look the socket up by its addresses alone


class DiagUnavailable(OSError):
    """This kernel has no sock_diag for TCP."""


def _diag_request(family: int, states: int, local: Address, remote: Address, dump: bool) -> bytes:
    def raw(ip: str) -> bytes:
        return socket.inet_pton(family, ip).ljust(16, b"\0")

    sockid = struct.pack(">HH", local[1], remote[1]) + raw(local[0]) + raw(remote[0]) + b"\0" * 4 + NO_COOKIE
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, states) + sockid
    flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body


def _diag(family: int, states: int, local: Address, remote: Address, dump: bool) -> List[TcpSocket]:
    """One sock_diag query: the sockets it answers (an exact lookup that finds none: [])."""
    found: List[TcpSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as nl:
        nl.sendall(_diag_request(family, states, local, remote, dump))
        while True:
            data = nl.recv(65536)
            off = 0
            while off + NLMSG_HDR.size <= len(data):
                length, kind = NLMSG_HDR.unpack_from(data, off)[:2]
                payload = data[off + NLMSG_HDR.size : off + length]
                off += (length + 3) & ~3
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", payload)[0]
                    if err == 0 or (err == errno.ENOENT and not dump):
                        return found  # an exact lookup that found nothing
                    raise DiagUnavailable(err, f"sock_diag: {errno.errorcode.get(err, err)}")
                fam, state, _, _, ports, src, dst, _, _, _, uid, inode = DIAG_MSG.unpack_from(payload)
                sport, dport = struct.unpack(">HH", ports)
                found.append(TcpSocket((_ip(fam, src), sport), (_ip(fam, dst), dport), state, uid, inode))
            if not dump:
                return found


def diag_listeners(port: int) -> List[TcpSocket]:
    """Every socket listening on ``port`` (IPv4 and IPv6); only the listening table is walked."""
    out = []
    for family, any_ip in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        out += _diag(family, 1 << LISTEN, (any_ip, port), (any_ip, 0), dump=True)
    return [s for s in out if s.local[1] == port]


def diag_far_end(here: Address, peer: Address) -> Optional[TcpSocket]:
    """The socket at the other end of our IPv4 connection ``here`` -> ``peer``: the one whose
    local address is ``peer`` and remote ``here`` (None when it is gone). The kernel falls
    back to the listener when no connection matches, hence the check of the addresses."""
    for s in _diag(socket.AF_INET, 0xFFFFFFFF, peer, here, dump=False):
        if s.local == peer and s.remote == here and s.state != LISTEN:
            return s
    return None


# -- /proc/net/tcp -------------------------------------------------------------
def _proc_address(field: bytes) -> Address:
    """``0100007F:1F90`` (IPv4) or 32 hex digits (IPv6: four host-order words) and a port."""
    hexaddr, _, hexport = field.partition(b":")
    raw = bytes.fromhex(hexaddr.decode())
    if len(raw) == 4:
        return _ip(socket.AF_INET, raw[::-1]), int(hexport, 16)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return _ip(socket.AF_INET6, raw), int(hexport, 16)


def proc_sockets(port: int, tables: Sequence[str] = PROC_TABLES) -> List[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) with ``port`` at either end, from /proc."""
    needle = b":%04X " % port  # only the address fields hold ':', 4 hex digits and a blank
    found = []
    for path in tables:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in data.split(b"\n")[1:]:
            if needle in line:
                f = line.split()
                found.append(TcpSocket(_proc_address(f[1]), _proc_address(f[2]), int(f[3], 16), int(f[7]), int(f[9])))
    return found


# -- the way this host answers ---------------------------------------------------
_use_diag: Optional[bool] = None


def _diag_works() -> bool:
    global _use_diag
    if _use_diag is None:
        try:
            diag_listeners(1)
            _use_diag = True
        except OSError:  # no netlink, or no inet_diag/tcp_diag in this kernel
            _use_diag = False
    return _use_diag


def listeners(port: int, host: str = "127.0.0.1") -> List[TcpSocket]:
    """The sockets listening on ``port`` that take connections to ``host``."""
    table = diag_listeners(port) if _diag_works() else proc_sockets(port)
    return listening_for(table, port, host)


def far_end(here: Address, peer: Address) -> Optional[TcpSocket]:
    """The socket at the other end of our connection ``here`` -> ``peer`` (None: gone)."""
    if _diag_works():
        return diag_far_end(here, peer)
    for s in proc_sockets(peer[1]):
        if s.local == peer and s.remote == here and s.state != LISTEN:
            return s
    return None
