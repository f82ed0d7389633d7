"""Shared pieces of the GPU proof (scripts/gpu_engines.sh): starting vLLM and
SGLang servers and offline engines with and without kvcached on one device,
limits, and a one-line log. Runs with the python that has the engine and
kvcached installed.

``--cpu`` in every step swaps the GPU settings for the tiny model on the CPU
engines, so the whole proof can be dry-run on a machine without a GPU before
device time is spent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from kvcached.testing import sglang_server as ss
from kvcached.testing import vllm_server as vs

GIB = 1 << 30
# SGLang's CPU path imports vllm._custom_ops.rotary_embedding: the tests' stub (never called).
SGLANG_STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "engines", "sglang_stubs")


def log(msg: str) -> None:
    print(f"[gpu-proof {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def base_args(cpu: bool, max_model_len: int) -> List[str]:
    """vLLM's defaults on the device (CUDA graphs, async scheduling, prefix
    caching), with only the dtype and context length set; the tiny CPU model
    runs eager in float32."""
    if cpu:
        return ["--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
    return ["--dtype", "bfloat16", "--max-model-len", str(max_model_len)]


# kvcached settings a step gives its kvcached engines through this process's environment
# (``KVCACHED_ZERO_PAGE=ro`` for the -ro steps; ``KVCACHED_ALLOW_UNSUPPORTED`` for an earlier
# commit's kvcached; ``KVCACHED_KEEP_NULL_PAGE`` for three-keep; ``KVCACHED_PAGE_SIZE`` for the
# limit steps whose blocks must divide the page): ``vs.engine_env`` starts every
# engine without this process's KVCACHED_* variables, so these are passed on by name (before
# 12-06 they were not: the -ro steps ran rw).
STEP_SETTINGS = ("KVCACHED_ZERO_PAGE", "KVCACHED_ALLOW_UNSUPPORTED", "KVCACHED_KEEP_NULL_PAGE", "KVCACHED_PAGE_SIZE")

# Kernel choices each engine process makes by timing change its numbers: Inductor benchmarks a
# reduction's configs and Triton's @autotune (vLLM's GDN and Mamba kernels) its configs in every
# process, so two processes of one engine may compute other tokens. 12-06, H100, MLA under a
# limit: the natives that loaded their compiled graph from the cache gave other tokens than
# kvcached-limit and native-bi (which compiled theirs) in 65 of 200 at 11:27 and in none at 14:48,
# while those two gave the very same tokens in both sessions. Token comparisons pin the choices in
# every engine alike: Triton's first valid config (vLLM's own switch), and a reduction's config by
# Inductor's fixed rule (that of TORCHINDUCTOR_DETERMINISTIC, whose ban on every other benchmark
# would stop vLLM's compile: it benchmarks combo kernels, which change no numbers).
PINNED_KERNELS = {"VLLM_TRITON_FORCE_FIRST_CONFIG": "1", "TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS": "1"}


def engine_env(kvcached: bool, name: str, cpu: bool, budget_fraction: float, **extra: object) -> Dict[str, str]:
    """Environment of one engine: kvcached on or off, the device budget of every
    kvcached instance on the device (``budget_fraction`` of its memory), and the
    ``STEP_SETTINGS`` this process has (kvcached engines only)."""
    more: Dict[str, object] = dict(extra)
    if kvcached:
        for k in STEP_SETTINGS:
            if os.environ.get(k):
                more.setdefault(k, os.environ[k])
        if cpu:
            more.setdefault("KVCACHED_HOST_MEMORY_BUDGET", f"{int(budget_fraction * 8 * GIB)}")
        else:
            more.setdefault("KVCACHED_GPU_UTILIZATION", f"{budget_fraction}")
    if os.environ.get("PYTHONPATH"):
        # On the device PYTHONPATH (/tmp/sc) makes /tmp/site, where vLLM and kvcached
        # are installed, a site directory of every process: keep it.
        more.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    return vs.engine_env(kvcached, name if kvcached else None, **more)


def start_server(
    model: str,
    name: str,
    kvcached: bool,
    log_dir: str,
    *,
    cpu: bool,
    kv_bytes: int,
    budget_fraction: float = 0.3,
    max_model_len: Optional[int] = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    **env_extra: object,
) -> vs.Server:
    """An OpenAI server with ``kv_bytes`` of KV capacity (explicit, so servers
    started side by side never size their KV from each other's free memory; with
    kvcached it is virtual and pages are mapped on demand). ``python``: the
    interpreter that has vLLM (another engine's proof may drive it)."""
    env = engine_env(kvcached, name, cpu, budget_fraction, **env_extra)
    args = [*base_args(cpu, max_model_len or (512 if cpu else 4096)), "--kv-cache-memory-bytes", str(kv_bytes)]
    if not cpu:
        # Only the start-up free-memory check reads this once KV bytes are explicit:
        # low, so several servers fit on one device.
        args += ["--gpu-memory-utilization", "0.2"]
    # Absolute: the server runs in log_dir.
    return vs.start_server(os.path.abspath(model), name, env, log_dir, *extra_args, base_args=args, python=python)


def kv_token_bytes(model: str, dtype_bytes: int) -> int:
    """KV bytes of one token over all layers of the model in ``model``: MLA keeps one
    latent (+ its rope part) per layer, attention K and V of every KV head."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    layers = c["num_hidden_layers"]
    if c.get("kv_lora_rank"):
        return layers * (c["kv_lora_rank"] + c.get("qk_rope_head_dim", 0)) * dtype_bytes
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return layers * 2 * heads * head_dim * dtype_bytes


def sglang_args(model: str, cpu: bool, kv_bytes: int, max_model_len: Optional[int] = None) -> List[str]:
    """``launch_server`` arguments of the proof: SGLang's defaults on the device (CUDA graphs,
    overlap scheduler, radix cache, its attention backend) with ``kv_bytes`` of KV capacity
    (``--max-total-tokens``, so servers side by side never size their pools from each other's
    free memory) and metrics on; the CPU backend's settings with ``cpu``."""
    tokens = kv_bytes // kv_token_bytes(model, 4 if cpu else 2)
    args = ["--max-total-tokens", str(tokens), "--context-length", str(max_model_len or (512 if cpu else 4096))]
    args += ["--random-seed", "0", "--enable-metrics"]
    if cpu:
        args += ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native"]
        return args + ["--sampling-backend", "pytorch", "--disable-cuda-graph"]
    return args + ["--dtype", "bfloat16"]


