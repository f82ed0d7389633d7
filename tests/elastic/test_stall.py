"""StallBackoff: an engine loop that admits nothing (requests waiting, none
running) is paced instead of spinning. A vLLM engine held to a limit below one
page stepped ~5 million empty steps in 2 minutes before it (docs/GPU.md)."""

from __future__ import annotations

from types import SimpleNamespace

from kvcached.elastic import StallBackoff


def _pool(limit=3 << 20):
    return SimpleNamespace(name="inst", limit_bytes=lambda: limit, bytes_per_page=4 << 20)


def test_a_stall_sleeps_longer_each_turn_up_to_a_bound_and_progress_resets_it():
    slept = []
    b = StallBackoff(_pool(), first_s=0.001, max_s=0.004, sleep=slept.append)
    for _ in range(5):
        b.stalled(1)
    assert slept == [0.001, 0.002, 0.004, 0.004, 0.004]
    b.progress()
    b.stalled(1)
    assert slept[5:] == [0.001]


def test_a_long_stall_says_once_what_holds_it(caplog, monkeypatch):
    import kvcached.elastic.stall as st

    now = [100.0]
    monkeypatch.setattr(st.time, "monotonic", lambda: now[0])
    b = StallBackoff(_pool(), warn_after_s=30.0, sleep=lambda s: None)
    with caplog.at_level("WARNING", logger="kvcached.elastic.stall"):
        for _ in range(4):
            b.stalled(2)
            now[0] += 20.0
    lines = [r.getMessage() for r in caplog.records if "none admitted" in r.getMessage()]
    assert len(lines) == 1
    assert "2 requests waiting" in lines[0] and "limit 3.00M, page 4.00M" in lines[0] and "kvctl limit inst" in lines[0]
    b.progress()  # a new stall may say it again
    assert not b.warned and b.since is None


def test_no_limit_is_named_as_none(caplog, monkeypatch):
    import kvcached.elastic.stall as st

    now = [0.0]
    monkeypatch.setattr(st.time, "monotonic", lambda: now[0])
    b = StallBackoff(_pool(limit=None), warn_after_s=1.0, sleep=lambda s: None)
    with caplog.at_level("WARNING", logger="kvcached.elastic.stall"):
        b.stalled(1)
        now[0] = 2.0
        b.stalled(1)
    assert "limit none" in caplog.text
