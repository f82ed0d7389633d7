"""Reading an engine's seams from its source with ``ast`` (the engine is never imported).

A ``Tree`` is one release's package source (``scripts/engine_sources.py``
puts it in a cache folder). ``Tree.module("vllm.v1.core.block_pool")`` gives
that file's *digest*: its module-level imports, functions and classes, each
class's methods (parameters, calls, attributes read), the attributes it sets
on ``self`` and its class-level fields, all with line numbers. A digest is
computed once with ``ast.parse`` and kept as JSON next to the source
(``<source>/.seam-digest-<N>/``), so a warm run parses nothing.

The ``Check`` functions below each answer one question about a seam ("does
``Scheduler.__init__`` take ``kv_cache_config``?") with a ``Finding``: ok or
not, the ``file:line`` that shows it, and what was found. Engine neutral: the
vLLM contract table lives in ``test_vllm_seams.py``.

Why this module is long: one small function per kind of check, plus the digest that keeps warm runs parse-free.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

# Bump when the digest's content changes: old digests are then ignored.
DIGEST_FORMAT = 2

Digest = Dict[str, Any]


@dataclass
class Finding:
    ok: bool
    where: str  # "vllm/v1/core/block_pool.py:159" (or the module path when the thing is missing)
    detail: str

    def __str__(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'} {self.where}: {self.detail}"


# ------------------------------------------------------------ digesting


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _params(fn: ast.AST) -> List[str]:
    a = fn.args  # type: ignore[attr-defined]
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _required(fn: ast.AST) -> List[str]:
    """Parameters without a default (``self`` included)."""
    a = fn.args  # type: ignore[attr-defined]
    pos = a.posonlyargs + a.args
    out = [p.arg for p in pos[: len(pos) - len(a.defaults)]]
    out += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return out


def _callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return "." + f.attr
    return ""


def _function(fn: ast.AST) -> Digest:
    """Parameters, calls (callee, line, keywords), attributes read (first line) and
    attributes stored on ``self`` (first line) of one function, nested code included."""
    calls: List[Tuple[str, int, List[str]]] = []
    reads: Dict[str, int] = {}
    self_reads: Dict[str, int] = {}
    self_stores: Dict[str, int] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            name = _callee(node)
            if name:
                calls.append((name, node.lineno, [k.arg for k in node.keywords if k.arg]))
        elif isinstance(node, ast.Attribute):
            is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if isinstance(node.ctx, ast.Store):
                if is_self:
                    self_stores.setdefault(node.attr, node.lineno)
            else:
                reads.setdefault(node.attr, node.lineno)
                if is_self:
                    self_reads.setdefault(node.attr, node.lineno)
    return {
        "line": fn.lineno,
        "params": _params(fn),
        "required": _required(fn),
        "calls": calls,
        "reads": reads,
        "self_reads": self_reads,
        "self_stores": self_stores,
    }


def _class(c: ast.ClassDef) -> Digest:
    bases = []
    for b in c.bases:
        if isinstance(b, ast.Name):
            bases.append(b.id)
        elif isinstance(b, ast.Attribute):
            bases.append(b.attr)
    methods: Dict[str, Digest] = {}
    fields: Dict[str, Tuple[int, str]] = {}  # class-level names: line, annotation text ("" if none)
    for node in c.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods[node.name] = _function(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.setdefault(node.target.id, (node.lineno, ast.unparse(node.annotation)))
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    fields.setdefault(t.id, (node.lineno, ""))
    attrs: Dict[str, int] = {name: line for name, (line, _) in fields.items()}
    for m in methods.values():
        for a, ln in m["self_stores"].items():
            if a not in attrs or ln < attrs[a]:
                attrs.setdefault(a, ln)
    return {"line": c.lineno, "bases": bases, "methods": methods, "fields": fields, "attrs": attrs}


def _absolute(name: str, rel: str, module: str, level: int) -> str:
    """``from .utils import x`` in vllm/v1/worker/gpu_model_runner.py -> vllm.v1.worker.utils."""
    if level == 0:
        return module
    pkg = name.split(".") if rel.endswith("__init__.py") else name.split(".")[:-1]
    base = pkg[: len(pkg) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def digest_source(name: str, rel: str, source: str) -> Digest:
    tree = ast.parse(source, filename=rel)
    imports: Dict[str, Tuple[str, str, int]] = {}
    functions: Dict[str, Digest] = {}
    classes: Dict[str, Digest] = {}

    def index(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = _function(node)
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = _class(node)
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(name, rel, node.module or "", node.level)
            for a in node.names:
                imports[a.asname or a.name] = (src, a.name, node.lineno)
        elif isinstance(node, ast.Try):  # try: from x import y / except ImportError
            for sub in node.body:
                index(sub)
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            for sub in node.body + node.orelse:
                index(sub)

    for node in tree.body:
        index(node)
    return {"format": DIGEST_FORMAT, "imports": imports, "functions": functions, "classes": classes}


class Module:
    """One source file's digest."""

    def __init__(self, name: str, rel: str, digest: Digest) -> None:
        self.name = name
        self.rel = rel  # path inside the package tree, e.g. vllm/v1/worker/utils.py
        self.imports: Dict[str, Tuple[str, str, int]] = {k: tuple(v) for k, v in digest["imports"].items()}
        self.functions: Dict[str, Digest] = digest["functions"]
        self.classes: Dict[str, Digest] = digest["classes"]

    def at(self, line: Optional[int] = None) -> str:
        return f"{self.rel}:{line}" if line else self.rel

    def cls(self, name: str) -> Optional[Digest]:
        return self.classes.get(name)

    def function(self, qual: str) -> Optional[Digest]:
        """``"allocate_kv_cache"`` or ``"Scheduler.__init__"`` (defined on the class itself)."""
        if "." in qual:
            cname, meth = qual.split(".", 1)
            c = self.classes.get(cname)
            return c["methods"].get(meth) if c is not None else None
        return self.functions.get(qual)

    def defines(self, name: str) -> Optional[int]:
        d = self.functions.get(name) or self.classes.get(name)
        return d["line"] if d else None


