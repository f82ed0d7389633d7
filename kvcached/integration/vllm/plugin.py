"""Entry points that turn kvcached on in a vLLM process.

Two routes reach ``activate`` in every vLLM process (API server / LLM,
EngineCore, each worker), and both are idempotent:

* the interpreter-start hook (``kvcached_autopatch.pth`` -> ``kvcached.autopatch``)
  calls it when ``vllm`` is imported in a process that runs vLLM (not when
  another engine, e.g. SGLang, imports ``vllm`` as a library: see
  ``autopatch.runs_engine``), before any engine module loads;
* vLLM's plugin loader calls ``register`` (entry point
  ``vllm.general_plugins: kvcached``) in each process before the block pool
  and the KV tensors exist, so the patches apply even where the .pth file did
  not run (then a warning says so).

``activate`` checks the vLLM version (outside the supported range start-up
stops with one line naming it: ``SystemExit``, no traceback;
``KVCACHED_ALLOW_UNSUPPORTED=1`` tries it anyway with the patches of the
nearest supported version and one warning naming the seams known not to fit)
and hooks every patch of ``versions`` to
its target module. The first vLLM process of an instance also fixes the
instance name (``KVCACHED_IPC_NAME``, inherited by the processes it spawns):
the scheduler's record and the workers' sockets must agree on it, and two
engines on one host must not. That process also removes the instance's
record and sockets at its exit, since vLLM kills the others without warning.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import weakref
from typing import Optional

from kvcached import autopatch, config, naming
from kvcached.integration.patch_base import PatchManager, UnsupportedVersionError
from kvcached.integration.vllm import versions

logger = logging.getLogger("vllm.kvcached")

_lock = threading.Lock()
_manager: Optional[PatchManager] = None
_warned_no_hook = False
_warned_unsupported = False
_cleanup_registered = False


class _Sentinel:
    """Lives as long as the process: the anchor of the exit-time cleanup."""


_sentinel = _Sentinel()


def _vllm_version() -> str:
    """``vllm.__version__``, else the distribution metadata, else one line naming the fix."""
    return autopatch.engine_version("vllm", "vLLM")


def manager() -> PatchManager:
    """The process-wide patch manager for vLLM (created once)."""
    global _manager
    with _lock:
        if _manager is None:
            m = PatchManager("vLLM", versions.SUPPORTED, _vllm_version)
            for p in versions.all_patches():
                m.register_patch(p)
            _manager = m
        return _manager


def ensure_instance_name() -> str:
    """KVCACHED_IPC_NAME, set to ``kvcached_vllm_<pid>`` by the first process if unset."""
    return naming.ensure_instance_name("vllm")


def activate() -> None:
    """Checks the version and hooks the patches (no-op unless ENABLE_KVCACHED)."""
    global _cleanup_registered
    if not autopatch.enabled():
        return
    name = ensure_instance_name()
    _activate_patches(manager())
    # kvcached_* series in this engine's own /metrics (every process: extra API servers serve it too).
    from kvcached.metrics.engine import register_engine_collector_quietly

    register_engine_collector_quietly("vllm")
    with _lock:
        if not _cleanup_registered and multiprocessing.parent_process() is None:
            # The process that starts the engine outlives its EngineCore and
            # workers; vLLM's default shutdown SIGKILLs those, so their record
            # and sockets are removed from here. A finalizer, not atexit: vLLM
            # shuts its engines down from weakref finalizers, which run newest
            # first at exit, so this older one runs after them.
            _cleanup_registered = True
            weakref.finalize(_sentinel, _cleanup_at_exit, name)


def _activate_patches(m: PatchManager) -> None:
    allow = config.allow_unsupported()
    try:
        m.activate(autopatch.register_post_import_hook, allow_unsupported=allow)
    except UnsupportedVersionError as e:
        # One line and stop: running vLLM unpatched while the user asked for
        # kvcached would silently use static memory, and a patch that misfits
        # the engine would corrupt KV state.
        raise SystemExit(f"{e} (KVCACHED_ALLOW_UNSUPPORTED=1 tries it anyway, unsupported)") from None
    global _warned_unsupported
    with _lock:
        if m.version not in m.supported and not _warned_unsupported:
            _warned_unsupported = True
            assert m.version is not None and m.patch_version is not None
            logger.warning(versions.unsupported_warning(_vllm_version(), m.version, m.patch_version))


def _cleanup_at_exit(name: str) -> None:
    try:
        from kvcached.elastic.cleanup import cleanup_instance

        cleanup_instance(name)
    except Exception as e:  # exiting anyway: the next start cleans up
        logger.debug("kvcached: cleanup of %s at exit failed: %s", name, e)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (runs in every vLLM process)."""
    global _warned_no_hook
    if not autopatch.enabled():
        return
    if not autopatch.hook_installed() and not _warned_no_hook:
        _warned_no_hook = True
        why = (
            "KVCACHED_AUTOPATCH=0"
            if autopatch.autopatch_disabled()
            else "kvcached_autopatch.pth did not run in this interpreter (reinstall kvcached with pip, "
            "or check that site-packages .pth files are processed)"
        )
        logger.warning(
            "ENABLE_KVCACHED is set but the interpreter-start hook is missing (%s); "
            "patching from the vLLM plugin entry point instead",
            why,
        )
    activate()
