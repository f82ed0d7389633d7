"""The hand-off of the GPU proof's correctness step (scripts/gpu_proof/correctness.py), checked
without a GPU: the native-small pools take kvcached-limit's block count under its limit, which
its process writes once started. The wait for it is bounded and ends at once, with one line,
when that process ends without writing (a zombie its parent has not reaped included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_proof"))
correctness = pytest.importorskip("correctness")


def _writer(path: str, after_s: float, blocks: int) -> subprocess.Popen:
    code = f"import json, time; time.sleep({after_s}); json.dump({{'blocks': {blocks}}}, open({path!r}, 'w'))"
    return subprocess.Popen([sys.executable, "-c", code])


def test_native_small_waits_for_the_count_kvcached_limit_writes(tmp_path):
    path = str(tmp_path / "kvcached-limit.blocks.json")
    p = _writer(path, 1.5, 448)
    try:
        assert correctness.wait_for_blocks(path, p.pid, timeout=30) == 448
    finally:
        p.wait()


def test_a_count_written_by_an_engine_that_has_ended_is_still_taken(tmp_path):
    # --at-once 1: kvcached-limit ran to its end before native-small started.
    path = str(tmp_path / "kvcached-limit.blocks.json")
    with open(path, "w") as f:
        json.dump({"blocks": 7}, f)
    assert correctness.wait_for_blocks(path, 2**22 + 1, timeout=5) == 7


def test_an_engine_that_ended_without_a_count_stops_the_wait_at_once(tmp_path):
    path = str(tmp_path / "kvcached-limit.blocks.json")
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while correctness._running(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not correctness._running(p.pid)  # ended, not reaped yet: a zombie
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"ended without writing its pool's size .*see its log"):
        correctness.wait_for_blocks(path, p.pid, timeout=600)
    assert time.monotonic() - t0 < 5
    p.wait()
    assert not correctness._running(p.pid)


def test_the_wait_is_bounded(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(SystemExit, match="did not write its pool's size"):
            correctness.wait_for_blocks(str(tmp_path / "never.json"), p.pid, timeout=1.5)
    finally:
        p.kill()
        p.wait()


def test_a_count_kvcached_limit_could_not_read_leaves_the_limits_bytes(tmp_path):
    path = str(tmp_path / "kvcached-limit.blocks.json")
    with open(path, "w") as f:
        json.dump({"error": "AttributeError: no geometry"}, f)
    assert correctness.wait_for_blocks(path, 2**22 + 1, timeout=5) is None
    assert "the limit's bytes" in correctness.describe_blocks({"error": "AttributeError: no geometry"})


def test_the_line_says_whether_every_page_holds_the_same_blocks():
    same = correctness.describe_blocks({"blocks": 96, "page": 18 << 20, "block": 384 << 10, "caps": [48, 48]})
    assert "every 18874368 B page holds 48 blocks" in same
    # 384 KiB blocks on 2 MiB pages: 5 or 4 a page (the straddling ones never handed out).
    uneven = correctness.describe_blocks(
        {"blocks": 25, "page": 2 << 20, "block": 384 << 10, "caps": [4, 5], "exact_page": 6 << 20}
    )
    assert "hold 4 to 5 blocks" in uneven and "KVCACHED_PAGE_SIZE=6291456" in uneven


def test_a_difference_is_placed_at_the_step_that_produced_its_token(tmp_path):
    # Request 0: a 10-token prefill (token 0), two decodes, preempted, a 13-token recompute (token 3),
    # a decode. Request 1: a prefill in two chunks (token 0 at step 1), then decodes.
    trace = [[0, [[0, 10], [1, 6]]], [0, [[0, 1], [1, 6]]], [0, [[0, 1], [1, 1]]], [0, [[1, 1]]]]
    trace += [[0, [[0, 13]]], [0, [[0, 1]]]]
    sched = tmp_path / "y.sched"
    sched.write_text("".join(json.dumps(t) + "\n" for t in trace))
    assert correctness.token_steps(str(sched)) == {
        0: [(0, False), (1, False), (2, False), (4, True), (5, True)],
        1: [(1, False), (2, False), (3, False)],
    }
    x = [[5, 6, 7, 8, 9], [1, 2, 3]]
    after_recompute = [[5, 6, 7, 0, 0], [1, 2, 3]]
    assert correctness.where_tokens_differ(x, after_recompute, str(sched)) == (
        "; first differ from step 4, 0 of 1 before a recompute of theirs"
    )
    from_prefill = [[5, 6, 7, 0, 0], [0, 2, 3]]
    assert correctness.where_tokens_differ(x, from_prefill, str(sched)) == (
        "; first differ from step 1, 1 of 2 before a recompute of theirs"
    )
    assert correctness.where_tokens_differ(x, x, str(sched)) == ""


def test_the_graph_source_is_read_from_each_engines_log(tmp_path):
    """Which engine compiled its graph and which loaded it (processes that pick kernel configs
    on their own: the 12-06 MLA natives that differed had loaded theirs)."""
    (tmp_path / "a.log").write_text("... Directly load the compiled graph(s) for compile range (1, 16384) ...\n")
    (tmp_path / "b.log").write_text("... Compiling a graph for compile range (1, 16384) takes 20.59 s\n")
    (tmp_path / "c.log").write_text("enforce_eager=True\n")
    got = [correctness.graph_source(str(tmp_path), label) for label in ("a", "b", "c", "missing")]
    assert got == ["cache", "compiled", "eager", "?"]


def test_every_engine_pins_its_kernel_configs_unless_told(tmp_path, monkeypatch):
    """The engines' environments, as main() builds them (Popen recorded, nothing started)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    envs = {}

    class Recorded:
        def __init__(self, cmd, env, **_):
            envs[cmd[cmd.index("--label") + 1]] = env
            self.pid = 0

        def wait(self):
            return 1  # "failed": main stops before reading any tokens

    monkeypatch.setattr(correctness.subprocess, "Popen", Recorded)
    for free in (False, True):
        envs.clear()
        argv = ["--model", str(model), "--out", str(tmp_path / f"out{free}"), "--cpu", "--prompts", "8"]
        argv += ["--only", "native,kvcached"] + (["--free-kernels"] if free else [])
        assert correctness.main(argv) == 1
        assert set(envs) == {"native", "kvcached"}
        for env in envs.values():
            for k, v in correctness.PINNED_KERNELS.items():
                assert (env.get(k) == v) is not free, (k, free)
