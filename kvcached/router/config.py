"""The router's config file: which models to serve, how, and when they sleep.

A YAML (needs PyYAML) or JSON file::

    port: 8080                      # the router's one endpoint
    wake_timeout_s: 300             # how long a request for a sleeping model may wait
    max_awake: 3                    # at most this many engines hold their weights at once (absent: all)
    kvcached:                       # shared by every engine the router starts
      gpu_utilization: 0.9          # -> KVCACHED_GPU_UTILIZATION
      host_memory_budget: 8G        # -> KVCACHED_HOST_MEMORY_BUDGET (CPU backend)
    models:
      - name: llama-8b              # what requests put in "model"
        engine: vllm                # vllm | sglang
        model: /models/llama-8b     # path (must exist) or a hub id
        args: [--max-model-len, "4096"]
        env: {CUDA_VISIBLE_DEVICES: "0"}
        idle_seconds: 600           # asleep after this long without requests (absent: never)
        sleep: auto                 # auto | engine | stop | kv (docs/ROUTER.md)

Every problem is one ``ConfigError`` line naming the file, the entry and the fix.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

ENGINES = ("vllm", "sglang")
SLEEP_MODES = ("auto", "engine", "stop", "kv")
# The options each engine needs for its own sleep to keep the model: vLLM's sleep mode; SGLang's
# memory saver and the host copy of its weights (without it the release drops the weights and the
# resume maps empty memory in their place: the woken model would answer, wrongly).
ENGINE_SLEEP_FLAGS: Dict[str, Tuple[str, ...]] = {
    "vllm": ("--enable-sleep-mode",),
    "sglang": ("--enable-memory-saver", "--enable-weights-cpu-backup"),
}

_TOP_KEYS = {
    "max_awake",
    "host",
    "port",
    "models",
    "wake_timeout_s",
    "request_timeout_s",
    "health_interval_s",
    "start_timeout_s",
    "restart_backoff_s",
    "restart_backoff_max_s",
    "stop_timeout_s",
    "log_dir",
    "kvcached",
}
_MODEL_KEYS = {"name", "engine", "model", "args", "env", "idle_seconds", "sleep", "port", "python", "kvcached"}
_KVCACHED_KEYS = {"gpu_utilization", "host_memory_budget"}


class ConfigError(ValueError):
    """A config the router cannot serve; the message is one line naming the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """One model behind the router: one engine process group."""

    name: str
    engine: str
    model: str
    args: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    idle_seconds: Optional[float] = None
    sleep: str = "auto"
    port: Optional[int] = None
    python: str = sys.executable
    kvcached: bool = True

    @property
    def instance(self) -> str:
        """The kvcached instance name (``KVCACHED_IPC_NAME``) of this model's engine."""
        safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in self.name)
        return f"kvcached_router_{safe}"[:127]

    def sleep_mode(self) -> str:
        """``sleep`` with ``auto`` resolved: the engine's own sleep when it was started
        able to sleep and wake as it was (its options in ``args``), else the process is stopped."""
        if self.sleep != "auto":
            return self.sleep
        return "stop" if self.missing_sleep_flags() else "engine"

    def missing_sleep_flags(self) -> List[str]:
        """The options of ``ENGINE_SLEEP_FLAGS`` this engine's ``args`` lack."""
        return [f for f in ENGINE_SLEEP_FLAGS[self.engine] if f not in self.args]


