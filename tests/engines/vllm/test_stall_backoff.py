"""A scheduler that admits nothing (requests waiting, none running, no token
scheduled: a kvcached limit below what the first request needs, or peers holding
the device budget) is paced instead of spinning: StallBackoff, driven by the
scheduler wrapper after every ``schedule()``. A real engine held to a limit below
one page stepped ~5 million empty steps in 2 minutes before it (docs/GPU.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _pool(limit=3 << 20, page=4 << 20):
    pool = SimpleNamespace(limit_bytes=lambda: limit, bytes_per_page=page)
    return SimpleNamespace(backend=SimpleNamespace(name="inst", pool=pool))


def _backoff(**kw):
    from kvcached.integration.vllm.scheduler_patches import StallBackoff

    slept = []
    return StallBackoff(_pool(), sleep=slept.append, **kw), slept


def test_a_stalled_scheduler_sleeps_longer_each_step_up_to_a_bound_and_resets_on_progress():
    b, slept = _backoff(first_s=0.001, max_s=0.004)
    stalled = SimpleNamespace(running=[], waiting=["r"])
    empty = SimpleNamespace(total_num_scheduled_tokens=0)
    for _ in range(5):
        b.after_schedule(stalled, empty)
    assert slept == [0.001, 0.002, 0.004, 0.004, 0.004]
    b.after_schedule(stalled, SimpleNamespace(total_num_scheduled_tokens=7))  # progress: no sleep, reset
    b.after_schedule(stalled, empty)
    assert slept[5:] == [0.001]


@pytest.mark.parametrize(
    "sched, tokens",
    [(SimpleNamespace(running=["a"], waiting=["r"]), 0),  # a step in flight or decoding: vLLM's own pace
     (SimpleNamespace(running=[], waiting=[]), 0),  # nothing to do: vLLM blocks on its input queue
     (SimpleNamespace(running=[], waiting=["r"]), 3)],  # admitted something
)  # fmt: skip
def test_only_a_stall_is_paced(sched, tokens):
    b, slept = _backoff()
    for _ in range(3):
        b.after_schedule(sched, SimpleNamespace(total_num_scheduled_tokens=tokens))
    assert slept == []


def test_a_long_stall_says_once_what_holds_it(caplog, monkeypatch):
    import kvcached.integration.vllm.scheduler_patches as sp

    now = [100.0]
    monkeypatch.setattr(sp.time, "monotonic", lambda: now[0])
    b, _ = _backoff(warn_after_s=30.0)
    stalled = SimpleNamespace(running=[], waiting=["r", "s"])
    empty = SimpleNamespace(total_num_scheduled_tokens=0)
    with caplog.at_level("WARNING", logger="vllm.kvcached"):
        for _ in range(4):
            b.after_schedule(stalled, empty)
            now[0] += 20.0
    lines = [r.getMessage() for r in caplog.records if "none admitted" in r.getMessage()]
    assert len(lines) == 1
    assert "2 requests waiting" in lines[0] and "limit 3.00M" in lines[0] and "kvctl limit inst" in lines[0]
