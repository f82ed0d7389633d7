"""The shape of the tree, checked: no import cycles between kvcached's modules
(imports inside functions count too: a cycle hidden in a function is still a
cycle), and no module over ~500 lines without a reason written at its top."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import kvcached

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcached.__file__)))
MAX_LINES = 500
LONG_REASON = "Why this module is long:"


def _modules() -> Dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kvcached")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _graph(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules():
    assert _cycles(_graph(_modules())) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_long_without_a_reason():
    long = []
    for name, path in _modules().items():
        text = open(path).read()
        if text.count("\n") > MAX_LINES and LONG_REASON not in text[:3000]:
            long.append(f"{name} ({text.count(chr(10))} lines)")
    assert long == [], f"split these, or say at their top '{LONG_REASON} ...'"
