"""``legorl dashboard --export DIR``: a static copy of the dashboard that opens without a server.

Layout of ``DIR``::

    index.html          the page (opens from file:// or any static web server)
    app.js, app.css     the page's code
    plotly.min.js       from the plotly package
    data.js             runs and overviews, as a script (file:// forbids fetching JSON)
    data/runs.json, data/overview-<I>.json           the same data as JSON, for scripts
    data/trials/<I>-<KEY>.js, data/trials/<I>-<KEY>.json   one file per trial for the viewer

Files are written to a temporary folder beside ``DIR`` and renamed into place, so a half export
never replaces a good one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from legorl.core.errors import LegorlError
from legorl.monitor.dashboard.server import STATIC, RunSet, index_html, plotly_js


def _script(variable: str, value: Any) -> str:
    """``variable = <value as JSON>;`` with "</" escaped, so the data can never close a script tag."""
    return _script_of(variable, json.dumps(value, separators=(",", ":")))


def _script_of(variable: str, body: str) -> str:
    escaped = body.replace("</", "<\\/")
    return f"{variable} = {escaped};\n"


def export(roots: list[Path], out: Path) -> dict[str, int]:
    """Write the static dashboard of ``roots`` into ``out``; returns counts of what was written."""
    runs = RunSet(roots)
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise LegorlError(f"{out}: export target exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "data" / "trials").mkdir(parents=True)
        for name in ("app.js", "app.css"):
            shutil.copyfile(STATIC / name, tmp / name)
        shutil.copyfile(plotly_js(), tmp / "plotly.min.js")
        run_list = runs.runs()
        for r in run_list:
            r.pop("path")  # a shared copy does not reveal local paths
        overviews = [runs.overview(i) for i in range(len(run_list))]
        (tmp / "data" / "runs.json").write_text(json.dumps(run_list, indent=1))
        trials = 0
        for i, ov in enumerate(overviews):
            (tmp / "data" / f"overview-{i}.json").write_text(json.dumps(ov))
            for detail in runs.trials(i):  # each dataset read once, not once per trial
                name = f"{i}-{detail['key']}"
                stem = tmp / "data" / "trials" / name
                body = json.dumps(detail, separators=(",", ":"))  # once, for both files
                stem.with_suffix(".json").write_text(body)
                stem.with_suffix(".js").write_text(
                    "window.LEGORL_TRIALS = window.LEGORL_TRIALS || {};\n"
                    + _script_of(f"window.LEGORL_TRIALS[{json.dumps(name)}]", body)
                )
                trials += 1
        (tmp / "data.js").write_text(_script("window.LEGORL_STATIC", {"runs": run_list, "overviews": overviews}))
        (tmp / "index.html").write_text(index_html('<script src="data.js"></script>'), encoding="utf-8")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"runs": len(run_list), "trials": trials}
