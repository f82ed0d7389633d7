"""Upstream kvcached's ``kvcached.utils``: its constants, errors, logger and helpers, over ours.

Code written against upstream (its ``controller/``, plugins, scripts) imports
these names. Each one is answered by the module that owns the concept here:

* the constants (``PAGE_SIZE``, ``CONTIGUOUS_LAYOUT``, ``DEFAULT_IPC_NAME``, ...)
  are read from ``kvcached.config`` / ``kvcached.naming`` when they are read
  (module ``__getattr__``), so a bad value raises the same one-line ValueError
  as everywhere else instead of being silently replaced by a default;
* ``KVCachedConfigError`` is an ``InvalidArgumentError`` (so also upstream's
  RuntimeError and a ValueError) and ``KVCachePoolExhausted`` an
  ``OutOfMemoryError`` that is also upstream's ValueError;
* ``get_kvcached_logger`` gives upstream's handler and format; kvcached's own
  modules log under the ``kvcached`` logger and take it over only when
  ``KVCACHED_LOG_LEVEL`` is set (``configure_logging``).

Differences from upstream are listed in docs/COMPAT.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from typing import Any

from kvcached import _C, config, naming
from kvcached.errors import InvalidArgumentError, OutOfMemoryError

SHM_DIR = "/dev/shm"


class KVCachedConfigError(InvalidArgumentError):
    """A configuration the user must fix (e.g. a KV block larger than the page);
    raised at start-up, never turned into a fallback."""


class KVCachePoolExhausted(OutOfMemoryError, ValueError):
    """The shared KV pool cannot back an allocation right now (recoverable
    pressure). A ValueError as upstream's, and an OutOfMemoryError as ours."""


