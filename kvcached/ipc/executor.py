"""What a worker does for each request: the kvcached data-plane calls of this
process, plus the history that makes MAP transactions safe to roll back.

MAP transactions: the coordinator tags every MAP with a transaction id. The
worker remembers, per (group, tx), the offsets that MAP newly mapped, so a
ROLLBACK_MAP undoes exactly those (never pages that were mapped before). A
ROLLBACK_MAP that arrives before its MAP (reordered over a new connection, or the
MAP never arrived) is recorded as rolled back and the late MAP is refused, so a
rolled-back transaction can never map pages afterwards. The history is bounded
(MAP_HISTORY entries, oldest dropped first), like the unmap transaction history
in the data plane which serves PREPARE/COMMIT/ABORT.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Sequence, Tuple, Union

from kvcached import _C, vmm_ops
from kvcached.errors import InvalidArgumentError
from kvcached.ipc.protocol import OUTCOMES, WorkerState

MAP_HISTORY = 4096

_ROLLED_BACK = "rolled back"
_FAILED = "failed"


class VmmExecutor:
    """Runs requests against this process's KV tensors (vmm_ops). Thread-safe."""

    def __init__(self, history: int = MAP_HISTORY) -> None:
        self._lock = threading.Lock()  # MAP/ROLLBACK_MAP check-then-act must be atomic
        self._maps: "OrderedDict[Tuple[int, int], Union[List[int], str]]" = OrderedDict()
        self._history = history

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
                newly, already = vmm_ops.map_to_kv_tensors_with_result(offsets, group)
            except Exception:
                self._remember(key, _FAILED)  # the data plane rolled this call back
                raise
            self._remember(key, list(newly))
            return len(newly), len(already)

    def rollback_map(self, group: int, tx: int) -> int:
        """Unmaps what MAP ``tx`` newly mapped; returns how many offsets. Idempotent."""
        key = (group, tx)
        with self._lock:
            prev = self._maps.get(key)
            if isinstance(prev, list) and prev:
                vmm_ops.unmap_from_kv_tensors(prev, group)  # raises if it cannot; then state is kept
            self._remember(key, _ROLLED_BACK)
            return len(prev) if isinstance(prev, list) else 0

    def prepare(self, group: int, tx: int, offsets: Sequence[int]) -> None:
        vmm_ops.prepare_unmap_from_kv_tensors(tx, offsets, group)

    def commit(self, group: int, tx: int) -> None:
        vmm_ops.commit_unmap_from_kv_tensors(tx, group)

    def abort(self, group: int, tx: int) -> None:
        vmm_ops.abort_unmap_from_kv_tensors(tx, group)

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
    """Answers every request without touching memory. For measuring the IPC path
    alone (``python -m kvcached.bench ipc``); never use it in an engine."""

    def map(self, group: int, tx: int, offsets: Sequence[int]) -> Tuple[int, int]:
        return len(offsets), 0

    def rollback_map(self, group: int, tx: int) -> int:
        return 0

    def prepare(self, group: int, tx: int, offsets: Sequence[int]) -> None:
        return None

    def commit(self, group: int, tx: int) -> None:
        return None

    def abort(self, group: int, tx: int) -> None:
        return None

    def tx_outcome(self, group: int, tx: int) -> int:
        return 0

    def kv_created(self, group: int) -> bool:
        return True

    def query(self, group: int) -> WorkerState:
        return WorkerState(created=True)
