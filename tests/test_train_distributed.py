"""Training across processes (issue #14): `accelerate launch` of two CPU processes (gloo) gives the
single process's update and metrics on the same rollouts and grades.

The guarantee (docs/training-at-scale.md): R processes with ``--micro-batches K`` cut every
generation batch into the same K micro-batches as one process does, each process training a
disjoint share of each; normalisers and advantages are counted over the whole batch, and every
figure is reduced over the processes. So the weights and every metric (TRL's per-micro-batch
figures included) agree to float tolerance.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_support import TrialSpec, run_fixture

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind
from legorl.training.batching import micro_batch_plan
from legorl.training.data import load_step

# Three groups, one trial forked into two segments, one group all equal (skipped: no signal); some
# trials record their calls' policy version, so the per-lag figures leave the others out on each process.
SPECS = [
    TrialSpec("t1", 0, 1.0, segments=2, versions=(0, 0)),
    TrialSpec("t1", 1, 0.0),
    TrialSpec("t1", 2, 0.0, versions=(0, 0)),
    TrialSpec("t1", 3, 1.0),
    TrialSpec("t2", 0, 0.0, versions=(0, 0)),
    TrialSpec("t2", 1, 0.5),
    TrialSpec("t2", 2, 1.0),
    TrialSpec("t3", 0, 1.0),
    TrialSpec("t3", 1, 1.0),
]
OPTIONS = ["--lr", "1e-4", "--is-cap", "1.5"]
LAUNCH_TIMEOUT_S = 600  # two processes importing torch + TRL on a loaded 2-core machine

shared_run = run_fixture(SPECS, logprob_noise=0.3)


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "ACCELERATE_USE_CPU": "1",  # gloo, whatever accelerators the machine has
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": str(tmp / "hf"),  # no user accelerate config (it lives under HF_HOME) changes the launch
    })
    return env


def _train(run: RunDir, model: Path, tmp: Path, processes: int, micro_batches: int, iterations: int) -> Path:
    """`legorl train` on a copy of ``run`` in ``processes`` processes; returns the copy's folder."""
    copy = tmp / f"run-{processes}"
    shutil.copytree(run.root, copy)
    train = ["-m", "legorl.cli", "train", "--run", str(copy), "--model", str(model), "--micro-batches",
             str(micro_batches), "--num-iterations", str(iterations), *OPTIONS, "--json"]
    if processes == 1:
        command = [sys.executable, *train]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_ip", "127.0.0.1", "--main_process_port", "0", *train]
    # Its own process group: on a timeout the launcher and the workers it started are killed together.
    proc = subprocess.Popen(command, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{processes} process(es) failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return copy


def _metrics(run: Path) -> dict[str, float]:
    dataset = shards.read(RunDir.at(run).metrics, Kind.METRICS)
    assert dataset.duplicates == 0
    return {r["key"] if r["harness"] is None else f"{r['key']}@{r['harness']}": r["value"]
            for r in dataset.table.to_pylist()}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


# 1: the old logprobs come from each training forward (and their figures are gathered after the
# batch); 2: a separate scoring pass, and a second, off-policy update that clips.
@pytest.mark.parametrize("iterations", [1, 2])
def test_two_gloo_processes_give_the_single_process_update_and_metrics(
    shared_run: RunDir, tiny_model: Path, tmp_path: Path, iterations: int
) -> None:
    one = _train(shared_run, tiny_model, tmp_path, processes=1, micro_batches=2, iterations=iterations)
    two = _train(shared_run, tiny_model, tmp_path, processes=2, micro_batches=2, iterations=iterations)

    a, b, init = (_weights(one / "train/checkpoints/step-0"), _weights(two / "train/checkpoints/step-0"),
                  _weights(tiny_model))
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    assert moved > 5e-5  # the update is far larger than the tolerance: unsynced gradients would show
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=name)

    m1, m2 = _metrics(one), _metrics(two)
    timing = {mk.PERF_WALL_S, mk.PERF_TOKENS_PER_S}
    assert m1.keys() == m2.keys()
    for key in sorted(m1.keys() - timing):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    # the comparison covers what it must: the step trained, with the zero group skipped, fidelity and
    # TRL's figures per micro-batch
    assert m1[mk.UPDATES] == iterations and m1[mk.SKIPPED] == 0.0 and m1[mk.TRIALS_SKIPPED] == 3  # t3, and t2/1 (its group's mean)
    for key in (mk.LOSS, mk.ENTROPY, mk.GRAD_NORM, mk.CLIP_FRACTION, mk.LOGPROB_PEARSON, mk.IS_TRUNCATED_FRAC,
                mk.IS_ESS_AT_LAG + "0", mk.IS_TRUNCATED_FRAC_AT_LAG + "0", "clip_ratio/low_min", "clip_ratio/high_max"):
        assert key in m1, key
    assert m1[mk.IS_TRUNCATED_FRAC] > 0 and m1[mk.GRAD_NORM] > 0

    # only the main process wrote: one checkpoint, one metrics part, rng states of both processes
    checkpoint = two / "train/checkpoints/step-0"
    assert sorted(p.name for p in (two / "train/checkpoints").iterdir()) == ["latest", "step-0"]
    assert len(shards.part_files(RunDir.at(two).metrics)) == 1
    assert {p.name for p in checkpoint.glob("rng_state*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}


def test_each_process_gets_a_disjoint_share_of_the_same_micro_batches(shared_run: RunDir) -> None:
    seqs = load_step(shared_run).sequences
    for by_tokens in (False, True):
        for chunks in (1, 2, 3):
            alone = micro_batch_plan(seqs, chunks, 1, torch.Generator().manual_seed(5), by_tokens=by_tokens)
            shared = micro_batch_plan(seqs, chunks, 2, torch.Generator().manual_seed(5), by_tokens=by_tokens)
            for (whole,), (first, second) in zip(alone, shared, strict=True):
                assert not set(first) & set(second)
                assert sorted(first + second) == sorted(whole)
                trials = [{seqs[i].trial_id for i in share} for share in (first, second)]
                assert not trials[0] & trials[1]  # a trial's segments stay on one process
            assert sorted(i for (whole,) in alone for i in whole) == list(range(len(seqs)))
    # more pieces than trials: the empty micro-batches come first, the synchronising last one is not empty
    plan = micro_batch_plan(seqs[:2], 4, 2, torch.Generator().manual_seed(0), keep_trials_together=False)
    assert [any(micro) for micro in plan] == [False, False, True, True]
