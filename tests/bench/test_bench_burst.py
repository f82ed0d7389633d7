"""kvcached.bench burst: a trace folder -> the timeline table of each burst."""

from __future__ import annotations

import json
import os

from kvcached import trace
from kvcached.bench import BENCHMARKS
from kvcached.bench import burst as bench_burst
from kvcached.bench.burst_report import burst_rows

MS = 1_000_000
T0 = 5_000 * MS  # the want


def ev(t_ms: float, instance: str, event: str, pid: int = 1, **fields):
    return {"t_ns": T0 + int(t_ms * MS), "pid": pid, "instance": instance, "event": event, **fields}


def synthetic():
    """A burst at A served by idle B, in the order the engines write it, plus noise."""
    return [
        ev(-400, "B", "map", pid=2, pages=8, ms=1.0),  # B's own earlier load: before the burst
        ev(-30, "A", "burst_sent", pid=9, requests=16),
        ev(-20, "A", "missed", tokens=100),
        ev(0, "A", "want", bytes=1 << 20, new=1),
        ev(0.2, "A", "grant", bytes=0, short=1 << 20, ms=0.1),  # the refused admit: not the grant phase
        ev(0.5, "B", "peer_woke", pid=3, wanted_by=1),
        ev(0.6, "A", "admitted", blocks=1, waited_ms=20.6),  # a running request served from memory held: not it
        ev(0.9, "B", "grant_released", pid=3, bytes=0, ms=0.05),  # nothing to release yet: skipped
        ev(1.0, "B", "watcher_gave", pid=3, bytes=0, unmapped=0, ms=0.4),  # unmapped nothing: not the phase
        ev(2.0, "B", "idle_queued", pid=3, act=2),
        ev(6.0, "B", "give_back_start", pid=3, act=2, cached=12),
        ev(7.0, "B", "evicted", pid=3, blocks=12, ms=0.8),
        ev(9.0, "B", "rank_unmap", pid=3, pages=10, ms=1.5),
        ev(9.5, "B", "unmapped", pid=3, pages=10, ms=2.0),
        ev(9.6, "B", "grant_released", pid=3, bytes=10 << 18, ms=0.1),
        ev(9.7, "B", "give_back_end", pid=3, pages=10, ms=3.7),
        ev(250, "A", "want", bytes=1 << 20, new=0),  # a renewal: the same burst
        ev(259.9, "A", "want_withdrawn"),  # inside the grant's lock
        ev(260, "A", "grant", bytes=3 << 18, short=0, ms=0.3),
        ev(261, "A", "rank_map", pages=3, ms=0.6),
        ev(261.2, "A", "map", pages=3, ms=0.9),
        ev(262, "A", "admitted", blocks=2, waited_ms=282.0),
    ]


def test_the_phases_of_a_burst_relative_to_the_want():
    rows = burst_rows(synthetic())
    phases = [(r["phase"], r.get("at_ms"), r.get("took_ms"), r.get("who"), r.get("amount")) for r in rows]
    assert phases == [
        ("requests sent (client mark)", -30.0, None, "", "requests=16"),
        ("wanting engine first missed memory", -20.0, None, "", "tokens=100"),
        ("want published", 0.0, None, "", "bytes=1048576"),
        ("peer woke (limits watcher)", 0.5, None, "B", ""),
        ("peer queued its give-back to its engine thread", 2.0, None, "B", ""),
        ("peer's engine thread began the give-back", 6.0, None, "B", ""),
        ("peer evicted its prefix cache", 7.0, 0.8, "B", "blocks=12"),
        ("peer unmapped pages", 9.0, 1.5, "B", "pages=10"),  # the workers' unmap, first
        ("peer released grant", 9.6, 0.1, "B", "bytes=2621440"),
        ("peer's give-back done", 9.7, 3.7, "B", "pages=10"),
        ("want withdrawn (a step placed all it tried)", 259.9, None, "", ""),
        ("grant grew for the wanting engine", 260.0, 0.3, "", "bytes=786432"),
        ("wanting engine mapped pages", 261.2, 0.9, "", "pages=3"),
        ("stalled load admitted (allocation after the grant)", 262.0, None, "", "blocks=2"),
        ("total: want -> admitted", 262.0, None, None, None),
        ("total: own grant (ms summed)", None, 0.4, None, None),  # the refused admit's lock too
        ("total: own map (ms summed)", None, 0.9, None, None),
        ("total: own rank_map (ms summed) (inside the above)", None, 0.6, None, None),
        ("total: peer evicted (ms summed)", None, 0.8, None, None),
        ("total: peer rank_unmap (ms summed) (inside the above)", None, 1.5, None, None),
        ("total: peer unmapped (ms summed)", None, 2.0, None, None),
        ("total: peer watcher_gave (ms summed)", None, 0.4, None, None),
        # rank_map / rank_unmap run inside map / unmapped: counted once.
        ("total: measured work", None, 4.5, None, None),
        ("total: the rest (waits, hops, steps)", None, 257.5, None, None),
    ]
    assert {r["burst"] for r in rows} == {1} and {r["instance"] for r in rows} == {"A"}


