"""The dashboard's web server: JSON endpoints over the shards, the page, and plotly.js served offline.

Endpoints (all GET, relative to the page):

- ``api/runs`` — the runs shown (the first is the main run, the others are compared with it);
- ``api/fingerprint`` — one digest per run of its part-file listing; the page polls it and
  refetches only when it changed, so a quiet run costs a few directory listings per poll;
- ``api/overview?run=I`` — every panel's data for run ``I`` (cached per fingerprint);
- ``api/trial?run=I&id=TRIAL_ID`` — one trial for the trajectory viewer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from legorl.core.errors import LegorlError
from legorl.monitor.dashboard.data import overview, trial_detail, trial_details
from legorl.monitor.loading import RunReader

STATIC = Path(__file__).with_name("static")


def plotly_js() -> Path:
    """plotly.min.js as shipped inside the ``plotly`` PyPI package (served, never fetched from a CDN)."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError as exc:
        raise LegorlError("the dashboard needs the 'plotly' package for its charts: pip install plotly") from exc
    if not path.is_file():
        raise LegorlError(f"{path}: plotly.min.js is missing from the installed plotly package")
    return path


def index_html(data_script: str = "") -> str:
    """The page; ``data_script`` is inserted before the app script (the static export embeds its data)."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    return html.replace("<!--LEGORL_DATA-->", data_script)


class RunSet:
    """The runs a dashboard shows, each with its reader and a cached overview, safe across threads."""

    def __init__(self, roots: list[Path]):
        if not roots:
            raise LegorlError("the dashboard needs at least one run directory")
        self.readers = [RunReader(r) for r in roots]
        self._locks = [threading.Lock() for _ in roots]
        self._overviews: dict[int, tuple[str, bytes]] = {}

    def _reader(self, index: int) -> RunReader:
        if not 0 <= index < len(self.readers):
            raise LegorlError(f"no run number {index} (this dashboard shows {len(self.readers)})")
        return self.readers[index]

    def runs(self) -> list[dict[str, Any]]:
        return [{"index": i, "name": r.run.root.resolve().name, "path": str(r.run.root)}
                for i, r in enumerate(self.readers)]

    def fingerprints(self) -> list[str]:
        return [r.fingerprint() for r in self.readers]

    def overview_json(self, index: int) -> bytes:
        reader = self._reader(index)
        with self._locks[index]:
            snap = reader.snapshot()
            cached = self._overviews.get(index)
            if cached is not None and cached[0] == snap.fingerprint:
                return cached[1]
            body = json.dumps(overview(snap), separators=(",", ":")).encode()
            self._overviews[index] = (snap.fingerprint, body)
            return body

    def overview(self, index: int) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.overview_json(index))
        return result

    def trial(self, index: int, trial_id: str) -> dict[str, Any]:
        reader = self._reader(index)
        with self._locks[index]:
            return trial_detail(reader, trial_id)

    def trials(self, index: int) -> Iterator[dict[str, Any]]:
        """Every trial's detail of run ``index``, reading each dataset once (the static export)."""
        reader = self._reader(index)
        with self._locks[index]:
            yield from trial_details(reader)


def create_app(roots: list[Path], poll_ms: int = 2000) -> Starlette:
    runs = RunSet(roots)
    plotly_path = plotly_js()

    def _run_index(request: Request) -> int:
        try:
            return int(request.query_params.get("run", "0"))
        except ValueError as exc:
            raise LegorlError("run must be an integer") from exc

    async def page(request: Request) -> Response:
        config = f"<script>window.LEGORL_CONFIG = {json.dumps({'pollMs': poll_ms})};</script>"
        return HTMLResponse(index_html(config), headers={"Cache-Control": "no-store"})

    async def plotly_file(request: Request) -> Response:
        return FileResponse(plotly_path, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    async def app_js(request: Request) -> Response:
        return FileResponse(STATIC / "app.js", media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    async def app_css(request: Request) -> Response:
        return FileResponse(STATIC / "app.css", media_type="text/css", headers={"Cache-Control": "no-cache"})

    def api_runs(request: Request) -> Response:
        return JSONResponse(runs.runs())

    def api_fingerprint(request: Request) -> Response:
        return JSONResponse({"fingerprints": runs.fingerprints()}, headers={"Cache-Control": "no-store"})

    def api_overview(request: Request) -> Response:
        try:
            body = runs.overview_json(_run_index(request))
        except LegorlError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    def api_trial(request: Request) -> Response:
        trial_id = request.query_params.get("id", "")
        try:
            return JSONResponse(runs.trial(_run_index(request), trial_id))
        except LegorlError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    routes = [
        Route("/", page),
        Route("/plotly.min.js", plotly_file),
        Route("/app.js", app_js),
        Route("/app.css", app_css),
        Route("/api/runs", api_runs),
        Route("/api/fingerprint", api_fingerprint),
        Route("/api/overview", api_overview),
        Route("/api/trial", api_trial),
    ]
    app = Starlette(routes=routes)
    app.state.runs = runs
    return app


def serve(roots: list[Path], host: str = "127.0.0.1", port: int = 8765, poll_ms: int = 2000,
          log_level: str = "warning") -> None:
    """Serve the dashboard until interrupted."""
    import uvicorn

    app = create_app(roots, poll_ms)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
