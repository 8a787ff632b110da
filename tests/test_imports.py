"""The import graph of dew_pipe: no circles, nothing importing a higher floor.

The graph is read from the source with ``ast``, so it sees every import a module can make,
not only the ones a test run happens to execute:

* ``top``: a module-level import, run when the module is imported;
* ``deferred``: an import inside a function body, run when the function is;
* ``typing``: an import under ``if TYPE_CHECKING:``, read only by type checkers;
* ``lazy``: a name in a lazy-export table (``_LAZY = {name: module}`` handed to
  :func:`dew_pipe._lazy.lazy_exports`), imported when the name is first used.

Every kind is a dependency, so a circle through any of them is reported: two modules that
need each other are one concept split in two, whether or not Python happens to load them
in an order that works. An import of ``a.b.c`` is an edge to ``a.b.c`` alone; the packages
above it are loaded too but are not counted, since a package's own lazy table is what
makes that harmless.

Floors are the ones ``design.md`` gives, from the ground up (see :data:`FLOORS`). A module
may import its own floor and those below. The one sanctioned way up is a lazy export: a
lower module (``dew_pipe.objectives.rl``) may name something that lives higher up
(``RolloutScheduler``) so that the spec's import path works, so ``lazy`` edges are exempt
from the floor rule (not from the circle rule).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each importable name's files are: stages/ is installed as dew_pipe.stages.
PACKAGES = {"dew_pipe": ROOT / "dew_pipe", "dew_pipe.stages": ROOT / "stages"}
SCRIPTS = {"pipelines": ROOT / "pipelines"}  # pipeline files: top floor, imported by nobody

#: Module prefix -> floor, from the ground up (design.md "Floors"). The longest prefix wins.
FLOORS: dict[str, int] = {
    "dew_pipe": 0,  # the package itself, the shared helpers, batches, models, data, training
    "dew_pipe.objectives": 1,
    "dew_pipe.sampling": 1,
    "dew_pipe.inference": 1,
    "dew_pipe.sandbox": 1,  # sandboxes for untrusted programs: launcher, runners, fleet
    "dew_pipe.tasks": 1,  # task definitions: prompts, verifiers (ready jobs are pipelines)
    "dew_pipe.rewards": 1,  # verifiable rewards (MathReward, CodeReward on the sandbox fleet)
    "dew_pipe.recipes": 1,  # stage chains: the Trainer, the objectives and SampledRollout composed
    "dew_pipe.flow": 2,
    "dew_pipe.stages": 3,
    "dew_pipe.beam": 3,  # offline jobs built from the objectives' functions
    "dew_pipe.stages.scheduler": 4,  # RolloutScheduler: a composition of stages
    "pipelines": 4,
    "dew_pipe.cli": 5,
    "dew_pipe.cli_tools": 5,  # the plot and audit sub-commands of dew-pipe
    "dew_pipe.compile_cache": 5,  # dew-pipe run's disk cache of compiled programs
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # "top", "deferred", "typing" or "lazy"
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.kind}, line {self.line})"


def _modules() -> dict[str, Path]:
    """Every module of dew_pipe, dew_pipe.stages and pipelines/, by dotted name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "dew_pipe" and name.startswith("dew_pipe.stages"):
                continue  # not a real path; stages/ is mapped
            found[name] = path
    for prefix, folder in SCRIPTS.items():
        for path in sorted(folder.glob("*.py")):
            found[f"{prefix}.{path.stem}"] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported dotted name refers to (its longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.AST, str]]:
    """Every node under ``node`` with the kind of import it would be."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, "deferred" if kind == "top" else kind)
        elif isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.body:
                yield stmt, "typing"
                yield from _walk(stmt, "typing")
            for stmt in child.orelse:
                yield stmt, kind
                yield from _walk(stmt, kind)
        else:
            yield child, kind
            yield from _walk(child, kind)


def _lazy_targets(value: ast.expr) -> Iterator[str]:
    if not isinstance(value, ast.Dict):
        return
    for target in value.values:
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            yield target.value
        elif (
            isinstance(target, ast.Tuple)
            and target.elts
            and isinstance(target.elts[0], ast.Constant)
            and isinstance(target.elts[0].value, str)
        ):
            yield target.elts[0].value


def _edges(module: str) -> list[Edge]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    edges = []

    def add(name: str, kind: str, line: int) -> None:
        target = _resolve(name)
        edge = Edge(module, target, kind, line) if target not in (None, module) else None
        if edge is not None and edge not in edges:
            edges.append(edge)

    for node, kind in _walk(tree, "top"):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, kind, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                full = f"{base}.{alias.name}"
                add(full if full in MODULES else base, kind, node.lineno)
    for node in tree.body:  # module-level lazy tables
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets) and value is not None:
            for name in _lazy_targets(value):
                add(name, "lazy", node.lineno)
    return edges


GRAPH: dict[str, list[Edge]] = {module: _edges(module) for module in MODULES}


def _cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                target = edge.target
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _floor(module: str) -> int:
    prefix = module
    while prefix not in FLOORS:
        prefix = prefix.rpartition(".")[0]
    return FLOORS[prefix]


def _describe(component: list[str]) -> str:
    members = set(component)
    inside = [str(e) for m in component for e in GRAPH[m] if e.target in members]
    return "circle of " + ", ".join(component) + ":\n    " + "\n    ".join(inside)


def test_the_graph_sees_the_whole_package():
    assert "dew_pipe.objectives.rl.sessions" in MODULES
    assert "dew_pipe.stages.messages" in MODULES and "pipelines.demo" in MODULES
    kinds = {e.kind for edges in GRAPH.values() for e in edges}
    assert kinds == {"top", "deferred", "typing", "lazy"}
    # a lazy table is read: the package names the module that defines pack
    assert any(
        e.target == "dew_pipe.objectives.rl.packing" and e.kind == "lazy"
        for e in GRAPH["dew_pipe.objectives.rl"]
    )


def test_the_cycle_finder_finds_a_circle():
    a, b, c = "a", "b", "c"
    graph = {
        a: [Edge(a, b, "top", 1)],
        b: [Edge(b, c, "lazy", 1)],
        c: [Edge(c, a, "deferred", 1)],
        "d": [Edge("d", a, "top", 1)],
    }
    assert _cycles(graph) == [[a, b, c]]
    assert _cycles({a: [Edge(a, b, "top", 1)], b: []}) == []


def test_no_import_circles():
    circles = [_describe(c) for c in _cycles(GRAPH)]
    assert not circles, "\n".join(circles)


def test_nothing_imports_a_higher_floor():
    upward = [
        f"{e} (floor {_floor(e.source)} -> {_floor(e.target)})"
        for edges in GRAPH.values()
        for e in edges
        if e.kind != "lazy" and _floor(e.target) > _floor(e.source)
    ]
    assert not upward, "\n".join(upward)


# The session format's modules, each imported alone in a fresh interpreter: an import-time
# circle shows up as an ImportError for whichever module happens to be imported first.
SESSION_FORMAT = [
    "dew_pipe.rollout_batches",
    "dew_pipe.batches",
    "dew_pipe.objectives.rl.session_records",
    "dew_pipe.objectives.rl.sessions",
    "dew_pipe.objectives.rl.session_arrow",
    "dew_pipe.objectives.rl.packing",
    "dew_pipe.objectives.rl.session_stats",
    "dew_pipe.objectives.rl.advantages",
    "dew_pipe.objectives.rl.task_rows",
    "dew_pipe.stages.messages",
    "dew_pipe.beam.sources",
    "dew_pipe.beam.packing",
    "dew_pipe.beam.journal",
]


def test_session_format_modules_import_alone():
    code = "import importlib, sys\nimportlib.import_module(sys.argv[1])"
    failed = []
    for module in SESSION_FORMAT:
        run = subprocess.run(
            [sys.executable, "-c", code, module], capture_output=True, text=True, timeout=120
        )
        if run.returncode:
            failed.append(f"{module}: {run.stderr.strip().splitlines()[-1]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("module", SESSION_FORMAT)
def test_session_format_modules_are_outside_every_circle(module):
    assert all(module not in c for c in _cycles(GRAPH))
