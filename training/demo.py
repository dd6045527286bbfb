"""The main job (`make demo`): the bundled model served by the three services, plain vs speculative.

Owns the end-to-end measurement a user runs first: it drives the services only as a client
would (through the gateway, or `dspark up` as a subprocess) and never reaches into their
engines, except to load a trunk of its own for the divergence margins.

    python -m training.demo [--checkpoint assets/dspark-small] [--max-tokens 64] [--repeats 3] [--record-rounds FILE]
    python -m training.demo --calibration 320 --record-rounds tests/data/bundled_rounds.json   # + ~1,000 rounds

Starts `dspark up --checkpoint assets/dspark-small` (the verifier, drafter and gateway as three
processes on localhost, `--port-base`, default 50150: gateway, verifier +1, drafter +2; batched
verify), waits for the gateway's gRPC health check, then generates greedily for four prompts
— repeat (counting upward), code, prose, math — three ways each: plain decode (spec off),
always-k (every round verifies the whole drafted block) and gated (the confidence gate picks k
each round), all through the gateway as any client would (`dspark generate` does the same).
The gate is the one `dspark up` runs: the demo sets no gate variable, so the gateway prices
rounds with the costs it profiled at start-up and refines online (docs/gate.md §12). Each
prompt runs `--repeats` repetitions; within one repetition the three modes run back to back,
in an order rotated by the repetition (`interleaved_order`), so drift on the machine falls on
every mode alike. The first gated generation of each prompt is streamed to the terminal.

Table per prompt and mode: completion tokens, accept rate (accepted / submitted drafts, over
the repetitions), mean acceptance length (tokens per verify round, bonus included, as the
gateway reports it), the median tok/s, the median of the per-repetition ratios to plain with
their range (min–max, `ratio_summary`), and where the first repetition's output first diverges
from plain: the token index
and the trunk's top-1 minus top-2 logit margin there on the plain path (batched speculative
verify is not guaranteed bitwise identical to plain decode unless exact mode is on; a
divergence at a near-tie margin is that rounding, not a bug). Then the per-position
acceptance h(j) = P(match at j | all before matched) of the always-k rounds and the gate's
calibration (confidence bucket, verified drafts n, match rate; censored as `Gate.observe`
counts them; buckets with fewer than `--min-bucket` drafts merged into a neighbour).

`--calibration TOKENS` adds always-k generations on four more prompts per workload
(`CALIBRATION_PROMPTS`) whose rounds only feed h(j), the calibration table, the live-vs-replay
table and the recorded file. The rounds come from the gateway's own recorder (`dspark up
--record-rounds`, written when the services stop): the first repetition's always-k generations
carry the workload name as their label, the others a label the tables drop. `--record-rounds FILE` keeps the
always-k rounds (replay format, `dspark replay FILE`); the draft/decode line compares the
drafter call's median wall with plain decode's median ms per token. The divergence margins
come from the trunk loaded in this process (the verifier's loader).

Timings are CPU figures of this machine (docs/architecture.md §8): compare the ratios and their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import grpc
import torch

DEFAULT_CHECKPOINT = Path("assets/dspark-small")
WORKLOADS = {
    "repeat": "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
}
# More prompts per workload for `--calibration`: always-k generations whose rounds only feed
# h(j), the calibration table and the recorded file (not the table).
CALIBRATION_PROMPTS = {
    "repeat": ["10, 11, 12, 13, 14, 15, 16, 17,", "alpha, beta, gamma, alpha, beta, gamma, alpha, beta,",
               "x = 1\nx = 1\nx = 1\nx = 1\n", "100, 101, 102, 103, 104, 105,"],
    "code": ["import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n        self.items = []\n",
             "for i in range(10):\n    if i % 2 == 0:\n", "    def __repr__(self):\n        return"],
    "prose": ["This program is free software; you can redistribute it and/or modify",
              "The following options are available:", "NAME\n       ls - list directory contents\n",
              "Permission is hereby granted, free of charge, to any person"],
    "math": ["12 + 30 = 42\n7 * 8 =", "Compute 15 * 4 = 60. Then 60 - 25 =", "2 + 2 = 4\n3 + 5 = 8\n9 + 1 =",
             "Solve for y: 2y - 4 = 10. Add 4 to both sides: 2y ="],
}
MODES = ("off", "always", "gated")
MODE_NAMES = {"off": "plain", "always": "always-k", "gated": "gated"}
CALL_TIMEOUT_S = 600.0


@dataclass
class Generation:
    tokens: list[int]
    text: str
    wall_s: float
    rounds: int
    submitted: int
    accepted: int
    mean_len: float

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.submitted if self.submitted else None


async def generate(stub, prompt: str, mode: str, max_tokens: int, label: str, stream: bool) -> Generation:
    from dspark_proto.v1 import gateway_pb2
    spec = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
            "gated": gateway_pb2.SPEC_MODE_GATED}[mode]
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=spec, ignore_eos=True, label=label)
    tokens, final, t0 = [], None, time.perf_counter()
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        tokens += msg.token_ids
        if stream and msg.text_delta:
            print(msg.text_delta, end="", flush=True)
        final = msg if msg.finished else final
    wall = time.perf_counter() - t0
    s = final.spec_stats
    return Generation(tokens, final.text, wall, s.rounds, s.submitted, s.accepted, s.mean_acceptance_length)


@dataclass(frozen=True)
class RatioSummary:
    """A mode's speed against plain over repetitions: the median of the per-repetition ratios
    tok/s(mode) / tok/s(plain) and their range (min, max); `repeats` ratios behind them."""

    median: float
    low: float
    high: float
    repeats: int


def interleaved_order(modes: Sequence[str], repetition: int) -> list[str]:
    """The modes of repetition `repetition` (0-based), rotated left by it: every mode runs
    first, second and third equally often over len(modes) repetitions."""
    shift = repetition % len(modes)
    return list(modes[shift:]) + list(modes[:shift])


def ratio_summary(tok_s: Mapping[str, Sequence[float]], baseline: str = "off") -> dict[str, RatioSummary]:
    """Per mode, the ratios to `baseline` paired by repetition (tok_s[mode][r] / tok_s[baseline][r]).

    tok_s: mode -> tok/s per repetition (same length for every mode, > 0 for the baseline).
    Raises ValueError naming the mode whose repetition count differs from the baseline's, or
    when the baseline has no repetition or a tok/s <= 0.
    """
    base = list(tok_s[baseline])
    if not base or min(base) <= 0:
        raise ValueError(f"baseline {baseline!r} tok/s={base}: needs at least one repetition, each > 0")
    out = {}
    for mode, values in tok_s.items():
        if len(values) != len(base):
            raise ValueError(f"mode {mode!r} has {len(values)} repetitions, {baseline!r} has {len(base)}")
        ratios = [v / b for v, b in zip(values, base)]
        out[mode] = RatioSummary(statistics.median(ratios), min(ratios), max(ratios), len(ratios))
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal over the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@torch.no_grad()
def margin_at(trunk, prompt_ids: list[int], plain: list[int], i: int) -> float:
    """The trunk's top-1 minus top-2 logit at completion index i on the plain path."""
    st = trunk.new_state()
    logits = trunk.prefill(st, torch.tensor(prompt_ids + plain[:i]), taps=False).logits
    top = logits.topk(2).values
    return float(top[0] - top[1])


