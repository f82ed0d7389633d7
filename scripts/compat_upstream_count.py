#!/usr/bin/env python3
"""How many of upstream kvcached's CPU tests pass against this package (docs/COMPAT.md
quotes its last line).

    python scripts/compat_upstream_count.py                 # upstream fetched into a cache
    python scripts/compat_upstream_count.py --src DIR       # an upstream clone (or its git dir)
    python scripts/compat_upstream_count.py --installed     # the kvcached this python has installed

Upstream's CPU suite is the test files its ``tests/manifests/cpu.txt`` lists (what its
CI's ``tools/run_cpu_tests.sh`` runs), at the commit COMPAT.md is checked against
(``COMMIT``). They are exported from upstream's git history into a temporary folder
without upstream's ``kvcached/`` package (its ``controller/``, ``tests/`` and ``tools/``
stay), so every ``import kvcached`` there is this package: this checkout (first on
PYTHONPATH), or with ``--installed`` the one installed for this interpreter. Then
pytest runs those files as upstream's CI does, and the counts come from its JUnit
report: a test module that cannot be imported counts as one error and none of its
tests are counted (pytest cannot collect them).

The source: ``--src`` (a clone of https://github.com/ovg-project/kvcached, or a bare
git directory), else ``$KVCACHED_UPSTREAM_SRC``, else
``~/.cache/kvcached-upstream/kvcached``, cloned there when absent (network needed
once). Needs pytest and what upstream's CI installs (CPU torch, numpy, pyyaml,
aiohttp, packaging); the dev venv has them. Exit status 0 when the suite ran
(whatever passed), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

UPSTREAM = "https://github.com/ovg-project/kvcached"
COMMIT = "e8e640638ba79f3ba7ce88d9692342d29d996e6d"  # docs/COMPAT.md: upstream main, 2026-08-20
MANIFEST = "tests/manifests/cpu.txt"
# What the suite reads of upstream's tree: not its kvcached/ package (ours is tested).
EXPORT = ("controller", "tests", "tools", "pyproject.toml")
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "kvcached-upstream"
# Upstream's requirements.txt has pytest-asyncio (its async tests, asyncio_mode = "auto").
ASYNCIO = "pytest-asyncio==1.5.0"


def _git(src: Path, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", str(src), *args], check=True, capture_output=True).stdout


def git_dir(src: Path) -> Path:
    """The git directory of a clone or a bare repository."""
    return src / ".git" if (src / ".git").exists() else src


def default_source() -> Path:
    src = Path(os.environ.get("KVCACHED_UPSTREAM_SRC") or CACHE / "kvcached")
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        print(f"cloning {UPSTREAM} into {src}", file=sys.stderr)
        subprocess.run(["git", "clone", "--quiet", UPSTREAM, str(src)], check=True)
    return src


def asyncio_path() -> List[str]:
    """Where pytest-asyncio is imported from: nowhere extra when this python has it, else
    ``ASYNCIO`` installed once into the cache (not into the venv: our own suite runs without it)."""
    if importlib.util.find_spec("pytest_asyncio") is not None:
        return []
    target = CACHE / ("site-" + ASYNCIO.replace("==", "-"))
    if not (target / "pytest_asyncio").exists():
        print(f"installing {ASYNCIO} into {target}", file=sys.stderr)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), ASYNCIO]
        subprocess.run(pip, check=True)
    return [str(target)]


def export(src: Path, commit: str, dest: Path) -> List[str]:
    """Upstream's ``EXPORT`` at ``commit`` into ``dest`` (not its ``kvcached/``); returns the
    CPU manifest's test files."""
    gd = git_dir(src)
    try:
        _git(gd, "cat-file", "-e", f"{commit}^{{commit}}")
    except subprocess.CalledProcessError:
        subprocess.run(["git", "--git-dir", str(gd), "fetch", "--quiet", UPSTREAM, commit], check=True)
    with tarfile.open(fileobj=io.BytesIO(_git(gd, "archive", "--format=tar", commit, "--", *EXPORT))) as tar:
        tar.extractall(dest, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
    lines = (dest / MANIFEST).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def counts(junit: Path) -> Dict[str, int]:
    """passed, failed, errors, skipped and tests (collected, plus modules that did not import)."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def passing_files(junit: Path) -> Dict[str, List[int]]:
    """{test file: [passed, tests]} for the files where any test passed."""
    per: Dict[str, List[int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        f = next((f"{p}.py" for p in name if p.startswith("test_")), ".".join(name))
        n = per.setdefault(f, [0, 0])
        n[1] += 1
        n[0] += not any(c.tag in ("failure", "error", "skipped") for c in case)
    return {f: n for f, n in sorted(per.items()) if n[0]}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=None, help="an upstream clone or git dir (default: cached clone)")
    ap.add_argument("--commit", default=COMMIT, help=f"upstream commit (default {COMMIT[:7]}, COMPAT.md's)")
    ap.add_argument("--installed", action="store_true", help="test the installed kvcached, not this checkout")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's report too")
    a = ap.parse_args(argv)
    try:
        src = a.src or default_source()
        extra = asyncio_path()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"cannot get upstream's source or pytest-asyncio ({e}); pass --src DIR", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvcached-upstream-") as tmp:
        work = Path(tmp) / "upstream"
        try:
            files = export(src, a.commit, work)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"cannot export upstream {a.commit[:7]} from {src}: {e}", file=sys.stderr)
            return 2
        env = dict(os.environ)
        # As upstream's run_cpu_tests.sh: its root on the path (controller/, tools/), ours first.
        path = ([] if a.installed else [str(ROOT)]) + [str(work)] + extra
        env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH", "")] if p])
        junit = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            f"--junitxml={junit}",
            *files,
        ]
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=not a.verbose, text=True)
        if not junit.exists():
            print(f"pytest did not run (exit {run.returncode}):\n{run.stdout or ''}{run.stderr or ''}", file=sys.stderr)
            return 2
        c, files_ok = counts(junit), passing_files(junit)

    where = "the installed kvcached" if a.installed else "this checkout"
    print(
        f"upstream kvcached {a.commit[:7]} CPU suite ({MANIFEST}, {len(files)} files) against {where}: "
        f"{c['passed']} of {c['tests']} tests pass ({c['failures']} failed, {c['errors']} errors, "
        f"{c['skipped']} skipped)"
    )
    print("passing: " + ", ".join(f"{f} {p}/{n}" for f, (p, n) in files_ok.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
