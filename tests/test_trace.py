"""kvcached.trace: the opt-in event trace (KVCACHED_TRACE)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
import threading

import pytest

from kvcached import config, trace


@pytest.fixture
def traced(tmp_path):
    """Tracing into a fresh folder (created by the trace itself); off again after the test."""
    d = str(tmp_path / "trace")
    trace.configure(d)
    yield d
    trace.configure(None)


def test_off_by_default_writes_nothing_and_costs_a_check(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCACHED_TRACE", raising=False)
    trace.configure(config.trace_dir())
    assert trace.ON is False and trace.start() == 0
    trace.event("want", "x", bytes=1)
    trace.end("map", trace.start(), "x", pages=1)  # a 0 start is no event
    assert os.listdir(tmp_path) == []


def test_the_variable_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_TRACE", str(tmp_path))
    assert config.trace_dir() == str(tmp_path)
    monkeypatch.setenv("KVCACHED_TRACE", "")
    assert config.trace_dir() is None  # empty means unset, as for every variable


def test_owner_only_folder_and_file(traced):
    trace.event("want", "inst", bytes=4096)
    assert stat.S_IMODE(os.stat(traced).st_mode) == 0o700
    path = trace.path_of(os.getpid(), traced)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


def test_an_existing_folder_keeps_its_mode(tmp_path):
    os.chmod(tmp_path, 0o755)  # e.g. a shared folder: not ours to narrow
    trace.configure(str(tmp_path))
    try:
        trace.event("x")
    finally:
        trace.configure(None)
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(trace.path_of(os.getpid(), str(tmp_path))).st_mode) == 0o600


def test_json_lines_with_the_common_fields(traced):
    t0 = trace.start()
    assert t0 > 0
    trace.event("want", "inst_a", bytes=262144, new=1)
    trace.end("map", t0, "inst_a", pages=3)
    with open(trace.path_of(os.getpid(), traced)) as f:
        lines = [json.loads(x) for x in f]
    assert [e["event"] for e in lines] == ["want", "map"]
    for e in lines:
        assert e["pid"] == os.getpid() and e["instance"] == "inst_a" and isinstance(e["t_ns"], int)
    assert lines[0]["bytes"] == 262144 and lines[0]["new"] == 1
    assert lines[1]["pages"] == 3 and lines[1]["ms"] >= 0 and lines[1]["t_ns"] >= t0


def test_threads_append_whole_lines(traced):
    def write(k: int) -> None:
        for i in range(300):
            trace.event("e", f"t{k}", i=i, pad="x" * 200)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = trace.read(traced)
    assert len(events) == 1200
    assert sorted((e["instance"], e["i"]) for e in events) == sorted((f"t{k}", i) for k in range(4) for i in range(300))


def _child(d: str, tag: str, n: int) -> None:
    trace.configure(d)
    for i in range(n):
        trace.event("e", tag, i=i)


def test_two_processes_write_their_own_files_on_one_clock(traced):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(traced, tag, 500)) for tag in ("p1", "p2")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    files = sorted(os.listdir(traced))
    assert files == sorted(f"kvcached-{p.pid}.jsonl" for p in procs)
    events = trace.read(traced)
    assert len(events) == 1000
    assert [e["t_ns"] for e in events] == sorted(e["t_ns"] for e in events)  # merged in time order
    for tag, p in zip(("p1", "p2"), procs):
        mine = [e for e in events if e["instance"] == tag]
        assert [e["i"] for e in mine] == list(range(500)) and {e["pid"] for e in mine} == {p.pid}


def test_a_forked_child_opens_its_own_file(traced):
    trace.event("parent")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        trace.event("child")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    by_pid = {e["pid"]: e["event"] for e in trace.read(traced)}
    assert by_pid == {os.getpid(): "parent", pid: "child"}


def test_read_skips_a_line_cut_short(traced):
    trace.event("a")
    with open(trace.path_of(os.getpid(), traced), "a") as f:
        f.write('{"t_ns": 1, "ev')  # a process killed mid-line
    assert [e["event"] for e in trace.read(traced)] == ["a"]


def test_a_write_error_turns_tracing_off_without_raising(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    trace.configure(str(blocker / "sub"))  # a folder under a file cannot be made
    try:
        trace.event("want")
        assert trace.ON is False
    finally:
        trace.configure(None)
