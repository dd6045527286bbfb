"""`dspark serve verifier|drafter|gateway` and `dspark up`; the parsers of every service command.

Owns these entry points: it parses the environment once (`services.settings.read_settings`),
with the flags taking precedence, checks every setting before any model loads, and hands the
typed settings to `services.app`, which builds the engines and servers; it serves no request
itself.

serve: one service in this process until SIGTERM (graceful: NOT_SERVING, then drain).
up: the three services on localhost as three child processes (the random tiny model when
no checkpoint is given); it says "Ctrl-C stops" once the gateway serves; Ctrl-C / SIGTERM
stops them.
generate, stats: the gateway's client commands, parsed here and run by `services.client_cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import grpc

from services.client_cli import _SPEC, _generate, _stats
from services.drafter.live_oracle import DEFAULT_DOUBTFUL
from services.settings import ProcessSettings, read_settings

DEFAULT_PORTS = {"verifier": 50051, "drafter": 50052, "gateway": 50050}


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register serve, up, generate and stats on the `dspark` parser's subcommands."""
    serve = sub.add_parser("serve", help="run one service until SIGTERM")
    serve.add_argument("service", choices=("verifier", "drafter", "gateway"))
    serve.add_argument("--port", type=int, default=None, help="listen port (default: 50051/50052/50050)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 in containers)")
    serve.add_argument("--checkpoint", default=None,
                       help="checkpoint folder (default: $DSPARK_CHECKPOINT, else the random tiny model)")
    serve.add_argument("--tp", type=int, default=1, help="verifier: tensor-parallel ranks (spawns tp - 1 workers)")
    serve.add_argument("--device", default=None,
                       help="verifier, drafter: where the model runs: cpu, cuda or cuda:N (default: $DSPARK_DEVICE, "
                            "else cpu; bf16 on a GPU; the verifier at --tp > 1 puts rank r on cuda:r)")
    serve.add_argument("--oracle", action="store_true", help="drafter: serve the oracle drafter")
    serve.add_argument("--oracle-corrupt-every", type=int, default=0,
                       help="oracle drafter: corrupt one draft slot in N positions (0 = never)")
    serve.add_argument("--oracle-doubtful", type=_finite_logit, default=DEFAULT_DOUBTFUL, metavar="LOGIT",
                       help="oracle drafter: the confidence logit of a corrupted slot (a finite number; default "
                            "%(default)s; the kept slots' is 6.5: give 6.5 for a drafter that is confidently wrong)")
    serve.add_argument("--record-rounds", default=None, help="gateway: write every round to FILE (replay format)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics on this port (0 = any free port; default: "
                            "$DSPARK_METRICS_PORT, else none)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="gateway: serve the OpenAI-compatible HTTP API on this port "
                            "(default: $DSPARK_HTTP_PORT, else none; 0 = any free port)")
    serve.set_defaults(func=_serve)

    up = sub.add_parser("up", help="start verifier, drafter and gateway on localhost")
    up.add_argument("--checkpoint", default=None,
                    help="checkpoint folder all three load (default: $DSPARK_CHECKPOINT, else the random tiny model)")
    up.add_argument("--oracle", action="store_true", help="use the oracle drafter")
    up.add_argument("--port-base", type=int, default=DEFAULT_PORTS["gateway"],
                    help="gateway port; the verifier listens on port-base + 1, the drafter on + 2, HTTP on + 3")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus metrics: gateway on this port, verifier on + 1, drafter on + 2 "
                         "(default: none; $DSPARK_METRICS_PORT is not used by up)")
    up.add_argument("--record-rounds", default=None, help="gateway: write every round to FILE at shutdown")
    up.add_argument("--http-port", type=int, default=None,
                    help="the gateway's OpenAI-compatible HTTP API (default: port-base + 3)")
    up.add_argument("--spans-dir", default=".",
                    help="with OTEL_TRACES_EXPORTER=console: the folder of each service's span file "
                         "(dspark-<service>.spans.json), so three processes never share one stdout")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="stream a generation from a gateway")
    gen.add_argument("prompt")
    _client_args(gen, timeout=300.0)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--spec", choices=tuple(_SPEC), default="default",
                     help="speculation: off, always (fixed k), gated, or default (gated when the gateway's "
                          "DSPARK_GATE=1, else always)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    gen.add_argument("--label", default="", help="workload label for the gateway's recorded rounds")
    gen.add_argument("--json", action="store_true", help="print each streamed message as one JSON line")
    _sampling_args(gen)
    _constraint_args(gen)
    gen.set_defaults(func=_generate)

    stats = sub.add_parser("stats", help="print a gateway's process totals (Gateway.Stats)")
    _client_args(stats, timeout=10.0)
    stats.add_argument("--json", action="store_true", help="print the raw Stats JSON")
    stats.set_defaults(func=_stats)


