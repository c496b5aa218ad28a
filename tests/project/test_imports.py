"""The package's import graph: layers that import only downwards, and no import cycle.

**Layers.** ``mixer`` is built in layers, one subpackage each (:data:`LAYERS`, bottom first); a
module may import from its own layer and the layers below, never above, and here every import
statement counts: type-only ones under ``TYPE_CHECKING`` and those inside functions too (a type or a
late import that runs up the layers is still a dependency on the layer above). The top-level
``mixer/__init__.py`` (the public API) sits above them all.

**Cycles.** The graph of what each module imports when it is imported must have no cycle.

Each module of the package is parsed (never imported) and its import statements are resolved to
modules of ``mixer``. Only imports that run when the module is imported count: those at module
level, in module-level ``if`` / ``try`` / ``with`` blocks and in class bodies. Imports inside a
function run when it is called, after every module has finished importing, so they are allowed to
break a cycle (a module that needs something from a module above it imports it there), and imports
under ``if TYPE_CHECKING:`` never run. Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first, so it
counts as importing ``a.b`` too (unless ``a.b`` encloses the importing module: it is already being
imported then).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import mixer

ROOT = Path(mixer.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's ``__init__``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("mixer", *path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _every_import_node(body: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it stands (functions and ``TYPE_CHECKING`` blocks included)."""
    for node in body:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                yield sub