def test_the_watcher_unmapping_counts_as_the_peer_unmap():
    events = [
        ev(0, "A", "want", bytes=1, new=1),
        ev(1, "B", "peer_woke", pid=3),
        ev(2, "B", "watcher_gave", pid=3, bytes=1 << 18, unmapped=1 << 18, ms=0.7),
        ev(3, "A", "admitted", blocks=1),
    ]
    row = next(r for r in burst_rows(events) if r["phase"] == "peer unmapped pages")
    assert (row["at_ms"], row["took_ms"], row["amount"]) == (2.0, 0.7, "unmapped=262144")


def test_two_bursts_and_one_never_admitted():
    events = synthetic() + [
        ev(5000, "A", "missed", tokens=50),
        ev(5001, "A", "want", bytes=1 << 18, new=1),
        ev(5002, "B", "peer_woke", pid=3),
    ]
    rows = burst_rows(events)
    assert {r["burst"] for r in rows} == {1, 2}
    second = [r for r in rows if r["burst"] == 2]
    assert [r["phase"] for r in second] == [
        "wanting engine first missed memory",  # the burst_sent of burst 1 is not this one's
        "want published",
        "peer woke (limits watcher)",
        "total: never admitted in the trace",
    ]
    assert second[0]["at_ms"] == -1.0


def test_sglang_evicts_tokens():
    events = [
        ev(0, "A", "want", bytes=1, new=1),
        ev(1, "B", "evicted", pid=3, tokens=830, ms=0.9),
        ev(3, "A", "admitted", blocks=1),
    ]
    row = next(r for r in burst_rows(events) if r["phase"] == "peer evicted its prefix cache")
    assert (row["at_ms"], row["took_ms"], row["amount"]) == (1.0, 0.9, "tokens=830")


def test_no_want_no_rows():
    assert burst_rows([ev(0, "A", "map", pages=1, ms=0.1)]) == []


def test_the_command_reads_a_trace_folder(tmp_path, capsys):
    assert "burst" in BENCHMARKS
    d = tmp_path / "t"
    d.mkdir()
    with open(d / "kvcached-1.jsonl", "w") as f:
        for e in synthetic():
            if e["pid"] != 3:
                f.write(json.dumps(e) + "\n")
    with open(d / "kvcached-3.jsonl", "w") as f:  # the peer's own file
        for e in synthetic():
            if e["pid"] == 3:
                f.write(json.dumps(e) + "\n")
    assert bench_burst.main(["--trace", str(d)]) == 0
    text = capsys.readouterr().out
    assert "peer unmapped pages" in text and "# bursts: 1" in text
    assert bench_burst.main(["--trace", str(d), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["events"] == len(synthetic()) and out["rows"][0]["phase"] == "requests sent (client mark)"
    assert trace.read(str(d))[0]["t_ns"] == synthetic()[0]["t_ns"]
    empty = tmp_path / "empty"
    os.mkdir(empty)
    assert bench_burst.main(["--trace", str(empty)]) == 1  # no burst: nothing to show
