"""Borrowing device memory for a process that is not an engine (kvcached.borrowing,
``kvctl borrow``), across real processes on the host backend: the "engines" are
tests/helpers/limits_worker.py (an allocator + InstanceLimits) and tests/borrowing/borrow_engine.py
(the elastic runtime with a prefix cache); the borrower is this process or a job
process. Every budget is scoped to the test's unique prefix."""

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

import kvcached
from kvcached import _C
from kvcached.borrowing import AllocRetry, reserve
from kvcached.borrowing.torch_retry import tried_bytes
from kvcached.cli import kvctl as kvctl_mod
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.limits import DeviceBudget
from limits_helpers import BPP, Worker, kvctl, kvctl_list_json

pytestmark = pytest.mark.slow
ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "borrow_engine.py")  # run as a script
ENGINE_BPP = 256 << 10  # tests/borrowing/borrow_engine.py: bytes of budget per page


@pytest.fixture
def procs():
    made = []

    def track(p):
        made.append(p)
        return p

    yield track
    for p in made:
        if isinstance(p, (Worker, Engine)):
            p.kill()
        elif p.poll() is None:
            p.kill()
            p.wait(10)


class Engine:
    """tests/borrowing/borrow_engine.py in a child process."""

    def __init__(self, **cfg) -> None:
        self.name = cfg["name"]
        self.proc = subprocess.Popen(
            [sys.executable, ENGINE, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.ready = json.loads(line)["ready"]

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def poll(self):
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stderr(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(10)
        return self.proc.stderr.read()


def held(budget: DeviceBudget, name: str) -> int:
    return next((r.held for r in budget.members() if r.name == name), 0)


def until(cond, what: str, timeout: float = 30.0):
    """Waits for ``cond()`` (a generous bound on a loaded 2-core box, not a timing check)."""
    end = time.monotonic() + timeout
    while not (v := cond()):
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.01)
    return v


JOB = textwrap.dedent(
    """
    import json, sys
    from kvcached.borrowing import reserve
    from kvcached.limits import DeviceBudget
    cfg = json.loads(sys.argv[1])
    b = DeviceBudget("cpu", cfg["budget"], scope=cfg["scope"])
    r = reserve(
        cfg["n"], budget=b, name=cfg["name"], timeout_s=cfg.get("timeout", 30), priority=cfg.get("priority", False)
    )
    print(json.dumps({"nbytes": r.nbytes, "lowered": r.lowered}), flush=True)
    sys.stdin.readline()  # held until told (or killed)
    r.release()
    """
)


def start_job(**cfg) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", JOB, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---- what engines give ------------------------------------------------------------------


def test_a_borrow_takes_unused_grant_and_reserve_and_engines_cannot_grow_into_it(prefix, procs):
    budget_bytes = 24 * BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    cfg = dict(pages=32, budget_bytes=budget_bytes, scope=prefix, min_reserved=2, max_reserved=4, quantum_bytes=8 * BPP)
    a = procs(Worker(name=prefix + "a", **cfg))
    b = procs(Worker(name=prefix + "b", **cfg))
    assert a.call("alloc", n=10)["ok"] and b.call("alloc", n=6)["ok"]
    a.call("free", n=8)  # a maps 2 pages in use plus its reserve, and holds a grant beyond them
    assert held(budget, a.name) > 2 * BPP and held(budget, b.name) > 6 * BPP
    want = budget_bytes - 8 * BPP  # all but the pages in use: every reserve page and grant beyond must come back
    r = reserve(want, budget=budget, name=prefix + "job", timeout_s=30)
    assert r.nbytes == want
    rec = r.record()
    assert rec.engine == "job" and rec.granted == want and rec.held == want and rec.wanted == 0
    # They gave back grant and reserve: the sum holds, with the borrow inside it.
    s = budget.sample()
    assert s.held <= budget_bytes and held(budget, r.name) == want
    qa, qb = a.call("query"), b.call("query")
    assert qa["reserved"] == 0 and qb["reserved"] == 0  # the mapped reserve was unmapped
    assert (qa["inuse"], qb["inuse"]) == (2, 6) and (qa["mapped"], qb["mapped"]) == (2, 6)
    # While it is held, neither grows into it.
    assert not a.call("alloc", n=12)["ok"] and not b.call("alloc", n=12)["ok"]
    assert budget.sample().held <= budget_bytes
    row = {x["name"]: x for x in kvctl_list_json()}[r.name]
    assert row["engine"] == "job" and row["held"] == want and row["state"] == "alive"
    assert r.name in kvctl("list").stdout  # the table too (HELD column)
    # Nobody applies a limit there: kvctl limit refuses a borrower, and writes nothing.
    rev = r.record().revision
    for args in (["limit", r.name, "1M"], ["limit-percent", r.name, "10"]):
        out = kvctl(*args)
        assert out.returncode == 2 and "is a borrower (engine job)" in out.stderr, out.stderr
    assert r.record().revision == rev
    r.release()
    assert r.nbytes == 0 and r.released and _C.list_mem_info_records().count(r.name) == 0
    # Released: they grow again (b's first miss asks a for the slack its quantum took).
    assert a.call("alloc", n=12)["ok"]
    until(lambda: b.call("alloc", n=2)["ok"], "b grows once a gave its slack back")


def test_a_borrow_gets_an_idle_engine_prefix_cache(prefix, procs):
    budget_bytes = 40 * ENGINE_BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    e = procs(Engine(name=prefix + "e", scope=prefix, budget_bytes=budget_bytes))
    assert e.call("cache", pages=30)["mapped"] >= 30  # idle, its prefix cache fills most of the budget
    want = 30 * ENGINE_BPP
    with kvcached.borrow(want, budget=budget, name=prefix + "job", timeout_s=30) as r:
        assert r.nbytes == want
        q = e.call("query")
        assert q["cached"] == 0 and q["give_backs"] >= 1 and q["given_pages"] > 0
        assert (q["mapped"] * ENGINE_BPP) + want <= budget_bytes
        assert not e.call("cache", pages=12)["ok"]  # cannot grow back into it
    assert e.call("cache", pages=12)["ok"]  # and can once it is given back
    give_backs = e.call("query")["give_backs"]
    log = e.stderr()
    lines = [x for x in log.splitlines() if "gave back" in x and "mapped pages (wanted by a peer)" in x]
    assert len(lines) == give_backs >= 1, log  # one line per give-back: how much and why


def test_a_borrow_waits_for_a_busy_engine_to_free_and_keeps_what_it_gathered(prefix, procs):
    budget_bytes = 24 * BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=budget_bytes, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=20)["ok"]  # pages held by "running requests": a want does not move them
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=reserve(16 * BPP, budget=budget, name=prefix + "job", timeout_s=60))
    )
    t.start()
    # It gathers what the budget has free, so the engine cannot take it back...
    until(lambda: held(budget, prefix + "job") >= 4 * BPP, "the borrower holds the free pages")
    w.call("free", n=6)  # a request finishes; its grant goes back when the borrower's want asks
    until(lambda: held(budget, prefix + "job") >= 10 * BPP, "the borrower holds what was freed")
    assert not w.call("alloc", n=6)["ok"]
    # ...and takes the rest as the engine frees (requests finish).
    w.call("free", n=6)
    t.join(60)
    assert out["r"].nbytes == 16 * BPP
    out["r"].release()


