"""A drafter that is always wrong, gated vs plain decode: `python -m bench.bench_gate [--repeats N]`.

Owns the wall-clock measurement behind the gate's promise that speculation never loses to
plain decode; it prints figures and never asserts them (the decisions are asserted in
tests/test_gate_estimator.py). One process: the random tiny model's verifier, a scripted
drafter whose every draft is the target's own next tokens shifted by one id (confidence logit
8.0, acceptance exactly 0) and the gateway, all real gRPC servers on localhost. Plain (spec
off) and gated generations of 64 tokens alternate, `--repeats` times each after one warm-up
of each; the median wall time of each and the ratio plain / gated are printed, with the gated
rounds' decisions (drafted, probe, suspended).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from services_fixtures import collect, gen_request, service_loop  # noqa: E402
from test_drafter_faults import _start_rig, shifted_drafts  # noqa: E402

PROMPT_IDS = tuple(range(7, 19))


async def _timed(stub, spec: str, max_tokens: int):
    t0 = time.perf_counter()
    gen = await collect(stub, gen_request(ids=PROMPT_IDS, max_tokens=max_tokens, spec=spec))
    return (time.perf_counter() - t0) * 1e3, gen


def main(argv=None) -> int:
    """Run the bench; returns the exit status (0)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    loop = service_loop()
    rig = loop.run(_start_rig())
    try:
        _, off = loop.run(_timed(rig.stub, "off", args.max_tokens))
        rig.scripted.script = shifted_drafts([*PROMPT_IDS, *off.token_ids])
        loop.run(_timed(rig.stub, "gated", args.max_tokens))  # warm-up
        walls = {"off": [], "gated": []}
        for _ in range(args.repeats):
            for spec in ("off", "gated"):
                ms, gen = loop.run(_timed(rig.stub, spec, args.max_tokens))
                walls[spec].append(ms)
                if spec == "gated":
                    s = gen.stats
                    assert gen.token_ids == off.token_ids and s.accepted == 0
        plain, gated = statistics.median(walls["off"]), statistics.median(walls["gated"])
        print(f"always-wrong drafter, {args.max_tokens} tokens, {args.repeats} interleaved repeats")
        print(f"plain  median {plain:8.1f} ms  (min {min(walls['off']):.1f}, max {max(walls['off']):.1f})")
        print(f"gated  median {gated:8.1f} ms  (min {min(walls['gated']):.1f}, max {max(walls['gated']):.1f})")
        print(f"gated / plain speed: {plain / gated:.3f}x; rounds {s.rounds}, drafted {s.rounds - s.margin_skipped_rounds},"
              f" suspended {s.margin_skipped_rounds}, submitted {s.submitted}, accepted {s.accepted}")
    finally:
        rig.scripted.script = None
        loop.run(rig.close())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