def position_acceptance(rounds, block: int) -> list[tuple[int, int, float | None]]:
    """(j, decided, h(j)) over rounds: position j is decided when every earlier one matched and j < submitted."""
    decided, matched = [0] * block, [0] * block
    for r in rounds:
        for j in range(min(r.accepted + 1, r.submitted)):
            decided[j] += 1
            matched[j] += j < r.accepted
    return [(j, decided[j], matched[j] / decided[j] if decided[j] else None) for j in range(block)]


def calibration_table(rounds, min_n: int) -> list[tuple[str, int, float]]:
    """(bucket label(s), n, match rate) of the gate's confidence buckets, sparse ones merged upward."""
    from services.gateway.gate import NUM_BUCKETS, bucket_index, bucket_label
    observed, matched = [0] * NUM_BUCKETS, [0] * NUM_BUCKETS
    for r in rounds:
        for pos in range(min(r.accepted + 1, r.submitted)):
            b = bucket_index(r.confidence_logits[pos])
            observed[b] += 1
            matched[b] += pos < r.accepted
    rows, start, n, m = [], None, 0, 0
    for b in range(NUM_BUCKETS):
        if observed[b] == 0 and n == 0:
            continue
        start = b if n == 0 else start
        n, m = n + observed[b], m + matched[b]
        if n >= min_n:
            label = bucket_label(start) if start == b else f"{bucket_label(start)} .. {bucket_label(b)}"
            rows.append((label, n, m / n))
            n, m = 0, 0
    if n:  # a sparse tail joins the last row
        if rows:
            label, n0, r0 = rows.pop()
            rows.append((f"{label.split(' .. ')[0]} .. {bucket_label(NUM_BUCKETS - 1)}", n0 + n, (r0 * n0 + m) / (n0 + n)))
        else:
            rows.append((f"{bucket_label(start)} ..", n, m / n))
    return rows


