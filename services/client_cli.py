"""`dspark generate` and `dspark stats`: the gateway's client commands.

Owns these two entry points: their flag checks (deadline, target, bearer token, CA file),
one gRPC call each with a deadline, and the way results and failures are printed (one line
per failure, never a traceback). It starts no service (`services.serve_cli` does) and reads
only the client's own token variable (`services.settings.client_token`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import struct
import sys

import grpc

from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.settings import MAX_TIMEOUT_S, backend_target, valid_token
from services.settings import client_token

_SPEC = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
         "gated": gateway_pb2.SPEC_MODE_GATED, "default": gateway_pb2.SPEC_MODE_DEFAULT}
_RULES = {"default": common_pb2.SAMPLING_RULE_DEFAULT, "coupled": common_pb2.SAMPLING_RULE_COUPLED,
          "rejection": common_pb2.SAMPLING_RULE_REJECTION}
SEED_LIMIT = 2 ** 63  # dsv4.sampling.SEED_LIMIT (this client does not import torch)


def _client_checks(args, command: str) -> int | None:
    """Check the gateway-client flags of `command` (timeout, token, CA file) and load the CA
    into `args.tls_ca_pem`; returns 2 after printing the reason, None when all are good."""
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        print(f"dspark {command}: --timeout={args.timeout:g} must be > 0 and <= {MAX_TIMEOUT_S:.10g} s",
              file=sys.stderr)
        return 2
    try:  # an empty target would reach gRPC core, which logs its own multi-line complaint
        args.target = backend_target(args.target, "--target")
    except ValueError as e:
        print(f"dspark {command}: {e}", file=sys.stderr)
        return 2
    args.token, source = client_token(args.token, os.environ)
    if args.token and not valid_token(args.token):
        # as the gateway checks its own DSPARK_GATEWAY_TOKEN; gRPC metadata would refuse it anyway
        print(f"dspark {command}: {source}: the token must be printable ASCII without spaces (value not shown)",
              file=sys.stderr)
        return 2
    if args.tls_ca is not None:
        try:
            with open(args.tls_ca, "rb") as f:
                args.tls_ca_pem = f.read(1 << 20)
        except OSError as e:
            print(f"dspark {command}: --tls-ca={args.tls_ca!r}: cannot read: {e.strerror or e}", file=sys.stderr)
            return 2
    return None


def rpc_failure(exc: grpc.aio.AioRpcError, timeout_s: float) -> str:
    """One line on a failed gateway call: "<STATUS>: <details>", and for the two statuses
    whose gRPC text does not say what to check, what it means (timeout_s: --timeout, s)."""
    line = f"{exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return f"{line} (this port does not serve dspark.v1.Gateway: a verifier's or drafter's port?)"
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{line} (no answer within --timeout={timeout_s:g} s)"
    return line


def _channel(args) -> grpc.aio.Channel:
    if args.tls_ca is not None:
        return grpc.aio.secure_channel(args.target, grpc.ssl_channel_credentials(args.tls_ca_pem))
    return grpc.aio.insecure_channel(args.target)


def _metadata(args):
    return (("authorization", f"Bearer {args.token}"),) if args.token else None


def _generate(args) -> int:
    if args.max_tokens <= 0:
        print(f"dspark generate: --max-tokens={args.max_tokens} must be > 0", file=sys.stderr)
        return 2
    if not 0 <= getattr(args, "min_tokens", 0) <= args.max_tokens:
        print(f"dspark generate: --min-tokens={args.min_tokens} must lie in [0, --max-tokens={args.max_tokens}]",
              file=sys.stderr)
        return 2
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:  # the wire's uint64 would refuse it less clearly
        print(f"dspark generate: --seed={args.seed} must lie in [0, 2**63)", file=sys.stderr)
        return 2
    bad = _client_checks(args, "generate")
    if bad is not None:
        return bad
    problem = float_flag_problem(args)
    if problem is not None:
        print(f"dspark generate: {problem}", file=sys.stderr)
        return 2
    if args.logprobs and not args.json:  # the text view has no place for them: say so, do not drop them silently
        print("dspark generate: --logprobs prints with --json only; add --json", file=sys.stderr)
        return 2
    try:
        args.constraint = cli_constraint(args)
        args.logit_bias_map = cli_logit_bias(getattr(args, "logit_bias", []))
    except ValueError as e:
        print(f"dspark generate: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_generate_async(args))
    except grpc.aio.AioRpcError as e:
        print(f"dspark generate: {args.target}: {rpc_failure(e, args.timeout)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the stream is cancelled; a line, not a traceback
        print("\ndspark generate: interrupted", file=sys.stderr)
        return 130


_FLOAT_FLAGS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def float_flag_problem(args) -> str | None:
    """What is wrong with `dspark generate`'s float flags that the gateway cannot see, or None.

    The wire carries them as float32: a finite non-zero value past float32's range would
    arrive as 0 (1e-50 for --repetition-penalty or --top-p: the wire's "unset", so silently
    off) or as inf, so it is refused here, as the HTTP API refuses it. --repetition-penalty 0
    (or below) and --top-p 0 are refused too: 0 is the wire's "unset", so the gateway would
    never see them.
    NaN and inf go through, for the gateway to refuse naming the field."""
    for name in _FLOAT_FLAGS:
        value = getattr(args, name, None)
        if value is None or not math.isfinite(value) or value == 0:
            continue
        try:
            carried = struct.unpack("<f", struct.pack("<f", value))[0]
        except OverflowError:
            carried = math.inf
        if carried == 0 or math.isinf(carried):
            return (f"--{name.replace('_', '-')}={value:g}: outside the float32 range the wire carries "
                    f"(magnitude 1.4e-45 to 3.4e38, or 0)")
    penalty = getattr(args, "repetition_penalty", 1.0)
    if penalty <= 0:  # False for NaN: the gateway names that one
        return f"--repetition-penalty={penalty:g} must be > 0 (1 is off)"
    if getattr(args, "top_p", 1.0) == 0:  # also the wire's "unset" (1)
        return "--top-p=0 must lie in (0, 1]"
    return None


def cli_constraint(args) -> common_pb2.Constraint | None:
    """The wire constraint of `dspark generate`'s --json-schema / --json-object / --regex /
    --grammar / --choice (at most one; None without any). The gateway compiles it.

    Raises:
        ValueError: a file that cannot be read, a schema file that is not JSON, an empty
            choice (each naming the flag).
    """
    if getattr(args, "json_schema", None) is not None:
        text = _read_flag_file("--json-schema", args.json_schema)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema={args.json_schema!r}: not JSON: {e}") from None
        return common_pb2.Constraint(json_schema=text)
    if getattr(args, "json_object", False):
        return common_pb2.Constraint(json_object=True)
    if getattr(args, "regex", None) is not None:
        return common_pb2.Constraint(regex=args.regex)
    if getattr(args, "grammar", None) is not None:
        return common_pb2.Constraint(grammar=_read_flag_file("--grammar", args.grammar))
    if getattr(args, "choice", None) is not None:
        choices = args.choice.split(",")
        if not all(choices):
            raise ValueError(f"--choice={args.choice!r}: every comma-separated choice must be non-empty")
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=choices))
    return None


def cli_logit_bias(items) -> dict[int, float]:
    """`--logit-bias ID=BIAS` flags -> {token id: bias} (the gateway checks the ranges).

    Raises:
        ValueError: an item not ID=BIAS with an integer ID and a number BIAS, or an ID given twice (named).
    """
    out: dict[int, float] = {}
    for item in items:
        token, sep, bias = item.partition("=")
        try:
            t, b = int(token), float(bias)
        except ValueError:
            t = None
        if not sep or t is None or not 0 <= t < 2 ** 31:
            raise ValueError(f"--logit-bias={item!r}: must be ID=BIAS (a token id and a number)")
        if t in out:
            raise ValueError(f"--logit-bias: token {t} given twice")
        out[t] = b
    return out


def _read_flag_file(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}={path!r}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def final_line(msg: gateway_pb2.GenerateResponse, sampled: bool = True) -> str:
    """The summary `dspark generate` prints after the text: finish reason, tokens, rounds,
    acceptance (only when drafts were verified: spec off or all-plain rounds say so), TTFT
    and, for a sampled request (`sampled`: temperature > 0), the seed that reproduces it."""
    s = msg.spec_stats
    if s.submitted > 0:
        spec = (f"acceptance {s.acceptance_rate:.0%}, mean acceptance length {s.mean_acceptance_length:.2f}")
    else:
        spec = "no drafts verified (plain decode)"
    return (f"[{msg.finish_reason}] {msg.usage.completion_tokens} tokens, {s.rounds} rounds, {spec}, "
            f"TTFT {msg.time_to_first_token_ms:.0f} ms" + (f", seed {msg.seed}" if sampled else ""))


async def _generate_async(args) -> int:
    req = gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, spec=_SPEC[args.spec],
                                      stop=args.stop, ignore_eos=args.ignore_eos, label=args.label,
                                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                      min_p=args.min_p, logprobs=args.logprobs,
                                      sampling_rule=_RULES[args.sampling_rule])
    if args.seed is not None:
        req.seed = args.seed
    if args.constraint is not None:
        req.constraint.CopyFrom(args.constraint)
    req.logit_bias.update(getattr(args, "logit_bias_map", {}))
    req.presence_penalty = getattr(args, "presence_penalty", 0.0)
    req.frequency_penalty = getattr(args, "frequency_penalty", 0.0)
    req.repetition_penalty = getattr(args, "repetition_penalty", 1.0)
    req.min_tokens = getattr(args, "min_tokens", 0)
    req.bad_words.extend(getattr(args, "bad_word", []))
    async with _channel(args) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        async for msg in stub.Generate(req, timeout=args.timeout, metadata=_metadata(args)):
            if args.json:
                print(json.dumps(_as_dict(msg)), flush=True)
            elif msg.finished:
                print(msg.text_delta, flush=True)
                print("\n" + final_line(msg, args.temperature > 0), file=sys.stderr)
            else:
                print(msg.text_delta, end="", flush=True)
    return 0


def _stats(args) -> int:
    bad = _client_checks(args, "stats")
    if bad is not None:
        return bad
    try:
        raw = asyncio.run(_stats_async(args))
        stats = json.loads(raw)
    except grpc.aio.AioRpcError as e:
        print(f"dspark stats: {args.target}: {rpc_failure(e, args.timeout)}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as e:
        print(f"dspark stats: {args.target}: the Stats reply is not JSON: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndspark stats: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    from rich.console import Console

    from services.stats_view import render_stats
    render_stats(stats, Console(emoji=False, highlight=False), title=f"gateway {args.target}")
    return 0


async def _stats_async(args) -> str:
    async with _channel(args) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).Stats(gateway_pb2.StatsRequest(), timeout=args.timeout,
                                                                   metadata=_metadata(args))
    return reply.json


def _as_dict(msg) -> dict:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(msg, preserving_proto_field_name=True)
