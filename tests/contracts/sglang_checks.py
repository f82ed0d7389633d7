"""Seam checks the SGLang contracts need beyond ``seam_ast`` (same ``Check`` -> ``Finding`` shape).

They read a release's source file directly (``Tree.root / Tree.rel(module)``) where the
digest does not keep what they need: whether a name is ever compared with
``isinstance``/``issubclass`` (then rebinding it would change behaviour), whether a method
is a property, a module constant's value, and whether every release entry point of an
SGLang allocator class is covered by kvcached's subclass.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from seam_ast import Check, Finding, Tree, digest_source

_parsed: Dict[Path, ast.Module] = {}


def _ast_of(tree: Tree, mod: str) -> Optional[Tuple[str, ast.Module]]:
    rel = tree.rel(mod)
    path = tree.root / rel
    if not path.is_file():
        return None
    if path not in _parsed:
        _parsed[path] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    return rel, _parsed[path]


def _function_node(module: ast.Module, qual: str) -> Optional[ast.AST]:
    parts = qual.split(".")
    body: Iterable[ast.AST] = module.body
    node: Optional[ast.AST] = None
    for part in parts:
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def names_not_compared(mod: str, names: Sequence[str]) -> Check:
    """``mod`` never passes one of ``names`` to ``isinstance``/``issubclass`` or compares it
    with ``is``/``==``: rebinding the module-level name to a subclass changes only what the
    module constructs."""

    def check(tree: Tree) -> Finding:
        got = _ast_of(tree, mod)
        if got is None:
            return Finding(False, tree.rel(mod), f"module {mod} does not exist")
        rel, module = got
        wanted = set(names)
        for node in ast.walk(module):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("isinstance", "issubclass"):
                    used = {n.id for a in node.args[1:] for n in ast.walk(a) if isinstance(n, ast.Name)}
                    if used & wanted:
                        what = f"{node.func.id}(..., {sorted(used & wanted)[0]})"
                        return Finding(False, f"{rel}:{node.lineno}", what)
            if isinstance(node, ast.Compare):
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if used & wanted and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops):
                    return Finding(False, f"{rel}:{node.lineno}", f"compares {sorted(used & wanted)[0]}")
        return Finding(True, rel, f"{', '.join(names)} only constructed or passed on, never compared")

    return check


def uses_name(mod: str, qual: str, name: str) -> Check:
    """``qual``'s body reads the plain name ``name`` (a constructor taken by name, e.g.
    ``mha_pool_class = MHATokenToKVPool``)."""

    def check(tree: Tree) -> Finding:
        got = _ast_of(tree, mod)
        if got is None:
            return Finding(False, tree.rel(mod), f"module {mod} does not exist")
        rel, module = got
        fn = _function_node(module, qual)
        if fn is None:
            return Finding(False, rel, f"{qual} is not defined here")
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
                return Finding(True, f"{rel}:{node.lineno}", f"{qual} uses {name}")
        return Finding(False, f"{rel}:{fn.lineno}", f"{qual} never uses {name}")

    return check


def is_property(mod: str, cls: str, name: str) -> Check:
    """``cls.name`` is a ``@property`` defined on the class itself."""

    def check(tree: Tree) -> Finding:
        got = _ast_of(tree, mod)
        if got is None:
            return Finding(False, tree.rel(mod), f"module {mod} does not exist")
        rel, module = got
        fn = _function_node(module, f"{cls}.{name}")
        if fn is None:
            return Finding(False, rel, f"{cls}.{name} is not defined on the class")
        decos = [ast.unparse(d) for d in getattr(fn, "decorator_list", [])]
        return Finding("property" in decos, f"{rel}:{fn.lineno}", f"{cls}.{name} ({', '.join(decos) or 'a method'})")

    return check


def constant(mod: str, name: str, value: object) -> Check:
    """``mod`` assigns the literal ``value`` to the module-level ``name``."""

    def check(tree: Tree) -> Finding:
        got = _ast_of(tree, mod)
        if got is None:
            return Finding(False, tree.rel(mod), f"module {mod} does not exist")
        rel, module = got
        for node in module.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                try:
                    got_value = ast.literal_eval(node.value)
                except ValueError:
                    return Finding(False, f"{rel}:{node.lineno}", f"{name} is not a literal")
                return Finding(got_value == value, f"{rel}:{node.lineno}", f"{name} = {got_value!r}")
        return Finding(False, rel, f"no module-level {name}")

    return check


def release_paths_covered(
    classes: Sequence[Tuple[str, str]], ours: Path, our_classes: Sequence[str], prefixes: Sequence[str]
) -> Check:
    """Every method of SGLang's allocator ``classes`` (``(module, class)``, the class and
    its bases) whose name starts with one of ``prefixes`` is either defined by kvcached's
    ``our_classes`` (in the file ``ours``), or only calls methods that are: no release path
    of the release can reach SGLang's own free list."""
    our_digest = digest_source("ours", str(ours), Path(ours).read_text(encoding="utf-8"))["classes"]
    overridden: Set[str] = {m for c in our_classes for m in our_digest[c]["methods"]}

    def check(tree: Tree) -> Finding:
        methods: Dict[str, Tuple[str, Set[str]]] = {}  # name -> (where, callees), most derived first
        for mod, cls in classes:
            m = tree.module(mod)
            if m is None or m.cls(cls) is None:
                return Finding(False, tree.rel(mod), f"no class {cls} in {mod}")
            for name, d in m.cls(cls)["methods"].items():
                if name.startswith(tuple(prefixes)) and name not in overridden:
                    methods.setdefault(f"{cls}.{name}", (m.at(d["line"]), {c[0].lstrip(".") for c in d["calls"]}))
        # Covered: ours, or SGLang's own that only raises NotImplementedError, or that
        # calls a covered method (free_full -> free, free_segments -> free_segment, ...).
        covered = set(overridden)
        through: List[str] = []
        changed = True
        while changed:
            changed = False
            for qual, (_, callees) in methods.items():
                name = qual.split(".", 1)[1]
                if name in covered:
                    continue
                if callees & covered or callees <= {"NotImplementedError"}:
                    covered.add(name)
                    through.append(f"{qual} -> {', '.join(sorted(callees & covered)) or 'raises'}")
                    changed = True
        bad = [f"{where} {qual}" for qual, (where, _) in methods.items() if qual.split(".", 1)[1] not in covered]
        if bad:
            return Finding(False, bad[0].split(" ")[0], "release paths kvcached does not cover: " + "; ".join(bad))
        return Finding(True, tree.rel(classes[0][0]), "covered; through ours: " + ("; ".join(through) or "none"))

    return check


def fields_declared(mod: str, cls: str, names: Sequence[str], namespaces: str) -> Check:
    """Each of ``names`` is a field of ``cls`` (class-level or set in a method), or (from
    SGLang 0.5.20, where ServerArgs is assembled from namespaces) a class-level field of a
    class in a module below ``namespaces``."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None or m.cls(cls) is None:
            return Finding(False, tree.rel(mod), f"no class {cls} in {mod}")
        found: Dict[str, str] = {n: m.at(m.cls(cls)["attrs"][n]) for n in names if n in m.cls(cls)["attrs"]}
        base = tree.root / namespaces.replace(".", "/")
        if base.is_dir():
            for dotted in tree.modules_under(namespaces):
                ns = tree.module(dotted)
                for c in ns.classes.values() if ns else ():
                    for n in names:
                        if n in c["fields"] and n not in found:
                            found[n] = ns.at(c["fields"][n][0])
        missing = [n for n in names if n not in found]
        if missing:
            return Finding(False, m.at(m.cls(cls)["line"]), f"{cls} has no field {', '.join(missing)}")
        return Finding(True, found[names[0]], ", ".join(f"{n} ({found[n]})" for n in names))

    return check
