"""The import graph of Ridgeline's packages: which module imports which, import cycles, layering rules.

    python -m tools.import_graph                 # the graph, then cycles and layering violations
    python -m tools.import_graph --format=dot    # the graph for Graphviz
    python -m tools.import_graph --check         # only the problems
    python -m tools.import_graph --no-layering   # cycles only

Exits 1 when it finds a cycle or (unless --no-layering) a layering violation, 0 otherwise.

Every module under `serving/`, `model/`, `sharding/` and `kernels_pallas/` is read with `ast`, never
imported. An import anywhere in a module counts: at module level, inside a function (a deferred import is
still a dependency: it runs the first time the function does, and the two modules cannot be understood
apart), or under `if TYPE_CHECKING:`. Only imports between project modules are edges.

How an import becomes an edge:

- `import a.b.c` and `from a.b import c` name the module `a.b.c` when it exists, else its longest
  project prefix (`from a.b import name` is an edge to `a.b`).
- `from pkg import Name`, where `pkg/__init__.py` exports `Name` lazily through
  `model.lazy_exports.lazy_exports(__name__, TABLE)`, is an edge to the module the table names for it
  (the module that actually runs); the package's table itself is no edge, since nothing in it runs
  until a name is looked up.
- Packages a dotted import passes through (`a` and `a.b` for `import a.b.c`) are no edges: package
  `__init__` files import nothing (or only their own submodules), so they would add noise, not cycles.

A cycle is a strongly connected component of more than one module. The layering rules are the table
`LAYERING` below, taken from docs/architecture.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
import textwrap
from collections.abc import Iterable, Sequence

PACKAGES = ("serving", "model", "sharding", "kernels_pallas")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Modules under `importer` must not import modules under any of `forbidden`."""

    importer: str
    forbidden: tuple[str, ...]
    why: str


# docs/architecture.md: "serving/ -> model/ -> kernels_pallas/, serving/ -> sharding/ -> model/": imports
# only go down. Within serving, core is the engine; the optional features, the HTTP app, the multi-process
# layer and the entry points are built on it, never the other way round.
LAYERING = (
    Rule("serving.core",
         ("serving.features", "serving.spec_decode", "serving.disaggregation", "serving.api", "serving.cluster",
          "serving.routing", "serving.llm", "serving.server", "serving.router", "serving.launch"),
         "serving/core is the engine; the features, APIs and entry points around it import it, not it them"),
    Rule("serving.compilation",
         ("serving.core", "serving.features", "serving.spec_decode", "serving.disaggregation", "serving.api",
          "serving.cluster", "serving.routing", "serving.llm", "serving.server", "serving.router", "serving.launch"),
         "serving/compilation compiles programs it knows by key and lowering; the engine above it says what they are"),
    Rule("model", ("serving", "sharding"), "model/ is the pure core: serving and sharding build on it"),
    Rule("sharding", ("serving",), "sharding/ lays out model/'s declarations and knows nothing of serving"),
    Rule("kernels_pallas", ("serving", "model", "sharding"),
         "kernels_pallas/ is the bottom layer: attention backends on plain arrays, imported by model/"),
)


@dataclasses.dataclass(frozen=True)
class Import:
    target: str  # the project module imported
    line: int
    deferred: bool  # inside a function (runs when the function does, not at import)


@dataclasses.dataclass(frozen=True)
class Violation:
    importer: str
    imp: Import
    rule: Rule

    def __str__(self):
        where = "function-level" if self.imp.deferred else "module-level"
        return (f"{self.importer} -> {self.imp.target} ({where}, line {self.imp.line}): "
                f"{self.rule.importer} must not import {_matching(self.imp.target, self.rule.forbidden)}")


@dataclasses.dataclass
class Report:
    graph: dict[str, dict[str, list[Import]]]
    cycles: list[list[str]]
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.cycles and not self.violations


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _matching(module: str, prefixes: Iterable[str]) -> str:
    return next(p for p in prefixes if _under(module, p))


# ---------------------------------------------------------------------------------------------------------
# Reading modules


