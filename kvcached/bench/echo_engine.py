"""An engine that answers at once, for measuring what sits in front of engines.

``python -m kvcached.bench.echo_engine --port P [anything else]`` serves what
the router uses of a vLLM/SGLang OpenAI server: ``GET /health`` and ``POST
/v1/completions`` / ``/v1/chat/completions``: JSON, or with ``"stream": true``
``max_tokens`` server-sent events in chunked encoding (as uvicorn sends them),
each flushed on its own. No model, no work: the time a request takes through
it is the HTTP path's own. Other arguments (the router's engine command line)
are ignored. Used by ``python -m kvcached.bench router``.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as uvicorn: headers and body are separate writes

    def log_message(self, *args: object) -> None:  # quiet: one line per request would be the cost measured
        pass

    def do_GET(self) -> None:
        self._send(200, b'{"status":"ok"}' if self.path == "/health" else b"{}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        req = json.loads(body or b"{}")
        n = max(1, int(req.get("max_tokens") or 1))
        if not req.get("stream"):
            text = "x" * n
            self._send(200, json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": text}]}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            self._chunk(b"data: " + json.dumps({"choices": [{"index": 0, "text": str(i)}]}).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args, _ = p.parse_known_args(argv)
    ThreadingHTTPServer.request_queue_size = 2048  # uvicorn's backlog (the default 5 drops a burst of connects)
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
