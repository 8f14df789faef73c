"""The import graph of the ``whatif`` package, built from the source, and the two rules it keeps.

The modules are the ``.py`` files of the packages ``pyproject.toml`` installs, named as its
``package-dir`` maps the folders (``sim/engine.py`` is ``whatif.sim.engine``). Every ``import``
and ``from ... import`` in a module, at any depth (a function-level import may not hide a cycle
either), is an edge to the ``whatif`` module it names: ``from P import name`` to ``P.name`` where
that is a module, else to ``P``. A module that imports by name (``importlib.import_module``:
``whatif.cli`` imports only the command's module, the facade a name's module on first use) has an
edge to every ``whatif`` module whose dotted name it spells as a string. The import of a
package's ``__init__`` that Python makes before any of its submodules is not an edge:
``whatif/__init__.py`` gathers the facade, and every module of the package would otherwise
reach it.

The rules:

* no cycles: no two modules reach each other;
* the lab stays outside: no module imports ``whatif.lab`` but the lab's own and ``whatif.cli``,
  which registers its commands.

    .venv/bin/python bench/import_graph.py            # exit 1 where a rule is broken
    .venv/bin/python bench/import_graph.py --edges    # and print every edge
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAB = "whatif.lab"
#: The modules besides the lab's own that may import it.
LAB_REGISTRAR = "whatif.cli"


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the installed packages, by dotted name, with its file."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    found = {}
    for package in config["packages"]:
        root = next(name for name in sorted(folders, key=len, reverse=True) if package == name or package.startswith(name + "."))
        folder = repo / folders[root] / Path(*package[len(root):].split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imports(module: str, path: Path, known: set) -> set[str]:
    """The modules of ``known`` that ``module`` (the file ``path``) imports, relative ones resolved."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    names, spelt = set(), set()
    by_name = False
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelt.add(node.value)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            by_name = True
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                names.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    if by_name:
        names |= spelt
    return {name for name in names if name in known and name != module}


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """Each module of ``whatif`` and the modules of ``whatif`` it imports."""
    found = modules(repo)
    return {module: imports(module, path, set(found)) for module, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each group of modules that reach each other (Tarjan's strongly connected
    components), as the modules in import order, the first repeated at the end."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:  # recursion depth is the longest import chain: a few dozen
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def lab_importers(graph: dict[str, set[str]]) -> list[str]:
    """The modules outside the lab, and other than :data:`LAB_REGISTRAR`, that import it."""
    def in_lab(name: str) -> bool:
        return name == LAB or name.startswith(LAB + ".")

    return sorted(m for m, targets in graph.items()
                  if not in_lab(m) and m != LAB_REGISTRAR and any(in_lab(t) for t in targets))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every module and what it imports")
    args = parser.parse_args(argv)
    graph = import_graph()
    if args.edges:
        for module in sorted(graph):
            print(f"{module} -> {', '.join(sorted(graph[module])) or '(nothing of whatif)'}")
    found_cycles, importers = cycles(graph), lab_importers(graph)
    for cycle in found_cycles:
        print(f"cycle: {' -> '.join(cycle)}")
    for module in importers:
        print(f"imports the lab: {module}")
    print(f"{'FAIL' if found_cycles or importers else 'PASS'}: {len(graph)} modules, "
          f"{sum(map(len, graph.values()))} imports of whatif modules, {len(found_cycles)} cycles, "
          f"{len(importers)} importers of the lab besides {LAB_REGISTRAR}")
    return 1 if found_cycles or importers else 0


if __name__ == "__main__":
    sys.exit(main())
