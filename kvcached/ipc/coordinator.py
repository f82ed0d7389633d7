"""TPCoordinator: the scheduler side. Fans one map/unmap out to every worker of a
TP group (and every pipeline stage) so that all ranks end in the same state.

Its ``map`` and ``unmap`` are the ``map_fn``/``unmap_fn`` of
``kvcached._C.PageAllocator``: all-or-nothing across ranks, raising the kvcached
error types with ``kvcached_kind`` set so the allocator sees the same kinds as
with a local mapper.

MAP: one MAP message with all offsets and a transaction id to
every rank, sent before any reply is awaited (ranks work in parallel). If any
rank fails, times out or loses its connection, ROLLBACK_MAP(tx) goes to every
rank that mapped or might have: each unmaps exactly what that transaction newly
mapped, or records the transaction as rolled back so a late MAP is refused. The
caller then gets the failing rank's error kind (OutOfMemoryError stays
recoverable) or BackendError for a rank that did not answer.

UNMAP: PREPARE(tx) everywhere (unmap, zero page back, handles
retained). All prepared: COMMIT(tx) everywhere; a COMMIT whose result is
ambiguous is retried (it is idempotent) and never turned into an ABORT, since
some rank may have released already. Any PREPARE failed or unanswered:
ABORT(tx) everywhere; ranks that never saw the PREPARE record the transaction as
aborted, so a late PREPARE is refused. The caller gets the PREPARE's error and
every page is still mapped on every rank.

Fail closed: when a rollback, abort or commit cannot be confirmed within the
recovery time (RECOVERY_FACTOR x KVCACHED_IPC_TIMEOUT) or at all (the rank's
worker process died: its mapping state went with it), or a rank reports
StateConsistencyError, the offsets are quarantined, StateConsistencyError is
raised, and every later map/unmap is refused with a message saying why. Only
``query``/``tx_outcome`` (diagnostics) still work.

Dead ranks (kvcached.ipc.peer): a rank whose worker process is known to have
exited is reported at once ("its worker process (pid N) died"), by the call
that finds it: no reconnect wait, no reply wait, no recovery retries. Only a
live rank, busy or stopped, gets the full timeouts. A request that certainly
did not reach the dead rank (it died between calls) fails like a rank without
listener: BackendError, the others rolled back or aborted. One it may have
reached fails closed, as the dead rank cannot confirm the rollback or abort.

Threading: calls are serialised by one lock (the connections carry one request
per rank at a time). No log line per call: only anomalies are logged.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

from kvcached import trace
from kvcached._C import (
    ERROR_KIND_BACKEND,
    ERROR_KIND_SHUTDOWN,
    ERROR_KIND_STATE_CONSISTENCY,
)
from kvcached.errors import InvalidArgumentError
from kvcached.ipc import paths, protocol, settings
from kvcached.ipc.peer import Closed, Died, Lost, NoReply, Peer
from kvcached.ipc.protocol import Cmd, ProtocolError, WorkerState

log = logging.getLogger("kvcached.ipc")

# Per-rank outcome of one request. UNSENT: could not connect, so the request
# certainly never reached the rank (nothing to undo there, and no late arrival to
# fence off). LOST/TIMEOUT: it may have run; only an idempotent follow-up settles it.
_OK, _ERR, _UNSENT, _LOST, _TIMEOUT = "ok", "error", "unsent", "lost", "timeout"


@dataclass
class _Result:
    status: str
    body: bytes = b""
    kind: int = ERROR_KIND_BACKEND
    detail: str = ""


class TPCoordinator:
    """Map/unmap fan-out to the workers of one instance and KV group.

    ``tp_size`` workers per stage; stages ``range(pp_size)`` when ``pp_rank`` is -1
    (pp_size defaults to KVCACHED_PP_SIZE), else only stage ``pp_rank``.
    Connections are opened on first use and kept; a socket that nobody answered
    on yet is waited for up to LISTENER_WAIT_S (within the request timeout).
    """

    def __init__(
        self,
        tp_size: int,
        pp_size: Optional[int] = None,
        pp_rank: int = -1,
        ipc_name: Optional[str] = None,
        group_id: int = 0,
        timeout: Optional[float] = None,
        recovery_timeout: Optional[float] = None,
    ) -> None:
        if tp_size < 1:
            raise InvalidArgumentError(f"tp_size must be >= 1, got {tp_size}")
        pp_size = settings.pp_size() if pp_size is None else int(pp_size)
        if pp_size < 1 or pp_rank < -1 or pp_rank >= pp_size:
            raise InvalidArgumentError(f"pp_rank {pp_rank} is not -1 or a stage of pp_size {pp_size}")
        self.tp_size = int(tp_size)
        self.pp_size = pp_size
        self.group_id = int(group_id)
        self.ipc_name = settings.ipc_name() if ipc_name is None else ipc_name
        self.timeout = settings.ipc_timeout() if timeout is None else float(timeout)
        self.recovery_timeout = (
            self.timeout * settings.RECOVERY_FACTOR if recovery_timeout is None else float(recovery_timeout)
        )
        stages = range(pp_size) if pp_rank == -1 else [pp_rank]
        self._rid = 0
        listener_wait = min(self.timeout, settings.LISTENER_WAIT_S)
        self._peers = [
            Peer(
                r,
                k,
                paths.socket_path(r, k, self.ipc_name),
                self.timeout,
                settings.ipc_spin_s(),
                self._next_rid,
                listener_wait,
            )
            for k in stages
            for r in range(self.tp_size)
        ]
        self._lock = threading.Lock()
        self._tx_base = secrets.randbits(31) << 32
        self._tx_count = 0
        self._failure: Optional[str] = None
        self._closed = False
        self.quarantined: set = set()
        self.last_tx: Optional[int] = None  # id of the latest map/unmap transaction, for diagnostics
        self._warned: set = set()

    # ---- state -----------------------------------------------------------------

    @property
    def failure(self) -> Optional[str]:
        """Why this coordinator refuses work, or None while it is usable."""
        return self._failure

    def _check_usable(self) -> None:
        if self._closed:
            raise protocol.make_error(ERROR_KIND_SHUTDOWN, f"the TP coordinator of {self.ipc_name!r} is closed")
        if self._failure is not None:
            raise protocol.make_error(
                ERROR_KIND_STATE_CONSISTENCY,
                f"kvcached TP coordinator of {self.ipc_name!r} refuses work (fail closed) since: {self._failure}. "
                "The mapping state of the ranks is not known; restart the engine.",
            )

    def _fail_closed(self, reason: str, offsets: Sequence[int]) -> Exception:
        self._failure = reason
        self.quarantined.update(offsets)
        log.error("kvcached TP coordinator of %r fails closed: %s", self.ipc_name, reason)
        return protocol.make_error(
            ERROR_KIND_STATE_CONSISTENCY,
            f"{reason}; {len(offsets)} offset(s) quarantined, this coordinator refuses further work (fail closed)",
        )

    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _next_tx(self) -> int:
        # Positive and unique per coordinator: random high bits, so a restarted
        # coordinator does not collide with a surviving worker's history.
        self._tx_count += 1
        if self._tx_count >= 1 << 32:
            self._tx_base, self._tx_count = secrets.randbits(31) << 32, 1
        self.last_tx = self._tx_base | self._tx_count
        return self.last_tx

    # ---- fan-out primitives ------------------------------------------------------

    def _fan_out(self, peers: List[Peer], cmd: int, body: bytes, wait: bool = True) -> List[_Result]:
        """Sends one request to every peer, then collects the replies (one timeout for all)."""
        deadline = time.monotonic() + self.timeout
        rid = self._next_rid()
        data = protocol.frame(cmd, rid, body)
        results: List[Optional[_Result]] = [None] * len(peers)
        for i, p in enumerate(peers):
            if p.sock is None:
                try:
                    p.connect(deadline, wait)
                except Lost as e:
                    results[i] = _Result(_UNSENT, detail=str(e))
                    continue
            results[i] = self._send(p, data, deadline, wait)
        for i, p in enumerate(peers):
            if results[i] is None:
                results[i] = self._collect(p, rid, cmd, deadline)
        return results  # type: ignore[return-value]

    @staticmethod
    def _send(p: Peer, data: bytes, deadline: float, wait: bool) -> Optional[_Result]:
        """Sends one request (None: sent). A connection the worker closed while
        idle (it evicts idle ones under pressure, see ipc/listener.py) carried
        nothing: reconnect and send anew."""
        try:
            p.send(data)
            return None
        except Closed:
            pass
        except Lost as e:
            return _Result(_LOST, detail=str(e))
        try:
            p.connect(deadline, wait)
        except Lost as e:
            return _Result(_UNSENT, detail=str(e))
        try:
            p.send(data)
            return None
        except Closed as e:
            return _Result(_UNSENT, detail=str(e))
        except Lost as e:
            return _Result(_LOST, detail=str(e))

    def _collect(self, p: Peer, rid: int, cmd: int, deadline: float) -> _Result:
        try:
            c, body = p.recv(rid, deadline)
        except NoReply:
            return _Result(_TIMEOUT, detail=f"no answer within {self.timeout:g} s (KVCACHED_IPC_TIMEOUT)")
        except Lost as e:
            return _Result(_LOST, detail=str(e))
        if c == protocol.OK | cmd:
            return _Result(_OK, body=body)
        if c == protocol.ERROR:
            try:
                kind, msg = protocol.parse_error_body(body)
            except ProtocolError as e:
                p.close()
                return _Result(_LOST, detail=str(e))
            return _Result(_ERR, kind=kind, detail=msg)
        p.close()
        return _Result(_LOST, detail=f"reply command {c} does not answer command {cmd}")

    def _settle(self, peers: List[Peer], cmd: int, body: bytes) -> Dict[Peer, str]:
        """Brings an idempotent request (ROLLBACK_MAP, ABORT, COMMIT) to every peer,
        resending after each timeout slice and reconnecting after a lost connection,
        until the recovery deadline. Returns peer -> why it is not confirmed."""
        deadline = time.monotonic() + self.recovery_timeout
        rid = self._next_rid()
        data = protocol.frame(cmd, rid, body)  # same id on resends: any answer counts
        pending: Dict[Peer, bool] = {}
        failures: Dict[Peer, str] = {}
        for p in peers:
            try:
                if p.sock is None:
                    p.connect(min(deadline, time.monotonic() + self.timeout))
                p.send(data)
                pending[p] = True
            except Died as e:
                failures[p] = str(e)  # a dead process cannot confirm anything: no retries
            except Lost:
                pending[p] = False
        # Collect where the request went out first: a dead rank's reconnect loop
        # must not eat the time in which the others' answers are read.
        for p in sorted((q for q in peers if q not in failures), key=lambda q: not pending[q]):
            while True:
                try:
                    if not pending[p]:
                        if p.sock is None:
                            p.connect(deadline)
                        p.send(data)
                        pending[p] = True
                    c, reply = p.recv(rid, min(deadline, time.monotonic() + self.timeout))
                except NoReply:
                    if time.monotonic() >= deadline:
                        failures[p] = f"no answer within {self.recovery_timeout:g} s"
                        break
                    pending[p] = False  # resend on the same connection
                    continue
                except Died as e:
                    failures[p] = str(e)
                    break
                except Lost as e:
                    if time.monotonic() >= deadline:
                        failures[p] = f"unreachable for {self.recovery_timeout:g} s ({e})"
                        break
                    pending[p] = False
                    time.sleep(0.005)
                    continue
                if c == protocol.ERROR:
                    try:
                        kind, msg = protocol.parse_error_body(reply)
                        failures[p] = msg
                    except ProtocolError as e:
                        failures[p] = str(e)
                elif c != protocol.OK | cmd:
                    failures[p] = f"reply command {c} does not answer command {cmd}"
                break
        return failures

    @staticmethod
    def _describe(pairs) -> str:
        return "; ".join(f"{p.name}: {r.detail if isinstance(r, _Result) else r}" for p, r in pairs)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[int]:
        """An operation's start: the lock held (until the block ends), the group usable,
        a new transaction id."""
        with self._lock:
            self._check_usable()
            yield self._next_tx()

    # ---- operations --------------------------------------------------------------

    def map(self, offsets: Sequence[int]) -> None:
        """Maps ``offsets`` on every rank, or on none (see the module docstring)."""
        offsets = list(offsets)
        if not offsets:
            return
        t0 = trace.start()
        with self._transaction() as tx:
            results, bad = self._offsets_to_all(Cmd.MAP, tx, offsets)
            if not bad:
                self._note_already_mapped(results)
                trace.end("rank_map", t0, self.ipc_name, pages=len(offsets), ranks=len(self._peers))
                return
            # Ranks that mapped, or may have: undo exactly this transaction there.
            # A rank that answered with an error was rolled back by its data plane.
            undo = [p for p, r in zip(self._peers, results) if r.status in (_OK, _LOST, _TIMEOUT)]
            unconfirmed = (
                self._settle(undo, Cmd.ROLLBACK_MAP, protocol.group_tx_body(self.group_id, tx)) if undo else {}
            )
            what = f"MAP of {len(offsets)} offset(s) failed on {self._describe(bad)}"
            self._raise_undone(
                what, bad, unconfirmed, offsets, "rollback", "rolled back on every rank, none of the offsets is mapped"
            )

    def unmap(self, offsets: Sequence[int]) -> None:
        """Unmaps ``offsets`` on every rank in two phases, or on none."""
        offsets = list(offsets)
        if not offsets:
            return
        t0 = trace.start()
        with self._transaction() as tx:
            txb = protocol.group_tx_body(self.group_id, tx)
            results, bad = self._offsets_to_all(Cmd.PREPARE, tx, offsets)
            if not bad:
                unconfirmed = self._settle(self._peers, Cmd.COMMIT, txb)
                trace.end("rank_unmap", t0, self.ipc_name, pages=len(offsets), ranks=len(self._peers))
                if unconfirmed:
                    raise self._fail_closed(
                        f"COMMIT of unmap transaction {tx} ({len(offsets)} offset(s)) not confirmed on "
                        f"{self._describe(unconfirmed.items())}; retried, never aborted (other ranks released)",
                        offsets,
                    )
                return
            # Every rank the PREPARE may have reached, including those that did not
            # answer: they record the transaction as aborted, so a late PREPARE
            # cannot reopen it.
            reached = [p for p, r in zip(self._peers, results) if r.status != _UNSENT]
            unconfirmed = self._settle(reached, Cmd.ABORT, txb)
            what = f"UNMAP (PREPARE of transaction {tx}, {len(offsets)} offset(s)) failed on {self._describe(bad)}"
            self._raise_undone(
                what, bad, unconfirmed, offsets, "ABORT", "aborted on every rank, every offset is still mapped"
            )

    def _offsets_to_all(
        self, cmd: int, tx: int, offsets: List[int]
    ) -> Tuple[List[_Result], List[Tuple[Peer, _Result]]]:
        """``cmd`` of transaction ``tx`` for ``offsets`` sent to every rank: each rank's
        answer, and the (rank, answer) pairs that are not OK."""
        results = self._fan_out(self._peers, cmd, protocol.offsets_body(self.group_id, tx, offsets))
        return results, [(p, r) for p, r in zip(self._peers, results) if r.status != _OK]

    def _raise_undone(
        self,
        what: str,
        bad: List[Tuple[Peer, _Result]],
        unconfirmed: Dict[Peer, str],
        offsets: List[int],
        undo: str,
        outcome: str,
    ) -> NoReturn:
        """After a failed MAP / UNMAP and its undo (``undo``: the step that undid it): fail
        closed where the undo is not confirmed everywhere or a rank's state is unknown;
        else the first rank's error kind, with ``outcome`` (every rank as before)."""
        if unconfirmed or any(r.status == _ERR and r.kind == ERROR_KIND_STATE_CONSISTENCY for _, r in bad):
            raise self._fail_closed(
                f"{what}; {undo} not confirmed on {self._describe(unconfirmed.items()) or 'n/a'}", offsets
            )
        kind = next((r.kind for _, r in bad if r.status == _ERR), ERROR_KIND_BACKEND)
        raise protocol.make_error(kind, f"{what}; {outcome}")

    def _note_already_mapped(self, results: List[_Result]) -> None:
        for p, r in zip(self._peers, results):
            _, already = protocol.parse_map_reply(r.body)
            if already and p.name not in self._warned:
                self._warned.add(p.name)  # once per rank: the ledger disagreed, now converged
                log.warning(
                    "kvcached IPC: %s already had %d of the offsets mapped (the scheduler's ledger "
                    "considered them free); all ranks map them now. Logged once per rank.",
                    p.name,
                    already,
                )

    def kv_tensors_created(self) -> bool:
        """True when every worker is reachable and has created the group's KV tensors.
        Does not wait for workers that are not listening yet."""
        with self._lock:
            if self._closed:
                return False
            results = self._fan_out(self._peers, Cmd.KV_CREATED, protocol.group_body(self.group_id), wait=False)
        return all(r.status == _OK and protocol.parse_u8_reply(r.body) == 1 for r in results)

    def _ask_all(self, cmd: int, body: bytes) -> List[Tuple[Peer, bytes]]:
        with self._lock:
            if self._closed:
                self._check_usable()
            results = self._fan_out(self._peers, cmd, body)
        bad = [(p, r) for p, r in zip(self._peers, results) if r.status != _OK]
        if bad:
            kind = next((r.kind for _, r in bad if r.status == _ERR), ERROR_KIND_BACKEND)
            raise protocol.make_error(kind, f"{Cmd(cmd).name} failed on {self._describe(bad)}")
        return [(p, r.body) for p, r in zip(self._peers, results)]

    def query(self) -> List[WorkerState]:
        """Every rank's view of the group, for checks and diagnosis; works after fail
        closed. A rank that does not answer is listed with ``reachable=False`` and
        the reason in ``failure``."""
        with self._lock:
            if self._closed:
                self._check_usable()
            results = self._fan_out(self._peers, Cmd.QUERY, protocol.group_body(self.group_id))
        out = []
        for p, r in zip(self._peers, results):
            if r.status == _OK:
                s = protocol.decode_state(r.body)
            else:
                s = WorkerState(reachable=False, failure=r.detail)
            s.rank, s.pp_rank = p.rank, p.pp_rank
            out.append(s)
        return out

    def tx_outcome(self, tx: int) -> List[str]:
        """Every rank's recorded outcome of unmap transaction ``tx``."""
        return [
            protocol.OUTCOMES[protocol.parse_u8_reply(b)]
            for _, b in self._ask_all(Cmd.TX_OUTCOME, protocol.group_tx_body(self.group_id, tx))
        ]

    def ping(self) -> None:
        """One empty round trip to every rank (connects first if needed)."""
        self._ask_all(Cmd.PING, b"")

    def close(self) -> None:
        """Closes the connections; later map/unmap raise ShutdownError."""
        with self._lock:
            self._closed = True
            for p in self._peers:
                p.release()

    def __enter__(self) -> TPCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
