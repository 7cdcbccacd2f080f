"""The package's import graph: no circle among selfspec's modules.

Every module of selfspec/ is parsed with ``ast`` (nothing is imported). An import counts wherever it
stands, at module level or inside a function: a function-level import only postpones a circle to the
first call. Imports under ``if TYPE_CHECKING:`` count too: never executed, but a circle through one still
ties the modules together (neither reads without the other, and a type checker follows it); they are marked
``type_only`` and shown as such. Not counted: the implicit import of a module's parent packages.
``from selfspec.a import b`` is an edge to ``selfspec.a.b`` when that is a module, else to ``selfspec.a``.

``python tests/test_architecture.py`` prints the circles and every import inside a function.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = "selfspec"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# selfspec modules imported inside a function on purpose: a Ray Serve replica builds its app in its own process; the
# command line imports the server (FastAPI, uvicorn, Ray: ~0.5 s) only when it serves
LAZY_INTERNAL = {("selfspec.server.ray_serve", "selfspec.api"), ("selfspec.server.ray_serve", "selfspec.server.app"),
                 ("selfspec.server.cli", "selfspec.server.app"), ("selfspec.server.cli", "selfspec.server.ray_serve")}


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it stands, and the function it stands in (None: module level)."""

    module: str  # the importing module, e.g. selfspec.bench.forward
    target: str  # the imported module (a selfspec module resolved to its file's module; others as written)
    line: int
    function: str | None  # qualified name of the enclosing function, e.g. "cmd" or "Engine.step"
    type_only: bool = False  # under ``if TYPE_CHECKING:``: read by type checkers, never executed

    @property
    def internal(self) -> bool:
        return self.target == PACKAGE or self.target.startswith(PACKAGE + ".")


@cache
def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file under selfspec/ (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str) -> str:
    """A dotted name inside selfspec -> the longest prefix that is one of its modules."""
    mods = modules()
    while name not in mods and "." in name:
        name = name.rpartition(".")[0]
    return name


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.package = module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]
        self.scope: list[str] = []
        self.functions = 0  # how many of the enclosing scopes are functions
        self.type_only = 0  # how many of the enclosing blocks are ``if TYPE_CHECKING:``
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.stmt) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            target = _resolve(target)
        function = ".".join(self.scope) if self.functions else None
        self.found.append(Import(self.module, target, node.lineno, function, self.type_only > 0))

    def _scoped(self, node: ast.AST, is_function: bool) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.functions += is_function
        self.generic_visit(node)
        self.functions -= is_function
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, True)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, False)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.type_only += 1
            for child in node.body:
                self.visit(child)
            self.type_only -= 1
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
            self._add(source, node)
            return
        targets = {f"{source}.{a.name}" if f"{source}.{a.name}" in modules() else source for a in node.names}
        for target in sorted(targets):
            self._add(target, node)


@cache
def imports() -> tuple[Import, ...]:
    """Every import in selfspec (module and function level), third-party ones included."""
    found: list[Import] = []
    for name, path in modules().items():
        visitor = _Visitor(name)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        found += visitor.found
    return tuple(found)


def function_level_imports(internal_only: bool = False) -> list[Import]:
    """The imports that stand inside a function (``internal_only``: of selfspec modules only)."""
    return [i for i in imports() if i.function is not None and (i.internal or not internal_only)]


def graph() -> dict[str, set[str]]:
    """selfspec module -> the selfspec modules it imports (module and function level, type-only ones included; no
    self-edges)."""
    edges: dict[str, set[str]] = {m: set() for m in modules()}
    for i in imports():
        if i.internal and i.target != i.module:
            edges[i.module].add(i.target)
    return edges


def circles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def describe(circle: frozenset[str]) -> str:
    """One concrete cycle through ``circle`` (shortest from its first module), each edge with file:line."""
    edges = graph()
    start = min(circle)
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if start in edges[v]:
            path = [v]
            while path[-1] != start:
                path.append(prev[path[-1]])
            path.reverse()
            break
        for w in sorted(edges[v] & circle):
            if w not in prev and w != start:
                prev[w] = v
                queue.append(w)
    steps = []
    for a, b in zip(path, path[1:] + [start]):
        found = [i for i in imports() if i.module == a and i.target == b]
        where = next((i for i in found if not i.type_only), found[0])  # a run-time import when there is one
        inside = f" (in {where.function})" if where.function else ""
        inside += " (under TYPE_CHECKING)" if where.type_only else ""
        steps.append(f"  {a} -> {b}  [{modules()[a].relative_to(ROOT.parent)}:{where.line}{inside}]")
    others = sorted(circle - set(path))
    return "\n".join(steps) + (f"\n  (same circle: {', '.join(others)})" if others else "")


def test_modules_found() -> None:
    mods = modules()
    assert {"selfspec", "selfspec.cli", "selfspec.config", "selfspec.kernels.linear"} <= set(mods)
    assert all(i.target in mods for i in imports() if i.internal), "an import of a selfspec module that does not exist"


def test_type_only_imports_count() -> None:
    """An import under ``if TYPE_CHECKING:`` is an edge of the graph like any other."""
    typed = [i for i in imports() if i.type_only and i.internal and i.target != i.module]
    assert typed, "no import under TYPE_CHECKING found: is the visitor still reading those blocks?"
    assert all(i.target in graph()[i.module] for i in typed)


def test_no_import_circles() -> None:
    bad = circles()
    assert not bad, "import circles among selfspec modules:\n" + "\n\n".join(describe(c) for c in bad)


def test_only_main_imports_cli() -> None:
    users = sorted({i.module for i in imports() if i.target == "selfspec.cli"})
    assert users == ["selfspec.__main__"]


def test_kernels_do_not_import_models() -> None:
    up = [i for i in imports() if i.module.startswith("selfspec.kernels") and i.target.startswith("selfspec.models")]
    assert not up, up


def test_no_selfspec_module_is_imported_inside_a_function() -> None:
    """Imports inside functions are for heavy or optional third-party packages (matplotlib, ray, datasets ...);
    a selfspec module imported there would be dodging a circle."""
    inside = {(i.module, i.target) for i in function_level_imports(internal_only=True)}
    assert inside <= LAZY_INTERNAL, sorted(inside - LAZY_INTERNAL)


def test_function_level_imports_reported() -> None:
    found = function_level_imports()
    assert all(i.function for i in found)
    assert any(not i.internal for i in found)  # e.g. matplotlib, imported when a plot is drawn
    assert set(function_level_imports(internal_only=True)) <= set(found)


if __name__ == "__main__":
    for c in circles():
        print("circle:\n" + describe(c))
    print("\nimports inside functions:")
    for i in function_level_imports():
        print(f"  {i.module}:{i.line} {i.function}: {i.target}")
