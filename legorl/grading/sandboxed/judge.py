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
  layout's root) — the modules only tests can need (not the gold patch's, imported by no other module);
- symbolic links and special files the patch made, and native code (shared libraries,
  executables: code that no screen can read);
- files the test runner or the interpreter reads on its own: ``conftest.py``, pytest's and the
  shared config files (``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``, ...),
  ``sitecustomize``/``usercustomize``, ``.pth``, compiled bytecode, packaging metadata
  (``*.dist-info``/``*.egg-info``: entry points autoload pytest plugins);
- test files anywhere (``test_*.py``, ``*_test.py``): only the hidden tests run, so a new or edited
  test file can matter only as a module something imports;
- new top-level modules (outside any package: a folder without ``__init__.py`` may be on
  ``sys.path``), above all those named like a standard-library module or anything installed in
  the image (the runner, its dependencies). A fix lives in the package; a new module at the top is a
  reproduction script, or a way around the screen below.

Then it screens the Python lines the patch added outside the tests for code that reaches into
the test runner or the interpreter (:data:`SCREEN`); findings go on the grade row.

Usage: ``python3 -I judge.py CONFIG.json`` prints one JSON object:
``{"reset": [[path, why], ...], "changed": [path, ...], "suspicious": ["path:line: why: code"]}``.
Compatible with Python 3.8+ (task images bring their own interpreter).
"""

from __future__ import annotations

import json
import os
import pkgutil
import re
import shutil
import stat
import sys
import time
from collections import Counter

RUNNER_CONFIGS = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
                            "pyproject.toml", "conftest.py"})
SITE_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".egg")
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
NATIVE_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".o", ".a")
NATIVE_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
TEST_DIR_PREFIX = "test"  # directories named test, tests, testing, test_utils, ...
MAX_ENTRIES = 200_000
MAX_SCREEN_BYTES = 2_000_000
MAX_FINDINGS = 100  # the screen is a tripwire: a few findings say as much as millions
SCREEN_BUDGET_S = 30.0  # past this the rest of the patch is left unscreened (and says so)

# (pattern, why): lines the patch added to non-test Python files that reach into the test runner
# or the interpreter. Code that fixes a bug has no business doing any of these.
SCREEN = [
    (r"\b_?pytest\b|\bPYTEST_|\bpluggy\b|\bunittest\b|\bTestCase\b|\bmock\b|\bassert[A-Z]\w*\s*=",
     "reaches into the test runner"),
    (r"\bsys\s*\.\s*(modules|meta_path|path_hooks|path|settrace|setprofile|_getframe|excepthook|__std(out|err)__"
     r"|exit|addaudithook|_current_frames)\b|\bfrom\s+(sys|os|gc|builtins|threading)\s+import\b"
     r"|\bimport\s+(sys|os|gc|builtins)\s+as\b", "interpreter surgery"),
    (r"\b(builtins|__builtins__|__subclasses__|__globals__|__code__|f_back|f_globals|f_locals|tb_frame"
     r"|gi_frame|co_code)\b", "interpreter internals"),
    (r"\bos\s*\.\s*(_exit|abort|kill|killpg|fork|forkpty|setsid|dup2?|write|system|exec\w*|spawn\w*|posix_spawn\w*)\b",
     "process control"),
    (r"\b(threading|_thread)\s*\.\s*(settrace|setprofile)\b|\bgc\s*\.\s*get_(objects|referrers|referents)\b",
     "interpreter internals"),
    (r"(?<![\w.])(exec|eval|compile|__import__)\b|\bimportlib\b|\b(ctypes|marshal|atexit|subprocess|signal"
     r"|faulthandler|inspect|pickle|codecs|base64|zlib|zipimport|resolve_name|settrace|setprofile|gettrace"
     r"|f_locals|f_globals|f_back|f_trace)\b", "dynamic code or process hooks"),
    (r"/proc/|/dev/(mem|kmem|kmsg|tty)", "reads process internals"),
]
_SCREEN = [(re.compile(p), why) for p, why in SCREEN]
# The same names, for added lines joined with all whitespace removed (``(_u\\n .TestCase)``).
_SCREEN_JOINED = [(re.compile(p), why) for p, why in (
    (r"_?pytest|PYTEST_|pluggy|unittest|TestCase|\.assert[A-Z]\w*=", "reaches into the test runner"),
    (r"sys\.(modules|meta_path|path|settrace|setprofile|_getframe)|builtins|__builtins__|__subclasses__|__globals__"
     r"|f_(back|globals|locals|trace)", "interpreter surgery"),
    (r"(?<![\w.])(exec|eval|compile|__import__)\(|importlib|ctypes|marshal|pickle|codecs|base64", "dynamic code"),
)]


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
        head = os.read(fd, 4)
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
                 gold: frozenset[str] = frozenset()) -> None:
        self.tree, self.before, self.now = tree, before, now
        self.hidden = frozenset(hidden)
        self.hidden_dirs = frozenset(os.path.dirname(p) for p in hidden)
        self.protected = frozenset(d for p in hidden for d in _ancestors(p))
        self.test_dirs = frozenset(d for d in self.hidden_dirs
                                   if d and os.path.basename(d).lower().startswith(TEST_DIR_PREFIX))
        self._names: frozenset[str] | None = None
        self.support = support_modules(pristine, before, self.hidden_dirs - self.test_dirs, self.hidden, gold)

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
        if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
            return "test file"
        if was is None and kind is not None and self._top_level(rel):
            mod = module_name(name, kind)
            if kind == "d" and not any(p.startswith(rel + "/") and p.endswith(MODULE_SUFFIXES) for p in self.now):
                mod = None  # a folder with no Python in it imports nothing
            if mod is not None:
                return f"shadows the module {mod!r}" if mod in self.names else "new module outside any package"
        return None

    @property
    def names(self) -> frozenset[str]:
        if self._names is None:
            self._names = shadowable_names(self.tree)
        return self._names

    def _top_level(self, rel: str) -> bool:
        """Not inside a package: its folder has no __init__.py, before or after the patch (so a sys.path
        entry may be that folder; a new ``__init__.py`` does not change that) — unless the folder is new
        and inside a package itself (a new subpackage: no sys.path entry can be a folder the patch made
        inside a package)."""
        parent = os.path.dirname(rel)
        init = (parent + "/" if parent else "") + "__init__.py"
        if self.now.get(init, ("",))[0] != "f":
            return True
        if self.before.get(init, ("",))[0] == "f":
            return False
        return not parent or parent in self.before or self._top_level(parent)


def support_modules(pristine: str, before: dict, dirs: frozenset[str], hidden: frozenset[str],
                    gold: frozenset[str]) -> frozenset[str]:
    """Modules beside a hidden test in a folder that is not a test folder (a flat layout's root, say)
    that only tests can need: not the gold patch's, and imported by no other module of the tree."""
    import ast

    candidates = {rel for rel, entry in before.items() if entry[0] == "f" and rel.endswith(".py")
                  and os.path.dirname(rel) in dirs and rel not in gold and rel not in hidden
                  and os.path.basename(rel) not in ("__init__.py", "setup.py", "conftest.py")}
    if not candidates:
        return frozenset()
    names = {os.path.basename(rel)[:-3]: rel for rel in candidates}
    used: set[str] = set()
    for rel, entry in before.items():
        base = os.path.basename(rel)
        if entry[0] != "f" or not rel.endswith(".py") or rel in candidates or rel in hidden or base.startswith("test"):
            continue
        try:
            tree = ast.parse(_read(os.path.join(pristine, rel)))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                used.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                used.update({(node.module or "").split(".")[0], *(a.name for a in node.names)})
    return frozenset(rel for name, rel in names.items() if name not in used)


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
    parent = os.path.dirname(cur)
    if not os.path.isdir(parent) or os.path.islink(parent):
        raise SystemExit(f"cannot restore {rel}: its folder is not a directory")
    if os.path.islink(old):
        os.symlink(os.readlink(old), cur)
    elif os.path.isdir(old):
        shutil.copytree(old, cur, symlinks=True)
    else:
        shutil.copy2(old, cur, follow_symlinks=False)


def _source(data: bytes) -> tuple[list[str], str]:
    """A Python file's lines as Python decodes them (its coding declaration honoured), and that coding."""
    import io
    import tokenize

    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding, "replace").splitlines(), encoding
    except (SyntaxError, LookupError, UnicodeError):
        return data.decode("utf-8", "replace").splitlines(), "utf-8"


