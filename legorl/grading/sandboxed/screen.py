"""Screen the Python lines a patch added outside the tests for code that reaches into the test runner
or the interpreter: a tripwire whose findings go on the grade row (``suspicious``), never a verdict.

Used by :mod:`.judge` in the grading container; Python 3.8+, standard library only. Pure text: it
reads no file.
"""

from __future__ import annotations

import re
from collections import Counter

MAX_FINDINGS = 100  # the screen is a tripwire: a few findings say as much as millions

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


def _lines(text: str) -> list[str]:
    """The lines as Python numbers them: only ``\n``, ``\r\n`` and ``\r`` end one. ``str.splitlines``
    also splits at a form feed, ``\x85``, ``\u2028`` and others, which moved every later line's number
    off the interpreter's: a pristine line then counted as the patch's, and the patch's own as pristine."""
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if lines[-1] == "" else lines


def _source(data: bytes) -> tuple[list[str], str]:
    """A Python file's lines as Python decodes and numbers them (its coding declaration honoured), and
    that coding."""
    import io
    import tokenize

    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return _lines(data.decode(encoding, "replace")), encoding
    except (SyntaxError, LookupError, UnicodeError):
        return _lines(data.decode("utf-8", "replace")), "utf-8"


def added_lines(new_file: bytes, old_file: bytes | None) -> tuple[list[int], list[str], str]:
    """The 1-based numbers and the text of the lines a patch added to one Python file (``old_file``:
    None when the file is new), and its coding.

    A line counts as added when the old file has fewer copies of it: linear in the file's size
    (a line diff is quadratic in what a patch adds, and the patch decides how much that is).
    """
    new, encoding = _source(new_file)
    # by their text without the indentation: code wrapped in a new ``try:`` is the old code (its own
    # frame reads re-indented became the patch's); moving lines was already the old lines
    left = Counter(line.strip() for line in (_source(old_file)[0] if old_file is not None else []))
    numbers: list[int] = []
    for n, line in enumerate(new, 1):
        key = line.strip()
        if left[key] > 0:
            left[key] -= 1
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