# ---- failures ------------------------------------------------------------------------------


def test_timeout_raises_naming_the_holders_or_returns_what_could_be_had(prefix, procs):
    budget_bytes = 16 * BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=budget_bytes, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=10)["ok"]
    with pytest.raises(OutOfMemoryError) as e:
        reserve(12 * BPP, budget=budget, name=prefix + "job", timeout_s=0.3)
    msg = str(e.value)
    assert "\n" not in msg and "could not borrow 3.00M of cpu within 0.3 s" in msg and w.name in msg, msg
    # Nothing left half-held: no record, no want, the engine grows.
    assert prefix + "job" not in _C.list_mem_info_records() and budget.wanting() == []
    assert w.call("alloc", n=6)["ok"]
    w.call("free", n=6)
    r = reserve(12 * BPP, budget=budget, name=prefix + "job", timeout_s=0.3, on_short="partial")
    assert r.nbytes == 6 * BPP and r.requested == 6 * BPP and not r.released
    assert r.record().limit == 6 * BPP and not w.call("alloc", n=1)["ok"]
    r.release()
    # Nothing to be had at all: an empty, released handle.
    assert w.call("alloc", n=6)["ok"]
    r = reserve(BPP, budget=budget, name=prefix + "job", timeout_s=0, on_short="partial")
    assert r.nbytes == 0 and r.released and prefix + "job" not in _C.list_mem_info_records()