def discover(root: str, packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    """{dotted module name: file path} for every `.py` file under the packages."""
    modules = {}
    for top in packages:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            rel = os.path.relpath(dirpath, root)
            parts = rel.split(os.sep)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                stem = name[:-3]
                modules[".".join(parts if stem == "__init__" else [*parts, stem])] = os.path.join(dirpath, name)
    return modules


def _raw_imports(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every Import / ImportFrom node with whether it sits inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _literal_table(node: ast.AST) -> dict[str, str] | None:
    """A lazy-export table's value: a dict of str -> str, with `**dict.fromkeys((names...), module)` parts."""
    if not isinstance(node, ast.Dict):
        return None
    table = {}
    for key, value in zip(node.keys, node.values):
        if key is None:  # **something
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "fromkeys" and isinstance(value.func.value, ast.Name)
                    and value.func.value.id == "dict" and len(value.args) == 2):
                try:
                    names, module = ast.literal_eval(value.args[0]), ast.literal_eval(value.args[1])
                except ValueError:
                    return None
                table.update(dict.fromkeys(names, module))
            else:
                inner = _literal_table(value)
                if inner is None:
                    return None
                table.update(inner)
        else:
            try:
                table[ast.literal_eval(key)] = ast.literal_eval(value)
            except ValueError:
                return None
    return table


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """The table a package's `__init__` hands to `lazy_exports(__name__, TABLE)`, or {}."""
    assigned = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id] = stmt.value
    for stmt in tree.body:
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.Expr)) else None
        if (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
                and (value.func.id if isinstance(value.func, ast.Name) else value.func.attr) == "lazy_exports"
                and len(value.args) == 2):
            table = value.args[1]
            if isinstance(table, ast.Name):
                table = assigned.get(table.id)
            found = _literal_table(table) if table is not None else None
            if found:
                return found
    return {}


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    """The longest prefix of dotted `name` that is a project module, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def build_graph(root: str, packages: Sequence[str] = PACKAGES) -> dict[str, dict[str, list[Import]]]:
    """{module: {imported project module: [Import, ...]}} for every module under the packages."""
    modules = discover(root, packages)
    trees = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            trees[module] = ast.parse(f.read(), filename=path)
    lazy = {module: _lazy_exports(tree) for module, tree in trees.items()
            if modules[module].endswith("__init__.py")}

    graph: dict[str, dict[str, list[Import]]] = {}
    for module, tree in trees.items():
        is_package = modules[module].endswith("__init__.py")
        edges: dict[str, list[Import]] = {}
        for node, deferred in _raw_imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, modules) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, up level - 1
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.append(full)
                    elif alias.name in lazy.get(base, {}) and lazy[base][alias.name] in modules:
                        targets.append(lazy[base][alias.name])
                    else:
                        targets.append(_resolve(base, modules))
            for target in dict.fromkeys(targets):  # `from a import x, y` is one import of `a`
                if target is not None and target != module:
                    edges.setdefault(target, []).append(Import(target, node.lineno, deferred))
        graph[module] = dict(sorted(edges.items()))
    return dict(sorted(graph.items()))


# ---------------------------------------------------------------------------------------------------------
# Checks


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively; each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def find_cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module."""
    return [c for c in strongly_connected(graph) if len(c) > 1]


def cycle_path(graph: dict[str, dict[str, list[Import]]], component: Sequence[str]) -> list[str]:
    """One closed path through a cycle's first module (shortest, by breadth-first search inside it)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in graph.get(node, {}):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def layering_violations(graph: dict[str, dict[str, list[Import]]],
                        rules: Sequence[Rule] = LAYERING) -> list[Violation]:
    found = []
    for importer, edges in graph.items():
        for rule in rules:
            if not _under(importer, rule.importer):
                continue
            for target, imports in edges.items():
                if any(_under(target, f) for f in rule.forbidden):
                    found.extend(Violation(importer, imp, rule) for imp in imports)
    return found


def check(root: str, packages: Sequence[str] = PACKAGES, rules: Sequence[Rule] | None = LAYERING) -> Report:
    """The graph of the packages under `root`, its cycles and (unless `rules` is None) layering violations."""
    graph = build_graph(root, packages)
    return Report(graph, find_cycles(graph), layering_violations(graph, rules) if rules is not None else [])


# ---------------------------------------------------------------------------------------------------------
# Output


def format_text(graph: dict[str, dict[str, list[Import]]]) -> str:
    lines = []
    for module, edges in graph.items():
        lines.append(module)
        for target, imports in edges.items():
            deferred = [i.line for i in imports if i.deferred]
            note = f"  (function-level, line {', '.join(map(str, deferred))})" if deferred else ""
            lines.append(f"    -> {target}{note}")
    return "\n".join(lines)


def format_dot(graph: dict[str, dict[str, list[Import]]]) -> str:
    lines = ["digraph imports {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    for module in graph:
        lines.append(f'  "{module}";')
    for module, edges in graph.items():
        for target, imports in edges.items():
            style = " [style=dashed]" if all(i.deferred for i in imports) else ""
            lines.append(f'  "{module}" -> "{target}"{style};')
    lines.append("}")
    return "\n".join(lines)


def format_problems(report: Report) -> str:
    lines = []
    for component in report.cycles:
        path = cycle_path(report.graph, component)
        steps = []
        for a, b in zip(path, path[1:]):
            imp = report.graph[a][b][0]
            steps.append(f"    {a} -> {b} (line {imp.line}{', function-level' if imp.deferred else ''})")
        lines.extend(textwrap.wrap(f"import cycle among {len(component)} modules: {', '.join(component)}",
                                   width=110, subsequent_indent="        "))
        lines.extend(steps)
        members = set(component)
        deferred = [f"{a} -> {b} (line {', '.join(str(i.line) for i in imports if i.deferred)})"
                    for a in component for b, imports in report.graph[a].items()
                    if b in members and any(i.deferred for i in imports)]
        if deferred:  # usually the imports that were moved into functions to dodge the cycle
            lines.append("  function-level imports inside it:")
            lines.extend(f"    {d}" for d in deferred)
    for violation in report.violations:
        lines.append(f"layering: {violation}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.import_graph", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the repository root (default: this checkout)")
    parser.add_argument("--format", choices=("text", "dot"), default="text", help="how to print the graph")
    parser.add_argument("--check", action="store_true", help="print only cycles and layering violations")
    parser.add_argument("--no-layering", action="store_true", help="check cycles only")
    args = parser.parse_args(argv)

    report = check(args.root, rules=None if args.no_layering else LAYERING)
    if not args.check:
        print(format_dot(report.graph) if args.format == "dot" else format_text(report.graph))
    problems = format_problems(report)
    if problems:
        print(problems, file=sys.stderr)
        return 1
    if args.check:
        print(f"{len(report.graph)} modules: no import cycles"
              + ("" if args.no_layering else ", no layering violations"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