def fmt(x: float | None, spec: str) -> str:
    """`x` formatted by `spec`, or "-" right-aligned to the spec's width when None."""
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return "-".rjust(width) if x is None else format(x, spec)


class Services:
    """`dspark up` as a child process group: start, wait until the gateway serves, stop.

    Raises:
        RuntimeError: the services exit or the gateway is not SERVING within `timeout_s` (s).
    """

    def __init__(self, checkpoint: Path, port_base: int, record: Path, timeout_s: float = 300.0):
        from services.common.ports import check_ports_free
        from services.serve_cli import up_ports
        # never talk to someone else's services; the probe treats a port in TIME_WAIT (left by
        # the previous run's connections) as free, as the gRPC servers that bind it will
        try:
            check_ports_free("127.0.0.1", {f"{name} (--port-base={port_base})": port
                                           for name, port in up_ports(port_base).items()})
        except ValueError as exc:
            raise RuntimeError(f"{exc}; choose another --port-base") from None
        env = dict(os.environ, DSPARK_VERIFY_MODE="batched")
        cmd = [sys.executable, "-m", "services.cli", "up", "--checkpoint", str(checkpoint),
               "--port-base", str(port_base), "--record-rounds", str(record)]
        self.target, self.timeout_s = f"127.0.0.1:{port_base}", timeout_s
        self.log = record.with_suffix(".log")  # the services' own output, shown when they fail
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_serving(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + self.timeout_s
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dspark up exited with status {self.proc.returncode} before serving")
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {self.target} not serving within {self.timeout_s:g} s")
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM `dspark up` (it stops its children; the gateway writes the rounds), then wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


async def run(args) -> int:
    from services.app import load_trunk
    from services.gateway.rounds import RoundLog, load_rounds, save_rounds
    from services.gateway.tokenizer import load_tokenizer

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        print(f"demo: no checkpoint at {ckpt} (expected the bundled model, assets/dspark-small)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dspark-demo-") as tmp:
        record = Path(tmp) / "rounds.json"
        try:
            services = Services(ckpt, args.port_base, record)
        except (RuntimeError, ValueError) as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        failure = None
        try:
            print(f"starting `dspark up --checkpoint {ckpt} --port-base {args.port_base}` ...", flush=True)
            await services.wait_serving()
            trunk = load_trunk(str(ckpt), model=args.model)  # only for the divergence margins
            cfg = trunk.cfg
            print(f"bundled model {ckpt} (config {cfg.config_hash()}, {cfg.n_layers} layers + {cfg.n_mtp_layers} "
                  f"DSpark stages, block {cfg.dspark_block_size}) behind `dspark up` (gateway {services.target}, "
                  f"three processes); serving after {time.perf_counter() - t0:.1f} s; torch {torch.__version__}")
            results, costs = await generate_all(services.target, args)
        except (RuntimeError, grpc.aio.AioRpcError) as exc:
            failure = exc
        finally:
            services.stop()
        if failure is not None:
            print(f"demo: {failure}\n--- the services' output (last lines):\n{services.log_tail()}", file=sys.stderr)
            return 1
        if services.proc.returncode not in (0, -signal.SIGTERM):
            print(f"demo: dspark up exited with status {services.proc.returncode}\n{services.log_tail()}",
                  file=sys.stderr)
            return 1
        recorded = load_rounds(record).rounds
    # the drafted rounds only: the recorder also keeps undrafted ones (their plain-decode time)
    always = [r for r in recorded if r.workload in WORKLOADS and r.confidence_logits]
    if args.record_rounds:
        save_rounds(RoundLog(tuple(always), {"source": "training.demo (always-k rounds)", "checkpoint": str(ckpt),
                                             "max_tokens": args.max_tokens}), args.record_rounds)
    tok = load_tokenizer(str(ckpt), cfg.vocab_size, cfg.eos_token_id)
    print_tables(args, cfg, trunk, tok, results, always, recorded)
    print_costs(costs)
    return 0


async def generate_all(target: str, args) -> tuple[dict[str, dict[str, list[Generation]]], dict]:
    """The table's generations (and the calibration ones) through the gateway at `target`:
    (workload -> mode -> one Generation per repetition (`args.repeats`, modes interleaved),
    the gateway's Stats `costs` and `cost_mode` afterwards).

    Labels: the first repetition's always-k generations carry the workload name (their rounds
    feed the tables); the others a label the tables drop.
    """
    from services.common.server import channel_options
    from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for mode in MODES:  # warm-up: first-call costs, and the measured cost model gets samples
            await generate(stub, "0 1 2 3", mode, 16, "warmup", stream=False)
        results: dict[str, dict[str, list[Generation]]] = {}
        for name, prompt in WORKLOADS.items():
            results[name] = {mode: [] for mode in MODES}
            print(f"\n--- {name}: {prompt!r} (gated, streamed)\n{prompt}", end="", flush=True)
            for rep in range(args.repeats):
                for mode in interleaved_order(("gated", "off", "always"), rep):
                    label = name if mode == "always" and rep == 0 else f"{mode}-{name}-{rep}"
                    results[name][mode].append(await generate(stub, prompt, mode, args.max_tokens, label,
                                                              stream=mode == "gated" and rep == 0))
                    if mode == "gated" and rep == 0:
                        print(f"\n  (repetitions: {args.repeats}, modes interleaved) ", end="", flush=True)
                print(".", end="", flush=True)
            print()
        if args.calibration:
            print(f"\ncalibration rounds: {sum(map(len, CALIBRATION_PROMPTS.values()))} more always-k generations "
                  f"of {args.calibration} tokens ...", flush=True)
            for name, prompts in CALIBRATION_PROMPTS.items():
                for prompt in prompts:
                    await generate(stub, prompt, "always", args.calibration, name, stream=False)
        stats = json.loads((await stub.Stats(gateway_pb2.StatsRequest(), timeout=CALL_TIMEOUT_S)).json)
    return results, dict(stats["costs"], mode=stats["cost_mode"])


def print_costs(costs: dict) -> None:
    """The gate costs the gateway had in force at the end (ms) and where each came from."""
    values, sources = costs["in_force"], costs["sources"]
    table = values["verify_table"]
    verify = (" ".join(f"{ms:.1f}" for ms in table) + f" (k = 1..{len(table)})" if table is not None
              else f"{values['verify_base_ms']:.1f} + {values['verify_slope_ms']:.1f}·k")
    print(f"\ngate costs in force (DSPARK_GATE_COSTS={costs['mode']}): draft {values['draft_ms']:.1f} ms "
          f"[{sources['draft_ms']}], verify {verify} ms [{sources['verify_base_ms']}], plain "
          f"{values['plain_ms']:.1f} ms [{sources['plain_ms']}], commit {values['commit_ms']:.1f} ms "
          f"[{sources['commit_ms']}]")
    if costs.get("profile"):
        p = costs["profile"]
        print(f"start-up profile ({p['elapsed_s']:.1f} s, {p['repeats']} samples per cost): gRPC overhead per call "
              + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in p["rpc_overhead_ms"].items()))
    elif costs.get("profile_error"):
        print(f"start-up profile failed: {costs['profile_error']}")