@dataclass(frozen=True)
class RouterConfig:
    models: Tuple[ModelSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    wake_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    start_timeout_s: float = 600.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    stop_timeout_s: float = 30.0
    log_dir: str = "."
    kvcached_env: Mapping[str, str] = field(default_factory=dict)
    max_awake: Optional[int] = None  # engines holding their weights at once (None: no bound)
    source: str = "<config>"

    def model(self, name: str) -> Optional[ModelSpec]:
        return next((m for m in self.models if m.name == name), None)


def load_config(path: str) -> RouterConfig:
    """Reads and checks ``path`` (YAML or JSON); raises ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"config {path} is YAML, which needs PyYAML: pip install pyyaml, or write it as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path} is not valid YAML: {' '.join(str(e).split())}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config {path} is not valid JSON: {e}") from None
    base = os.path.dirname(os.path.abspath(path))
    return parse_config(data, source=path, base_dir=base)


def parse_config(data: Any, source: str = "<config>", base_dir: Optional[str] = None) -> RouterConfig:
    """Checks a loaded config mapping; relative paths are taken from ``base_dir``."""
    base_dir = base_dir or os.getcwd()

    def fail(where: str, what: str) -> ConfigError:
        return ConfigError(f"config {source}: {where}: {what}")

    if not isinstance(data, dict):
        raise fail("top level", "must be a mapping with a 'models' list")
    _unknown(data, _TOP_KEYS, "top level", fail)
    raw_models = data.get("models")
    if not isinstance(raw_models, list) or not raw_models:
        raise fail("models", "must be a non-empty list of models")
    models: List[ModelSpec] = []
    seen: Dict[str, int] = {}
    for i, raw in enumerate(raw_models):
        m = _parse_model(raw, f"models[{i}]", base_dir, fail)
        if m.name in seen:
            raise fail(f"models[{i}]", f"duplicate name {m.name!r} (also models[{seen[m.name]}]); names must differ")
        seen[m.name] = i
        models.append(m)
    ports = [m.port for m in models if m.port is not None]
    router_port = _port(data.get("port", 8080), "port", fail)
    if router_port in ports or len(set(ports)) != len(ports):
        raise fail("port", "the router and every model need their own port; leave engine ports out to pick free ones")
    kv = data.get("kvcached") or {}
    if not isinstance(kv, dict):
        raise fail("kvcached", "must be a mapping (gpu_utilization, host_memory_budget)")
    _unknown(kv, _KVCACHED_KEYS, "kvcached", fail)
    kv_env: Dict[str, str] = {}
    if "gpu_utilization" in kv:
        u = _number(kv["gpu_utilization"], "kvcached.gpu_utilization", fail)
        if not 0 < u <= 1:
            raise fail("kvcached.gpu_utilization", f"must be in (0, 1], got {u}")
        kv_env["KVCACHED_GPU_UTILIZATION"] = str(u)
    if "host_memory_budget" in kv:
        kv_env["KVCACHED_HOST_MEMORY_BUDGET"] = str(kv["host_memory_budget"])
    log_dir = str(data.get("log_dir", "."))
    max_awake = data.get("max_awake")
    if max_awake is not None and (isinstance(max_awake, bool) or not isinstance(max_awake, int) or max_awake < 1):
        raise fail("max_awake", f"must be a whole number >= 1 (leave it out for no bound), got {max_awake!r}")
    return RouterConfig(
        models=tuple(models),
        host=str(data.get("host", "127.0.0.1")),
        port=router_port,
        wake_timeout_s=_positive(data, "wake_timeout_s", 300.0, fail),
        request_timeout_s=_positive(data, "request_timeout_s", 600.0, fail),
        health_interval_s=_positive(data, "health_interval_s", 2.0, fail),
        start_timeout_s=_positive(data, "start_timeout_s", 600.0, fail),
        restart_backoff_s=_positive(data, "restart_backoff_s", 1.0, fail),
        restart_backoff_max_s=_positive(data, "restart_backoff_max_s", 60.0, fail),
        stop_timeout_s=_positive(data, "stop_timeout_s", 30.0, fail),
        log_dir=log_dir if os.path.isabs(log_dir) else os.path.join(base_dir, log_dir),
        kvcached_env=kv_env,
        max_awake=max_awake,
        source=source,
    )


def _parse_model(raw: Any, where: str, base_dir: str, fail) -> ModelSpec:
    if not isinstance(raw, dict):
        raise fail(where, "must be a mapping with name, engine and model")
    _unknown(raw, _MODEL_KEYS, where, fail)
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise fail(where, "needs a non-empty 'name' (what requests put in \"model\")")
    where = f"{where} ({name})"
    engine = raw.get("engine")
    if engine not in ENGINES:
        raise fail(where, f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}")
    model = raw.get("model")
    if not isinstance(model, str) or not model.strip():
        raise fail(where, "needs 'model': a checkpoint directory or a hub id")
    # A path (absolute, ./ ../ ~, or existing next to the config) must exist; anything else is a hub id.
    path = os.path.normpath(os.path.join(base_dir, os.path.expanduser(model)))
    if model.startswith(("/", ".", "~")) or os.path.exists(path):
        if not os.path.exists(path):
            raise fail(where, f"model path {path} does not exist; fix 'model'")
        model = path
    args = raw.get("args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise fail(where, "'args' must be a list of command-line arguments (or one string)")
    args = tuple(str(a) for a in args)
    for owned in ("--port", "--host", "--model", "--model-path", "--served-model-name"):
        if any(a == owned or a.startswith(owned + "=") for a in args):
            raise fail(where, f"'args' sets {owned}, which the router sets; remove it (use 'port'/'model')")
    env = raw.get("env", {}) or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise fail(where, "'env' must be a mapping of variable names to values")
    idle = raw.get("idle_seconds")
    if idle is not None:
        idle = _number(idle, f"{where}.idle_seconds", fail)
        if idle <= 0:
            raise fail(where, f"idle_seconds must be > 0 (leave it out to never sleep), got {idle}")
    sleep = raw.get("sleep", "auto")
    if sleep not in SLEEP_MODES:
        raise fail(where, f"unknown sleep {sleep!r}; use one of: {', '.join(SLEEP_MODES)}")
    python = str(raw.get("python") or sys.executable)
    if shutil.which(python) is None:
        raise fail(where, f"python {python} is not an executable; fix 'python' (the engine's interpreter)")
    kvcached = raw.get("kvcached", True)
    if not isinstance(kvcached, bool):
        raise fail(where, f"'kvcached' must be true or false, got {kvcached!r}")
    spec = ModelSpec(
        name=name,
        engine=engine,
        model=model,
        args=args,
        env={str(k): str(v) for k, v in env.items()},
        idle_seconds=idle,
        sleep=sleep,
        port=None if raw.get("port") is None else _port(raw["port"], f"{where}.port", fail),
        python=python,
        kvcached=kvcached,
    )
    mode = spec.sleep_mode()
    missing = spec.missing_sleep_flags()
    if mode == "engine" and missing:
        raise fail(
            where,
            f"sleep: engine needs {' and '.join(missing)} in 'args' (the {engine} engine sleeps and wakes "
            "with its weights only with them)",
        )
    if mode == "kv" and not kvcached:
        raise fail(where, "sleep: kv gives the KV cache back through kvcached; it needs kvcached: true")
    return spec


def _unknown(d: Dict[str, Any], known: set, where: str, fail) -> None:
    extra = sorted(str(k) for k in d if k not in known)
    if extra:
        raise fail(where, f"unknown key {extra[0]!r}; known keys: {', '.join(sorted(known))}")


def _number(v: Any, where: str, fail) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise fail(where, f"must be a number, got {v!r}")
    return float(v)


def _positive(d: Dict[str, Any], key: str, default: float, fail) -> float:
    if key not in d:
        return default
    v = _number(d[key], key, fail)
    if v <= 0:
        raise fail(key, f"must be > 0, got {v}")
    return v


def _port(v: Any, where: str, fail) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        raise fail(where, f"must be a port number 0..65535 (0: any free port), got {v!r}")
    return v
