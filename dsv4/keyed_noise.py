"""Counter-based random numbers keyed by (seed, position, stream), on any torch device.

Owns the one generator every random draw of sampling comes from (docs/sampling.md §2):
Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
counter-based generator cuRAND and JAX also use. A counter-based generator is a keyed
bijection: output block i of key (seed, position, stream) is a pure function of those
integers, so a row of V uniforms is V / 4 independent evaluations that run in parallel on
whatever device holds the logits, with no state and no host round trip.

Layout. Key (k0, k1) = the seed's low and high 32 bits (seeds are < 2**63). Counter
(c0, c1, c2, c3) = (block index i within the row, position's low 32 bits, position's high
32 bits, stream). Block i yields the 32-bit words of uniforms 4i .. 4i + 3; word w maps to
the uniform (w + 0.5) / 2**32, exact in fp64 and strictly inside (0, 1), so -log(-log(u)) is
always finite.

Bits. Everything is int64 tensor arithmetic on words below 2**32. A round's 32 x 32-bit
product is one int64 multiply whose low 64 bits are kept: two's-complement wrap, what every
torch backend's int64 multiply does (x86 imul and AVX multiplies on the CPU, mul.lo.s64 on
CUDA); shifting and masking then give the high and low words. (Splitting the operands into
16-bit halves would avoid the wrap but costs three times the ops: 8.5 against 2.9 ms per
row of 129,280 on one CPU thread.) A CPU and a CUDA device therefore give the same words bit
for bit (tests/test_keyed_noise.py checks a recorded fixture everywhere
and CUDA against the CPU where CUDA exists), which the coupled rule needs: a drafter and a
verifier on different devices draw the same noise for the same key. The uniforms are an
exact function of the words; the Gumbel transform is IEEE fp64 `log`, which a device's
library may round differently in the last bit: that can only change a drafter's proposal in
a tie to 1e-16, never a verifier's output (every committed token is the verifier's own draw).

Dimension legend: S = rows (positions), n = numbers per row.
"""

from __future__ import annotations

import torch

# Philox-4x32 round multipliers and Weyl key increments (Salmon et al., table 2).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF
_TWO_POW_M32 = 2.0 ** -32


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 of counter words c0..c3 (int64 tensors in [0, 2**32), broadcastable,
    on one device) under key words k0, k1 (ints in [0, 2**32)) -> four int64 tensors of the
    broadcast shape, each word in [0, 2**32). Matches the Random123 known-answer vectors.

    Each round's 32 x 32-bit products are one int64 multiply: its low 64 bits are the exact
    product's whatever the sign wrap, so the high word is (x >> 32) & MASK32 and the low word
    x & MASK32 (see the module docstring on why every backend gives these bits)."""
    for _ in range(ROUNDS):
        x0, x1 = c0 * M0, c2 * M1  # the full products, modulo 2**64
        n0 = (x1 >> 32).bitwise_and_(MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        n2 = (x0 >> 32).bitwise_and_(MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c0, c1, c2, c3 = n0, x1.bitwise_and_(MASK32), n2, x0.bitwise_and_(MASK32)
        k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return c0, c1, c2, c3


def _positions(positions, device: torch.device) -> torch.Tensor:
    """S positions (ints, or an int64 tensor) -> [S, 1] int64 on `device`. A run of
    consecutive ints (every caller's case: a decode row, a verify block) is built on the
    device from its first value, so no host-to-device copy is made."""
    if torch.is_tensor(positions):
        return positions.to(device=device, dtype=torch.int64).reshape(-1, 1)
    pos = [int(p) for p in positions]
    if pos and pos == list(range(pos[0], pos[0] + len(pos))):
        return (torch.arange(len(pos), dtype=torch.int64, device=device) + pos[0]).reshape(-1, 1)
    return torch.tensor(pos, dtype=torch.int64).reshape(-1, 1).to(device, non_blocking=True)


def words(seed: int, positions, stream: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first n 32-bit words of each key (seed, position, stream): [S, n] int64 in
    [0, 2**32) on `device`.

    seed in [0, 2**63); positions: S ints or an int64 tensor (each in [0, 2**63)); stream and
    n >= 0 ints. The caller validates the ranges (`dsv4.sampling.uniforms` does).
    """
    device = torch.device(device)
    pos = _positions(positions, device)  # [S, 1]
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device).reshape(1, -1)  # [1, B]
    c0 = blocks.expand(pos.shape[0], -1)
    c1 = (pos & MASK32).expand_as(c0)
    c2 = (pos >> 32).expand_as(c0)
    c3 = torch.full_like(c0, int(stream))
    out = philox4x32(c0, c1, c2, c3, int(seed) & MASK32, (int(seed) >> 32) & MASK32)
    return torch.stack(out, dim=-1).reshape(pos.shape[0], -1)[:, :n]  # [S, B, 4] -> [S, n]


def to_uniform(w: torch.Tensor) -> torch.Tensor:
    """32-bit words (int64 in [0, 2**32)) -> uniforms (w + 0.5) / 2**32, fp64 in
    [2**-33, 1 - 2**-33]: exact, so equal words give equal uniforms on every device."""
    return (w.double() + 0.5) * _TWO_POW_M32
