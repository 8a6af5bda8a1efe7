"""farlink's layers, read from the source: the library never imports the application, and no
two modules import each other.

The library (:data:`LIBRARY`) is what a user composes into their own loop: codecs, robust
aggregation and trust, collectives, the algorithms, the model, the data, and the run's state on
disk. The application (:data:`APPLICATION`) reads a run's config and builds those objects: the
config itself, ``farlink train`` and its launcher, the benches, the planner, the WAN emulator,
the CLI and the swarm's commands. Data flows one way, so a library module that imports the
application (at the top or inside a function, which only hides the edge until it runs) is a
violation, and so is any cycle between modules, whichever kind of import closes it.

Every import is read with :mod:`ast`, so nothing is imported to check it; imports under
``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import functools
import gc
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

LIBRARY = ("farlink.codecs", "farlink.robust", "farlink.comm", "farlink.sync", "farlink.model",
           "farlink.data", "farlink.state", "farlink.rl")
APPLICATION = ("farlink.config", "farlink.train", "farlink.bench", "farlink.plan",
               "farlink.emulate", "farlink.cli", "farlink.swarm", "farlink.worker",
               "farlink.compose", "farlink.flags", "farlink.rl_command")


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the module imported (a package's __init__ where a name comes from it)
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "farlink").rglob("*.py"))}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> list[Edge]:
    """Every farlink module ``name`` imports, each with whether the import sits in a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: list[Edge] = []

    def target(dotted: str) -> str | None:
        while dotted and dotted not in known:  # an attribute path: the module that holds it
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for stmt in child.orelse:
                    visit(stmt, in_function)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("farlink") and (t := target(alias.name)):
                        edges.append(Edge(name, t, child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                if not module.startswith("farlink"):
                    continue
                for alias in child.names:  # `from farlink.sync import exchange`: a submodule
                    sub = f"{module}.{alias.name}"
                    t = sub if sub in known else target(module)
                    if t:
                        edges.append(Edge(name, t, child.lineno, in_function))
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            visit(child, inside)

    visit(parse(path), False)
    # one edge per import statement and module (``from m import a, b`` is one import of m)
    return sorted({e for e in edges if e.target != name}, key=lambda e: (e.line, e.target))


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, with the garbage collector held off: a finalizer run by a
    collection in the middle of CPython 3.11's tree conversion (an earlier test's coroutine
    or thread state) re-enters it and fails the parse with "AST constructor recursion depth
    mismatch" (seen once in a suite run after hivemind tests)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


def all_edges() -> list[Edge]:
    return list(_edges_under(SRC))


@functools.lru_cache(maxsize=None)
def _edges_under(src: Path) -> tuple[Edge, ...]:
    """Parsed once per tree: three tests read the same edges."""
    assert src == SRC
    found = modules()
    known = set(found)
    return tuple(e for name, path in found.items() for e in imports_of(name, path, known))


def within(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def upward(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if within(e.source, LIBRARY) and within(e.target, APPLICATION)]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:
        nonlocal counter
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(groups)


def describe(edges: list[Edge]) -> str:
    return "\n".join(f"  {e.source}:{e.line} -> {e.target}"
                     + (" (in a function)" if e.in_function else "") for e in edges)


def test_counts_are_printed(capsys) -> None:
    """The figures the layering is measured by (``pytest -s`` shows them)."""
    edges = all_edges()
    with capsys.disabled():
        print(f"\nimports between farlink modules: {len(edges)}; function-level: "
              f"{sum(e.in_function for e in edges)}; upward (library -> application): "
              f"{len(upward(edges))}; cycles: {len(cycles(edges))} "
              f"(top-level imports only: {len(cycles([e for e in edges if not e.in_function]))})")
    assert edges, "no farlink imports found: the walker reads the wrong tree"


def test_the_library_never_imports_the_application() -> None:
    bad = upward(all_edges())
    assert not bad, "library modules import the application:\n" + describe(bad)


def test_no_import_cycles() -> None:
    edges = all_edges()
    found = cycles(edges)
    detail = []
    for group in found:
        members = set(group)
        detail.append(" <-> ".join(group) + "\n" + describe(
            [e for e in edges if e.source in members and e.target in members]))
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_the_walker_sees_both_kinds_of_import(tmp_path) -> None:
    """The checks above can fail: an upward import inside a function and a cycle are found."""
    global SRC
    pkg = tmp_path / "farlink"
    (pkg / "sync").mkdir(parents=True)
    (pkg / "train").mkdir()
    for init in (pkg / "__init__.py", pkg / "sync" / "__init__.py", pkg / "train" / "__init__.py"):
        init.write_text("")
    (pkg / "sync" / "algo.py").write_text("def f():\n    from farlink.train.loop import x\n")
    (pkg / "train" / "loop.py").write_text("from farlink.sync import algo\nx = 1\n")
    (pkg / "sync" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from farlink.train import loop\n")
    saved, SRC = SRC, tmp_path
    try:
        edges = all_edges()
    finally:
        SRC = saved
    assert [(e.source, e.target, e.in_function) for e in upward(edges)] == [
        ("farlink.sync.algo", "farlink.train.loop", True)]
    assert cycles(edges) == [["farlink.sync.algo", "farlink.train.loop"]]
