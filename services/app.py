"""Build and start the three services (used by `dspark serve`, tests and benchmarks).

Owns wiring: loading a model source into engines and starting each service's gRPC server
around them. It holds no serving logic (that is the engines' and the scheduler's) and never
reads the environment: every setting arrives as an argument (`services.settings` parses the
environment at the entry point), and an omitted one takes its dataclass default.

A model source is a checkpoint folder in the real layout (`dsv4.checkpoint`) or, with no
checkpoint, the random tiny model: `random_tiny_config()` (the docs/model.md §13 tiny config)
with fixed random weights (`TINY_SEED`), for smoke tests. Each service process loads only its
own consumer set: the verifier the trunk tensors, the drafter `mtp.*` + embed + head (the
oracle drafter the trunk).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc
import torch
from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2_grpc
from dsv4.config import ModelConfig, tiny_config
from dsv4.dspark import DSparkDraft, load_draft_module
from dsv4.init import random_weights
from dsv4.trunk import Trunk
from dsv4.settings import Settings as ModelSettings
from services.common.constraint import checkpoint_vocab
from services.common.limits import session_limit
from services.common.server import RunningServer, start_server
from services.common.settings import DEFAULT_MAX_CONNECTION_AGE_S, BackendSettings, GatewaySettings
from services.common.tls import TlsFiles
from services.drafter.engine import DrafterEngine
from services.drafter.live_oracle import DEFAULT_DOUBTFUL, LiveOracleDrafter
from services.drafter.servicer import DrafterServicer
from services.drafter.steps import DraftStepLoop, batchable as drafter_batchable
from services.gateway.auth import BearerTokenInterceptor
from services.gateway.costs import CostTracker
from services.gateway.gate import ENV_VARS as GATE_ENV_VARS, GateConfig
from services.gateway.load import VerifierLoad
from services.gateway.load_regime import ModelRegime
from services.gateway.profile import PROFILE_PROMPT
from services.gateway.scheduler import Scheduler
from services.gateway.backends import Backends
from services.gateway.servicer import GatewayServicer, connect_backends, measure_costs
from services.gateway.tokenizer import load_tokenizer
from services.gateway.warm import WarmStart
from services.verifier.batcher import DEFAULT_PREFILL_CHUNK, StepLoop, StepRecord
from services.verifier.engine import VerifierEngine, per_session_bytes
from services.common.alignment import make_alignment
from services.common.budget import StepBudget
from services.verifier.step_profile import StepProfileSettings, profile_steps
from services.verifier.step_table import LoadTracker
from services.verifier.servicer import VerifierServicer
from services.verifier.topk_diag import TopKDiagSettings, maybe_wrap

if TYPE_CHECKING:  # imports torch.distributed: loaded only when tp > 1
    from services.verifier.tp import TPSettings

TINY_SEED = 0
log = logging.getLogger("dspark.app")


def random_tiny_config() -> ModelConfig:
    """The tiny config with room for demo generations (max_seq_len 256)."""
    return tiny_config(max_seq_len=256)


def load_trunk(checkpoint: str | Path | None, dtype: torch.dtype = torch.float32, tp: int = 1,
               device: str = "cpu", verify_numerics: str = "fast", model: ModelSettings | None = None,
               tp_settings: TPSettings | None = None, topk: TopKDiagSettings | None = None) -> Trunk:
    """The verifier's trunk from a checkpoint folder, or the random tiny model when None.

    tp > 1 starts tp - 1 worker processes (`services.verifier.tp.start_tp_trunk`, deadlines
    `tp_settings`) and returns the rank-0 proxy, which `VerifierEngine` drives like a plain
    `Trunk`. verify_numerics "exact" (`Trunk`'s exact mode: batched verify bitwise equal to
    decode) is TP=1 only. model: the numerics switches (default `ModelSettings()`); topk: dump
    every forward's top-k logits (`services.verifier.topk_diag`; every TP rank its own file).
    device: "cpu" or "cuda:N" (`services.common.settings.parse_device`); TP=1 runs there and
    reads the checkpoint straight onto it, one decoded tensor at a time into the model
    (`Trunk.load_streamed`: never the model twice); TP > 1 on a GPU puts rank r on cuda:r.
    Raises:
        ValueError: exact numerics requested with tp > 1; what the checkpoint loader raises.
    """
    if tp > 1 and verify_numerics != "fast":
        raise ValueError(f"DSPARK_VERIFY_NUMERICS={verify_numerics!r} needs --tp 1: exact mode is not "
                         "implemented under tensor parallelism")
    model = ModelSettings() if model is None else model
    if tp > 1:
        from services.verifier.tp import start_tp_trunk
        cfg = random_tiny_config() if checkpoint is None else None
        weights = random_weights(cfg, "trunk", TINY_SEED) if checkpoint is None else str(checkpoint)
        return start_tp_trunk(cfg, weights, tp, dtype, device="cpu" if device == "cpu" else "cuda", settings=tp_settings, topk=topk,
                              deterministic_reduce=model.moe_deterministic_reduce,
                              kernels=model.kernel_config())
    if checkpoint is None:
        cfg = random_tiny_config()
        weights = random_weights(cfg, "trunk", TINY_SEED).items()
    else:  # one decoded tensor at a time, onto the device: never the model twice, never on the host
        from dsv4.checkpoint import stream_trunk_weights
        cfg, weights = stream_trunk_weights(checkpoint, dtype=_decode_dtype(dtype, device), device=device)
    trunk = Trunk(cfg, dtype=dtype, device=device, verify_numerics=verify_numerics,
                  deterministic_reduce=model.moe_deterministic_reduce, kernels=model.kernel_config())
    trunk.load_streamed(weights)
    return maybe_wrap(trunk, topk)


def _decode_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype a checkpoint's fp8 / fp4 tensors are decoded to: the model's own on a GPU
    (a decoded tensor, streamed into the model one at a time, then takes no more device memory
    than its parameter), fp32 on a CPU, the bits the CPU has always loaded (fp32 decode, then
    the model's cast)."""
    return torch.float32 if device == "cpu" else dtype


