"""Shared helpers for the service tests: the three services in process on port 0, real channels.

What is here (import what you need; pytest picks up the fixtures a test module imports):

* `tiny_trunk()`, `tiny_draft_module()`, `tiny_tokenizer()`: the random tiny model of
  `services.app` (docs/model.md §13 config, max_seq_len 256, fixed seed), loaded once per process;
  `bundled_trunk(numerics)`, `bundled_draft_module()`: the bundled trained model
  (assets/dspark-small, `BUNDLED`), loaded once per process, for `astart_stack(model="bundled")`.
* `ServiceLoop` / `service_loop()`: one asyncio event loop in a daemon thread for the whole
  test process. Servers, channels and clients all live on it; a synchronous test calls
  `loop.run(coro, timeout_s)`, which raises TimeoutError (and cancels the coroutine) when the
  deadline passes, so nothing hangs.
* `start_stack(...)` -> `ServiceStack`: a verifier and (optionally) a drafter server over
  fresh engines on the shared model, and gateways started lazily per verify mode
  (`stack.gateway("sequential" | "batched")`). Drafters: "oracle" (the live oracle drafter:
  the target's own greedy continuation, whole blocks accepted unless `corrupt_every` > 0),
  "dspark" (the DSpark module with random weights) or "none". Gate costs are pinned
  (`GateConfig()` defaults, `configured` costs) so outputs are deterministic.
* `stack.generate(request, verify_mode)` -> `Generation` over gRPC;
  `stack.local_generate(request, verify_mode)` -> `Generation` from the same scheduler code
  run in process over `LocalVerifierSession` / `LocalDrafterSession` on the same engines.
* `stack.wait_idle()`: polls both backends' Info `open_sessions` and the engines'
  `num_sessions` until all are zero (bounded wait), returning what it saw last.
* `gen_request(...)`: a `GenerateRequest` with the suite's defaults (ignore_eos, greedy).
* Fixtures (module scope): `oracle_stack`, `dspark_stack`.

Every RPC here carries a deadline (`RPC_TIMEOUT_S` unless given).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Sequence

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import (common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc,
                             verifier_pb2_grpc)
from services.app import (drafter_engine, load_drafter, load_trunk, start_drafter, start_gateway,
                          start_verifier, verifier_engine)
from verifier_fixtures import loop_of
from services.common.server import RunningServer, channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.backends import Backends, LocalDrafterSession, LocalVerifierSession
from services.gateway.gate import GateConfig
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.gateway.servicer import spec_stats
from services.gateway.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

RPC_TIMEOUT_S = 60.0     # deadline of one Generate / Session / Info call
RUN_TIMEOUT_S = 120.0    # deadline of one `ServiceLoop.run`
SPEC = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
        "gated": gateway_pb2.SPEC_MODE_GATED, "default": gateway_pb2.SPEC_MODE_DEFAULT}
_SPEC_NAME = {v: k for k, v in SPEC.items()}
DRAFTERS = ("oracle", "dspark", "none")
MODELS = ("tiny", "bundled")
BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dspark-small"  # the bundled trained model


# ---------------------------------------------------------------------------- the model
@functools.lru_cache(maxsize=None)
def tiny_trunk():
    """The random tiny trunk (shared read-only by every engine in the process)."""
    return load_trunk(None)


@functools.lru_cache(maxsize=None)
def exact_trunk():
    """The random tiny trunk in exact verify numerics (a verifier whose batched verify is
    bitwise plain decode; shared read-only)."""
    return load_trunk(None, verify_numerics="exact")


@functools.lru_cache(maxsize=None)
def tiny_draft_module():
    """The DSpark module of the random tiny model (random weights, confidence head present)."""
    return load_drafter(None)


@functools.lru_cache(maxsize=None)
def bundled_trunk(verify_numerics: str = "fast"):
    """The bundled model's trunk (assets/dspark-small, fp32 on the CPU) in `verify_numerics`
    ("fast" | "exact"); shared read-only. Raises what `load_trunk` raises (a missing checkpoint)."""
    return load_trunk(str(BUNDLED), verify_numerics=verify_numerics)


@functools.lru_cache(maxsize=None)
def bundled_draft_module():
    """The bundled model's trained DSpark module (confidence head present); shared read-only."""
    return load_drafter(str(BUNDLED))


def tiny_tokenizer() -> ByteTokenizer:
    """The gateway's tokenizer for the random model (no tokenizer.json: bytes <-> ids 2..257)."""
    cfg = tiny_trunk().cfg
    return ByteTokenizer(cfg.vocab_size, cfg.eos_token_id)


def block_size() -> int:
    return tiny_trunk().cfg.dspark_block_size


