"""Interpreter-start hook (imported by ``kvcached_autopatch.pth`` in every Python process).

Engines spawn their scheduler and worker processes as fresh interpreters, so
the patches must be set up by something that runs in each of them before the
engine's modules are imported: the ``.pth`` file does, and this module then

* returns at once unless ``ENABLE_KVCACHED`` is true (it is the only switch
  needed; ``KVCACHED_AUTOPATCH=0`` turns this hook off while the engine's own
  plugin entry point, ``kvcached.integration.vllm.plugin``, still applies the
  patches from inside vLLM). Both are read by kvcached.config; a value that is
  not a boolean is reported on stderr here and the hook stays off (the engine's
  plugin then stops start-up with the same message);
* installs a post-import hook (a meta-path finder that runs callbacks right
  after a watched module finishes executing) and watches each engine's
  top-level package (``ENGINE_ACTIVATORS``): when vLLM is imported,
  ``kvcached.integration.vllm.plugin.activate`` checks the version and hooks
  each patch to its target module (SGLang likewise).

It is cheap (no torch, no engine, no extension import) and never raises at
interpreter start: a failure to install is reported on stderr once and the
interpreter goes on. Errors raised later by a hook (an unsupported engine
version, a patch that does not fit) do propagate into the engine's import, on
purpose: the engine must not start half patched.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Callable, Dict, List, Optional

from kvcached import config

# Engine -> "module:function" run when the engine's top-level package is imported.
ENGINE_ACTIVATORS = {
    "vllm": "kvcached.integration.vllm.plugin:activate",
    "sglang": "kvcached.integration.sglang.plugin:activate",
}

_lock = threading.RLock()
_hooks: Dict[str, List[Callable[[ModuleType], None]]] = {}
_finder: Optional[_PostImportFinder] = None
_installed_at_start = False


def enabled() -> bool:
    """True when ENABLE_KVCACHED asks for kvcached in engine processes (``config.enabled``:
    a value other than true/1/yes/on, false/0/no/off or empty raises ValueError)."""
    return config.enabled()


def autopatch_disabled() -> bool:
    """KVCACHED_AUTOPATCH=0/false/no/off turns the interpreter-start hook off (raises
    ValueError for a value that is not a boolean)."""
    return not config.autopatch_enabled()


def hook_installed() -> bool:
    """True when this interpreter's start-up (the .pth file) installed the hook."""
    return _installed_at_start


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders for
    the spec and makes the loader run the hooks right after the module body
    executed (the loader object is left in place; only its ``exec_module`` is
    shadowed for that one call)."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        if fullname not in _hooks:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        inner = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                del loader.exec_module  # back to the class's method
            except AttributeError:
                pass
            # A reload runs the module body again: its functions are fresh, so
            # the patches must be applied again.
            module.__dict__.pop("__kvcached_patches__", None)
            inner(module)
            _run_hooks(fullname, module)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec  # a loader we cannot shadow: the engine plugin applies the patches
        return spec


def _loaded(name: str) -> Optional[ModuleType]:
    """The module if it has finished importing, else None (a module still
    executing gets the hook when it finishes)."""
    mod = sys.modules.get(name)
    spec = getattr(mod, "__spec__", None)
    if mod is None or (spec is not None and getattr(spec, "_initializing", False)):
        return None
    return mod


def _run_hooks(name: str, module: ModuleType) -> None:
    with _lock:
        fns = list(_hooks.get(name, ()))
    for fn in fns:
        fn(module)


def _install_finder() -> None:
    global _finder
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def register_post_import_hook(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Runs ``fn(module)`` right after module ``name`` is imported, or now if it
    already is. Callbacks must be idempotent (a reload runs them again)."""
    with _lock:
        _hooks.setdefault(name, []).append(fn)
        _install_finder()
    mod = _loaded(name)
    if mod is not None:
        fn(mod)


def _activator(spec: str) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        import importlib

        if getattr(module, "KVCACHED_TEST_STUB", False):
            return  # a test stand-in (tests/engines/sglang_stubs/vllm), not the engine
        mod_name, func = spec.split(":")
        getattr(importlib.import_module(mod_name), func)()

    return run


def install() -> None:
    """Watches every supported engine's top-level package (idempotent)."""
    with _lock:
        for engine, spec in ENGINE_ACTIVATORS.items():
            if engine not in _hooks:
                register_post_import_hook(engine, _activator(spec))


def _at_interpreter_start() -> None:
    global _installed_at_start
    try:
        if not enabled() or autopatch_disabled():
            return
    except ValueError as e:
        # Not here: a bad value must not break every Python process. The engine's
        # plugin reads the same variable and stops the engine's start-up with it.
        sys.stderr.write(f"kvcached: {e}; the import hook is not installed\n")
        return
    try:
        install()
        _installed_at_start = True
    except Exception as e:  # never break interpreter start
        sys.stderr.write(
            f"kvcached: could not install the import hook ({type(e).__name__}: {e}); "
            "engines will only be patched through their plugin entry points\n"
        )


_at_interpreter_start()
