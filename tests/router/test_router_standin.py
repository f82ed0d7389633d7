"""A stand-in engine for the router's unit tests (no tests in this file).

A real HTTP server in its own process that answers what the router uses of a
vLLM/SGLang OpenAI server: ``/health``, ``/v1/completions`` and
``/v1/chat/completions`` (JSON, or server-sent events with chunked encoding as
uvicorn sends them), the sleep endpoints of both engines, and ``/stats`` (what
it saw). It tests the router, not an engine: tests/engines/router runs real vLLM.

Started through ``standin_python(tmp_path)``: an executable that takes the
router's engine command line (``-m vllm.entrypoints...``/``--port`` ...).
Environment: ``STANDIN_START_DELAY`` seconds before it listens;
``STANDIN_FAIL_FILE``: while that file exists the process exits 3 at start;
``STANDIN_BIND_GATE``: it listens only once that file exists;
``STANDIN_GATE``: a stream's second event waits until ``POST /open_gate``;
``STANDIN_WAKE_FAIL_FILE``: while that file exists the wake endpoints answer 500;
``STANDIN_BUSY_FILE``: while that file exists ``/flush_cache`` answers 400 (not idle);
``STANDIN_HIGHEST_PORT``: started as SGLang on a port above it, the process exits 1 at start
(as SGLang 0.5.15 does above 55535: its derived gRPC port would pass 65535);
a request whose prompt is ``crash`` kills the process before it answers (after a
line in ``STANDIN_CRASH_LOG``, when set).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.abspath(__file__)


def standin_python(tmp_path) -> str:
    """An executable to put in a model's ``python:`` that runs this stand-in."""
    path = os.path.join(str(tmp_path), "standin-python")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {sys.executable} {HERE} "$@"\n')
    os.chmod(path, 0o755)
    return path


class _State:
    name = ""
    sleeping = False
    calls: list = []
    headers: dict = {}  # of the last POST
    gate = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def _json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/stats":
            self._json(
                200,
                {
                    "pid": os.getpid(),
                    "name": _State.name,
                    "sleeping": _State.sleeping,
                    "calls": _State.calls,
                    "headers": _State.headers,
                },
            )
        else:
            self._json(404, {"error": self.path})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _State.calls.append(self.path)
        _State.headers = dict(self.headers.items())
        if self.path in ("/sleep?level=1", "/release_memory_occupation"):
            _State.sleeping = True
            return self._json(200, {})
        if self.path in ("/wake_up", "/resume_memory_occupation"):
            if os.path.exists(os.environ.get("STANDIN_WAKE_FAIL_FILE", "/nonexistent")):
                return self._json(500, {"error": "the weights could not be restored"})  # a failed wake
            _State.sleeping = False
            return self._json(200, {})
        if self.path.startswith("/flush_cache"):  # SGLang's: 400 while requests remain
            busy = os.path.exists(os.environ.get("STANDIN_BUSY_FILE", "/nonexistent"))
            return self._json(400 if busy else 200, {})
        if self.path == "/open_gate":
            _State.gate.set()
            return self._json(200, {})
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": self.path})
        req = json.loads(body)
        if req.get("model") != _State.name:
            return self._json(404, {"error": {"message": f"model {req.get('model')} not served here"}})
        if _State.sleeping:
            return self._json(500, {"error": "asleep"})
        if req.get("prompt") == "crash":  # a request that takes the engine down with it
            if os.environ.get("STANDIN_CRASH_LOG"):
                with open(os.environ["STANDIN_CRASH_LOG"], "a") as f:
                    f.write(f"{os.getpid()}\n")
            os._exit(9)
        words = [f"{_State.name}-{i}" for i in range(int(req.get("max_tokens", 3)))]
        if not req.get("stream"):
            return self._json(200, {"model": _State.name, "pid": os.getpid(), "choices": [{"text": " ".join(words)}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, w in enumerate(words + ["[DONE]"]):
            if i == 1 and os.environ.get("STANDIN_GATE"):
                _State.gate.wait(60)  # the test saw the first event before the second exists
            data = "data: [DONE]\n\n" if w == "[DONE]" else "data: " + json.dumps({"choices": [{"text": w}]}) + "\n\n"
            raw = data.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def main(argv) -> None:
    if os.path.exists(os.environ.get("STANDIN_FAIL_FILE", "/nonexistent")):
        sys.exit(3)
    port = int(argv[argv.index("--port") + 1])
    if "sglang.launch_server" in argv and port > int(os.environ.get("STANDIN_HIGHEST_PORT", "65535")):
        sys.exit(f"ValueError: SGLANG_GRPC_PORT ({port + 10000}) must be between 1 and 65535")
    _State.name = argv[argv.index("--served-model-name") + 1]
    time.sleep(float(os.environ.get("STANDIN_START_DELAY", "0")))
    while os.environ.get("STANDIN_BIND_GATE") and not os.path.exists(os.environ["STANDIN_BIND_GATE"]):
        time.sleep(0.05)  # the test has its port until then
    # A listen queue like the real engines' servers (uvicorn: 2048), not socketserver's 5:
    # the router forwards a burst's requests at once.
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler, bind_and_activate=False)
    server.request_queue_size = 1024
    server.server_bind()
    server.server_activate()
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