# ---------------------------------------------------------------------------- the loop
class ServiceLoop:
    """An asyncio loop in a daemon thread; `run(coro, timeout_s)` runs a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="service-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable, timeout_s: float = RUN_TIMEOUT_S) -> Any:
        """Run `coro` on the loop and return its result.

        Raises:
            TimeoutError: it did not finish within timeout_s (it is cancelled).
            whatever the coroutine raised.
        """
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout_s:g} s") from None


_LOOP: ServiceLoop | None = None
_LOOP_LOCK = threading.Lock()


def service_loop() -> ServiceLoop:
    """The process-wide ServiceLoop (created on first use, lives until the process exits)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = ServiceLoop()
        return _LOOP


# ---------------------------------------------------------------------------- requests
def gen_request(prompt: str = "", *, ids: Sequence[int] = (), max_tokens: int = 16, spec: str = "always",
            stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (), ignore_eos: bool = True,
            temperature: float = 0.0) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest; `spec` is "off" | "always" | "gated" | "default". eos is ignored by
    default so that lengths do not depend on where the random model happens to emit it."""
    return gateway_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=list(ids), max_tokens=max_tokens, spec=SPEC[spec],
        stop_token_ids=list(stop_token_ids), stop=list(stop), ignore_eos=ignore_eos, temperature=temperature)


@dataclass
class Generation:
    """One generation as the client saw it.

    chunks: token ids of each streamed message (the final message's included, often empty);
    deltas: text_delta of each message; final: the final GenerateResponse (None if the
    stream ended without one).
    """

    chunks: list[list[int]] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    final: gateway_pb2.GenerateResponse | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c]

    @property
    def streamed_text(self) -> str:
        """The deltas concatenated (must equal final.text)."""
        return "".join(self.deltas)

    @property
    def finish_reason(self) -> str:
        return self.final.finish_reason

    @property
    def stats(self) -> gateway_pb2.SpecStats:
        return self.final.spec_stats

    def add(self, msg: gateway_pb2.GenerateResponse) -> None:
        self.chunks.append(list(msg.token_ids))
        self.deltas.append(msg.text_delta)
        if msg.finished:
            self.final = msg


async def collect(stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest,
                  timeout_s: float = RPC_TIMEOUT_S) -> Generation:
    """Stream one Generate to its end. Raises grpc.aio.AioRpcError on a failed call."""
    gen = Generation()
    async for msg in stub.Generate(req, timeout=timeout_s):
        gen.add(msg)
    return gen


def spec_counts(stats: gateway_pb2.SpecStats) -> dict:
    """The integer counters of a SpecStats (what two equal runs must share)."""
    return {f: getattr(stats, f) for f in ("rounds", "drafted", "submitted", "accepted", "margin_skipped_rounds",
                                          "truncated_rounds", "skipped_after_draft", "plain_rounds",
                                          "drafter_failed")}


# ---------------------------------------------------------------------------- the services
@dataclass
class GatewayHandle:
    """A running gateway: its server, scheduler (process stats), backend channels and a client stub."""

    server: RunningServer
    scheduler: Scheduler
    backends: Backends
    channel: grpc.aio.Channel
    stub: gateway_pb2_grpc.GatewayStub

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def close(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.backends.close()


class ServiceStack:
    """A verifier and a drafter server (see `start_stack`) plus gateways by verify mode.

    Attributes: loop, drafter_kind, verifier_engine, drafter_engine (None for "none"),
    verifier / drafter (RunningServer), verifier_stub / drafter_stub (direct backend stubs on
    the stack's own channels), gate_config, provider, checkpoint (the model folder whose
    tokenizer.json the gateways load; None: the byte tokenizer of the random model).
    """

    def __init__(self, loop: ServiceLoop, drafter_kind: str, verifier_engine, drafter_engine,
                 verifier: RunningServer, drafter: RunningServer | None, gate_config: GateConfig,
                 provider: TracerProvider | None, checkpoint: Path | None = None):
        self.loop, self.drafter_kind = loop, drafter_kind
        self.verifier_engine, self.drafter_engine = verifier_engine, drafter_engine
        self.verifier, self.drafter = verifier, drafter
        self.gate_config, self.provider, self.checkpoint = gate_config, provider, checkpoint
        self._gateways: dict[tuple, GatewayHandle] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.verifier_stub = verifier_pb2_grpc.VerifierStub(self._channel(self.verifier_target))
        self.drafter_stub = (drafter_pb2_grpc.DrafterStub(self._channel(self.drafter_target))
                             if drafter is not None else None)

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(target, options=channel_options())
        self._channels.append(ch)
        return ch

    @property
    def verifier_target(self) -> str:
        return f"127.0.0.1:{self.verifier.port}"

    @property
    def drafter_target(self) -> str:
        return f"127.0.0.1:{self.drafter.port}" if self.drafter is not None else ""

    # ------------------------------------------------------------------ gateways
    def settings(self, verify_mode: str = "sequential", **overrides) -> GatewaySettings:
        """GatewaySettings pointing at this stack's backends (overrides: any GatewaySettings field)."""
        values = dict(verifier_target=self.verifier_target, drafter_target=self.drafter_target,
                      verify_mode=verify_mode, cost_mode="configured", startup_timeout_s=10.0)
        values.update(overrides)
        return GatewaySettings(**values)

    async def start_gateway(self, verify_mode: str = "sequential", recorder: list | None = None,
                            **overrides) -> GatewayHandle:
        """A new gateway over this stack's backends (the caller closes it with `close()`)."""
        server, scheduler, backends = await start_gateway(
            self.settings(verify_mode, **overrides), self.gate_config, provider=self.provider, recorder=recorder,
            checkpoint=self.checkpoint)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=channel_options())
        return GatewayHandle(server, scheduler, backends, channel, gateway_pb2_grpc.GatewayStub(channel))

    async def agateway(self, verify_mode: str = "sequential") -> GatewayHandle:
        """The stack's shared gateway for `verify_mode` (started on first use, closed with the stack)."""
        key = (verify_mode,)
        if key not in self._gateways:
            self._gateways[key] = await self.start_gateway(verify_mode)
        return self._gateways[key]

    def gateway(self, verify_mode: str = "sequential") -> GatewayHandle:
        return self.loop.run(self.agateway(verify_mode))

    # ------------------------------------------------------------------ generations
    async def agenerate(self, req: gateway_pb2.GenerateRequest, verify_mode: str = "sequential",
                        timeout_s: float = RPC_TIMEOUT_S) -> Generation:
        gw = await self.agateway(verify_mode)
        return await collect(gw.stub, req, timeout_s)

    def generate(self, req: gateway_pb2.GenerateRequest, verify_mode: str = "sequential",
                 timeout_s: float = RPC_TIMEOUT_S) -> Generation:
        """One generation through the gateway (gRPC end to end)."""
        return self.loop.run(self.agenerate(req, verify_mode, timeout_s), timeout_s + 10)

    def local_scheduler(self, verify_mode: str = "sequential") -> Scheduler:
        """A Scheduler configured like the stack's gateways, for in-process runs."""
        cfg = self.verifier_engine.cfg
        confidence = (self.drafter_engine is not None and self.drafter_engine.identity()["confidence_head"])
        limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, confidence)
        return Scheduler(limits, self.tokenizer(), self.gate_config, verify_mode, "configured")

    def tokenizer(self) -> Tokenizer:
        """The gateways' tokenizer: the checkpoint's tokenizer.json, else the byte tokenizer."""
        cfg = self.verifier_engine.cfg
        return load_tokenizer(self.checkpoint, cfg.vocab_size, cfg.eos_token_id)

    async def alocal_generate(self, req: gateway_pb2.GenerateRequest, verify_mode: str = "sequential") -> Generation:
        sched = self.local_scheduler(verify_mode)
        p = sched.params(req.prompt, list(req.prompt_token_ids), req.max_tokens, _SPEC_NAME[req.spec]
                         if req.spec != gateway_pb2.SPEC_MODE_DEFAULT else "", req.temperature,
                         list(req.stop_token_ids), list(req.stop), req.ignore_eos)
        verifier = LocalVerifierSession(loop_of(self.verifier_engine))
        drafter = LocalDrafterSession(self.drafter_engine) if self.drafter_engine is not None else None
        gen = Generation()
        try:
            async for ev in sched.generate(p, verifier, drafter):
                if isinstance(ev, FinalEvent):
                    gen.add(gateway_pb2.GenerateResponse(
                        text_delta=ev.text_delta, finished=True, finish_reason=ev.finish_reason,
                        usage=gateway_pb2.Usage(prompt_tokens=ev.prompt_tokens,
                                                completion_tokens=ev.completion_tokens),
                        spec_stats=spec_stats(ev.counters), text=ev.text + ev.text_delta))
                else:
                    gen.add(gateway_pb2.GenerateResponse(token_ids=ev.token_ids, text_delta=ev.text_delta))
        finally:
            await verifier.close()
            if drafter is not None:
                await drafter.close()
        return gen

    def local_generate(self, req: gateway_pb2.GenerateRequest, verify_mode: str = "sequential") -> Generation:
        """The same generation through the in-process scheduler over this stack's engines."""
        return self.loop.run(self.alocal_generate(req, verify_mode))

    # ------------------------------------------------------------------ sessions
    async def aopen_sessions(self) -> dict[str, int]:
        """Open sessions as each backend reports them (Info) and as the engines count them."""
        out = {"verifier_info": (await self.verifier_stub.Info(common_pb2.InfoRequest(), timeout=5)).open_sessions,
               "verifier_engine": self.verifier_engine.num_sessions}
        if self.drafter_stub is not None:
            out["drafter_info"] = (await self.drafter_stub.Info(common_pb2.InfoRequest(), timeout=5)).open_sessions
            out["drafter_engine"] = self.drafter_engine.num_sessions
        return out

    async def await_idle(self, timeout_s: float = 15.0) -> dict[str, int]:
        """Poll `aopen_sessions` until every count is 0 or `timeout_s` passes; returns the last counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = await self.aopen_sessions()
            if not any(counts.values()) or time.monotonic() > deadline:
                return counts
            await asyncio.sleep(0.05)

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, int]:
        return self.loop.run(self.await_idle(timeout_s), timeout_s + 20)

    # ------------------------------------------------------------------ shutdown
    async def aclose(self) -> None:
        for gw in self._gateways.values():
            await gw.close()
        self._gateways.clear()
        for ch in self._channels:
            await ch.close()
        for s in (self.drafter, self.verifier):
            if s is not None:
                await s.stop(0)

    def close(self) -> None:
        self.loop.run(self.aclose(), 30)


async def astart_stack(drafter: str = "oracle", *, verifier_max_sessions: int | None = 16,
                       drafter_max_sessions: int | None = 16, corrupt_every: int = 0,
                       provider: TracerProvider | None = None, gate_config: GateConfig | None = None,
                       loop: ServiceLoop | None = None, verify_numerics: str = "fast",
                       model: str = "tiny") -> ServiceStack:
    """Start a verifier and a drafter (`drafter`: "oracle" | "dspark" | "none") on port 0 over new
    engines on the shared model (`model`: "tiny", the random tiny model, or "bundled",
    assets/dspark-small with its tokenizer). verify_numerics "exact": the verifier runs the
    exact trunk (the oracle still drafts from the fast one). A max_sessions of None sizes it
    from memory. Must run on `loop` (default: the process-wide one).
    Raises ValueError naming an unknown drafter or model."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter={drafter!r}: must be one of {DRAFTERS}")
    if model not in MODELS:
        raise ValueError(f"model={model!r}: must be one of {MODELS}")
    bundled = model == "bundled"
    trunk = bundled_trunk() if bundled else tiny_trunk()
    verifying = (bundled_trunk("exact") if bundled else exact_trunk()) if verify_numerics == "exact" else trunk
    v_engine = verifier_engine(verifying, BackendSettings(max_sessions=verifier_max_sessions,
                                                      verify_numerics=verify_numerics))
    verifier = await start_verifier(v_engine, provider=provider)
    d_engine, d_server = None, None
    if drafter != "none":
        d_settings = BackendSettings(max_sessions=drafter_max_sessions)
        if drafter == "oracle":
            d_engine = drafter_engine(trunk, oracle=True, settings=d_settings, corrupt_every=corrupt_every)
        else:
            d_engine = drafter_engine(bundled_draft_module() if bundled else tiny_draft_module(), settings=d_settings)
        d_server = await start_drafter(d_engine, provider=provider)
    return ServiceStack(loop or service_loop(), drafter, v_engine, d_engine, verifier, d_server,
                        gate_config or GateConfig(), provider, BUNDLED if bundled else None)


