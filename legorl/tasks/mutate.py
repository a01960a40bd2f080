"""One-span source mutations located with the AST (the bugs of SWE-smith-style tasks).

Each :class:`Mutation` replaces one span of one file: a comparison operator flipped (``<`` ->
``>=``, ``==`` -> ``!=``, ``in`` -> ``not in``, ...), ``and`` swapped with ``or``, a ``not``
dropped, or an integer constant moved by one. Spans come from the AST's exact positions, so the
rest of the file stays byte-identical and the fix (the gold patch) is the one-span reversal.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Iterator
from dataclasses import dataclass

_FLIP: dict[type[ast.cmpop], str] = {
    ast.Eq: "!=", ast.NotEq: "==", ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">",
    ast.Is: "is not", ast.IsNot: "is", ast.In: "not in", ast.NotIn: "in",
}
_OP_TEXT: dict[type[ast.cmpop], tuple[str, ...]] = {
    ast.Eq: ("==",), ast.NotEq: ("!=",), ast.Lt: ("<",), ast.GtE: (">=",), ast.Gt: (">",), ast.LtE: ("<=",),
    ast.Is: ("is",), ast.IsNot: ("is not", "is  not"), ast.In: ("in",), ast.NotIn: ("not in", "not  in"),
}


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the repository root
    kind: str  # compare | boolop | not | constant
    start: int  # character offsets into the file's text
    end: int
    old: str
    new: str
    line: int

    def apply(self, text: str) -> str:
        if text[self.start : self.end] != self.old:
            raise ValueError(f"{self.path}:{self.line}: the span no longer reads {self.old!r}")
        return text[: self.start] + self.new + text[self.end :]

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.old!r} -> {self.new!r}"


def _offsets(text: str) -> list[int]:
    """Character offset of each line start (AST columns are UTF-8 byte offsets; converted below)."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


class _Locator:
    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = _offsets(text)

    def pos(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1]
        col = len(line.encode()[:col_bytes].decode(errors="replace"))
        return self.starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.pos(node.lineno, node.col_offset),  # type: ignore[attr-defined]
                self.pos(node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]


def _in_annotation_or_docstring(tree: ast.AST) -> set[int]:
    """ids of nodes not worth mutating: annotations (types) and everything under them."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        annotations: list[ast.AST | None] = []
        if isinstance(node, ast.arg | ast.AnnAssign):
            annotations.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotations.append(node.returns)
        for ann in annotations:
            if ann is not None:
                skip.update(id(n) for n in ast.walk(ann))
    return skip


def find_mutations(path: str, text: str) -> list[Mutation]:
    """Every candidate mutation of one Python file, in source order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    loc = _Locator(text)
    skip = _in_annotation_or_docstring(tree)
    out: list[Mutation] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            gap_start = loc.span(node.left)[1]
            gap_end = loc.span(node.comparators[0])[0]
            gap = text[gap_start:gap_end]
            for op_text in _OP_TEXT[type(node.ops[0])]:
                i = gap.find(op_text)
                if i >= 0 and gap.count(op_text) == 1:
                    s = gap_start + i
                    out.append(Mutation(path, "compare", s, s + len(op_text), op_text, _FLIP[type(node.ops[0])],
                                        node.lineno))
                    break
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            gap_start = loc.span(node.values[0])[1]
            gap_end = loc.span(node.values[1])[0]
            gap = text[gap_start:gap_end]
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            i = gap.find(f" {old} ")
            if i >= 0 and gap.count(f" {old} ") == 1 and "#" not in gap:
                s = gap_start + i + 1
                out.append(Mutation(path, "boolop", s, s + len(old), old, new, node.lineno))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            s, e = loc.span(node)
            os_, oe = loc.span(node.operand)
            operand = text[os_:oe]
            if "\n" in text[s:e]:
                continue
            out.append(Mutation(path, "not", s, e, text[s:e], f"({operand})", node.lineno))
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and node.end_lineno == node.lineno):
            s, e = loc.span(node)
            old = text[s:e]
            if not old.isdigit() or (old.startswith("0") and old != "0"):
                continue  # hex, octal-looking, underscores: leave them
            for new_value in (node.value + 1, node.value - 1):
                if new_value >= 0:
                    out.append(Mutation(path, "constant", s, e, old, str(new_value), node.lineno))
    out.sort(key=lambda m: (m.start, m.kind, m.new))
    return out


def sample(mutations: list[Mutation], k: int, seed: int) -> Iterator[Mutation]:
    """Up to ``k`` mutations in a seeded random order, at most one per source line."""
    rng = random.Random(seed)
    pool = list(mutations)
    rng.shuffle(pool)
    seen_lines: set[tuple[str, int]] = set()
    taken = 0
    for m in pool:
        if taken >= k:
            return
        if (m.path, m.line) in seen_lines:
            continue
        seen_lines.add((m.path, m.line))
        taken += 1
        yield m
