"""Policy versions per call and per token: a trial whose calls straddle a weight load, the swap
waiting for the call in flight, the staleness bound as pure functions, and old shards (no version)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from legorl.core import shards
from legorl.core.errors import ConfigError, LegorlError
from legorl.core.schemas import CALL_TYPE, Call, Kind, Segment, TrialRow
from legorl.engines.base import SamplingParams
from legorl.engines.embedded import EmbeddedEngine
from legorl.engines.watched import WatchedEngine
from legorl.proxy.budgets import Budgets
from legorl.proxy.clients import InProcessProxy
from legorl.trials import provenance
from legorl.trials.external import session_row


@pytest.fixture(scope="module")
def perturbed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second checkpoint of the tiny model: the (tied) LM head scaled, so every logprob moves."""
    out = tmp_path_factory.mktemp("perturbed") / "step-0"
    shutil.copytree(tiny_model, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.5)
    model.save_pretrained(out)
    return out


def _fp32_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens_<i) under ``model_dir``'s weights in float32, for i >= 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def test_a_trial_spanning_two_versions_versions_each_token_and_its_logprobs_match_that_version(
    tiny_model: Path, perturbed: Path
) -> None:
    import openai

    with InProcessProxy(EmbeddedEngine(tiny_model), str(tiny_model)) as proxy:
        sid, base_url, _ = proxy.new_session(Budgets(), {"task_id": "t", "harness": "h", "step": 1})
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Say something."}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=1.0)
        asyncio.run(proxy.engine.load_weights(str(perturbed)))  # between the trial's two calls
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And again."}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=1.0, stream=False)
        row = session_row(proxy.finish(sid))
        asyncio.run(proxy.engine.close())

    assert [c.policy_version for c in row.calls] == [0, 1]
    assert len(row.segments) == 1  # the second call extended the first's segment: it spans both versions
    segment = row.segments[0]
    versions = provenance.token_versions(row)[0]
    for call in row.calls:
        span = versions[call.prompt_tokens: call.prompt_tokens + call.completion_tokens]
        assert span == [call.policy_version] * call.completion_tokens
    assert all(v is None for v, m in zip(versions, segment.loss_mask, strict=True) if not m)  # prompts: none
    assert sum(v is not None for v in versions) == sum(segment.loss_mask) == sum(c.completion_tokens for c in row.calls)

    recorded = torch.tensor(segment.logprobs[1:])
    by_version = {0: _fp32_logprobs(tiny_model, segment.token_ids), 1: _fp32_logprobs(perturbed, segment.token_ids)}
    for version, other in ((0, 1), (1, 0)):
        at = torch.tensor([v == version for v in versions[1:]])
        assert at.any()
        delta = (by_version[version][at] - recorded[at]).abs().max().item()
        wrong = (by_version[other][at] - recorded[at]).abs().max().item()
        print(f"\nversion {version}: {int(at.sum())} tokens, max |Δ| {delta:.2e} (other version's weights {wrong:.2e})")
        assert delta < 1e-4
        assert wrong > 1e-2  # the versions really differ: the check above could fail

    assert provenance.lags(row) == [1, 0] and provenance.trial_lag(row) == 1
    assert not provenance.is_stale(row, 1, max_staleness=1) and provenance.is_stale(row, 2, max_staleness=1)