def print_tables(args, cfg, trunk, tok, results, always, recorded) -> None:
    """The demo table, h(j), the calibration table, live vs replay, and the draft/decode line."""
    summaries = {name: ratio_summary({m: [g.tok_s for g in gens] for m, gens in by.items()})
                 for name, by in results.items()}
    print(f"\nmedian of {args.repeats} interleaved repetitions per cell; x plain: median of the per-repetition "
          f"ratios, range min-max")
    print(f"{'workload':8} {'mode':9} {'tokens':>6} {'accept':>7} {'mean len':>8} {'tok/s':>7} {'x plain':>7} "
          f"{'range':>11}  first divergence from plain")
    for name, by in results.items():
        plain = by["off"][0]
        prompt_ids = tok.encode(WORKLOADS[name])
        for mode in MODES:
            gens, r = by[mode], summaries[name][mode]
            div = "-" if mode == "off" else "none"
            if mode != "off":
                i = first_divergence(plain.tokens, gens[0].tokens)
                if i is not None:
                    margin = margin_at(trunk, prompt_ids, plain.tokens, i)
                    div = f"token {i} (margin {fmt(margin, '.3f')})"
            submitted = sum(g.submitted for g in gens)
            acc = None if mode == "off" or not submitted else sum(g.accepted for g in gens) / submitted
            mlen = None if mode == "off" else statistics.median(g.mean_len for g in gens)
            tok_s = statistics.median(g.tok_s for g in gens)
            print(f"{name:8} {MODE_NAMES[mode]:9} {len(gens[0].tokens):6d} {fmt(acc, '7.1%')} {fmt(mlen, '8.2f')} "
                  f"{tok_s:7.1f} {r.median:7.2f} {f'{r.low:.2f}-{r.high:.2f}':>11}  {div}")
    verified = [r for r in always if r.submitted > 0]
    print(f"\nper-position acceptance h(j) = P(match at j | all before matched), {len(verified)} always-k rounds:")
    print("  " + "  ".join(f"h({j})={fmt(h, '.2f')} (n={n})" for j, n, h in position_acceptance(verified, cfg.dspark_block_size)))
    print(f"\ncalibration of the confidence head (bucket, verified drafts n, match rate; under {args.min_bucket} merged):")
    for label, n, rate in calibration_table(verified, args.min_bucket):
        print(f"  {label:>24} {n:6d} {rate:7.1%}")
    if verified:
        from services.analysis.replay import replay_log
        from services.gateway.rounds import RoundLog
        rep = replay_log(RoundLog(tuple(always), {}), args.gate)
        print("\nlive (median x plain) vs replay of the first repetition's always-k rounds (`dspark replay`, "
              "its configured costs): x plain")
        print(f"{'workload':8} {'live always-k':>13} {'replay always-k':>15} {'live gated':>10} {'replay gated':>12}")
        for w in rep.workloads:
            live = summaries.get(w.name)
            if live is None:
                continue
            rp = w.results["plain"].tok_s
            print(f"{w.name:8} {live['always'].median:13.2f} {w.results['always-k'].tok_s / rp:15.2f} "
                  f"{live['gated'].median:10.2f} {w.results['gated'].tok_s / rp:12.2f}")
    draft_ms = sorted(r.draft_ms for r in recorded if r.draft_ms is not None)
    plain_ms = sorted(1e3 * g.wall_s / max(1, len(g.tokens)) for by in results.values() for g in by["off"])
    if draft_ms and plain_ms:
        d, p = draft_ms[len(draft_ms) // 2], plain_ms[len(plain_ms) // 2]
        print(f"\ndraft round {d:.1f} ms (median of {len(draft_ms)}, drafter call as the gateway sees it) vs plain "
              f"decode {p:.1f} ms/token (median over the plain generations): draft/decode = {d / p:.2f}")
    if args.record_rounds:
        print(f"\nrecorded {len(always)} always-k rounds to {args.record_rounds} (replay: dspark replay {args.record_rounds})")


def main() -> None:
    ap = argparse.ArgumentParser(description="The main job: the bundled model served by the three services.")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved repetitions of plain, always-k and gated per prompt (default 3)")
    ap.add_argument("--record-rounds", default=None, help="write the recorded rounds to FILE (replay format)")
    ap.add_argument("--calibration", type=int, default=0, metavar="TOKENS",
                    help="also run always-k generations of TOKENS tokens on more prompts per workload, for "
                         "h(j), the calibration table and --record-rounds (default 0: none)")
    ap.add_argument("--min-bucket", type=int, default=30, help="merge calibration buckets with fewer drafts")
    ap.add_argument("--port-base", type=int, default=50150,
                    help="gateway port of `dspark up`; verifier +1, drafter +2 (default 50150)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the divergence margins)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats}: must be >= 1")
    from services.settings import gate_config, model_settings
    try:  # this process's own model (the margins) and the replay's gate, as the services read them
        args.gate, args.model = gate_config(os.environ), model_settings(os.environ)
    except ValueError as exc:
        sys.exit(f"demo: {exc}")
    torch.set_num_threads(args.threads)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
