"""The project's import graph, read from source with `ast`: its circles and its layer order.

`tests/test_layering.py` holds the layering with it; `python tests/import_graph.py [ROOT]`
prints the circles and the imports between folders of the checkout at ROOT (default: this
one), the figures of docs/architecture.md ("Where things live").

Nodes are the modules of the project's packages (`PACKAGES`; a package is its `__init__`).
An edge a -> b is any `import` statement in a that names b or something inside b, wherever it
stands: at module level, inside a function or method, or under `if TYPE_CHECKING:`. A
function-level import is still a dependency, taken when the function first runs; moving an
import into a function to dodge an import-time error hides a circle without removing it. A
TYPE_CHECKING import makes the imported type part of the module's interface: the module
cannot be read, type-checked or moved without the other. So both count, and a circle is a
strongly connected component of more than one module of this graph. Relative imports are
resolved against the importing module; `from a import b` is an edge to `a.b` when that is a
module, else to `a`; names outside the project are ignored.
"""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "dsv4", "dspark_proto", "services", "bench", "training")

# The layer order, bottom first. A module may import its own group and any group of a lower
# layer; groups that share a layer are independent (neither imports the other). A module's
# group is the longest prefix listed here. dspark_proto (generated wire code) sits above the
# model: the model knows no wire format.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels",),
    ("dsv4",),
    ("dspark_proto",),
    ("services.common",),
    ("services.verifier", "services.drafter", "services.gateway"),
    ("services.http", "services.analysis"),
    ("services",),  # the entry points: services/app.py, cli.py, serve_cli.py, settings.py, ...
    ("training",),
    ("bench",),
)


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source text of every .py file of `PACKAGES` under `root`.

    Raises:
        OSError / UnicodeDecodeError: a file that cannot be read as UTF-8.
    """
    sources = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            sources[name] = path.read_text(encoding="utf-8")
    return sources


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (module docstring for what counts).

    sources: module name -> source text (`project_sources`). Package modules are recognised by
    having submodules among the names. Each source is parsed once per text (cached), so a graph
    of the sources with one module changed costs one parse. Raises SyntaxError for a source
    that does not parse.
    """
    modules = set(sources)
    packages = {m.rpartition(".")[0] for m in modules} - {""}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, text in sources.items():
        edges = set()
        for base, names in _imports(module, module in packages, text):
            if not names:  # `import a.b.c`
                edges.add(owner(base))
            for name in names:  # `from base import name`: a submodule, or a name in base
                edges.add(owner(f"{base}.{name}") if f"{base}.{name}" in modules else owner(base))
        graph[module] = {e for e in edges if e is not None and e != module}
    return graph


@functools.lru_cache(maxsize=None)
def _imports(module: str, is_package: bool, text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every import statement of one source, anywhere in it: (absolute module, names imported
    from it), names empty for a plain `import`."""
    found = []
    for node in ast.walk(ast.parse(text, filename=module)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((_absolute(module, is_package, node), tuple(alias.name for alias in node.names)))
    return tuple(found)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a `from ... import` statement reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def circles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan,
    iterative), each as a frozenset of module names, sorted by their smallest member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return sorted(found, key=min)


def group_of(module: str) -> str:
    """The `LAYERS` group a module belongs to (its longest listed prefix).

    Raises:
        KeyError: a module outside every group.
    """
    best = max((g for layer in LAYERS for g in layer if module == g or module.startswith(g + ".")),
               key=len, default=None)
    if best is None:
        raise KeyError(f"module {module!r} belongs to no layer group")
    return best


def layer_of(group: str) -> int:
    """The index in `LAYERS` (0 = bottom) of a group."""
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """Every edge (importer, imported) that `LAYERS` forbids: into a higher layer, or into
    another group of the same layer. Sorted."""
    bad = []
    for a, targets in graph.items():
        ga = group_of(a)
        for b in targets:
            gb = group_of(b)
            if gb != ga and layer_of(gb) >= layer_of(ga):
                bad.append((a, b))
    return sorted(bad)


def group_edges(graph: Mapping[str, Iterable[str]]) -> Counter:
    """(importer group, imported group) -> number of module edges, for groups that differ."""
    return Counter((group_of(a), group_of(b)) for a, targets in graph.items() for b in targets
                   if group_of(a) != group_of(b))


if __name__ == "__main__":
    import sys
    g = import_graph(project_sources(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
    found = circles(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, {len(found)} circles")
    for c in found:
        print("  circle:", ", ".join(sorted(c)))
    for (a, b), n in sorted(group_edges(g).items(), key=lambda kv: (layer_of(kv[0][0]), kv[0])):
        print(f"  {a} -> {b}: {n}")
    for a, b in upward_imports(g):
        print(f"  against the layer order: {a} -> {b}")