def test_a_killed_engine_frees_its_share_for_a_waiting_borrow(prefix, procs):
    budget_bytes = 16 * BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=budget_bytes, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=14)["ok"]
    job = procs(start_job(budget=budget_bytes, scope=prefix, n=12 * BPP, name=prefix + "job", timeout=60))
    until(lambda: held(budget, prefix + "job") > 0, "the job holds what is free")
    os.kill(w.pid, signal.SIGKILL)  # the engine dies meanwhile: its record counts 0
    assert json.loads(job.stdout.readline())["nbytes"] == 12 * BPP
    job.stdin.write("\n")
    job.stdin.flush()
    assert job.wait(30) == 0


def test_a_borrower_killed_with_sigkill_gives_its_share_back(prefix, procs):
    budget_bytes = 16 * BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=budget_bytes, scope=prefix, max_reserved=0))
    job = procs(start_job(budget=budget_bytes, scope=prefix, n=14 * BPP, name=prefix + "job"))
    assert json.loads(job.stdout.readline())["nbytes"] == 14 * BPP
    assert held(budget, prefix + "job") == 14 * BPP and not w.call("alloc", n=4)["ok"]
    job.kill()
    job.wait(10)
    # Counted 0 at once (its owner lock went with it), listed dead, removed by cleanup.
    assert held(budget, prefix + "job") == 0 and budget.sample().held <= 2 * BPP
    assert w.call("alloc", n=14)["ok"]
    row = {x["name"]: x for x in kvctl_list_json()}[prefix + "job"]
    assert row["state"] == "dead" and row["held"] == 0 and row["engine"] == "job"
    r = kvctl("cleanup", "--prefix", prefix + "job", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"] == [prefix + "job"]


BAD = [
    (dict(nbytes=0), "nbytes must be >= 1"),
    (dict(nbytes=-5), "nbytes must be >= 1"),
    (dict(nbytes=True), "got bool"),
    (dict(nbytes=1.5), "got float"),
    (dict(nbytes="1G"), "got str"),
    (dict(nbytes=1 << 70), "64-bit"),
    (dict(nbytes=17 * BPP), "more than the whole budget of cpu (4.00M)"),
    (dict(nbytes=BPP, timeout_s=-1), "timeout_s must be in [0, 86400]"),
    (dict(nbytes=BPP, timeout_s=float("nan")), "timeout_s"),
    (dict(nbytes=BPP, timeout_s=True), "timeout_s must be a number"),
    (dict(nbytes=BPP, on_short="some"), "on_short must be 'raise' or 'partial'"),
    (dict(nbytes=BPP, priority=1), "priority must be True or False"),
    (dict(nbytes=BPP, name="bad/name"), "invalid"),
    (dict(nbytes=BPP, device="cuda:0"), "not the budget's device"),
]


@pytest.mark.parametrize("kw, why", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_one_line_and_changes_nothing(prefix, kw, why):
    budget = DeviceBudget("cpu", 16 * BPP, scope=prefix)
    before = sorted(_C.list_mem_info_records())
    kw = {"name": prefix + "job", "budget": budget, **kw}
    with pytest.raises(InvalidArgumentError, match=None) as e:
        reserve(**kw)
    assert why in str(e.value) and "\n" not in str(e.value), e.value
    assert not [n for n in _C.list_mem_info_records() if n.startswith(prefix) and n not in before]


def test_an_unknown_device_and_a_live_name_are_refused(prefix, procs):
    for dev in ("cuda:7", "tpu", -1):
        with pytest.raises(InvalidArgumentError) as e:
            reserve(BPP, dev, name=prefix + "job")
        assert "\n" not in str(e.value)
    w = procs(Worker(name=prefix + "w", pages=8))
    before = _C.MemInfoTracker.open(w.name).snapshot()
    with pytest.raises(InvalidArgumentError, match="live process"):
        reserve(BPP, budget=DeviceBudget("cpu", 16 * BPP, scope=prefix), name=w.name)
    after = _C.MemInfoTracker.open(w.name).snapshot()
    assert (after.owner_pid, after.engine, after.revision, after.granted) == (
        before.owner_pid,
        before.engine,
        before.revision,
        before.granted,
    )


def test_two_borrows_of_one_process_get_their_own_records(prefix):
    budget = DeviceBudget("cpu", 16 * BPP, scope="kvcached_job_")
    with kvcached.borrow(BPP, budget=budget) as a, kvcached.borrow(BPP, budget=budget) as b:
        assert a.name == f"kvcached_job_{os.getpid()}" and b.name == f"kvcached_job_{os.getpid()}_2"
    assert not [n for n in _C.list_mem_info_records() if n.startswith(f"kvcached_job_{os.getpid()}")]


def test_an_exception_while_waiting_leaves_nothing_held(prefix, procs, monkeypatch):
    budget = DeviceBudget("cpu", 16 * BPP, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=16 * BPP, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=8)["ok"]
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(budget, "nudge", interrupted)
    with pytest.raises(KeyboardInterrupt):
        reserve(12 * BPP, budget=budget, name=prefix + "job", timeout_s=60)
    assert prefix + "job" not in _C.list_mem_info_records() and w.call("alloc", n=8)["ok"]


# ---- priority: running requests make room ----------------------------------------------------


def test_priority_lowers_limits_preempts_and_restores_them(prefix, procs):
    budget_bytes = 40 * ENGINE_BPP
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    e = procs(Engine(name=prefix + "e", scope=prefix, budget_bytes=budget_bytes))
    original = e.ready["limit"]
    for _ in range(3):
        assert e.call("run", pages=10)["ok"]  # three running requests, no cache: a want moves nothing
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=reserve(24 * ENGINE_BPP, budget=budget, name=prefix + "job", timeout_s=60, priority=True)
        )
    )
    t.start()
    until(lambda: e.call("query")["limit"] < original, "the engine's limit is lowered")
    while t.is_alive():  # the engine decodes; over its limit it preempts, as vLLM does
        e.call("step")
        time.sleep(0.02)
    r = out["r"]
    assert r.nbytes == 24 * ENGINE_BPP and r.lowered == [e.name]
    q = e.call("query")
    assert q["preempted"] >= 1 and q["mapped"] * ENGINE_BPP + r.nbytes <= budget_bytes
    r.release()
    assert e.call("query")["limit"] == original  # restored
    assert e.call("run", pages=10)["ok"]


