"""fp8 / fp4 weight codecs and activation fake-quantisation (docs/model.md §2.4, §6.3)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.codecs import (act_quant_fp4, act_quant_fp8, fp4_decode, fp4_encode, fp8_decode,
                         fp8_encode, hadamard_rotate)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _e4m3_value(byte: int) -> float:
    """e4m3fn byte -> value by the bit formula (independent of torch's cast)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _random_fp8_pair(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes (no NaN) and e8m0 scale bytes where each block's largest |code| is in (224, 448]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # 0x7F / 0xFF are NaN
    nb, kb = -(-n // 128), -(-k // 128)
    for i in range(nb):
        for j in range(kb):
            r = i * 128 + int(torch.randint(0, min(128, n - i * 128), (1,), generator=g))
            c = j * 128 + int(torch.randint(0, min(128, k - j * 128), (1,), generator=g))
            big = int(torch.randint(0x77, 0x7F, (1,), generator=g))  # 240 .. 448
            codes[r, c] = big | (codes[r, c] & 0x80)
    scale = torch.randint(90, 160, (nb, kb), generator=g, dtype=torch.int32)
    return codes.to(torch.uint8), scale.to(torch.uint8)


def _random_fp4_pair(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed e2m1 bytes and scales where each 32-block's largest |code| is 4 or 6."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    for blk in range(k // 32):
        cols = blk * 32 + torch.randint(0, 32, (n,), generator=g)
        rows = torch.arange(n)
        big = torch.randint(6, 8, (n,), generator=g, dtype=torch.int32)
        codes[rows, cols] = big | (codes[rows, cols] & 8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.randint(100, 150, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, scale


# ----------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 129), (96, 192)])
def test_fp8_decode_then_encode_reproduces_stored_bytes(shape):
    codes, scale = _random_fp8_pair(*shape, seed=sum(shape))
    w = fp8_decode(codes, scale)
    q, s = fp8_encode(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert torch.equal(_bytes(q), codes)
    assert torch.equal(_bytes(s), scale)


def test_fp8_decode_matches_bit_formula():
    codes, scale = _random_fp8_pair(130, 260, seed=3)
    w = fp8_decode(codes, scale)
    for r, c in [(0, 0), (5, 127), (127, 128), (128, 0), (129, 259), (64, 200)]:
        want = _e4m3_value(int(codes[r, c])) * 2.0 ** (int(scale[r // 128, c // 128]) - 127)
        assert w[r, c].item() == want


def test_fp8_block_scales_follow_block_boundaries_on_ragged_shape():
    n, k = 130, 260  # blocks: rows 0-127 | 128-129, cols 0-127 | 128-255 | 256-259
    exps = torch.tensor([[0, 3, -5], [7, -2, 11]])
    w = torch.empty(n, k)
    for i in range(2):
        for j in range(3):
            w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = 3.0 * 2.0 ** int(exps[i, j])
    q, s = fp8_encode(w)
    # amax = 3 * 2^e -> scale exponent ceil(log2(3 * 2^e / 448)) = e - 7
    assert torch.equal(_bytes(s).to(torch.int64), exps + 127 - 7)
    assert torch.equal(fp8_decode(q, s), w)


def test_fp8_all_zero_block_gets_smallest_scale_and_decodes_to_zero():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, s = fp8_encode(w)
    assert _bytes(s)[0, 0].item() == 0
    assert torch.equal(fp8_decode(q, s), w)


def test_fp8_encode_error_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 3, 200)
    q, s = fp8_encode(w)
    d = fp8_decode(q, s)
    block_scale = fp8_decode(torch.ones_like(q, dtype=torch.uint8) * 0x38, s)  # e4m3 0x38 = 1.0
    bound = w.abs() / 16 + block_scale * 2.0**-10  # half an ulp: normal | subnormal range
    assert ((d - w).abs() <= bound).all()
    assert (d - w).abs().max() > 0  # random data is not representable


def test_fp8_values_are_fixed_after_one_quantisation_pass():
    w = torch.randn(260, 140, generator=torch.Generator().manual_seed(1))
    q1 = fp8_decode(*fp8_encode(w))
    assert torch.equal(fp8_decode(*fp8_encode(q1)), q1)


def test_fp8_decode_rejects_wrong_scale_shape():
    q, s = fp8_encode(torch.ones(130, 10))
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        fp8_decode(q, s[:1])


# ----------------------------------------------------------------------------- fp4
@pytest.mark.parametrize("shape", [(4, 32), (7, 96), (128, 256)])
def test_fp4_decode_then_encode_reproduces_stored_bytes(shape):
    packed, scale = _random_fp4_pair(*shape, seed=shape[0])
    w = fp4_decode(packed, scale)
    p, s = fp4_encode(w)
    assert p.dtype == torch.int8 and p.shape == (shape[0], shape[1] // 2)
    assert torch.equal(p, packed)
    assert torch.equal(_bytes(s), scale)


def test_fp4_low_nibble_is_even_column():
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8).view(torch.int8)
    w = fp4_decode(packed, torch.tensor([[129]], dtype=torch.uint8))  # scale 2^2
    assert w[0, :4].tolist() == [2.0, 4.0, 2.0, 4.0]  # [0.5, 1.0] * 4, low nibble first
    row = torch.zeros(1, 32)
    row[0, :3] = torch.tensor([0.5, 1.0, 6.0])  # 6 pins the block scale at 1
    p, s = fp4_encode(row)
    assert _bytes(p)[0, 0].item() == 0x21 and _bytes(s).item() == 127


def test_fp4_bit3_is_the_sign():
    packed = torch.full((1, 16), 0xA9, dtype=torch.uint8).view(torch.int8)  # codes 9, 10
    w = fp4_decode(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert w[0, :2].tolist() == [-0.5, -1.0]
    p, _ = fp4_encode(torch.tensor([[-0.5, -1.0, -6.0] + [0.0] * 29]))
    assert _bytes(p)[0, 0].item() == 0xA9


def test_fp4_decode_matches_grid_times_scale():
    packed, scale = _random_fp4_pair(5, 64, seed=9)
    w = fp4_decode(packed, scale)
    b = _bytes(packed)
    for r, c in [(0, 0), (0, 1), (4, 63), (2, 32), (3, 31)]:
        code = int(b[r, c // 2]) >> (4 * (c % 2)) & 0xF
        value = E2M1[code & 7] * (-1 if code & 8 else 1)
        assert w[r, c].item() == value * 2.0 ** (int(scale[r, c // 32]) - 127)


def test_fp4_scale_is_per_row_and_32_columns():
    exps = torch.tensor([[0, -4, 9], [2, 5, -1]])
    w = (6.0 * 2.0 ** exps.float()).repeat_interleave(32, dim=1)  # [2, 96]
    p, s = fp4_encode(w)
    assert torch.equal(_bytes(s).to(torch.int64), exps + 127)
    assert torch.equal(fp4_decode(p, s), w)


def test_fp4_values_are_fixed_after_one_quantisation_pass():
    w = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    q1 = fp4_decode(*fp4_encode(w))
    assert torch.equal(fp4_decode(*fp4_encode(q1)), q1)


def test_fp4_encode_rejects_width_not_multiple_of_32():
    with pytest.raises(ValueError, match="in_features=48"):
        fp4_encode(torch.ones(2, 48))


# ----------------------------------------------------------------------------- activations
def test_act_quant_fp8_keeps_representable_values():
    codes, scale = _random_fp8_pair(6, 256, seed=4)
    scale = torch.full_like(scale, 120)  # one pow2 scale per 128-block along the row
    # e4m3 values times a power of two: a row block whose largest code is <= 224 gets a
    # smaller scale, which still represents every value exactly
    x = fp8_decode(codes, scale)
    assert torch.equal(act_quant_fp8(x, 128), x)


def test_act_quant_fp8_is_idempotent_and_keeps_shape_dtype():
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = x.clone()
    y = act_quant_fp8(x, 64)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(x, before)  # input untouched
    assert torch.equal(act_quant_fp8(y, 64), y)


def test_act_quant_fp8_error_bound_and_scale():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6), dtype=torch.float64).float()
    x[0, :64] *= 1e-6  # below the 1e-4 amax clamp
    y = act_quant_fp8(x, 64)
    blocks = x.view(4, 4, 64)
    amax = blocks.abs().amax(-1, keepdim=True).double().clamp(min=1e-4)
    s = (2.0 ** torch.ceil(torch.log2(amax / 448))).expand(-1, -1, 64).reshape(4, 256).float()
    err = (y - x).abs()
    assert (err <= x.abs() / 16 + s * 2.0**-10).all()
    # the result divided by its block scale is an e4m3 value
    q = y / s
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)


def _rne_e2m1_bruteforce(a: float) -> float:
    """Nearest e2m1 magnitude to a in [0, 6], ties to the even code."""
    d = [abs(a - g) for g in E2M1]
    best = min(d)
    cands = [i for i, v in enumerate(d) if v == best]
    return E2M1[next((i for i in cands if i % 2 == 0), cands[0])]


def test_act_quant_fp4_ties_round_to_even_code():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor(mids + [6.0] + [-m for m in mids] + [0.0] * 17)
    y = act_quant_fp4(x, 32)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert y[:8].tolist() == want
    assert y[8:15].tolist() == [-w for w in want[:7]]


def test_act_quant_fp4_matches_bruteforce_nearest_grid():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)) * 3
    y = act_quant_fp4(x, 32)
    for r in range(3):
        for b in range(2):
            blk = x[r, b * 32:(b + 1) * 32].tolist()
            amax = max(max(abs(v) for v in blk), 6 * 2.0**-126)
            s = 2.0 ** math.ceil(math.log2(amax / 6))
            want = [math.copysign(_rne_e2m1_bruteforce(min(abs(v) / s, 6.0)) * s, v) for v in blk]
            assert y[r, b * 32:(b + 1) * 32].tolist() == want


def test_act_quant_fp4_keeps_representable_values_and_dtype():
    packed, scale = _random_fp4_pair(4, 64, seed=8)
    x = fp4_decode(packed, scale)
    assert torch.equal(act_quant_fp4(x, 32), x)
    xb = torch.randn(2, 64).to(torch.bfloat16)
    assert act_quant_fp4(xb).dtype == torch.bfloat16


def test_act_quant_rejects_block_not_dividing_last_dim():
    with pytest.raises(ValueError, match="block=64"):
        act_quant_fp8(torch.ones(2, 96), 64)
    with pytest.raises(ValueError, match="block=32"):
        act_quant_fp4(torch.ones(2, 48), 32)


# ----------------------------------------------------------------------------- Hadamard
def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_hadamard_matches_bruteforce_sylvester(d):
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    want = x @ _sylvester(d).T / math.sqrt(d)
    torch.testing.assert_close(hadamard_rotate(x), want, rtol=1e-12, atol=1e-12)


def test_hadamard_is_orthonormal_involution():
    d = 128
    h = hadamard_rotate(torch.eye(d, dtype=torch.float64))  # rows = H / sqrt(d)
    torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)


def test_hadamard_keeps_bf16_dtype_and_rejects_non_power_of_two():
    x = torch.randn(2, 64).to(torch.bfloat16)
    y = hadamard_rotate(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    with pytest.raises(ValueError, match="96"):
        hadamard_rotate(torch.ones(2, 96))


# ----------------------------------------------------------------------------- full scale range, non-finite
def test_fp8_round_trip_over_every_finite_scale_byte():
    """Scale bytes 0..246: a block whose largest code is in (224, 448] decodes to finite
    float32 (448 * 2^119 < 2^128) and re-encodes to the same bytes, subnormal results included."""
    n_blocks = 247
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (1, 128 * n_blocks), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN bytes
    codes[0, ::128] = torch.randint(0x77, 0x7F, (n_blocks,), generator=g, dtype=torch.int32)  # 240 .. 448
    scale = torch.arange(n_blocks, dtype=torch.uint8)[None, :]
    w = fp8_decode(codes.to(torch.uint8), scale)
    assert bool(torch.isfinite(w).all())
    assert (w[0, 0].item(), w[0, -128].item()) == (_e4m3_value(int(codes[0, 0])) * 2.0**-127,
                                                    _e4m3_value(int(codes[0, -128])) * 2.0**119)
    q, s = fp8_encode(w)
    assert torch.equal(_bytes(q), codes.to(torch.uint8))
    assert torch.equal(_bytes(s), scale)


def test_fp4_round_trip_over_every_finite_scale_byte():
    """Scale bytes 0..252 (6 * 2^125 < 2^128), largest code 4 or 6 per block."""
    n_blocks = 253
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (1, 32 * n_blocks), generator=g, dtype=torch.int32)
    codes[0, ::32] = torch.randint(6, 8, (n_blocks,), generator=g, dtype=torch.int32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.arange(n_blocks, dtype=torch.uint8)[None, :]
    w = fp4_decode(packed, scale)
    assert bool(torch.isfinite(w).all())
    assert w[0, -32].item() == E2M1[int(codes[0, -32])] * 2.0**125
    p, s = fp4_encode(w)
    assert torch.equal(p, packed)
    assert torch.equal(_bytes(s), scale)


@pytest.mark.parametrize("encode", [fp8_encode, fp4_encode])
@pytest.mark.parametrize("value, dtype, why", [
    (math.nan, torch.float32, "value nan at \\[2, 37\\] is not finite"),
    (math.inf, torch.float32, "value inf at \\[2, 37\\] is not finite"),
    (-math.inf, torch.bfloat16, "value -inf at \\[2, 37\\] is not finite"),
    (1e300, torch.float64, "value 1e\\+300 at \\[2, 37\\] is outside the float32 range"),
])
def test_encoders_reject_non_finite_values_naming_the_first_position(encode, value, dtype, why):
    w = torch.randn(4, 64).to(dtype)
    w[2, 37] = value
    w[3, 1] = value  # a later one is not the one named
    with pytest.raises(ValueError, match=why):
        encode(w)


@pytest.mark.parametrize("quant, block", [(act_quant_fp8, 32), (act_quant_fp4, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_turns_blocks_with_non_finite_inputs_into_nan(quant, block, dtype):
    """Decision: propagate, not raise (no host sync in the hot path). NaN used to become 0
    (fp4) and inf a finite 448 * s / 6 * s."""
    x = torch.randn(3, 4 * block, generator=torch.Generator().manual_seed(2)).to(dtype)
    bad = x.clone()
    bad[0, block + 3] = math.nan  # row 0, block 1
    bad[1, 3 * block] = math.inf  # row 1, block 3
    bad[2, 0] = -math.inf  # row 2, block 0
    out = quant(bad, block).float().view(3, 4, block)
    poisoned = torch.zeros(3, 4, dtype=torch.bool)
    poisoned[0, 1] = poisoned[1, 3] = poisoned[2, 0] = True
    assert torch.equal(out.isnan().all(-1), poisoned)
    assert torch.equal(out.isnan().any(-1), poisoned)
    clean = quant(x, block).float().view(3, 4, block)
    assert torch.equal(out[~poisoned], clean[~poisoned])  # finite blocks are unaffected


def test_fp4_decode_names_a_width_that_is_not_a_multiple_of_32():
    with pytest.raises(ValueError, match=r"K = 2 \* 24 packed columns = 48 is not a multiple of 32"):
        fp4_decode(torch.zeros(2, 24, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))


def test_fp4_helpers_follow_the_input_device():
    """`_fp4_codes` / `fp4_values` used to build CPU tensors whatever the input's device."""
    x = torch.empty(2, 64, device="meta")
    assert act_quant_fp4(x).device.type == "meta"
    assert act_quant_fp8(x, 32).device.type == "meta"
