"""Where a hidden test's expected values are: the syntax-tree reading behind the canaries.

Given the statement a test fails at (its *site*), the values it compares against there: the literal
sides of an equality or identity assertion (``assert X == L``, ``self.assertEqual(X, L)``), the value
of a local bound once that one side names, the literal arguments of a constructor call there, the
argument a helper call passes to a parameter the helper compares against, the exception class a
``pytest.raises``/``assertRaises`` expects, and a parametrized row's value for a compared parameter.
:mod:`.canary` decides what each becomes.

Used in the grading container; Python 3.8+, standard library only.
"""

from __future__ import annotations

import ast
from typing import Tuple  # noqa: UP035 - task images may run Python 3.8

EQUAL_METHODS = frozenset({"assertEqual", "assertEquals", "assert_equal", "assertListEqual", "assertTupleEqual",
                           "assertDictEqual", "assertSetEqual", "assertSequenceEqual", "assertMultiLineEqual"})
RAISES = frozenset({"raises", "assertRaises", "assertRaisesRegex", "assertRaisesRegexp"})
Site = Tuple[ast.expr, str]  # noqa: UP006 - (a node to respell, how: "literal", "nudge" or "exception")


def literal_sites(node: ast.expr, calls: bool = False, how: str = "literal") -> list[Site]:
    """The constants of a literal expected value: a constant, a tuple/list/set/dict display of them, or
    (with ``calls``: the value is known to be the expected one, never the call under test) a
    constructor call on them, whose numbers are only nudged (a drawn one may be out of its range)."""
    if isinstance(node, ast.Constant):
        return [(node, how)] if isinstance(node.value, (int, float, str, bytes)) else []
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = node.operand
        return [(inner, how)] if isinstance(inner, ast.Constant) and kind_of(inner.value) in (int, float) else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        parts: list[ast.expr] = list(node.elts)
    elif isinstance(node, ast.Dict):
        parts = [v for v in node.values if v is not None]
    elif calls and isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
        parts, how = [*node.args, *(k.value for k in node.keywords)], "nudge"
    else:
        return []
    return [s for p in parts for s in literal_sites(p, calls, how)]


def _own_nodes(root: ast.AST) -> list[ast.AST]:
    """The nodes of a function's own body (nested functions and classes left out)."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def statement_at(func: ast.AST, line: int) -> ast.stmt | None:
    """The innermost statement of ``func``'s own body that spans ``line``."""
    spans = [n for n in _own_nodes(func) if isinstance(n, ast.stmt) and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return max(spans, key=lambda n: (n.lineno, -(n.end_lineno or n.lineno)), default=None)


def statement_nodes(stmt: ast.stmt) -> list[ast.AST]:
    """A statement and the nodes of its own expressions (not the statements of its body)."""
    out: list[ast.AST] = [stmt]
    for _field, value in ast.iter_fields(stmt):
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST) and not isinstance(child, (ast.stmt, ast.excepthandler)):
                out += list(ast.walk(child))
    return out


def expected_sides(nodes: list[ast.AST]) -> list[ast.expr]:
    """Both sides of the equality (and identity) assertions among ``nodes``."""
    out: list[ast.expr] = []
    for node in nodes:
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                and isinstance(node.test.ops[0], (ast.Eq, ast.Is)):
            out += [node.test.left, node.test.comparators[0]]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in EQUAL_METHODS \
                and len(node.args) >= 2:
            out += node.args[:2]
    return out


def expected_exceptions(nodes: list[ast.AST]) -> list[Site]:
    """The exception classes named by ``pytest.raises(E)`` / ``self.assertRaises(E, ...)`` among ``nodes``."""
    out: list[Site] = []
    for node in nodes:
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr in RAISES)
                or (isinstance(node.func, ast.Name) and node.func.id == "raises")):
            out.append((node.args[0], "exception"))
    return out


def assigned_once(func: ast.AST) -> dict[str, ast.expr]:
    """The local names ``func``'s own body binds exactly once, by a plain ``name = value``, with the value."""
    stores: dict[str, int] = {}
    values: dict[str, ast.expr] = {}
    for node in _own_nodes(func):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
    return {name: value for name, value in values.items() if stores.get(name) == 1}


def compared_values(nodes: list[ast.AST], assigned: dict[str, ast.expr]) -> list[Site]:
    """What an equality among ``nodes`` compares against: its literal sides, and the value a local
    bound once holds where exactly one side is such a local (``assert f(v) == expected``)."""
    sides = expected_sides(nodes)
    out: list[Site] = []
    for i in range(0, len(sides) - 1, 2):
        pair = sides[i:i + 2]
        out += [site for side in pair for site in literal_sites(side)]
        locals_ = [side.id for side in pair if isinstance(side, ast.Name) and side.id in assigned]
        if len(locals_) == 1:
            out += literal_sites(assigned[locals_[0]], calls=True)
    return out


