"""TransferHolds: blocks an engine's own copy jobs (KV offload to host memory) still read or write.

The release fence (``fence.py``) orders physical release after the engine's
*steps*. An offload tier copies blocks outside the steps: vLLM's offloading
connector submits a store at the start of the step after the one that wrote the
blocks and lets it run for as long as it takes, across later steps; it reports
the job finished (per worker) in some later step's output. vLLM frees a finished
request's blocks at once and only flushes a pending store when one of its blocks
is handed out again, so without more a page could empty, pass the fence and be
unmapped while a store still copies it (the host tier would then hold zeros).

A hold closes that gap at the one place a page can empty: the block ledger's
free. Every job's blocks are *held* from the moment the job is built until every
worker has reported it finished; a block the engine frees while held does not
go back to the ledger (its page stays mapped, the block cannot be handed out
again), it is kept here and handed to the ledger when its last hold ends. The
page then empties as usual and the fence releases it after the steps that
follow. Blocks a finished request leaves for a store that is built one step
later are held from the request's end until then (``hold_until_built``).

Fail closed: a job that never finishes keeps its blocks (and their pages)
forever; ``overdue()`` names jobs older than ``timeout_s`` once each, with one
error line, so a stuck copy shows as memory that does not come back, never as
a page unmapped under a copy. Engine-neutral: the adapters feed it job ids and
block ids.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Optional, Set

logger = logging.getLogger("kvcached.elastic")

# A job not finished after this long is reported (once); its blocks stay held.
DEFAULT_TIMEOUT_S = 120.0


@dataclass
class _Job:
    kind: str
    blocks: List[int]
    pending: int  # workers that have not reported it finished
    since: float
    reported: bool = False


@dataclass
class TransferStats:
    jobs_begun: int = 0
    jobs_done: int = 0
    deferred_frees: int = 0  # blocks the engine freed while a job held them
    overdue: int = 0
    kinds: Counter = field(default_factory=Counter)


class TransferHolds:
    """Holds on ledger blocks by in-flight copy jobs; frees of held blocks wait for the last hold."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "") -> None:
        self.timeout_s = float(timeout_s)
        self.name = name
        self._jobs: Dict[Hashable, _Job] = {}
        self._count: Counter = Counter()  # block -> holds on it
        self._freed: Set[int] = set()  # held blocks the engine already freed
        self._until_built: List[int] = []  # blocks held until the next jobs are built
        self.stats = TransferStats()

    # ---------------------------------------------------------- questions

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def held(self, block: int) -> bool:
        return self._count[block] > 0 if block in self._count else False

    def held_blocks(self) -> Set[int]:
        return {b for b, n in self._count.items() if n > 0}

    @property
    def freed_count(self) -> int:
        """How many blocks ``freed_while_held`` holds (no copy: asked every scheduler step)."""
        return len(self._freed)

    def freed_while_held(self) -> Set[int]:
        """Blocks freed by the engine, waiting for their holds to end (not in the ledger)."""
        return set(self._freed)

    # ------------------------------------------------------------- holds

    def _hold(self, blocks: Iterable[int]) -> List[int]:
        out = [int(b) for b in blocks if int(b) > 0]  # block 0: the null block, never freed
        for b in out:
            self._count[b] += 1
        return out

    def _unhold(self, blocks: Iterable[int]) -> List[int]:
        """Ends one hold on each block; returns the freed blocks that are free now."""
        ready = []
        for b in blocks:
            n = self._count[b] - 1
            if n > 0:
                self._count[b] = n
                continue
            del self._count[b]
            if b in self._freed:
                self._freed.discard(b)
                ready.append(b)
        return ready

    def begin(self, job_id: Hashable, blocks: Iterable[int], workers: int = 1, kind: str = "copy") -> None:
        """A job that reads or writes ``blocks`` was built; ``workers`` must each report it finished."""
        if job_id in self._jobs:
            return  # the same job seen again (a re-sent metadata): one hold is enough
        held = self._hold(blocks)
        self._jobs[job_id] = _Job(kind, held, max(1, int(workers)), time.monotonic())
        self.stats.jobs_begun += 1
        self.stats.kinds[kind] += 1

    def finished(self, job_id: Hashable, count: int = 1) -> List[int]:
        """``count`` workers report ``job_id`` finished. Returns the blocks whose
        free waited for it and that are free now (hand them to the ledger).
        A job never begun (built before holds were attached) is ignored."""
        job = self._jobs.get(job_id)
        if job is None:
            return []
        job.pending -= max(1, int(count))
        if job.pending > 0:
            return []
        del self._jobs[job_id]
        self.stats.jobs_done += 1
        if job.reported:
            logger.warning(
                "kvcached: %s: %s job %s finished after %.1f s; its %d blocks are released now",
                self.name,
                job.kind,
                job_id,
                time.monotonic() - job.since,
                len(job.blocks),
            )
        return self._unhold(job.blocks)

    def hold_until_built(self, blocks: Iterable[int]) -> None:
        """Blocks a finished request leaves behind, which its last jobs (built at
        the next ``built()``) may still read."""
        self._until_built.extend(self._hold(blocks))

    def built(self) -> List[int]:
        """The jobs of a step were built (and begun): the blocks held until now
        are covered by their own jobs. Returns the blocks free now."""
        blocks, self._until_built = self._until_built, []
        return self._unhold(blocks)

    # -------------------------------------------------------------- frees

    def defer(self, blocks: Iterable[int]) -> List[int]:
        """The engine frees ``blocks``: returns those that may go to the ledger
        now; held ones wait (``finished`` / ``built`` return them later)."""
        free = []
        count = self._count
        for b in blocks:
            if b in count:
                self._freed.add(b)
                self.stats.deferred_frees += 1
            else:
                free.append(b)
        return free

    # ------------------------------------------------------------ failures

    def overdue(self, now: Optional[float] = None) -> List[Hashable]:
        """Jobs older than ``timeout_s`` (each named once, in one error line):
        their blocks stay held and their pages mapped (fail closed)."""
        if not self._jobs or self.timeout_s <= 0:
            return []
        t = time.monotonic() if now is None else now
        late = []
        for jid, job in self._jobs.items():  # oldest first (insertion order)
            if t - job.since < self.timeout_s:
                break
            late.append(jid)
            if not job.reported:
                job.reported = True
                self.stats.overdue += 1
                logger.error(
                    "kvcached: %s: %s job %s has not finished after %.0f s (KVCACHED_TRANSFER_TIMEOUT); "
                    "its %d blocks stay held and their pages mapped until it does (never unmapped under a copy)",
                    self.name,
                    job.kind,
                    jid,
                    t - job.since,
                    len(job.blocks),
                )
        return late
