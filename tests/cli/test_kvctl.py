"""kvctl and kvtop against live instances in other processes (host backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kvcached import _C
from kvcached.cli import kvctl as kvctl_mod
from kvcached.cli import kvtop as kvtop_mod
from kvcached.cli.utils import get_kv_cache_limit, update_kv_cache_limit
from limits_helpers import BPP, Worker, kvctl, poke, record_state, remove_records, unique_prefix

BUDGET = 16 * BPP  # the instance's device: 4 MiB usable


@pytest.fixture(scope="module")
def inst():
    """One live instance in a child process, with a 4 MiB device budget."""
    prefix = unique_prefix()
    w = Worker(name=prefix + "m", pages=32, budget_bytes=BUDGET, scope=prefix)
    yield w
    w.kill()
    remove_records(prefix)


def _wait_applied(name: str, rev: int) -> None:
    t0 = time.monotonic()
    while _C.MemInfoTracker.open(name).snapshot().applied_revision != rev:
        assert time.monotonic() - t0 < 2, "owner did not apply the limit"
        time.sleep(0.001)


BAD = [
    (["limit", "{missing}", "1G"], "no kvcached instance named"),
    (["limit", "{name}", "0"], "must be > 0"),
    (["limit", "{name}", "-5M"], "must be > 0"),
    (["limit", "{name}", "-1"], "must be > 0"),
    (["limit", "{name}", "abc"], "not a size"),
    (["limit", "{name}", "1.5X"], "not a size"),
    (["limit", "{name}", ""], "not a size"),
    (["limit", "{name}", "100G"], "exceeds the usable memory of cpu (4.00M); use at most 4.00M"),
    (["limit", "{name}", "5M"], "exceeds the usable memory"),
    (["limit", "{name}", "1M", "--revision", "x"], "--revision"),
    (["limit", "{name}"], "required"),
    (["limit-percent", "{name}", "0"], "outside (0, 100]"),
    (["limit-percent", "{name}", "-1"], "outside (0, 100]"),
    (["limit-percent", "{name}", "100.5"], "outside (0, 100]"),
    (["limit-percent", "{name}", "abc"], "not a number"),
    (["limit-percent", "{missing}", "50"], "no kvcached instance named"),
    (["delete", "{name}"], "is alive"),
    (["delete", "{missing}"], "no kvcached instance named"),
    (["delete", "bad/name"], "invalid"),
    (["watch", "-n", "0"], "outside (0, 86400]"),
    (["frobnicate"], "invalid choice"),
    # Numbers: ASCII digits only, finite, within the field they go to.
    (["limit", "{name}", "1M", "--revision", "99999999999999999999"], "outside [0, 4294967295]"),
    (["limit", "{name}", "1M", "--revision", str(1 << 32)], "outside [0, 4294967295]"),  # would wrap to 0
    (["limit", "{name}", "1M", "--revision", "\uff11"], "not an integer"),
    (["limit", "{name}", "1M", "--revision", "-1"], "not an integer"),
    (["limit", "{name}", "\uff11\uff12\uff13"], "not a size"),
    (["limit", "{name}", "\u0663M"], "not a size"),
    (["limit", "{name}", "1_0"], "not a size"),
    (["limit", "{name}", "1e3"], "not a size"),
    (["limit", "{name}", str(1 << 63)], "too large"),
    (["limit", "{name}", "1M", "--wait", "inf"], "--wait"),
    (["limit", "{name}", "1M", "--wait", "nan"], "--wait"),
    (["limit", "{name}", "1M", "--wait", "-1"], "--wait"),
    (["limit", "{name}", "1M", "--wait", "1e9"], "--wait"),
    (["limit-percent", "{name}", "\u0665\u0660"], "not a number"),
    (["limit-percent", "{name}", "1_0"], "not a number"),
    (["limit-percent", "{name}", "inf"], "not a number"),
    (["watch", "-n", "inf"], "-n"),
    (["watch", "-n", "nan"], "-n"),
    (["watch", "--count", "-1"], "--count"),
    (["watch", "--count", "0"], "--count"),
    (["watch", "--count", "1.5"], "--count"),
]


def run_main(argv) -> int:
    """kvctl.main in this process; argparse's own errors exit through SystemExit."""
    try:
        return kvctl_mod.main(argv)
    except SystemExit as e:
        return int(e.code)


