"""How kvcached gets into SGLang's processes.

Two ways in, both ending in ``activate()`` (idempotent):

* the ``sglang.srt.plugins`` entry point ``kvcached = kvcached.integration.sglang.plugin:register``:
  SGLang calls ``load_plugins()`` in the launching process and as the first
  line of every scheduler process (spawned, so it re-imports everything);
* ``kvcached.autopatch`` (the ``.pth`` hook) calls ``activate()`` as soon as
  ``sglang`` is imported in a process that runs SGLang (``ENABLE_KVCACHED=true``;
  a vLLM process importing ``sglang`` for a kernel is left alone: see
  ``autopatch.runs_engine``).

``activate()`` checks the SGLang version once and hooks each patch of
``patches.all_patches()`` to its module (applied at once if it is already
imported). An unsupported SGLang version stops start-up with one line naming
the supported range. Nothing happens unless ``ENABLE_KVCACHED`` is true.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from kvcached import config, naming
from kvcached.integration.patch_base import PatchError, PatchManager, UnsupportedVersionError

logger = logging.getLogger("kvcached.integration.sglang")

_lock = threading.Lock()
_manager: Optional[PatchManager] = None


def sglang_version() -> str:
    """``sglang.__version__``, else the distribution metadata, else one line naming the fix."""
    from kvcached.autopatch import engine_version

    return engine_version("sglang", "SGLang")


def patch_manager() -> PatchManager:
    """The process's SGLang PatchManager (made once)."""
    global _manager
    with _lock:
        if _manager is None:
            from kvcached.integration.sglang.patches import SUPPORTED, all_patches

            m = PatchManager("sglang", SUPPORTED, sglang_version)
            for p in all_patches():
                m.register_patch(p)
            _manager = m
        return _manager


def ensure_instance_name() -> str:
    """KVCACHED_IPC_NAME, set to ``kvcached_sglang_<pid>`` by the first process if unset.

    SGLang spawns its scheduler(s) after loading plugins in the launching
    process, so they inherit the name: ``kvctl list`` shows one instance per
    engine (one record per pool and rank under it), and two engines started
    from one shell do not collide the way a process-group name would.
    """
    return naming.ensure_instance_name("sglang")


def activated_by() -> Optional[str]:
    """``"autopatch"`` or ``"plugin"``: which route activated kvcached in this process (None: neither)."""
    return None if _manager is None else _manager.activated_via


def activate(source: str = "autopatch") -> None:
    """Checks the SGLang version and installs the patches (no-op unless ENABLE_KVCACHED)."""
    if not config.enabled():
        return
    from kvcached.autopatch import register_post_import_hook

    ensure_instance_name()
    m = patch_manager()
    try:
        m.activate(register_post_import_hook)
    except UnsupportedVersionError as e:
        # One clear line, and stop: running SGLang unpatched while the user
        # asked for kvcached would silently use static memory.
        raise SystemExit(str(e)) from None
    # kvcached_* series in SGLang's own /metrics (its per-app multiprocess registry).
    from kvcached.metrics.engine import register_engine_collector_quietly

    register_engine_collector_quietly("sglang")
    if m.activated_via is None:
        m.activated_via = source
        logger.info(
            "kvcached: SGLang %s patched (via %s, instance %s)",
            ".".join(map(str, m.version or ())),
            source,
            naming.env_instance_name(),
        )


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (runs in every SGLang process)."""
    try:
        activate("plugin")
    except PatchError as e:
        # load_plugins() only logs a plugin's exceptions; the engine must not
        # run half patched.
        raise SystemExit(str(e)) from None
