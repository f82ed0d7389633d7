"""What the real-vLLM tests share: the workload, engine environments, servers,
records, and the worker's physical memory as the OS sees it.

Geometry of the tiny model under test: 2 layers, 2 KV heads x 32 (K+V) fp32,
vLLM CPU block of 128 tokens = 64 KiB per layer. With KVCACHED_PAGE_SIZE=128K a
kvcached page holds 2 blocks; one page offset maps 2 x 128 KiB (one per layer),
so ``BPP`` (bytes per page in the record) is 256 KiB.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional

PAGE = 128 << 10
LAYERS = 2
BPP = PAGE * LAYERS
MAX_RESERVED_PAGES = 2
BLOCK_TOKENS = 128
MAX_TOKENS = 32
HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def prompts(n: int, length: int = 200, seed: int = 1) -> List[List[int]]:
    """``n`` distinct token-id prompts (BOS + ``length`` ids), no shared prefix."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [1, 7 + (i % 500)] + [rng.randrange(7, 512) for _ in range(length - 1)]
        out.append(ids)
    return out


LONG_DECODE = 100  # tokens generated per request of decode_prompts()


def decode_prompts(n: int = 8) -> List[List[int]]:
    """Prompts of one block (100 tokens) that need a second block at token 128
    while decoding: under a tight limit, running requests must be preempted."""
    return prompts(n, length=99, seed=2)


def engine_env(kvcached: bool, name: Optional[str] = None, **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENABLE_KVCACHED", "KVCACHED_", "VLLM_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if kvcached:
        env.update(
            ENABLE_KVCACHED="true",
            KVCACHED_PAGE_SIZE=str(PAGE),
            KVCACHED_MIN_RESERVED_PAGES="0",
            KVCACHED_MAX_RESERVED_PAGES=str(MAX_RESERVED_PAGES),
        )
        if name:
            env["KVCACHED_IPC_NAME"] = name
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ------------------------------------------------------------------- driver


def run_driver(model: str, out: str, env: dict, *args: str, timeout: float = 900) -> dict:
    log = out + ".log"
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_offline_driver.py"), model, out, *args],
                           env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=os.path.dirname(out))
    if p.returncode != 0:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-80:])
        raise AssertionError(f"driver failed ({p.returncode}):\n{tail}")
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------ records


def read_record(name: str) -> Optional[dict]:
    from kvcached.limits.records import read_record as rr

    try:
        return rr(name).to_dict()
    except Exception:
        return None


def socket_root(name: str) -> str:
    from kvcached.ipc.paths import socket_root as sr

    return sr(name)


def children(pid: int) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def kvcached_physical_bytes(pid: int) -> int:
    """Committed bytes of every kvcached page memfd process ``pid`` holds."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvcached-page"):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            continue
    return total


@dataclass
class Sampler:
    """Samples the records of ``names`` (and the workers' memfds) every ``period`` s."""

    names: List[str]
    period: float = 0.01
    workers: bool = True
    samples: List[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    _children: Dict[int, List[int]] = field(default_factory=dict)

    def sample(self) -> dict:
        s: Dict[str, object] = {"t": time.monotonic()}
        for n in self.names:
            r = read_record(n)
            s[n] = r
            if self.workers and r is not None and r["alive"]:
                pid = r["owner_pid"]
                if pid not in self._children:  # the EngineCore's workers: scanning /proc is slow
                    self._children[pid] = children(pid)
                s[n + ":worker"] = sum(kvcached_physical_bytes(c) for c in self._children[pid])
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period)

    def __enter__(self) -> "Sampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def mapped(rec: Optional[dict]) -> int:
    return 0 if rec is None else rec["used"] + rec["prealloc"]


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def kill9(self, timeout: float = 30) -> None:
        """SIGKILL to every process of the engine (API server, EngineCore, worker)."""
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


def start_server(model: str, name: str, env: Dict[str, str], log_dir: str, *extra_args: str) -> Server:
    port = free_port()
    log_path = os.path.join(log_dir, f"{name}.log")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
        "--enforce-eager", "--seed", "0", *extra_args,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=log_dir)
    log.close()
    return Server(name, port, proc, log_path)


def wait_healthy(srv: Server, timeout: float = 420) -> None:
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


def complete(port: int, model: str, prompt_ids: List[int], max_tokens: int = MAX_TOKENS, timeout: float = 300) -> List[int]:
    body = json.dumps({
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True,
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return list(out["choices"][0]["token_ids"])


def metrics(port: int) -> Dict[str, float]:
    """Prometheus counters summed over labels: {'vllm:num_preemptions_total': ...}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def kvctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "kvctl"), *args], capture_output=True, text=True, timeout=60)
