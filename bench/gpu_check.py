"""Device checks for a session that is lent a GPU: `python -m bench.gpu_check [--dry-run] [--quick]`.

Owns the checks that need a CUDA device (kernels against their torch references, kernel and
bandwidth timings, exactness on the GPU); it never changes the device's settings, and its
timings are never asserted (tests/test_kernels.py runs only its `--dry-run`).

One command; prints one table (check | value | bound | status) and exits 1 when a check
fails (2 when no CUDA device and no --dry-run). Sections:

1. kernels vs references on CUDA, fresh random inputs, fp32 and bf16: lane mean (bitwise
   equal to a CPU mean), sparse attention with sink (V4-Flash shapes: 64 heads of 512,
   window 128 + top-512), fp8 block-scaled GEMM, fp4 routed-expert GEMM on both paths
   (relative error bounds as tests/test_kernels.py); the small-batch path's row invariance.
2. timings vs torch (median ms): each kernel against its `_ref`.
3. fp4 GEMV bandwidth: one token, 6 routes of a [2048, 4096] expert matrix: bytes moved /
   time against the copy ceiling measured here (a device-to-device copy of 1 GiB).
4. verify(k) slope of the fp4 routed GEMM, small-batch path on and off
   (DSPARK_MOE_MULTI_TOKEN_FP4), for k + 1 = 1..6 tokens (ms per extra token).
5. trunk on the GPU (bench_trunk's large config, random weights): bf16 batched-vs-sequential
   drift of fast verify (max relative logit difference, reported) and the first divergence of
   a batched speculative chain from the plain chain; exact mode: verify row i == decode row i
   bitwise (fp32, bf16) and the exact/fast cost of decode and verify(5).

`--services` runs the services' check instead (bench/gpu_services.py: the three services
with verifier and drafter on the GPU, exactness of speculation against plain decode at 1..64
streams, the measured step table written for a simulator, TP = 2 over NCCL where 2 devices
exist, then the same on a V4-Flash-shaped random checkpoint, bench/gpu_v4.py). `--all` runs
both, then the test cases that need CUDA (keyed-noise bits CPU == GPU, steps under
`torch.cuda.set_sync_debug_mode`), into one table: the first GPU session's one command
(`bench/gpu_day.sh`, meant to finish within 8 minutes on one H100). `--dry-run` runs every section on the CPU at small sizes (kernels under TRITON_INTERPRET=1,
one repeat) so CI can check that the script works without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench.bench_trunk import large_config  # noqa: E402
from dsv4.config import tiny_config  # noqa: E402
from dsv4.init import random_weights  # noqa: E402
from dsv4.trunk import Trunk  # noqa: E402
from kernels.fp4_gemm import fp4_moe_gemm, fp4_moe_gemm_ref  # noqa: E402
from kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref  # noqa: E402
from kernels.lane_mean import lane_mean  # noqa: E402
from kernels.sparse_attn import sparse_attn, sparse_attn_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class Report:
    """Rows of (check, value, bound, status); status "ok", "FAIL" or "info"."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def check(self, name: str, value: float, bound: float, fmt: str = ".2e") -> None:
        ok = value <= bound  # NaN fails
        self.rows.append((name, format(value, fmt), f"<= {bound:{fmt}}", "ok" if ok else "FAIL"))

    def exact(self, name: str, equal: bool) -> None:
        self.rows.append((name, "equal" if equal else "differ", "bitwise", "ok" if equal else "FAIL"))

    def info(self, name: str, value: str) -> None:
        self.rows.append((name, value, "", "info"))

    @property
    def failed(self) -> int:
        return sum(r[3] == "FAIL" for r in self.rows)

    def print(self) -> None:
        w = max(len(r[0]) for r in self.rows)
        v = max(len(r[1]) for r in self.rows)
        print(f"{'check':<{w}}  {'value':>{v}}  {'bound':<12} status")
        print("-" * (w + v + 24))
        for name, value, bound, status in self.rows:
            print(f"{name:<{w}}  {value:>{v}}  {bound:<12} {status}")
        print(f"\n{len(self.rows)} rows, {self.failed} failed")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)).max())


