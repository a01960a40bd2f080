"""The fuzz suite's proxies, its example budget, and its figures file (what was fuzzed, how much)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import proxy_support
import pytest
from hypothesis import HealthCheck, settings
from proxy_support import scripted_proxy

from legorl.proxy.server import ProxyServer

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "reliability"
API_KEY = "fuzz-key"

# the proxy tests' fixture, bound here so that pytest finds it
tokenizer = proxy_support.tokenizer


@pytest.fixture(scope="module")
def open_proxy(tokenizer: Any) -> Iterator[ProxyServer]:
    """No API key; request bodies are capped at 256 KiB so the 413 path is cheap to reach."""
    with scripted_proxy(tokenizer) as server:
        server.app.max_body = 256 << 10
        yield server


@pytest.fixture(scope="module")
def keyed_proxy(tokenizer: Any) -> Iterator[ProxyServer]:
    with scripted_proxy(tokenizer, api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="session")
def fuzz_settings(long_profile: bool) -> Any:
    """Hypothesis settings: a fixed-seed, bounded run in the short profile, ten times more random
    examples under ``--long``. Call it with the short profile's example count."""

    def make(examples: int) -> settings:
        return settings(max_examples=examples * (10 if long_profile else 1), derandomize=not long_profile,
                        deadline=None, database=None, suppress_health_check=list(HealthCheck))

    return make


@pytest.fixture(scope="session")
def fuzzed(long_profile: bool) -> Iterator[Counter[str]]:
    """Inputs fuzzed, by kind; written on teardown to ``$LEGORL_RELIABILITY_OUT/fuzz.json``
    (default tests/artifacts/reliability/fuzz.json) for docs/reliability.md to quote."""
    counts: Counter[str] = Counter()
    yield counts
    out = Path(os.environ.get("LEGORL_RELIABILITY_OUT") or ARTIFACTS)
    out.mkdir(parents=True, exist_ok=True)
    figures = {"profile": "long" if long_profile else "short", "inputs_fuzzed": dict(sorted(counts.items())),
               "total": sum(counts.values())}
    (out / "fuzz.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
