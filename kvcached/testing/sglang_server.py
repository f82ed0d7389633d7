"""SGLang API servers for tests and the GPU proof: ``python -m sglang.launch_server``
unchanged, in its own process group, and the native ``/generate`` endpoint.

The process handling (log, kill, health wait) is ``vllm_server``'s; only the command
line and the request format are SGLang's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Sequence, Tuple

from kvcached.router.engines import HIGHEST_PORT
from kvcached.router.supervisor import free_port
from kvcached.testing.vllm_server import Server, metrics, wait_healthy  # noqa: F401  (re-exported)


def start_server(
    model: str,
    name: str,
    env: Dict[str, str],
    log_dir: str,
    *args: str,
    python: str = sys.executable,
) -> Server:
    """``python -m sglang.launch_server --model-path MODEL`` on a free loopback port with
    ``args`` (the caller's settings), logging to ``log_dir/<name>.log``."""
    port = free_port(highest=HIGHEST_PORT["sglang"])
    log_path = os.path.join(log_dir, f"{name}.log")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += args
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=log_dir)
    return Server(name, port, proc, log_path, model)


def generate(
    srv: Server, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], timeout: float = 1800
) -> Tuple[List[List[int]], List[int]]:
    """Greedy completions of every prompt (EOS ignored) in one ``/generate`` request: SGLang
    hands pre-tokenized batches to the scheduler as one message, so every request is queued
    before the first step and two engines see the same arrivals. Returns each prompt's output
    ids and its prompt tokens served from the prefix cache, in prompt order."""
    body = {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": [{"temperature": 0.0, "max_new_tokens": int(m), "ignore_eos": True} for m in max_tokens],
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: Any = json.loads(r.read())
    if isinstance(out, dict):
        out = [out]
    return [list(o["output_ids"]) for o in out], [int(o["meta_info"].get("cached_tokens", 0)) for o in out]


def stream(srv: Server, prompt_ids: Sequence[int], max_tokens: int, timeout: float = 300) -> Tuple[float, float, int]:
    """Streams one greedy completion through ``/generate``: (time to first token, total
    time, output tokens), as ``vllm_server.stream`` measures a vLLM server."""
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_tokens), "ignore_eos": True},
        "stream": True,
    }
    url = f"http://127.0.0.1:{srv.port}/generate"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    n = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = int(chunk.get("meta_info", {}).get("completion_tokens", n))
            if n and ttft is None:
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, n