def _finite_logit(text: str) -> float:
    """A confidence logit flag's value: a finite number. Raises argparse.ArgumentTypeError
    naming the text (NaN and +-inf included), which argparse reports as a usage error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """`dspark generate`'s sampling flags (the gateway validates the values; docs/services.md)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="most likely tokens kept (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top token's probability")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the gateway draws one and "
                                                          "prints it, so the run can be repeated)")
    p.add_argument("--logprobs", type=int, default=0, help="top alternatives per token (0..20; with --json)")
    p.add_argument("--sampling-rule", choices=("default", "coupled", "rejection"), default="default",
                   help="acceptance rule of speculative sampling (default: the gateway's DSPARK_SAMPLING_RULE)")
    _control_args(p)


def _control_args(p: argparse.ArgumentParser) -> None:
    """`dspark generate`'s logits control flags (the gateway validates the values; docs/sampling.md §5a)."""
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; -100 bans, +100 forces)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over generated tokens, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over generated tokens, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's, over prompt and generated tokens, > 0 (1: off)")
    p.add_argument("--min-tokens", type=int, default=0, help="no eos or stop token before this many tokens")
    p.add_argument("--bad-word", action="append", default=[], help="a word never to generate (repeatable)")


def _constraint_args(p: argparse.ArgumentParser) -> None:
    """`dspark generate`'s output constraint flags, one at most (docs/structured.md)."""
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="output matches this JSON Schema (a file)")
    shape.add_argument("--json-object", action="store_true", help="output is one JSON object")
    shape.add_argument("--regex", metavar="R", help="output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="output matches this EBNF / GBNF grammar (a file)")
    shape.add_argument("--choice", metavar="A,B,...", help="output is one of these comma-separated strings")


def _client_args(p: argparse.ArgumentParser, timeout: float) -> None:
    """The flags of a command that calls a gateway: where, how long, and its credentials."""
    p.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['gateway']}", help="gateway address")
    p.add_argument("--timeout", type=float, default=timeout, help="deadline of the whole call (s; > 0, <= 1e8)")
    p.add_argument("--token", default=None,
                   help="bearer token for a gateway that requires one (default: $DSPARK_GATEWAY_TOKEN)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="connect with TLS, trusting the CA certificates in FILE (PEM); default plaintext")


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output file that could not be written at shutdown (its rounds would be lost).

    Raises:
        ValueError: naming `flag` and `path`: a directory, a missing parent folder, or no write permission.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag}={path!r}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag}={path!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag}={path!r}: not writable")


# Start-up failures `dspark serve` reports as one line (exit 2): bad settings and checkpoints
# (ValueError, CheckpointError), ports that will not bind and unreachable or mismatched
# backends (RuntimeError: BackendError, IdentityMismatch). Anything else is a bug: traceback.
_STARTUP_ERRORS = (ValueError, RuntimeError)


