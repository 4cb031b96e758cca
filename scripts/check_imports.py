#!/usr/bin/env python
"""Import cycles inside the project's packages, found statically (nothing is imported or run).

    python scripts/check_imports.py              # the repository's trainer/ and kernels/ packages
    python scripts/check_imports.py path/to/pkg  # any package directories
    python scripts/check_imports.py --edges      # also print every import edge (file:line)
    python scripts/check_imports.py --types      # also count imports under `if TYPE_CHECKING:`

Every `import` and `from ... import` of the package's own modules counts, at module level and
inside functions or methods (a deferred import still ties the two modules together); relative
imports are resolved against the importing module's package. Imports under `if TYPE_CHECKING:`
are left out (they never run; --types counts them too: a type-only import is still a dependency
of the design); their `else:` branch counts. `from pkg import name` is an edge to
the submodule pkg.name when that file exists, else to pkg itself. Importing a submodule does not
add an edge to its parent package's __init__ (Python runs it first, but within one package that
is the normal layout, not a cycle of ours).

Layers: the trainer's components (its subpackages and top modules) stand in the layers of LAYERS,
from the schema up to the runner; an import from a lower layer into a higher one is reported with
its file and line (imports under `if TYPE_CHECKING:` are types and exempt).

Prints every cycle (a strongly connected component of two or more modules, or a module importing
itself) with one closed path through it and the import lines behind each step, and every import
against the layers; exit status 1 if there is any, 0 if none, 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Iterator, Optional

Graph = dict[str, dict[str, list[int]]]  # module -> imported module -> line numbers
PACKAGES = ("trainer", "kernels")  # the repository's packages, checked by default

# The trainer's components from the bottom up (docs/design.md has the map): a module may import
# its own component and those of lower layers, never a higher one. "" is the package's __init__.
LAYERS: dict[str, list[tuple[str, ...]]] = {"trainer": [
    ("base",),                     # 0 the foundation: the config schema (config/), core helpers (core/), collectives (comm/)
    ("workload",),                 # 1 what is trained: batches from every source (data/), the dense models (models/)
    ("sparse",),                   # 2 the sparse side: embedding/, placement/ (FAE, SCA), schedule/ (Herald), sim/
    ("step",),                     # 3 the step: its order, strategies, precision, the dense optimizer's graph
    ("run",),                      # 4 a run: assembly (build), the Trainer, resolve/, checkpoint/, evaluation/, report/, its life
    ("serving", "tools", "__main__", ""),  # 5 the entry points: the command line, the user tools, export and predict
]}


def module_files(package_dir: str) -> dict[str, str]:
    """Dotted module name -> file of every module under package_dir (a package named after the
    directory; __init__.py files are their package's module)."""
    root = os.path.abspath(package_dir)
    base = os.path.basename(root)
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d.isidentifier())
        rel = os.path.relpath(folder, root)
        parts = [base] + ([] if rel == "." else rel.split(os.sep))
        for f in sorted(files):
            if f.endswith(".py") and f[:-3].isidentifier():
                name = parts if f == "__init__.py" else parts + [f[:-3]]
                out[".".join(name)] = os.path.join(folder, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, types: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere in the tree except `if TYPE_CHECKING:` bodies
    (those too with `types`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not types:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: dict[str, str]) -> Iterator[str]:
    """The package's modules one import statement of `module` loads."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # `import pkg.mod.attr`-like forms: longest module
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        if node.level - 1 > len(parts) - 1:
            return  # beyond the top of the package: not ours
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            yield sub
        elif base in modules:
            yield base


def import_graph(package_dir: str, types: bool = False) -> Graph:
    """module -> {imported module of the same package -> [line, ...]} for every module (`types`:
    imports under `if TYPE_CHECKING:` count too)."""
    modules = module_files(package_dir)
    graph: Graph = {m: {} for m in modules}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = os.path.basename(path) == "__init__.py"
        for node in _imports(tree, types):
            for target in _targets(node, module, is_package, modules):
                graph[module].setdefault(target, []).append(node.lineno)
    return {m: {t: sorted(set(at)) for t, at in edges.items()} for m, edges in graph.items()}


def _components(graph: Graph) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                out.append(sorted(comp))
    return out


def cycles_of(graph: Graph) -> list[list[str]]:
    """Every cycle of an import graph: components of two or more modules, and self-imports."""
    found = [c for c in _components(graph) if len(c) > 1 or c[0] in graph.get(c[0], {})]
    return sorted(found)


def find_cycles(package_dir: str, types: bool = False) -> list[list[str]]:
    """The import cycles of the package in package_dir: one sorted list of module names per cycle
    (strongly connected component of size > 1, or a module importing itself); [] when none."""
    return cycles_of(import_graph(package_dir, types))


def closed_path(graph: Graph, comp: list[str]) -> list[str]:
    """One cycle through the component's first module, as [m0, m1, ..., m0] (breadth-first, so the
    shortest one back to m0)."""
    members, start = set(comp), comp[0]
    if start in graph.get(start, {}):
        return [start, start]
    prev: dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(graph[m]):
                if t == start:
                    path = [m]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])  # type: ignore[arg-type]
                    return list(reversed(path)) + [start]
                if t in members and t not in prev:
                    prev[t] = m
                    nxt.append(t)
        frontier = nxt
    return comp + [start]  # unreachable for a real component


def component(module: str) -> str:
    """The component of a module: `trainer.run.report.x` -> "report", the package itself -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: Graph, layers: list[tuple[str, ...]], files: dict[str, str], root: str) -> list[str]:
    """One line per import of a higher layer's module, and per component placed in no layer."""
    where = {c: i for i, names in enumerate(layers) for c in names}
    out = sorted({f"{m}: component {component(m)!r} is in no layer of check_imports.LAYERS"
                  for m in graph if component(m) not in where})
    for m in sorted(graph):
        for t, at in sorted(graph[m].items()):
            a, b = where.get(component(m)), where.get(component(t))
            if a is not None and b is not None and b > a:
                out.append(f"{m} -> {t}: layer {a} ({component(m) or '__init__'}) imports layer {b} "
                           f"({component(t)})    ({os.path.relpath(files[m], root)}:{', '.join(map(str, at))})")
    return out


