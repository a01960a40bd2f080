"""Hide a task's failing tests: delete the test functions behind test ids from a tree (step 3 of
:mod:`legorl.tasks.builder`; the task's ``test_patch`` puts them back)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from legorl.tasks.library import BuildError


def _test_target(test_id: str) -> tuple[str, str | None, str]:
    """``path::Class::func[param]`` -> (path, Class, func)."""
    parts = test_id.split("[", 1)[0].split("::")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[-2], parts[-1]


def _function_spans(text: str, cls: str | None, func: str, anywhere: bool) -> list[tuple[int, int, ast.AST]]:
    """Line spans (1-based, inclusive, decorators included) of ``func`` defined in ``cls``."""
    tree = ast.parse(text)
    spans: list[tuple[int, int, ast.AST]] = []

    def visit(body: list[ast.stmt], owner: ast.ClassDef | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
                owner_name = owner.name if owner else None
                if anywhere or owner_name == cls:
                    start = min([node.lineno, *[d.lineno for d in node.decorator_list]])
                    spans.append((start, node.end_lineno or node.lineno, owner or tree))

    visit(tree.body, None)
    return spans


def remove_tests(root: Path, test_ids: Iterable[str], helper_files: list[str]) -> list[str]:
    """Delete the functions behind ``test_ids`` from the files under ``root``; the files changed.

    A test inherited from a mixin defined elsewhere (say ``tests/__init__.py``) is removed where it
    is defined. Raises :class:`BuildError` when a test's definition cannot be found.
    """
    removals: dict[str, set[tuple[str | None, str, bool]]] = {}
    for test_id in test_ids:
        path, cls, func = _test_target(test_id)
        text = (root / path).read_text()
        if _function_spans(text, cls, func, anywhere=False):
            removals.setdefault(path, set()).add((cls, func, False))
            continue
        found = [h for h in helper_files if _function_spans((root / h).read_text(), None, func, anywhere=True)]
        if not found:
            raise BuildError(f"cannot find the definition of {test_id}")
        for h in found:
            removals.setdefault(h, set()).add((None, func, True))
    for path, items in removals.items():
        text = (root / path).read_text()
        lines = text.splitlines(keepends=True)
        spans: list[tuple[int, int, ast.AST]] = []
        for cls, func, anywhere in items:
            spans += _function_spans(text, cls, func, anywhere)
        drop: set[int] = set()
        for start, end, _owner in spans:
            drop.update(range(start, end + 1))
        out = []
        for number, line in enumerate(lines, 1):
            if number not in drop:
                out.append(line)
        new_text = "".join(out)
        # A class left without a body gets `pass`.
        try:
            ast.parse(new_text)
        except SyntaxError:
            new_text = _fill_empty_classes(text, spans, lines)
        (root / path).write_text(new_text)
    return sorted(removals)


def _fill_empty_classes(text: str, spans: list[tuple[int, int, ast.AST]], lines: list[str]) -> str:
    drop: dict[int, str] = {}
    for start, end, owner in spans:
        for n in range(start, end + 1):
            drop[n] = ""
        if isinstance(owner, ast.ClassDef):
            remaining = [s for s in owner.body if not any(
                s.lineno >= a and (s.end_lineno or s.lineno) <= b for a, b, _ in spans)]
            if not remaining:
                indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
                drop[start] = f"{indent}pass\n"
    return "".join(drop.get(n, line) for n, line in enumerate(lines, 1))
