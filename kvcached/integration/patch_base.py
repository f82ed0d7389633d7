"""Version-ranged, idempotent engine patches.

An engine integration is a list of small patches. Each names the module it
changes, the engine versions it is written for, and an ``apply(module)``
function. A ``PatchManager`` per engine:

* checks the engine version once, when the engine is imported, and stops
  start-up with one message naming the supported range if it is not
  supported (``UnsupportedVersionError``), instead of failing deep inside the
  engine later. An engine plugin may let a person try an unsupported
  version anyway (``activate(..., allow_unsupported=True)``): the patches
  written for the nearest supported version (``VersionRange.clamp``) are then
  applied, and ``patch_version`` says which that is;
* applies each patch whose range contains the version as soon as its target
  module is imported (at once if it already is), through the post-import hook
  of ``kvcached.autopatch``; patches outside their range are skipped;
* marks every patched module (``__kvcached_patches__``), so a second
  activation (the .pth hook and the engine's plugin entry point both run in
  every process, tests reload modules) never wraps a wrapper;
* keeps a result per patch (``applied``, ``pending``, ``skipped``,
  ``failed``) for logs and tests.

A patch that fails on a supported version is a bug or an engine change this
code does not know: the error names the patch and is raised, so the engine
does not run half patched.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("kvcached.integration")

Version = Tuple[int, int, int]
MARKER = "__kvcached_patches__"
WRAPPED = "__kvcached_wrapped__"


class UnsupportedVersionError(RuntimeError):
    """The installed engine version is outside what kvcached supports."""


class PatchError(RuntimeError):
    """A patch could not be applied to a supported engine version."""


def parse_version(text: str) -> Version:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; pre/dev/local suffixes are ignored."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text))
    if not m:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


@dataclass(frozen=True)
class VersionRange:
    """``low <= version < high``; written ``">=0.32,<0.34"``."""

    low: Version
    high: Version

    @classmethod
    def parse(cls, spec: str) -> VersionRange:
        low: Optional[Version] = None
        high: Optional[Version] = None
        for part in spec.split(","):
            part = part.strip()
            if part.startswith(">="):
                low = parse_version(part[2:])
            elif part.startswith("<"):
                high = parse_version(part[1:])
            else:
                raise ValueError(f"version range {spec!r}: use '>=A.B,<C.D'")
        if low is None or high is None or not low < high:
            raise ValueError(f"version range {spec!r}: need '>=A.B,<C.D' with A.B < C.D")
        return cls(low, high)

    def __contains__(self, v: Version) -> bool:
        return self.low <= tuple(v) < self.high

    def clamp(self, v: Version) -> Version:
        """The supported version nearest to ``v``: ``low`` below the range, the
        last minor's ``.0`` (``0.33.0`` for ``<0.34``) above it, else ``v``."""
        v = tuple(v)  # type: ignore[assignment]
        if v < self.low:
            return self.low
        if v >= self.high:
            h = self.high
            last = (h[0], h[1], h[2] - 1) if h[2] else (h[0], h[1] - 1, 0) if h[1] else (h[0] - 1, 0, 0)
            return max(last, self.low)
        return v

    def __str__(self) -> str:
        def fmt(v: Version) -> str:
            return ".".join(str(x) for x in (v if v[2] else v[:2]))

        return f">={fmt(self.low)},<{fmt(self.high)}"


def mark(module: ModuleType, name: str) -> bool:
    """Records that patch ``name`` changed ``module``; False if it already had."""
    done = module.__dict__.setdefault(MARKER, set())
    if name in done:
        return False
    done.add(name)
    return True


def is_marked(module: ModuleType, name: str) -> bool:
    return name in module.__dict__.get(MARKER, ())


def original(fn: Callable) -> Callable:
    """The unwrapped function behind a kvcached wrapper (or ``fn`` itself)."""
    while hasattr(fn, WRAPPED):
        fn = getattr(fn, WRAPPED)
    return fn


def wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Replaces ``cls.name`` by ``make(original)`` and returns the wrapper.

    The wrapper takes the original's name and docstring and remembers it
    (``WRAPPED``, see ``original``), so a patch can be recognised and undone.
    ``name`` must be defined on ``cls`` itself: wrapping an inherited method
    would change the base class's behaviour for this class only by accident.
    """
    if name not in cls.__dict__:
        raise AttributeError(f"{cls.__module__}.{cls.__qualname__} does not define {name} itself")
    orig = cls.__dict__[name]
    new = make(orig)
    functools.update_wrapper(new, orig)
    setattr(new, WRAPPED, orig)
    setattr(cls, name, new)
    return new


def call_after(cls: type, name: str, after: Callable[..., None]) -> Callable:
    """``wrap_method`` for the common case: the original runs, then
    ``after(self, result, *args, **kwargs)``, and the original's result is returned."""

    def make(orig: Callable) -> Callable:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, *args, **kwargs)
            after(self, out, *args, **kwargs)
            return out

        return wrapper

    return wrap_method(cls, name, make)