def test_a_swap_waits_for_the_call_in_flight_and_holds_the_calls_that_arrive_meanwhile(
    tiny_model: Path, perturbed: Path
) -> None:
    engine = WatchedEngine(EmbeddedEngine(tiny_model), policy_version=3)
    params = SamplingParams(max_tokens=40, seed=1, stop_token_ids=())
    events: list[tuple[str, Any]] = []
    swap_asked = threading.Event()

    def swap() -> None:  # the loop's thread: its own event loop, as Policy.reload does it
        swap_asked.set()
        asyncio.run(engine.load_weights(str(perturbed)))
        events.append(("swapped", engine.policy_version))

    async def calls() -> None:
        stream = engine.stream([1, 2, 3], params)
        async for chunk in stream:
            if not swap_asked.is_set():
                events.append(("first chunk", engine.call_version()))
                threading.Thread(target=swap, daemon=True).start()
                while not engine.swapping:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the swap waits for this call: it must not complete meanwhile
            if chunk.final is not None:
                events.append(("first call done", engine.call_version()))
        later = engine.stream([4, 5, 6], SamplingParams(max_tokens=2, seed=2))
        async for _ in later:
            events.append(("second call", engine.call_version()))
            break
        await later.aclose()  # type: ignore[attr-defined]

    asyncio.run(calls())
    deadline = time.monotonic() + 120
    while not any(e[0] == "swapped" for e in events):
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
    asyncio.run(engine.load_weights(str(tiny_model), version=1))  # a caller that knows which version it loads
    assert engine.policy_version == 1
    with pytest.raises(LegorlError, match="not a model directory"):
        asyncio.run(engine.load_weights(str(tiny_model / "missing")))
    assert engine.policy_version == 1 and not engine.swapping  # a failed load keeps the version
    asyncio.run(engine.close())
    names = [e[0] for e in events]
    assert names.index("first call done") < names.index("swapped"), events
    assert dict(events) == {"first chunk": 3, "first call done": 3, "swapped": 4, "second call": 4}
    assert engine.in_flight == 0


def _row(step: int, calls: list[tuple[int, int, int, int | None]], tokens: int = 12) -> TrialRow:
    """A trial of one segment: each call (segment, prompt_tokens, completion_tokens, version) marks its
    sampled tokens in the loss mask."""
    mask = [0] * tokens
    for _, start, n, _ in calls:
        mask[start:start + n] = [1] * n
    segment = Segment(token_ids=list(range(tokens)), loss_mask=mask, logprobs=[-1.0 * m for m in mask])
    return TrialRow.new("t", "h", step, 0, outcome="submitted", segments=[segment], calls=[
        Call(index=i, api="openai", stream=False, segment=s, prompt_tokens=p, completion_tokens=n, policy_version=v)
        for i, (s, p, n, v) in enumerate(calls)
    ])


def test_the_bound_drops_or_masks_only_calls_older_than_k() -> None:
    row = _row(5, [(0, 2, 3, 3), (0, 7, 2, 4), (0, 10, 2, 5)])
    assert provenance.token_versions(row) == [[None, None, 3, 3, 3, None, None, 4, 4, None, 5, 5]]
    assert provenance.lags(row) == [2, 1, 0] and provenance.trial_lag(row) == 2
    assert provenance.is_stale(row, 5, 1) and not provenance.is_stale(row, 5, 2)
    assert provenance.segment_loss_masks(row, 5, 1) == [[0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1]]
    assert provenance.segment_loss_masks(row, 5, 2) == [row.segments[0].loss_mask]
    assert provenance.segment_loss_masks(row.to_dict(), 5, 0) == [[0] * 10 + [1, 1]]  # dict rows, as shards read

    fresh = _row(5, [(0, 2, 4, 5)])
    unknown = _row(5, [(0, 2, 4, None)])
    figures = provenance.staleness_metrics([row, fresh, unknown], 5, provenance.Staleness(1, "drop_trial"))
    assert figures == {
        "staleness/trials_lag/0": 0.5, "staleness/trials_lag/2": 0.5,
        "staleness/tokens_lag/0": 6 / 11, "staleness/tokens_lag/1": 2 / 11, "staleness/tokens_lag/2": 3 / 11,
        provenance.MAX_LAG: 2.0, provenance.TRIALS_UNVERSIONED: 1.0, provenance.TRIALS_STALE: 1.0,
        provenance.TRIALS_DROPPED: 1.0, provenance.TOKENS_MASKED: 0.0,
    }
    masked = provenance.staleness_metrics([row, fresh], 5, provenance.Staleness(1, "mask"))
    assert masked[provenance.TRIALS_DROPPED] == 0.0 and masked[provenance.TOKENS_MASKED] == 3.0
    kept = provenance.staleness_metrics([row, fresh], 5, provenance.Staleness(1, "keep"))
    assert (kept[provenance.TRIALS_STALE], kept[provenance.TRIALS_DROPPED], kept[provenance.TOKENS_MASKED]) == (1, 0, 0)
    assert provenance.lag_shares([row, fresh, unknown]) == {"0": 0.5, "2": 0.5}


