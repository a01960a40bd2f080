"""A test reward plug-in (standard library only: it runs on the grading image's Python): the tests'
reward, less 0.5 for a patch carrying the marker line ``loop_fixer`` adds."""

MARK = "# loop-verifier-marker"


def verify(task, patch, report):
    marked = any(line.startswith("+") and MARK in line for line in patch.splitlines())
    return report["reward"] - (0.5 if marked else 0.0), ["marked" if marked else "clean"]
