"""UserLock (kvcached/limits/user_lock.py) across processes: mutual exclusion
from a cold start (no lock file yet: every process may try to create one at
once), with the plain name taken, and with names added while it is held."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets

import pytest

from kvcached.limits.user_lock import UserLock

ROUNDS = 200


@pytest.fixture
def base():
    stem = f"/dev/shm/kvt-lock-{secrets.token_hex(4)}"
    yield stem + ".lock"
    for n in os.listdir("/dev/shm"):
        if n.startswith(os.path.basename(stem) + "."):
            os.unlink(os.path.join("/dev/shm", n))


def _count(base: str, counter: str, start: mp.Event) -> None:
    """Read-modify-write of a counter file under the lock, ROUNDS times."""
    lock = UserLock(base, wait_s=60)
    start.wait()
    for _ in range(ROUNDS):
        fds = lock.acquire()
        try:
            with open(counter) as f:
                n = int(f.read() or 0)
            with open(counter, "w") as f:
                f.write(str(n + 1))
        finally:
            lock.release(fds)


def _race(base: str, tmp_path, procs: int = 4) -> int:
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx = mp.get_context("fork")
    start = ctx.Event()
    ps = [ctx.Process(target=_count, args=(base, str(counter), start)) for _ in range(procs)]
    for p in ps:
        p.start()
    start.set()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    return int(counter.read_text())


def test_processes_starting_cold_exclude_each_other(base, tmp_path):
    assert _race(base, tmp_path) == 4 * ROUNDS
    assert UserLock(base).paths == [base]  # the plain name, made once


def test_with_the_plain_name_not_a_regular_file_a_random_name_is_made_once(base, tmp_path):
    # Not a file the lock can take (another user's file behaves the same: tests/limits/test_security_users.py).
    os.mkdir(base)
    try:
        assert _race(base, tmp_path) == 4 * ROUNDS
        made = [p for p in UserLock(base).paths if p != base]
        assert len(made) >= 1 and all(os.path.isfile(p) for p in made)
    finally:
        os.rmdir(base)


def test_a_file_added_while_held_is_taken_by_the_next_holder_too(base):
    first = UserLock(base, wait_s=0.2)
    fds = first.acquire()
    try:
        extra = base[: -len(".lock")] + ".extra.lock"
        open(extra, "w").close()
        with pytest.raises(TimeoutError, match="stayed locked"):
            UserLock(base, wait_s=0.2).acquire()  # waits on the plain file, held by `first`
    finally:
        first.release(fds)
    second = UserLock(base, wait_s=0.2).acquire()
    try:
        assert len(second) == 2  # both files
        with pytest.raises(TimeoutError):
            UserLock(base, wait_s=0.2).acquire()
    finally:
        UserLock.release(second)


def test_a_hard_link_under_a_second_name_is_locked_once(base):
    lock = UserLock(base, wait_s=0.5)
    lock.release(lock.acquire())
    os.link(base, base[: -len(".lock")] + ".1.lock")
    fds = lock.acquire()  # a second flock of the same file would wait for the first, then time out
    try:
        assert len(fds) == 1
    finally:
        lock.release(fds)