def bench_ms(fn, repeats: int, device: str) -> float:
    """Median ms of fn() after one warm-up (CUDA: synchronised around each call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_fp4(E: int, N: int, K: int, g: torch.Generator, device: str):
    """Random packed e2m1 bytes [E, N, K/2] and ue8m0 scales [E, N, K/32] (2^-12..2^-3)."""
    packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8).to(device)
    scale = torch.randint(115, 125, (E, N, K // 32), generator=g, dtype=torch.uint8).to(device)
    return packed, scale


# ---------------------------------------------------------------- sections
def check_kernels(rep: Report, dev: str, small: bool, repeats: int, g: torch.Generator) -> None:
    S, H, Dh, W, topk = (5, 4, 96, 8, 16) if small else (6, 64, 512, 128, 512)
    D, N, K, E, k = (300, 96, 256, 8, 3) if small else (4096, 2048, 4096, 160, 6)
    for dtype in (torch.float32, torch.bfloat16):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        x = torch.randn(S, 4, D, generator=g).to(dtype).to(dev)
        out = torch.full((S, D), float("nan"), device=dev)
        got = lane_mean(x, out=out).cpu()
        rep.exact(f"lane_mean {tag} == CPU mean", torch.equal(got, x.cpu().float().mean(-2)))

        n_rows = W + S + 4 * topk
        q = torch.randn(S, H, Dh, generator=g).to(dtype).to(dev)
        kv = torch.randn(n_rows, Dh, generator=g).to(dtype).to(dev)
        sink = torch.randn(H, generator=g).to(dev)
        idx = torch.randint(-1, n_rows, (S, W + topk), generator=g).to(dev)
        got = sparse_attn(q, kv, sink, idx, Dh ** -0.5, out=torch.full_like(q, float("nan")))
        want = sparse_attn_ref(q, kv, sink, idx, Dh ** -0.5)
        rep.check(f"sparse_attn {tag} rel err", rel(got, want), TOL[dtype])
        if dtype == torch.bfloat16:
            t_kernel = bench_ms(lambda: sparse_attn(q, kv, sink, idx, 0.05), repeats, dev)
            t_ref = bench_ms(lambda: sparse_attn_ref(q, kv, sink, idx, 0.05), repeats, dev)
            rep.info("ms sparse_attn bf16 triton / torch", f"{t_kernel:.3f} / {t_ref:.3f}")

        from dsv4.codecs import fp8_encode
        w8, s8 = fp8_encode(torch.randn(N, K, generator=g) * 0.05)
        w8, s8 = w8.to(dev), s8.to(dev)
        for M in (1, 6) if small else (1, 6, 64):
            xa = torch.randn(M, K, generator=g).to(dtype).to(dev)
            got = fp8_gemm(xa, w8, s8, out=torch.full((M, N), float("nan"), device=dev))
            rep.check(f"fp8_gemm {tag} M={M} rel err", rel(got, fp8_gemm_ref(xa, w8, s8)), 1e-4)
        if dtype == torch.bfloat16:
            t_kernel = bench_ms(lambda: fp8_gemm(xa[:6], w8, s8), repeats, dev)
            t_ref = bench_ms(lambda: fp8_gemm_ref(xa[:6], w8, s8), repeats, dev)
            rep.info("ms fp8_gemm bf16 M=6 triton / torch", f"{t_kernel:.3f} / {t_ref:.3f}")

        packed, scale = random_fp4(E, N, K, g, dev)
        for M in (1, 6) if small else (1, 6, 24):
            ex = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(dev)
            xa = torch.randn(M, K, generator=g).to(dtype).to(dev)
            want = fp4_moe_gemm_ref(xa, packed, scale, ex, combine=True)
            for small_batch in (True, False):
                got = fp4_moe_gemm(xa, packed, scale, ex, combine=True, small_batch=small_batch,
                                   out=torch.full((M, N), float("nan"), device=dev))
                rep.check(f"fp4_moe_gemm {tag} M={M} {'small' if small_batch else 'grouped'} rel err",
                          rel(got, want), 1e-4)
        block = fp4_moe_gemm(xa[:6], packed, scale, ex[:6], combine=True, small_batch=True)
        alone = torch.cat([fp4_moe_gemm(xa[i:i + 1], packed, scale, ex[i:i + 1], combine=True) for i in range(6)])
        rep.exact(f"fp4 small path {tag}: token alone == in block of 6", torch.equal(alone, block))
        if dtype == torch.bfloat16:
            xs, es = xa[:6], ex[:6]
            t_small = bench_ms(lambda: fp4_moe_gemm(xs, packed, scale, es, True, True, True), repeats, dev)
            t_grouped = bench_ms(lambda: fp4_moe_gemm(xs, packed, scale, es, True, True, False), repeats, dev)
            t_ref = bench_ms(lambda: fp4_moe_gemm_ref(xs, packed, scale, es, True), repeats, dev)
            rep.info("ms fp4_moe_gemm bf16 M=6 small / grouped / torch",
                     f"{t_small:.3f} / {t_grouped:.3f} / {t_ref:.3f}")


def check_bandwidth_and_slope(rep: Report, dev: str, small: bool, repeats: int, g: torch.Generator) -> None:
    N, K, E, k = (96, 256, 8, 3) if small else (2048, 4096, 160, 6)
    packed, scale = random_fp4(E, N, K, g, dev)
    buf = torch.empty((1 << 20) if small else (1 << 30), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    copy_ms = bench_ms(lambda: dst.copy_(buf), repeats, dev)
    ceiling = 2 * buf.numel() / copy_ms / 1e6  # GB/s, read + write
    ex = torch.randperm(E, generator=g)[:k][None].to(dev)
    x = torch.randn(1, K, generator=g).to(torch.bfloat16).to(dev)
    gemv_ms = bench_ms(lambda: fp4_moe_gemm(x, packed, scale, ex, combine=True), repeats, dev)
    moved = k * (packed[0].numel() + scale[0].numel()) + 2 * K + 4 * N
    rep.info("fp4 GEMV (1 token, k routes) GB/s / copy ceiling GB/s",
             f"{moved / gemv_ms / 1e6:.0f} / {ceiling:.0f} ({moved / gemv_ms / 1e6 / ceiling:.0%})")
    for small_batch in (True, False):
        ms = {}
        for M in (1, 6) if small else range(1, 7):
            exs = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(dev)
            xs = torch.randn(M, K, generator=g).to(torch.bfloat16).to(dev)
            ms[M] = bench_ms(lambda: fp4_moe_gemm(xs, packed, scale, exs, combine=True, small_batch=small_batch),
                             repeats, dev)
        slope = (ms[6] - ms[1]) / 5
        rep.info(f"fp4 verify(k) {'small-batch on' if small_batch else 'small-batch off'}: ms at 1 / 6 tokens, slope",
                 f"{ms[1]:.3f} / {ms[6]:.3f}, {slope:.3f} ms/token")


def check_trunk(rep: Report, dev: str, small: bool, repeats: int) -> None:
    cfg = tiny_config(max_seq_len=128) if small else large_config()
    weights = random_weights(cfg, "trunk", seed=0)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    costs = {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        models = {}
        for numerics in ("fast", "exact"):
            models[numerics] = m = Trunk(cfg, dtype=dtype, verify_numerics=numerics, device=dev)
            m.load_weights(weights)
        for numerics, m in models.items():
            worst, equal = 0.0, True
            positions = (15, 22) if small else (13, 15, 22, 23)
            for n in positions:
                a, b = m.new_state(), m.new_state()
                m.prefill(a, prompt[:n])
                m.prefill(b, prompt[:n])
                block = prompt[n:n + 6]
                seq = [m.decode(a, int(t), n + i) for i, t in enumerate(block)]
                out = m.forward_block(b, block, n)
                dec = torch.stack([s.logits for s in seq])
                worst = max(worst, rel(out.logits, dec))
                equal &= torch.equal(out.logits, dec) and torch.equal(out.taps, torch.cat([s.taps for s in seq]))
                m.rollback(b, out.undo, 6)
            if numerics == "exact":
                rep.exact(f"exact {tag}: verify rows == decode rows (k=5, {len(positions)} positions)", equal)
            else:
                rep.info(f"fast {tag}: batched vs sequential max rel logit diff", f"{worst:.2e}")
        if dtype == torch.bfloat16:
            for numerics, m in models.items():
                st = m.new_state()
                m.prefill(st, prompt[:24])
                costs[numerics] = (bench_ms(lambda: decode_once(m, st), repeats, dev),
                                   bench_ms(lambda: verify_once(m, st, prompt), repeats, dev))
            n_chain = 12 if small else 32
            chains = {nm: greedy(m, prompt[:16], n_chain) for nm, m in models.items()}
            for numerics, m in models.items():
                spec = speculate_perfect(m, prompt[:16], chains[numerics], n_chain)
                i = next((j for j, (p, q) in enumerate(zip(spec, chains[numerics])) if p != q), None)
                if numerics == "exact":
                    rep.exact(f"exact bf16: batched speculative chain == plain chain ({n_chain} tokens)", i is None)
                else:
                    rep.info("fast bf16: batched speculative chain vs plain",
                             "identical" if i is None else f"diverges at {i}")
    rep.info("bf16 ms decode fast / exact", f"{costs['fast'][0]:.2f} / {costs['exact'][0]:.2f}")
    rep.info("bf16 ms verify(5) fast / exact", f"{costs['fast'][1]:.2f} / {costs['exact'][1]:.2f}")


def decode_once(m: Trunk, st) -> None:
    m.decode(st, 7, st.next_position)


def verify_once(m: Trunk, st, prompt: torch.Tensor) -> None:
    out = m.forward_block(st, prompt[:6], st.next_position)
    m.rollback(st, out.undo, 1)


def greedy(m: Trunk, prompt: torch.Tensor, n: int) -> list[int]:
    st = m.new_state()
    toks = [int(m.prefill(st, prompt).logits.argmax())]
    while len(toks) < n:
        toks.append(int(m.decode(st, toks[-1], st.next_position).logits.argmax()))
    return toks


def speculate_perfect(m: Trunk, prompt: torch.Tensor, chain: list[int], n: int) -> list[int]:
    """Batched verify with the plain chain as drafts (block 5)."""
    st = m.new_state()
    out = [int(m.prefill(st, prompt).logits.argmax())]
    while len(out) < n:
        drafts = chain[len(out):len(out) + 5]
        res = m.forward_block(st, [out[-1], *drafts], st.next_position)
        targets = res.logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and targets[a] == drafts[a]:
            a += 1
        m.rollback(st, res.undo, a + 1)
        out += drafts[:a] + [targets[a]]
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes, kernels under TRITON_INTERPRET=1")
    ap.add_argument("--repeats", type=int, default=20, help="timing repeats (dry run: 1)")
    ap.add_argument("--services", action="store_true",
                    help="the three services on the GPU instead of the kernel checks (bench/gpu_services.py)")
    ap.add_argument("--all", action="store_true",
                    help="the first GPU session's one command: kernels and trunk, the services (bundled, TP = 2, "
                         "V4-Flash-shaped) and the CUDA-only tests, in one table (bench/gpu_day.sh)")
    ap.add_argument("--port-base", type=int, default=50150,
                    help="--services: gateway port; verifier + 1, drafter + 2; the TP=2 stack + 10..12, "
                         "the V4 stack + 20..22")
    ap.add_argument("--out", default="gpu_step_table.json", help="--services: the step-table file written")
    ap.add_argument("--log-dir", default="gpu_check_logs", help="--services: the services' log folder")
    ap.add_argument("--v4-dir", default="gpu_check_v4",
                    help="--services: folder of the V4-Flash-shaped random checkpoint (reused when complete; "
                         "about 16 GB); 'none' skips that stage")
    args = ap.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
            return 2
        dev, repeats = "cpu", 1
        torch.set_num_threads(1)  # the shared CI CPU: a second thread only adds contention
    elif torch.cuda.is_available():
        dev, repeats = "cuda", args.repeats
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print("no CUDA device: run with --dry-run for the CPU check of this script", file=sys.stderr)
        return 2
    rep = Report()
    t0 = time.perf_counter()
    if not args.services or args.all:
        g = torch.Generator().manual_seed(int(time.time()))  # fresh inputs every run
        check_kernels(rep, dev, args.dry_run, repeats, g)
        check_bandwidth_and_slope(rep, dev, args.dry_run, repeats, g)
        check_trunk(rep, dev, args.dry_run, repeats)
        rep.info("kernels and trunk: wall", f"{time.perf_counter() - t0:.1f} s")
    if args.services or args.all:
        from bench.gpu_services import check_services
        t1 = time.perf_counter()
        out, log_dir = Path(args.out), Path(args.log_dir)
        out.parent.mkdir(parents=True, exist_ok=True)  # found missing only after minutes otherwise
        check_services(rep, args.dry_run, args.port_base, out, log_dir)
        if args.v4_dir == "none":
            rep.info("V4: V4-Flash-shaped random model", "skipped (--v4-dir none)")
        else:
            from bench.gpu_v4 import check_v4
            check_v4(rep, args.dry_run, args.port_base + 20, log_dir, Path(args.v4_dir),
                     out.with_name(out.stem + "-v4.json"))
        rep.info("services and V4 stage: wall", f"{time.perf_counter() - t1:.1f} s")
    if args.all and not args.dry_run:
        check_cuda_tests(rep)
    rep.print()
    print(f"{time.perf_counter() - t0:.1f} s")
    return 1 if rep.failed else 0


CUDA_TESTS = ("tests/test_keyed_noise.py", "tests/test_host_sync.py")  # their CUDA cases skip without a GPU


def check_cuda_tests(rep: Report) -> None:
    """The test cases that need CUDA (keyed noise: CPU bits == GPU bits; a verifier and a
    drafter step under `torch.cuda.set_sync_debug_mode("error")`), as one row: pytest's summary."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
                          capture_output=True, text=True, timeout=300)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    rep.rows.append(("pytest " + " ".join(CUDA_TESTS), summary, "passed", "ok" if proc.returncode == 0 else "FAIL"))


if __name__ == "__main__":
    sys.exit(main())
