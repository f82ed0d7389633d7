"""Instance records against crashes and corruption by the same user (or root):
readers never hang, the owner never dies of its record, and nothing trusts a
field it did not check (docs/SECURITY.md, promises R1-R5).

Every test uses real records in /dev/shm under a unique name prefix and real
processes; corruption is written the way a killed writer or a careless
operator leaves it (raw bytes, no lock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvcached import _C
from kvcached.limits import DeviceBudget, list_records
from limits_helpers import BPP, kvctl, peek, poke, shm_path


def _wait(pred, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.005)


# ---- R1: an odd seqlock word never hangs a reader --------------------------------


def test_a_write_left_half_done_is_completed_by_the_next_reader(prefix, workers):
    """A limit writer killed between its two seq updates (seq odd, lock free):
    readers repair it and the owner applies the limit that is there."""
    w = workers(name=prefix + "odd", pages=16)
    name = w.name
    rev = peek(name, "revision")
    poke(name, seq=peek(name, "seq") + 1, limit=3 * BPP)  # the first half of a write
    r = kvctl("list", "--json", timeout=30)  # a hang would time out here
    assert r.returncode == 0, r.stderr
    row = next(x for x in json.loads(r.stdout) if x["name"] == name)
    assert row["state"] in ("alive", "pending") and not row["busy"] and row["problem"] == ""
    assert peek(name, "seq") % 2 == 0 and peek(name, "revision") == rev + 1
    _wait(lambda: w.call("query")["applied_revision"] == rev + 1, "the owner did not apply the repaired write")
    assert w.call("query")["mem_limit"] == 3 * BPP
    assert kvctl("limit", name, str(2 * BPP)).returncode == 0  # writers go on as before


HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(600)
    """
)