def floors(graph: Graph, skip: tuple[str, ...] = ("",)) -> dict[str, int]:
    """The floor each component stands on when its imports stack it (types left out): 0 for a
    component that imports no other, else one above the highest component it imports. The layers
    are drawn right when component c of LAYERS[i] stands on floor i (`skip`: the package's own
    __init__, which imports nothing). A cycle between components is reported by layer_violations."""
    deps: dict[str, set[str]] = {}
    for m, edges in graph.items():
        a = component(m)
        if a in skip:
            continue
        deps.setdefault(a, set()).update(b for b in map(component, edges) if b != a and b not in skip)
    out: dict[str, int] = {}

    def floor(c: str, seen: tuple[str, ...] = ()) -> int:
        if c not in out:
            out[c] = 0 if c in seen else 1 + max((floor(d, seen + (c,)) for d in deps.get(c, ())), default=-1)
        return out[c]

    for c in deps:
        floor(c)
    return out


def drawn_wrong(graph: Graph, layers: list[tuple[str, ...]]) -> list[str]:
    """One line per component whose floor (floors()) is not its layer's index."""
    got = floors(graph)
    return [f"component {c!r}: declared layer {i}, its imports stack it on floor {got.get(c)}"
            for i, names in enumerate(layers) for c in names if c in got and got[c] != i]


def api_bypasses(package_dir: str, api: str) -> list[str]:
    """Imports of a file under package `api` other than the package itself (`from api.x import`,
    `import api.x`, `from api import x` where x.py is a file of api/): one line per import."""
    api_dir = os.path.join(os.path.dirname(os.path.abspath(package_dir)), api)
    files = {f[:-3] for f in os.listdir(api_dir) if f.endswith(".py")} if os.path.isdir(api_dir) else set()
    out = []
    for module, path in sorted(module_files(package_dir).items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in _imports(tree, types=True):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.startswith(api + ".")]
            elif node.level == 0 and node.module and node.module.startswith(api + "."):
                bad = [node.module]
            elif node.level == 0 and node.module == api:
                bad = [f"{api}.{a.name}" for a in node.names if a.name in files]
            else:
                bad = []
            out += [f"{module} imports {b} past {api}/__init__ ({os.path.basename(path)}:{node.lineno})" for b in bad]
    return out


def report(graph: Graph, cycles: list[list[str]], files: dict[str, str], root: str) -> str:
    lines = []
    for i, comp in enumerate(cycles, 1):
        lines.append(f"cycle {i}: {len(comp)} module(s): {', '.join(comp)}")
        path = closed_path(graph, comp)
        for a, b in zip(path, path[1:]):
            where = os.path.relpath(files[a], root)
            at = ", ".join(str(n) for n in graph[a][b])
            lines.append(f"    {a} -> {b}    ({where}:{at})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package_dirs", nargs="*", default=[os.path.join(here, p) for p in PACKAGES],
                    help="package directories (default: this repository's " + " and ".join(PACKAGES) + ")")
    ap.add_argument("--edges", action="store_true", help="also print every import edge")
    ap.add_argument("--types", action="store_true", help="also count imports under `if TYPE_CHECKING:`")
    a = ap.parse_args(argv)
    for d in a.package_dirs:
        if not os.path.isdir(d):
            print(f"error: {d}: not a directory", file=sys.stderr)
            return 2
    found = 0
    for d in a.package_dirs:
        files = module_files(d)
        graph = import_graph(d, a.types)
        root = os.path.dirname(os.path.abspath(d))
        if a.edges:
            for m in sorted(graph):
                for t, at in sorted(graph[m].items()):
                    print(f"{m} -> {t}    ({os.path.relpath(files[m], root)}:{', '.join(map(str, at))})")
        cycles = cycles_of(graph)
        edges = sum(len(e) for e in graph.values())
        name = os.path.basename(os.path.abspath(d))
        runtime = import_graph(d) if a.types else graph  # type-only imports are exempt from the layers
        wrong = layer_violations(runtime, LAYERS[name], files, root) if name in LAYERS else []
        if name in LAYERS:
            wrong += drawn_wrong(runtime, LAYERS[name])
        if name == "trainer":
            wrong += api_bypasses(d, "kernels")
        for line in wrong:
            print(f"layer: {line}")
        found += len(wrong)
        if wrong:
            print(f"{name}: {len(wrong)} import(s) against its layers")
        elif name in LAYERS:
            print(f"{name}: every import within its layers, each layer on its own floor ({len(LAYERS[name])} layers: "
                  f"{', '.join('/'.join(c or '__init__' for c in names) for names in LAYERS[name])})")
        if not cycles:
            print(f"{name}: no import cycle among {len(graph)} modules ({edges} import edges)")
            continue
        found += len(cycles)
        print(report(graph, cycles, files, root))
        print(f"{name}: {len(cycles)} import cycle(s) among {len(graph)} modules ({edges} import edges)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