class Tree:
    """One release's package source (site-packages layout) under ``root``."""

    def __init__(self, root: Path, package: str) -> None:
        self.root = Path(root)
        self.package = package
        self._mods: Dict[str, Optional[Module]] = {}
        self._digest_dir = self.root / f".seam-digest-{DIGEST_FORMAT}"

    def rel(self, dotted: str) -> str:
        p = dotted.replace(".", "/")
        if (self.root / (p + ".py")).is_file():
            return p + ".py"
        return p + "/__init__.py"

    def module(self, dotted: str) -> Optional[Module]:
        if dotted not in self._mods:
            rel = self.rel(dotted)
            path = self.root / rel
            self._mods[dotted] = Module(dotted, rel, self._digest(dotted, rel, path)) if path.is_file() else None
        return self._mods[dotted]

    def _digest(self, dotted: str, rel: str, path: Path) -> Digest:
        cached = self._digest_dir / f"{dotted}.json"
        try:
            d = json.loads(cached.read_text(encoding="utf-8"))
            if d.get("format") == DIGEST_FORMAT:
                return d
        except (OSError, ValueError):
            pass
        d = digest_source(dotted, rel, path.read_text(encoding="utf-8"))
        try:  # the source cache is ours; a read-only one just means no reuse
            self._digest_dir.mkdir(exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(d), encoding="utf-8")
            tmp.replace(cached)
        except OSError:
            pass
        return d

    def modules_under(self, dotted_prefix: str) -> Iterator[str]:
        base = self.root / dotted_prefix.replace(".", "/")
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(self.root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts)

    def files_importing(self, name: str, from_module: str, under: str) -> List[str]:
        """Modules below ``under`` that bind ``name`` from ``from_module`` at module level.
        A plain text search first keeps this cheap."""
        out = []
        for dotted in self.modules_under(under):
            try:
                text = (self.root / self.rel(dotted)).read_text(encoding="utf-8")
            except OSError:
                continue
            if name not in text:
                continue
            mod = self.module(dotted)
            if mod is not None and mod.imports.get(name, ("", "", 0))[:2] == (from_module, name):
                out.append(dotted)
        return out


# --------------------------------------------------------------- checks
# A Check takes a Tree and returns one Finding.

Check = Callable[[Tree], Finding]


def _missing_module(tree: Tree, mod: str) -> Finding:
    return Finding(False, tree.rel(mod), f"module {mod} does not exist")


def _class_or_fail(tree: Tree, mod: str, cls: str) -> Tuple[Optional[Module], Optional[Digest], Optional[Finding]]:
    m = tree.module(mod)
    if m is None:
        return None, None, _missing_module(tree, mod)
    c = m.cls(cls)
    if c is None:
        return m, None, Finding(False, m.rel, f"no class {cls}")
    return m, c, None


