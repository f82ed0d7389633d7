"""What a worker does for each request: the kvcached data-plane calls of this
process, plus the transaction bookkeeping that makes requests safe to repeat
and to roll back.

MAP transactions: the coordinator tags every MAP with a transaction id. The
worker remembers, per (group, tx), the offsets that MAP newly mapped, so a
ROLLBACK_MAP undoes exactly those (never pages that were mapped before). A
ROLLBACK_MAP that arrives before its MAP (reordered over a new connection, or the
MAP never arrived) is recorded as rolled back and the late MAP is refused, so a
rolled-back transaction can never map pages afterwards. The history is bounded
(MAP_HISTORY entries, oldest dropped first), like the unmap transaction history
in the data plane which serves PREPARE/COMMIT/ABORT.

Extension point: the offsets of a request need not be the data plane's own.
The vLLM worker (``integration/vllm/worker_executor.py``) serves logical pages
that each cover several physical pages, some shared by two logical pages. Such
an executor overrides only the page hooks (``map_pages``, ``unmap_pages``,
``stage_unmap``, ``commit_unmap``, ``abort_unmap``): which data-plane offsets a
request touches and which of them may really be mapped or unmapped now. The
bookkeeping here (history, statuses, idempotent repeats, exact rollback, the
record of prepared unmaps that an ABORT gives back) is the same for every
executor. Hooks run under the executor's lock, one at a time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from kvcached import _C, vmm_ops
from kvcached.errors import InvalidArgumentError
from kvcached.ipc.protocol import OUTCOMES, WorkerState

log = logging.getLogger("kvcached.ipc")

MAP_HISTORY = 4096

# What the MAP history holds per (group, tx): the offsets it newly mapped, or
# one of these statuses. A FAILED MAP changed nothing, so a retry runs again.
_ROLLED_BACK = "rolled back"
_FAILED = "failed"


_warned_leak = False


def _note_leaks() -> None:
    """Logs once per process when KV memory could not be released (a failed
    driver call): QUERY reports it per group, shutdown retries it."""
    global _warned_leak
    if not _warned_leak and _C.quarantined_bytes():
        _warned_leak = True
        log.warning(
            "kvcached worker (pid %d): %d bytes of KV memory could not be released (a failed driver call); "
            "they stay allocated until shutdown retries them",
            os.getpid(),
            _C.quarantined_bytes(),
        )


class VmmExecutor:
    """Runs requests against this process's KV tensors (vmm_ops). Thread-safe.

    The page hooks below are the identity: a request's offsets are the data
    plane's, and the data plane knows which are mapped."""

    def __init__(self, history: int = MAP_HISTORY) -> None:
        self._lock = threading.Lock()  # check-then-act on the history must be atomic
        self._maps: OrderedDict[Tuple[int, int], Union[List[int], str]] = OrderedDict()
        self._history = history
        # Prepared unmaps whose stage_unmap returned something to give back on
        # ABORT: (group, tx) -> (sorted offsets, what stage_unmap returned).
        self._staged: Dict[Tuple[int, int], Tuple[List[int], Any]] = {}

    # ---- page hooks (the extension point) ------------------------------------------

    def map_pages(self, group: int, offsets: Sequence[int]) -> Tuple[List[int], int]:
        """Maps what ``offsets`` need, all or nothing; returns (the offsets this call
        newly mapped, how many were mapped already). Raises with nothing changed."""
        newly, already = vmm_ops.map_to_kv_tensors_with_result(offsets, group)
        return list(newly), len(already)

    def unmap_pages(self, group: int, offsets: Sequence[int]) -> None:
        """Undoes one ``map_pages``: ``offsets`` are what it newly mapped (ROLLBACK_MAP).
        Raises with nothing changed if it cannot."""
        vmm_ops.unmap_from_kv_tensors(offsets, group)

    def stage_unmap(self, group: int, tx: int, offsets: Sequence[int]) -> Optional[Any]:
        """Phase one of unmapping ``offsets`` under ``tx`` (the data plane keeps the
        handles). Returns what ``abort_unmap`` needs to give the pages back, or None
        when the data plane alone holds that state (then repeated PREPAREs reach it)."""
        vmm_ops.prepare_unmap_from_kv_tensors(tx, offsets, group)
        return None

    def commit_unmap(self, group: int, tx: int) -> None:
        """Phase two: the data plane releases what ``tx`` prepared. Repeats are no-ops."""
        vmm_ops.commit_unmap_from_kv_tensors(tx, group)

    def abort_unmap(self, group: int, tx: int, staged: Optional[Any]) -> None:
        """Undoes phase one; ``staged`` is what ``stage_unmap`` returned (None if nothing
        or unknown)."""
        vmm_ops.abort_unmap_from_kv_tensors(tx, group)

    # ---- requests --------------------------------------------------------------------

    def _remember(self, key: Tuple[int, int], value: Union[List[int], str]) -> None:
        self._maps[key] = value
        self._maps.move_to_end(key)
        while len(self._maps) > self._history:
            self._maps.popitem(last=False)

    def map(self, group: int, tx: int, offsets: Sequence[int]) -> Tuple[int, int]:
        """Maps ``offsets`` (all or nothing); returns (newly mapped, already mapped).
        Already-mapped offsets are accepted so a retried MAP converges."""
        key = (group, tx)
        with self._lock:
            prev = self._maps.get(key)
            if prev == _ROLLED_BACK:
                raise InvalidArgumentError(f"map transaction {tx} was rolled back; a late MAP is refused")
            if isinstance(prev, list):
                return len(prev), len(offsets) - len(prev)  # repeated MAP: already done
            try:
                newly, already = self.map_pages(group, offsets)
            except Exception:
                self._remember(key, _FAILED)  # the hook changed nothing
                raise
            self._remember(key, newly)
            return len(newly), already

    def rollback_map(self, group: int, tx: int) -> int:
        """Unmaps what MAP ``tx`` newly mapped; returns how many offsets. Idempotent."""
        key = (group, tx)
        with self._lock:
            prev = self._maps.get(key)
            if isinstance(prev, list) and prev:
                self.unmap_pages(group, prev)  # raises if it cannot; then state is kept
            self._remember(key, _ROLLED_BACK)
        _note_leaks()
        return len(prev) if isinstance(prev, list) else 0

    def prepare(self, group: int, tx: int, offsets: Sequence[int]) -> None:
        key = (group, tx)
        with self._lock:
            held = self._staged.get(key)
            if held is not None:
                if held[0] != sorted(int(o) for o in offsets):
                    raise InvalidArgumentError(f"transaction {tx} is already prepared with other offsets")
                return  # a repeated PREPARE
            staged = self.stage_unmap(group, tx, offsets)
            if staged is not None:
                self._staged[key] = (sorted(int(o) for o in offsets), staged)

    def commit(self, group: int, tx: int) -> None:
        with self._lock:
            self.commit_unmap(group, tx)
            self._staged.pop((group, tx), None)
        _note_leaks()

    def abort(self, group: int, tx: int) -> None:
        key = (group, tx)
        with self._lock:
            held = self._staged.get(key)
            self.abort_unmap(group, tx, None if held is None else held[1])
            self._staged.pop(key, None)

    def tx_outcome(self, group: int, tx: int) -> int:
        return OUTCOMES.index(vmm_ops.unmap_transaction_outcome(tx, group))

    def kv_created(self, group: int) -> bool:
        return vmm_ops.kv_tensors_created(group)

    def query(self, group: int) -> WorkerState:
        if not vmm_ops.kv_tensors_created(group):
            return WorkerState(created=False)
        info = vmm_ops.group_info(group)
        backend = _C.backend_info(_C.config()["device"])
        units = 1 if info["contiguous_layout"] else info["num_layers"] * info["num_kv_buffers"]
        return WorkerState(
            created=True,
            failed=bool(info["failed"]),
            live_handles=backend["live_handles"],
            mapped_pages=info["mapped_pages"],
            prepared_pages=info["prepared_pages"],
            pending_transactions=info["pending_transactions"],
            quarantined=info["quarantined"],
            units_per_page=units,
            mapped_offsets=list(_C.mapped_offsets(group)),
            failure=info["failure"],
        )


class NullExecutor(VmmExecutor):
    """Answers every request without touching memory: the bookkeeping of a real
    worker with page hooks that do nothing. For measuring the IPC path alone
    (``python -m kvcached.bench ipc``); never use it in an engine."""

    def map_pages(self, group: int, offsets: Sequence[int]) -> Tuple[List[int], int]:
        return list(offsets), 0

    def unmap_pages(self, group: int, offsets: Sequence[int]) -> None:
        return None

    def stage_unmap(self, group: int, tx: int, offsets: Sequence[int]) -> Optional[Any]:
        return None

    def commit_unmap(self, group: int, tx: int) -> None:
        return None

    def abort_unmap(self, group: int, tx: int, staged: Optional[Any]) -> None:
        return None

    def tx_outcome(self, group: int, tx: int) -> int:
        return 0

    def kv_created(self, group: int) -> bool:
        return True

    def query(self, group: int) -> WorkerState:
        return WorkerState(created=True)