def load_drafter(checkpoint: str | Path | None, dtype: torch.dtype = torch.float32,
                 model: ModelSettings | None = None, device: str = "cpu") -> DSparkDraft:
    """The drafter's DSpark module from a checkpoint folder, or the random tiny model when None;
    `model`: the numerics switches (default `ModelSettings()`); device: "cpu" or "cuda:N",
    where the module lives (a checkpoint is read straight onto it, shard by shard).

    Raises:
        ValueError, CheckpointError: what `dsv4.dspark.load_draft_module` raises.
    """
    reduce = (ModelSettings() if model is None else model).moe_deterministic_reduce
    if checkpoint is not None:
        return load_draft_module(checkpoint, dtype=dtype, deterministic_reduce=reduce, device=device,
                                 decode_dtype=_decode_dtype(dtype, device))
    cfg = random_tiny_config()
    module = DSparkDraft(cfg, dtype=dtype, deterministic_reduce=reduce, device=device)
    module.load_weights(random_weights(cfg, "drafter", TINY_SEED))
    return module


async def start_verifier(engine: VerifierEngine, port: int = 0, default_mode: str = "batched",
                         provider: TracerProvider | None = None, host: str = "127.0.0.1",
                         credentials: grpc.ServerCredentials | None = None, tp: int = 1,
                         max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S, metrics=None,
                         prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                         step_profile: StepProfileSettings | None = None, gather_s: float = 0.0,
                         torch_threads: int | None = None, alignment: str = "gather") -> RunningServer:
    """Serve the Verifier over `engine` on host:port (0 = any free port); `default_mode` is the
    verify path of requests that name none; credentials: TLS (None = plaintext);
    max_connection_age_s: clients reconnect after it (s); metrics: a
    `services.common.metrics.VerifierMetrics` (None: none). Every session's forwards run in
    one batched step loop (`services.verifier.batcher`; under TP every rank runs the same
    batched step); prefill_chunk: the loop's most prompt tokens per step. The loop stops with the server; it keeps the load figures the gate prices drafts
    with (a step-time table and the committed tokens per ms, `services.verifier.step_table`).
    step_profile: time batch steps over dummy sessions before serving, seeding the step table
    (None: live steps alone fill it). gather_s: the loop's longest wait (s) before a step for
    the sessions the previous step answered (`services.common.schedule`; 0: none).
    torch_threads: torch intra-op threads of the step loop's thread (None: torch's default;
    `dspark serve` passes DSPARK_TORCH_THREADS, `services.common.threads`). alignment: how the
    loop gathers sessions before a step (STEP_ALIGNMENTS, `services.common.alignment`).
    Raises:
        RuntimeError: port not bound.
        ValueError: prefill_chunk not an integer >= 1, gather_s negative or not finite
            (named), a model the step loop cannot drive; what the model raises in the profile."""
    load = LoadTracker()
    steps = StepLoop(engine, None, prefill_chunk, gather_s, torch_threads)
    try:
        if step_profile is not None:  # before the hook: profile steps seed the table, they are not live load
            await asyncio.to_thread(profile_steps, steps, load, step_profile)
    except BaseException:
        steps.close()
        raise
    steps.on_step = _step_hook(load, metrics)
    steps.budget = StepBudget(load.prices)  # blocks that carry estimates are cut to what they admit
    # `rate` prices arrivals on the step table with the rows per session of the last batch step
    steps.schedule.alignment = make_alignment(alignment, gather_s, lambda: (load.prices()[0], steps.rows_per_session()))
    log.info("verifier: step alignment %s (DSPARK_STEP_ALIGNMENT; docs/simulate.md §6)", alignment)
    servicer = VerifierServicer(engine, default_mode, provider, tp, metrics, steps, load)
    running = await _serve_with_loop("dspark.v1.Verifier",
                                     lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
                                     steps, port, host, provider, credentials, max_connection_age_s)
    if hasattr(engine.model, "on_broken"):  # a TP driver: a failed worker leaves it refusing every call
        engine.model.on_broken = _health_when_broken(running, asyncio.get_running_loop())
    return running


