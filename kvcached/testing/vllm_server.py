"""Starting and driving vLLM OpenAI servers on the tiny model (CPU), for the
engine tests, the main job (scripts/main_job.py) and ``kvcached.bench vllm``.

Everything here talks to a server over HTTP with the standard library; only
the server processes import vLLM. ``vllm serve`` does not work with the CPU
wheel's distribution name, so servers start as
``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvcached.router.supervisor import free_port

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


ENV_ENGINE_PYTHONPATH = "KVCACHED_TEST_ENGINE_PYTHONPATH"


def token_prompts(n: int, length: int = 200, seed: int = 1) -> List[List[int]]:
    """``n`` distinct prompts of BOS + ``length`` token ids (no shared prefix)."""
    rng = random.Random(seed)
    return [[1, 7 + (i % 500)] + [rng.randrange(7, 512) for _ in range(length - 1)] for i in range(n)]


def engine_env(kvcached: bool, name: Optional[str] = None, **extra: object) -> Dict[str, str]:
    """This process's environment without any kvcached/vLLM settings or
    PYTHONPATH (the engine imports what is installed), plus the offline
    switches, kvcached on or off, and ``extra``.

    ``KVCACHED_TEST_ENGINE_PYTHONPATH`` (opt-in): the engine's PYTHONPATH, so a
    checkout's kvcached shadows the one installed in a shared, cached venv
    (run a branch's engine tests without installing it there)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ENABLE_KVCACHED", "KVCACHED_", "VLLM_")) and k != "PYTHONPATH"
    }
    env.update(OFFLINE_ENV)
    if os.environ.get(ENV_ENGINE_PYTHONPATH):
        env["PYTHONPATH"] = os.environ[ENV_ENGINE_PYTHONPATH]
    if os.environ.get("KVCACHED_TRACE"):  # a trace of the engines a test starts (kvcached.trace)
        env["KVCACHED_TRACE"] = os.environ["KVCACHED_TRACE"]
    if kvcached:
        env["ENABLE_KVCACHED"] = "true"
        env["KVCACHED_LOG_LEVEL"] = "INFO"  # kvcached's own lines (wants, give-backs) in the server log
        if name:
            env["KVCACHED_IPC_NAME"] = name
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class Server:
    """One API server process group (API server, EngineCore, worker)."""

    name: str
    port: int
    proc: subprocess.Popen
    log_path: str
    model: str

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def kill9(self, timeout: float = 30) -> None:
        """SIGKILL to every process of the engine; returns when all are gone."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the others die (and are reaped) asynchronously
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise RuntimeError(f"processes of {self.name} survived SIGKILL")

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the API server, as an operator stops it; vLLM stops the rest."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left behind
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(30)


def start_server(
    model: str,
    name: str,
    env: Dict[str, str],
    log_dir: str,
    *extra_args: str,
    max_num_seqs: int = 8,
    python: str = sys.executable,
    base_args: Optional[Sequence[str]] = None,
) -> Server:
    """Starts a server in its own process group (so it can be killed as a whole).

    ``base_args`` replaces the tiny-model CPU settings (float32, 256 tokens,
    ``max_num_seqs``, eager) with the caller's, e.g. a GPU run's defaults."""
    port = free_port()
    log_path = os.path.join(log_dir, f"{name}.log")
    restart = 1
    while os.path.exists(log_path):  # a restart under the same name keeps the earlier log
        restart += 1
        log_path = os.path.join(log_dir, f"{name}.{restart}.log")
    if base_args is None:
        base_args = (
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            str(max_num_seqs),
            "--enforce-eager",
        )
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *base_args,
        "--seed",
        "0",
        *extra_args,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=log_dir)
    return Server(name, port, proc, log_path, model)


def wait_healthy(srv: Server, timeout: float = 480) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server {srv.name} exited with {srv.proc.returncode}:\n{srv.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise RuntimeError(f"server {srv.name} not healthy after {timeout} s:\n{srv.log_tail()}")


def _post(port: int, body: dict, timeout: float) -> urllib.request.Request:
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def complete(
    srv: Server,
    prompt_ids: List[int],
    max_tokens: int,
    timeout: float = 300,
    on_first_token: Optional[Callable[[], None]] = None,
) -> List[int]:
    """Greedy completion of ``max_tokens`` tokens (EOS ignored); the output token ids.
    With ``on_first_token`` the completion is streamed and that is called once, when
    the first token arrives: from then on the engine is running the request."""
    body = {
        "model": srv.model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if on_first_token is None:
        with urllib.request.urlopen(_post(srv.port, body, timeout), timeout=timeout) as r:
            out = json.loads(r.read())
        return list(out["choices"][0]["token_ids"])
    tokens: List[int] = []
    with urllib.request.urlopen(_post(srv.port, {**body, "stream": True}, timeout), timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:]).get("choices", ()):
                if c.get("token_ids") and not tokens:
                    on_first_token()
                tokens.extend(c.get("token_ids") or ())
    return tokens


def stream_batch(
    srv: Server,
    prompts: List[List[int]],
    max_tokens: int,
    on_token: Callable[[int, bool], None],
    timeout: float = 300,
    extra: Optional[Dict[str, object]] = None,
) -> List[List[int]]:
    """Greedy completions of every prompt in one streamed request: the server hands them to
    the engine together (one by one, on a busy client, a fast engine may finish each before
    the next arrives). ``on_token(index, finished)`` is called for every chunk of a prompt's
    tokens; returns each prompt's output token ids, in prompt order. ``extra``: more fields
    of the request (e.g. vLLM's ``cache_salt``)."""
    body = {
        "model": srv.model,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stream": True,
        **(extra or {}),
    }
    out: List[List[int]] = [[] for _ in prompts]
    with urllib.request.urlopen(_post(srv.port, body, timeout), timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:]).get("choices", ()):
                i = int(c["index"])
                if "token_ids" not in c and c.get("text"):
                    # SGLang before 0.5.17 streams text only: an empty list here would compare equal.
                    raise RuntimeError(
                        f"the server on port {srv.port} streams no token_ids (return_token_ids): its greedy "
                        "tokens cannot be compared; use vLLM or SGLang 0.5.17+"
                    )
                out[i].extend(c.get("token_ids") or ())
                on_token(i, c.get("finish_reason") is not None)
    return out


def stream(srv: Server, prompt_ids: List[int], max_tokens: int, timeout: float = 300) -> Tuple[float, float, int]:
    """Streams a greedy completion: (time to first token, total time, output tokens). The
    count is the server's own (the usage chunk): a text chunk may hold several tokens
    (SGLang before 0.5.17 sends no token ids)."""
    body = {
        "model": srv.model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    n = 0
    usage: Optional[int] = None
    with urllib.request.urlopen(_post(srv.port, body, timeout), timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = int(chunk["usage"].get("completion_tokens", 0))
            for c in chunk.get("choices", ()):
                got = len(c.get("token_ids") or ()) or (1 if c.get("text") else 0)
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                n += got
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, (n if usage is None else usage)


def metrics(srv: Server) -> Dict[str, float]:
    """Prometheus samples summed over labels: {'vllm:num_preemptions_total': ...}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        try:
            out[name_labels.split("{", 1)[0]] = out.get(name_labels.split("{", 1)[0], 0.0) + float(value)
        except ValueError:
            continue
    return out
