"""Structured output's validity and exactness grid: `python -m bench.bench_structured_grid [options]`.

Owns the grid the structured-output issue asks for (docs/structured.md §8): over the JSON
Schemas of `tests/structured_schemas.py` (nested objects, arrays, enums, numbers, strings with
patterns, optional fields), greedy and seeded (T = 0.7, 1.0), speculation off / always /
gated, 1 and 16 concurrent streams, streamed over gRPC and over HTTP with `stream` on and
off, and with the drafter killed mid-generation, every generation is checked two ways:

* valid: it ended on eos, its text parses as JSON and validates against its schema (and its
  streamed deltas concatenate to its final text: nothing is sent after the grammar completes);
* exact: its tokens (gRPC) or its text (HTTP) equal those of constrained plain decode of the
  same (schema, T, seed): a gateway with jump-forward off and speculation off, one stream.

Run against the bundled model in exact numerics (this script: a verifier, a DSpark drafter
drafting inside the grammar, three gateways and an HTTP front, ports from --port-base) or
against the tests' tiny model (`tests/test_structured_grid.py` calls `run_grid`). It prints
the grid and a total, never asserts: the tests assert.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import jsonschema

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from structured_schemas import SCHEMAS  # noqa: E402

SPEC = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
        "gated": gateway_pb2.SPEC_MODE_GATED}
PROMPT = "json:"


@dataclass(frozen=True)
class Row:
    """One generation of the grid: what ran (part, schema index, T, spec mode, concurrent
    streams, api "grpc" | "http" | "http-stream"), whether it was valid and exact, and what
    went wrong (empty: nothing; a killed drafter that was never lost is a failure too)."""

    part: str
    schema: int
    t: float
    spec: str
    streams: int
    api: str
    valid: bool
    exact: bool
    why: str = ""


@dataclass
class Outcome:
    """A generation as a client saw it: its tokens (gRPC; None over HTTP), final text, the
    streamed deltas concatenated, how it finished, and its SpecStats (gRPC; else None)."""

    tokens: list[int] | None
    text: str
    streamed: str
    finish_reason: str
    stats: gateway_pb2.SpecStats | None = None


@dataclass
class GridTargets:
    """What the grid drives. plain: a gateway stub with jump-forward off (the reference);
    main: a gateway stub with jump-forward on and a drafter drafting inside the grammar;
    http: an `openai.AsyncOpenAI` client of main's HTTP front and its model id (None: no
    HTTP part); killable: makes a fresh (gateway stub, kill, close) whose drafter `kill()`
    stops for good (None: no kill part)."""

    plain: gateway_pb2_grpc.GatewayStub
    main: gateway_pb2_grpc.GatewayStub
    http: object | None = None
    model: str = ""
    killable: Callable[[], Awaitable[tuple]] | None = None


def grpc_request(schema: dict, spec: str, t: float, seed: int, max_tokens: int) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, spec=SPEC[spec], temperature=t)
    req.constraint.json_schema = json.dumps(schema)
    if t > 0:
        req.seed = seed
    return req


async def grpc_generate(stub, req, timeout_s: float = 600.0, on_message=None) -> Outcome:
    """Stream one Generate; `on_message(count)` is awaited after each message (the kill part)."""
    tokens, deltas, final = [], [], None
    async for msg in stub.Generate(req, timeout=timeout_s):
        tokens += msg.token_ids
        deltas.append(msg.text_delta)
        if msg.finished:
            final = msg
        if on_message is not None:
            await on_message(len(tokens))
    ok = final is not None and final.finish_reason == "stop" and final.matched_token_id == 1
    return Outcome(tokens, final.text if final else "", "".join(deltas),
                   "stop" if ok else getattr(final, "finish_reason", "none"), final.spec_stats if final else None)


async def http_generate(client, model: str, schema: dict, spec: str, t: float, seed: int, max_tokens: int,
                        stream: bool) -> Outcome:
    """One completion through the OpenAI client: `guided_json` in the extra body."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=t,
                  extra_body={"guided_json": schema, "spec": spec}, **({"seed": seed} if t > 0 else {}))
    if not stream:
        r = await client.completions.create(**kwargs)
        return Outcome(None, r.choices[0].text, r.choices[0].text, r.choices[0].finish_reason)
    parts, finish = [], "none"
    async for chunk in await client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    text = "".join(parts)
    return Outcome(None, text, text, finish)


