"""The `gpu` shape: DeepSeek-V4-Flash on one TP=4 H100 node, by roofline (docs/simulate.md §2.3).

A step of R rows over S sessions takes

    step(R, S) = overhead + max(bytes(R) / bandwidth, flops(R) / peak) + S * kv_bytes / bandwidth
    bytes(R)   = dense_bytes + layers * experts_touched(R) * expert_bytes
    experts_touched(R) = E * (1 - (1 - k / E) ** R)        (routing taken as uniform)
    flops(R)   = 2 * active_params * R

with the published config (docs/model.md §1): 43 trunk layers, width 4096, 64 heads of 512,
q/o low ranks 1024 in 8 output groups, 256 routed experts of intermediate 2048 (fp4 e2m1 with
an ue8m0 scale per 32 weights: 0.53125 B per weight), one shared expert and the attention in
fp8 (1 B per weight), the head in bf16. The drafter (three DSpark stages of the same layer
geometry, 5 draft slots per session) runs on its own H100. `overhead` is the fixed per-step
cost the roofline leaves out (launches, all-reduces, host work); it is fitted at one row to
the peer's measured single-stream costs (plain 72.7 ms, draft 24 ms) and `models.roofline_check`
prints the comparison.
"""

from __future__ import annotations

from services.common.budget import StepTimes

# Published config (docs/model.md §1).
LAYERS, DIM, HEADS, HEAD_DIM, Q_LORA, O_LORA, O_GROUPS = 43, 4096, 64, 512, 1024, 1024, 8
EXPERTS, TOP_K, MOE_INTER, VOCAB, DRAFT_STAGES, BLOCK = 256, 6, 2048, 129280, 3, 5
INDEX_HEADS, INDEX_DIM, COMPRESS_WIDTH = 64, 128, 512
FP4_BYTES, FP8_BYTES, BF16_BYTES = 0.53125, 1.0, 2.0
# Hardware (NVIDIA H100 SXM datasheet): HBM3 3.35 TB/s, dense fp8 1979 TFLOP/s per GPU.
HBM_BYTES_PER_MS, FP8_FLOPS_PER_MS, TP = 3.35e9, 1.979e12, 4
# The peer's single-stream costs the overheads are fitted to (ms, one row / one session).
PEER_PLAIN_MS, PEER_DRAFT_MS, PEER_VERIFY = 72.7, 24.0, (71.0, 16.0)
COMMIT_MS = 1.0  # assumed for a commit of any rows (a few rows per stage); no measured figure exists
CONTEXT = 1024  # tokens of context each session's attention reads (prompt + output)


def attention_params() -> float:
    """Weights of one layer's attention (q low-rank, kv latent, grouped output, compressor and
    indexer), in weights."""
    q = DIM * Q_LORA + Q_LORA * HEADS * HEAD_DIM
    kv = DIM * HEAD_DIM
    out = HEADS * HEAD_DIM * O_LORA + O_GROUPS * O_LORA * DIM
    compress = 2 * DIM * COMPRESS_WIDTH + Q_LORA * INDEX_HEADS * INDEX_DIM
    return q + kv + out + compress


EXPERT_PARAMS = 3 * DIM * MOE_INTER  # gate, up, down
LAYER_DENSE_BYTES = (attention_params() + EXPERT_PARAMS + EXPERTS * DIM) * FP8_BYTES  # + shared expert, router
HEAD_BYTES = VOCAB * DIM * BF16_BYTES
EXPERT_BYTES = EXPERT_PARAMS * FP4_BYTES
ACTIVE_PARAMS = LAYERS * (attention_params() + (1 + TOP_K) * EXPERT_PARAMS) + VOCAB * DIM


def experts_touched(rows: float) -> float:
    """Expected distinct routed experts of one layer that `rows` tokens route to."""
    return EXPERTS * (1.0 - (1.0 - TOP_K / EXPERTS) ** rows)


def kv_bytes(context: int = CONTEXT) -> float:
    """KV bytes one session's attention reads per step over the 43 layers: the 128-token
    window everywhere, plus the indexer's top 512 of context / 4 entries and its keys on the 21
    CSA layers, and context / 128 entries on the 20 HCA layers; a latent entry is 512 fp8 + 64
    bf16 (576 B)."""
    entry = HEAD_DIM + 64
    csa = (128 + min(512, context / 4)) * entry + context / 4 * INDEX_DIM
    hca = (128 + context / 128) * entry
    return 21 * csa + 20 * hca + 2 * 128 * entry


def trunk_roofline_ms(rows: float) -> float:
    """The trunk's roofline time of one step of `rows` rows on the TP group (ms), overhead excluded."""
    weights = LAYERS * (LAYER_DENSE_BYTES + experts_touched(rows) * EXPERT_BYTES) + HEAD_BYTES
    return max(weights / (TP * HBM_BYTES_PER_MS), 2 * ACTIVE_PARAMS * rows / (TP * FP8_FLOPS_PER_MS))


def draft_roofline_ms(sessions: float) -> float:
    """The drafter's roofline time of one draft step of `sessions` sessions on one GPU (ms)."""
    rows = sessions * BLOCK
    weights = DRAFT_STAGES * (LAYER_DENSE_BYTES + experts_touched(rows) * EXPERT_BYTES) + HEAD_BYTES
    active = DRAFT_STAGES * (attention_params() + (1 + TOP_K) * EXPERT_PARAMS) + VOCAB * DIM
    return max(weights / HBM_BYTES_PER_MS, 2 * active * rows / FP8_FLOPS_PER_MS)


def gpu_tables() -> tuple[StepTimes, StepTimes, StepTimes, float]:
    """(verifier step table over rows, draft table over sessions, commit table over rows, session_ms)."""
    session_ms = kv_bytes() / (TP * HBM_BYTES_PER_MS)
    overhead = PEER_PLAIN_MS - trunk_roofline_ms(1) - session_ms
    rows = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096]
    verifier = StepTimes(tuple(float(r) for r in rows), tuple(overhead + trunk_roofline_ms(r) for r in rows))
    d_overhead = PEER_DRAFT_MS - draft_roofline_ms(1)
    sessions = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    draft = StepTimes(tuple(float(s) for s in sessions), tuple(d_overhead + draft_roofline_ms(s) for s in sessions))
    commit = StepTimes((1.0,), (COMMIT_MS,))
    return verifier, draft, commit, session_ms