def positional_params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in (*getattr(func.args, "posonlyargs", []), *func.args.args)]


def expected_params(func: ast.FunctionDef | ast.AsyncFunctionDef, nodes: list[ast.AST] | None = None) -> set[str]:
    """``func``'s parameters that an assertion compares against (in ``nodes``, else in its own body)."""
    params = set(positional_params(func))
    sides = expected_sides(_own_nodes(func) if nodes is None else nodes)
    out = set()
    for i in range(0, len(sides) - 1, 2):  # a parameter compared with another is not known to be the expected one
        named = [side.id for side in sides[i:i + 2] if isinstance(side, ast.Name) and side.id in params]
        if len(named) == 1:
            out.add(named[0])
    return out


def _auto_id(values: list[ast.expr], argnames: list[str], index: int) -> str:
    """pytest's id for a row of plain values (its own ids for anything else are not guessed)."""
    parts = []
    for i, value in enumerate(values):  # (no zip(strict=): Python 3.8)
        plain = isinstance(value, ast.Constant) and (value.value is None or isinstance(value.value, (str, int, float)))
        parts.append(str(value.value) if plain else f"{argnames[i]}{index}")  # type: ignore[attr-defined]
    return "-".join(parts)


def parametrize_rows(func: ast.FunctionDef | ast.AsyncFunctionDef, names: set[str]) -> list[tuple[str, ast.expr, bool]]:
    """``(row id, value, id shown)`` for the values ``@pytest.mark.parametrize`` rows give the parameters
    in ``names`` (one decorator: stacked ones multiply their rows' ids); ``id shown``: the row's id is
    pytest's own, made from the value (so a new value would rename the test)."""
    decos = [d for d in func.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
             and d.func.attr == "parametrize" and len(d.args) >= 2]
    if len(decos) != 1:
        return []
    deco = decos[0]
    spec, rows = deco.args[0], deco.args[1]
    if isinstance(spec, ast.Constant) and isinstance(spec.value, str):
        argnames = [a.strip() for a in spec.value.split(",") if a.strip()]
    elif isinstance(spec, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in spec.elts):
        argnames = [str(e.value) for e in spec.elts]  # type: ignore[attr-defined]
    else:
        return []
    wanted = [i for i, name in enumerate(argnames) if name in names]
    if not wanted or not isinstance(rows, (ast.List, ast.Tuple)):
        return []
    ids_kw = next((k.value for k in deco.keywords if k.arg == "ids"), None)
    ids = [str(e.value) for e in ids_kw.elts if isinstance(e, ast.Constant)] \
        if isinstance(ids_kw, (ast.List, ast.Tuple)) else None
    if ids_kw is not None and (ids is None or len(ids) != len(rows.elts)):
        return []
    out: list[tuple[str, ast.expr, bool]] = []
    for index, row in enumerate(rows.elts):
        own_id = ids[index] if ids is not None else None
        if isinstance(row, ast.Call) and isinstance(row.func, ast.Attribute) and row.func.attr == "param":
            id_kw = next((k.value for k in row.keywords if k.arg == "id"), None)
            if id_kw is not None:
                if not (isinstance(id_kw, ast.Constant) and isinstance(id_kw.value, str)):
                    continue
                own_id = id_kw.value
            values: list[ast.expr] = list(row.args)
        elif len(argnames) == 1:
            values = [row]
        elif isinstance(row, (ast.Tuple, ast.List)):
            values = list(row.elts)
        else:
            continue
        if len(values) == len(argnames):
            row_id = own_id if own_id is not None else _auto_id(values, argnames, index)
            out += [(row_id, values[i], own_id is None) for i in wanted]
    return out


def helper_arguments(nodes: list[ast.AST], helpers: dict[str, tuple[list[str], set[str]]]) -> list[ast.expr]:
    """Arguments that calls among ``nodes`` pass to a helper's compared-against parameters (a function
    of the file, or a method called on ``self``/``cls``)."""
    out: list[ast.expr] = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in helpers:
            params, expected = helpers[node.func.id]
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in ("self", "cls") and node.func.attr in helpers:
            params, expected = helpers[node.func.attr]
            params = params[1:]
        else:
            continue
        out += [arg for i, arg in enumerate(node.args) if i < len(params) and params[i] in expected]
        out += [kw.value for kw in node.keywords if kw.arg in expected]
    return out


def kind_of(value: object) -> type:
    return bool if isinstance(value, bool) else type(value)