def _health_when_broken(running: RunningServer, loop: asyncio.AbstractEventLoop) -> Callable[[str], None]:
    """A TP trunk's `on_broken` (called on the step loop's thread): log the reason and turn
    the server NOT_SERVING on its event loop."""
    def broken(why: str) -> None:
        log.error("verifier: the TP trunk is unusable (%s); health is NOT_SERVING, restart the verifier", why)
        asyncio.run_coroutine_threadsafe(running.not_serving(), loop)
    return broken


async def _serve_with_loop(service: str, add, steps, port: int, host: str, provider, credentials,
                           max_connection_age_s: float) -> RunningServer:
    """Start `service`'s server; the step loop `steps` (None: none) stops with it, and at once
    when the server cannot start. Raises RuntimeError: port not bound."""
    try:
        running = await start_server(service, add, port, host, provider, credentials=credentials,
                                     max_connection_age_s=max_connection_age_s)
    except BaseException:
        if steps is not None:
            steps.close()
        raise
    if steps is not None:
        running.on_stop.append(steps.close)
    return running


def _step_hook(load: LoadTracker, metrics) -> Callable[[StepRecord], None]:
    """The step loop's `on_step`: the load figures, then the metrics (when given)."""
    def on_step(step: StepRecord) -> None:
        load.record(step)
        if metrics is not None:
            metrics.record_step(step)
    return on_step


