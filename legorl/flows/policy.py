"""The policy as a proxy: a model directory served in this process (by the embedded engine, or by a
vLLM server: an existing one at ``upstream`` or one started here), or an external ``legorl
serve-proxy``. :func:`open_policy` builds any of them and closes it exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from legorl.core.errors import LegorlError
from legorl.engines.base import Engine
from legorl.engines.config import EngineSpec, SamplingConfig
from legorl.engines.watched import WatchedEngine
from legorl.proxy.clients import InProcessProxy, ProxyHandle, RemoteProxy
from legorl.proxy.limits import ProxyLimits

# Wraps loading the engine from a model directory (a caller's spinner, say).
Loading = Callable[[Path], AbstractContextManager[object]]


@dataclass(kw_only=True)
class PolicySpec(EngineSpec, SamplingConfig):
    """Where the policy is: ``model`` (served in this process by the :class:`EngineSpec`'s engine) or
    ``proxy_url``, exactly one; served here, every call samples at the :class:`SamplingConfig`'s
    temperature, whatever the harness asks (None: as it asks)."""

    model: Path | None = field(default=None, metadata={"help": (
        "Model directory: the embedded engine's weights, or a vLLM engine's tokenizer (and the weights of the "
        "vLLM server started here when there is no --upstream).")})
    proxy_url: str | None = field(default=None, metadata={"aliases": ["--proxy"], "help": (
        "URL of a running `legorl serve-proxy` (instead of --model).")})
    api_key: str | None = field(default=None, metadata={"help": "API key of the --proxy."})
    tokenizer: Path | None = None  # default: the model directory's
    engine_name: str | None = None  # the model name the proxy answers with (default: the engine's)
    max_context: int | None = None
    limits: ProxyLimits = field(default_factory=ProxyLimits)  # what each trial's session may hold

    def validate(self) -> None:
        if (self.model is None) == (self.proxy_url is None):
            raise LegorlError("give exactly one of --model DIR (served here) or --proxy URL")
        self.check()
        if self.proxy_url is not None and self.engine != "embedded":
            raise LegorlError("--engine serves --model here; a --proxy brings its own engine")


# The fields of PolicySpec a command that runs trials takes as options.
POLICY_FIELDS = ("model", "engine", "upstream", "proxy_url", "api_key")


@dataclass
class Policy:
    """An open policy: the proxy the trials talk to, and the engine behind it when it is ours."""

    proxy: ProxyHandle
    engine: WatchedEngine | None = None  # None: an external proxy's engine is not ours to watch

    def reload(self, checkpoint: Path) -> None:
        """Serve the weights at ``checkpoint`` from now on (in-flight calls finish on the old ones)."""
        if self.engine is None:
            raise LegorlError("cannot load a checkpoint into an external proxy's engine")
        asyncio.run(self.engine.load_weights(str(checkpoint)))


def _engine(spec: PolicySpec, model: Path) -> Engine:
    if spec.engine == "vllm":
        from legorl.engines.vllm_server import vllm_engine

        return vllm_engine(model, spec.upstream, name=spec.engine_name, tokenizer=spec.tokenizer,
                           max_context=spec.max_context, reload_tolerance=spec.reload_tolerance)
    from legorl.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(model, name=spec.engine_name, max_context=spec.max_context)


def require_model_dir(model: Path) -> None:
    if not (model / "config.json").exists():
        raise LegorlError(f"--model {model}: not a model directory (no config.json)")


@contextlib.contextmanager
def open_policy(spec: PolicySpec, *, loading: Loading | None = None) -> Iterator[Policy]:
    """The policy of ``spec``, served until the block ends; then the proxy and the engine are closed."""
    spec.validate()
    if spec.proxy_url is not None:
        with RemoteProxy(spec.proxy_url, spec.api_key, limits=spec.limits) as remote:
            yield Policy(remote)
        return
    assert spec.model is not None
    with loading(spec.model) if loading is not None else contextlib.nullcontext():
        engine = _engine(spec, spec.model)
    try:
        with InProcessProxy(engine, str(spec.tokenizer or spec.model), temperature=spec.temperature,
                            limits=spec.limits) as proxy:
            yield Policy(proxy, proxy.engine)
    except BaseException:
        with contextlib.suppress(Exception):  # the failure that got us here is the one to report
            asyncio.run(engine.close())
        raise
    asyncio.run(engine.close())