def module_binds(mod: str, name: str, from_module: str) -> Check:
    """``mod`` has ``from from_module import name`` at module level (the name a patch rebinds)."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        got = m.imports.get(name)
        if got is None:
            line = m.defines(name)
            if line:
                return Finding(False, m.at(line), f"{name} is defined here, not imported from {from_module}")
            return Finding(False, m.rel, f"no module-level name {name}")
        if got[:2] != (from_module, name):
            return Finding(False, m.at(got[2]), f"{name} comes from {got[0]}.{got[1]}, not {from_module}")
        return Finding(True, m.at(got[2]), f"from {from_module} import {name}")

    return check


def defines(mod: str, qual: str) -> Check:
    """``mod`` defines ``qual`` (a function, a class, or ``Class.method`` on the class itself)."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        if "." not in qual and qual in m.classes:
            c = m.classes[qual]
            return Finding(True, m.at(c["line"]), f"class {qual}({', '.join(c['bases'])})")
        fn = m.function(qual)
        if fn is None:
            if "." in qual and m.cls(qual.split(".")[0]) is None:
                return Finding(False, m.rel, f"no class {qual.split('.')[0]}")
            return Finding(False, m.rel, f"{qual} is not defined {'on the class itself' if '.' in qual else 'here'}")
        return Finding(True, m.at(fn["line"]), f"def {qual}({', '.join(fn['params'])})")

    return check


def signature(mod: str, qual: str, has: Sequence[str] = (), exactly: Optional[Sequence[str]] = None) -> Check:
    """``qual``'s parameters include ``has`` (or are ``exactly`` these, in order)."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        fn = m.function(qual)
        if fn is None:
            return Finding(False, m.rel, f"{qual} is not defined here")
        ps = fn["params"]
        shown = f"{qual}({', '.join(ps)})"
        if exactly is not None and ps != list(exactly):
            return Finding(False, m.at(fn["line"]), f"{shown}; expected ({', '.join(exactly)})")
        missing = [p for p in has if p not in ps]
        if missing:
            return Finding(False, m.at(fn["line"]), f"{shown}; missing {', '.join(missing)}")
        return Finding(True, m.at(fn["line"]), shown)

    return check


def sets_attrs(mod: str, cls: str, attrs: Sequence[str], bases_in: Sequence[str] = ()) -> Check:
    """Class ``cls`` (or one of its bases defined in the same module, or in ``bases_in``
    modules) sets every attribute in ``attrs``: ``self.x = ...`` or a class-level field."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        found: Dict[str, str] = {}
        seen: Set[str] = set()
        todo: List[Tuple[Module, str, Digest]] = [(m, cls, c)]
        while todo:
            mm, cname, cc = todo.pop(0)
            if cname in seen:
                continue
            seen.add(cname)
            for a, ln in cc["attrs"].items():
                found.setdefault(a, mm.at(ln))
            for b in cc["bases"]:
                for other in [mm] + [x for x in (tree.module(n) for n in bases_in) if x is not None]:
                    bc = other.cls(b)
                    if bc is not None:
                        todo.append((other, b, bc))
                        break
        missing = [a for a in attrs if a not in found]
        if missing:
            return Finding(False, m.at(c["line"]), f"{cls} sets no {', '.join(missing)}")
        first = found[attrs[0]] if attrs else m.at(c["line"])
        return Finding(True, first, f"{cls}: " + ", ".join(f"{a} ({found[a].rsplit(':', 1)[1]})" for a in attrs))

    return check


def has_methods(mod: str, cls: str, names: Sequence[str]) -> Check:
    """Class ``cls`` defines each method in ``names`` itself."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        missing = [n for n in names if n not in c["methods"]]
        if missing:
            return Finding(False, m.at(c["line"]), f"{cls} defines no {', '.join(missing)}")
        return Finding(True, m.at(c["line"]), f"{cls}: " + ", ".join(f"{n} ({c['methods'][n]['line']})" for n in names))

    return check


def calls_in(mod: str, qual: str, callee: str, keywords: Sequence[str] = ()) -> Check:
    """``qual``'s body calls ``callee`` (a bare name, or ``.attr`` for a method call),
    passing ``keywords`` by keyword."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        fn = m.function(qual)
        if fn is None:
            return Finding(False, m.rel, f"{qual} is not defined here")
        hits = [c for c in fn["calls"] if c[0] == callee]
        if not hits:
            return Finding(False, m.at(fn["line"]), f"{qual} does not call {callee.lstrip('.')}(...)")
        for _name, line, kws in hits:
            if all(k in kws for k in keywords):
                return Finding(True, m.at(line), f"{qual} calls {callee.lstrip('.')}(...)")
        return Finding(False, m.at(hits[0][1]), f"{callee.lstrip('.')}(...) is called without {', '.join(keywords)}")

    return check