async def start_drafter(engine, port: int = 0, provider: TracerProvider | None = None,
                        host: str = "127.0.0.1", credentials: grpc.ServerCredentials | None = None,
                        max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S, metrics=None,
                        step_loop: bool = True, gather_s: float = 0.0,
                        torch_threads: int | None = None, vocab=None, mask_drafts: bool = True) -> RunningServer:
    """Serve the Drafter over `engine` (a `DrafterEngine` or an oracle drafter), as
    `start_verifier`; metrics: a `services.common.metrics.DrafterMetrics` (None: none).
    step_loop: run every session's commits and drafts in one batched step loop
    (`services.drafter.steps`) when the engine is a TP=1 `DrafterEngine`; False, or an
    oracle: one thread per call. The loop stops with the server. gather_s, torch_threads: as
    `start_verifier`'s. vocab: the `GrammarVocab` constrained sessions draft inside (None: the
    byte vocabulary); mask_drafts False drafts blind (benchmarks: acceptance without the mask).
    Raises RuntimeError: port not bound; ValueError: gather_s negative or not finite."""
    steps = None
    if step_loop and drafter_batchable(engine):
        steps = DraftStepLoop(engine, None if metrics is None else metrics.record_step, gather_s, torch_threads)
    servicer = DrafterServicer(engine, provider, metrics, steps, vocab, mask_drafts)
    return await _serve_with_loop("dspark.v1.Drafter",
                                  lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                                  steps, port, host, provider, credentials, max_connection_age_s)


async def start_gateway(settings: GatewaySettings, gate_config: GateConfig | None = None, port: int = 0,
                        provider: TracerProvider | None = None, checkpoint: str | Path | None = None,
                        recorder: list | None = None, host: str = "127.0.0.1",
                        backend_tls: TlsFiles | None = None, credentials: grpc.ServerCredentials | None = None,
                        metrics=None, max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S,
                        ) -> tuple[RunningServer, Scheduler, Backends]:
    """Connect to the backends (identity check), profile the round costs when
    `settings.cost_mode` is "measured" (`servicer.measure_costs`), then serve the Gateway.

    gate_config: the gate (None = `GateConfig()`'s defaults).
    backend_tls: the gateway's client certificate and the backends' CA (mTLS; None = plaintext).
    credentials: TLS of the client-facing port (None = plaintext). `settings.token`, when set,
    is required from every client call (`services.gateway.auth`).
    metrics: a `services.gateway.metrics.GatewayMetrics` the scheduler records into (None: none).
    max_connection_age_s: clients reconnect after it (s).
    Raises:
        IdentityMismatch: drafter and verifier serve different models.
        BackendError: the verifier is unreachable within the startup deadline.
        RuntimeError: the port could not be bound.
    """
    if backend_tls is None:
        backends = Backends(settings, provider)
    else:
        backends = Backends(settings, provider, backend_tls.channel_credentials(), backend_tls.channel_options())
    try:
        limits, identity = await connect_backends(backends)
    except BaseException:
        await backends.close()  # a refused pairing leaves no open channels behind
        raise
    gate_config = GateConfig() if gate_config is None else gate_config
    tokenizer = load_tokenizer(checkpoint, limits.vocab_size, limits.eos_token_id)
    costs = CostTracker(gate_config.cost_model(), {f: GATE_ENV_VARS[f] for f in settings.pinned_costs})
    if settings.cost_mode == "measured":
        try:
            await measure_costs(backends, limits, tokenizer.encode(PROFILE_PROMPT), costs)
        except BaseException:
            await backends.close()
            raise
    load = None
    if settings.cost_mode == "measured":  # the regime's and the step budget's table; configured costs keep none
        load = VerifierLoad(backends.verifier, settings.round_timeout_s)
        load.update(identity)
    regime = None
    if settings.regime:
        regime = ModelRegime(limits.block_size, lambda: None if load is None else load.table,
                             lambda: costs.model(settings.cost_mode))
    warm = WarmStart(settings.warm_max_weight) if settings.warm_start else None
    scheduler = Scheduler(limits, tokenizer, gate_config, settings.verify_mode, settings.cost_mode,
                          provider, recorder, metrics, costs, load, regime, warm,
                          jump_forward=settings.jump_forward, step_budget=settings.step_budget)
    log.info("gateway: step budget %s for gated generations (DSPARK_STEP_BUDGET; docs/gate.md §15)",
             settings.step_budget)
    servicer = GatewayServicer(scheduler, backends)
    auth = [BearerTokenInterceptor(settings.token)] if settings.token else []
    running = await start_server("dspark.v1.Gateway",
                                 lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
                                 port, host, provider, credentials=credentials, interceptors=auth,
                                 max_connection_age_s=max_connection_age_s)
    return running, scheduler, backends