def test_bad_bounds_and_corrupt_call_spans_are_refused() -> None:
    with pytest.raises(ConfigError, match="--max-staleness must be >= 0"):
        provenance.Staleness(-1)
    with pytest.raises(ConfigError, match="--stale-tokens 'later'"):
        provenance.Staleness(1, "later")  # type: ignore[arg-type]
    with pytest.raises(LegorlError, match=r"call 0 points at tokens 10:14 of segment 0, which the row does not"):
        provenance.token_versions(_row(1, [(0, 10, 4, 0)]))
    bad = _row(1, [(0, 2, 3, 0)])
    bad.segments[0].loss_mask[3] = 0
    with pytest.raises(LegorlError, match=r"call 0's tokens 2:5 of segment 0 are not all sampled"):
        provenance.token_versions(bad)


def test_shards_from_before_versions_read_as_unknown(tmp_path: Path) -> None:
    row = _row(2, [(0, 2, 3, 1)])
    shards.write(tmp_path, Kind.ROLLOUTS, [row])
    assert shards.read_rows(tmp_path, Kind.ROLLOUTS)[0].calls[0].policy_version == 1
    old_call = pa.struct([f for f in CALL_TYPE if f.name != "policy_version"])
    for part in shards.part_files(tmp_path):
        table = pq.read_table(part)
        i = table.schema.get_field_index("calls")
        table = table.set_column(i, pa.field("calls", pa.list_(old_call)), table.column(i).cast(pa.list_(old_call)))
        pq.write_table(table.replace_schema_metadata(pq.read_metadata(part).schema.to_arrow_schema().metadata), part)
    (old,) = shards.read_rows(tmp_path, Kind.ROLLOUTS)
    assert old.calls[0].policy_version is None
    assert provenance.token_versions(old) == [[None] * 12] and provenance.trial_lag(old) is None
    assert not provenance.is_stale(old, 9, 0)


def test_inspect_and_health_show_the_staleness_of_a_versioned_run(tmp_path: Path) -> None:
    from legorl.core.schemas import MetricRow
    from legorl.monitor.health import health_renderable, health_summary
    from legorl.monitor.inspect import inspect_path

    rows = [_row(1, [(0, 2, 3, 1)]), _row(1, [(0, 2, 3, 0)])]
    rows[1].sample_index, rows[1].trial_id = 1, "t/h/step1/sample1"
    shards.write(tmp_path / "rollouts", Kind.ROLLOUTS, rows)
    figures = provenance.staleness_metrics(rows, 1, provenance.Staleness(1))
    shards.write(tmp_path / "train" / "metrics", Kind.METRICS, [
        MetricRow(step=1, key=k, value=v, stage=provenance.METRICS_STAGE) for k, v in figures.items()])

    (rollouts,) = [d for d in inspect_path(tmp_path)["datasets"] if d["name"] == "rollouts"]
    assert rollouts["breakdown"]["staleness"] == {"lag 0": 0.5, "lag 1": 0.5}
    summary = health_summary(tmp_path)
    assert summary["staleness"] == {"step": 1, "trials_by_lag": {"0": 0.5, "1": 0.5}, "trials_stale": 0.0,
                                    "trials_dropped": 0.0}
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(health_renderable(summary))
    assert "staleness             step 1: lag 0 50.0%, lag 1 50.0% of trials · 0 stale, 0 dropped" in console.export_text()

    unversioned = tmp_path / "old"
    shards.write(unversioned / "rollouts", Kind.ROLLOUTS, [_row(0, [(0, 2, 3, None)])])
    (old,) = inspect_path(unversioned)["datasets"]
    assert "staleness" not in old["breakdown"] and health_summary(unversioned)["staleness"] is None