def _serve(args) -> int:
    port = DEFAULT_PORTS[args.service] if args.port is None else args.port
    try:  # every setting is checked, and every port probed, before any model loads
        if not 0 <= port <= 65535:
            raise ValueError(f"--port={port}: must be in [0, 65535]")
        if args.tp < 1:
            raise ValueError(f"--tp={args.tp}: must be >= 1")
        settings = read_settings(os.environ, args.service, tp=args.tp,
                                 checkpoint_flag=getattr(args, "checkpoint", None),
                                 metrics_port_flag=getattr(args, "metrics_port", None),
                                 http_port_flag=getattr(args, "http_port", None),
                                 device_flag=_device_flag(args))
        _check_device(settings, args.tp)
        if getattr(args, "record_rounds", None) is not None:
            _check_writable("--record-rounds", args.record_rounds)
        from services.common.ports import check_ports_free
        check_ports_free(getattr(args, "host", "127.0.0.1"),
                         {"--port": port, "metrics": settings.metrics_port, "health": settings.serve.health_port,
                          "HTTP API": settings.http_port or None})
    except ValueError as exc:
        print(f"dspark serve {args.service}: {exc}", file=sys.stderr)
        return 2
    from services.common.logs import configure
    configure(settings.log_format)
    try:
        asyncio.run(_serve_async(args, port, settings))
    except _STARTUP_ERRORS as exc:
        print(f"dspark serve {args.service}: {exc}", file=sys.stderr)
        return 2
    _exit_served()


def _device_flag(args) -> str | None:
    """`--device` as given (None when absent). Raises ValueError for the gateway, which runs no
    model: a placement it would ignore is refused."""
    flag = getattr(args, "device", None)
    if flag is not None and args.service == "gateway":
        raise ValueError(f"--device={flag}: the gateway runs no model (use it on the verifier and the drafter)")
    return flag


def _check_device(s: ProcessSettings, tp: int) -> None:
    """Fail before any model loads when the service's device is not on this machine.

    Raises:
        ValueError: one line naming the device (no CUDA, cuda:N past the device count, or
            fewer GPUs than --tp ranks); cuda:N with N > 0 and DSV4_KERNELS=triton (Triton
            launches on the calling thread's current device, which the step loop's threads
            leave at cuda:0: expose the GPU with CUDA_VISIBLE_DEVICES=N and --device cuda).
    """
    if s.backend is None or s.backend.device == "cpu":
        return
    if s.backend.device != "cuda:0" and tp == 1 and s.model is not None and s.model.kernels == "triton":
        raise ValueError(f"device {s.backend.device} with DSV4_KERNELS=triton: Triton kernels run on the "
                         f"thread's current GPU (cuda:0); set CUDA_VISIBLE_DEVICES to the GPU and use --device cuda")
    from services.common.device import DeviceUnavailable, check_available
    try:
        check_available(s.backend.device)
    except DeviceUnavailable as exc:
        raise ValueError(str(exc)) from None
    import torch
    if tp > 1 and torch.cuda.device_count() < tp:
        raise ValueError(f"device {s.backend.device}: --tp={tp} puts rank r on cuda:r, but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")