def test_priority_limits_are_restored_when_the_borrower_is_killed(prefix, procs):
    budget_bytes = 40 * ENGINE_BPP
    e = procs(Engine(name=prefix + "e", scope=prefix, budget_bytes=budget_bytes))
    original = e.ready["limit"]
    assert e.call("run", pages=30)["ok"]
    job = procs(
        start_job(budget=budget_bytes, scope=prefix, n=20 * ENGINE_BPP, name=prefix + "job", priority=True, timeout=60)
    )
    until(lambda: e.call("query")["limit"] < original, "the engine's limit is lowered")
    job.kill()  # SIGKILL while the limit is lowered (it has not even got its memory)
    job.wait(10)
    until(lambda: e.call("query")["limit"] == original, "the guardian restores the limit")
    assert "restored" in job.stderr.read()  # the guardian says so on the borrower's stderr
    # A limit changed by someone else meanwhile is theirs: not restored.
    job = procs(
        start_job(budget=budget_bytes, scope=prefix, n=20 * ENGINE_BPP, name=prefix + "job2", priority=True, timeout=60)
    )
    until(lambda: e.call("query")["limit"] < original, "lowered again")
    assert kvctl("limit", e.name, "3M").returncode == 0
    job.kill()
    job.wait(10)
    assert "left as it is" in job.stderr.read()
    assert e.call("query")["limit"] == 3 << 20


# ---- kvctl borrow -------------------------------------------------------------------------------


def _kvctl_borrow(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli.kvctl", "borrow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, KVCACHED_HOST_MEMORY_BUDGET="64M", **(env or {})),
        **kw,
    )


def test_kvctl_borrow_runs_the_command_with_the_memory_and_passes_its_status(prefix):
    name = prefix + "cli"
    check = (
        "import json, os, subprocess, sys\n"
        "rows = json.loads(subprocess.run([sys.executable, '-m', 'kvcached.cli.kvctl', 'list', '--json', "
        f"'{name}'], capture_output=True, text=True).stdout)\n"
        "print(json.dumps({'env': os.environ['KVCACHED_BORROW_BYTES'], 'row': rows[0]}))\n"
        "sys.exit(3)\n"
    )
    p = _kvctl_borrow("2M", "--device", "cpu", "--name", name, "--json", "--", sys.executable, "-c", check)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err  # CMD's exit status
    held_line, seen = (json.loads(x) for x in out.splitlines())
    assert held_line["name"] == name and held_line["nbytes"] == 2 << 20 and held_line["device"] == "cpu"
    assert seen["env"] == str(2 << 20) and seen["row"]["engine"] == "job" and seen["row"]["held"] == 2 << 20
    assert name not in _C.list_mem_info_records()  # given back when CMD ended
    # A command that fails to start, bad input.
    p = _kvctl_borrow("1M", "--device", "cpu", "--", "/nonexistent/cmd")
    assert p.wait(60) == 127
    for bad, why in (
        (["0", "--device", "cpu", "--", "true"], "must be > 0"),
        (["-1M", "--device", "cpu", "--", "true"], "must be > 0"),
        (["1M", "--device", "cpu"], "give the command after --"),
        (["1M", "--device", "cpu", "--timeout", "inf", "--", "true"], "--timeout"),
        (["1G", "--device", "cpu", "--", "true"], "more than the whole budget"),
        # No CUDA here: no CUDA device can be borrowed; on a GPU machine: that one is not there.
        (["1M", "--device", "cuda:5", "--", "true"], ("cannot borrow on device", "does not exist")),
    ):
        p = _kvctl_borrow(*bad)
        _, err = p.communicate(timeout=60)
        whys = (why,) if isinstance(why, str) else why
        assert p.returncode == 2 and any(w in err for w in whys) and err.count("\n") == 1, (bad, err)


