"""Unified diffs, file by file: split a patch (git-style or plain) and list the paths it touches.

Grading never trusts what a diff says it touches — it judges the tree after applying
(:mod:`legorl.grading.sandboxed.judge`); this module serves the host's bookkeeping: which files a
task's ``test_patch`` holds (the hidden tests), and task import checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")



@dataclass
class FilePatch:
    """The part of a diff that changes one file."""

    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    text: str

    @property
    def paths(self) -> list[str]:
        return [p for p in dict.fromkeys([self.old_path, self.new_path]) if p]


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


def added_lines(patch: str | None) -> dict[str, list[int]]:
    """For each file a patch leaves, the line numbers (in the new file) of the lines it adds."""
    out: dict[str, list[int]] = {}
    for fp in split_patch(patch or ""):
        if fp.new_path is None:
            continue
        lines = out.setdefault(fp.new_path, [])
        number = 0
        in_hunk = False
        for line in fp.text.splitlines():
            m = _HUNK.match(line)
            if m:
                number, in_hunk = int(m.group(3)), True
            elif in_hunk and line.startswith("+"):
                lines.append(number)
                number += 1
            elif in_hunk and line[:1] in (" ", ""):
                number += 1
    return out
