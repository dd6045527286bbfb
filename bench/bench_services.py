"""The three gRPC services vs the in-process scheduler: `python -m bench.bench_services [options]`.

Owns the measurement of what the services' gRPC hops cost per round against the same
scheduler over in-process sessions; it prints figures and never asserts them (figures of
record: bench/README.md).

One process, one run: the random tiny model (docs/model.md §13 config, max_seq_len 256), one verifier
engine, two drafters (the live oracle drafter with a corrupted slot every `--corrupt-every`
positions, and the DSpark module with its random weights), four text workloads
(docs/architecture.md §8: repeat = counting upward, code, prose, math). Every (workload, drafter, spec mode)
runs once through the services (verifier, drafter and gateway servers on localhost port 0,
real channels, OTel interceptors on) and once through the same `Scheduler` over in-process
sessions on the same engines, back to back, `--repeats` times (medians are reported), after
one warm-up generation per path.

Per row: completion tok/s of each path; the round count and acceptance; mean round wall
(`spec_decode.round` span) of each path; and per-round gRPC overhead two ways:
  A = service round wall - in-process round wall (same rounds: outputs and decisions match),
  B = service round wall - backend compute in that round (the `forward_ms` timing fields
      the verifier and drafter report for their messages),
in ms and as % of the service round wall. B also counts the gateway's own round logic.
CPU figures are for comparing the two paths in one run (docs/architecture.md §8). The
oracle drafter decodes with the target itself (its draft costs ~B target decodes), and the
random DSpark weights are rarely accepted, so speculative tok/s here say nothing about the
real model's speed-up; the overhead columns are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.app import (drafter_engine, load_drafter, load_trunk, start_drafter, start_gateway, start_verifier,
                          verifier_engine)
from services.common.server import channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
from services.gateway.gate import GateConfig
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.gateway.tokenizer import load_tokenizer
from services.verifier.batcher import StepLoop

WORKLOADS = {
    "repeat": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
}
SPECS = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS, "gated": gateway_pb2.SPEC_MODE_GATED}
CALL_TIMEOUT_S = 600.0


@dataclass
class Run:
    """One generation: tokens, wall time (s), counters, and per round: wall ms and backend compute ms."""

    tokens: list[int]
    wall_s: float
    rounds: int
    submitted: int
    accepted: int
    round_ms: list[float]
    compute_ms: list[float]

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.wall_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.submitted if self.submitted else 0.0


def _round_timings(exporter: InMemorySpanExporter) -> tuple[list[float], list[float]]:
    """(round wall ms, backend forward ms of the round's child message spans) per round span."""
    spans = exporter.get_finished_spans()
    children: dict[int, float] = {}
    for s in spans:
        fwd = s.attributes.get("verifier.forward_ms", s.attributes.get("drafter.forward_ms"))
        if fwd is not None and s.parent is not None:
            children[s.parent.span_id] = children.get(s.parent.span_id, 0.0) + fwd
    rounds = [s for s in spans if s.name == "spec_decode.round"]
    return ([(s.end_time - s.start_time) / 1e6 for s in rounds],
            [children.get(s.context.span_id, 0.0) for s in rounds])


async def run_service(stub, exporter: InMemorySpanExporter, prompt: str, spec: str, max_tokens: int) -> Run:
    exporter.clear()
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=SPECS[spec], ignore_eos=True)
    tokens, final, t0 = [], None, time.perf_counter()
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        tokens += msg.token_ids
        final = msg if msg.finished else final
    wall = time.perf_counter() - t0
    s = final.spec_stats
    return Run(tokens, wall, s.rounds, s.submitted, s.accepted, *_round_timings(exporter))


async def run_local(sched: Scheduler, exporter: InMemorySpanExporter, v_steps, d_engine, prompt: str, spec: str,
                    max_tokens: int) -> Run:
    exporter.clear()
    p = sched.params(prompt, [], max_tokens, spec, ignore_eos=True)
    verifier, drafter = LocalVerifierSession(v_steps), LocalDrafterSession(d_engine)
    tokens, final, t0 = [], None, time.perf_counter()
    try:
        async for ev in sched.generate(p, verifier, drafter):
            if isinstance(ev, FinalEvent):
                final = ev
            else:
                tokens += ev.token_ids
    finally:
        await verifier.close()
        await drafter.close()
    wall = time.perf_counter() - t0
    c = final.counters
    round_ms, _ = _round_timings(exporter)
    return Run(tokens, wall, c.rounds, c.submitted, c.accepted, round_ms, [])


