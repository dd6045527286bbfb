"""`dspark serve verifier|drafter|gateway`, `dspark up` and `dspark generate`.

Owns these entry points: it parses the environment once (`services.settings.read_settings`),
with the flags taking precedence, checks every setting before any model loads, and hands the
typed settings to `services.app`, which builds the engines and servers; it serves no request
itself.

serve: one service in this process until SIGTERM (graceful: NOT_SERVING, then drain).
up: the three services on localhost as three child processes (the embedded default model
when no checkpoint is given); Ctrl-C / SIGTERM stops them.
generate: streams one generation from a gateway to the terminal (or as JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.settings import MAX_TIMEOUT_S, valid_token
from services.settings import ProcessSettings, client_token, read_settings

DEFAULT_PORTS = {"verifier": 50051, "drafter": 50052, "gateway": 50050}
_SPEC = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
         "gated": gateway_pb2.SPEC_MODE_GATED, "default": gateway_pb2.SPEC_MODE_DEFAULT}


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register serve, up and generate on the `dspark` parser's subcommands."""
    serve = sub.add_parser("serve", help="run one service until SIGTERM")
    serve.add_argument("service", choices=("verifier", "drafter", "gateway"))
    serve.add_argument("--port", type=int, default=None, help="listen port (default: 50051/50052/50050)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 in containers)")
    serve.add_argument("--checkpoint", default=None,
                       help="checkpoint folder (default: $DSPARK_CHECKPOINT, else the random tiny model)")
    serve.add_argument("--tp", type=int, default=1, help="verifier: tensor-parallel ranks (spawns tp - 1 workers)")
    serve.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="verifier: where the trunk runs")
    serve.add_argument("--oracle", action="store_true", help="drafter: serve the oracle drafter")
    serve.add_argument("--oracle-corrupt-every", type=int, default=0,
                       help="oracle drafter: corrupt one draft slot in N positions (0 = never)")
    serve.add_argument("--record-rounds", default=None, help="gateway: write every round to FILE (replay format)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="gateway: serve Prometheus metrics on this port (default: $DSPARK_METRICS_PORT, else none)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="gateway: serve the OpenAI-compatible HTTP API on this port "
                            "(default: $DSPARK_HTTP_PORT, else none; 0 = any free port)")
    serve.set_defaults(func=_serve)

    up = sub.add_parser("up", help="start verifier, drafter and gateway on localhost")
    up.add_argument("--checkpoint", default=None)
    up.add_argument("--oracle", action="store_true", help="use the oracle drafter")
    up.add_argument("--port-base", type=int, default=DEFAULT_PORTS["gateway"],
                    help="gateway port; the verifier listens on port-base + 1, the drafter on + 2 (default 50050)")
    up.add_argument("--record-rounds", default=None, help="gateway: write every round to FILE at shutdown")
    up.add_argument("--http-port", type=int, default=None,
                    help="the gateway's OpenAI-compatible HTTP API (default: port-base + 3)")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="stream a generation from a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['gateway']}", help="gateway address")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--spec", choices=tuple(_SPEC), default="default")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--label", default="", help="workload label for the gateway's recorded rounds")
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole call (s; > 0, <= 1e8)")
    gen.add_argument("--json", action="store_true", help="print each streamed message as one JSON line")
    gen.add_argument("--token", default=None,
                     help="bearer token for a gateway that requires one (default: $DSPARK_GATEWAY_TOKEN)")
    gen.add_argument("--tls-ca", default=None, metavar="FILE",
                     help="connect with TLS, trusting the CA certificates in FILE (PEM); default plaintext")
    gen.set_defaults(func=_generate)


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    port = DEFAULT_PORTS[args.service] if args.port is None else args.port
    try:  # every setting is checked before any model loads
        if not 0 <= port <= 65535:
            raise ValueError(f"--port={port}: must be in [0, 65535]")
        if args.tp < 1:
            raise ValueError(f"--tp={args.tp}: must be >= 1")
        settings = read_settings(os.environ, args.service, tp=args.tp,
                                 checkpoint_flag=getattr(args, "checkpoint", None),
                                 metrics_port_flag=getattr(args, "metrics_port", None),
                                 http_port_flag=getattr(args, "http_port", None))
        if getattr(args, "record_rounds", None) is not None:
            _check_writable("--record-rounds", args.record_rounds)
    except ValueError as exc:
        print(f"dspark serve {args.service}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_async(args, port, settings))
    except _STARTUP_ERRORS as exc:
        print(f"dspark serve {args.service}: {exc}", file=sys.stderr)
        return 2
    return 0


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

    provider = tracer_provider(f"dspark-{settings.service}", settings.telemetry)
    recorder = [] if settings.service == "gateway" and args.record_rounds else None
    metrics = health = running = None
    stopped = False
    try:
        if settings.metrics_port is not None:
            from services.gateway.metrics import GatewayMetrics
            metrics = GatewayMetrics()
            metrics.serve(settings.metrics_port, args.host)
        running = await _start(args, port, settings, provider, recorder, metrics)
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
        if metrics is not None:
            metrics.close()
        provider.shutdown()


async def _start(args, port: int, s: ProcessSettings, provider, recorder: list | None, metrics):
    """Load the model `s.service` needs and start its server (a `RunningServer`)."""
    from services import app

    tls = s.tls.server_credentials() if s.tls is not None else None
    age = s.serve.max_connection_age_s
    if s.service == "verifier":
        tp = getattr(args, "tp", 1)
        trunk = app.load_trunk(s.checkpoint, tp=tp, device=getattr(args, "device", "cpu"),
                               verify_numerics=s.backend.verify_numerics, model=s.model, tp_settings=s.tp,
                               topk=s.topk)
        return await app.start_verifier(app.verifier_engine(trunk, s.backend), port, s.backend.verify_mode,
                                        provider, args.host, credentials=tls, tp=tp, max_connection_age_s=age)
    if s.service == "drafter":
        model = app.load_trunk(s.checkpoint, model=s.model) if args.oracle else app.load_drafter(s.checkpoint,
                                                                                                  model=s.model)
        engine = app.drafter_engine(model, args.oracle, s.backend, args.oracle_corrupt_every)
        return await app.start_drafter(engine, port, provider, args.host, credentials=tls, max_connection_age_s=age)
    running, scheduler, _ = await app.start_gateway(
        s.gateway, s.gate, port=port, provider=provider, checkpoint=s.checkpoint, recorder=recorder,
        host=args.host, backend_tls=s.tls, credentials=s.gateway_tls and s.gateway_tls.server_credentials(),
        metrics=metrics, max_connection_age_s=age)
    if s.http_port is None:
        return running
    from services.http.server import start_http_front
    try:
        return await start_http_front(running, scheduler, s.checkpoint, s.http_port, args.host, s.gateway.token,
                                      s.gateway.generation_timeout_s, metrics and metrics.registry)
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


def _up(args) -> int:
    exe = [sys.executable, "-m", "services.cli", "serve"]
    ckpt = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    try:
        ports = up_ports(args.port_base)
        http_port = args.port_base + 3 if args.http_port is None else args.http_port
        if not 0 <= http_port <= 65535:
            raise ValueError(f"--http-port={http_port}: must be in [0, 65535] (default port-base + 3)")
        if args.record_rounds is not None:
            _check_writable("--record-rounds", args.record_rounds)
    except ValueError as exc:
        print(f"dspark up: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ, DSPARK_VERIFIER_TARGET=f"127.0.0.1:{ports['verifier']}",
               DSPARK_DRAFTER_TARGET=f"127.0.0.1:{ports['drafter']}")
    # the gateway starts beside backends that are still loading their weights: wait for them
    env.setdefault("DSPARK_STARTUP_TIMEOUT_S", "120")
    try:  # the three children's settings, checked once here before anything starts
        for service in ("verifier", "drafter", "gateway"):
            read_settings(env, service, http_port_flag=http_port if service == "gateway" else None)
    except ValueError as exc:
        print(f"dspark up: {exc}", file=sys.stderr)
        return 2
    port = {name: ["--port", str(p)] for name, p in ports.items()}
    record = ["--record-rounds", args.record_rounds] if args.record_rounds else []
    procs = [subprocess.Popen(exe + ["verifier"] + port["verifier"] + ckpt, env=env),
             subprocess.Popen(exe + ["drafter"] + port["drafter"] + ckpt + (["--oracle"] if args.oracle else []),
                              env=env)]
    http = ["--http-port", str(http_port)]
    procs.append(subprocess.Popen(exe + ["gateway"] + port["gateway"] + ckpt + record + http, env=env))
    print(f"dspark up: gateway on 127.0.0.1:{ports['gateway']} "
          f"(verifier :{ports['verifier']}, drafter :{ports['drafter']}), "
          f"OpenAI-compatible HTTP API on http://127.0.0.1:{http_port}/v1; Ctrl-C stops", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"] and all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
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


def _generate(args) -> int:
    if args.max_tokens <= 0:
        print(f"dspark generate: --max-tokens={args.max_tokens} must be > 0", file=sys.stderr)
        return 2
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        print(f"dspark generate: --timeout={args.timeout:g} must be > 0 and <= {MAX_TIMEOUT_S:.10g} s",
              file=sys.stderr)
        return 2
    args.token, source = client_token(args.token, os.environ)
    if args.token and not valid_token(args.token):
        # as the gateway checks its own DSPARK_GATEWAY_TOKEN; gRPC metadata would refuse it anyway
        print(f"dspark generate: {source}: the token must be printable ASCII without spaces (value not shown)",
              file=sys.stderr)
        return 2
    if args.tls_ca is not None:
        try:
            with open(args.tls_ca, "rb") as f:
                args.tls_ca_pem = f.read(1 << 20)
        except OSError as e:
            print(f"dspark generate: --tls-ca={args.tls_ca!r}: cannot read: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        return asyncio.run(_generate_async(args))
    except grpc.aio.AioRpcError as e:
        print(f"dspark generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


async def _generate_async(args) -> int:
    req = gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, spec=_SPEC[args.spec],
                                      stop=args.stop, ignore_eos=args.ignore_eos, label=args.label)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    if args.tls_ca is not None:
        channel = grpc.aio.secure_channel(args.target, grpc.ssl_channel_credentials(args.tls_ca_pem))
    else:
        channel = grpc.aio.insecure_channel(args.target)
    async with channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        async for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
            if args.json:
                print(json.dumps(_as_dict(msg)), flush=True)
            elif msg.finished:
                s = msg.spec_stats
                print(msg.text_delta, flush=True)
                print(f"\n[{msg.finish_reason}] {msg.usage.completion_tokens} tokens, {s.rounds} rounds, "
                      f"acceptance {s.acceptance_rate:.0%}, mean acceptance length {s.mean_acceptance_length:.2f}, "
                      f"TTFT {msg.time_to_first_token_ms:.0f} ms", file=sys.stderr)
            else:
                print(msg.text_delta, end="", flush=True)
    return 0


def _as_dict(msg) -> dict:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(msg, preserving_proto_field_name=True)
