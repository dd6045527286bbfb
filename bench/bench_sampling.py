"""Speculative sampling: `python -m bench.bench_sampling [options]`.

Owns the measurement of speculative sampling on the bundled model: at temperature 0 / 0.7 /
1.0 (top-p 1), greedy vs probabilistic drafting x the coupled vs the rejection rule, against
plain sampling at the same temperature. It prints figures and never asserts them (figures of
record: bench/README.md).

One process: the bundled model (`--checkpoint`, default assets/dspark-small), one verifier
engine and one DSpark drafter engine, the same `Scheduler` the gateway runs over in-process
sessions (no gRPC: the arms differ only in how drafts are made and judged), always-k
speculation, the four workload prompts of bench_services (repeat, code, prose, math). Arms:
  plain            spec off (the baseline of every ratio at that temperature);
  greedy/coupled   the drafter proposes its argmax; the coupled rule;
  greedy/rejection the drafter proposes its argmax, q one-hot on it; the rejection rule;
  prob/coupled     the drafter draws from its own distribution with the TOKEN stream's noise;
  prob/rejection   the drafter draws from its own distribution with its DRAFT stream.
Arms run interleaved (every arm once per repeat, in turn) so they share the machine's load;
each cell is the median of `--repeats` runs with the range (min-max) of tok/s. A run uses a
fixed seed per (workload, repeat), so every arm of a repeat samples with the same seed.

Per cell: acceptance rate (accepted / submitted drafts), mean acceptance length (tokens per
verify round, bonus included), tok/s and tok/s relative to plain at the same temperature.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import torch

from dsv4.sampling import GREEDY, SamplingParams
from services.app import drafter_engine, load_drafter, load_trunk, verifier_engine
from services.common.settings import BackendSettings
from services.gateway.backends import DraftReply, LocalDrafterSession, LocalVerifierSession
from services.gateway.gate import GateConfig
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.gateway.tokenizer import load_tokenizer
from services.verifier.batcher import StepLoop

from bench.bench_services import WORKLOADS

TEMPERATURES = (0.0, 0.7, 1.0)
ARMS = ("plain", "greedy/coupled", "greedy/rejection", "prob/coupled", "prob/rejection")


class GreedyDrafts(LocalDrafterSession):
    """A drafter session that proposes its argmax whatever the request's sampling (the draft
    vLLM measured collapsing at T > 0); under the rejection rule its q is one-hot on the
    proposal, the distribution it was in fact drawn from."""

    async def draft(self, anchor, seed_position, trace, sampling=GREEDY):
        reply = await super().draft(anchor, seed_position, trace, GREEDY)
        if sampling.greedy or sampling.rule != "rejection":
            return reply
        vocab = self.engine.identity()["vocab_size"]
        q = torch.nn.functional.one_hot(torch.tensor(reply.tokens, dtype=torch.int64), vocab).float()
        return DraftReply(reply.tokens, reply.confidence_logits, reply.forward_ms, q.reshape(len(reply.tokens), vocab))


@dataclass
class Run:
    """One generation: completion tokens, wall time (s), drafts submitted and accepted, and the
    mean acceptance length (tokens per verify round, bonus included)."""

    tokens: int
    wall_s: float
    submitted: int
    accepted: int
    mean_len: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.submitted if self.submitted else 0.0


async def run_arm(sched: Scheduler, v_steps, d_engine, prompt: str, arm: str, temperature: float, seed: int,
                  max_tokens: int) -> Run:
    """One generation of `arm` (see the module docstring) at `temperature` with `seed`."""
    rule = arm.split("/")[-1] if "/" in arm else "coupled"
    sampling = SamplingParams(temperature=temperature, seed=seed, rule=rule)
    spec = "off" if arm == "plain" else "always"
    p = sched.params(prompt, [], max_tokens, spec, ignore_eos=True, sampling=sampling)
    verifier = LocalVerifierSession(v_steps)
    drafter = (GreedyDrafts if arm.startswith("greedy") else LocalDrafterSession)(d_engine)
    tokens, final, t0 = 0, None, time.perf_counter()
    try:
        async for ev in sched.generate(p, verifier, drafter):
            if isinstance(ev, FinalEvent):
                final = ev
            else:
                tokens += len(ev.token_ids)
    finally:
        await verifier.close()
        await drafter.close()
    c = final.counters
    return Run(tokens, time.perf_counter() - t0, c.submitted, c.accepted, c.mean_acceptance_length)


async def bench(args) -> dict:
    """Every (temperature, workload, arm) `--repeats` times, interleaved; returns the runs."""
    trunk = load_trunk(args.checkpoint)
    cfg = trunk.cfg
    v_engine = StepLoop(verifier_engine(trunk, BackendSettings(verify_mode="batched")))
    d_engine = drafter_engine(load_drafter(args.checkpoint), settings=BackendSettings())
    limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, True)
    sched = Scheduler(limits, load_tokenizer(args.checkpoint, cfg.vocab_size, cfg.eos_token_id), GateConfig(),
                      "batched", "configured")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.checkpoint}; batched verify; "
          f"always-k (k = block size {cfg.dspark_block_size}); max_tokens {args.max_tokens}; top-p 1; "
          f"{args.repeats} repeats, interleaved")
    for arm in ARMS:  # warm-up
        await run_arm(sched, v_engine, d_engine, "warm up", arm, 1.0, 0, 8)
    runs: dict[tuple[float, str, str], list[Run]] = {}
    for rep in range(args.repeats):
        for t in TEMPERATURES:
            for w, (workload, prompt) in enumerate(WORKLOADS.items()):
                for arm in ARMS:
                    run = await run_arm(sched, v_engine, d_engine, prompt, arm, t, 1000 * rep + w, args.max_tokens)
                    runs.setdefault((t, workload, arm), []).append(run)
    return runs


def report(runs: dict) -> None:
    head = (f"{'T':>4} {'workload':<8} {'arm':<16} {'accept':>6} {'mean len':>8} {'tok/s':>7} "
            f"{'range':>13} {'vs plain':>8}")
    print(head)
    print("-" * len(head))
    for (t, workload, arm), rs in runs.items():
        plain = statistics.median(r.tok_s for r in runs[t, workload, "plain"])
        tok_s = statistics.median(r.tok_s for r in rs)
        accept = statistics.median(r.acceptance for r in rs)
        mean_len = statistics.median(r.mean_len for r in rs)
        spread = f"{min(r.tok_s for r in rs):.1f}-{max(r.tok_s for r in rs):.1f}"
        cells = ("-", "-") if arm == "plain" else (f"{accept:.0%}", f"{mean_len:.2f}")
        print(f"{t:>4.1f} {workload:<8} {arm:<16} {cells[0]:>6} {cells[1]:>8} {tok_s:>7.1f} {spread:>13} "
              f"{tok_s / plain:>7.2f}x")
    print("\nper temperature and arm, over the four workloads (median of the per-workload medians):")
    for t in TEMPERATURES:
        for arm in ARMS[1:]:
            cells = [runs[t, w, arm] for w in WORKLOADS]
            accept = statistics.median(statistics.median(r.acceptance for r in rs) for rs in cells)
            mean_len = statistics.median(statistics.median(r.mean_len for r in rs) for rs in cells)
            ratio = statistics.median(statistics.median(r.tok_s for r in rs) /
                                      statistics.median(r.tok_s for r in runs[t, w, "plain"])
                                      for rs, w in zip(cells, WORKLOADS))
            print(f"  T={t:.1f} {arm:<16} acceptance {accept:.0%}, mean acceptance length {mean_len:.2f}, "
                  f"{ratio:.2f}x plain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default assets/dspark-small)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--max-tokens", type=int, default=48, help="completion tokens per generation (default 48)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; medians reported (default 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report(asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
