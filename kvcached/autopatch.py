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
  top-level package (``ENGINE_ACTIVATORS``): when vLLM is imported in a
  process that runs vLLM, ``kvcached.integration.vllm.plugin.activate`` checks
  the version and hooks each patch to its target module (SGLang likewise).

Which engine a process runs (``runs_engine``) is decided by what the process
is doing, not by what it imports: engines import each other as libraries
(SGLang imports ``vllm._custom_ops`` for a kernel), and activating vLLM's
patches there would run vLLM's version check inside SGLang. The rule:

1. the entry point: ``python -m vllm...``/``python -m sglang...`` (``__main__``
   or, in a spawned child, ``__mp_main__``), or a console script named after
   the engine (``vllm serve``), or a script inside the engine's package; a
   spawned child inherits the parent's ``sys.argv`` so it decides the same;
2. otherwise (``LLM``/``Engine`` in a user script, pytest): the engine whose
   package was imported first in the process. An engine imported by another
   engine's code is always imported after that engine's package, so it is a
   library there and is left alone.

The engines' own plugin entry points (``vllm.general_plugins``,
``sglang.srt.plugins``) run only in that engine's processes and activate
directly, whatever this rule says.

It is cheap (no torch, no engine, no extension import) and never raises at
interpreter start: a failure to install is reported on stderr once and the
interpreter goes on. Errors raised later by a hook (an unsupported engine
version, a patch that does not fit) do propagate into the engine's import, on
purpose: the engine must not start half patched.
"""

from __future__ import annotations

import importlib.abc
import os
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
_first_engine: Optional[str] = None  # the engine package whose import started first here


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
            _note_engine_import(fullname)
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


def _note_engine_import(name: str) -> None:
    global _first_engine
    with _lock:
        if _first_engine is None and name in ENGINE_ACTIVATORS:
            _first_engine = name


def _engine_of_path(path: str) -> Optional[str]:
    """The engine whose package holds the script ``path`` (None: none)."""
    parts = os.path.abspath(path).split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part in ENGINE_ACTIVATORS and os.path.isfile(os.sep.join(parts[: i + 1] + ["__init__.py"])):
            return part
    return None


def _dash_m_engine(argv: List[str]) -> Optional[str]:
    """The engine of ``python [options] -m engine.module ...`` (known before runpy
    imports the module's package), else None."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-X", "-W"):
            i += 2
            continue
        if a == "-m" or (a.startswith("-m") and len(a) > 2):
            mod = a[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            top = mod.split(".")[0]
            return top if top in ENGINE_ACTIVATORS else None
        if a == "-c" or not a.startswith("-"):
            return None  # code or a script: the rest are its arguments
        i += 1
    return None


def entry_point_engine() -> Optional[str]:
    """The engine this process was started as (``python -m sglang.launch_server``,
    ``vllm serve``, a child spawned by either), or None (a user script, pytest, ``-c``)."""
    top = _dash_m_engine(getattr(sys, "orig_argv", None) or [])
    if top is not None:
        return top
    for main in ("__main__", "__mp_main__"):
        spec = getattr(sys.modules.get(main), "__spec__", None)
        top = (getattr(spec, "name", None) or "").split(".")[0]
        if top in ENGINE_ACTIVATORS:
            return top
    argv0 = sys.argv[0] if sys.argv and isinstance(sys.argv[0], str) else ""
    if argv0 and argv0 not in ("-c", "-m", "-"):
        stem = os.path.splitext(os.path.basename(argv0))[0]
        if stem in ENGINE_ACTIVATORS and not os.path.isfile(os.path.join(os.path.dirname(argv0), "__init__.py")):
            return stem  # the engine's console script
        return _engine_of_path(argv0)
    return None


def runs_engine(engine: str) -> bool:
    """True when this process runs ``engine`` (the rule in the module docstring)."""
    by_entry = entry_point_engine()
    if by_entry is not None:
        return by_entry == engine
    with _lock:
        if _first_engine is None:  # installed after an engine was imported: what is loaded
            return not any(e in sys.modules for e in ENGINE_ACTIVATORS if e != engine)
        return _first_engine == engine


def engine_version(package: str, label: str) -> str:
    """``package.__version__``, else its distribution metadata, else a one-line
    ``SystemExit`` naming the fix (never a traceback)."""
    import importlib

    try:
        v = getattr(importlib.import_module(package), "__version__", None)
    except Exception:
        v = None
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return str(version(package))
    except Exception as e:
        raise SystemExit(
            f"kvcached: cannot tell the {label} version ({package}.__version__ is missing and "
            f"{type(e).__name__} reading the '{package}' distribution metadata); install {label} "
            f"with pip (`pip install -e .` for a source checkout) or unset ENABLE_KVCACHED"
        ) from None


def _activator(engine: str, spec: str) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        import importlib

        if getattr(module, "KVCACHED_TEST_STUB", False):
            return  # a test stand-in (tests/engines/sglang_stubs/vllm), not the engine
        if not runs_engine(engine):
            return  # imported as a library by another engine or a tool: left alone
        mod_name, func = spec.split(":")
        getattr(importlib.import_module(mod_name), func)()

    return run


def install() -> None:
    """Watches every supported engine's top-level package (idempotent)."""
    with _lock:
        for engine, spec in ENGINE_ACTIVATORS.items():
            if engine not in _hooks:
                register_post_import_hook(engine, _activator(engine, spec))


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
