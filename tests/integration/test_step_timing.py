"""kvcached.integration.sglang.step_timing: time inside kvcached per scheduler step, slow steps
logged at most once per window with the worst step's parts (importable without SGLang)."""

from __future__ import annotations

import logging
import time

from kvcached.integration.sglang import step_timing
from kvcached.integration.sglang.step_timing import StepTimer


def test_fast_steps_are_counted_and_silent(caplog) -> None:
    t = StepTimer()
    with caplog.at_level(logging.INFO, logger="kvcached.integration.sglang"):
        for _ in range(3):
            with t.part("alloc"):
                pass
            t.end_step()
    assert not caplog.records
    st = t.stats()
    assert st["steps"] == 3 and st["slow_steps"] == 0 and st["alloc_s"] >= 0


def test_slow_steps_are_logged_once_per_window_with_the_worst(caplog, monkeypatch) -> None:
    monkeypatch.setattr(step_timing, "SLOW_S", 0.01)
    t = StepTimer()
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.sglang"):
        with t.part("alloc"):
            time.sleep(0.03)
        t.end_step()  # logged at once
        for pause in (0.02, 0.04):  # inside the window: counted, logged later
            with t.part("hooks"):
                time.sleep(pause)
            t.end_step()
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "1 scheduler step(s) spent over 10 ms" in msg and "alloc" in msg
    st = t.stats()
    assert st["steps"] == 3 and st["slow_steps"] == 3 and st["worst_step_s"] >= 0.04
    assert st["hooks_s"] >= 0.06 and st["alloc_s"] >= 0.03
    t._next_log = 0.0  # the window has passed: the next step reports the two waiting, worst first
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.sglang"):
        t.end_step()
    msg = caplog.records[0].getMessage()
    assert "2 scheduler step(s)" in msg and "hooks" in msg and "alloc" not in msg  # the worst of the two
