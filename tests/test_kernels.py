"""Triton kernels against their torch references, under the interpreter on CPU.

`TRITON_INTERPRET=1` is set in conftest.py before anything imports triton. Every kernel
writes into a NaN-poisoned destination that is a strided window of a larger NaN buffer, so
an element the kernel forgot to write fails the comparison and one it wrote outside its
output shows up in the border. Shapes are random and irregular (non-powers of two, odd row
counts, masked tails); tiles are large because each program step costs ~ms here.
Tolerances: fp32 outputs 1e-5 relative (row-wise norm); bf16 outputs 1e-2 (bf16 rounding of
the result, 2^-8 per element); the pooling kernel is exact.
"""

import pytest
import torch

from dsv4.attention import sparse_attn as model_sparse_attn
from dsv4.codecs import fp4_encode, fp8_encode
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.inventory import trunk_params
from dsv4.layers import Linear
from dsv4.mhc import lane_mean as model_lane_mean
from dsv4.moe import MoE
from dsv4.quantised import quantised_gemms
from dsv4.trunk import Trunk
from kernels.fp4_gemm import fold_routes, fp4_gemm_ref, fp4_moe_gemm_ref
from kernels.fp8_gemm import fp8_gemm_ref
from kernels.lane_mean import lane_mean_ref
from kernels.select import OPS, KernelConfig
from kernels.sparse_attn import sparse_attn_ref
from model_fixtures import quantised_weights, varied_weights
from services.settings import model_settings

try:
    import triton
except ImportError:
    triton = None

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed (pip install '.[kernels]')")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over rows of ||a - b|| / ||b|| (NaN anywhere -> NaN, which fails every `<`)."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)).max())


def poisoned(shape, dtype):
    """(buffer, out): a NaN buffer one larger on every side and the strided window inside it."""
    buf = torch.full(tuple(s + 2 for s in shape[:-1]) + (shape[-1] + 3,), float("nan"), dtype=dtype)
    return buf, buf[tuple(slice(1, 1 + s) for s in shape)]


def border_untouched(buf, shape):
    inner = torch.zeros_like(buf, dtype=torch.bool)
    inner[tuple(slice(1, 1 + s) for s in shape)] = True
    return bool(buf[~inner].isnan().all())


def shapes(seed, n, lo_hi):
    g = torch.Generator().manual_seed(seed)
    return [[int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in lo_hi] for _ in range(n)]


# ---------------------------------------------------------------- references equal the model's math
def test_refs_equal_the_model_functions_bitwise():
    g = torch.Generator().manual_seed(0)
    q, kv, sink = torch.randn(5, 3, 40, generator=g), torch.randn(17, 40, generator=g), torch.randn(3, generator=g)
    idx = torch.randint(-1, 17, (5, 9), generator=g)
    assert torch.equal(sparse_attn_ref(q, kv, sink, idx, 0.3), model_sparse_attn(q, kv, sink, idx, 0.3))
    x = torch.randn(6, 4, 50, generator=g)
    assert torch.equal(lane_mean_ref(x), model_lane_mean(x))


def test_fold_routes_orders_match_the_moe_combine():
    """Ascending expert id (deterministic) or slot order, as dsv4.moe.MoE._reduce."""
    cfg = tiny_config()
    model = Trunk(cfg)
    moe = model.layers[2].ffn
    g = torch.Generator().manual_seed(1)
    partial = torch.randn(5, cfg.n_activated_experts, 7, generator=g) * 1e3
    experts = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.n_activated_experts]
                           for _ in range(5)])
    for det in (True, False):
        moe.deterministic_reduce = det
        assert torch.equal(fold_routes(partial, experts, det), moe._reduce(partial, experts))


# ---------------------------------------------------------------- selection
def test_kernel_config_reads_env_and_picks_refs_for_torch():
    assert model_settings({}).kernel_config() == KernelConfig("torch", False, True)
    env = {"DSPARK_KERNELS": " Triton ", "DSPARK_MOE_MULTI_TOKEN_FP4": "1", "DSPARK_MOE_DETERMINISTIC_REDUCE": "0"}
    assert model_settings(env).kernel_config() == KernelConfig("triton", True, False)
    assert model_settings(env).kernel_config().chosen_by == "DSPARK_KERNELS"
    assert model_settings(env).kernels == "triton"
    with pytest.raises(ValueError, match="DSPARK_KERNELS='cuda'"):
        model_settings({"DSPARK_KERNELS": "cuda"})
    with pytest.raises(ValueError, match="DSPARK_MOE_MULTI_TOKEN_FP4"):
        model_settings({"DSPARK_MOE_MULTI_TOKEN_FP4": "yes"})
    with pytest.raises(ValueError, match="backend"):
        KernelConfig("cuda")
    with pytest.raises(ValueError, match="unknown kernel op"):
        KernelConfig().op("softmax")
    for name, (_, _, ref) in OPS.items():
        assert KernelConfig().op(name).__name__ == ref


