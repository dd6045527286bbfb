"""Sampling cost per row: `python -m bench.bench_sampling_cost [--vocab V] [--rows S] [--repeats N] [--device D]`.

Owns the measurement of what one sampled token costs outside the model, per logits row at a
given vocabulary (default DeepSeek-V4-Flash's 129,280): the keyed Gumbel noise
(`dsv4.sampling.gumbel`, against the host NumPy PCG64 draw it replaced, kept here as
the baseline arm), the top-p filter (`filtered_logits` at top_p 0.9), and a whole
`keyed_choice` at T 1.0 / top-p 0.9. Each cell is the median over `--repeats` runs of the ms
per row, with the range (min-max); rows per call `--rows`. It prints figures and asserts
nothing (figures of record: bench/README.md). On a CUDA device it synchronises before reading
the clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dsv4.sampling import TOKEN, SamplingParams, filtered_logits, gumbel, keyed_choice


def _ms_per_row(fn, rows: int, device: torch.device) -> float:
    """Wall ms of one call of fn() divided by rows (synchronising a CUDA device first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / rows


def host_numpy_gumbel(seed: int, positions, stream: int, vocab: int) -> torch.Tensor:
    """The noise as drawn before the device generator, kept here as the baseline arm: one
    NumPy PCG64 stream per (seed, position, stream) on the host, -log(-log u) -> [S, vocab] fp64."""
    rows = [np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, p, stream]))).random(vocab)
            for p in positions]
    u = np.maximum(np.stack(rows), np.finfo(np.float64).tiny)
    return torch.from_numpy(-np.log(-np.log(u)))


def measure(vocab: int, rows: int, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """{cell: [ms per row, one per repeat]} for the noise, the top-p filter and a whole choice."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=12345)
    positions = list(range(100, 100 + rows))
    cells = {
        "noise, host NumPy (before)": lambda: host_numpy_gumbel(params.seed, positions, TOKEN, vocab),
        "noise, keyed Philox (after)": lambda: gumbel(params.seed, positions, TOKEN, vocab, device=device),
        "top-p 0.9 filter": lambda: filtered_logits(logits, params),
        "keyed_choice T=1 top-p 0.9": lambda: keyed_choice(logits, params, positions),
    }
    out: dict[str, list[float]] = {name: [] for name in cells}
    for name, fn in cells.items():
        fn()  # warm-up: allocator, kernels
    for _ in range(repeats):  # interleaved, so the cells share the machine's load
        for name, fn in cells.items():
            out[name].append(_ms_per_row(fn, rows, device))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=129_280, help="vocabulary size (default: V4-Flash's)")
    ap.add_argument("--rows", type=int, default=4, help="logits rows per call")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per cell (median and range)")
    ap.add_argument("--device", default="cpu", help="torch device of the logits (cpu, cuda, cuda:N)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    res = measure(args.vocab, args.rows, args.repeats, device)
    print(f"sampling cost per row, vocab {args.vocab}, {args.rows} rows per call, device {device}, "
          f"{args.threads} thread(s), median [min-max] of {args.repeats}")
    for name, ms in res.items():
        print(f"  {name:30s} {statistics.median(ms):8.3f} ms/row  [{min(ms):.3f}-{max(ms):.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
