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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# Server helpers shared with the main job and the benchmark (re-exported here).
from kvcached.testing.vllm_server import (  # noqa: F401
    Server,
    complete,
    metrics,
    start_server,
    stream_batch,
    wait_healthy,
)

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
    from kvcached.testing.vllm_server import token_prompts

    return token_prompts(n, length, seed)


LONG_DECODE = 100  # tokens generated per request of decode_prompts()


def decode_prompts(n: int = 8) -> List[List[int]]:
    """Prompts of one block (100 tokens) that need a second block at token 128
    while decoding: under a tight limit, running requests must be preempted."""
    return prompts(n, length=99, seed=2)


PREFIX_GROUPS = 8  # shared_prefix_prompts(): more distinct prefix blocks than a 1 MiB limit holds (6)
PREFIX_DECODE = 20


def shared_prefix_prompts(per_group: int = 2) -> List[List[int]]:
    """``PREFIX_GROUPS`` groups of ``per_group`` prompts; a group shares its first
    full block (128 tokens: a prefix-cache entry) and has distinct 100-token tails."""
    heads = prompts(PREFIX_GROUPS, length=BLOCK_TOKENS - 1, seed=4)
    tails = prompts(PREFIX_GROUPS * per_group, length=101, seed=5)
    return [heads[g] + tails[g * per_group + i][1:] for g in range(PREFIX_GROUPS) for i in range(per_group)]


GROW_DECODE = 200  # tokens generated per request of grow_prompts()


def grow_prompts(n: int = 8) -> List[List[int]]:
    """Short prompts (20 tokens) that need their second block only after ~108 decode
    steps: time to lower a limit while every request still decodes in its first block."""
    return prompts(n, length=19, seed=3)


def engine_env(kvcached: bool, name: Optional[str] = None, **extra: str) -> Dict[str, str]:
    from kvcached.testing.vllm_server import engine_env as base

    env = base(kvcached, name)
    if kvcached:
        env.update(
            KVCACHED_PAGE_SIZE=str(PAGE),
            KVCACHED_MIN_RESERVED_PAGES="0",
            KVCACHED_MAX_RESERVED_PAGES=str(MAX_RESERVED_PAGES),
        )
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ------------------------------------------------------------------- driver


def run_driver(
    model: str, out: str, env: dict, *args: str, script: str = "vllm_offline_driver.py", timeout: float = 900
) -> dict:
    """Runs a driver script of this folder in its own process; its JSON result (its log: OUT.log)."""
    log = out + ".log"
    with open(log, "w") as f:
        p = subprocess.run(
            [sys.executable, os.path.join(HERE, script), model, out, *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=os.path.dirname(out),
        )
    if p.returncode != 0:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-80:])
        raise AssertionError(f"driver failed ({p.returncode}):\n{tail}")
    with open(out) as f:
        return json.load(f)


def engine_counters(llm) -> dict:
    """An offline LLM's prefix-cache and preemption counters, summed over labels (in a driver)."""
    out: dict = {}
    for m in llm.get_metrics():
        if "prefix_cache" in m.name or "preemption" in m.name:
            v = getattr(m, "value", None)
            if v is not None:
                out[m.name] = out.get(m.name, 0) + v
    return out


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
    """Samples the records of ``names`` (and the memfds of each owner and its workers)
    every ``period`` s."""

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
                    # The owner too: with the engine core in process, the worker is the owner.
                    self._children[pid] = [pid] + children(pid)
                s[n + ":worker"] = sum(kvcached_physical_bytes(c) for c in self._children[pid])
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def mapped(rec: Optional[dict]) -> int:
    return 0 if rec is None else rec["used"] + rec["prealloc"]


def kvctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "kvctl"), *args], capture_output=True, text=True, timeout=60)
