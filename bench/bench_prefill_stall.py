"""How long a long prompt stalls running generations, through the verifier's step loop:
`python -m bench.bench_prefill_stall [--checkpoint assets/dspark-small] [--chunks 16,32,64,128,0]
[--streams 8] [--prompt 900] [--repeats 3] [--numerics fast] [--step-chunks 0,16,..,512]`.

First, the step-time table: one `forward_batch` of the streams' decodes plus one prompt
chunk of C tokens, per C (`step_times`), the cost a chunk adds to a step.

Owns the stall figure of chunked prefill (services/verifier/batcher.py). Per chunk size C
(0 = the whole prompt in one step, the unchunked baseline) and repetition: `--streams`
sessions are prefilled with short prompts and decode greedily, each from its own thread
through a real `StepLoop` (the verifier's engine, the loaded model, real futures); once
every stream has decoded WARMUP tokens, a `--prompt`-token prompt is submitted and the
streams keep decoding until it is prefilled and AFTER more tokens came. Reported, as the
median over `--repeats` with the range [min, max]:

* normal gap: the streams' median inter-token gap (ms) before the prompt arrived;
* gap during, p90 during, stall (max): the median, 90th percentile and longest inter-token
  gap of the streams' gaps that overlap the prompt's prefill (ms);
* chunk step: the median wall time of a step that carried a full chunk (ms), and of a
  step without one with every stream in it (the decode step), from the loop's
  `StepRecord`s, and the mean sessions in a step that carried a chunk (streams + 1 when
  every stream decoded in it);
* TTFT: submit to the prompt's result (ms).

Nothing is asserted; the figures go to bench/README.md. On a shared CPU, absolute times move
with the machine's load; compare within one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time

import torch

from dsv4.batch import BatchItem
from services.app import load_trunk
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine

WARMUP = 6  # tokens every stream decodes before the prompt arrives
AFTER = 4  # tokens every stream decodes after the prompt's result
SHORT = 32  # tokens of each stream's own prompt


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_once(engine: VerifierEngine, chunk: int, streams: int, prompt_len: int, seed: int) -> dict:
    """One repetition at chunk size `chunk` (tokens); returns its figures (ms)."""
    records = []
    steps = StepLoop(engine, records.append, prefill_chunk=chunk or prompt_len)
    vocab = engine.cfg.vocab_size
    sids = [engine.open_session() for _ in range(streams)]
    times: list[list[float]] = [[] for _ in range(streams)]
    warm, done = threading.Barrier(streams + 1), threading.Event()

    def stream(i: int) -> None:
        ids = _ids(SHORT, vocab, seed * 100 + i)
        tok = steps.submit(engine.admit_prefill(sids[i], ids)).result().next_token
        pos, after = len(ids), 0
        while after < AFTER:
            tok = steps.submit(engine.admit_decode(sids[i], tok, pos)).result().next_token
            times[i].append(time.perf_counter())
            pos += 1
            if len(times[i]) == WARMUP:
                warm.wait()
            after += done.is_set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    warm.wait()
    long_sid = engine.open_session()
    mark = len(records)
    t0 = time.perf_counter()
    steps.submit(engine.admit_prefill(long_sid, _ids(prompt_len, vocab, seed))).result()
    t1 = time.perf_counter()
    done.set()
    for t in threads:
        t.join()
    steps.close()
    for sid in sids + [long_sid]:
        engine.close_session(sid)
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < t0]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t0 and a < t1]
    full = [r.ms for r in records[mark:] if r.prefill_rows == (chunk or prompt_len)]
    plain = [r.ms for r in records if r.prefill_rows == 0 and r.sessions == streams]
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731 (no such step: nan)
    during.sort()
    chunk_steps = [r for r in records[mark:] if r.prefill_rows]
    return {"normal gap": med(before) * 1e3, "gap during": med(during) * 1e3,
            "p90 during": during[int(0.9 * (len(during) - 1))] * 1e3 if during else float("nan"),
            "stall (max)": max(during, default=float("nan")) * 1e3,
            "chunk step": med(full), "decode step": med(plain),
            "sessions / chunk step": statistics.mean(r.sessions for r in chunk_steps),
            "TTFT": (t1 - t0) * 1e3}


def step_times(trunk, chunks: list[int], streams: int, prompt_len: int, repeats: int) -> dict[int, list[float]]:
    """Wall time (ms) of one `forward_batch` of `streams` decodes (at position SHORT) plus one
    prompt chunk of C tokens at position 256 (C = 0: the decodes alone), `repeats` times per
    C, interleaved: the step the loop runs, without threads or queues around it."""
    vocab, out = trunk.cfg.vocab_size, {c: [] for c in chunks}
    dec = []
    for i in range(streams):
        st = trunk.new_state()
        trunk.prefill(st, _ids(SHORT, vocab, i), taps=False)
        dec.append(st)
    base = trunk.new_state()
    trunk.prefill(base, _ids(256, vocab, 99), taps=False)
    for _ in range(repeats):
        for c in chunks:
            states = [copy.deepcopy(st) for st in dec]
            items = [BatchItem.decode(st, 7, SHORT) for st in states]
            if c:
                items.append(BatchItem.prefill_chunk(copy.deepcopy(base), _ids(c, vocab, c), 256, 64))
            t0 = time.perf_counter()
            trunk.forward_batch(items)
            out[c].append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small")
    ap.add_argument("--chunks", default="16,32,64,128,0", help="chunk sizes in tokens; 0 = unchunked")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=900, help="prompt tokens (at most max_seq_len - 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--numerics", default="fast", choices=("fast", "exact"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--step-chunks", default="0,16,32,64,128,256,512",
                    help="chunk sizes of the step-time table (0: decodes alone); empty: skip it")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trunk = load_trunk(args.checkpoint, verify_numerics=args.numerics)
    prompt_len = min(args.prompt, trunk.cfg.max_seq_len - 64)
    if prompt_len < args.prompt:
        print(f"prompt cut to {prompt_len} tokens: max_seq_len={trunk.cfg.max_seq_len}")
    engine = VerifierEngine(trunk, max_sessions=args.streams + 1)
    if args.step_chunks:
        sizes = [int(c) for c in args.step_chunks.split(",")]
        times = step_times(trunk, sizes, args.streams, prompt_len, max(args.repeats, 5))
        print(f"step time: {args.streams} decodes + one prompt chunk of C tokens, median [min, max] ms")
        print("| C | step ms | ms per chunk token over the decode step |\n|---|---|---|")
        base = statistics.median(times[0]) if 0 in times else float("nan")
        for c in sizes:
            m = statistics.median(times[c])
            per = f"{(m - base) / c:.2f}" if c else "-"
            print(f"| {c} | {m:.0f} [{min(times[c]):.0f}, {max(times[c]):.0f}] | {per} |")
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    for rep in range(args.repeats):  # interleaved: drift of the shared machine hits every C alike
        for c in chunks:
            runs[c].append(run_once(engine, c, args.streams, prompt_len, seed=rep + 1))
    print(f"{args.streams} streams decoding, a {prompt_len}-token prompt arrives; {args.numerics} numerics, "
          f"median [min, max] of {args.repeats} repetitions, ms")
    keys = list(runs[chunks[0]][0])
    print("| chunk C | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for c in chunks:
        cells = []
        for k in keys:
            v = [r[k] for r in runs[c]]
            fmt = ".1f" if k.startswith("sessions") else ".0f"
            cells.append(f"{statistics.median(v):{fmt}} [{min(v):{fmt}}, {max(v):{fmt}}]")
        print(f"| {c or f'{prompt_len} (unchunked)'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
