"""Another local user against one user's instances (docs/SECURITY.md, promises
U1-U4): what they plant in /dev/shm is never trusted, cannot keep an instance
from starting, and cannot change a limit. Runs as root, acting as two
unprivileged uids with no passwd entry (a forked interpreter that drops to
them after importing what it needs); skips elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvcached.limits import DeviceBudget, list_records
from limits_helpers import BPP, Worker, peek, remove_records, shm_path, unique_prefix

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other uids")

ATTACKER, VICTIM = 64001, 64002

# Imports first: the interpreter's own files may not be readable by the new uid.
PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    from kvcached import _C
    from kvcached.cli import kvctl, table, args
    from kvcached.limits import DeviceBudget, InstanceLimits, list_records
    from kvcached.limits import budget, owned_record, records, user_lock
    from kvcached import units
    import kvcached.control, kvcached.elastic.cleanup, kvcached.ipc.paths, argparse, gettext, locale, secrets, glob
    kvctl.build_parser()  # argparse loads its translations lazily
    uid = int(sys.argv[1])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    arg = json.loads(sys.argv[2])
    """
)


def as_uid(uid: int, body: str, arg: object = None, wait: bool = True):
    """Runs ``body`` (after PRELUDE) as ``uid``; returns its last stdout line as
    JSON, or the Popen when not ``wait`` (it prints 'ready' first)."""
    cmd = [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(uid), json.dumps(arg)]
    if not wait:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert line.strip() == "ready", p.stderr.read()
        return p
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def prefix():
    p = unique_prefix()
    yield p
    remove_records(p)
    for lock in DeviceBudget("cpu", 1, scope=p).lock_paths:
        if os.path.lexists(lock):
            os.unlink(lock)


# A live record of the attacker with a 1 TiB grant, readable by everyone.
PLANT = """
t = _C.MemInfoTracker.create(arg["name"], "vllm", 0, 0, 1 << 40, 1 << 40)
t.set_granted(1 << 40)
t.set_wanted(1 << 40)
os.chmod("/dev/shm/" + arg["name"], 0o644)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_planted_record_counts_in_no_budget_of_another_user(prefix):
    attacker = as_uid(ATTACKER, PLANT, {"name": prefix + "fake"}, wait=False)
    try:
        # Root sees it, and counts it nowhere (it is not root's).
        budget = DeviceBudget("cpu", 8 * BPP, scope=prefix)
        rec = next(r for r in list_records() if r.name == prefix + "fake")
        assert rec.owner_uid == ATTACKER and rec.alive
        assert budget.held_bytes() == 0 and budget.wanting() == []
        # An unprivileged victim sees it as invalid; its instances get their budget.
        out = as_uid(
            VICTIM,
            """
            b = DeviceBudget("cpu", 8 * 262144, scope=arg["prefix"])
            rows = {r.name: (r.state, r.problem) for r in list_records()}
            pa = _C.PageAllocator(2, 32 * 65536, 65536, 2)
            _C.init_kvcached("cpu", 65536, False)
            _C.create_kv_tensors(32 * 65536, 2, 2, 0)
            lim = InstanceLimits.for_page_allocator(pa, engine="t", device="cpu", name=arg["prefix"] + "v", budget=b)
            lim.admit_pages(6)
            ids = pa.alloc_pages(6)
            text = table.records_table(list_records())
            print(json.dumps({"rows": rows, "held": b.held_bytes(exclude=lim.name), "got": len(ids), "text": text}))
            lim.close()
            """,
            {"prefix": prefix},
        )
        state, problem = out["rows"][prefix + "fake"]
        assert state == "invalid" and "another user" in problem
        assert out["held"] == 0 and out["got"] == 6
        assert "invalid, ignored by budgets" in out["text"]
    finally:
        attacker.kill()
        attacker.wait()


SQUAT = """
for p in arg["paths"]:
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
print(json.dumps("done"))
"""


def _lock_stem(prefix: str, uid: int = 0) -> str:
    """The budget lock's plain name (less ``.lock``) for ``uid`` (names carry the uid)."""
    return DeviceBudget("cpu", 1, scope=prefix).lock_path[: -len(".lock")].replace("-u0-", f"-u{uid}-")


def _lock_names(prefix: str, uid: int = 0):
    """The plain budget lock name and the ones an attacker would guess (the four
    fixed names older versions used, and more)."""
    stem = _lock_stem(prefix, uid)
    return [stem + ".lock"] + [f"{stem}.{k}.lock" for k in range(1, 9)]