def lacks(mod: str, cls: str, names: Sequence[str]) -> Check:
    """Class ``cls`` exists and neither defines nor sets (itself) any of ``names``: the
    shape a patch for an older engine relies on (e.g. no ``KVCacheBlock.pool`` before 0.30)."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        present = [n for n in names if n in c["methods"] or n in c["attrs"]]
        if present:
            n = present[0]
            line = c["methods"][n]["line"] if n in c["methods"] else c["attrs"][n]
            return Finding(False, m.at(line), f"{cls} has {', '.join(present)}")
        return Finding(True, m.at(c["line"]), f"{cls} has no {', '.join(names)}")

    return check


def class_member(mod: str, cls: str, member: str) -> Check:
    """An enum (or any class) member ``cls.member`` assigned in the class body."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        if member in c["fields"]:
            return Finding(True, m.at(c["fields"][member][0]), f"{cls}.{member}")
        return Finding(False, m.at(c["line"]), f"{cls} has no member {member}")

    return check


def subclass(mod: str, cls: str, base: str) -> Check:
    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        return Finding(base in c["bases"], m.at(c["line"]), f"class {cls}({', '.join(c['bases'])})")

    return check


def mentions(mod: str, qual: str, attr: str) -> Check:
    """``qual``'s body reads ``<something>.attr`` (e.g. that a worker honours
    ``cache_config.kv_cache_memory_bytes``)."""

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        fn = m.function(qual)
        if fn is None:
            return Finding(False, m.rel, f"{qual} is not defined here")
        if attr in fn["reads"]:
            return Finding(True, m.at(fn["reads"][attr]), f"{qual} reads .{attr}")
        return Finding(False, m.at(fn["line"]), f"{qual} never reads .{attr}")

    return check


def importers_within(name: str, from_module: str, under: str, allowed: Iterable[str]) -> Check:
    """Every module below ``under`` that binds ``name`` by name at import time is in
    ``allowed`` (a new by-name importer would keep the unpatched function)."""
    allowed_set = set(allowed)

    def check(tree: Tree) -> Finding:
        found = tree.files_importing(name, from_module, under)
        extra = [f for f in found if f not in allowed_set]
        if extra:
            where = ", ".join(tree.module(f).at(tree.module(f).imports[name][2]) for f in extra)  # type: ignore
            return Finding(False, where, f"not patched by name: {', '.join(extra)}")
        return Finding(True, tree.rel(from_module), f"by-name importers: {', '.join(found) or 'none'}")

    return check


def methods_touching(mod: str, cls: str, attr: str, known: Iterable[str]) -> Check:
    """The methods of ``cls`` that use ``self.<attr>`` are all in ``known`` (a new one is
    a code path the patch has not been read against)."""
    known_set = set(known)

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        users = {n: d["line"] for n, d in c["methods"].items() if attr in d["self_reads"] or attr in d["self_stores"]}
        extra = sorted(set(users) - known_set)
        if extra:
            return Finding(False, m.at(users[extra[0]]), f"{cls} uses self.{attr} in unreviewed {', '.join(extra)}")
        return Finding(True, m.at(c["line"]), f"{cls} uses self.{attr} in {', '.join(sorted(users))}")

    return check