def test_the_trainer_drops_or_masks_stale_trials_and_the_loop_writes_its_figures_once(tmp_path: Path) -> None:
    """Step 2's data under the bound: a trial one version behind is taken as it is, one two versions
    behind in one of its calls is left out (drop_trial) or trained on its fresh call only (mask)."""
    from legorl.core.paths import RunDir
    from legorl.core.schemas import GradeRow, GradeStatus
    from legorl.flows.online import _staleness_figures, _write_staleness
    from legorl.training.data import load_step

    run = RunDir.at(tmp_path)
    fresh = _row(2, [(0, 2, 3, 1)])
    mixed = _row(2, [(0, 2, 3, 0), (0, 7, 2, 2)])
    mixed.sample_index, mixed.trial_id = 1, "t/h/step2/sample1"
    broken = _row(2, [(0, 2, 3, 0)])  # two versions behind too, but its grading failed: training leaves it out
    broken.sample_index, broken.trial_id = 2, "t/h/step2/sample2"
    shards.write(run.rollouts, Kind.ROLLOUTS, [fresh, mixed, broken])
    shards.write(run.grades, Kind.GRADES, [
        GradeRow(r.trial_id, r.task_id, GradeStatus.GRADED, harness="h", step=2, reward=float(r.sample_index),
                 resolved=bool(r.sample_index)) for r in (fresh, mixed)])
    shards.write(run.grades, Kind.GRADES, [GradeRow(broken.trial_id, broken.task_id, GradeStatus.INFRA_ERROR,
                                                    harness="h", step=2, infra_failure=True)])

    taken = load_step(run, 2, staleness=provenance.Staleness(2))
    assert [t.trial_id for t in taken.trials] == [fresh.trial_id, mixed.trial_id]
    dropped = load_step(run, 2, staleness=provenance.Staleness(1, "drop_trial"))
    assert [t.trial_id for t in dropped.trials] == [fresh.trial_id] and dropped.dropped["stale_trial"] == 1
    masked = load_step(run, 2, staleness=provenance.Staleness(1, "mask"))
    assert [t.trial_id for t in masked.trials] == [fresh.trial_id, mixed.trial_id]
    (sequence,) = [masked.sequences[i] for i in masked.trials[1].sequences]
    assert sequence.loss_mask.tolist() == [0] * 7 + [1, 1] + [0] * 3  # the version-0 call's tokens carry no loss
    kept = load_step(run, 2, staleness=provenance.Staleness(1, "keep"))
    (sequence,) = [kept.sequences[i] for i in kept.trials[1].sequences]
    assert sequence.loss_mask.tolist() == [0] * 2 + [1] * 3 + [0] * 2 + [1, 1] + [0] * 3  # every sampled token
    assert kept.dropped["stale_trial"] == 0
    assert load_step(run, 2).dropped["stale_trial"] == 0  # no bound given: every trial as it is

    figures = _staleness_figures(run, 2, provenance.Staleness(1))
    # the figures are of the trials training takes: the infrastructure failure is not among them
    assert figures[provenance.MAX_LAG] == 2.0 and figures[provenance.TRIALS_STALE] == 1.0
    _write_staleness(run, 2, figures)
    _write_staleness(run, 2, figures)  # a rerun after a kill between the write and the step's end
    written = shards.read_rows(run.metrics, Kind.METRICS)
    assert sorted(m.key for m in written) == sorted(figures) and {m.stage for m in written} == {"loop"}