def test_names_squatted_by_another_user_do_not_stop_an_instance(prefix, caplog):
    """The record name and every lock name one could guess are another user's
    files: the instance starts under a suffixed name, and the budget lock takes
    a random name (issue 34, item 10: all four fixed names squatted stopped it)."""
    guessed = _lock_names(prefix)
    as_uid(ATTACKER, SQUAT, {"paths": [shm_path(prefix + "victim")] + guessed})
    w = Worker(name=prefix + "victim", pages=16, budget_bytes=8 * BPP, scope=prefix)
    try:
        name = w.ready["name"]
        assert name.startswith(prefix + "victim.") and len(name) == len(prefix + "victim") + 9
        w.wait_stderr("is taken by a file of uid 64001")
        assert w.call("alloc", n=4)["ok"]  # the budget lock was taken: the grant grew under it
        assert peek(name, "used") == 4 * BPP
    finally:
        w.kill()
    ours = [p for p in DeviceBudget("cpu", 1, scope=prefix).lock_paths if os.lstat(p).st_uid == 0]
    assert len(ours) == 1 and ours[0] not in guessed


HOLD = """
b = DeviceBudget("cpu", 8 * 262144, scope=arg["prefix"])
with b.lock():
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_every_lock_name_squatted_still_excludes(prefix):
    """With the guessable names squatted, one holder of the budget lock still
    keeps every other out (another process of the victim waits, then times
    out), and more squatting while it holds the lock changes nothing."""
    as_uid(ATTACKER, SQUAT, {"paths": _lock_names(prefix, VICTIM)})
    holder = as_uid(VICTIM, HOLD, {"prefix": prefix}, wait=False)
    try:
        stem = _lock_stem(prefix, VICTIM)
        as_uid(ATTACKER, SQUAT, {"paths": [f"{stem}.x{k}.lock" for k in range(4)]})
        out = as_uid(
            VICTIM,
            """
            lock = user_lock.UserLock(DeviceBudget("cpu", 1, scope=arg["prefix"]).lock_path, wait_s=0.5)
            try:
                lock.release(lock.acquire())
                print(json.dumps("acquired"))
            except TimeoutError as e:
                print(json.dumps(str(e)))
            """,
            {"prefix": prefix},
        )
        assert "stayed locked" in out
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    victims = [
        p
        for p in os.listdir("/dev/shm")
        if p.startswith(os.path.basename(stem)) and os.lstat(shm_path(p)).st_uid == VICTIM
    ]
    assert len(victims) == 1
    for p in os.listdir("/dev/shm"):  # the fixture removes root's lock files only
        if p.startswith(os.path.basename(stem) + "."):
            os.unlink(shm_path(p))


def test_another_users_record_cannot_be_deleted_and_is_not_cleaned_up(prefix):
    attacker = as_uid(ATTACKER, PLANT, {"name": prefix + "theirs"}, wait=False)
    try:
        out = as_uid(
            VICTIM,
            """
            rc = kvctl.main(["delete", arg["name"], "--force"])
            failed = {}
            deleted = kvcached.elastic.cleanup.cleanup_dead_instances(arg["prefix"], failed=failed)
            print(json.dumps({"rc": rc, "deleted": deleted, "failed": failed}))
            """,
            {"name": prefix + "theirs", "prefix": prefix},
        )
        assert out == {"rc": 2, "deleted": [], "failed": {}}
        assert os.path.exists(shm_path(prefix + "theirs"))
    finally:
        attacker.kill()
        attacker.wait()
    # Its owner is dead now: root's cleanup removes it, and says so.
    failed: dict = {}
    from kvcached.elastic.cleanup import cleanup_dead_instances

    assert cleanup_dead_instances(prefix, failed=failed) == [prefix + "theirs"] and failed == {}


def test_a_record_chowned_to_another_user_gives_them_no_control(prefix):
    """Root hands a live instance's record to another uid by mistake: that uid
    can now write the file, but the owner no longer trusts what it says."""
    w = Worker(name=prefix + "mine", pages=16)
    try:
        before = w.call("query")
        os.chown(shm_path(w.name), ATTACKER, -1)
        out = as_uid(
            ATTACKER,
            """
            t = _C.MemInfoTracker.open(arg["name"])
            print(json.dumps({"rev": t.set_limit(262144)}))
            """,
            {"name": w.name},
        )
        assert out["rev"] == before["applied_revision"] + 1  # the write itself went through
        w.wait_stderr("cannot be trusted")
        q = w.call("query")
        assert q["mem_limit"] == before["mem_limit"] and q["applied_revision"] == before["applied_revision"]
        assert w.call("alloc", n=8)["ok"]  # still under its own limit, not the written 1 page
    finally:
        w.kill()