def _traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def bench(args) -> None:
    trunk = load_trunk(None)
    cfg = trunk.cfg
    v_engine = verifier_engine(trunk, BackendSettings())
    d_engines = {"oracle": drafter_engine(trunk, oracle=True, settings=BackendSettings(),
                                          corrupt_every=args.corrupt_every),
                 "dspark": drafter_engine(load_drafter(None), settings=BackendSettings())}
    provider, exporter = _traced()
    verifier = await start_verifier(v_engine, provider=provider)
    v_local = StepLoop(v_engine)  # the in-process arm's own step loop over the same engine
    servers, gateways, locals_ = [verifier], {}, {}
    limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, True)
    local_provider, local_exporter = _traced()
    for name, engine in d_engines.items():
        d = await start_drafter(engine, provider=provider)
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{d.port}",
                                   verify_mode=args.verify_mode, cost_mode="configured")
        gw, _, backends = await start_gateway(settings, GateConfig(), provider=provider)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options())
        servers += [d, gw]
        gateways[name] = (gateway_pb2_grpc.GatewayStub(channel), channel, backends)
        locals_[name] = Scheduler(limits, load_tokenizer(None, cfg.vocab_size, cfg.eos_token_id), GateConfig(),
                                  args.verify_mode, "configured", local_provider)
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); tiny random model; "
              f"verify {args.verify_mode}; max_tokens {args.max_tokens}; oracle corrupt_every {args.corrupt_every}; "
              f"gate costs configured (reference defaults, docs/architecture.md §12)")
        for name in d_engines:  # warm-up, both paths
            await run_service(gateways[name][0], exporter, "warm up", "always", 12)
            await run_local(locals_[name], local_exporter, v_local, d_engines[name], "warm up", "always", 12)
        rows = []
        for workload, prompt in WORKLOADS.items():
            for drafter in d_engines:
                for spec in SPECS:
                    if spec == "off" and drafter != "oracle":
                        continue  # plain decode does not depend on the drafter
                    svc, loc = [], []
                    for _ in range(args.repeats):  # interleaved, so both paths see the same machine load
                        svc.append(await run_service(gateways[drafter][0], exporter, prompt, spec, args.max_tokens))
                        loc.append(await run_local(locals_[drafter], local_exporter, v_local, d_engines[drafter],
                                                   prompt, spec, args.max_tokens))
                    rows.append((workload, "-" if spec == "off" else drafter, spec, svc, loc))
        _report(rows)
    finally:
        for _, channel, backends in gateways.values():
            await channel.close()
            await backends.close()
        for s in reversed(servers):
            await s.stop(0)


def _median(runs: list[Run], metric) -> float:
    return statistics.median(metric(r) for r in runs)


def _report(rows) -> None:
    head = (f"{'workload':<8} {'drafter':<7} {'spec':<6} {'svc tok/s':>9} {'inproc tok/s':>12} {'svc/inproc':>10} "
            f"{'rounds':>6} {'accept':>6} {'same out':>8} {'svc round ms':>12} {'inproc round ms':>15} "
            f"{'A ms':>6} {'A %':>6} {'B ms':>6} {'B %':>6}")
    print(head)
    print("-" * len(head))
    total = {"a": 0.0, "b": 0.0, "round": 0.0, "n": 0}
    for workload, drafter, spec, svc, loc in rows:
        svc_round = _median(svc, lambda r: statistics.fmean(r.round_ms))
        loc_round = _median(loc, lambda r: statistics.fmean(r.round_ms))
        a = svc_round - loc_round
        b = _median(svc, lambda r: statistics.fmean(w - c for w, c in zip(r.round_ms, r.compute_ms)))
        svc_tok_s, loc_tok_s = _median(svc, lambda r: r.tok_s), _median(loc, lambda r: r.tok_s)
        same = all(r.tokens == svc[0].tokens for r in svc + loc)
        n = svc[0].rounds
        total.update(a=total["a"] + a * n, b=total["b"] + b * n, round=total["round"] + svc_round * n,
                     n=total["n"] + n)
        print(f"{workload:<8} {drafter:<7} {spec:<6} {svc_tok_s:>9.1f} {loc_tok_s:>12.1f} "
              f"{svc_tok_s / loc_tok_s:>10.3f} {n:>6} {svc[0].acceptance:>6.0%} {str(same):>8} {svc_round:>12.1f} {loc_round:>15.1f} "
              f"{a:>6.2f} {a / svc_round:>6.1%} {b:>6.2f} {b / svc_round:>6.1%}")
    n = total["n"]
    print(f"all {n} rounds (median run per row, weighted by rounds): A {total['a'] / n:.2f} ms/round "
          f"({total['a'] / total['round']:.1%} of a service round), B {total['b'] / n:.2f} ms/round "
          f"({total['b'] / total['round']:.1%})")
    print("A = service round wall - in-process round wall; B = service round wall - backend compute (forward_ms); "
          "same out: every run of the row, both paths, gave the same tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per generation (default 64)")
    ap.add_argument("--corrupt-every", type=int, default=7,
                    help="oracle drafter: corrupt one draft slot in N positions (default 7)")
    ap.add_argument("--verify-mode", choices=("sequential", "batched"), default="batched")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row and path; medians reported (default 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