def judge(part: str, i: int, t: float, spec: str, streams: int, api: str, out: Outcome, ref: Outcome) -> Row:
    """The row of one generation against its reference."""
    why = []
    try:
        jsonschema.validate(json.loads(out.text), SCHEMAS[i])
    except (ValueError, jsonschema.ValidationError) as exc:
        why.append(f"invalid: {str(exc)[:80]}")
    if out.finish_reason != "stop":
        why.append(f"finish {out.finish_reason}")
    if out.streamed != out.text:
        why.append("streamed text differs from the final text")
    valid = not why
    exact = out.text == ref.text and (out.tokens is None or out.tokens == ref.tokens)
    if not exact:
        why.append(f"differs from plain: {out.text[:60]!r} vs {ref.text[:60]!r}")
    return Row(part, i, t, spec, streams, api, valid, exact, "; ".join(why))


async def run_grid(targets: GridTargets, schemas: list[int], temps: tuple[float, ...], *,
                   specs: tuple[str, ...] = ("off", "always", "gated"), streams: int = 16,
                   http_temps: tuple[float, ...] = (0.0, 0.7), kills: int = 3, max_tokens: int = 200,
                   log=None) -> list[Row]:
    """The grid over schema indices `schemas` x `temps` (seed = the schema index): the
    references one stream at a time, then every spec in `specs` over gRPC one stream at a
    time, "always" and "gated" again `streams` at once, "always" over HTTP with and without
    streaming at `http_temps`, and `kills` generations whose drafter is killed after a few
    tokens. Returns one Row per generation (references included, part "plain")."""
    cells = list(itertools.product(schemas, temps))
    refs: dict[tuple[int, float], Outcome] = {}
    rows: list[Row] = []
    for i, t in cells:
        refs[i, t] = await grpc_generate(targets.plain, grpc_request(SCHEMAS[i], "off", t, i, max_tokens))
        rows.append(judge("plain", i, t, "off", 1, "grpc", refs[i, t], refs[i, t]))
    _note(log, "references", rows)
    for spec in specs:
        for i, t in cells:
            out = await grpc_generate(targets.main, grpc_request(SCHEMAS[i], spec, t, i, max_tokens))
            rows.append(judge("grpc x1", i, t, spec, 1, "grpc", out, refs[i, t]))
        _note(log, f"grpc {spec} x1", rows)
    for spec in (s for s in specs if s != "off"):
        for wave in range(0, len(cells), streams):
            batch = cells[wave:wave + streams]
            outs = await asyncio.gather(*(grpc_generate(targets.main, grpc_request(SCHEMAS[i], spec, t, i, max_tokens))
                                          for i, t in batch))
            rows += [judge(f"grpc x{streams}", i, t, spec, len(batch), "grpc", out, refs[i, t])
                     for (i, t), out in zip(batch, outs)]
        _note(log, f"grpc {spec} x{streams}", rows)
    if targets.http is not None:
        for (i, t), stream in itertools.product([c for c in cells if c[1] in http_temps], (False, True)):
            out = await http_generate(targets.http, targets.model, SCHEMAS[i], "always", t, i, max_tokens, stream)
            rows.append(judge("http", i, t, "always", 1, "http-stream" if stream else "http", out, refs[i, t]))
        _note(log, "http", rows)
    if targets.killable is not None:
        rows += await _kill_part(targets, cells[:kills], max_tokens, refs)
        _note(log, "drafter killed", rows)
    return rows


async def _kill_part(targets: GridTargets, cells, max_tokens: int, refs) -> list[Row]:
    """Each cell through a fresh gateway whose drafter is killed once 3 tokens have streamed."""
    rows = []
    for i, t in cells:
        stub, kill, close = await targets.killable()
        killed = []

        async def on_message(count: int) -> None:
            if count >= 3 and not killed:
                killed.append(count)
                await kill()
        try:
            out = await grpc_generate(stub, grpc_request(SCHEMAS[i], "always", t, i, max_tokens), on_message=on_message)
        finally:
            await close()
        row = judge("drafter killed", i, t, "always", 1, "grpc", out, refs[i, t])
        if not killed or out.stats is None or not (out.stats.drafter_failed or out.stats.drafter_failovers):
            row = dataclasses.replace(row, why=(row.why + "; the drafter was not lost mid-generation").lstrip("; "))
        rows.append(row)
    return rows


def _note(log, what: str, rows: list[Row]) -> None:
    if log is not None:
        log(f"  {what}: {len(rows)} generations so far ({time.strftime('%H:%M:%S')})")


