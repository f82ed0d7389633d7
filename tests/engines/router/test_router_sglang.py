"""One real SGLang-CPU engine (kvcached on) behind ``python -m kvcached.router serve``,
on the tiny model built at test time: routed answers and streams, ``sleep: kv``
after ``idle_seconds`` (limit 0, the pages given back), a request wakes it with
the same greedy text, SIGTERM stops it. Run with the SGLang venv's python
(scripts/test_engines_router.sh); SGLang's CPU path imports one vLLM kernel
module, satisfied by tests/engines/sglang_stubs (never called)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcached.limits.records import list_records
from kvcached.testing.tiny_model import build_tiny_llama
from kvcached.testing.vllm_server import OFFLINE_ENV, free_port

STUBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang_stubs")
IDLE_S = 10
BOUND_S = 480
KV_PAGE = 16 << 10  # 64 tokens of the tiny model per page and layer: the prompts below span several pages
PROMPTS = [" ".join(f"w{i * 50 + j}" for j in range(40)) for i in range(3)]
ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch"]
ARGS += ["--disable-cuda-graph", "--page-size", "16", "--max-total-tokens", "2048", "--random-seed", "0"]


def wait_for(pred, what, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("router_sglang"))
    model = build_tiny_llama(os.path.join(work, "tiny_llama"))
    port, name = free_port(), f"sg{os.getpid()}"
    pp = os.environ.get("PYTHONPATH")
    env = dict(OFFLINE_ENV, PYTHONPATH=STUBS + (os.pathsep + pp if pp else ""), KVCACHED_PAGE_SIZE=str(KV_PAGE))
    cfg = {
        "port": port,
        "log_dir": os.path.join(work, "logs"),
        "health_interval_s": 1,
        "wake_timeout_s": BOUND_S,
        "kvcached": {"host_memory_budget": str(16 << 20)},
        "models": [
            {
                "name": name,
                "engine": "sglang",
                "model": model,
                "args": ARGS,
                "env": env,
                "idle_seconds": IDLE_S,
                "sleep": "kv",
            }
        ],
    }
    with open(os.path.join(work, "router.json"), "w") as f:
        json.dump(cfg, f)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED", "SGLANG_"))}
    log_path = os.path.join(work, "router.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached.router", "serve", os.path.join(work, "router.json")],
            env=clean,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def call(method, path, body=None, timeout=BOUND_S):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def state():
        try:
            return json.loads(call("GET", "/health", timeout=5)[1])["models"][name]
        except OSError:
            return None

    r = type(
        "R", (), {"proc": proc, "name": name, "port": port, "call": staticmethod(call), "state": staticmethod(state)}
    )
    r.instance = f"kvcached_router_{name}"
    try:
        wait_for(lambda: proc.poll() is not None or state() == "ready", "ready")
        assert proc.poll() is None, open(log_path).read()[-3000:]
        yield r
    except BaseException:
        print(open(log_path).read()[-3000:])
        for f in os.listdir(cfg["log_dir"]):
            print(open(os.path.join(cfg["log_dir"], f), errors="replace").read()[-3000:])
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _complete(r, prompt, stream=False):
    body = {"model": r.name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if not stream:
        status, out = r.call("POST", "/v1/completions", body)
        assert status == 200, out
        return json.loads(out)["choices"][0]["text"]
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=BOUND_S)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    text, events = "", 0
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            events += 1
            text += "".join(c.get("text") or "" for c in json.loads(line[5:])["choices"])
    conn.close()
    assert events >= 1  # the count is the engine's timing; pass-through: test_router_proxy.py
    return text


def _record(r):
    return next((x for x in list_records() if x.name == r.instance and x.alive), None)


def test_sglang_behind_the_router_sleeps_and_wakes(router):
    reference = [_complete(router, p) for p in PROMPTS]
    assert all(reference)
    assert _complete(router, PROMPTS[0], stream=True) == reference[0]
    serving = _record(router)
    assert serving.limit > 0
    wait_for(lambda: router.state() == "asleep", "asleep after idle")
    # Given back: the cached prompts' pages unmapped; the page of SGLang's padding slot stays.
    rec = wait_for(
        lambda: (x := _record(router)) and x.limit == 0 and x.prealloc == 0 and x.used < serving.used and x,
        "KV given back",
    )
    assert [_complete(router, p) for p in PROMPTS] == reference
    after = _record(router)
    assert after.owner_pid == rec.owner_pid and after.limit > 0
    print(f"\n[router-sglang] used bytes serving {serving.used}, asleep {rec.used}")
    pgid = os.getpgid(after.owner_pid)
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(120) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    # SGLang's launcher SIGKILLs its scheduler on the way out (launch_server's kill_process_tree), so
    # the scheduler cannot remove its record: it may stay behind dead (reclaimed by the next start).
    assert _record(router) is None