def test_a_stopped_writer_makes_readers_answer_busy_not_hang(prefix, workers):
    """A writer stopped (SIGSTOP) inside its write holds the lock with seq odd:
    every reader answers within its bound with ``busy``, without the GIL held,
    and a writer gives up with a typed error instead of waiting forever."""
    w = workers(name=prefix + "stop", pages=16)
    name = w.name
    assert w.call("alloc", n=2)["ok"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, shm_path(name)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        poke(name, seq=peek(name, "seq") + 1)
        tracker = _C.MemInfoTracker.open(name)
        ticks = []
        done = threading.Event()

        def read_three_times() -> None:
            for _ in range(3):
                assert tracker.snapshot().busy
            done.set()

        t = threading.Thread(target=read_three_times)
        t.start()
        while not done.is_set():  # this thread runs while the other one waits in C++
            ticks.append(1)
            time.sleep(0.001)
        t.join()
        assert len(ticks) >= 30, len(ticks)  # three bounded waits passed with the GIL free
        rec = next(r for r in list_records() if r.name == name)
        assert rec.busy and rec.state == "busy" and rec.held == 2 * BPP  # still counted: its fields are fine
        r = kvctl("list", timeout=30)
        assert r.returncode == 0 and "busy" in r.stdout
        with pytest.raises(_C.BackendError, match="stayed locked by another writer"):
            tracker.set_limit(2 * BPP)
    finally:
        holder.kill()
        holder.wait()
    # The lock is free again, seq still odd: the next reader completes the write.
    assert not _C.MemInfoTracker.open(name).snapshot().busy
    assert peek(name, "seq") % 2 == 0


# ---- R2: fields are validated; an invalid record counts in no budget -------------


GARBAGE = [
    ({"limit": -1}, "limit = -1 is out of range"),
    ({"granted": 1 << 62}, "granted"),
    ({"used": -5}, "used"),
    ({"device_type": 7}, "device type"),
    ({"owner_pid": -3}, "owner pid"),
    ({"version": 99}, "not a kvcached record of version 1"),
    ({"name": b"someone_else"}, "does not match the file name"),
    ({"name": b"\xff\xfe\x80"}, "does not match the file name"),
    ({"engine": b"\x1b[31mred"}, "engine field"),
    ({"engine": b"\xc3\x28"}, "engine field"),
]


@pytest.mark.parametrize("fields,why", GARBAGE, ids=[ascii(sorted(f))[1:-1] for f, _ in GARBAGE])
def test_a_garbage_field_fails_closed_while_its_owner_lives(prefix, fields, why):
    """Its numbers are not trusted: while its owner lives (the owner lock says so,
    whatever owner_pid now says) the budget counts it as holding everything; once
    the owner is gone it is invalid and counts nothing (issue 34, item 9)."""
    name = prefix + "g"
    budget = DeviceBudget("cpu", 8 * BPP, scope=prefix)
    t = _C.MemInfoTracker.create(name, "t", 0, 0, 4 * BPP, 4 * BPP)
    t.set_granted(2 * BPP)
    assert budget.held_bytes() == 2 * BPP
    poke(name, **fields)
    snap = t.snapshot()
    assert why in snap.problem, snap.problem
    assert snap.name == name and snap.engine.isprintable() and snap.engine.isascii()
    rec = next(r for r in list_records() if r.name == name)
    assert rec.state == "damaged" and rec.held == 0 and rec.wants(10.0) == 0
    assert budget.held_bytes() == 8 * BPP and budget.members() == []
    assert [r.name for r in budget.damaged()] == [name]
    r = kvctl("list", timeout=30)
    assert r.returncode == 0 and "damaged while its owner lives" in r.stdout, r.stderr
    rev = peek(name, "revision")
    r = kvctl("limit", name, str(BPP), timeout=30)  # refused: invalid, or (pid -3) dead, or not a record
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert peek(name, "revision") == rev
    with pytest.raises(_C.InvalidArgumentError, match="is invalid"):
        t.set_limit(BPP)  # the data plane refuses too, whatever the caller checked
    if "owner_pid" in fields:
        r = kvctl("cleanup", timeout=30)  # dead by its pid field, alive by its lock: kept
        assert r.returncode == 0 and os.path.exists(shm_path(name)), r.stdout + r.stderr
    del t  # the owner lets go of its lock
    if "owner_pid" in fields or "version" in fields:  # no pid vouches for it any more: invalid, counts nothing
        rec = next(r for r in list_records() if r.name == name)
        assert rec.state == "invalid" and not rec.alive
        assert budget.held_bytes() == 0 and budget.damaged() == []


def test_the_owner_ignores_a_garbage_limit(prefix, workers):
    """limit = -1 (or above the device) written into a live record is not
    applied: the instance stays under its limit and its budget."""
    w = workers(name=prefix + "neg", pages=32, budget_bytes=4 * BPP, scope=prefix, max_reserved=0)
    name = w.name
    before = w.call("query")
    tracker = _C.MemInfoTracker.open(name)
    for bad, said in ((-1, "cannot be trusted"), (1 << 50, "above the usable memory")):
        poke(name, limit=bad, revision=peek(name, "revision") + 1)
        tracker.wake()
        w.wait_stderr(said)  # the watcher read it and said why it ignores it
        q = w.call("query")
        assert (q["mem_limit"], q["limit"], q["applied_revision"]) == (
            before["mem_limit"],
            before["limit"],
            before["applied_revision"],
        )
    assert w.call("alloc", n=4)["ok"] and not w.call("alloc", n=1)["ok"]  # the 4-page budget holds
    assert w.call("query")["mapped"] <= 4


# ---- R3: a truncated record does not kill its owner ---------------------------


def test_truncating_a_live_record_does_not_kill_its_owner(prefix, workers):
    w = workers(name=prefix + "trunc", pages=16)
    name = w.name
    assert w.call("alloc", n=2)["ok"]
    os.truncate(shm_path(name), 0)
    for _ in range(3):  # each alloc/free publishes into the vanished page
        assert w.call("alloc", n=1)["ok"]
        assert w.call("free", n=1)["ok"]
    assert w.proc.poll() is None
    r = kvctl("list", "--json", timeout=30)
    assert r.returncode == 0
    (row,) = [x for x in json.loads(r.stdout) if x["name"] == name]  # listed: its owner lock is held
    assert row["state"] == "damaged" and "no record header" in row["problem"]
    r = kvctl("delete", name, timeout=30)
    assert r.returncode == 2 and "is alive" in r.stderr
    w.exit()  # clean shutdown still works
    assert not os.path.exists(shm_path(name))


def test_a_damaged_live_record_keeps_its_memory_in_the_budget(prefix, workers):
    """Issue 34, item 9: A holds 6 of 8 pages; its record truncated to 0 (or its
    owner_pid scribbled), B used to map 6 more. B now gets nothing until A exits."""
    budget = DeviceBudget("cpu", 8 * BPP, scope=prefix)
    cfg = dict(pages=16, budget_bytes=8 * BPP, scope=prefix, max_reserved=0, quantum_bytes=BPP)
    for damage in ("truncate", "owner_pid"):
        a = workers(name=prefix + "a" + damage[0], **cfg)
        b = workers(name=prefix + "b" + damage[0], **cfg)
        assert a.call("alloc", n=6)["ok"]
        if damage == "truncate":
            os.truncate(shm_path(a.name), 0)
        else:
            poke(a.name, owner_pid=1)  # a live process, but not the owner (its start time differs)
        if damage == "truncate":  # its numbers are gone: it counts as holding everything
            assert [r.name for r in budget.damaged(exclude=b.name)] == [a.name]
        else:  # a plausible pid: still a valid record, alive by its owner lock, counted as it says
            assert [(r.name, r.state) for r in budget.members(exclude=b.name)] == [(a.name, "alive")]
        assert b.call("alloc", n=1)["ok"]  # the quantum B was granted at its start
        assert not b.call("alloc", n=1)["ok"]  # A's 6 pages are not given away
        if damage == "truncate":
            b.wait_stderr("is damaged while its owner lives")
        r = kvctl("cleanup", timeout=30)
        assert r.returncode == 0 and os.path.exists(shm_path(a.name)), r.stdout + r.stderr
        a.kill()
        assert b.call("alloc", n=6)["ok"]  # A's memory went with it (7 of 8 pages now B's)
        b.exit()


def test_a_truncated_record_is_reported_to_a_reader_that_maps_it(prefix):
    name = prefix + "t2"
    t = _C.MemInfoTracker.create(name, "t", 0, 0, BPP, BPP)
    reader = _C.MemInfoTracker.open(name)
    os.truncate(shm_path(name), 0)
    assert "truncated" in reader.snapshot().problem
    t.publish_usage(BPP, 0)  # the owner's store faults, the guard maps a page in its place
    assert "detached" in t.snapshot().problem
    with pytest.raises(_C.InvalidArgumentError, match="is invalid"):
        t.set_limit(BPP)
    del t, reader


def test_a_sigbus_elsewhere_still_kills(prefix):
    """The guard handles only faults inside a record: any other SIGBUS keeps
    its default action (a core dump), even after a record was mapped."""
    code = textwrap.dedent(
        f"""
        import mmap, os, sys
        from kvcached import _C
        t = _C.MemInfoTracker.create({prefix + "sb"!r}, "t", 0, 0, 1, 1)
        t.unlink()
        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096)
        os.ftruncate(fd, 0)
        m[0] = 1
        print("survived")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -7 and "survived" not in r.stdout, (r.returncode, r.stderr)


# ---- R4: names ---------------------------------------------------------------


def test_listing_skips_names_kvcached_never_makes(prefix):
    """A file with the record magic under a non-ASCII or control-character name
    is not a record: no tool decodes it, none fails on it."""
    t = _C.MemInfoTracker.create(prefix + "ok", "t", 0, 0, BPP, BPP)
    raw = open(shm_path(prefix + "ok"), "rb").read()
    odd = [prefix.encode() + b"\xff\xfe", prefix.encode() + b"\x1b[2J"]
    try:
        for n in odd:
            with open(b"/dev/shm/" + n, "wb") as f:
                f.write(raw)
        names = _C.list_mem_info_records()
        assert prefix + "ok" in names and not [n for n in names if not n.isascii() or not n.isprintable()]
        assert DeviceBudget("cpu", 8 * BPP, scope=prefix).held_bytes() == 0
        r = kvctl("list", timeout=30)
        assert r.returncode == 0 and "\x1b" not in r.stdout
    finally:
        for n in odd:
            os.unlink(b"/dev/shm/" + n)
        del t


def test_a_record_made_or_removed_is_listed_at_once_though_listings_are_reused(prefix, tmp_path, monkeypatch):
    """record_names scans /dev/shm again only when the folder changed (the budget asks on
    every grant; a scan opens every file there): a record made or removed moves the
    folder's mtime, so it is seen by the next listing."""
    from kvcached.limits import records

    assert prefix + "new" not in records.record_names()
    t = _C.MemInfoTracker.create(prefix + "new", "t", 0, 0, BPP, BPP)
    assert prefix + "new" in records.record_names()
    t.unlink()
    del t
    assert prefix + "new" not in records.record_names()

    # The reuse itself, on a folder whose mtime the test sets.
    scans = []
    real = _C.list_mem_info_records
    monkeypatch.setattr(records, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(records._C, "list_mem_info_records", lambda: scans.append(1) or real())
    monkeypatch.setattr(records, "_scan", (0, 0, []))
    os.utime(tmp_path, ns=(time.time_ns() - 5_000_000_000,) * 2)  # settled 5 s ago
    records.record_names()
    records.record_names()
    assert len(scans) == 1  # reused
    (tmp_path / "x").write_text("")  # a file made: the mtime moves
    records.record_names()
    assert len(scans) == 2
    records.record_names()
    assert len(scans) == 3  # changed under a second ago: not trusted yet
    os.utime(tmp_path, ns=(time.time_ns() - 5_000_000_000,) * 2)
    records.record_names()
    records.record_names()
    assert len(scans) == 4  # settled again: reused
    mtime, started, names = records._scan
    monkeypatch.setattr(records, "_scan", (mtime, started - 3_000_000_000, names))
    records.record_names()
    assert len(scans) == 5  # a listing older than the rescan bound is not reused


def test_a_fifo_or_link_under_a_record_name_blocks_nothing(prefix):
    os.mkfifo(shm_path(prefix + "fifo"))
    os.symlink("/etc/passwd", shm_path(prefix + "link"))
    try:
        r = kvctl("list", timeout=30)  # opening a FIFO without O_NONBLOCK would hang
        assert r.returncode == 0
        for n, why in ((prefix + "fifo", "not a kvcached record"), (prefix + "link", "symbolic link")):
            with pytest.raises(_C.InvalidArgumentError, match=why):
                _C.MemInfoTracker.open(n)
        r = kvctl("delete", prefix + "link", timeout=30)
        assert r.returncode == 2 and os.path.lexists(shm_path(prefix + "link"))
        t = _C.MemInfoTracker.create(prefix + "fifo", "t", 0, 0, BPP, BPP)  # ours and not a record: replaced
        assert t.snapshot().problem == ""
        del t
    finally:
        for n in ("fifo", "link"):
            if os.path.lexists(shm_path(prefix + n)):
                os.unlink(shm_path(prefix + n))


def test_create_reclaims_what_a_killed_create_left(prefix):
    """create() killed between O_EXCL and the magic leaves an empty or zeroed
    file: the next start under that name must not be refused."""
    for content in (b"", bytes(312)):
        with open(shm_path(prefix + "half"), "wb") as f:
            f.write(content)
        t = _C.MemInfoTracker.create(prefix + "half", "t", 0, 0, BPP, BPP)
        assert t.snapshot().problem == ""
        t.unlink()
        del t


# ---- R5: deletes say what happened ------------------------------------------------


def test_delete_refuses_what_is_not_a_record_and_reports_the_result(prefix):
    path = shm_path(prefix + "plain")
    with open(path, "wb") as f:
        f.write(b"not a record at all")
    r = kvctl("delete", prefix + "plain", timeout=30)
    assert r.returncode == 2 and "not a kvcached record" in r.stderr and os.path.exists(path)
    os.unlink(path)
    t = _C.MemInfoTracker.create(prefix + "d", "t", 0, 0, BPP, BPP)
    r = kvctl("delete", prefix + "d", timeout=30)
    assert r.returncode == 2 and "is alive" in r.stderr  # its owner is this process
    r = kvctl("delete", prefix + "d", "--force", timeout=30)
    assert r.returncode == 0 and not os.path.exists(shm_path(prefix + "d"))
    del t


def test_a_forked_child_does_not_keep_a_killed_owner_alive(prefix):
    """The owner lock is per open file description, which fork shares: the child
    takes a fresh one of its own, so the owner's death still shows at once."""
    name = prefix + "fork"
    code = f"""
import os, sys, time
from kvcached import _C
t = _C.MemInfoTracker.create({name!r}, "t", 0, 0, {BPP}, {BPP})
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    try:
        (rec,) = [r for r in list_records() if r.name == name]
        assert rec.alive and rec.state == "alive"
        owner.kill()
        owner.wait(30)
        (rec,) = [r for r in list_records() if r.name == name]
        assert not rec.alive and rec.state == "dead"  # the child lives on, without the lock
        assert _C.record_owner_locked(name) is False
    finally:
        os.kill(child, signal.SIGKILL)
