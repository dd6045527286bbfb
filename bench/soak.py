"""Soak: the three services as separate processes under 32 streams with random cancels: `python -m bench.soak`.

Owns the long-running check that serving leaks neither sessions nor memory; not in CI (it
runs for minutes). One stack of `dspark serve` processes (bench/service_procs.py; gateway
on `--port-base`, verifier + 1, drafter + 2) on `--checkpoint` (default the bundled
assets/dspark-small). `--streams` workers each run generations back to back for
`--seconds`: a random workload prompt, spec off / always / gated, 8..`--max-tokens`
tokens, greedy or (half of them) sampled at T 0.7-1.0 with top-p 0.9 under the coupled or
the rejection rule; a fraction `--cancel` of them is stopped after a random number of messages, half by
a client cancel and half by `Gateway.Abort`. Every few seconds (`--sample-s`) the resident
set size of every service process is sampled.

Reported: generations finished, cancelled and aborted; errors other than those stops
(must be 0, each named by its status code); the backends' `Info.open_sessions` after the
load stops (must return to 0); per process, the RSS after `--warmup-s` seconds, at the end,
its maximum and the growth end / warm-up - 1 (aim < 5 %). Exit status 1 when an error
happened or a session stayed open, else 0; the growth is reported, not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.bench_serving import WORKLOADS
from bench.service_procs import ServiceProcesses, StackSpec, rss_bytes
from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services.common.server import channel_options

SPECS = (gateway_pb2.SPEC_MODE_OFF, gateway_pb2.SPEC_MODE_ALWAYS, gateway_pb2.SPEC_MODE_GATED)
CALL_TIMEOUT_S = 300.0   # deadline of one Generate (s)
RPC_TIMEOUT_S = 10.0     # deadline of Abort and Info (s)
IDLE_WAIT_S = 60.0       # how long the backends may take to close every session after the load (s)


@dataclass
class Counts:
    """Outcomes of the soak's generations; `errors`: {status code name: count}."""

    finished: int = 0
    cancelled: int = 0
    aborted: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)

    def error(self, code: str, detail: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        if len(self.error_examples) < 5:
            self.error_examples.append(f"{code}: {detail}")


async def one_generation(stub, rng: random.Random, args, counts: Counts, rid: str) -> None:
    """One random generation, maybe stopped early (module docstring); its outcome lands in `counts`."""
    req = gateway_pb2.GenerateRequest(prompt=rng.choice(list(WORKLOADS.values())), ignore_eos=True,
                                      max_tokens=rng.randint(8, args.max_tokens), spec=rng.choice(SPECS),
                                      request_id=rid)
    if rng.random() < 0.5:  # sampled: both acceptance rules, with q on the wire under rejection
        req.temperature, req.top_p = rng.uniform(0.7, 1.0), 0.9
        req.sampling_rule = rng.choice((common_pb2.SAMPLING_RULE_COUPLED, common_pb2.SAMPLING_RULE_REJECTION))
    stop_after = rng.randint(1, 4) if rng.random() < args.cancel else 0
    by_abort = rng.random() < 0.5
    call = stub.Generate(req, timeout=CALL_TIMEOUT_S)
    seen, last = 0, None
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            seen, last = seen + 1, msg
            counts.tokens += len(msg.token_ids)
            if stop_after and seen == stop_after and not msg.finished:
                if not by_abort:
                    call.cancel()
                    counts.cancelled += 1
                    return
                await stub.Abort(gateway_pb2.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        counts.error(exc.code().name, exc.details() or "")
        return
    if last is None or not last.finished:
        counts.error("NO_FINAL_MESSAGE", f"{rid}: the stream ended without a final message")
    elif last.finish_reason == "abort":
        counts.aborted += 1
    else:
        counts.finished += 1


async def worker(stub, index: int, deadline: float, args, counts: Counts) -> None:
    rng = random.Random(args.seed * 1000 + index)
    n = 0
    while time.monotonic() < deadline:
        await one_generation(stub, rng, args, counts, f"soak-{index}-{n}")
        n += 1


async def sample_rss(pids: dict[str, int], t0: float, every_s: float, stop: asyncio.Event) -> list[dict]:
    """[{"t_s": seconds since t0, service: RSS bytes, ...}] every `every_s` seconds until `stop`."""
    samples = []
    while True:
        row = {"t_s": time.monotonic() - t0}
        for name, pid in pids.items():
            try:
                row[name] = rss_bytes(pid)
            except ProcessLookupError:
                row[name] = None  # it died: the soak reports that as an error
        samples.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return samples
        except asyncio.TimeoutError:
            pass


async def open_sessions(verifier, drafter) -> dict[str, int]:
    """Poll both backends' Info until no session is open or IDLE_WAIT_S passes; the last counts."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        counts = {"verifier": (await verifier.Info(common_pb2.InfoRequest(), timeout=RPC_TIMEOUT_S)).open_sessions,
                  "drafter": (await drafter.Info(common_pb2.InfoRequest(), timeout=RPC_TIMEOUT_S)).open_sessions}
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.5)


def rss_report(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per service: RSS (MiB) at the first sample after warm-up, at the end, the maximum, and
    growth end / warm-up - 1 (%). Raises ValueError when no sample follows the warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if not after:
        raise ValueError(f"no RSS sample after the warm-up of {warmup_s:g} s: run longer than --warmup-s")
    out = {}
    for name in (k for k in samples[0] if k != "t_s"):
        vals = [s[name] for s in after if s[name] is not None]
        if not vals:
            out[name] = {"error": "process gone"}
            continue
        mib = [v / 2**20 for v in vals]
        out[name] = {"warm_mib": mib[0], "end_mib": mib[-1], "max_mib": max(mib),
                     "growth_pct": (mib[-1] / mib[0] - 1) * 100}
    return out


async def soak(args, env: dict[str, str]) -> dict:
    """Start the stack, run the load with the RSS sampler, check the sessions, stop; the report."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="soak_"))
    spec = StackSpec(args.checkpoint, args.port_base, log_dir, args.numerics, max_sessions=args.streams + 8,
                     threads=args.threads)
    procs = ServiceProcesses(spec, env)
    try:
        print(f"services starting (logs in {log_dir})", flush=True)
        print(f"serving after {await procs.wait_serving():.0f} s; {args.streams} streams for {args.seconds:g} s",
              flush=True)
        async with grpc.aio.insecure_channel(spec.gateway_target, options=channel_options()) as gch, \
                grpc.aio.insecure_channel(spec.verifier_target, options=channel_options()) as vch, \
                grpc.aio.insecure_channel(spec.drafter_target, options=channel_options()) as dch:
            counts, stop = Counts(), asyncio.Event()
            t0 = time.monotonic()
            sampler = asyncio.create_task(sample_rss(procs.pids, t0, args.sample_s, stop))
            stub = gateway_pb2_grpc.GatewayStub(gch)
            await asyncio.gather(*(worker(stub, i, t0 + args.seconds, args, counts) for i in range(args.streams)))
            load_s = time.monotonic() - t0
            sessions = await open_sessions(verifier_pb2_grpc.VerifierStub(vch), drafter_pb2_grpc.DrafterStub(dch))
            stop.set()
            samples = await sampler
    finally:
        procs.stop()
    dead = {n: rc for n, rc in procs.exited().items() if rc not in (0, -15)}
    return {"counts": counts.__dict__, "open_sessions_after": sessions, "load_s": load_s,
            "tok_s": counts.tokens / load_s, "rss": rss_report(samples, args.warmup_s), "rss_samples": samples,
            "unclean_exits": dead, "args": {k: v for k, v in vars(args).items() if k != "json"}}


def print_report(rep: dict, args) -> bool:
    """Print the report; True when the soak passed (no error, no session left open)."""
    c = rep["counts"]
    print(f"\n{rep['load_s']:.0f} s of load: {c['finished']} finished, {c['cancelled']} cancelled, "
          f"{c['aborted']} aborted; {c['tokens']} tokens streamed ({rep['tok_s']:.1f} tok/s)")
    errors = sum(c["errors"].values())
    print(f"errors other than cancels: {errors} {c['errors'] or ''}")
    for example in c["error_examples"]:
        print(f"  {example}")
    print(f"open sessions after the load: {rep['open_sessions_after']}")
    print(f"\nRSS (MiB) from {args.warmup_s:g} s on, sampled every {args.sample_s:g} s:")
    print(f"{'service':<9} {'warm':>8} {'end':>8} {'max':>8} {'growth':>8}")
    for name, r in rep["rss"].items():
        if "error" in r:
            print(f"{name:<9} {r['error']}")
            continue
        print(f"{name:<9} {r['warm_mib']:>8.1f} {r['end_mib']:>8.1f} {r['max_mib']:>8.1f} {r['growth_pct']:>7.2f}%")
    grown = [n for n, r in rep["rss"].items() if "error" in r or r["growth_pct"] >= 5]
    print(f"aim RSS growth < 5 % for every service: {'met' if not grown else 'missed (' + ', '.join(grown) + ')'}")
    if rep["unclean_exits"]:
        print(f"services that did not stop cleanly: {rep['unclean_exits']}")
    return errors == 0 and not any(rep["open_sessions_after"].values()) and not rep["unclean_exits"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder ('' = the random tiny model)")
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the load runs (s)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent client streams")
    ap.add_argument("--max-tokens", type=int, default=64, help="longest generation (tokens; at least 8)")
    ap.add_argument("--cancel", type=float, default=0.2, help="fraction of generations stopped early")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="the RSS curve starts after this (s)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period (s)")
    ap.add_argument("--numerics", choices=["fast", "exact"], default="fast", help="the verifier's numerics")
    ap.add_argument("--port-base", type=int, default=50350, help="gateway port (verifier +1, drafter +2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service process")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random requests and stops")
    ap.add_argument("--json", default=None, help="write the report (with every RSS sample) to this file")
    ap.add_argument("--log-dir", default=None, help="the services' logs (default: a new temporary folder)")
    args = ap.parse_args(argv)
    if not args.seconds > 0 or not args.sample_s > 0 or args.warmup_s < 0:
        ap.error(f"--seconds={args.seconds}, --sample-s={args.sample_s} must be > 0, --warmup-s={args.warmup_s} >= 0")
    if args.warmup_s >= args.seconds:
        ap.error(f"--warmup-s={args.warmup_s} must be below --seconds={args.seconds}")
    if args.streams < 1 or args.threads < 1 or args.max_tokens < 8:
        ap.error(f"--streams={args.streams}, --threads={args.threads} must be >= 1, --max-tokens={args.max_tokens} >= 8")
    if not 0 <= args.cancel <= 1:
        ap.error(f"--cancel={args.cancel}: must be in [0, 1]")
    args.checkpoint = args.checkpoint or None
    return args


def main() -> None:
    args = parse_args()
    env = dict(os.environ)  # the entry point's one read of the environment, passed down
    rep = asyncio.run(soak(args, env))
    ok = print_report(rep, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
        print(f"wrote {args.json}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
