"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by playwright).

Screenshots go to ``tests/artifacts/dashboard/`` (printed by the tests). Needs ``apt-get install
chromium`` and ``pip install playwright``; the browser is the system one, never a downloaded build.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from monitor_runs import make_run, write_step
from train_support import TrialSpec, stale_run, trained_run
from train_support import make_run as make_train_run

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.schemas import Kind
from legorl.monitor import report
from legorl.monitor.dashboard.export import export
from legorl.monitor.dashboard.server import create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts" / "dashboard"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
PANELS = ["panel-reward", "panel-outcomes", "panel-groups", "panel-grid", "panel-fidelity", "panel-behaviour",
          "panel-eval", "panel-compare", "panel-trials"]
CHARTS = ["chart-reward", "chart-outcomes", "chart-groups", "chart-grid", "chart-eval", "chart-compare"]

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if not Path(CHROMIUM).exists():
    pytest.skip("needs Debian's chromium (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)  # a fresh, empty profile per launch
        yield b
        b.close()


class Server:
    """uvicorn in a thread on a free port, stopped on exit."""

    def __init__(self, roots: list[Path], poll_ms: int):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(create_app(roots, poll_ms=poll_ms), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("dashboard server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}/"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _shot(page: Any, name: str, selector: str | None = None) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    if selector:
        page.locator(selector).screenshot(path=str(path))
    else:
        page.evaluate("window.scrollTo(0, 0)")  # the sticky header belongs at the top of a full-page shot
        page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def _errors(page: Any) -> list[str]:
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "favicon" not in m.text else None)
    return errors


@contextmanager
def _served_page(browser: Any, root: Path, trials: int) -> Iterator[Any]:
    """A page on the live server of one run, once it shows ``trials`` trials; no page error by the end."""
    with Server([root], poll_ms=300) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = _errors(page)
        page.goto(url)
        page.wait_for_function(f"document.body.dataset.trials === '{trials}'", timeout=20000)
        yield page
        assert not errors, errors
        page.close()


def _check_panels(page: Any) -> None:
    states = page.evaluate(f"{PANELS}.map(id => document.getElementById(id).dataset.state)")
    assert states == ["ready"] * len(PANELS), dict(zip(PANELS, states, strict=True))
    for chart in CHARTS:
        points = page.evaluate(
            f"(() => {{ const d = document.getElementById('{chart}'); return (d.data || [])"
            ".reduce((n, t) => n + ((t.y || t.z || []).filter(v => v !== null).length), 0); })()"
        )
        assert points > 0, chart
    for multiples, minimum in (("fidelity-charts", 7), ("behaviour-charts", 10)):
        n = page.evaluate(f"document.querySelectorAll('#{multiples} .js-plotly-plot').length")
        assert n >= minimum, multiples
    # plotly drew real SVG marks, not just an empty frame
    assert page.locator("#chart-reward .scatterlayer .trace path.js-line").count() > 0
    assert page.locator("#chart-outcomes .barlayer .point").count() > 0
    assert page.locator("#trial-table tbody tr").count() > 0


def _open_trial(page: Any, row: int = 2) -> str:
    page.locator(f"#trial-table tbody tr:nth-child({row})").click()
    page.wait_for_selector("#viewer-conversation .msg.assistant")
    assert page.locator("#panel-viewer").get_attribute("data-state") == "ready"
    assert page.locator("#viewer-conversation .toolcall").count() > 0
    assert page.locator("#viewer-calls tbody tr").count() > 0
    assert page.locator("#viewer-segments tbody tr").count() > 0
    page.wait_for_function("document.querySelector('#viewer-logprobs.js-plotly-plot') !== null")
    return str(page.locator("#viewer-title").inner_text())


def test_live_dashboard_in_chromium(browser: Any, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=2)
    other = make_run(tmp_path / "baseline", steps=2, harnesses=("opencode",), seed=5)
    report.write_report(run, report.build_report(run, baseline=other))
    with Server([run, other], poll_ms=300) as url:
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        errors = _errors(page)
        page.goto(url)
        page.wait_for_function("document.body.dataset.trials === '64'", timeout=20000)
        page.wait_for_timeout(300)
        _check_panels(page)
        assert "live" in page.locator("#status-text").inner_text()
        _shot(page, "overview.png")

        # the trajectory viewer opens a trial with its patch and per-test grade
        page.locator("#f-harness").select_option("mini-swe-agent")
        page.locator("#f-category").select_option("resolved")
        title = _open_trial(page, 1)
        assert "mini-swe-agent" in title
        assert page.locator("#viewer-patch .add").count() > 0
        assert page.locator("#viewer-tests tbody tr").count() == 3
        assert page.locator("#viewer-conversation .tag.edit").count() > 0
        _shot(page, "trajectory.png", "#panel-viewer")

        # new shards land: the page picks them up without a reload, and the open trial stays open
        write_step(run, 2)
        page.wait_for_function("document.body.dataset.trials === '96'", timeout=15000)
        steps = page.evaluate("document.getElementById('chart-reward').data[0].x")
        assert list(steps) == [0, 1, 2]
        assert page.evaluate("document.getElementById('chart-grid').data[0].x").count("2") == 1
        assert page.locator("#viewer-title").inner_text() == title
        assert page.locator("#stat-trials b").inner_text() == "96"
        _shot(page, "after-update.png")
        assert not errors, errors
        page.close()


def test_static_export_opens_from_file(browser: Any, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=2, harnesses=("openhands",))
    report.write_report(run, report.build_report(run))
    out = tmp_path / "share"
    export([run], out)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = _errors(page)
    page.goto((out / "index.html").as_uri())
    page.wait_for_function("document.body.dataset.trials === '32'", timeout=20000)
    _check_panels(page)
    assert "static export" in page.locator("#status-text").inner_text()
    page.locator("#f-category").select_option("resolved")
    _open_trial(page, 1)
    assert page.locator("#viewer-tests tbody tr").count() == 3
    _shot(page, "static-export.png")
    assert not errors, errors
    page.close()


def test_fidelity_panel_draws_a_real_training_run(browser: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The metrics of a real `legorl train` step, not hand-written ones, reach the fidelity charts."""
    run = trained_run(tmp_path / "run", tiny_model)
    written = {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}
    with _served_page(browser, run.root, 5) as page:
        assert page.locator("#panel-fidelity").get_attribute("data-state") == "ready"
        shown = page.evaluate(
            "Array.from(document.querySelectorAll('#fidelity-charts .small')).map(d => "
            "[d.dataset.key, d.title, (d.data || []).find(t => t.name === 'all').y])"
        )
        assert [key for key, _, _ in shown] == list(mk.FIDELITY_PANEL)
        for key, title, values in shown:
            assert title == mk.FIDELITY_PANEL[key] and values == [written[key]], key
        _shot(page, "fidelity-real-run.png", "#panel-fidelity")


def test_staleness_panel_draws_a_real_training_run(browser: Any, tiny_model: Path, tmp_path: Path) -> None:
    """A step whose trials straddle a weight load, trained by the real train stage: the panel stacks the
    rollouts' token lags and draws the trainer's per-lag ESS; a run without versions leaves it empty."""
    run = stale_run(tmp_path / "run", tiny_model)
    written = {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}
    with _served_page(browser, run.root, 5) as page:
        assert page.locator("#panel-staleness").get_attribute("data-state") == "ready"
        traces = page.evaluate("document.getElementById('chart-staleness').data.map(t => [t.name, t.x, t.y])")
        assert traces == [["lag 0", [1], [round(10 / 44, 6)]], ["lag 1", [1], [round(34 / 44, 6)]],
                          ["ESS lag 0", [1], [written[mk.IS_ESS_AT_LAG + "0"]]],
                          ["ESS lag 1", [1], [written[mk.IS_ESS_AT_LAG + "1"]]]]
        assert page.locator("#chart-staleness .barlayer .point").count() == 2
        _shot(page, "staleness-real-run.png", "#panel-staleness")
    unversioned = make_run(tmp_path / "old", steps=1, harnesses=("openhands",))
    with _served_page(browser, unversioned, 16) as page:
        assert page.locator("#panel-staleness").get_attribute("data-state") == "empty"
        assert "records its policy version" in page.locator("#panel-staleness .empty-note").inner_text()


def test_a_step_skipped_for_zero_advantage_says_why(browser: Any, tiny_model: Path, tmp_path: Path) -> None:
    """A real `legorl train` step where every group's trials scored the same makes no update: the
    fidelity panel says so and why, not "no train/metrics yet"."""
    from legorl.stages.train import run_train
    from legorl.training.config import TrainConfig

    specs = [TrialSpec("t1", i, 0.0, harness="mini") for i in range(2)]
    run = make_train_run(tmp_path / "run", tiny_model, specs)
    run_train(run.root, tiny_model, None, TrainConfig(learning_rate=1e-4))
    written = {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}
    assert written[mk.SKIPPED] == 1.0 and written[mk.SKIPPED_BECAUSE + mk.SKIP_ZERO_ADVANTAGE] == 1.0
    with _served_page(browser, run.root, 2) as page:
        assert page.locator("#panel-fidelity").get_attribute("data-state") == "empty"
        note = page.locator("#panel-fidelity .empty-note").inner_text()
        assert note.startswith("No fidelity figures: step 0 made no update: every group's trials scored the same"), note
        assert page.locator(".modebar").count() == 0  # no plotly toolbar over a panel's title
        _shot(page, "fidelity-skipped-step.png", "#panel-fidelity")
