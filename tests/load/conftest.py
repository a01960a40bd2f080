"""The load suite's proxies (scripted engine, embedded tiny model) and its figures file."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_support import scripted_engine
from transformers import AutoTokenizer

from legorl.engines.embedded import EmbeddedEngine
from legorl.proxy.server import ProxyServer

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "reliability"


@pytest.fixture(scope="module")
def scripted_proxy(tiny_model: Path) -> Iterator[ProxyServer]:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with ProxyServer(scripted_engine(tok), tok) as server:
        yield server


@pytest.fixture(scope="module")
def real_proxy(tiny_model: Path) -> Iterator[ProxyServer]:
    engine = EmbeddedEngine(tiny_model, max_batch=32)
    with ProxyServer(engine, tiny_model) as server:
        yield server
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def load_figures(long_profile: bool) -> Iterator[dict[str, Any]]:
    """What the load tests measured, written on teardown to ``$LEGORL_RELIABILITY_OUT/load.json``
    (default tests/artifacts/reliability/load.json) for docs/reliability.md to quote."""
    figures: dict[str, Any] = {"profile": "long" if long_profile else "short"}
    yield figures
    out = Path(os.environ.get("LEGORL_RELIABILITY_OUT") or ARTIFACTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
