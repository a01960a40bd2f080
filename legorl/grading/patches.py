"""Unified diffs, file by file: split a patch, and drop what a candidate patch may not touch.

Grading takes only the agent's patch and never trusts it. Before it is applied, edits to these
paths are dropped (and recorded on the grade row):

- the hidden test files (every path the task's ``test_patch`` touches), and ``__init__.py`` in
  their folders;
- test infrastructure anywhere in the tree: ``conftest.py``; ``pytest.ini`` / ``.pytest.ini`` /
  ``pytest.toml``; ``sitecustomize.py`` / ``usercustomize.py``; ``*.pth``; compiled bytecode
  (``*.pyc``, ``*.pyo``, ``__pycache__/``: an unchecked-hash ``.pyc`` would run instead of a hidden
  helper's source); top-level modules that would shadow the test runner (``pytest``, ``_pytest``,
  ``pluggy``, ``py``);
- unsafe paths (absolute, ``..``, inside ``.git``).

``tox.ini``, ``setup.cfg`` and ``pyproject.toml`` hold other things besides pytest's settings, so
they are judged after the patch is applied: when their pytest section (``[pytest]``,
``[tool:pytest]``, ``[tool.pytest...]``) differs from the original, the file is restored
(:func:`pytest_section`).
"""

from __future__ import annotations

import configparser
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")

SITE_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
PYTEST_CONFIGS = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"})
SHARED_CONFIGS = frozenset({"tox.ini", "setup.cfg", "pyproject.toml"})
RUNNER_MODULES = frozenset({"pytest", "pytest.py", "_pytest", "pluggy", "pluggy.py", "py", "py.py"})


@dataclass
class FilePatch:
    """The part of a diff that changes one file."""

    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    text: str

    @property
    def paths(self) -> list[str]:
        return [p for p in dict.fromkeys([self.old_path, self.new_path]) if p]


@dataclass
class FilteredPatch:
    patch: str
    kept: list[FilePatch] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # path -> why


def _unquote(raw: str) -> str:
    """A path from a diff header: C-quoted (git quotes unusual names) or bare, tab-terminated."""
    raw = raw.rstrip("\n")
    if raw.startswith('"'):
        end = 1
        while end < len(raw) and not (raw[end] == '"' and raw[end - 1] != "\\"):
            end += 1
        body = raw[1:end]
        return body.encode("latin-1", "backslashescape").decode("unicode_escape").encode("latin-1").decode(
            "utf-8", "replace"
        )
    return raw.split("\t", 1)[0].strip()


def _strip_prefix(path: str) -> str | None:
    """``a/x/y`` -> ``x/y`` (what ``-p1`` does); ``/dev/null`` -> None."""
    if path == "/dev/null":
        return None
    parts = path.split("/", 1)
    return parts[1] if len(parts) == 2 else path


def _git_header_paths(line: str) -> tuple[str | None, str | None]:
    rest = line[len("diff --git ") :].rstrip("\n")
    if rest.startswith('"'):
        first = _unquote(rest)
        tail = rest[len(rest.split('" ', 1)[0]) + 2 :]
        return _strip_prefix(first), _strip_prefix(_unquote(tail))
    # Unquoted: "a/X b/X" — split where the second half starts with "b/" and both halves agree.
    half = (len(rest) - 1) // 2
    if rest[half] == " " and rest[half + 1 :].startswith("b/"):
        return _strip_prefix(rest[:half]), _strip_prefix(rest[half + 1 :])
    a, _, b = rest.partition(" b/")
    return _strip_prefix(a), b or None