def annotation_excludes(mod: str, cls: str, field: str, words: Sequence[str]) -> Check:
    """The class-level annotation of ``cls.field`` mentions none of ``words``
    (e.g. ``KVCacheBlock.pool`` became a ``weakref.ref`` in 0.34)."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        got = c["fields"].get(field)
        if got is None or not got[1]:
            return Finding(True, m.at(c["line"]), f"{cls}.{field} has no class-level annotation")
        line, text = got
        bad = [w for w in words if w in text]
        return Finding(not bad, m.at(line), f"{cls}.{field}: {text}")

    return check


def annotation_includes(mod: str, cls: str, field: str, words: Sequence[str]) -> Check:
    """The class-level annotation of ``cls.field`` mentions every one of ``words``
    (e.g. ``KVCacheBlock.pool: "weakref.ref[BlockPool] | None"`` in 0.34)."""

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        got = c["fields"].get(field)
        if got is None or not got[1]:
            return Finding(False, m.at(c["line"]), f"{cls}.{field} has no class-level annotation")
        line, text = got
        missing = [w for w in words if w not in text]
        return Finding(not missing, m.at(line), f"{cls}.{field}: {text}")

    return check


def overrides_match(mod: str, cls: str, ours: Path, our_cls: str) -> Check:
    """Every method our subclass ``our_cls`` (in the kvcached file ``ours``) overrides
    accepts the engine's call: the engine's parameters, in order, start ours, and what
    ours adds has a default (or ours takes ``*args, **kwargs``)."""
    our = digest_source("ours", str(ours), Path(ours).read_text(encoding="utf-8"))["classes"][our_cls]

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        bad = []
        n = 0
        for name, mine in our["methods"].items():
            theirs = c["methods"].get(name)
            if name.startswith("__") or theirs is None:
                continue
            n += 1
            if any(p.startswith("*") for p in mine["params"]):
                continue
            mp, tp = mine["params"], theirs["params"]
            extra_required = [p for p in mp[len(tp) :] if p in mine["required"]]
            if mp[: len(tp)] != tp or extra_required:
                bad.append(
                    f"{name}({', '.join(theirs['params'])}) at line {theirs['line']} "
                    f"vs ours ({', '.join(mine['params'])})"
                )
        if bad:
            return Finding(False, m.at(c["line"]), "; ".join(bad))
        return Finding(True, m.at(c["line"]), f"{n} overridden methods take the engine's parameters")

    return check


def all_of(*checks: Check) -> Check:
    def check(tree: Tree) -> Finding:
        fs = [c(tree) for c in checks]
        bad = [f for f in fs if not f.ok]
        f = bad[0] if bad else fs[0]
        return Finding(not bad, f.where, "; ".join(x.detail for x in (bad or fs)))

    return check


def any_of(*checks: Check) -> Check:
    def check(tree: Tree) -> Finding:
        fs = [c(tree) for c in checks]
        good = [f for f in fs if f.ok]
        f = good[0] if good else fs[0]
        return Finding(bool(good), f.where, f.detail if good else " / ".join(x.detail for x in fs))

    return check


def callers_within(mod: str, cls: str, callees: Sequence[str], allowed: Iterable[str]) -> Check:
    """The methods of ``cls`` that call any of ``callees`` are all in ``allowed``
    (e.g. only ``allocate_slots`` reaches the pool's allocation)."""
    allowed_set = set(allowed)

    def check(tree: Tree) -> Finding:
        m, c, fail = _class_or_fail(tree, mod, cls)
        if fail:
            return fail
        assert m is not None and c is not None
        users: Dict[str, int] = {}
        for name, d in c["methods"].items():
            for callee, line, _ in d["calls"]:
                if callee in callees:
                    users.setdefault(name, line)
        if not users:
            return Finding(False, m.at(c["line"]), f"{cls} calls none of {', '.join(callees)}")
        extra = sorted(set(users) - allowed_set)
        if extra:
            return Finding(False, m.at(users[extra[0]]), f"{', '.join(callees)} also called from {', '.join(extra)}")
        return Finding(
            True, m.at(min(users.values())), f"{', '.join(callees)} called only from {', '.join(sorted(users))}"
        )

    return check


def accepts_engine_call(mod: str, qual: str, ours: Path, our_name: str) -> Check:
    """Our replacement ``our_name`` (the first function of that name anywhere in the
    kvcached file ``ours``, nested ones included) accepts every call the engine's ``qual``
    accepts: the engine's parameters, in order, start ours and what ours adds has a
    default (or ours takes ``*args, **kwargs``)."""
    tree_ours = ast.parse(Path(ours).read_text(encoding="utf-8"))
    fn = next(
        n for n in ast.walk(tree_ours) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == our_name
    )
    mine, required = _params(fn), _required(fn)

    def check(tree: Tree) -> Finding:
        m = tree.module(mod)
        if m is None:
            return _missing_module(tree, mod)
        theirs = m.function(qual)
        if theirs is None:
            return Finding(False, m.rel, f"{qual} is not defined here")
        tp = theirs["params"]
        shown = f"{qual}({', '.join(tp)})"
        if any(p.startswith("*") for p in mine):
            return Finding(True, m.at(theirs["line"]), f"{shown}; ours takes *args/**kwargs")
        extra_required = [p for p in mine[len(tp) :] if p in required]
        if mine[: len(tp)] != tp or extra_required:
            return Finding(False, m.at(theirs["line"]), f"{shown}; ours ({', '.join(mine)})")
        return Finding(True, m.at(theirs["line"]), f"{shown}; ours ({', '.join(mine)})")

    return check