def _exit_served() -> NoReturn:
    """End the process after a drained stop, skipping the interpreter's teardown.

    Everything the server owned is closed by then (streams drained, rounds saved, metrics
    endpoint closed, spans flushed). The heap frozen after start-up (`gc.freeze`) is never
    collected, so a normal teardown would only make native extensions loaded with it
    (triton's, when installed) report their objects as leaked, dozens of lines on every stop.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


async def _serve_async(args, port: int, settings: ProcessSettings) -> None:
    """Start `settings.service` on `port` and serve until SIGTERM, then drain, write the
    recorded rounds (gateway, `--record-rounds`) and flush the spans.

    Raises:
        ValueError, RuntimeError: a start-up failure (bad checkpoint, port in use, backends
            unreachable or mismatched), reported by `_serve` as one line.
    """
    from services.common.server import run_until_signal
    from services.common.telemetry import tracer_provider
    from services.common.tls import start_health_server

    # Spans nothing exports are pure cost: without an exporter the service runs without a tracer
    # provider, so its gRPC calls carry no tracing interceptors (docs/services.md §6).
    t = settings.telemetry
    provider = tracer_provider(f"dspark-{settings.service}", t) if t.exporters or t.jsonl_path else None
    if settings.service != "gateway":  # which weights: a user must be able to tell random ones apart
        logging.getLogger("dspark.serve").info(
            "%s: model %s", settings.service,
            settings.checkpoint or "random tiny (no --checkpoint / DSPARK_CHECKPOINT; docs/model.md §13)")
    recorder = [] if settings.service == "gateway" and args.record_rounds else None
    endpoints: list = []  # the metrics endpoint, once `_start` made it
    health = running = None
    stopped = False
    try:
        running = await _start(args, port, settings, provider, recorder, endpoints)
        # Everything loaded so far (torch, the model, the generated protos: ~200k objects) lives
        # as long as the process. Moving it out of the collector's generations keeps full
        # collections from re-walking it while serving (a ~0.1-0.2 s pause each on this CPU),
        # and the interpreter's last collection from walking it at exit, which made a stop
        # after SIGTERM take seconds after the drain had finished.
        gc.freeze()
        if settings.serve.health_port is not None:
            health, _ = await start_health_server(running.health, settings.serve.health_port, args.host)
        await run_until_signal(running, settings.serve.drain_timeout_s)
        stopped = True
    finally:
        if health is not None:
            await health.stop(0)
        if running is not None and not stopped:
            await running.stop(0)  # started, but the start-up failed after it (the health port)
        if recorder is not None and running is not None:
            from services.gateway.rounds import RoundLog, save_rounds
            save_rounds(RoundLog(tuple(recorder), {"source": "dspark serve gateway --record-rounds"}),
                        args.record_rounds)
        for endpoint in endpoints:
            endpoint.close()
        if provider is not None:
            provider.shutdown()


def resolved_alignment(backend) -> str:
    """The verifier's step alignment from its `BackendSettings`: "auto" becomes the device's
    default (`services.common.alignment.default_alignment`)."""
    from services.common.alignment import default_alignment
    name = backend.step_alignment
    return default_alignment(backend.device) if name == "auto" else name


def _serve_metrics(endpoint, s: ProcessSettings, host: str, endpoints: list):
    """Serve `endpoint` on the settings' metrics port and remember it for the shutdown."""
    endpoints.append(endpoint)
    endpoint.serve(s.metrics_port, host)
    return endpoint


async def _start(args, port: int, s: ProcessSettings, provider, recorder: list | None, endpoints: list):
    """Load the model `s.service` needs, serve its metrics when `s.metrics_port` is set (the
    endpoint appended to `endpoints`) and start its server (a `RunningServer`)."""
    from services import app
    from services.common import metrics as m
    from services.common.device import default_dtype
    from services.common.limits import available_memory_bytes

    tls = s.tls.server_credentials() if s.tls is not None else None
    age = s.serve.max_connection_age_s
    want = s.metrics_port is not None
    threads = s.backend.torch_threads if s.service in ("verifier", "drafter") else None
    if threads is not None:  # the gateway runs no model
        from services.common.threads import use_torch_threads
        use_torch_threads(threads, asyncio.get_running_loop())  # before the model: exact mode pins it
    if s.service == "verifier":
        tp = getattr(args, "tp", 1)
        trunk = app.load_trunk(s.checkpoint, tp=tp, device=s.backend.device, dtype=default_dtype(s.backend.device),
                               verify_numerics=s.backend.verify_numerics, model=s.model, tp_settings=s.tp,
                               topk=s.topk)
        engine = app.verifier_engine(trunk, s.backend, available_memory_bytes(), app.grammar_vocab(s.checkpoint, trunk.cfg))
        metrics = _serve_metrics(m.VerifierMetrics(engine), s, args.host, endpoints) if want else None
        profile = app.StepProfileSettings() if s.backend.step_profile else None
        return await app.start_verifier(engine, port, s.backend.verify_mode, provider, args.host, credentials=tls,
                                        tp=tp, max_connection_age_s=age, metrics=metrics,
                                        prefill_chunk=s.backend.prefill_chunk, step_profile=profile,
                                        gather_s=s.backend.step_gather_ms / 1e3, torch_threads=threads,
                                        alignment=resolved_alignment(s.backend))
    if s.service == "drafter":
        device, dtype = s.backend.device, default_dtype(s.backend.device)
        model = (app.load_trunk(s.checkpoint, model=s.model, device=device, dtype=dtype) if args.oracle
                 else app.load_drafter(s.checkpoint, model=s.model, device=device, dtype=dtype))
        engine = app.drafter_engine(model, args.oracle, s.backend, args.oracle_corrupt_every,
                                    available_memory_bytes(), doubtful=args.oracle_doubtful)
        metrics = _serve_metrics(m.DrafterMetrics(engine), s, args.host, endpoints) if want else None
        return await app.start_drafter(engine, port, provider, args.host, credentials=tls, max_connection_age_s=age,
                                       metrics=metrics, gather_s=s.backend.step_gather_ms / 1e3,
                                       torch_threads=threads, vocab=app.grammar_vocab(s.checkpoint, model.cfg))
    from services.gateway.metrics import GatewayMetrics
    metrics = (_serve_metrics(GatewayMetrics(model=m.served_model_name(s.checkpoint)), s, args.host, endpoints)
               if want else None)
    running, scheduler, _ = await app.start_gateway(
        s.gateway, s.gate, port=port, provider=provider, checkpoint=s.checkpoint, recorder=recorder,
        host=args.host, backend_tls=s.tls, credentials=s.gateway_tls and s.gateway_tls.server_credentials(),
        metrics=metrics, max_connection_age_s=age)
    if s.http_port is None:
        return running
    from services.http.server import start_http_front
    try:
        return await start_http_front(running, scheduler, s.checkpoint, s.http_port, args.host, s.gateway.token,
                                      s.gateway.generation_timeout_s, metrics and metrics.registry,
                                      s.http_max_body_bytes)
    except BaseException:
        await running.stop(0)
        raise