@needs_triton
def test_kernel_config_picks_triton_wrappers():
    for name, (_, kernel, _) in OPS.items():
        assert KernelConfig("triton").op(name).__name__ == kernel


# ---------------------------------------------------------------- lane mean
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lane_mean_kernel_equals_cpu_mean_exactly(dtype):
    """Exact for C <= 4 lanes (hc_mult = 4); C = 6 only to fp32 rounding (see kernels/lane_mean.py)."""
    from kernels.lane_mean import lane_mean
    for S, C, D in shapes(2, 3, [(1, 9), (2, 5), (1, 700)]) + [[5, 4, 333], [3, 6, 77]]:
        x = torch.randn(S, C + 1, D).to(dtype)[:, 1:]  # strided lanes
        buf, out = poisoned((S, D), torch.float32)
        got = lane_mean(x, block_d=256, out=out)
        assert got.data_ptr() == out.data_ptr()
        if C <= 4:
            assert torch.equal(got, x.float().mean(-2)), (S, C, D)
        else:
            assert rel(got, x.float().mean(-2)) < TOL[torch.float32]
        assert border_untouched(buf, (S, D))
        if C == 4:  # a sum would read exactly 4x: the check is not vacuous
            assert torch.equal(x.float().sum(-2), 4 * got)


# ---------------------------------------------------------------- sparse attention
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attn_kernel_matches_ref_on_irregular_shapes(dtype):
    from kernels.sparse_attn import sparse_attn
    g = torch.Generator().manual_seed(3)
    for S, H, Dh, N, K in shapes(4, 3, [(1, 7), (1, 6), (17, 100), (1, 50), (1, 300)]):
        q = torch.randn(S, H, Dh, generator=g).to(dtype)
        kv = torch.randn(N, Dh, generator=g).to(dtype)
        sink = torch.randn(H, generator=g) * 2
        idx = torch.randint(-1, N, (S, K), generator=g)
        idx[0, : K // 2] = -1  # a half-masked list
        if S > 1:
            idx[-1] = -1  # a fully masked list: only the sink, output 0
        buf, out = poisoned((S, H, Dh), dtype)
        got = sparse_attn(q, kv, sink, idx, Dh ** -0.5, out=out)
        want = sparse_attn_ref(q, kv, sink, idx, Dh ** -0.5)
        assert rel(got[:S - 1 or 1], want[:S - 1 or 1]) < TOL[dtype], (S, H, Dh, N, K)
        assert torch.equal(got[-1], want[-1]) or S == 1
        assert border_untouched(buf, (S, H, Dh))


@needs_triton
def test_sparse_attn_kernel_ignores_padding_columns():
    """Padding a list with -1 (a masked chunk) leaves every output bitwise unchanged."""
    from kernels.sparse_attn import sparse_attn
    g = torch.Generator().manual_seed(5)
    q, kv, sink = torch.randn(3, 4, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(4, generator=g)
    idx = torch.randint(0, 40, (3, 20), generator=g)
    padded = torch.cat((idx, torch.full((3, 300), -1)), dim=1)
    assert torch.equal(sparse_attn(q, kv, sink, idx, 0.125, block_k=32),
                       sparse_attn(q, kv, sink, padded, 0.125, block_k=32))


@needs_triton
def test_trunk_with_triton_kernels_matches_torch_kernels():
    cfg = tiny_config()
    w = random_weights(cfg, "trunk", seed=3)
    models = [Trunk(cfg, kernels=KernelConfig(b)) for b in ("torch", "triton")]
    outs = []
    for m in models:
        m.load_weights(w)
        st = m.new_state()
        first = m.prefill(st, list(range(3, 14)))
        step = m.decode(st, 7, 11)
        outs.append((first, step))
    for a, b in zip(*outs):
        assert rel(b.logits[None], a.logits[None]) < TOL[torch.float32]
        assert rel(b.taps, a.taps) < TOL[torch.float32]


# ---------------------------------------------------------------- the model's quantised GEMMs
def _record_gemms(model):
    """Wrap every wired fp8 linear's and fp4 MoE's kernel to record its calls: fp8 row counts,
    and (rows, small_batch) of the fp4 calls."""
    calls = {"fp8": [], "fp4": []}
    for m in model.modules():
        if isinstance(m, Linear) and m.fp8_gemm is not None:
            m.fp8_gemm = lambda x, *a, f=m.fp8_gemm: calls["fp8"].append(x.shape[0]) or f(x, *a)
        if isinstance(m, MoE) and m.fp4_gemm is not None:
            m.fp4_gemm = lambda x, *a, f=m.fp4_gemm, **kw: calls["fp4"].append((x.shape[0], kw["small_batch"])) or f(
                x, *a, **kw)
    return calls


@needs_triton
@pytest.mark.parametrize("multi_token", [False, True])
def test_triton_backend_runs_the_quantised_gemms_and_matches_the_torch_path(multi_token):
    """With checkpoint-like (exactly fp8 / fp4) weights, every fp8-stored linear runs fp8_gemm
    and every MoE the fp4 kernel: prefill on its grouped path, decode on the small path, a
    verify block on the small path only with moe_multi_token_fp4; logits and taps within fp32
    rounding of the torch backend."""
    cfg = tiny_config()
    w = quantised_weights(cfg, varied_weights(cfg, seed=4))
    ref, tri = Trunk(cfg), Trunk(cfg, kernels=KernelConfig("triton", multi_token))
    for m in (ref, tri):
        m.load_weights(w)
    n_fp8 = sum(p.storage == "fp8" and not p.name.endswith("wo_a.weight") for p in trunk_params(cfg))
    assert quantised_gemms(tri) == {"fp8_linears": n_fp8, "fp4_moes": cfg.n_layers}
    assert quantised_gemms(ref) == {"fp8_linears": 0, "fp4_moes": 0}
    calls = _record_gemms(tri)
    outs = []
    for m in (ref, tri):
        st = m.new_state()
        first = m.prefill(st, list(range(3, 14)))
        step = m.decode(st, 7, 11)
        block = m.forward_block(st, torch.tensor([5, 9, 2, 8]), 12)
        m.rollback(st, block.undo, 2)
        outs.append([(first.logits[None], first.taps), (step.logits[None], step.taps), (block.logits, block.taps)])
    for (a_logits, a_taps), (b_logits, b_taps) in zip(*outs):
        assert rel(b_logits, a_logits) < TOL[torch.float32] and rel(b_taps, a_taps) < TOL[torch.float32]
    assert set(calls["fp8"]) == {11, 1, 4}  # every fp8 linear of every call ran the kernel
    three = 3 * cfg.n_layers  # w1, w3, w2 of every layer's MoE per forward
    # prefill: grouped path; decode: one row (the kernel's small path either way); verify:
    # small path iff moe_multi_token_fp4
    assert calls["fp4"] == [(11, False)] * three + [(1, multi_token)] * three + [(4, multi_token)] * three


@needs_triton
def test_exact_mode_stays_bitwise_with_the_quantised_gemms():
    """Exact numerics on the triton backend: fixed 8-row tiles for the fp8 GEMMs and the
    row-invariant small-batch fp4 path keep verify rows bitwise equal to decode rows."""
    cfg = tiny_config()
    m = Trunk(cfg, verify_numerics="exact", kernels=KernelConfig("triton"))
    m.load_weights(quantised_weights(cfg, varied_weights(cfg, seed=5)))
    assert quantised_gemms(m)["fp4_moes"] == cfg.n_layers
    block = [5, 9, 2, 8]
    a, b = m.new_state(), m.new_state()
    for st in (a, b):
        m.prefill(st, list(range(3, 15)))
    out = m.forward_block(a, torch.tensor(block), 12)
    for i, t in enumerate(block):
        step = m.decode(b, t, 12 + i)
        assert torch.equal(out.logits[i], step.logits) and torch.equal(out.taps[i], step.taps[0])


def test_weights_that_are_not_exactly_fp8_or_fp4_keep_the_torch_gemms():
    """Random float weights are not representable in the stored formats: the model keeps
    F.linear and the per-expert torch path (no silent requantisation)."""
    cfg = tiny_config()
    w = varied_weights(cfg, seed=4)
    m = Trunk(cfg, kernels=KernelConfig("triton")) if triton is not None else Trunk(cfg)
    m.load_weights(w)
    assert quantised_gemms(m) == {"fp8_linears": 0, "fp4_moes": 0}


# ---------------------------------------------------------------- fp8 GEMM
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_kernel_matches_ref(dtype):
    from kernels.fp8_gemm import fp8_gemm
    g = torch.Generator().manual_seed(6)
    for M, N, K in shapes(7, 2, [(1, 10), (1, 300), (1, 400)]) + [[3, 129, 257]]:
        w = torch.randn(N, K, generator=g) * torch.logspace(-4, 2, N)[:, None]  # subnormal codes too
        weight, scale = fp8_encode(w)
        x = torch.randn(M, K, generator=g).to(dtype)
        buf, out = poisoned((M, N), torch.float32)
        got = fp8_gemm(x, weight, scale, out=out)
        assert rel(got, fp8_gemm_ref(x, weight, scale)) < TOL[torch.float32], (M, N, K)
        assert border_untouched(buf, (M, N))


@needs_triton
def test_fp8_gemm_decodes_every_e4m3_byte():
    """Identity activations read the decoded weight back: every finite byte, both signs."""
    from kernels.fp8_gemm import fp8_gemm
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    weight = codes.view(2, 127)  # [N, K]
    scale = torch.tensor([[120]], dtype=torch.uint8)  # 2^-7
    got = fp8_gemm(torch.eye(127), weight, scale)  # [K, N] = W^T
    assert torch.equal(got.T, fp8_gemm_ref(torch.eye(127), weight, scale).T)


# ---------------------------------------------------------------- fp4 routed GEMM
def _experts(seed, E, N, K):
    g = torch.Generator().manual_seed(seed)
    ws = [fp4_encode(torch.randn(N, K, generator=g) * 10 ** float(torch.rand(1, generator=g) * 4 - 2))
          for _ in range(E)]
    return torch.stack([p for p, _ in ws]), torch.stack([s for _, s in ws]), g


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_moe_gemm_both_paths_match_ref(dtype):
    from kernels.fp4_gemm import fp4_moe_gemm
    E, N, K, M, k = 5, 150, 224, 6, 3
    packed, scale, g = _experts(8, E, N, K)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    for x in (torch.randn(M, K, generator=g).to(dtype), torch.randn(M, k, K, generator=g).to(dtype)):
        for combine in (False, True):
            for det in (True, False):
                want = fp4_moe_gemm_ref(x, packed, scale, experts, combine, det)
                for small in (True, False):
                    shape = (M, N) if combine else (M, k, N)
                    buf, out = poisoned(shape, torch.float32)
                    got = fp4_moe_gemm(x, packed, scale, experts, combine, det, small, out=out)
                    assert rel(got, want) < TOL[torch.float32], (x.shape, combine, det, small)
                    assert border_untouched(buf, shape)


@needs_triton
def test_fp4_small_batch_path_is_row_invariant_and_folds_in_expert_order():
    """A token's result on the small-batch path is bitwise the same alone or among others
    (what exact verify needs), and the deterministic fold ignores the gate's slot order."""
    from kernels.fp4_gemm import fp4_moe_gemm
    packed, scale, g = _experts(9, 6, 70, 96)
    experts = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(5)])
    x = torch.randn(5, 96, generator=g)
    block = fp4_moe_gemm(x, packed, scale, experts, combine=True, small_batch=True)
    for i in range(5):
        alone = fp4_moe_gemm(x[i:i + 1], packed, scale, experts[i:i + 1], combine=True)
        assert torch.equal(alone[0], block[i])
    shuffled = experts[:, torch.randperm(4, generator=g)]
    assert torch.equal(fp4_moe_gemm(x, packed, scale, shuffled, combine=True, small_batch=True), block)


@needs_triton
def test_fp4_dense_gemm_and_bad_arguments():
    from kernels.fp4_gemm import fp4_gemm, fp4_moe_gemm
    packed, scale, g = _experts(10, 1, 33, 64)
    for M in (1, 7):
        x = torch.randn(M, 64, generator=g)
        assert rel(fp4_gemm(x, packed[0], scale[0]), fp4_gemm_ref(x, packed[0], scale[0])) < TOL[torch.float32]
    with pytest.raises(ValueError, match="expert ids"):
        fp4_moe_gemm(torch.randn(2, 64), packed, scale, torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="out must be"):
        fp4_gemm(torch.randn(2, 64), packed[0], scale[0], out=torch.empty(2, 32))


# ---------------------------------------------------------------- the prepared GPU script
@needs_triton
def test_gpu_check_dry_run_passes_on_cpu(capsys):
    """bench/gpu_check.py imports and runs all its sections on the CPU (small sizes)."""
    from bench.gpu_check import main
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ", 0 failed" in out and "exact bf16: verify rows == decode rows" in out
