"""What forks cost: segment tokens per sampled token and the shared-prefix share of a trial
(``legorl.trials.costs.fork_cost``), where ``legorl inspect`` and the dashboard show them, and the trainer's
prefix sharing over forks of forks and sub-agents (``legorl.training.packing.fork_clusters``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from monitor_runs import make_run
from starlette.testclient import TestClient

from legorl.core import shards
from legorl.core.schemas import Kind, Segment, TrialRow
from legorl.monitor.dashboard.server import create_app
from legorl.monitor.inspect import inspect_path
from legorl.training.packing import fork_clusters, pack
from legorl.trials.costs import fork_cost, segments_fork_cost


def _seg(ids: list[int], sampled: int, reason: str = "main", parent: int | None = None) -> Segment:
    mask = [0] * (len(ids) - sampled) + [1] * sampled
    return Segment(ids, mask, [-0.5 * m for m in mask], reason=reason, parent=parent)


PROMPT = list(range(1000, 1100))  # a system prompt and tools: 100 tokens


def _trial() -> list[Segment]:
    """main; a fork of main sharing 130 tokens; a fork of the fork sharing 150 with it (130 with main);
    a sub-agent sharing 2 tokens (a header) with all of them."""
    main = PROMPT + list(range(30)) + list(range(500, 540))  # 170 tokens, the last 40 sampled
    fork = main[:130] + list(range(600, 650))  # 180, 20 sampled
    fork2 = fork[:150] + list(range(700, 710))  # 160, 10 sampled
    sub = PROMPT[:2] + list(range(2000, 2058))  # 60, 8 sampled
    return [_seg(main, 40), _seg(fork, 20, "rewrite", 0), _seg(sub, 8, "subagent", 0), _seg(fork2, 10, "rewrite", 1)]


def test_fork_cost_counts_the_longest_prefix_with_any_earlier_segment() -> None:
    cost = segments_fork_cost(_trial())
    # main 0, the fork 130 (with main), the sub-agent 2, the fork of the fork 150 (with the fork, not main's 130)
    assert (cost.segments, cost.segment_tokens, cost.sampled_tokens, cost.shared_tokens) == (4, 570, 78, 282)
    assert cost.tokens_per_sampled == round(570 / 78, 2) and cost.shared_share == round(282 / 570, 4)
    assert fork_cost([], 0).to_dict() == {"segments": 0, "segment_tokens": 0, "sampled_tokens": 0, "shared_tokens": 0,
                                          "tokens_per_sampled": None, "shared_share": None}
    assert fork_cost([[1, 2, 3]], 1).shared_tokens == 0
    assert fork_cost([[1, 2, 3], [1, 2, 3]], 2).shared_tokens == 3  # a retried request: all of it


def test_a_subagent_sharing_a_header_does_not_shrink_the_forks_prefix() -> None:
    """The forks of main keep their common prefix (130 tokens) although a sub-agent shares the first
    tokens of every row: it is a document of its own (the first-fit rule before put every row in one
    document sharing those 2 tokens)."""
    rows = [torch.tensor(s.token_ids) for s in _trial()]
    clusters = fork_clusters(rows, [7] * 4, [None] * 4, min_shared=2)
    # 2 x 130 saved beats 150 (the fork and its fork alone) and 3 x 2 (everything together)
    assert clusters == [(130, [0, 1, 3]), (60, [2])]
    # rows of other trials never share, whatever their tokens
    assert fork_clusters(rows[:2], [1, 2], [None, None]) == [(170, [0]), (180, [1])]
    assert fork_clusters(rows[:2], None, [None, None]) == [(170, [0]), (180, [1])]


def test_the_best_split_of_forks_by_dynamic_programming() -> None:
    base = list(range(100))
    # four forks: two pairs sharing 90 tokens each, all four sharing only 20
    rows = [torch.tensor(base[:20] + [k] * 70 + list(range(200 + 10 * j, 210 + 10 * j))) for k in (1, 2) for j in (0, 1)]
    clusters = fork_clusters(rows, [0] * 4, [None] * 4)
    assert clusters == [(90, [0, 1]), (90, [2, 3])]  # 2 x 90 saved, not 3 x 20
    # MoE: a prefix is shared only where the routing agrees too
    routing = [torch.zeros(100, 2, 2, dtype=torch.long) for _ in range(4)]
    routing[1][50:] = 1
    same_tokens = [torch.tensor(base)] * 2
    assert fork_clusters(same_tokens, [0, 0], routing[:2]) == [(50, [0, 1])]


def test_packing_a_forked_trial_keeps_every_token_at_its_position() -> None:
    rows = [torch.tensor(s.token_ids) for s in _trial()]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    packed = pack(ids, mask, [0] * 4)
    assert packed.length == 570 - 2 * 130
    for i, r in enumerate(rows):
        at = packed.source[i, : len(r)]
        assert torch.equal(packed.input_ids[0, at], r)
        assert torch.equal(packed.position_ids[0, at], torch.arange(len(r)))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_run(tmp_path_factory.mktemp("forks") / "run", steps=1)
    forked = TrialRow.new("forky__task-1", "claude-code", 0, 0, outcome="submitted", segments=_trial())
    shards.write(root / "rollouts", Kind.ROLLOUTS, [forked])
    return root


def test_inspect_reports_fork_costs(run: Path) -> None:
    [rollouts] = [d for d in inspect_path(run)["datasets"] if d["name"] == "rollouts"]
    figures = rollouts["breakdown"]["fork_costs"]
    rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    total = [segments_fork_cost(r.segments) for r in rows]
    tokens, sampled = sum(c.segment_tokens for c in total), sum(c.sampled_tokens for c in total)
    assert figures["segment_tokens_per_sampled"] == round(tokens / sampled, 2)
    assert figures["shared_share"] == round(sum(c.shared_tokens for c in total) / tokens, 4)
    heaviest = figures["heaviest"]
    assert 1 <= len(heaviest) <= 3 and all(h["segments"] > 1 for h in heaviest)
    ratios = [h["segment_tokens_per_sampled"] for h in heaviest]
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[0] == max(c.tokens_per_sampled or 0 for c in total if c.segments > 1)


def test_dashboard_trial_view_shows_fork_costs(run: Path) -> None:
    client = TestClient(create_app([run]))
    [row] = [r for r in shards.read_rows(run / "rollouts", Kind.ROLLOUTS) if r.task_id == "forky__task-1"]
    d = client.get("/api/trial", params={"run": 0, "id": row.trial_id}).json()
    assert d["fork_cost"] == segments_fork_cost(_trial()).to_dict()
    assert d["fork_cost"]["shared_tokens"] == 282
    static = Path(__file__).parents[1] / "legorl" / "monitor" / "dashboard" / "static" / "app.js"
    assert "d.fork_cost.tokens_per_sampled" in static.read_text()
