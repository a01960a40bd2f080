"""Judge what a patch actually changed in /testbed, and undo what a candidate patch may not change.

Runs inside the grading container, as root, with ``python3 -I`` and nothing of the repository on
its path, after the patch was applied by an unprivileged user whose processes are all dead. It
never follows a link in the tree. It compares the tree with the pristine copy taken before the
patch (type, mode, size, content) and, for every path that differs, applies the rules below; a
path that breaks one is put back as it was (or removed when it is new) and reported with why.
This is the one place these rules live (docs/threat-model.md points here):

- ``.git`` anywhere (the repository's own history is outside the tree while patches apply);
- the hidden test files (what the task's test_patch touches), their parent directories, every
  file under a test directory that holds one, and — beside a hidden test in another folder (a flat
  layout's root) — the modules only tests can need (not the gold patch's, imported by no other module
  but tests and such modules);
- symbolic links and special files the patch made, and native code (shared libraries,
  executables: code that no screen can read);
- files the test runner or the interpreter reads on its own: ``conftest.py``, pytest's and the
  shared config files (``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``, ...),
  ``sitecustomize``/``usercustomize``, ``.pth``, compiled bytecode, packaging metadata
  (``*.dist-info``/``*.egg-info``: entry points autoload pytest plugins);
- test files anywhere (``test_*.py``, ``*_test.py``): only the hidden tests run, so a new or edited
  test file can matter only as a module something imports (one the library imports is the library's);
- new top-level modules (outside any package: a folder without ``__init__.py`` may be on
  ``sys.path``, unless it lies inside a package and pytest puts it on no path: no hidden test below
  it, no ``conftest.py`` in it), above all those named like a standard-library module or anything
  installed in the image (the runner, its dependencies). A fix lives in the package; a new module at the top is a
  reproduction script, or a way around the screen below. Where the fix itself lives at the top (the
  gold patch changes a module outside any package: a single-module library, a namespace package), or
  with ``"top_level_modules": true`` in the config (a Harbor task's WORKDIR, usually a flat folder),
  a new helper module beside it is the usual shape of a fix: only those that shadow a module go back.

Then it screens the Python lines the patch added outside the tests for code that reaches into
the test runner or the interpreter (:mod:`.screen`, a tripwire); findings go on the grade row.

Usage (:func:`legorl.grading.script.launch`): ``judge CONFIG.json`` prints one JSON object:
``{"reset": [[path, why], ...], "changed": [path, ...], "suspicious": ["path:line: why: code"]}``.
Compatible with Python 3.8+ (task images bring their own interpreter).
"""

from __future__ import annotations

import json
import os
import pkgutil
import shutil
import stat
import sys
import time

from .screen import MAX_FINDINGS, added_lines, screen

RUNNER_CONFIGS = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
                            "pyproject.toml", "conftest.py"})
