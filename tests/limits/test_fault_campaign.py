"""Fault campaign: kill -9 limit writers and mapping owners at random points,
over and over, and check after each kill what docs/SECURITY.md promises (C1):
readers answer (bounded), the budget adds up, no record is left busy or
invalid, a live owner still applies limit writes, and a new instance starts
under the same name.

Deterministic enough for CI: a fixed seed picks the kinds of kill and the
delays; every wait has a generous bound that only a hang can reach. About
20-40 s on two cores (the number of rounds is CAMPAIGN_ROUNDS)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest

from kvcached import _C
from kvcached.limits import DeviceBudget, list_records
from limits_helpers import BPP, WORKER, Worker, kvctl, remove_records, unique_prefix

pytestmark = pytest.mark.slow

CAMPAIGN_ROUNDS = 36
SEED = 20261203
PAGES = 16
BUDGET = 10 * BPP
READER_BOUND_S = 20.0  # a reader that takes this long is hung (the design bound is 50 ms per busy record)

WRITER = """
import random, sys
from kvcached import _C
t = _C.MemInfoTracker.open(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
while True:
    try:
        t.set_limit(rng.randint(1, int(sys.argv[3])))
    except _C.KvcachedError:
        pass
"""


def bounded(fn, what: str):
    """fn() in a thread; fails the test if it does not return within READER_BOUND_S."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn()), daemon=True)
    t.start()
    t.join(READER_BOUND_S)
    assert not t.is_alive(), f"{what} did not answer within {READER_BOUND_S} s"
    return box["v"]


def test_kill_9_at_random_points(tmp_path):
    prefix = unique_prefix()
    name = prefix + "inst"
    cfg = dict(name=name, pages=PAGES, budget_bytes=BUDGET, scope=prefix, max_reserved=2, min_reserved=1)
    budget = DeviceBudget("cpu", BUDGET, scope=prefix)
    rng = random.Random(SEED)
    kinds = {"writer": 0, "owner": 0, "owner-start": 0}
    owner = Worker(**cfg)
    t0 = time.monotonic()
    try:
        for rnd in range(CAMPAIGN_ROUNDS):
            kind = rng.choice(["writer", "writer", "owner", "owner-start"])
            kinds[kind] += 1
            if kind == "writer":
                p = subprocess.Popen(
                    [sys.executable, "-c", WRITER, name, str(rnd), str(BUDGET)], stdout=subprocess.PIPE, text=True
                )
                assert p.stdout.readline().strip() == "ready"
                time.sleep(rng.uniform(0, 0.03))
                p.kill()
                p.wait()
            elif kind == "owner":
                owner.send("churn", seconds=5, seed=rnd, max_pages=PAGES)
                time.sleep(rng.uniform(0, 0.2))
                owner.kill()
                owner = Worker(**cfg)  # the dead owner's record is reclaimed
            else:  # killed while it starts: creating its record, attaching, taking its first grant
                owner.kill()
                p = subprocess.Popen([sys.executable, WORKER, json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
                time.sleep(rng.uniform(0, 0.25))
                p.kill()
                p.wait()
                p.stdout.close()
                owner = Worker(**cfg)
            check(rnd, kind, name, prefix, budget, owner)
        elapsed = time.monotonic() - t0
        print(f"fault campaign: {CAMPAIGN_ROUNDS} kills {kinds} in {elapsed:.1f} s")
    finally:
        owner.kill()
        remove_records(prefix)


def check(rnd: int, kind: str, name: str, prefix: str, budget: DeviceBudget, owner: Worker) -> None:
    where = f"round {rnd} ({kind})"
    recs = [r for r in bounded(list_records, "list_records") if r.name.startswith(prefix)]
    for r in recs:
        assert r.valid and not r.busy, (where, r.name, r.problem, r.busy)
    live = [r for r in recs if r.alive]
    assert [r.name for r in live] == [name], (where, [(r.name, r.state) for r in recs])
    sample = bounded(budget.sample, "the budget")
    assert sample.mapped <= sample.budget and sample.held <= sample.budget, (where, sample)
    # The owner applies a write made now (after whatever the kill left behind).
    tracker = _C.MemInfoTracker.open(name)
    rev = bounded(lambda: tracker.set_limit(BUDGET), "a limit write")
    end = time.monotonic() + READER_BOUND_S
    while bounded(tracker.snapshot, "a snapshot").applied_revision != rev:
        assert time.monotonic() < end, f"{where}: the owner did not apply revision {rev}"
        time.sleep(0.002)
    assert owner.call("query")["mem_limit"] <= BUDGET
    if rnd % 12 == 11:  # the operator's view, as a separate process
        r = kvctl("list", "--json", timeout=READER_BOUND_S)
        assert r.returncode == 0 and name in r.stdout, r.stderr
