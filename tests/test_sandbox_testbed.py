"""/testbed holds one parentless commit and nothing that could reveal the fix."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from legorl.sandbox import (
    PodmanBackend,
    PodmanSandbox,
    SandboxSpec,
    install_testbed,
    strip_history,
)
from legorl.sandbox.testbed import TestbedError, prepare_repo

FIX = "return a + b  # THE-FIX-MARKER"


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, input=input)
    return proc.stdout.decode().strip()


class History(NamedTuple):
    repo: Path
    bundle: Path
    base: str
    fix: str
    fix_blob: str


@pytest.fixture
def history(tmp_path: Path) -> History:
    """A repo whose second commit is the fix, plus a tag and a branch; and a bundle of all of it."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "notes.txt").write_text("export-ignored but part of the tree\n")
    (repo / ".gitattributes").write_text("notes.txt export-ignore\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "buggy base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text(f"def add(a, b):\n    {FIX}\n")
    git(repo, "commit", "-qam", "the fix")
    fix = git(repo, "rev-parse", "HEAD")
    fix_blob = git(repo, "rev-parse", "HEAD:calc.py")
    git(repo, "tag", "v1", fix)
    git(repo, "branch", "task-1", base)
    bundle = tmp_path / "lib.bundle"
    git(repo, "bundle", "create", str(bundle), "--all")
    return History(repo, bundle, base, fix, fix_blob)


def assert_no_fix(box: PodmanSandbox, fix: str, fix_blob: str) -> None:
    out = box.exec("git rev-list --all; echo ---; git for-each-ref --format='%(refname)'; echo ---; "
                   "git reflog --all | wc -l").output.split("---\n")
    commits, refs, reflog = out[0].split(), out[1].split(), out[2].strip()
    assert len(commits) == 1 and refs == ["refs/heads/main"] and reflog == "0", out
    assert box.exec(f"git rev-list --parents -n1 {commits[0]}").output.split() == commits  # parentless
    for obj in (fix, fix_blob):
        assert box.exec(f"git cat-file -e {obj}").exit_code != 0, f"{obj} is reachable in the container"
    # no object anywhere in .git holds the fix (loose or packed, reachable or not)
    scan = box.exec("git cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype)' "
                    "| awk '$2==\"blob\"{print $1}' | git cat-file --batch | grep -c THE-FIX-MARKER || true")
    assert scan.output.strip() == "0"
    assert box.exec("grep -r THE-FIX-MARKER /testbed || true").output == ""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host-side caches of bundles and testbeds go to this test's tmp dir, not the user's."""
    monkeypatch.setenv("LEGORL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def box(image: str) -> Iterator[PodmanSandbox]:
    with PodmanBackend().create(SandboxSpec(image=image, labels={"run": "pytest", "trial": "testbed"})) as b:
        yield b


@pytest.mark.podman
def test_bundle_testbed_has_one_commit_and_no_fix(box: PodmanSandbox, history: History) -> None:
    commit = install_testbed(box, history.bundle, history.base)
    assert box.testbed_commit == commit
    assert box.exec("cat calc.py").output == "def add(a, b):\n    return a - b\n"
    assert box.exec("cat notes.txt").exit_code == 0  # export-ignore does not drop files
    assert box.exec("git status --porcelain").output == ""
    assert_no_fix(box, history.fix, history.fix_blob)


@pytest.mark.podman
def test_directory_source_by_ref(box: PodmanSandbox, history: History) -> None:
    install_testbed(box, history.repo, "task-1")
    assert "a - b" in box.exec("cat calc.py").output
    assert_no_fix(box, history.fix, history.fix_blob)


@pytest.mark.podman
def test_strip_history_of_an_existing_testbed(box: PodmanSandbox, history: History, tmp_path: Path) -> None:
    # An image-style /testbed: a full clone checked out at the base commit, with a remote, a tag,
    # a stash and reflogs that all reach the fix.
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(history.repo), str(clone))
    git(clone, "checkout", "-q", history.base)
    (clone / "calc.py").write_text(f"def add(a, b):\n    {FIX}\n")
    git(clone, "stash", "-q")
    box.put_dir(str(clone), "/testbed")
    assert box.exec(f"git cat-file -e {history.fix_blob}").exit_code == 0  # reachable before
    commit = strip_history(box)
    assert box.testbed_commit == commit
    assert box.exec("cat calc.py").output == "def add(a, b):\n    return a - b\n"
    assert_no_fix(box, history.fix, history.fix_blob)
    box.exec("echo x >> calc.py")
    assert "+x" in box.patch()


def test_prepare_repo_is_cached_and_deterministic(history: History) -> None:
    path1, commit1 = prepare_repo(history.bundle, history.base)
    path2, commit2 = prepare_repo(history.bundle, history.base)
    _path3, commit3 = prepare_repo(history.repo, "task-1")
    assert (path1, commit1) == (path2, commit2)
    assert commit3 == commit1  # same tree, fixed identity and date: same commit id from either source
    assert git(path1, "rev-list", "--all").split() == [commit1]


def test_bad_sources_are_clear_errors(history: History, tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="does not exist"):
        prepare_repo(tmp_path / "missing.bundle", "HEAD")
    with pytest.raises(TestbedError, match="not found"):
        prepare_repo(history.bundle, "0" * 40)
    (tmp_path / "junk.bundle").write_text("not a bundle")
    with pytest.raises(TestbedError, match="not a git bundle"):
        prepare_repo(tmp_path / "junk.bundle", "HEAD")
    (tmp_path / "plain").mkdir()
    with pytest.raises(TestbedError, match="not a git repository"):
        prepare_repo(tmp_path / "plain", "HEAD")
