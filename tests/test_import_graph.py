"""The project's own import graph has no circle, and each folder imports only from the layers below it.

Every import of a ``legorl`` module counts, at module level or inside a function (a lazy import
hides a circle from Python, not from a reader), ``TYPE_CHECKING`` ones too: two modules that need
each other are one idea split in two. ``cli/`` and ``stages/`` are ``legorl.cli`` and ``legorl.stages``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"legorl": ROOT / "legorl", "legorl.cli": ROOT / "cli", "legorl.stages": ROOT / "stages"}
# The layers, lowest first: a module imports from its own folder and from the layers below its own.
# The core (schemas, errors, paths, the shard files every stage meets in) stands on nothing else.
LAYERS = (
    ("legorl.core",),
    ("legorl.models", "legorl.routing", "legorl.sandbox"),
    ("legorl.engines",),
    ("legorl.proxy",),
    ("legorl.harnesses",),
    ("legorl.trials",),
    ("legorl.grading",),
    ("legorl.tasks",),
    ("legorl.monitor", "legorl.training", "legorl.demo"),
    ("legorl.stages",),
    ("legorl.flows",),
    ("legorl.cli",),
)


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or (package == "legorl" and path.is_relative_to(ROOT / "legorl" / "cli")):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project's modules ``path`` imports (a name imported from a package counts as its module
    when there is one: ``from legorl.proxy import wire``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import legorl.grading.grader as g` and the like
                target = target.rpartition(".")[0]
            if target and target != name and target != "legorl":
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    edges = graph()
    found = circles(edges)
    assert not found, "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a] & set(c))) for c in found)


def folder(name: str) -> str:
    """The layer entry a module belongs to (``legorl.proxy.wire`` -> ``legorl.proxy``)."""
    return ".".join(name.split(".")[:2])


def layer(name: str) -> int:
    for i, entries in enumerate(LAYERS):
        if folder(name) in entries:
            return i
    raise AssertionError(f"{name}: in no layer of LAYERS (add its folder)")


def upward(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module's imports of a higher layer, or of another folder of its own layer."""
    out = {}
    for name, targets in edges.items():
        up = sorted(t for t in targets
                    if layer(t) > layer(name) or (layer(t) == layer(name) and folder(t) != folder(name)))
        if up:
            out[name] = up
    return out


def test_each_folder_imports_only_from_the_layers_below() -> None:
    assert not upward(graph())


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward({"legorl.core.paths": {"legorl.trials.costs"}, "legorl.proxy.app": {"legorl.core.errors"},
                   "legorl.monitor.inspect": {"legorl.training.data"}}) == {
        "legorl.core.paths": ["legorl.trials.costs"], "legorl.monitor.inspect": ["legorl.training.data"]}
    edges = graph()
    assert "legorl.proxy.wire" in edges["legorl.proxy.openai_api"]  # `from legorl.proxy.wire import ...`
    assert "legorl.grading.grader" in edges["legorl.cli.grade"]  # cli/ is legorl.cli
