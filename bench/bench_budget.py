"""Load-aware verification budget against fixed draft lengths: `python -m bench.bench_budget`.

Owns the measurement of what the gate's load pricing (docs/gate.md §13) buys at several
concurrencies; it prints figures and never asserts them.

One process, every service in process on localhost port 0 with real channels: one verifier
(step loop, start-up step profile) over the model (default the bundled assets/dspark-small),
and per policy a gateway over it with its own DSpark drafter server over the same draft
module:

* plain: spec off;
* k=1..5: spec always behind a drafter that returns only the first k of its block (it still
  drafts the whole block, as a fixed-k deployment of this drafter would);
* gated: spec gated, measured costs, priced at the verifier's load (the served default);
* gated-static: the same gate with load pricing off (GatewaySettings.load_aware=False, in process).

For each concurrency in `--streams`, every policy runs `--repeats` times, interleaved (the
policy order rotates per repeat, so drift falls on all of them). A run starts that many
Generate calls at once (prompts cycle through four workloads) and scores aggregate
completion tok/s = all tokens / wall time of the slowest. Printed per concurrency: the median
and range of each policy, gated / best of {plain, k=1..5}, and for the gated policies what
their gateways' Stats counted over those runs: drafts submitted per round and the share of
plain rounds (no draft submitted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import grpc
import torch

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.app import (drafter_engine, load_drafter, load_trunk, start_drafter, start_gateway, start_verifier,
                          verifier_engine)
from services.common.server import channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.verifier.step_profile import StepProfileSettings

WORKLOADS = ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
             "The old lighthouse keeper walked slowly along the shore, watching",
             "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =")
CALL_TIMEOUT_S = 600.0
FIXED = (1, 2, 3, 4, 5)
SPEC = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
        "gated": gateway_pb2.SPEC_MODE_GATED}


class FirstK:
    """A drafter engine that returns only the first k drafts (and confidences) of each block;
    every other call goes to the wrapped engine."""

    def __init__(self, engine, k: int):
        self._engine, self._k = engine, k

    def draft(self, sid: int, anchor: int, seed_position: int):
        tokens, conf = self._engine.draft(sid, anchor, seed_position)
        return tokens[:self._k], None if conf is None else conf[:self._k]

    def __getattr__(self, name):
        return getattr(self._engine, name)


class Services:
    """The verifier, the drafters and one gateway per policy; `stubs[policy]` -> (stub, spec)."""

    def __init__(self):
        self.servers, self.closers, self.stubs = [], [], {}

    async def start(self, checkpoint: str | None) -> Services:
        trunk, module = load_trunk(checkpoint), load_drafter(checkpoint)
        engine = verifier_engine(trunk, BackendSettings(max_sessions=64))
        verifier = await start_verifier(engine, step_profile=StepProfileSettings())
        self.servers.append(verifier)
        target = f"127.0.0.1:{verifier.port}"
        policies = [("plain", None, "off", "configured", False), *((f"k={k}", k, "always", "configured", False)
                                                                    for k in FIXED),
                    ("gated", None, "gated", "measured", True), ("gated-static", None, "gated", "measured", False)]
        for name, k, spec, cost_mode, load_aware in policies:
            d_engine = drafter_engine(module, settings=BackendSettings(max_sessions=64))
            drafter = await start_drafter(FirstK(d_engine, k) if k else d_engine)
            self.servers.append(drafter)
            settings = GatewaySettings(verifier_target=target, drafter_target=f"127.0.0.1:{drafter.port}",
                                       verify_mode="batched", cost_mode=cost_mode, load_aware=load_aware)
            gw, _, backends = await start_gateway(settings, GateConfig(enabled=True), checkpoint=checkpoint)
            self.servers.append(gw)
            self.closers.append(backends.close)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options())
            self.closers.append(channel.close)
            self.stubs[name] = (gateway_pb2_grpc.GatewayStub(channel), SPEC[spec])
        return self

    async def close(self) -> None:
        for close in self.closers:
            await close()
        for s in reversed(self.servers):
            await s.stop(0)


async def generate(stub, spec: int, prompt: str, max_tokens: int) -> int:
    """Completion tokens of one generation."""
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=spec, ignore_eos=True)
    n = 0
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        n += len(msg.token_ids)
    return n


async def run_streams(stub, spec: int, streams: int, max_tokens: int) -> float:
    """Aggregate completion tok/s of `streams` concurrent generations."""
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(generate(stub, spec, WORKLOADS[i % len(WORKLOADS)], max_tokens)
                                    for i in range(streams)))
    return sum(counts) / (time.perf_counter() - t0)


async def speculation(stub) -> dict:
    """The gateway's summed speculation counters (Stats RPC)."""
    reply = await stub.Stats(gateway_pb2.StatsRequest(), timeout=30)
    return json.loads(reply.json)["speculation"]


async def measure(args) -> None:
    svc = await Services().start(args.checkpoint)
    try:
        names = list(svc.stubs)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); model {args.checkpoint}; "
              f"{args.max_tokens} tokens per stream; median of {args.repeats} (range), policies interleaved")
        for name in names:  # warm-up, and the gated gateways' first live rounds
            await run_streams(*svc.stubs[name], 2, 8)
        for streams in args.streams:
            figures = {name: [] for name in names}
            gated = [n for n in names if n.startswith("gated")]
            before = {n: await speculation(svc.stubs[n][0]) for n in gated}
            for rep in range(args.repeats):
                for i in range(len(names)):
                    name = names[(i + rep) % len(names)]
                    figures[name].append(await run_streams(*svc.stubs[name], streams, args.max_tokens))
            report(streams, figures)
            for n in gated:
                after = await speculation(svc.stubs[n][0])
                d = {k: after[k] - before[n][k] for k in ("rounds", "submitted", "plain_rounds")}
                print(f"{n}: {d['submitted'] / max(d['rounds'], 1):.2f} drafts submitted per round, "
                      f"{d['plain_rounds'] / max(d['rounds'], 1):.0%} plain rounds")
    finally:
        await svc.close()


def report(streams: int, figures: dict[str, list[float]]) -> None:
    """One concurrency's table: median and range per policy, gated / best fixed policy."""
    med = {name: statistics.median(v) for name, v in figures.items()}
    best = max((n for n in med if not n.startswith("gated")), key=med.get)
    print(f"\nstreams {streams}")
    print(f"{'policy':>12} {'tok/s':>8} {'range':>15}")
    for name, values in figures.items():
        print(f"{name:>12} {med[name]:>8.1f} {min(values):>7.1f}-{max(values):<7.1f}")
    for name in ("gated", "gated-static"):
        print(f"{name} / best ({best}) = {med[name] / med[best]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default: the bundled model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16], help="concurrencies to measure")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (policy, concurrency); the median is printed")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