def split_patch(text: str) -> list[FilePatch]:
    """Split a unified diff (git-style or plain) into per-file parts.

    Hunk bodies are consumed by their line counts, so a content line that happens to start with
    ``--- `` or ``diff --git`` never starts a new file.
    """
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    cur: list[str] = []
    old: str | None = None
    new: str | None = None
    git = False
    i = 0

    def flush() -> None:
        nonlocal cur, old, new, git
        if cur:
            files.append(FilePatch(old, new, "".join(cur)))
        cur, old, new, git = [], None, None, False

    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            flush()
            git = True
            old, new = _git_header_paths(line)
            cur.append(line)
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if not git or any(c.startswith("--- ") for c in cur):
                flush()
            old = _strip_prefix(_unquote(line[4:]))
            new = _strip_prefix(_unquote(lines[i + 1][4:]))
            cur += [line, lines[i + 1]]
            i += 1
        elif git and line.startswith(("rename from ", "copy from ")):
            old = _unquote(line.split(" ", 2)[2])
            cur.append(line)
        elif git and line.startswith(("rename to ", "copy to ")):
            new = _unquote(line.split(" ", 2)[2])
            cur.append(line)
        elif git and line.startswith("new file mode"):
            old = None
            cur.append(line)
        elif git and line.startswith("deleted file mode"):
            new = None
            cur.append(line)
        elif (m := _HUNK.match(line)) and cur:
            cur.append(line)
            old_left = int(m.group(2)) if m.group(2) is not None else 1
            new_left = int(m.group(4)) if m.group(4) is not None else 1
            while (old_left > 0 or new_left > 0) and i + 1 < len(lines):
                i += 1
                body = lines[i]
                cur.append(body)
                tag = body[:1]
                if tag in (" ", "\n", "\r"):
                    old_left, new_left = old_left - 1, new_left - 1
                elif tag == "-":
                    old_left -= 1
                elif tag == "+":
                    new_left -= 1
            # "\ No newline at end of file" belongs to the hunk
            while i + 1 < len(lines) and lines[i + 1].startswith("\\"):
                i += 1
                cur.append(lines[i])
        elif cur:
            cur.append(line)  # index lines, mode lines, binary patches
        i += 1
    flush()
    return files


def touched_paths(patch: str | None) -> list[str]:
    """Every path a patch touches (old and new names), in order."""
    out: dict[str, None] = {}
    for fp in split_patch(patch or ""):
        for p in fp.paths:
            out[p] = None
    return list(out)


def drop_reason(path: str, hidden: frozenset[str], hidden_dirs: frozenset[str]) -> str | None:
    """Why an edit to ``path`` may not reach the graded tree, or None when it may."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or ".git" in pure.parts:
        return "unsafe path"
    if path in hidden:
        return "hidden test file"
    name = pure.name
    if name == "conftest.py":
        return "conftest.py"
    if name in SITE_HOOKS:
        return "interpreter hook"
    if name.endswith(".pth"):
        return ".pth file"
    if name.endswith((".pyc", ".pyo")) or "__pycache__" in pure.parts:
        return "compiled bytecode"
    if name in PYTEST_CONFIGS:
        return "pytest config"
    if pure.parts and pure.parts[0] in RUNNER_MODULES:
        return "shadows the test runner"
    if name == "__init__.py" and str(pure.parent) in hidden_dirs:
        return "test package __init__"
    return None


def filter_patch(patch: str | None, hidden_paths: Iterable[str]) -> FilteredPatch:
    """Drop the per-file parts of ``patch`` that touch hidden tests or test infrastructure."""
    hidden = frozenset(hidden_paths)
    hidden_dirs = frozenset(str(PurePosixPath(p).parent) for p in hidden)
    out = FilteredPatch(patch="")
    for fp in split_patch(patch or ""):
        reasons = [(p, r) for p in fp.paths if (r := drop_reason(p, hidden, hidden_dirs))]
        if reasons:
            for p in fp.paths:
                out.dropped[p] = reasons[0][1]
        else:
            out.kept.append(fp)
    out.patch = "".join(fp.text if fp.text.endswith("\n") else fp.text + "\n" for fp in out.kept)
    return out


def shared_configs(files: Iterable[FilePatch]) -> list[str]:
    """Paths among ``files`` that may hold a pytest section (judged after applying)."""
    return [p for fp in files for p in fp.paths if PurePosixPath(p).name in SHARED_CONFIGS]


def pytest_section(name: str, text: str | None) -> object:
    """The pytest settings a config file holds (comparable with ==), or a marker when unparsable.

    ``name`` is the file's base name: ``tox.ini`` -> ``[pytest]``, ``setup.cfg`` ->
    ``[tool:pytest]``, ``pyproject.toml`` -> ``[tool.pytest...]``.
    """
    if text is None:
        return None
    if name == "pyproject.toml":
        try:
            return tomllib.loads(text).get("tool", {}).get("pytest")
        except tomllib.TOMLDecodeError:
            return ("<unparsable>", text)
    section = "pytest" if name == "tox.ini" else "tool:pytest"
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(text)
    except configparser.Error:
        return ("<unparsable>", text)
    return dict(parser.items(section)) if parser.has_section(section) else None