def verifier_engine(model: Trunk, settings: BackendSettings | None = None,
                    available_bytes: int | None = None, vocab=None) -> VerifierEngine:
    """A `VerifierEngine` over `model` (a `Trunk`, TP proxy or top-k wrapper) with the
    session limit `services.common.limits.session_limit` chooses from `settings.max_sessions`
    (default `BackendSettings()`), the model's per-session bytes and `available_bytes`
    (memory available at start-up, bytes; None: unknown, the fallback limit); vocab: the
    grammar vocabulary of constrained sessions (`grammar_vocab`; None: the byte vocabulary).

    Raises:
        ValueError: not one session fits in the memory rule (`session_limit`).
    """
    settings = BackendSettings() if settings is None else settings
    limit = session_limit(per_session_bytes(model), settings.max_sessions, available_bytes)
    log.info("verifier: %d sessions at most (%s)", limit.limit, limit.rule)
    return VerifierEngine(model, max_sessions=limit.limit, limit_rule=limit.rule, vocab=vocab)


def grammar_vocab(checkpoint: str | Path | None, cfg):
    """The grammar vocabulary of a checkpoint, built on first use (a callable for
    `verifier_engine` / `start_drafter`): its tokenizer.json's, else the byte vocabulary."""
    return functools.cache(lambda: checkpoint_vocab(checkpoint, cfg.vocab_size, cfg.eos_token_id))


def drafter_engine(module_or_trunk, oracle: bool = False, settings: BackendSettings | None = None,
                   corrupt_every: int = 0, available_bytes: int | None = None,
                   doubtful: float = DEFAULT_DOUBTFUL):
    """The drafter's engine: a `DrafterEngine` over a DSpark module, or with `oracle` a
    `LiveOracleDrafter` over a trunk that corrupts one draft slot in `corrupt_every` positions
    (0 = never) and gives a corrupted slot the confidence logit `doubtful` (a finite number;
    the kept slots' is `DEFAULT_CONFIDENT`, so doubtful = DEFAULT_CONFIDENT is a drafter that is
    confidently wrong). Its session limit is chosen as `verifier_engine`'s, over the bytes of one
    session's rings (the oracle: one trunk state).

    Raises:
        ValueError: not one session fits in the memory rule (`session_limit`).
    """
    settings = BackendSettings() if settings is None else settings
    make = ((lambda n: LiveOracleDrafter(module_or_trunk, n, corrupt_every, doubtful=doubtful)) if oracle
            else (lambda n: DrafterEngine(module_or_trunk, max_sessions=n)))
    if oracle:
        size = module_or_trunk.state_bytes(module_or_trunk.new_state())
    else:
        probe = make(1)  # one session's rings, measured on the module itself
        sid = probe.open_session()
        size = probe.session_bytes(sid)
        probe.close_session(sid)
    limit = session_limit(size, settings.max_sessions, available_bytes)
    log.info("drafter: %d sessions at most (%s)", limit.limit, limit.rule)
    return make(limit.limit)