def start_stack(drafter: str = "oracle", **kwargs) -> ServiceStack:
    """Synchronous `astart_stack` on the process-wide loop (see its arguments)."""
    loop = kwargs.pop("loop", None) or service_loop()
    return loop.run(astart_stack(drafter, loop=loop, **kwargs), 60)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def oracle_stack():
    """Verifier + live oracle drafter (no corruption: every draft is the target's own greedy choice)."""
    stack = start_stack("oracle")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def dspark_stack():
    """Verifier + DSpark drafter with the tiny model's random weights (drafts mostly rejected)."""
    stack = start_stack("dspark")
    yield stack
    stack.close()


def start_exact_stack(drafter: str, model: str = "tiny") -> ServiceStack:
    """An exact-numerics verifier beside `drafter` ("oracle": the live oracle corrupting every
    third draft slot, so drafts are both accepted and rejected; "dspark"), memory-sized limits,
    on `model` ("tiny" | "bundled", see `astart_stack`)."""
    return start_stack(drafter, verify_numerics="exact", corrupt_every=3 if drafter == "oracle" else 0,
                       verifier_max_sessions=None, drafter_max_sessions=None, model=model)


@pytest.fixture(scope="module")
def oracle_exact():
    """`start_exact_stack("oracle")` for a module."""
    stack = start_exact_stack("oracle")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def dspark_exact():
    """`start_exact_stack("dspark")` for a module."""
    stack = start_exact_stack("dspark")
    yield stack
    stack.close()
