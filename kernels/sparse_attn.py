"""Sparse attention with a sink over per-query index lists (docs/model.md §5.4;
dsv4.attention.sparse_attn), beside its torch reference `sparse_attn_ref`. This module owns
that reduction; it never builds the index lists or touches a ring (`dsv4.attention`).

Dimension legend: S = queries, H = heads, Dh = head_dim, N = rows of the key/value tensor,
K = index columns per query (-1 = masked).

out[s, h] = sum_k softmax_k(l[s, h, k] with the sink in the denominator) kv[idx[s, k]], with
l = scale * q[s, h] . kv[idx[s, k]] (one KV head: key = value). The kernel streams a query's
index list in chunks of BLOCK_K keys with a running max and denominator (flash-attention
style) whose initial state is the sink (m = sink, l = 1, acc = 0); a masked key adds exact
zeros, so padding a list with -1 never changes a result.
"""

from __future__ import annotations

import torch

from kernels.checks import interpreting, out_tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Gather-then-softmax reference: q [S, H, Dh], kv [N, Dh], sink [H] fp32, idx [S, K] int
    (-1 = masked) -> [S, H, Dh] in q.dtype, computed in fp32 (the same math as dsv4.attention)."""
    rows = kv[idx.clamp(min=0)].float()  # (S, K, Dh); reads S*K*Dh
    logits = torch.einsum("shd,skd->shk", q.float(), rows) * scale  # (S, H, K)
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(-1), sink[None, :]).unsqueeze(-1)  # (S, H, 1)
    p = torch.exp(logits - m)
    den = p.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
    return torch.einsum("shk,skd->shd", p / den, rows).to(q.dtype)


if triton is not None:
    @triton.jit
    def _sparse_attn_kernel(
        # Pointers: q [S, H, Dh], kv [N, Dh], sink [H] fp32, idx [S, K] int, out [S, H, Dh]
        q_ptr, kv_ptr, sink_ptr, idx_ptr, out_ptr,
        # Sizes
        H, Dh, K, scale,
        # Strides (elements)
        stride_qs, stride_qh, stride_kvn, stride_is, stride_os, stride_oh,
        # Meta-parameters: heads per program, keys per step, Dh padded to a power of two;
        # DOT_F32 casts the tiles to fp32 before tl.dot (the interpreter gets bf16 dots wrong)
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Grid (S, cdiv(H, BLOCK_H)): one program per (query, head block)."""
        s = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask, d_mask = offs_h < H, offs_d < Dh
        q = tl.load(q_ptr + s * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        q = q.to(tl.float32) if DOT_F32 else q
        # running state starts at the sink: m = sink, denominator exp(sink - m) = 1
        m = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        den = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ids = tl.load(idx_ptr + s * stride_is + offs_k, mask=offs_k < K, other=-1)
            live = ids >= 0
            rows = tl.load(kv_ptr + tl.where(live, ids, 0)[:, None] * stride_kvn + offs_d[None, :],
                           mask=live[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_D] gathered
            rows = rows.to(tl.float32) if DOT_F32 else rows.to(q.dtype)
            if DOT_F32:  # ieee: no tf32 rounding of fp32 tiles on GPUs
                logits = tl.dot(q, tl.trans(rows), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_K]
            else:
                logits = tl.dot(q, tl.trans(rows)) * scale
            logits = tl.where(live[None, :], logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
            p = tl.exp(logits - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, rows, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(rows.dtype), rows)
            m = m_new
        out = acc / den[:, None]
        tl.store(out_ptr + s * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                block_h: int | None = None, block_k: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton sparse attention with sink; same contract as `sparse_attn_ref`.

    out: optional [S, H, Dh] destination in q.dtype (leading dims may be strided).

    block_h / block_k: heads and keys per program step (powers of two >= 16; default 16/64 on
    a GPU, every head and 128 keys under the interpreter, where each step costs milliseconds).
    Raises:
        ValueError: shapes or dtypes that do not fit the contract (named).
        ImportError: triton is not installed.
    """
    if triton is None:
        raise ImportError("kernels.sparse_attn: triton is not installed (use sparse_attn_ref)")
    if q.ndim != 3 or kv.ndim != 2 or idx.ndim != 2 or sink.ndim != 1:
        raise ValueError(f"sparse_attn: expected q [S, H, Dh], kv [N, Dh], sink [H], idx [S, K]; got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(sink.shape)}, {tuple(idx.shape)}")
    S, H, Dh = q.shape
    if kv.shape[1] != Dh or sink.shape[0] != H or idx.shape[0] != S:
        raise ValueError(f"sparse_attn: mismatched shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"sink {tuple(sink.shape)}, idx {tuple(idx.shape)}")
    if idx.is_floating_point() or not q.is_floating_point() or not kv.is_floating_point():
        raise ValueError(f"sparse_attn: float q/kv and integer idx expected, got {q.dtype}, {kv.dtype}, {idx.dtype}")
    interpret = interpreting()
    block_h = block_h or (triton.next_power_of_2(max(H, 16)) if interpret else 16)
    block_k = block_k or (128 if interpret else (64 if Dh <= 256 else 32))  # wide heads: smaller key tiles
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.contiguous()
    sink = sink.float().contiguous()
    out = out_tensor(out, (S, H, Dh), q.dtype, q.device, "sparse_attn")
    if out.numel():
        grid = (S, triton.cdiv(H, block_h))
        _sparse_attn_kernel[grid](
            q, kv, sink, idx, out, H, Dh, idx.shape[1], float(scale),
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=triton.next_power_of_2(max(Dh, 16)),
            DOT_F32=interpret or q.dtype == torch.float32 or kv.dtype == torch.float32,
        )
    return out
