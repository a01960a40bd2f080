"""Reading SWE-bench predictions files: every shape people write, and a clear error for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from legorl.core.errors import LegorlError
from legorl.core.schemas import TaskRow
from legorl.stages.grade import prediction_jobs

TASKS = {i: TaskRow(instance_id=i, FAIL_TO_PASS=["t.py::a"]) for i in ("a__b-1", "a__b-2")}
ONE = {"instance_id": "a__b-1", "model_patch": "diff", "model_name_or_path": "m"}


@pytest.mark.parametrize("text", [
    json.dumps(ONE) + "\n",  # a one-line JSONL file is one JSON object
    json.dumps([ONE]),
    json.dumps({"a__b-1": ONE}),
    json.dumps(ONE) + "\n" + json.dumps({**ONE, "instance_id": "a__b-2"}) + "\n",
])
def test_prediction_shapes(tmp_path: Path, text: str) -> None:
    path = tmp_path / "preds.jsonl"
    path.write_text(text)
    jobs = prediction_jobs(path, TASKS)
    assert jobs[0].task_id == "a__b-1" and jobs[0].patch == "diff" and jobs[0].harness == "m"


@pytest.mark.parametrize(("text", "message"), [
    ("5", "got a JSON int"),
    ('"x"', "got a JSON str"),
    ('[{"model_patch": "d"}]', "prediction 0: field 'instance_id': missing"),
    ('{"instance_id": "zz"}', "no task 'zz'"),
    ("{nope", "neither JSON nor JSON lines"),
])
def test_bad_predictions_get_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "preds.jsonl"
    path.write_text(text)
    with pytest.raises(LegorlError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prediction_jobs(path, TASKS)
