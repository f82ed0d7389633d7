"""TransferHolds (kvcached.elastic.transfers): the release fence's accounting of offload copies.

A block an in-flight copy job reads or writes is never handed back to the ledger
(so its page cannot empty and be unmapped) until every worker reported the job
finished; a job that never finishes keeps it forever and is named once."""

from __future__ import annotations

import logging

from kvcached.elastic.transfers import TransferHolds


def test_free_of_a_held_block_waits_for_every_worker():
    h = TransferHolds()
    h.begin(7, [3, 4, 5], workers=2, kind="store")
    assert h.defer([3, 9]) == [9]  # 9 is not held: to the ledger now
    assert h.freed_while_held() == {3}
    assert h.finished(7, 1) == []  # one of two workers
    assert h.held(3) and h.in_flight == 1
    assert h.finished(7, 1) == [3]  # the last worker: the freed block goes now
    assert not h.held(3) and not h.held(4) and h.in_flight == 0
    assert h.defer([4, 5]) == [4, 5]  # never freed while held: straight through later


def test_aggregated_counts_and_overlapping_jobs():
    h = TransferHolds()
    h.begin(1, [10, 11], workers=4)
    h.begin(2, [11, 12], workers=4)
    assert h.defer([10, 11, 12]) == []
    assert h.finished(1, 4) == [10]  # 11 is still read by job 2
    assert h.finished(2, 3) == []
    assert h.finished(2, 1) == [11, 12]
    assert h.stats.jobs_done == 2 and h.stats.deferred_frees == 3


def test_null_block_and_unknown_jobs_are_ignored():
    h = TransferHolds()
    h.begin(1, [0, 2])
    assert not h.held(0) and h.held(2)
    assert h.finished(99, 1) == []  # built before the holds were attached (or stale): nothing to end
    h.begin(1, [2, 3])  # the same job again: one hold
    assert h.finished(1) == [] and not h.held(2) and not h.held(3)


def test_finished_request_blocks_are_held_until_its_last_jobs_are_built():
    h = TransferHolds()
    h.hold_until_built([5, 6])  # the request ended; vLLM freed its blocks at once
    assert h.defer([5, 6]) == []
    h.begin(3, [6], workers=1, kind="store")  # its last store, built at the next schedule
    assert h.built() == [5]  # 5 got no job: free now; 6 waits for the store
    assert h.finished(3) == [6]


def test_a_job_that_never_finishes_keeps_its_blocks_and_is_named_once(caplog):
    h = TransferHolds(timeout_s=5.0, name="inst")
    h.begin(1, [8], kind="store")
    h.begin(2, [9], kind="load")
    assert h.defer([8, 9]) == []
    t0 = h._jobs[1].since
    assert h.overdue(t0 + 1) == []
    with caplog.at_level(logging.ERROR, logger="kvcached.elastic"):
        assert h.overdue(t0 + 6) == [1, 2]
        assert h.overdue(t0 + 7) == [1, 2]  # still late, not named again
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "store job 1" in errors[0].getMessage() and "mapped" in errors[0].getMessage()
    assert h.held(8) and h.held(9) and h.stats.overdue == 2  # fail closed: nothing is freed
    assert h.finished(1) == [8]  # a late finish still releases


def test_timeout_zero_never_reports():
    h = TransferHolds(timeout_s=0)
    h.begin(1, [1])
    assert h.overdue(1e12) == []
