"""No import circle among specdec's modules, type-only ones included: every import statement counts (module level,
inside functions, under `if TYPE_CHECKING:`), and so does a module named in a string annotation
(`"specdec.engine.engine.Engine"`). A package's own `__init__` run by importing one of its modules is not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at `root` (a package by its `__init__`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` is, or the closest module containing it (`pkg.mod.Class` -> `pkg.mod`); None outside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in `module` brings in (relative ones made absolute)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]  # a name that is no module resolves to `base`


def _annotation_names(tree: ast.AST) -> list[str]:
    """Dotted names (`a.b.c`) written inside string annotations."""
    strings = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            strings += [a.annotation for a in every if a is not None and a.annotation is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            strings.append(node.annotation)
    names = []
    for ann in strings:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                parsed = ast.parse(ann.value, mode="eval")
            except SyntaxError:
                continue
            names += [ast.unparse(n) for n in ast.walk(parsed) if isinstance(n, ast.Attribute)]
    return names


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `known` it imports, counting every import statement and string annotation."""
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        names = _annotation_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names += _imported(node, module, path.name == "__init__.py")
        graph[module] = {m for m in (_resolve(n, known) for n in names) if m is not None and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds at least one import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_specdec_has_no_import_circle():
    assert cycles(import_graph(modules(ROOT, "specdec"))) == []


def test_type_only_function_level_and_string_annotation_imports_count(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("class B:\n    pass\n\ndef f():\n    from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("def g(x: 'pkg.d.D') -> None:\n    pass\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    known = modules(pkg, "pkg")
    graph = import_graph(known)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.d", "pkg.sub.c"]]
    (pkg / "d.py").write_text("")
    assert cycles(import_graph(known)) == []