def up_ports(port_base: int) -> dict[str, int]:
    """The ports `dspark up --port-base N` uses: gateway N, verifier N + 1, drafter N + 2.

    Raises:
        ValueError: naming the value, when N + 2 is not a port (N outside 1..65533).
    """
    if not 1 <= port_base <= 65533:
        raise ValueError(f"--port-base={port_base}: must be in [1, 65533] (the drafter listens on port-base + 2)")
    return {"gateway": port_base, "verifier": port_base + 1, "drafter": port_base + 2}


def up_metrics_ports(metrics_base: int | None) -> dict[str, int | None]:
    """The metrics ports of `dspark up --metrics-port M`: gateway M, verifier M + 1, drafter
    M + 2; all None without the flag.

    Raises:
        ValueError: naming the value, when M + 2 is not a port (M outside 1..65533).
    """
    if metrics_base is None:
        return {"gateway": None, "verifier": None, "drafter": None}
    if not 1 <= metrics_base <= 65533:
        raise ValueError(f"--metrics-port={metrics_base}: must be in [1, 65533] (the drafter's is metrics-port + 2)")
    return {"gateway": metrics_base, "verifier": metrics_base + 1, "drafter": metrics_base + 2}


def _up_plan(args) -> tuple[dict[str, list[str]], dict[str, str], dict[str, str | None]]:
    """Each child's `dspark serve` arguments, their environment and, with the console span
    exporter, each child's span file (else None). Every setting and port is checked here,
    before anything starts.

    Raises:
        ValueError: a bad flag or setting, or a port another process holds (each named).
    """
    from services.common.ports import check_ports_free

    ports, metrics = up_ports(args.port_base), up_metrics_ports(args.metrics_port)
    http_flag = getattr(args, "http_port", None)
    args.http = args.port_base + 3 if http_flag is None else http_flag
    if not 0 <= args.http <= 65535:
        raise ValueError(f"--http-port={args.http}: must be in [0, 65535] (default port-base + 3)")
    if args.record_rounds is not None:
        _check_writable("--record-rounds", args.record_rounds)
    offsets = {n: f"--port-base + {p - args.port_base}" if p != args.port_base else "--port-base"
               for n, p in ports.items()}
    check_ports_free("127.0.0.1", {**{f"{n} ({offsets[n]})": p for n, p in ports.items()},
                                   **{f"{n} metrics (--metrics-port)": p for n, p in metrics.items()},
                                   "gateway HTTP API (--http-port)": args.http or None})
    env = dict(os.environ, DSPARK_VERIFIER_TARGET=f"127.0.0.1:{ports['verifier']}",
               DSPARK_DRAFTER_TARGET=f"127.0.0.1:{ports['drafter']}")
    env.pop("DSPARK_METRICS_PORT", None)  # one port cannot serve three processes: --metrics-port
    # the gateway starts beside backends that are still loading their weights: wait for them
    env.setdefault("DSPARK_STARTUP_TIMEOUT_S", "120")
    children = [read_settings(env, n, http_port_flag=args.http if n == "gateway" else None)
                for n in ("verifier", "drafter", "gateway")]  # checked once, here
    console = any("console" in c.telemetry.exporters for c in children)
    args.gateway_tls = children[2].gateway_tls is not None
    spans = {n: None for n in ports}
    if console:
        if not Path(args.spans_dir).is_dir():
            raise ValueError(f"--spans-dir={args.spans_dir!r}: not an existing folder")
        spans = {n: str(Path(args.spans_dir) / f"dspark-{n}.spans.json") for n in ports}
    ckpt = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    argv = {n: ["--port", str(p)] + ckpt + ([] if metrics[n] is None else ["--metrics-port", str(metrics[n])])
            for n, p in ports.items()}
    argv["drafter"] += ["--oracle"] if args.oracle else []
    argv["gateway"] += ["--record-rounds", args.record_rounds] if args.record_rounds else []
    argv["gateway"] += ["--http-port", str(args.http)]
    return argv, env, spans


