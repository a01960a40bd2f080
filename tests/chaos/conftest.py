"""The chaos suite's profile: how many seeds each stage is killed under, and where the figures go."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from chaos_support import Figures

SHORT_SEEDS = 1  # per stage, in the default (CI) profile
LONG_SEEDS = 4  # per stage, under `pytest --long` / LEGORL_LONG=1


def _long(config: pytest.Config) -> bool:
    return bool(config.getoption("--long")) or os.environ.get("LEGORL_LONG") == "1"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_seed" in metafunc.fixturenames:
        metafunc.parametrize("chaos_seed", range(LONG_SEEDS if _long(metafunc.config) else SHORT_SEEDS))


@pytest.fixture(scope="session")
def figures(long_profile: bool) -> Iterator[Figures]:
    """The session's chaos figures, written to tests/artifacts/reliability/chaos.json at its end."""
    collected = Figures("long" if long_profile else "short")
    yield collected
    collected.save()