def _sanitize_segment(segment: str) -> str:
    """Upstream's reduction of a name to ``[A-Za-z0-9_-]``, at most 64 characters."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in segment)[:64]


def _detect_engine_tag() -> str:
    """``vLLM``, ``SGLang`` or ``proc``: which engine is installed (upstream's helper)."""
    if importlib.util.find_spec("vllm") is not None:
        return "vLLM"
    if importlib.util.find_spec("sglang") is not None:
        return "SGLang"
    return "proc"


def _ipc_segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _engine() -> str:
    """The engine kvcached was initialized for in this process, else ``kvcached``."""
    runtime = sys.modules.get("kvcached.compat.runtime")
    engine = getattr(getattr(runtime, "_state", None), "engine", "") if runtime is not None else ""
    return engine or "kvcached"


def _obtain_default_ipc_name() -> str:
    """The instance name of this process (kvcached.naming, rule 1).

    ``KVCACHED_IPC_NAME`` exactly (validated: an invalid name raises ValueError
    naming the rule, where upstream rewrote it), else ``kvcached_<engine>_<pid>``.
    Never probes /dev/shm: a live record of the same name is refused when it
    is created, not silently given a suffix.
    """
    return naming.instance_name(_engine())


def _get_page_size() -> int:
    """The page size: the data plane's once initialized here, else the environment's."""
    return int(_C.config()["page_size"]) if _C.is_initialized() else config.page_size()


def _max_cached_tokens() -> int:
    n = config.max_cached_tokens()
    return -1 if n is None else n  # upstream: < 0 is unbounded


# Upstream's module constants, read when read.
_CONSTANTS = {
    "PAGE_SIZE": _get_page_size,
    "GPU_UTILIZATION": config.gpu_utilization,
    "PAGE_PREALLOC_ENABLED": config.page_prealloc_enabled,
    "MIN_RESERVED_PAGES": config.min_reserved_pages,
    "MAX_RESERVED_PAGES": config.max_reserved_pages,
    "MAX_CACHED_BLOCKS": config.max_cached_blocks,
    "SANITY_CHECK": config.sanity_check,
    "MAX_CACHED_TOKENS": _max_cached_tokens,
    "CONTIGUOUS_LAYOUT": config.contiguous_layout,
    "DEFAULT_IPC_NAME": _obtain_default_ipc_name,
    "LOG_USE_COLOR": config.log_color,
}


def __getattr__(name: str) -> Any:
    reader = _CONSTANTS.get(name)
    if reader is None:
        raise AttributeError(f"module 'kvcached.utils' has no attribute {name!r}")
    return reader()


def normalize_gpu_device(device: str) -> str:
    """``hip[:N]`` -> ``cuda[:N]`` (torch on ROCm names AMD GPUs ``cuda``); anything else unchanged."""
    dev = str(device)
    return "cuda" + dev[3:] if dev.lower().startswith("hip") else dev


def align_to(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return (x + a - 1) // a * a


def align_up_to_page(n_cells: int, cell_size: int) -> int:
    """``n_cells`` rounded up to whole pages of ``cell_size``-byte cells."""
    per_page = _get_page_size() // cell_size
    if per_page <= 0:
        raise KVCachedConfigError(
            f"a cell of {cell_size} bytes is larger than the page ({_get_page_size()} bytes); "
            "raise KVCACHED_PAGE_SIZE (or KVCACHED_PAGE_SIZE_MB)"
        )
    return align_to(n_cells, per_page)


# ------------------------------------------------------------------ logging

_LEVEL_TO_COLOR = {
    logging.DEBUG: "\033[36m",
    logging.INFO: "\033[32m",
    logging.WARNING: "\033[33m",
    logging.ERROR: "\033[31m",
    logging.CRITICAL: "\033[35m",
}
_COLOR_RESET = "\033[0m"


class ColorFormatter(logging.Formatter):
    """Colours the ``[...] `` prefix of a record by its level (upstream's formatter)."""

    def format(self, record: logging.LogRecord) -> str:
        formatted = super().format(record)
        color = _LEVEL_TO_COLOR.get(record.levelno, config.log_color_code())
        prefix, sep, rest = formatted.partition("] ")
        if sep:
            return f"{color}{prefix}{sep}{_COLOR_RESET}{rest}"
        return f"{color}{formatted}{_COLOR_RESET}"


def get_log_level() -> int:
    """KVCACHED_LOG_LEVEL as a ``logging`` level (INFO when unset; a bad name raises ValueError)."""
    return getattr(logging, config.log_level() or "INFO")


def get_kvcached_logger(name: str = "kvcached") -> logging.Logger:
    """Upstream's logger: one stream handler ``[name][LEVEL][time][file:line] msg``,
    level KVCACHED_LOG_LEVEL, coloured on a terminal unless KVCACHED_LOG_COLOR=false,
    not propagated (so an engine that also logs it does not print it twice)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        fmt = f"[{name}][%(levelname)s][%(asctime)s][%(filename)s:%(lineno)d] %(message)s"
        isatty = getattr(handler.stream, "isatty", lambda: False)
        cls = ColorFormatter if config.log_color() and isatty() else logging.Formatter
        handler.setFormatter(cls(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(get_log_level())
        logger.propagate = False
    return logger


_configured = False
_configure_lock = threading.Lock()


def configure_logging() -> None:
    """Applies KVCACHED_LOG_LEVEL to the ``kvcached`` logger once per process (when set).

    Called where kvcached starts working in a process (engine interfaces, a new
    KVCacheManager); unset, kvcached's records go to the engine's logging as usual.
    """
    global _configured
    if _configured:
        return
    with _configure_lock:
        if not _configured:
            if config.log_level() is not None:
                get_kvcached_logger("kvcached").setLevel(get_log_level())
            _configured = True


__all__ = [
    "SHM_DIR",
    "ColorFormatter",
    "KVCachePoolExhausted",
    "KVCachedConfigError",
    "align_to",
    "align_up_to_page",
    "configure_logging",
    "get_kvcached_logger",
    "get_log_level",
    "normalize_gpu_device",
    *_CONSTANTS,
]
