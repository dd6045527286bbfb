"""Plain decode under concurrency, the step loop with and without its gather wait:
`python -m bench.bench_concurrency`.

Owns the measurement of what the verifier's step loop (services/verifier/batcher.py) and its
gather wait (services/common/schedule.py) buy when several generations stream at once; it
prints figures and never asserts them.

One process: the random tiny model (or `--checkpoint`, e.g. assets/dspark-small), two
verifiers over their own engines on the same trunk, one whose step loop starts a step as
soon as work is queued and one that gathers for up to GATHER_S, each behind its own gateway
(no drafter: spec off, plain decode), all on localhost port 0 with real channels. For each
concurrency in `--streams`, both paths run `--repeats` times interleaved so both see the
same machine load, after one warm-up each. A run
starts that many Generate calls at once (prompts cycle through four workloads) and reports
aggregate completion tok/s = all streams' tokens / wall time of the slowest; the medians
are printed, with the step loop's mean sessions per batch step from its Info.

`--check-fast-batched` adds, on the same tiny model with fast numerics, the live oracle
drafter (one corrupted slot in 3) and batched verify: 8 concurrent speculative generations
against their solo runs through the step loop, reporting how many match token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc
import torch

from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services.app import drafter_engine, load_trunk, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.server import channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig

WORKLOADS = ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
             "The old lighthouse keeper walked slowly along the shore, watching",
             "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =")
CALL_TIMEOUT_S = 600.0
PATHS = ("no gather", "gather")
GATHER_S = 0.05  # what `dspark serve` gathers by default (DSPARK_STEP_GATHER_MS)


class Path:
    """A verifier (step loop gathering or not) and a gateway over it, with a client stub."""

    def __init__(self):
        self.servers, self.closers = [], []
        self.stub = self.verifier_stub = None

    async def start(self, trunk, checkpoint, gather_s: float, drafter=None, verify_mode: str = "sequential"):
        engine = verifier_engine(trunk, BackendSettings(max_sessions=64))
        verifier = await start_verifier(engine, gather_s=gather_s)
        self.servers.append(verifier)
        target = ""
        if drafter is not None:
            d = await start_drafter(drafter)
            self.servers.append(d)
            target = f"127.0.0.1:{d.port}"
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=target,
                                   verify_mode=verify_mode, cost_mode="configured")
        gw, _, backends = await start_gateway(settings, GateConfig(), checkpoint=checkpoint)
        self.servers.append(gw)
        self.closers.append(backends.close)
        for port, cls in ((gw.port, gateway_pb2_grpc.GatewayStub), (verifier.port, verifier_pb2_grpc.VerifierStub)):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
            self.closers.append(channel.close)
            stub = cls(channel)
            if cls is gateway_pb2_grpc.GatewayStub:
                self.stub = stub
            else:
                self.verifier_stub = stub
        return self

    async def close(self) -> None:
        for close in self.closers:
            await close()
        for s in reversed(self.servers):
            await s.stop(0)


async def generate(stub, prompt: str, max_tokens: int, spec: int = gateway_pb2.SPEC_MODE_OFF) -> list[int]:
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=spec, ignore_eos=True)
    tokens = []
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        tokens += list(msg.token_ids)
    return tokens


async def run_streams(stub, streams: int, max_tokens: int) -> float:
    """Aggregate completion tok/s of `streams` concurrent plain generations."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(generate(stub, WORKLOADS[i % len(WORKLOADS)], max_tokens) for i in range(streams)))
    return sum(map(len, outs)) / (time.perf_counter() - t0)


async def throughput(args) -> None:
    trunk = load_trunk(args.checkpoint)
    paths = {name: await Path().start(trunk, args.checkpoint, GATHER_S if name == "gather" else 0.0)
             for name in PATHS}
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); model "
              f"{args.checkpoint or 'random tiny'}; plain decode (spec off), {args.max_tokens} tokens per stream; "
              f"median of {args.repeats}, paths interleaved")
        for p in paths.values():
            await run_streams(p.stub, 2, 8)  # warm-up
        print(f"{'streams':>7} {'no-gather tok/s':>15} {'gather tok/s':>12} {'gather/none':>11} "
              f"{'sessions/step':>13} {'step ms':>7}")
        for streams in args.streams:
            figures = {name: [] for name in PATHS}
            info0 = await paths["gather"].verifier_stub.Info(common_pb2.InfoRequest(), timeout=10)
            for _ in range(args.repeats):
                for name in PATHS:
                    figures[name].append(await run_streams(paths[name].stub, streams, args.max_tokens))
            info1 = await paths["gather"].verifier_stub.Info(common_pb2.InfoRequest(), timeout=10)
            n = info1.steps - info0.steps
            sessions = (info1.batch_size_mean * info1.steps - info0.batch_size_mean * info0.steps) / max(n, 1)
            ms = (info1.step_ms_mean * info1.steps - info0.step_ms_mean * info0.steps) / max(n, 1)
            th, st = (statistics.median(figures[k]) for k in PATHS)
            print(f"{streams:>7} {th:>15.1f} {st:>12.1f} {st / th:>11.2f} {sessions:>13.2f} {ms:>7.2f}")
    finally:
        for p in paths.values():
            await p.close()


async def check_fast_batched(args) -> None:
    trunk = load_trunk(None)
    oracle = drafter_engine(trunk, oracle=True, settings=BackendSettings(max_sessions=64), corrupt_every=3)
    path = await Path().start(trunk, None, 0.0, drafter=oracle, verify_mode="batched")
    try:
        spec = gateway_pb2.SPEC_MODE_ALWAYS
        prompts = [WORKLOADS[i % 4] + " " * (i // 4) for i in range(8)]
        solo = [await generate(path.stub, p, 24 + 4 * i, spec) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(generate(path.stub, p, 24 + 4 * i, spec) for i, p in enumerate(prompts)))
        same = sum(a == b for a, b in zip(solo, together))
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(solo, together)]
        print(f"fast numerics, batched verify, 8 concurrent speculative generations: {same}/8 equal their solo "
              f"runs; first differing token per generation: {first}")
    finally:
        await path.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="model folder (default: the random tiny model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8], help="concurrencies to measure")
    ap.add_argument("--max-tokens", type=int, default=48, help="completion tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (path, concurrency); the median is printed")
    ap.add_argument("--check-fast-batched", action="store_true", help="also run the fast batched-verify check")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (bench/README.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(throughput(args))
    if args.check_fast_batched:
        asyncio.run(check_fast_batched(args))


if __name__ == "__main__":
    main()