def added_lines(tree: str, pristine: str, rel: str) -> tuple[list[int], list[str], str]:
    """The 1-based numbers and the text of the lines the patch added to one Python file, and its coding.

    A line counts as added when the old file has fewer copies of it: linear in the file's size
    (a line diff is quadratic in what a patch adds, and the patch decides how much that is).
    """
    new, encoding = _source(_read(os.path.join(tree, rel)))
    old_path = os.path.join(pristine, rel)
    old = _source(_read(old_path))[0] if os.path.isfile(old_path) and not os.path.islink(old_path) else []
    left = Counter(old)
    numbers: list[int] = []
    for n, line in enumerate(new, 1):
        if left[line] > 0:
            left[line] -= 1
        else:
            numbers.append(n)
    return numbers, new, encoding


def screen(rel: str, numbers: list[int], lines: list[str], encoding: str) -> list[str]:
    """Findings in the lines the patch added to one Python file.

    Each added line is read alone, and each run of consecutive added lines joined with all
    whitespace and line continuations removed (so a name split across lines is still seen).
    """
    out = []
    if encoding.lower().replace("_", "-") not in ("utf-8", "utf-8-sig", "ascii", "us-ascii", "latin-1", "iso-8859-1"):
        out.append(f"{rel}:1: source encoding {encoding!r} (code no reader sees as written)")
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    for run in runs:
        if len(out) >= MAX_FINDINGS:
            break
        texts = [lines[n - 1] for n in run]
        code = [t.split("#", 1)[0] if t.lstrip().startswith("#") else t for t in texts]
        joined = re.sub(r"\\\n|\s+", "", "\n".join(code))
        for i, n in enumerate(run):
            text, line = texts[i], code[i]
            why = next((w for pattern, w in _SCREEN if pattern.search(line)), None)
            if why:
                out.append(f"{rel}:{n}: {why}: {text.strip()[:200]}")
        if not any(f.startswith(f"{rel}:{n}:") for f in out[-len(run):] for n in run):
            why = next((w for pattern, w in _SCREEN_JOINED if pattern.search(joined)), None)
            if why:
                out.append(f"{rel}:{run[0]}: {why} (across lines): {joined[:200]}")
    return out


def judge(tree: str, pristine: str, hidden: list[str], gold: list[str] | None = None) -> dict:
    before, now = scan(pristine), scan(tree)
    changed = changed_paths(tree, pristine, now, before)
    rules = Rules(tree, hidden, before, now, pristine, frozenset(gold or ()))
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
        if time.monotonic() > deadline or len(suspicious) >= MAX_FINDINGS:
            added[rel] = None  # unscreened: every line counts as the patch's for the runner's tripwire
            continue
        numbers, lines, encoding = added_lines(tree, pristine, rel)
        added[rel] = numbers
        suspicious += screen(rel, numbers, lines, encoding)
    if len(suspicious) > MAX_FINDINGS:
        suspicious = [*suspicious[:MAX_FINDINGS], f"... {len(suspicious) - MAX_FINDINGS} more findings"]
    return {"reset": reset, "changed": kept, "suspicious": suspicious, "added": added}


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    result = judge(config["tree"], config["pristine"], config["hidden"], config.get("gold"))
    with open(config["changes"], "w") as f:  # the runner's view of which code is the patch's
        json.dump(result["added"], f)
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "added"}) + "\n")


if __name__ == "__main__":
    main()
