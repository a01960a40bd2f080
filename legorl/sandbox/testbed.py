"""Put a task's repository at ``/testbed`` with no history that could reveal the fix.

Two ways in:

- :func:`install_testbed` — the task names a ``repo_source`` (a git bundle or a directory) and a
  commit. The tree of that one commit is taken with ``git archive`` into a fresh repository whose
  single commit has no parent, no other refs and a fixed identity and date; that repository is
  copied into the container. Fetching the commit from the bundle instead would carry every other
  object the bundle holds — other tasks' versions of the same files, the fix itself.
- :func:`strip_history` — the task's image already holds ``/testbed`` at the commit (SWE-bench
  images). Inside the container: squash HEAD's tree into one parentless commit, delete every other
  ref, the reflogs, remotes, alternates and shallow grafts, and prune every object that is no
  longer reachable.

The fresh repositories are cached on the host (keyed by source, its size and mtime, and commit),
so a group of trials on one task builds it once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from legorl.core.errors import LegorlError
from legorl.core.paths import cache_dir
from legorl.sandbox.base import Sandbox

COMMIT_MESSAGE = "legorl testbed"
_FIXED_DATE = "2000-01-01T00:00:00+0000"
_LAYOUT = "packed, no templates"  # part of the cache key: a change to how testbeds are laid out rebuilds them
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "legorl", "GIT_AUTHOR_EMAIL": "legorl@localhost", "GIT_AUTHOR_DATE": _FIXED_DATE,
    "GIT_COMMITTER_NAME": "legorl", "GIT_COMMITTER_EMAIL": "legorl@localhost", "GIT_COMMITTER_DATE": _FIXED_DATE,
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


class TestbedError(LegorlError):
    """A task's repository cannot be found or built."""

    __test__ = False  # not a pytest class, despite the name


def _git(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, **_GIT_ENV, "HOME": str(cache_dir())}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, env=env)


def _git_ok(args: list[str], cwd: Path | None = None, what: str = "") -> bytes:
    proc = _git(args, cwd)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise TestbedError(f"{what or 'git ' + args[0]}: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc.stdout


def _source_key(source: Path, ref: str) -> str:
    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{ref}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _object_store(source: Path) -> Path:
    """A git directory holding the source's objects: the directory itself, or a bare mirror of a bundle."""
    if source.is_dir():
        if _git(["rev-parse", "--git-dir"], cwd=source).returncode != 0:
            raise TestbedError(f"repo_source {source} is a directory but not a git repository")
        return source
    if not source.is_file():
        raise TestbedError(f"repo_source {source} does not exist")
    mirror = cache_dir() / "bundles" / _source_key(source, "")
    if (mirror / "legorl-complete").exists():
        return mirror
    mirror.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bundle-", dir=mirror.parent))
    _git_ok(["init", "-q", "--bare", str(tmp)], what=f"git init for {source}")
    _git_ok(["fetch", "-q", str(source.resolve()), "+refs/*:refs/*"], cwd=tmp, what=f"repo_source {source}: not a git bundle")
    (tmp / "legorl-complete").touch()
    try:
        tmp.rename(mirror)
    except OSError:  # a concurrent builder won
        shutil.rmtree(tmp, ignore_errors=True)
    return mirror


def _resolve(store: Path, ref: str, source: Path) -> str:
    proc = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=store)
    if proc.returncode != 0:
        raise TestbedError(f"repo_source {source}: commit or ref '{ref}' not found")
    return proc.stdout.decode().strip()


