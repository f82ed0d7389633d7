"""The router in this process over stand-in engine processes (tests/router/test_router_standin.py),
and the HTTP helpers the router tests share; the ``running`` fixture is in conftest.py."""

from __future__ import annotations

import http.client
import json
import threading
import time

from kvcached.router.config import parse_config
from kvcached.router.server import bind
from kvcached.router.supervisor import READY
from test_router_standin import standin_python

BOUND_S = 60  # every wait below is bounded by this; none is a timing assertion


def wait_for(pred, what: str, timeout: float = BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def request(port, method, path, body=None, timeout=BOUND_S):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def complete(port, model, **kw):
    status, _, body = request(port, "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, **kw})
    return status, json.loads(body)


class Running:
    """A router (in this process) over stand-in engines."""

    def __init__(self, tmp_path, models, **top):
        py = standin_python(tmp_path)
        for m in models:
            m.setdefault("engine", "vllm")
            m.setdefault("model", str(tmp_path))
            m.setdefault("kvcached", False)
            m["python"] = py
        top.setdefault("health_interval_s", 0.1)
        top.setdefault("restart_backoff_s", 0.1)
        top.setdefault("log_dir", str(tmp_path / "logs"))
        cfg = parse_config(dict(top, port=0, models=models))
        self.server = bind(cfg)
        self.router = self.server.router
        self.port = self.server.server_address[1]
        self.router.start()
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def ready(self, *names):
        for n in names or self.router.engines:
            wait_for(lambda n=n: self.router.engines[n].state == READY, f"{n} ready")

    def pid(self, name):
        return self.router.engines[name].proc.pid

    def close(self):
        self.server.shutdown()
        self.router.shutdown()
        self.server.server_close()