def _import_time_nodes(body: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements in ``body`` (and the blocks under it) that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # runs when called: allowed to break a cycle
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_nodes(node.orelse)  # the TYPE_CHECKING branch never runs
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from _import_time_nodes(ast.iter_child_nodes(node))


def _with_parents(target: str, importer: str) -> set[str]:
    """``target`` and the packages above it that importing it runs (not those enclosing ``importer``)."""
    out = set()
    parts = target.split(".")
    for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        if not (importer == name or importer.startswith(name + ".")):
            out.add(name)
    return out


def _imports(name: str, package: bool, source: str, known: set[str], *, every: bool = False) -> set[str]:
    """The modules of ``known`` that importing module ``name`` (a package's ``__init__`` if
    ``package``) with this source imports; with ``every``, those any of its import statements name."""
    here = name if package else name.rpartition(".")[0]  # the package relative imports start from
    out: set[str] = set()
    nodes = _every_import_node if every else _import_time_nodes
    for node in nodes(ast.parse(source).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base]
            # ``from pkg import name``: ``name`` may be a submodule, imported in its own right.
            targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
        for target in targets:
            if target == "mixer" or target.startswith("mixer."):
                out |= {t for t in _with_parents(target, name) if t in known and t != name}
    return out


def _graph(*, every: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(name, package, path.read_text(), set(modules), every=every)
        for name, (path, package) in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(graph, set(group), group[0]) for group in groups]


def _path_through(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside ``group`` (breadth-first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but none was found")


#: Bottom first. The foundation: errors, the shared checks and warnings, bounded collectives and the state format.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mixer.errors", "mixer._check", "mixer._warn", "mixer.collective", "mixer._native", "mixer.state"),
    ("mixer.storage",),
    ("mixer.spec",),
    ("mixer.read",),
    ("mixer.plan",),
    ("mixer.stream",),
    ("mixer.batching",),
    ("mixer.mixing",),
    ("mixer.observe",),
    ("mixer.runtime",),
    ("mixer.service",),
    ("mixer.config",),
    ("mixer.integrations", "mixer.lightning"),
    ("mixer.cli",),
)


def layer_of(module: str) -> int:
    for rank, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return rank
    raise AssertionError(f"{module} is in no layer: put it in a subpackage of LAYERS (or the foundation)")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` that run up the layers (the public ``mixer/__init__.py`` sits above all)."""
    return sorted(
        f"{a} (layer {LAYERS[layer_of(a)][0]}) imports {b} (layer {LAYERS[layer_of(b)][0]})"
        for a, targets in graph.items()
        if a != "mixer"
        for b in targets
        if b != "mixer" and layer_of(b) > layer_of(a)
    )


def test_every_import_points_down_the_layers() -> None:
    upward = _upward(_graph(every=True))
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_every_module_is_in_a_layer_and_only_the_foundation_is_at_the_top() -> None:
    top = sorted(name for name in _modules() if name.count(".") == 1)
    assert top == [
        "mixer._check",
        "mixer._native",
        "mixer._warn",
        "mixer.batching",
        "mixer.cli",
        "mixer.collective",
        "mixer.config",
        "mixer.errors",
        "mixer.integrations",
        "mixer.lightning",
        "mixer.mixing",
        "mixer.observe",
        "mixer.plan",
        "mixer.read",
        "mixer.runtime",
        "mixer.service",
        "mixer.spec",
        "mixer.state",
        "mixer.storage",
        "mixer.stream",
    ]
    for name in _modules():
        if name != "mixer":
            layer_of(name)


def test_the_layer_check_sees_an_upward_import() -> None:
    # The check the real graph passes must catch a type-only import that runs up the layers, and pass
    # imports down the layers, inside a layer and from the public package.
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mixer.mixing.mixture import Mixture\n"
    known = {"mixer", "mixer.mixing", "mixer.mixing.mixture", "mixer.spec", "mixer.spec.source"}
    graph = {"mixer.spec.source": _imports("mixer.spec.source", False, source, known, every=True)}
    assert _upward(graph) == [
        "mixer.spec.source (layer mixer.spec) imports mixer.mixing (layer mixer.mixing)",
        "mixer.spec.source (layer mixer.spec) imports mixer.mixing.mixture (layer mixer.mixing)",
    ]
    assert _upward({"mixer.mixing.mixture": {"mixer.spec.source", "mixer.mixing.loops"}, "mixer": {"mixer.cli"}}) == []


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, (
        "import cycles in mixer (move the shared piece down, or import inside the function):\n"
        + "\n".join(" -> ".join(c) for c in cycles)
    )


def test_the_graph_sees_imports() -> None:
    # Guards the test above against passing vacuously: each kind of import is found, or left out.
    known = {
        "mixer",
        "mixer.errors",
        "mixer.plan",
        "mixer.plan.world",
        "mixer.observe",
        "mixer.observe.stats",
        "mixer.storage",
        "mixer.storage.urls",
        "mixer.mixing",
        "mixer.mixing.mixture",
        "mixer.spec",
        "mixer.spec.source",
        "mixer.spec.budget",
    }
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from . import budget
from mixer.errors import ConfigError
import mixer.storage.urls
try:
    from mixer.observe.stats import log_every
except ImportError:
    pass
if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture
def build():
    from mixer.plan.world import World
"""
    runtime = {
        "mixer.spec.budget",
        "mixer.errors",
        "mixer.storage",
        "mixer.storage.urls",
        "mixer.observe",
        "mixer.observe.stats",
    }
    assert _imports("mixer.spec.source", False, source, known) == runtime
    # every import counts for the layers: type-only and function-level ones too
    assert _imports("mixer.spec.source", False, source, known, every=True) == runtime | {
        "mixer.mixing",
        "mixer.mixing.mixture",
        "mixer.plan",
        "mixer.plan.world",
    }
    # Inside a package: relative imports start there, and its own __init__ is already running.
    assert _imports("mixer.storage.logsafe", False, "from .urls import redact\nfrom ..errors import X", known) == {
        "mixer.storage.urls",
        "mixer.errors",
    }
    graph = _graph()
    assert "mixer.storage.urls" in graph["mixer.storage.logsafe"] and "mixer.errors" in graph["mixer.storage.urls"]
    assert sum(map(len, graph.values())) > len(graph)  # the real package: more edges than modules


def test_no_module_is_named_after_a_standard_library_module() -> None:
    # ``from . import io`` then ``io.open_shard`` reads as the standard library's io; a module run as a
    # script from its folder would shadow the real one.
    clashes = sorted(name for name in _modules() if name.rpartition(".")[2] in sys.stdlib_module_names)
    assert not clashes, f"modules named after standard-library modules: {clashes}"


def test_a_cycle_is_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"a"}}) == []  # a module that imports its own name is not a cycle (dropped above)