def prepare_repo(repo_source: str | os.PathLike[str], ref: str) -> tuple[Path, str]:
    """A host directory holding ``ref``'s tree as a one-commit repository, and that commit's id.

    ``ref`` is the task's ``repo_ref`` or ``base_commit``.
    """
    source = Path(repo_source)
    store = _object_store(source)
    commit = _resolve(store, ref, source)
    key = f"{store.resolve()}|{commit}|{_LAYOUT}"
    out = cache_dir() / "testbeds" / hashlib.sha256(key.encode()).hexdigest()[:16]
    done = out / ".git" / "legorl-testbed"
    if done.exists():
        return out, done.read_text().strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="testbed-", dir=out.parent))
    try:
        # export-ignore / export-subst in the commit's .gitattributes would drop or rewrite files:
        # an info/attributes in a private git dir over the same objects overrides them.
        gitdir = tmp / "objects-view"
        _git_ok(["init", "-q", "--bare", str(gitdir)])
        objects = Path(_git_ok(["rev-parse", "--git-path", "objects"], cwd=store).decode().strip())
        objects = (store / objects).resolve()  # relative to store unless absolute
        (gitdir / "objects" / "info" / "alternates").write_text(f"{objects}\n")
        (gitdir / "info").mkdir(exist_ok=True)
        (gitdir / "info" / "attributes").write_text("* -export-ignore -export-subst\n")
        tree = tmp / "tree"
        tree.mkdir()
        archive = subprocess.Popen(["git", "--git-dir", str(gitdir), "archive", "--worktree-attributes", "--format=tar",
                                    commit], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env={**os.environ, **_GIT_ENV})
        untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, capture_output=True)
        assert archive.stdout is not None and archive.stderr is not None
        archive.stdout.close()
        err = archive.stderr.read()
        if archive.wait() != 0 or untar.returncode != 0:
            raise TestbedError(f"git archive of {commit[:12]} from {source} failed: "
                               f"{(err or untar.stderr).decode(errors='replace').strip()[-200:]}")
        _git_ok(["init", "-q", "-b", "main", "--template="], cwd=tree)  # no sample hooks to copy
        _git_ok(["add", "-A", "-f"], cwd=tree)
        _git_ok(["commit", "-q", "--allow-empty", "--no-verify", "-m", COMMIT_MESSAGE], cwd=tree)
        # one pack instead of a file per object: a copy (or a grading tar) of the testbed then
        # holds a few files for .git instead of one per blob and tree
        _git_ok(["repack", "-a", "-d", "-q"], cwd=tree)
        new = _git_ok(["rev-parse", "HEAD"], cwd=tree).decode().strip()
        shutil.rmtree(tree / ".git" / "logs", ignore_errors=True)  # the reflog of the one commit: noise
        (tree / ".git" / "legorl-testbed").write_text(new + "\n")
        try:
            tree.rename(out)
        except OSError:
            if not done.exists():
                raise
        return out, done.read_text().strip()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_testbed(box: Sandbox, repo_source: str | os.PathLike[str], ref: str, path: str = "/testbed") -> str:
    """Build ``/testbed`` in ``box`` at ``ref`` of ``repo_source``; returns the testbed's commit id."""
    repo, commit = prepare_repo(repo_source, ref)
    res = box.exec(["sh", "-c", f'mkdir -p "{path}" && find "{path}" -mindepth 1 -maxdepth 1 -exec rm -rf {{}} +'])
    if res.exit_code != 0:
        raise TestbedError(f"{box.name}: cannot empty {path}: {res.output.strip()[-200:]}")
    box.put_dir(str(repo), path)
    box.exec(["rm", "-f", f"{path}/.git/legorl-testbed"])
    if hasattr(box, "testbed_commit"):
        box.testbed_commit = commit
    return commit


_STRIP = r"""
set -eu
cd "$1"
export GIT_AUTHOR_NAME=legorl GIT_AUTHOR_EMAIL=legorl@localhost GIT_AUTHOR_DATE="$2"
export GIT_COMMITTER_NAME=legorl GIT_COMMITTER_EMAIL=legorl@localhost GIT_COMMITTER_DATE="$2"
g() { git -c safe.directory='*' -c gc.auto=0 "$@"; }
gd=$(g rev-parse --git-dir)
new=$(g commit-tree "HEAD^{tree}" -m "$3")
g for-each-ref --format='%(refname)' | while read -r ref; do g update-ref -d "$ref"; done
for r in $(g remote); do g remote remove "$r"; done
g symbolic-ref HEAD refs/heads/main
g update-ref refs/heads/main "$new"
rm -rf "$gd/logs" "$gd/ORIG_HEAD" "$gd/FETCH_HEAD" "$gd/MERGE_HEAD" "$gd/CHERRY_PICK_HEAD" \
       "$gd/REVERT_HEAD" "$gd/shallow" "$gd/info/grafts" "$gd/packed-refs" "$gd/modules" "$gd/refs/original"
g repack -a -d -q
rm -f "$gd/objects/info/alternates"
g prune --expire=now
g repack -a -d -q
echo "$new"
"""


def strip_history(box: Sandbox, path: str = "/testbed") -> str:
    """Squash an existing ``/testbed`` to one parentless commit and drop everything unreachable."""
    res = box.exec(["sh", "-c", _STRIP, "sh", path, _FIXED_DATE, COMMIT_MESSAGE], timeout=600)
    if res.exit_code != 0:
        raise TestbedError(f"{box.name}: stripping git history in {path} failed: {res.output.strip()[-300:]}")
    commit = res.output.strip().splitlines()[-1]
    if hasattr(box, "testbed_commit"):
        box.testbed_commit = commit
    return commit