def sglang_pythonpath(cpu: bool, path: Optional[str] = None) -> str:
    """PYTHONPATH of an SGLang process: ``path`` (default this process's), on the CPU behind the
    test stub for ``vllm._custom_ops`` that SGLang's CPU path imports (never called)."""
    path = path if path is not None else os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in ((SGLANG_STUBS if cpu else ""), path) if p)


def start_sglang_server(
    model: str,
    name: str,
    kvcached: bool,
    log_dir: str,
    *,
    cpu: bool,
    kv_bytes: int,
    budget_fraction: float = 0.3,
    max_model_len: Optional[int] = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    **env_extra: object,
) -> vs.Server:
    """``python -m sglang.launch_server`` unchanged with ``sglang_args``; kvcached through
    autopatch, as a user runs it. ``python``: the interpreter that has SGLang."""
    env_extra["PYTHONPATH"] = sglang_pythonpath(cpu, env_extra.get("PYTHONPATH"))  # type: ignore[arg-type]
    if kvcached:
        env_extra.setdefault("KVCACHED_AUTOPATCH", "1")
    env = engine_env(kvcached, name, cpu, budget_fraction, **env_extra)
    args = sglang_args(model, cpu, kv_bytes, max_model_len)
    log_dir = os.path.abspath(log_dir)
    return ss.start_server(os.path.abspath(model), name, env, log_dir, *args, *extra_args, python=python)


def budget_env(kv: int, cpu: bool) -> Dict[str, str]:
    """The device budget of every kvcached instance of a run: ``kv`` bytes."""
    if cpu:
        return {"KVCACHED_HOST_MEMORY_BUDGET": str(kv)}
    import torch

    return {"KVCACHED_GPU_UTILIZATION": f"{kv / torch.cuda.get_device_properties(0).total_memory:.6f}"}


def add_engine_args(ap: Any) -> None:
    """``--vllm-python/--vllm-path/--sglang-python/--sglang-path``: each engine's interpreter and
    PYTHONPATH (their packages clash: on the H200 /tmp/sc-vllm and /tmp/sc-sglang)."""
    for engine, name in (("vllm", "vLLM"), ("sglang", "SGLang")):
        ap.add_argument(f"--{engine}-python", default=sys.executable, help=f"the interpreter that has {name}")
        ap.add_argument(f"--{engine}-path", default=None, help=f"PYTHONPATH of the {name} engines (default: ours)")


