"""`legorl setup`: check-and-fix, idempotent, machine-readable."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.sandbox import host

_SCRIPT = Path(sys.executable).with_name("legorl")
LEGORL = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from legorl.cli.app import main; main()"]


def run_setup(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LEGORL_CACHE": str(cache)}
    return subprocess.run([*LEGORL, "setup", *args], capture_output=True, text=True, env=env, timeout=900)


def test_containers_conf_stays_within_the_hard_limits() -> None:
    text = host.containers_conf_text()
    assert 'runtime = "runc"' in text
    limits = dict(re.findall(r'"(nofile|nproc)=(\d+):\d+"', text))
    for name, kind in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(kind)[1]
        assert hard == resource.RLIM_INFINITY or int(limits[name]) <= hard


def test_podman_env_points_at_legorls_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEGORL_CACHE", str(tmp_path))
    env = host.podman_env({"EXTRA": "1"})
    assert env["CONTAINERS_CONF"] == str(tmp_path / "containers.conf") and env["EXTRA"] == "1"
    assert (tmp_path / "containers.conf").read_text() == host.containers_conf_text()


def test_base_image_name_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    name = host.base_image()
    assert re.fullmatch(r"localhost/legorl-base:[0-9a-f]{12}", name)
    monkeypatch.setattr(host, "BASE_PACKAGES", (*host.BASE_PACKAGES, "jq"))
    assert host.base_image() != name


@pytest.mark.podman
def test_setup_is_idempotent(tmp_path: Path) -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    cache = tmp_path / "cache"
    first = run_setup(cache, "--json", "--reap")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    steps = {s["name"]: s["status"] for s in report["steps"]}
    assert report["ok"] and steps["containers.conf"] == "fixed" and report["changed"]
    assert steps["container smoke test"] == "ok" and steps["reaper"] in ("ok", "fixed")
    assert steps["base image"] in ("ok", "fixed")

    second = run_setup(cache, "--json")
    again = json.loads(second.stdout)
    assert second.returncode == 0 and again["ok"] and not again["changed"]
    assert {s["status"] for s in again["steps"]} == {"ok"}
    assert again["image"] == report["image"] == host.base_image()

    human = run_setup(cache)
    assert human.returncode == 0 and "nothing to do" in human.stderr


def test_setup_without_image(tmp_path: Path) -> None:
    out = run_setup(tmp_path / "cache", "--json", "--no-image")
    report = json.loads(out.stdout)
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["base image"]["status"] == "skipped"
    assert (tmp_path / "cache" / "containers.conf").exists()


def test_missing_podman_says_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no podman, runc or debootstrap
    step = host.ensure_tools(install=False)
    assert step.status == "manual" and "apt-get install -y podman runc" in step.detail
    from legorl.core.errors import LegorlError
    from legorl.sandbox import PodmanBackend, SandboxSpec

    with pytest.raises(LegorlError, match=r"podman is not installed.*legorl setup"):
        PodmanBackend().create(SandboxSpec(image=host.base_image()))