def deferred_call(module: str, func: str, *args: object) -> Callable[[ModuleType], None]:
    """A patch's apply: ``module.func(target, *args)``, ``module`` imported only when it
    runs (importing a patch table must import neither the engine nor torch)."""

    def apply(target: ModuleType) -> None:
        getattr(importlib.import_module(module), func)(target, *args)

    apply.__qualname__ = apply.__name__ = func
    return apply


@dataclass
class BasePatch:
    """One small change to one engine module, valid for a range of versions.

    ``apply(module)`` does the change; it runs at most once per module object
    (the manager marks the module). ``why`` is the one-line reason shown in
    logs and errors.
    """

    name: str
    target_module: str
    versions: VersionRange
    apply: Callable[[ModuleType], None]
    why: str = ""


@dataclass
class PatchResult:
    status: str  # applied | pending | skipped | failed
    detail: str = ""


@dataclass
class PatchManager:
    """The patches of one engine (``library``), applied when their modules load."""

    library: str
    supported: VersionRange
    version_reader: Callable[[], str]
    patches: List[BasePatch] = field(default_factory=list)
    results: Dict[str, PatchResult] = field(default_factory=dict)
    version: Optional[Version] = None
    # The version whose patches apply: ``version``, or under allow_unsupported
    # the supported version nearest to it.
    patch_version: Optional[Version] = None
    # Which route activated the patches first ("autopatch", "plugin"), for logs.
    activated_via: Optional[str] = None
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _activated: bool = False

    def __post_init__(self) -> None:
        _MANAGERS[self.library] = self

    def register_patch(self, patch: BasePatch) -> None:
        if any(p.name == patch.name for p in self.patches):
            raise ValueError(f"patch {patch.name!r} is registered twice")
        self.patches.append(patch)

    def check_version(self, allow_unsupported: bool = False) -> Version:
        """The engine version; raises UnsupportedVersionError outside ``supported``
        unless ``allow_unsupported`` (then ``patch_version`` is the nearest supported one)."""
        if self.version is None:
            text = self.version_reader()
            v = parse_version(text)
            if v not in self.supported and not allow_unsupported:
                raise UnsupportedVersionError(
                    f"kvcached supports {self.library} {self.supported} but {self.library} {text} is installed; "
                    f"install a {self.library} version in that range, or unset ENABLE_KVCACHED to run without kvcached"
                )
            self.version = v
            self.patch_version = self.supported.clamp(v)
        return self.version

    def activate(
        self, register_hook: Callable[[str, Callable[[ModuleType], None]], None], allow_unsupported: bool = False
    ) -> None:
        """Checks the version, then applies every patch in range now or when its
        module is imported (``register_hook(module_name, fn)``). Idempotent."""
        with self._lock:
            self.check_version(allow_unsupported)
            version = self.patch_version
            assert version is not None
            if self._activated:
                return
            self._activated = True
            for patch in self.patches:
                if version not in patch.versions:
                    self.results[patch.name] = PatchResult("skipped", f"for {self.library} {patch.versions}")
                    continue
                self.results[patch.name] = PatchResult("pending", f"waits for {patch.target_module}")
                register_hook(patch.target_module, self._applier(patch))

    def _applier(self, patch: BasePatch) -> Callable[[ModuleType], None]:
        def run(module: ModuleType) -> None:
            with self._lock:
                if is_marked(module, patch.name):
                    self.results[patch.name] = PatchResult("applied")
                    return
                try:
                    patch.apply(module)
                except Exception as e:
                    self.results[patch.name] = PatchResult("failed", f"{type(e).__name__}: {e}")
                    raise PatchError(
                        f"kvcached patch {patch.name!r} ({patch.why or 'no description'}) failed on "
                        f"{patch.target_module} of {self.library} "
                        f"{'.'.join(map(str, self.version or ()))}: {type(e).__name__}: {e}; "
                        "unset ENABLE_KVCACHED to run without kvcached and report this"
                    ) from e
                mark(module, patch.name)
                self.results[patch.name] = PatchResult("applied")
                logger.debug("kvcached: applied %s to %s", patch.name, module.__name__)

        return run

    def summary(self) -> str:
        """One line: version and each patch's status."""
        by: Dict[str, List[str]] = {}
        for name, r in self.results.items():
            by.setdefault(r.status, []).append(name)
        v = ".".join(map(str, self.version)) if self.version else "?"
        parts = [f"{k}: {', '.join(sorted(names))}" for k, names in sorted(by.items())]
        return f"kvcached for {self.library} {v} ({self.supported}): " + ("; ".join(parts) or "no patches")


_MANAGERS: Dict[str, PatchManager] = {}


def manager_of(library: str) -> Optional[PatchManager]:
    """The newest patch manager made for ``library`` in this process, if any
    (engine code that runs under the patches reads it without importing the plugin)."""
    return _MANAGERS.get(library)


def summary_of(library: str) -> str:
    """The newest patch manager's summary for ``library`` ("" when none was made)."""
    m = _MANAGERS.get(library)
    return m.summary() if m is not None else ""


def loaded(name: str) -> Optional[ModuleType]:
    """The module if it has finished importing, else None."""
    mod = sys.modules.get(name)
    if mod is None:
        return None
    spec = getattr(mod, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return mod