def test_the_kvctl_shell_runs_no_borrow(tmp_path):
    marker = tmp_path / "ran"
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvctl", "shell"],
        input=f"borrow 1M --device cpu -- touch {marker}\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, KVCACHED_HOST_MEMORY_BUDGET="64M"),
    )
    assert r.returncode == 2 and "borrow runs a command" in r.stderr and not marker.exists()


def test_kvctl_borrow_forwards_sigterm_and_releases(prefix, tmp_path):
    name = prefix + "sig"
    ready = tmp_path / "ready"
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    p = _kvctl_borrow("1M", "--device", "cpu", "--name", name, "--", sys.executable, "-c", script)
    until(ready.exists, "the command started", 60)
    assert name in _C.list_mem_info_records()
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 42
    assert name not in _C.list_mem_info_records()


def test_kvctl_borrow_exits_75_when_the_memory_cannot_be_had(prefix, procs, monkeypatch, capsys):
    budget = DeviceBudget("cpu", 16 * BPP, scope=prefix)
    w = procs(Worker(name=prefix + "w", pages=32, budget_bytes=16 * BPP, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=10)["ok"]
    monkeypatch.setattr(DeviceBudget, "from_env", classmethod(lambda cls, device, scope="": budget))
    rc = kvctl_mod.main(["borrow", "3M", "--device", "cpu", "--timeout", "0.2", "--name", prefix + "j", "--", "true"])
    assert rc == 75 and "could not borrow" in capsys.readouterr().err
    rc = kvctl_mod.main(["borrow", "3M", "--device", "cpu", "--timeout", "0", "--partial", "--json", "--", "true"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["nbytes"] == 6 * BPP


# ---- the PyTorch retry core and the package surface ---------------------------------------------


class FakeOOM(RuntimeError):
    pass


def test_alloc_retry_borrows_what_the_error_lacked_and_runs_again(prefix, procs):
    budget = DeviceBudget("cpu", 64 << 20, scope=prefix)
    assert tried_bytes("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity") == 20 << 20
    assert tried_bytes("Tried to allocate 1.50 GiB") == 3 << 29 and tried_bytes("out of memory") is None
    fails = [FakeOOM("Tried to allocate 3.00 MiB"), FakeOOM("Tried to allocate 1.00 MiB")]

    def step(x):
        if fails:
            raise fails.pop(0)
        return x + 1

    with AllocRetry("cpu", budget=budget, name=prefix + "t", oom_types=(FakeOOM,)) as retry:
        assert retry(step, 1) == 2
        assert retry.nbytes == (4 + 2) << 20  # 3 MiB and 1 MiB, each rounded up to 2 MiB
        assert held(budget, prefix + "t") == 6 << 20
    assert held(budget, prefix + "t") == 0
    # A borrow that cannot be had: PyTorch's error again, kvcached's as its cause.
    w = procs(Worker(name=prefix + "w", pages=64, budget_bytes=16 * BPP, scope=prefix, max_reserved=0))
    assert w.call("alloc", n=14)["ok"]
    small = DeviceBudget("cpu", 16 * BPP, scope=prefix)
    retry = AllocRetry("cpu", budget=small, name=prefix + "t2", timeout_s=0.1, oom_types=(FakeOOM,))
    with pytest.raises(FakeOOM) as e:
        retry(lambda: (_ for _ in ()).throw(FakeOOM("Tried to allocate 2.00 MiB")))
    assert isinstance(e.value.__cause__, OutOfMemoryError) and retry.nbytes == 0


def test_importing_kvcached_and_its_borrow_api_loads_no_torch():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, kvcached; kvcached.borrow, kvcached.reserve, kvcached.Reservation; "
            "import kvcached.cli.borrow; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["False"]