@pytest.mark.parametrize("argv,why", BAD, ids=[ascii(" ".join(a)) or "empty" for a, _ in BAD])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(inst, capsys, argv, why):
    argv = [a.format(name=inst.name, missing=inst.name + "_nope") for a in argv]
    before = record_state(inst.name)
    rc = run_main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvctl: error: ") and why in err, err
    assert record_state(inst.name) == before


KVTOP_BAD = [
    (["-n", "inf"], "-n"),
    (["-n", "0"], "outside (0, 86400]"),
    (["-n", "-1"], "-n"),
    (["--count", "-1"], "--count"),
    (["--count", "0"], "--count"),
    (["--count", "\uff13"], "not an integer"),
    (["--frobnicate"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv,why", KVTOP_BAD, ids=[ascii(" ".join(a)) for a, _ in KVTOP_BAD])
def test_kvtop_bad_input_exits_2_with_one_line(capsys, argv, why):
    with pytest.raises(SystemExit) as e:
        kvtop_mod.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvtop: error: ") and why in err, err


def test_console_script_exit_codes(inst):
    before = record_state(inst.name)
    # The console script of this interpreter's install, if there is one.
    exe = os.path.join(os.path.dirname(sys.executable), "kvctl")
    cmd = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "kvcached.cli.kvctl"]
    r = subprocess.run(cmd + ["limit", inst.name, "-3G"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "must be > 0" in r.stderr
    r = subprocess.run(cmd + ["limit-percent", inst.name, "150"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "outside (0, 100]" in r.stderr
    assert record_state(inst.name) == before


def test_limit_and_percent_apply(inst):
    r = kvctl("limit", inst.name, "2M", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "applied" and out["limit"] == 2 << 20
    assert inst.call("query")["mem_limit"] <= 2 << 20
    r = kvctl("limit-percent", inst.name, "50")
    assert r.returncode == 0 and "applied" in r.stdout, r.stderr
    rec = _C.MemInfoTracker.open(inst.name).snapshot()
    assert rec.limit == BUDGET // 2 and rec.applied_revision == rec.revision
    # Compare-and-set from the shell: the current revision succeeds, an old one is stale.
    r = kvctl("limit", inst.name, "1M", "--revision", str(rec.revision))
    assert r.returncode == 0
    r = kvctl("limit", inst.name, "3M", "--revision", str(rec.revision))
    assert r.returncode == 1 and "stale" in r.stderr
    assert _C.MemInfoTracker.open(inst.name).snapshot().limit == 1 << 20


def test_concurrent_writers_last_revision_wins_no_torn_record(inst):
    name = inst.name
    rev0, limit0 = record_state(name)
    sizes = [(i + 1) * BPP for i in range(8)]
    seen = set()
    stop = threading.Event()

    def read() -> None:
        t = _C.MemInfoTracker.open(name)
        while not stop.is_set():
            s = t.snapshot()
            seen.add((s.revision, s.limit))

    reader = threading.Thread(target=read)
    reader.start()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvcached.cli.kvctl", "limit", name, str(sz), "--json", "--wait", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for sz in sizes
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    stop.set()
    reader.join()
    written = {r["revision"]: r["limit"] for r in results}
    assert sorted(written) == list(range(rev0 + 1, rev0 + 1 + len(sizes)))  # every write got its own revision
    final = _C.MemInfoTracker.open(name).snapshot()
    assert final.revision == rev0 + len(sizes) and final.limit == written[final.revision]
    allowed = set(written.items()) | {(rev0, limit0)}
    assert seen <= allowed, seen - allowed  # every read paired a limit with its own revision
    _wait_applied(name, final.revision)
    assert inst.call("query")["limit"] == final.limit


def test_list_delete_and_cleanup():
    prefix = unique_prefix()
    try:
        w = Worker(name=prefix + "x", pages=8)
        w.call("alloc", n=2)
        r = kvctl("list")
        assert r.returncode == 0
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(prefix + "x"))
        assert " alive " in line and "512.0K" in line  # 2 pages of 256 KiB used
        r = kvctl("delete", prefix + "x")
        assert r.returncode == 2 and "is alive" in r.stderr and "--force" in r.stderr
        w.kill()
        assert any(ln.startswith(prefix + "x") and " dead " in ln for ln in kvctl("list").stdout.splitlines())
        r = kvctl("delete", prefix + "x", "--json")
        assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": [prefix + "x"]}
        assert record_state(prefix + "x") is None
        w2 = Worker(name=prefix + "y", pages=8)
        r = kvctl("delete", prefix + "y", "--force")
        assert r.returncode == 0 and record_state(prefix + "y") is None
        w2.kill()
    finally:
        remove_records(prefix)


KVTOP_NO_GPU = (
    "import sys\n"
    "from kvcached.cli import kvtop\n"
    "rc = kvtop.main(['--once'])\n"
    "maps = open('/proc/self/maps').read()\n"
    "print('MODULES', 'torch' in sys.modules, 'libcuda' in maps or 'libamdhip' in maps, rc)\n"
)


def test_kvtop_once_without_gpu_libraries(inst):
    r = subprocess.run([sys.executable, "-c", KVTOP_NO_GPU], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "MODULES False False 0" in r.stdout
    assert inst.name in r.stdout and "DEVICE" in r.stdout and "cpu" in r.stdout
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith(inst.name))
    assert " alive " in row and "[" in row


def test_kvtop_refreshes_and_kvctl_watch(inst):
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvtop", "-n", "0.05", "--count", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.count("kvtop  ") == 3 and r.stdout.count(inst.name) == 3
    r = kvctl("kvtop", "--once")
    assert r.returncode == 0 and r.stdout.count("kvtop  ") == 1
    r = kvctl("watch", "-n", "0.05", "--count", "2")
    assert r.returncode == 0 and r.stdout.count("Every 0.05s: kvctl list") == 2 and r.stdout.count(inst.name) == 2


def test_upstream_utils(inst):
    assert get_kv_cache_limit(inst.name + "_nope") is None
    assert update_kv_cache_limit(inst.name + "_nope", BPP) is None
    v = update_kv_cache_limit(inst.name, 3 * BPP)
    assert v is not None and v.total_size == v.limit == 3 * BPP
    got = get_kv_cache_limit(inst.name)
    assert got.total_size == 3 * BPP and got.used_size == got.used and got.prealloc_size == got.prealloc
    before = record_state(inst.name)
    for bad in (0, -BPP, BUDGET + 1):
        with pytest.raises(ValueError):
            update_kv_cache_limit(inst.name, bad)
    assert record_state(inst.name) == before


def test_list_escapes_what_a_record_says():
    """A name or engine with terminal escape codes is printed as text, never raw."""
    prefix = unique_prefix()
    try:
        t = _C.MemInfoTracker.create(prefix + "esc", "t", 0, 0, BPP, BPP)
        poke(prefix + "esc", name=(prefix + "esc\x1b[2J\x1b]0;owned\x07").encode(), engine=b"\x1b[31mred\xe2\x80\xae")
        for cmd in (["list"], ["kvtop", "--once"], ["watch", "--count", "1"]):
            r = kvctl(*cmd)
            assert r.returncode == 0, r.stderr
            assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\u202e" not in r.stdout, r.stdout
            assert prefix + "esc" in r.stdout
        r = kvctl("list", "--json")
        assert r.returncode == 0 and "\x1b" not in r.stdout  # JSON escapes control characters itself
        del t
    finally:
        remove_records(prefix)