def wait_all(servers: Sequence[vs.Server], timeout: float) -> float:
    """Waits until every server answers /health; returns the seconds it took."""
    t0 = time.monotonic()
    for s in servers:
        vs.wait_healthy(s, timeout=max(1.0, timeout - (time.monotonic() - t0)))
    return time.monotonic() - t0


def kvctl(*args: str) -> str:
    """Runs ``kvctl`` (the installed CLI, as an operator would); raises with its output on failure."""
    out = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"kvctl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip() or out.stdout}")
    return out.stdout


def write_json(path: str, obj: object) -> None:
    """Written whole or not at all: another process may be waiting for the file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def first_differing_token(x: Sequence[int], y: Sequence[int]) -> int:
    """The index of the first token where two greedy outputs differ (the shorter one's
    length where it is a prefix of the other)."""
    return next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


# ------------------------------------------------------------ kvcached serve (the router)


def router_budget(kv: int, cpu: bool, device_bytes: Optional[int] = None) -> Dict[str, object]:
    """The ``kvcached`` section of a ``kvcached serve`` config: ``kv`` bytes shared by its
    models; on the device a utilization of ``device_bytes`` (default: device 0's memory)."""
    if cpu:
        return {"host_memory_budget": str(kv)}
    if device_bytes is None:
        import torch

        device_bytes = torch.cuda.get_device_properties(0).total_memory
    return {"gpu_utilization": round(kv / device_bytes, 6)}


def router_model(
    name: str,
    engine: str,
    model: str,
    *,
    cpu: bool,
    kv: int,
    max_model_len: int,
    sleep: str,
    idle: float,
    python: str,
    path: Optional[str] = None,
    vllm_gpu_args: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
) -> Dict[str, object]:
    """One model of a ``kvcached serve`` config: ``engine`` (vllm or sglang) serving ``model``
    with ``kv`` bytes of KV capacity (vLLM: ``base_args`` and ``--kv-cache-memory-bytes``, plus
    ``vllm_gpu_args`` on the device; SGLang: ``sglang_args``), run by ``python`` with
    ``path`` as PYTHONPATH (default: this process's) and ``env`` besides."""
    model = os.path.abspath(model)
    if engine == "vllm":
        args = [*base_args(cpu, max_model_len), "--kv-cache-memory-bytes", str(kv)]
        if not cpu:
            args += vllm_gpu_args
        path = path or os.environ.get("PYTHONPATH", "")
    else:
        args = sglang_args(model, cpu, kv, max_model_len)
        path = sglang_pythonpath(cpu, path)
    return {
        "name": name,
        "engine": engine,
        "model": model,
        "args": [*args, *extra_args],
        "env": {**(env or {}), **({"PYTHONPATH": path} if path else {})},
        "idle_seconds": idle,
        "sleep": sleep,
        "python": python,
    }


def router_config(out: str, port: int, budget: Dict[str, object], models: List[Dict], **more: object) -> Dict:
    """A ``kvcached serve`` config on ``127.0.0.1:port`` (engine logs under ``out``): long
    wake and start timeouts (a cold GPU engine takes minutes), ``more`` (e.g. ``max_awake``)."""
    return {
        "host": "127.0.0.1",
        "port": port,
        **more,
        "wake_timeout_s": 900,
        "start_timeout_s": 900,
        "health_interval_s": 1,
        "log_dir": os.path.abspath(out),
        "kvcached": budget,
        "models": models,
    }


def start_router(cfg: Dict, out: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """``python -m kvcached.router serve OUT/router.json`` (``cfg`` written there) in a child
    process whose output goes to ``OUT/router.log``."""
    cfg_path = os.path.join(out, "router.json")
    write_json(cfg_path, cfg)
    cmd = [sys.executable, "-m", "kvcached.router", "serve", cfg_path]
    with open(os.path.join(out, "router.log"), "w") as logf:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)


def router_states(port: int) -> Dict[str, str]:
    """{model: state} from the router's ``/v1/models``."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return {m["id"]: m.get("state", "?") for m in json.load(r)["data"]}
