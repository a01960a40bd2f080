"""The sampling distribution travels in the shards (issue #11): the proxy records it on every call and
`legorl train` takes it from there instead of assuming temperature 1.

Rollouts are sampled by the real in-process proxy that `legorl rollout --temperature 0.7` builds (an
embedded engine on the tiny model; the harness asks for temperature 1, the override wins), through
both APIs, streaming or not, with a budget stop at the end of every trial; then the real train stage
runs on the written shards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import INFO_FILE, RunDir
from legorl.core.schemas import CALL_TYPE, GradeRow, Kind, TrialRow
from legorl.proxy.budgets import Budgets
from legorl.stages.train import run_train
from legorl.training.config import TrainConfig
from legorl.training.data import StepData, Trial
from legorl.training.sampling import CallSampling, step_sampling

T = 0.7
REWARDS = {("t1", 0): 1.0, ("t1", 1): 0.0, ("t2", 0): 0.0, ("t2", 1): 1.0}


def _trial(proxy: Any, task: str, sample: int, api: str, seed: int) -> TrialRow:
    """Two sampled calls (one plain, one streamed) and a third one the turn budget stops."""
    sid, oa_url, an_url = proxy.new_session(Budgets(max_turns=2, max_tokens_per_call=14), {})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Fix task {task}; attempt {sample}."}]
    for turn in range(3):
        stream = turn == 1
        if api == "openai":
            oa: Any = openai.OpenAI(base_url=oa_url, api_key="x", max_retries=0)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
                    model="m", messages=msgs, temperature=1.0, seed=seed + turn, stream=True) if c.choices)
            else:
                r = oa.chat.completions.create(model="m", messages=msgs, temperature=1.0, seed=seed + turn)
                text = r.choices[0].message.content or ""
        else:
            an = anthropic.Anthropic(base_url=an_url, api_key="x", max_retries=0)
            kwargs: dict[str, Any] = {"model": "m", "max_tokens": 14, "messages": msgs,
                                      "extra_body": {"temperature": 1.0}}  # no seed in this API
            if stream:
                with an.messages.stream(**kwargs) as s:
                    text = "".join(s.text_stream)
            else:
                text = "".join(b.text for b in an.messages.create(**kwargs).content if b.type == "text")
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Output {turn}: ok"}]
    cap = proxy.finish(sid)
    return TrialRow.new(task, api, 0, sample, outcome="max_turns", segments=cap.segments, calls=cap.calls)


def _write(run: RunDir, trials: list[TrialRow]) -> None:
    shards.write(run.rollouts, Kind.ROLLOUTS, trials)
    shards.write(run.grades, Kind.GRADES, [
        GradeRow(trial_id=t.trial_id, task_id=t.task_id, harness=t.harness, step=0, status="graded",
                 reward=REWARDS.get((t.task_id, t.sample_index), 0.0),
                 resolved=bool(REWARDS.get((t.task_id, t.sample_index))))
        for t in trials
    ])


@pytest.fixture(scope="module")
def rollouts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunDir, list[TrialRow]]]:
    """A step rolled out at temperature 0.7, and three trials of another task at 1.0 (same engine)."""
    from transformers import AutoTokenizer

    from legorl.engines.embedded import EmbeddedEngine
    from legorl.proxy.clients import InProcessProxy

    engine = EmbeddedEngine(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    try:
        with InProcessProxy(engine, tokenizer, temperature=T) as proxy:
            trials = [_trial(proxy, task, i, "openai" if task == "t1" else "anthropic", seed=10 * k)
                      for k, (task, i) in enumerate(REWARDS)]
        with InProcessProxy(engine, tokenizer, temperature=1.0) as proxy:
            hot = [_trial(proxy, "t3", i, "openai", seed=100 + i) for i in range(2)]
    finally:
        asyncio.run(engine.close())
    run = RunDir.at(tmp_path_factory.mktemp("sampling") / "run")
    _write(run, trials)
    yield run, hot


def _copy(run: RunDir, dst: Path) -> RunDir:
    for name in ("rollouts", "grades"):
        shutil.copytree(run.root / name, dst / name)
    return RunDir.at(dst)


def _metrics(run: RunDir) -> dict[str, float]:
    return {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None and r.value is not None}


def test_every_call_records_the_distribution_it_sampled(rollouts: tuple[RunDir, list[TrialRow]]) -> None:
    run, hot = rollouts
    trials = shards.read_rows(run.rollouts, Kind.ROLLOUTS)
    assert {t.harness for t in trials} == {"openai", "anthropic"}
    for trial in trials + hot:
        want = 1.0 if trial.task_id == "t3" else T
        sampled = [c for c in trial.calls if not c.budget_stop]
        assert [c.stream for c in sampled] == [False, True]
        assert all((c.temperature, c.top_p, c.top_k) == (want, 1.0, 0) for c in sampled), sampled
        (stop,) = [c for c in trial.calls if c.budget_stop]  # sampled nothing: records nothing
        assert (stop.temperature, stop.top_p, stop.top_k) == (None, None, None)


def test_plain_train_uses_the_recorded_temperature(rollouts: tuple[RunDir, list[TrialRow]], tiny_model: Path,
                                                   tmp_path: Path) -> None:
    run = _copy(rollouts[0], tmp_path / "run")
    result = run_train(run.root, tiny_model, None, TrainConfig(learning_rate=1e-4))
    m = _metrics(run)
    print(f"\nrollout T={T}, train (no --temperature): pearson={m[mk.LOGPROB_PEARSON]:.7f} "
          f"mismatch_kl={m[mk.MISMATCH_KL]:.2e} max|d|={m[mk.LOGPROB_ABS_DIFF_MAX]:.2e} "
          f"tokens={m[mk.TOKENS_SAMPLED]:.0f}")
    assert m[mk.TOKENS_SAMPLED] >= 40
    assert m[mk.LOGPROB_PEARSON] >= 0.9999
    assert m[mk.MISMATCH_KL] < 1e-6
    assert m[mk.IS_ESS] == pytest.approx(1.0, abs=1e-5)
    info = json.loads((result.checkpoint / INFO_FILE).read_text())
    assert info["sampling"]["temperature"] == T and info["sampling"]["source"] == "shards"
    assert info["sampling"]["recorded_calls"] == 8 and info["sampling"]["unrecorded_calls"] == 0


def test_a_wrong_explicit_temperature_is_refused(rollouts: tuple[RunDir, list[TrialRow]], tiny_model: Path,
                                                 tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from legorl.cli.app import app

    run = _copy(rollouts[0], tmp_path / "run")
    bad = CliRunner().invoke(app, ["train", "--run", str(run.root), "--model", str(tiny_model), "--temperature", "1.0"])
    assert bad.exit_code != 0 and isinstance(bad.exception, LegorlError), bad.output
    message = str(bad.exception)
    assert "--temperature 1 differs" in message and "(0.7," in message and "trial t" in message, message
    assert not run.checkpoints.exists() and not run.metrics.exists()  # refused before anything is written
    from legorl.training.data import load_step

    assert step_sampling(load_step(run), T).temperature == T  # the matching value is accepted


def test_a_step_mixing_temperatures_is_refused(rollouts: tuple[RunDir, list[TrialRow]], tiny_model: Path,
                                               tmp_path: Path) -> None:
    run, hot = rollouts
    mixed = _copy(run, tmp_path / "run")
    _write(mixed, hot)  # the same step, sampled at 1.0 by a second rollout
    with pytest.raises(LegorlError, match=r"trial t3/openai/step0/sample\d call \d was sampled at temperature 1 "
                                          r"but trial t\d/\w+/step0/sample\d call \d at 0\.7"):
        run_train(mixed.root, tiny_model, None, TrainConfig())
    assert not mixed.checkpoints.exists()


def _strip_sampling(src: RunDir, dst: Path) -> RunDir:
    """The shards as a legorl from before the fields existed wrote them (calls without them)."""
    old_call = pa.struct([f for f in CALL_TYPE if f.name not in ("temperature", "top_p", "top_k")])
    run = _copy(src, dst)
    for part in shards.part_files(run.rollouts):
        table = pq.read_table(part)
        i = table.schema.get_field_index("calls")
        table = table.set_column(i, pa.field("calls", pa.list_(old_call)), table.column(i).cast(pa.list_(old_call)))
        pq.write_table(table.replace_schema_metadata(pq.read_metadata(part).schema.to_arrow_schema().metadata), part)
    return run


def test_old_shards_train_at_the_configured_temperature(rollouts: tuple[RunDir, list[TrialRow]], tiny_model: Path,
                                                        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    configured = _strip_sampling(rollouts[0], tmp_path / "configured")
    assert all(c.temperature is None for t in shards.read_rows(configured.rollouts, Kind.ROLLOUTS) for c in t.calls)
    with caplog.at_level(logging.WARNING, "legorl.train"):
        run_train(configured.root, tiny_model, None, TrainConfig(learning_rate=1e-4, temperature=T))
    assert "record no sampling parameters" in caplog.text and "configured (--temperature) temperature 0.7" in caplog.text
    m = _metrics(configured)
    assert m[mk.LOGPROB_PEARSON] >= 0.9999 and m[mk.MISMATCH_KL] < 1e-6

    # Without a value they fall back to 1.0: what every step trained at before the fix (wrong here).
    default = _strip_sampling(rollouts[0], tmp_path / "default")
    caplog.clear()
    with caplog.at_level(logging.WARNING, "legorl.train"):
        result = run_train(default.root, tiny_model, None, TrainConfig(learning_rate=1e-4))
    assert "default temperature 1" in caplog.text
    assert json.loads((result.checkpoint / INFO_FILE).read_text())["sampling"]["source"] == "default"
    wrong = _metrics(default)
    print(f"\nold shards sampled at T={T}: --temperature {T}: pearson={m[mk.LOGPROB_PEARSON]:.7f} "
          f"kl={m[mk.MISMATCH_KL]:.2e}; default 1.0: pearson={wrong[mk.LOGPROB_PEARSON]:.7f} "
          f"kl={wrong[mk.MISMATCH_KL]:.2e}")
    assert wrong[mk.MISMATCH_KL] > 1e-3


# ------------------------------------------------------------------ the decision itself, without a model


def _data(*trials: list[CallSampling]) -> StepData:
    rows = [Trial(f"t{i}/h/step0/sample0", f"t{i}/step0", "h", 0.0, False, sampling=s) for i, s in enumerate(trials)]
    return StepData(step=0, trials=rows, sequences=[])


def _call(i: int, temperature: float | None, top_p: float | None = 1.0, top_k: int | None = 0) -> CallSampling:
    return CallSampling(i, temperature, top_p, top_k)


@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (1.0, 50), (0.95, 20)])
def test_truncated_sampling_is_refused_naming_the_trial(top_p: float, top_k: int) -> None:
    data = _data([_call(0, 1.0)], [_call(0, 1.0), _call(1, 1.0, top_p, top_k)])
    with pytest.raises(LegorlError, match=rf"trial t1/h/step0/sample0 call 1 was sampled with top_p={top_p:g}, "
                                          rf"top_k={top_k}: the trainer"):
        step_sampling(data)


def test_greedy_and_partly_recorded_steps() -> None:
    # Greedy calls record 0; their logprobs are those at temperature 1, so the trainer scores at 1.
    greedy = step_sampling(_data([_call(0, 0.0)]))
    assert (greedy.temperature, greedy.logprob_temperature) == (0.0, 1.0)
    assert step_sampling(_data([_call(0, 0.0)]), 5e-5).temperature == 0.0  # the proxy's greedy rule
    with pytest.raises(LegorlError, match="differs"):
        step_sampling(_data([_call(0, 0.0)]), 1.0)
    # Calls without a record next to recorded ones take the recorded value; none at all: the config's.
    part = step_sampling(_data([_call(0, None, None, None)], [_call(0, 0.5)]))
    assert (part.temperature, part.source, part.recorded_calls, part.unrecorded_calls) == (0.5, "shards", 1, 1)
    assert step_sampling(_data([], [_call(0, None, None, None)]), 0.8).temperature == 0.8
    assert step_sampling(_data([])).temperature == 1.0
    with pytest.raises(LegorlError, match="no temperature"):
        step_sampling(_data([_call(0, None, 1.0, 0)]))



def test_calls_record_the_requested_sampling_after_the_greedy_rule_and_overrides(tiny_model: Path) -> None:
    """Without an override each call records what its request asked (a tiny temperature as the greedy 0
    it samples at); with one, the override. Both APIs, streaming or not."""
    from proxy_support import scripted_engine
    from transformers import AutoTokenizer

    from legorl.proxy.core import SamplingOverride
    from legorl.proxy.server import ProxyServer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    msgs: list[Any] = [{"role": "user", "content": "hi"}]
    for override, want in ((None, [(0.0, 0.9, 0), (0.5, 1.0, 7), (1.0, 1.0, 0)]),
                           (SamplingOverride(temperature=0.7, top_p=1.0, top_k=0), [(0.7, 1.0, 0)] * 3),
                           # what `legorl rollout --temperature` uses: truncation a harness asks for is undone
                           (SamplingOverride.policy(0.7), [(0.7, 1.0, 0)] * 3)):
        with ProxyServer(scripted_engine(tokenizer), tokenizer, sampling=override) as proxy:
            sid = proxy.new_session()
            oa: Any = openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)
            oa.chat.completions.create(model="m", messages=msgs, temperature=5e-5, top_p=0.9)
            an = anthropic.Anthropic(base_url=proxy.anthropic_base_url(sid), api_key="x", max_retries=0)
            with an.messages.stream(model="m", max_tokens=5, messages=msgs,
                                    extra_body={"temperature": 0.5, "top_k": 7}) as s:
                "".join(s.text_stream)
            list(oa.chat.completions.create(model="m", messages=msgs, stream=True))
            calls = proxy.capture(sid).calls
        assert [c.stream for c in calls] == [False, True, True]
        assert [(c.temperature, c.top_p, c.top_k) for c in calls] == want
