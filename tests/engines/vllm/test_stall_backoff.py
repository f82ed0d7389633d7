"""The vLLM scheduler wrapper paces a scheduler that admits nothing: requests
waiting, none running, no token scheduled (``StallBackoff``, kvcached.elastic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _wrapped(monkeypatch, outputs, running, waiting):
    import kvcached.elastic.stall as st
    from kvcached.integration.vllm.scheduler_patches import count_steps

    slept = []
    monkeypatch.setattr(st.time, "sleep", slept.append)
    fence = SimpleNamespace(depth=0, launched=lambda: None, finished=lambda: None, settle=lambda: None)
    backend = SimpleNamespace(
        fence=fence,
        instance=SimpleNamespace(end_step=lambda: None),
        pool=SimpleNamespace(name="inst", limit_bytes=lambda: None, bytes_per_page=1 << 20),
    )
    it = iter(outputs)
    sched = SimpleNamespace(running=running, waiting=waiting, schedule=lambda: next(it), update_from_output=None)
    count_steps(sched, SimpleNamespace(backend=backend))
    for _ in outputs:
        sched.schedule()
    return slept


def test_empty_steps_with_requests_waiting_and_none_running_are_paced(monkeypatch):
    empty = SimpleNamespace(total_num_scheduled_tokens=0)
    slept = _wrapped(monkeypatch, [empty] * 4, running=[], waiting=["r"])
    assert slept == [0.0005, 0.001, 0.002, 0.004]


@pytest.mark.parametrize(
    "tokens, running, waiting",
    [(0, ["a"], ["r"]),  # a step in flight or decoding: vLLM's own pace
     (0, [], []),  # nothing to do: vLLM blocks on its input queue
     (5, [], ["r"])],  # admitted something
)  # fmt: skip
def test_other_steps_are_not(monkeypatch, tokens, running, waiting):
    out = SimpleNamespace(total_num_scheduled_tokens=tokens)
    assert _wrapped(monkeypatch, [out] * 3, running=running, waiting=waiting) == []