def summary(rows: list[Row]) -> str:
    """The grid as text: per (part, T, spec, streams, api) generations, valid and exact, then the total."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r.part, r.t, r.spec, r.streams if r.part != "grpc x16" else "16", r.api].append(r)
    lines = [f"{'part':<15} {'T':>4} {'spec':<7} {'streams':>7} {'api':<12} {'n':>4} {'valid':>6} {'exact':>6}"]
    for (part, t, spec, streams, api), rs in groups.items():
        lines.append(f"{part:<15} {t:>4g} {spec:<7} {streams!s:>7} {api:<12} {len(rs):>4} "
                     f"{sum(r.valid for r in rs):>6} {sum(r.exact for r in rs):>6}")
    n, schemas = len(rows), len({r.schema for r in rows})
    lines.append(f"total: {n} generations over {schemas} schemas; valid {sum(r.valid for r in rows)}/{n} "
                 f"({sum(r.valid for r in rows) / max(n, 1):.1%}); exact {sum(r.exact for r in rows)}/{n} "
                 f"({sum(r.exact for r in rows) / max(n, 1):.1%})")
    lines += [f"  FAIL {r.part} schema {r.schema} T={r.t:g} {r.spec} {r.api}: {r.why}" for r in rows if r.why]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the bundled model
async def start_grid_gateway(verifier_port: int, drafter_port: int, port: int = 0, checkpoint: str | None = None,
                             startup_timeout_s: float = 10.0, **settings):
    """A gateway over the grid's verifier and a drafter (batched verify, configured costs, the
    GatewaySettings `settings` laid over): (server, scheduler, stub, close coroutine function)."""
    import grpc

    from services.app import start_gateway
    from services.common.settings import GatewaySettings
    from services.gateway.gate import GateConfig

    gw, sched, backends = await start_gateway(GatewaySettings(
        verifier_target=f"127.0.0.1:{verifier_port}", drafter_target=f"127.0.0.1:{drafter_port}",
        verify_mode="batched", cost_mode="configured", startup_timeout_s=startup_timeout_s, **settings),
        GateConfig(), port=port, checkpoint=checkpoint)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")

    async def close():
        await channel.close()
        await gw.stop(0)
        await backends.close()
    return gw, sched, gateway_pb2_grpc.GatewayStub(channel), close


async def bundled_targets(args):
    """Servers over the bundled checkpoint in exact numerics; returns (targets, close)."""
    import openai

    from services.app import drafter_engine, load_drafter, load_trunk, start_drafter, start_verifier, verifier_engine
    from services.common.constraint import checkpoint_vocab
    from services.common.settings import BackendSettings
    from services.http.server import start_http_front

    ckpt, base = args.checkpoint, args.port_base
    trunk = load_trunk(ckpt, verify_numerics="exact")
    vocab = checkpoint_vocab(ckpt, trunk.cfg.vocab_size, trunk.cfg.eos_token_id)
    grammar = lambda: vocab  # noqa: E731
    verifier = await start_verifier(verifier_engine(trunk, BackendSettings(verify_numerics="exact"), vocab=grammar),
                                    port=base + 1)
    module = load_drafter(ckpt)
    drafter = await start_drafter(drafter_engine(module), port=base + 2, vocab=grammar)
    closers, stubs = [], {}

    gateway = functools.partial(start_grid_gateway, verifier.port, checkpoint=ckpt, startup_timeout_s=30.0)
    _, _, stubs["plain"], c1 = await gateway(drafter.port, port=base + 3, jump_forward=False)
    gw, sched, stubs["main"], c2 = await gateway(drafter.port, port=base + 4)
    front = await start_http_front(gw, sched, ckpt, base + 5)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.http.port}/v1", api_key="unused", max_retries=0,
                                timeout=600.0)
    model = (await client.models.list()).data[0].id
    closers += [c1, c2]

    async def killable():
        victim = await start_drafter(drafter_engine(module), port=base + 6, vocab=grammar)
        _, _, stub, close = await gateway(base + 7, victim.port)

        async def both():
            await close()
            await victim.stop(0)
        return stub, lambda: victim.stop(0), both

    async def close_all():
        await front.http.stop(1.0)
        for c in closers:
            await c()
        await drafter.stop(0)
        await verifier.stop(0)
    return GridTargets(stubs["plain"], stubs["main"], client, model, killable), close_all


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default assets/dspark-small)")
    ap.add_argument("--port-base", type=int, default=52600, help="ports port-base+1 .. +7")
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS), help=f"schemas (1..{len(SCHEMAS)})")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens per generation at most")
    ap.add_argument("--kills", type=int, default=6, help="generations with the drafter killed mid-way")
    args = ap.parse_args(argv)

    async def run():
        targets, close = await bundled_targets(args)
        try:
            t0 = time.perf_counter()
            rows = await run_grid(targets, list(range(args.schemas)), (0.0, 0.7, 1.0), kills=args.kills,
                                  max_tokens=args.max_tokens, log=print)
            print(f"\n== structured grid: bundled model, exact numerics, batched verify "
                  f"({time.perf_counter() - t0:.0f} s) ==")
            print(summary(rows))
        finally:
            await close()
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
