"""Shared fixtures: the tiny offline models every test can use, built once per cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="Reliability suites (tests/chaos, tests/load, tests/fuzz) in their long profile.")


@pytest.fixture(scope="session")
def long_profile(request: pytest.FixtureRequest) -> bool:
    """True under `pytest --long` (or LEGORL_LONG=1): the reliability suites run their long profile."""
    return bool(request.config.getoption("--long")) or os.environ.get("LEGORL_LONG") == "1"


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models on two shared cores: one intra-op thread is ~10x faster than two fighting.
    import torch

    torch.set_num_threads(1)


HEAVY = frozenset({"tiny_model", "tiny_moe_model", "browser"})  # a model to load, a Chromium to start
LIGHT = frozenset({"tokenizer"})  # reads only the model directory's tokenizer: milliseconds


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that loads a tiny model or starts a browser (it, or a fixture it uses other than a
    tokenizer, asks for one) is ``heavy``: seconds each, left out of ``make unit``. Tests heavy for
    another reason (the CLI or a crash in a subprocess) carry the mark themselves."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's resolved fixture closure of the test
        if info is None:
            continue
        own = set(info.argnames)
        through = {name for name, defs in info.name2fixturedefs.items() if name not in LIGHT
                   and any(HEAVY & set(d.argnames) for d in defs)}
        if (own & HEAVY) or through:
            item.add_marker(pytest.mark.heavy)


def _model(kind: str, moe: bool) -> Path:
    from legorl.core.paths import cache_dir
    from legorl.models import MODEL_RECIPE_VERSION, init_model

    out = cache_dir() / "test-models" / f"{kind}-v{MODEL_RECIPE_VERSION}"
    if not (out / "config.json").exists():
        init_model(out, moe=moe, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A ~5M-parameter Qwen3 model + byte-level BPE tokenizer + Qwen chat template, random weights."""
    return _model("dense", moe=False)


@pytest.fixture(scope="session")
def tiny_moe_model() -> Path:
    """A tiny Qwen3-MoE model (8 experts, top-2) with the same tokenizer."""
    return _model("moe", moe=True)


@pytest.fixture(scope="session")
def base_image() -> str:
    """The sandbox base image built by `legorl setup`; missing, it skips locally and fails in CI."""
    from legorl.sandbox.host import base_image, image_exists

    name = base_image()
    if not image_exists(name):
        message = f"base image {name} missing: run `legorl setup`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return name


@pytest.fixture(scope="session")
def image() -> str:
    """The sandbox base image, built (about a minute, offline) when this host has none yet; skips where
    podman is not installed. The sandbox tests' image: unlike :func:`base_image`, they build it."""
    from legorl.sandbox.host import base_image, ensure_base_image

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (legorl setup installs it)")
    step = ensure_base_image()
    assert step.status in ("ok", "fixed"), step.detail
    return base_image()
