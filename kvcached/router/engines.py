"""How each engine is started and put to sleep: command line, environment, endpoints.

vLLM starts as ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``
does not work with the CPU wheel's distribution name), SGLang as
``python -m sglang.launch_server``. Both serve the model under the router's
name (``--served-model-name``), so a request is forwarded unchanged.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Tuple

from kvcached.router.config import ModelSpec

# (method, path, JSON body or None) to put an engine to sleep and wake it, by engine.
SLEEP_CALLS: Dict[str, Tuple[Tuple[str, str, object], Tuple[str, str, object]]] = {
    # level 1: weights to host memory, KV cache discarded; /wake_up restores both.
    "vllm": (("POST", "/sleep?level=1", None), ("POST", "/wake_up", None)),
    "sglang": (("POST", "/release_memory_occupation", {}), ("POST", "/resume_memory_occupation", {})),
}
# Called before the sleep call, by engine: it must answer 200 (the engine is idle). SGLang's release
# asserts an idle scheduler (a failed assertion there ends the scheduler); its flush waits for
# idle up to the timeout, answers 400 when requests remain, and drops only what the release drops.
IDLE_CALLS: Dict[str, Tuple[str, str, object]] = {"sglang": ("POST", "/flush_cache?timeout=30", None)}
# The highest port an engine starts on, by engine. SGLang 0.5.15 derives a gRPC port of --port +
# 10000 and exits at start-up when it is above 65535, gRPC or not (ServerArgs; 0.5.16 checks it
# only in gRPC mode). The router cannot tell the engine's release: every SGLang gets the bound.
HIGHEST_PORT: Dict[str, int] = {"sglang": 65535 - 10000}


def engine_command(spec: ModelSpec, host: str, port: int) -> List[str]:
    """The engine's command line, listening on ``host:port``."""
    if spec.engine == "vllm":
        head = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
    else:
        head = [spec.python, "-m", "sglang.launch_server", "--model-path", spec.model]
    return [*head, "--served-model-name", spec.name, "--host", host, "--port", str(port), *spec.args]


def engine_env(
    spec: ModelSpec, kvcached_env: Mapping[str, str], base: Mapping[str, str] = os.environ
) -> Dict[str, str]:
    """The engine's environment: the router's, the shared kvcached budget, the model's
    own ``env`` (wins), and kvcached switched on or off with the model's instance name."""
    env = dict(base)
    env.update(kvcached_env)
    env.update(spec.env)
    if spec.kvcached:
        env["ENABLE_KVCACHED"] = "true"
        env["KVCACHED_IPC_NAME"] = spec.instance
    else:
        env["ENABLE_KVCACHED"] = "false"
        env.pop("KVCACHED_IPC_NAME", None)
    if spec.engine == "vllm" and spec.sleep_mode() == "engine":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep and /wake_up are development endpoints
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