SITE_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".egg")
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
NATIVE_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".o", ".a")
NATIVE_MAGIC = (b"\x7fELF", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
TEST_DIR_PREFIX = "test"  # directories named test, tests, testing, test_utils, ...
MAX_ENTRIES = 200_000
MAX_SCREEN_BYTES = 2_000_000
SCREEN_BUDGET_S = 30.0  # past this the rest of the patch is left unscreened (and says so)


def scan(root: str) -> dict[str, tuple[str, int, int, int, str]]:
    """rel path -> (kind, mode, size, mtime_ns, link target) for everything under ``root``, no link followed.

    kind: f (regular file), d (directory), l (symbolic link), o (anything else).
    """
    out: dict[str, tuple[str, int, int, int, str]] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                path = rel + "/" + entry.name if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    out[path] = ("l", 0, 0, 0, os.readlink(entry.path))
                elif stat.S_ISDIR(st.st_mode):
                    out[path] = ("d", 0, 0, 0, "")
                    stack.append(path)
                elif stat.S_ISREG(st.st_mode):
                    out[path] = ("f", stat.S_IMODE(st.st_mode) & 0o111, st.st_size, st.st_mtime_ns, "")
                else:
                    out[path] = ("o", 0, 0, 0, "")
                if len(out) > MAX_ENTRIES:
                    raise SystemExit(f"more than {MAX_ENTRIES} files in the tree")
    return out


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _is_native(path: str) -> bool:
    """An executable or a shared library (it runs code no screen reads), by its first bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        head = os.read(fd, 64)
        if head.startswith(b"MZ"):  # a Windows executable has its PE header where 0x3C points (a CSV of
            # countries that starts "MZ,Mozambique" is data: it was put back as native code)
            at = int.from_bytes(head[0x3C:0x40], "little") if len(head) >= 0x40 else -1
            return at >= 0 and os.pread(fd, 4, at) == b"PE\0\0"
    finally:
        os.close(fd)
    return head.startswith(NATIVE_MAGIC)


def changed_paths(tree: str, pristine: str, now: dict, before: dict) -> list[str]:
    out = []
    for rel in sorted(set(now) | set(before)):
        a, b = before.get(rel), now.get(rel)
        if a is None or b is None or a[0] != b[0] or a[4] != b[4] or (a[0] == "f" and (a[1], a[2]) != (b[1], b[2])) or (a[0] == "f" and a[3] != b[3] and _read(os.path.join(pristine, rel)) != _read(os.path.join(tree, rel))):
            out.append(rel)
    return out


def shadowable_names(tree: str) -> frozenset[str]:
    """Top-level module names a new module in the tree must not take: the standard library and
    everything importable from the image's own paths."""
    names = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
    paths = [p for p in sys.path if p and os.path.isdir(p) and not os.path.realpath(p).startswith(tree)]
    names.update(m.name for m in pkgutil.iter_modules(paths))
    names.update({"pytest", "_pytest", "py", "pluggy", "iniconfig", "conftest"})
    return frozenset(names)


def module_name(name: str, kind: str) -> str | None:
    if kind == "d":
        return name
    for suffix in MODULE_SUFFIXES:
        if name.endswith(suffix):
            return name.split(".", 1)[0]
    return None


class Rules:
    def __init__(self, tree: str, hidden: list[str], before: dict, now: dict, pristine: str = "",
                 gold: frozenset[str] = frozenset(), top_level_modules: bool = False) -> None:
        self.tree, self.before, self.now = tree, before, now
        self.top_level_modules = top_level_modules
        self.hidden = frozenset(hidden)
        self.hidden_dirs = frozenset(os.path.dirname(p) for p in hidden)
        self.protected = frozenset(d for p in hidden for d in _ancestors(p))
        self.test_dirs = frozenset(d for d in self.hidden_dirs
                                   if d and os.path.basename(d).lower().startswith(TEST_DIR_PREFIX))
        self._names: frozenset[str] | None = None
        self.pristine = pristine
        self._library_tests: frozenset[str] | None = None
        self.support = support_modules(pristine, before, self.hidden_dirs - self.test_dirs, self.hidden, gold)
        self.top_level_modules = top_level_modules or any(  # (a packaging script is no fix's home)
            self._top_level(rel) for rel in gold if rel.endswith(".py") and rel not in self.hidden
            and os.path.basename(rel) not in ("setup.py", "conftest.py", "noxfile.py"))

    def why(self, rel: str) -> str | None:
        parts = rel.split("/")
        name = parts[-1]
        was, now = self.before.get(rel), self.now.get(rel)
        kind = now[0] if now else None
        if ".git" in parts:
            return "git metadata"
        if rel in self.hidden or any(rel.startswith(d + "/") for d in self.test_dirs):
            return "hidden test file"
        if rel in self.support:
            return "test support file"
        if rel in self.protected and (kind != "d" or (was is not None and was[0] != "d")):
            return "hidden test file"
        if kind == "l" or (was is not None and was[0] == "l"):
            return "symbolic link"
        if kind == "o":
            return "special file"
        if name in RUNNER_CONFIGS:
            return "test runner config"
        if name in SITE_HOOKS or name.endswith(".pth"):
            return "interpreter hook"
        if name.endswith((".pyc", ".pyo")) or "__pycache__" in parts:
            return "compiled bytecode"
        if kind == "f" and (name.endswith(NATIVE_SUFFIXES) or _is_native(os.path.join(self.tree, rel))):
            return "native code"
        if any(p.endswith(METADATA_SUFFIXES) for p in parts):
            return "package metadata"
        if _is_test_name(rel) and (was is None or rel not in self.library_tests):
            return "test file"
        if was is None and kind is not None and self._top_level(rel):
            mod = module_name(name, kind)
            if kind == "d" and not any(p.startswith(rel + "/") and p.endswith(MODULE_SUFFIXES) for p in self.now):
                mod = None  # a folder with no Python in it imports nothing
            if mod is not None and mod in self.names:
                return f"shadows the module {mod!r}"
            if mod is not None and not self.top_level_modules:
                return "new module outside any package"
        return None

    @property
    def names(self) -> frozenset[str]:
        if self._names is None:
            self._names = shadowable_names(self.tree)
        return self._names

    @property
    def library_tests(self) -> frozenset[str]:
        """Modules named like tests that a module of the library imports (``stats/chi2_test.py``): the
        library's code. The importers are read as they were before the patch, and none of them is a file
        the tests own or the runner reads on its own (a test, a test folder's, ``conftest.py``)."""
        if self._library_tests is None:
            library = {rel for rel, entry in self.before.items() if entry[0] == "f" and rel.endswith(".py")
                       and rel not in self.hidden and rel not in self.support
                       and not any(p.lower().startswith(TEST_DIR_PREFIX) for p in rel.split("/")[:-1])}
            named = {rel for rel in library if _is_test_name(rel)}
            importers = [rel for rel in library if rel not in named and not os.path.basename(rel).startswith("test")
                         and os.path.basename(rel) not in RUNNER_CONFIGS | SITE_HOOKS]
            self._library_tests = _imported(self.pristine, importers, named) if named else frozenset()
        return self._library_tests

    def _top_level(self, rel: str) -> bool:
        """Not inside a package: its folder has no __init__.py, before or after the patch (so a sys.path
        entry may be that folder; a new ``__init__.py`` does not change that) — unless the folder is new
        and inside a package itself (a new subpackage: no sys.path entry can be a folder the patch made
        inside a package), or has no ``__init__.py`` but lies inside a package (a namespace subpackage)
        where pytest puts no folder on sys.path (it puts there the first folder up from a test or a
        ``conftest.py`` it loads that has no ``__init__.py``)."""
        parent = os.path.dirname(rel)
        init = (parent + "/" if parent else "") + "__init__.py"
        if self.now.get(init, ("",))[0] != "f":
            return (not parent or parent in self.protected or (parent + "/conftest.py") in self.before
                    or self._top_level(parent))
        if self.before.get(init, ("",))[0] == "f":
            return False
        return not parent or parent in self.before or self._top_level(parent)


def support_modules(pristine: str, before: dict, dirs: frozenset[str], hidden: frozenset[str],
                    gold: frozenset[str]) -> frozenset[str]:
    """Modules beside a hidden test in a folder that is not a test folder (a flat layout's root, say)
    that only tests can need: not the gold patch's, and imported by no other module of the tree (a test
    file, or another such module, does not count; one the library imports, directly or through
    others, is the library's)."""
    candidates = {rel for rel, entry in before.items() if entry[0] == "f" and rel.endswith(".py")
                  and os.path.dirname(rel) in dirs and rel not in gold and rel not in hidden
                  and os.path.basename(rel) not in ("__init__.py", "setup.py", "conftest.py")}
    if not candidates:
        return frozenset()
    importers = [rel for rel, entry in before.items() if entry[0] == "f" and rel.endswith(".py")
                 and rel not in candidates and rel not in hidden and not os.path.basename(rel).startswith("test")]
    return frozenset(candidates - _imported(pristine, importers, candidates))


def _is_test_name(rel: str) -> bool:
    name = os.path.basename(rel)
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _imported(pristine: str, importers: list[str], modules: set[str]) -> frozenset[str]:
    """Which of ``modules`` (.py paths) the ``importers`` import, directly or through one another of
    ``modules`` that they import. An absolute name matches every module whose path ends with it (which
    folder is on sys.path is not known); a relative one the module at its path."""
    import ast
    import re

    stems = {os.path.basename(rel)[:-3].encode() for rel in modules}
    names: set[tuple[str, ...]] = set()  # absolute dotted names, and relative ones as paths from the root
    found: set[str] = set()
    while importers:
        for rel in importers:
            try:
                source = _read(os.path.join(pristine, rel))
                if not (any(stem in source for stem in stems) if len(stems) <= 32
                        else not stems.isdisjoint(re.findall(rb"\w+", source))):
                    continue  # names none of them (parsing every module of a large tree takes minutes)
                tree = ast.parse(source)
            except (SyntaxError, ValueError, OSError):
                continue
            package = tuple(rel.split("/")[:-1])
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    dotted = [tuple(a.name.split(".")) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    module = tuple(node.module.split(".")) if node.module else ()
                    if node.level:
                        if node.level - 1 > len(package):
                            continue
                        module = ("/", *package[:len(package) - node.level + 1], *module)
                    dotted = [module, *((*module, a.name) for a in node.names if a.name != "*")]
                else:
                    continue
                names.update(name[:i] for name in dotted for i in range(1, len(name) + 1))
        importers = []
        for rel in modules - found:
            parts = tuple(rel[:-3].split("/"))
            if ("/", *parts) in names or any(parts[i:] in names for i in range(len(parts))):
                importers.append(rel)
        found.update(importers)
    return frozenset(found)


def _ancestors(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def restore(tree: str, pristine: str, rel: str) -> None:
    """Put ``rel`` back as it is in the pristine copy (or remove it when it is new)."""
    cur, old = os.path.join(tree, rel), os.path.join(pristine, rel)
    if os.path.lexists(cur):
        _remove(cur)
    if not os.path.lexists(old):
        return
    for folder in _ancestors(rel):  # git apply removes a folder it emptied: make it again, as it was
        path = os.path.join(tree, folder)
        if not os.path.lexists(path):
            os.mkdir(path)
            shutil.copystat(os.path.join(pristine, folder), path, follow_symlinks=False)
        elif os.path.islink(path) or not os.path.isdir(path):
            raise SystemExit(f"cannot restore {rel}: its folder is not a directory")
    if os.path.islink(old):
        os.symlink(os.readlink(old), cur)
    elif os.path.isdir(old):
        shutil.copytree(old, cur, symlinks=True)
    else:
        shutil.copy2(old, cur, follow_symlinks=False)


def judge(tree: str, pristine: str, hidden: list[str], gold: list[str] | None = None,
          top_level_modules: bool = False) -> dict:
    before, now = scan(pristine), scan(tree)
    changed = changed_paths(tree, pristine, now, before)
    rules = Rules(tree, hidden, before, now, pristine, frozenset(gold or ()), top_level_modules)
    reset: list[list[str]] = []
    done: list[str] = []
    for rel in changed:  # sorted: a folder comes before what is in it
        if any(rel.startswith(d + "/") for d in done):
            continue
        why = rules.why(rel)
        if why is not None:
            restore(tree, pristine, rel)
            reset.append([rel, why])
            done.append(rel)
    kept = [rel for rel in changed if not any(rel == d or rel.startswith(d + "/") for d in done)]
    suspicious: list[str] = []
    added: dict[str, list[int] | None] = {}
    deadline = time.monotonic() + SCREEN_BUDGET_S
    for rel in kept:
        entry = now.get(rel)
        if not entry or entry[0] != "f":
            continue
        if not rel.endswith((".py", ".pyw")):
            added[rel] = None  # code Python may load that is not a source file: every line is the patch's
            continue
        if entry[2] > MAX_SCREEN_BYTES:
            suspicious.append(f"{rel}:0: too large to screen")
            added[rel] = None
            continue
        if time.monotonic() > deadline:
            added[rel] = None  # unread: every line counts as the patch's for the runner's tripwire
            continue
        old = os.path.join(pristine, rel)
        numbers, lines, encoding = added_lines(_read(os.path.join(tree, rel)),
                                               _read(old) if os.path.isfile(old) and not os.path.islink(old) else None)
        added[rel] = numbers  # past the findings cap too: a file's own old lines never become the patch's
        if len(suspicious) < MAX_FINDINGS:
            suspicious += screen(rel, numbers, lines, encoding)
    if len(suspicious) > MAX_FINDINGS:
        suspicious = [*suspicious[:MAX_FINDINGS], f"... {len(suspicious) - MAX_FINDINGS} more findings"]
    return {"reset": reset, "changed": kept, "suspicious": suspicious, "added": added}


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    result = judge(config["tree"], config["pristine"], config["hidden"], config.get("gold"),
                   bool(config.get("top_level_modules")))
    with open(config["changes"], "w") as f:  # the runner's view of which code is the patch's
        json.dump(result["added"], f)
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "added"}) + "\n")


if __name__ == "__main__":
    main()
