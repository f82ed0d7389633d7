"""Many models behind one OpenAI-compatible endpoint: ``kvcached serve CONFIG``.

The router starts each configured model's engine (vLLM or SGLang, kvcached on,
one shared device budget) as a supervised child process, routes requests by
``model`` (streams included), restarts crashed engines, puts idle ones to sleep
and wakes them on demand. docs/ROUTER.md describes the config and behaviour.

Modules: ``config`` (the file), ``engines`` (command lines, environment, sleep
endpoints), ``supervisor`` (one engine's process and state), ``sleep`` (the
ways to sleep), ``router`` (supervision loop, idle policy, transitions),
``proxy`` (HTTP), ``peer_check`` (a connection reaches the engine the router
started, not whoever took its port) over ``tcp_table`` (the kernel's sockets),
``metrics`` (``/metrics``), ``server`` and ``cli`` (entry).
"""

from kvcached.router.config import ConfigError, ModelSpec, RouterConfig, load_config, parse_config

__all__ = ["ConfigError", "ModelSpec", "RouterConfig", "load_config", "parse_config"]