def _up(args) -> int:
    try:
        argv, env, spans = _up_plan(args)
    except ValueError as exc:
        print(f"dspark up: {exc}", file=sys.stderr)
        return 2
    exe = [sys.executable, "-m", "services.cli", "serve"]
    procs, files = [], []
    stop = {"now": False}  # set before any child starts: a SIGTERM from then on stops them all
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    for name in ("verifier", "drafter", "gateway"):
        out = open(spans[name], "w", encoding="utf-8") if spans[name] else None
        files += [out] if out else []
        procs.append(subprocess.Popen(exe + [name] + argv[name], env=env, stdout=out))
    ports = up_ports(args.port_base)
    where = (f"gateway on 127.0.0.1:{ports['gateway']} (verifier :{ports['verifier']}, drafter :{ports['drafter']}), "
             f"OpenAI-compatible HTTP API on http://127.0.0.1:{args.http}/v1")
    print(f"dspark up: starting {where}; loading the model", flush=True)
    if any(spans.values()):
        print("dspark up: console spans go to " + ", ".join(v for v in spans.values() if v), flush=True)
    try:
        _supervise(procs, f"127.0.0.1:{ports['gateway']}", where, args.metrics_port, stop, args.gateway_tls)
    except KeyboardInterrupt:
        pass
    code = _stop_children(procs)
    for f in files:
        f.close()
    return code


def _supervise(procs: list, target: str, where: str, metrics_base: int | None, stop: dict, tls: bool) -> None:
    """Wait while every child runs and no stop was asked; say "Ctrl-C stops" once the gateway
    reports SERVING (it serves only after both backends answered its identity check). Under
    gateway TLS the plaintext probe cannot ask, so that line comes at once, saying so."""
    from services.common.ports import is_serving

    ready = False
    if tls:
        where += " (gateway TLS: readiness not checked)"
    with grpc.insecure_channel(target) as channel:
        while not stop["now"] and all(p.poll() is None for p in procs):
            if not ready and (tls or is_serving(channel, "dspark.v1.Gateway")):
                ready = True
                extra = "" if metrics_base is None else f"; metrics on :{metrics_base}, :{metrics_base + 1}, " \
                                                         f":{metrics_base + 2} /metrics"
                print(f"dspark up: ready: {where}{extra}; Ctrl-C stops", flush=True)
            time.sleep(0.5)


def _stop_children(procs: list) -> int:
    """SIGTERM every child still running, wait (30 s each, then kill); the exit code of `up`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    failed = [(p.args[4], p.returncode) for p in procs if p.returncode not in (0, -signal.SIGTERM)]
    if failed:  # each child printed its own reason (a start-up failure: one line, exit 2)
        print("dspark up: " + ", ".join(f"{name} exited with status {rc}" for name, rc in failed)
              + "; stopped the others", file=sys.stderr)
        return 2 if any(rc == 2 for _, rc in failed) else 1
    return 0
