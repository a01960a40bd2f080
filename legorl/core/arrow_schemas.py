"""The Arrow schemas of the four shard kinds and of the structs inside their rows.

:mod:`legorl.core.schemas` is where stages get them (with the row classes and keys); each field here
matches a field of a row class there (``tests/test_schemas_agree.py`` checks it).
"""

from __future__ import annotations

import pyarrow as pa

SEGMENT_TYPE = pa.struct(
    [
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        # 1 only on tokens the policy sampled; prompt and tool output tokens are 0.
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        # logprob of each token under the distribution it was sampled from (0.0 where mask is 0).
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        # experts each token was routed to, flattened row-major from [tokens, layers, top_k].
        pa.field("routed_experts", pa.list_(pa.int16())),
        pa.field("routing_layers", pa.int32()),
        pa.field("routing_top_k", pa.int32()),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("parent", pa.int32()),  # index of the segment this one forked from
    ]
)

CALL_TYPE = pa.struct(
    [
        pa.field("index", pa.int32()),
        pa.field("api", pa.string()),  # legorl.proxy.core.Api: "openai" (chat completions) | "responses" | "anthropic"
        pa.field("stream", pa.bool_()),
        pa.field("segment", pa.int32()),
        pa.field("started_at", pa.float64()),
        pa.field("latency_s", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("new_prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("parse_error", pa.string()),
        pa.field("budget_stop", pa.string()),  # a BudgetStop
        # The distribution the call sampled from, after the proxy's overrides (null for a budget stop,
        # which samples nothing, and in shards written before they were recorded). temperature 0 is
        # greedy (its logprobs are those at temperature 1); top_k 0 = off.
        pa.field("temperature", pa.float64()),
        pa.field("top_p", pa.float64()),
        pa.field("top_k", pa.int64()),
        # The policy version whose weights sampled the call (legorl.trials.provenance): 0 = the initial model, +1
        # per weight load; null for a budget stop, behind an engine whose loads legorl does not see, and in
        # shards written before it was recorded (unknown).
        pa.field("policy_version", pa.int64()),
    ]
)

TIMINGS_TYPE = pa.struct(
    [
        pa.field("sandbox_s", pa.float64()),
        pa.field("agent_s", pa.float64()),
        pa.field("model_s", pa.float64()),
        pa.field("patch_s", pa.float64()),
        pa.field("total_s", pa.float64()),
    ]
)

# What produced a trial row (legorl.trials.fingerprints): two rows alike here ran the same harness build, config,
# legorl and model. Versions are the installed package's; config and model revision are sha256 prefixes
# ("sha256:<16 hex>") of the effective harness config and of the model directory's files; a model the
# rollout does not load itself (an external proxy) is "served:<name>".
TRIAL_FINGERPRINT_TYPE = pa.struct(
    [
        pa.field("harness", pa.string()),
        pa.field("harness_version", pa.string()),
        pa.field("harness_config", pa.string()),
        pa.field("legorl_version", pa.string()),
        pa.field("model_revision", pa.string()),
    ]
)

# What a trial cost (legorl.trials.fingerprints.trial_cost): sandbox_s the wall time its sandboxes lived, over every
# attempt; engine_s the time the engine took on its calls (their latencies); tokens summed over its calls,
# cached = prompt tokens the proxy reused from the session's history (prompt_tokens - new_prompt_tokens, a
# prefix an engine with prefix caching need not recompute); retries = attempts - 1.
TRIAL_COST_TYPE = pa.struct(
    [
        pa.field("sandbox_s", pa.float64()),
        pa.field("engine_s", pa.float64()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("sampled_tokens", pa.int64()),
        pa.field("cached_tokens", pa.int64()),
        pa.field("retries", pa.int32()),
    ]
)

# What produced a grade row: the image it graded in and podman's id of it ("sha256:..."), the hidden-test
# command as run, and the grader's version ("<legorl version>+g<GRADER_VERSION>.<digest of the sandboxed code>").
GRADE_FINGERPRINT_TYPE = pa.struct(
    [
        pa.field("image", pa.string()),
        pa.field("image_digest", pa.string()),
        pa.field("test_command", pa.string()),
        pa.field("grader_version", pa.string()),
    ]
)

TEST_RESULT_TYPE = pa.struct(
    [
        pa.field("name", pa.string()),
        pa.field("kind", pa.string()),  # FAIL_TO_PASS | PASS_TO_PASS
        pa.field("status", pa.string()),  # PASSED FAILED ERROR SKIPPED XFAIL MISSING
        pa.field("passed", pa.bool_()),
    ]
)

_str = pa.string()
_strings = pa.list_(pa.string())

TASKS_SCHEMA = pa.schema(
    [
        pa.field("instance_id", _str, nullable=False),
        pa.field("repo", _str),
        pa.field("base_commit", _str),
        pa.field("patch", _str),
        pa.field("test_patch", _str),
        pa.field("problem_statement", _str),
        pa.field("hints_text", _str),
        pa.field("created_at", _str),
        pa.field("version", _str),
        pa.field("FAIL_TO_PASS", _strings),
        pa.field("PASS_TO_PASS", _strings),
        pa.field("environment_setup_commit", _str),
        pa.field("image", _str),
        pa.field("repo_source", _str),  # absolute path of a git bundle or directory
        pa.field("repo_ref", _str),
        pa.field("test_command", _str),
        pa.field("log_parser", _str),
        # JSON object: every test's status when the gold patch is graded (the reference a trial must reach)
        pa.field("gold_statuses", _str),
        # JSON object: each test the task check saw change status across runs of the same patch (so left out of
        # FAIL_TO_PASS / PASS_TO_PASS) -> {"gold": [its status per gold run], "empty": [per empty-patch run]}
        pa.field("flaky_tests", _str),
        # how the task is graded: null = SWE-style hidden tests; "harbor" = a Harbor task's tests/test.sh, whose
        # files (base64 of a tar.gz) are hidden_tests, run in workdir (the image's WORKDIR) under test_timeout
        pa.field("grader", _str),
        pa.field("hidden_tests", _str),
        pa.field("workdir", _str),
        pa.field("test_timeout", pa.float64()),
    ]
)

ROLLOUTS_SCHEMA = pa.schema(
    [
        pa.field("trial_id", _str, nullable=False),
        pa.field("task_id", _str, nullable=False),
        pa.field("harness", _str, nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("group_id", _str, nullable=False),
        pa.field("model", _str),
        pa.field("outcome", _str, nullable=False),
        pa.field("infra_failure", pa.bool_(), nullable=False),
        pa.field("error", _str),
        pa.field("exit_code", pa.int32()),
        pa.field("attempts", pa.int32()),
        pa.field("patch", _str),
        pa.field("segments", pa.list_(SEGMENT_TYPE)),
        pa.field("calls", pa.list_(CALL_TYPE)),
        pa.field("messages", _str),  # JSON: the conversation as the harness last sent it
        pa.field("timings", TIMINGS_TYPE),
        pa.field("started_at", pa.float64()),
        pa.field("finished_at", pa.float64()),
        pa.field("fingerprint", TRIAL_FINGERPRINT_TYPE),
        pa.field("cost", TRIAL_COST_TYPE),
    ]
)

GRADES_SCHEMA = pa.schema(
    [
        pa.field("trial_id", _str, nullable=False),
        pa.field("task_id", _str, nullable=False),
        pa.field("harness", _str),
        pa.field("step", pa.int32()),
        pa.field("reward", pa.float64()),  # null when grading itself failed
        pa.field("resolved", pa.bool_()),
        pa.field("resolution", _str),
        pa.field("status", _str, nullable=False),
        pa.field("infra_failure", pa.bool_(), nullable=False),
        pa.field("error", _str),
        pa.field("tests", pa.list_(TEST_RESULT_TYPE)),
        pa.field("dropped_paths", _strings),
        pa.field("apply_method", _str),
        # lines the patch added that reach into the test runner or the interpreter ("path:line: why: code")
        pa.field("suspicious", _strings),
        # the grade's canaries ("test name: status"), from the runs that mutated them: tests whose expectation was
        # mutated, which every patch must fail; one that passed makes the grade "tampered". Empty when none was made
        pa.field("canaries", _strings),
        # the control run (the gold or empty patch, same conditions) behind an infra / tests_errored verdict
        pa.field("control", _str),
        # grade --confirm, for a grade of 1: true when a fresh rerun of the same patch scored 1 too; false when it did
        # not (the reward is then 0: a pass that does not reproduce earns nothing); null when not asked or not a 1
        pa.field("confirmed", pa.bool_()),
        # grade --verifier: the plug-in (package.module:function) whose reward is in `reward`, the hidden tests' own
        # reward before it, and the reasons it gave; null / empty without one (legorl.grading.verifier)
        pa.field("verifier", _str),
        pa.field("tests_reward", pa.float64()),
        pa.field("verifier_reasons", _strings),
        pa.field("duration_s", pa.float64()),
        pa.field("log", _str),
        pa.field("fingerprint", GRADE_FINGERPRINT_TYPE),
    ]
)

METRICS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("key", _str, nullable=False),
        pa.field("value", pa.float64()),
        pa.field("harness", _str),
        pa.field("stage", _str),
        pa.field("time", pa.float64()),
    ]
)
