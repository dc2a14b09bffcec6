"""PyTorch reference of sparse MLA attention (forward and backward): the semantic source of truth.

Math (one query row t, head h; ``K = kv[i]`` all Dqk dims, ``V = kv[i, :d_v]``):
    valid j: ``j < topk_length[t]`` and ``0 <= indices[t, j] < Tkv`` (duplicates count as separate keys)
    ``s_j = sm_scale * q[t, h] . kv[indices[t, j]]``; ``lse = log(sum_j exp(s_j))`` (natural log)
    ``out = sum_j exp(s_j - lse) * kv[indices[t, j], :d_v] * g`` with ``g = 1 / (1 + exp(sink[h] - lse))`` (g = 1
    without sink); empty rows: out 0, lse +inf, max_logits -inf.

Backward (the sink acts as one more logit whose value vector is 0):
    ``P_j = exp(s_j - lse) * g``; ``delta = out . dout``; ``dP_j = dout . V_j``; ``dS_j = P_j * (dP_j - delta)``
    ``dq = sm_scale * sum_j dS_j K_j``; ``dkv[i_j] += sm_scale * dS_j q`` and ``dkv[i_j, :d_v] += P_j dout``
    ``d_sink[h] = -sum_t (1 - g) * delta``.

Computes in float32 (float64 if given float64), processing query rows in chunks so that at most about
``2**26`` gathered elements exist at once. Runs on CPU and CUDA. Invalid indices are clamped to row 0 for the
gather and the gathered values replaced by 0 with ``torch.where``, so NaN in unreferenced rows never leaks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..quant import dequantize_kv_fp8

_CHUNK_ELEMS = 1 << 26


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk_rows(topk: int, dqk: int, heads: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, topk * max(dqk, heads)))


def valid_mask(indices: torch.Tensor, num_kv: int, topk_length: Optional[torch.Tensor]) -> torch.Tensor:
    """`[T, topk]` bool: index in [0, num_kv) and position < topk_length[t]."""
    valid = (indices >= 0) & (indices < num_kv)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        valid &= pos.unsqueeze(0) < topk_length.unsqueeze(-1).to(pos.dtype)
    return valid


def _gather(kv: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv rows at idx (invalid -> 0 without propagating what row 0 holds): `[t, topk, D]`."""
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    kv = kv if kv.shape[0] > 0 else kv.new_zeros(1, kv.shape[-1])  # no rows: every index is invalid, gather a dummy
    rows = kv[safe]
    if rows.dtype == torch.uint8:  # the 656-byte FP8 cache row: dequantize what was gathered
        rows = dequantize_kv_fp8(rows)
    rows = rows.to(dtype)
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=dtype, device=kv.device))


def sink_gate(lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """``1 / (1 + exp(sink - lse))`` per [t, h]; 1 where there is no sink or the row is empty (lse = +inf)."""
    if attn_sink is None:
        return torch.ones_like(lse)
    sink = attn_sink.to(lse.dtype).unsqueeze(0).expand_as(lse)
    g = torch.sigmoid(lse - sink)
    return torch.where(torch.isinf(lse) & (lse > 0), torch.ones_like(g), g)


def sparse_mla_fwd_reference(q, kv, indices, *, sm_scale: float, d_v: int,
                             attn_sink: Optional[torch.Tensor] = None,
                             topk_length: Optional[torch.Tensor] = None):
    """Reference forward on the flat form.

    Args:
        q: `[T, H, Dqk]`; kv: `[Tkv, Dqk]`; indices: `[T, topk]` int32; attn_sink: `[H]` or None;
        topk_length: `[T]` int32 or None. Any float dtype; computed in float32 (float64 for float64 inputs).

    Returns:
        out `[T, H, d_v]` (compute dtype), lse `[T, H]`, max_logits `[T, H]` (compute dtype).
    """
    cd = _compute_dtype(q)
    T, H, dqk = q.shape  # kv may be the uint8 [Tkv, 656] FP8 cache (dequantized per gathered row)
    topk = indices.shape[-1]
    out = torch.zeros(T, H, d_v, dtype=cd, device=q.device)
    lse = torch.full((T, H), math.inf, dtype=cd, device=q.device)
    max_logits = torch.full((T, H), -math.inf, dtype=cd, device=q.device)
    step = _chunk_rows(topk, dqk, H)
    for a in range(0, T, step):
        b = min(T, a + step)
        tl = topk_length[a:b] if topk_length is not None else None
        valid = valid_mask(indices[a:b], kv.shape[0], tl)
        k = _gather(kv, indices[a:b], valid, cd)  # [t, topk, Dqk]
        s = torch.einsum("thd,tkd->thk", q[a:b].to(cd), k) * sm_scale
        s = torch.where(valid.unsqueeze(1), s, torch.full((), -math.inf, dtype=cd, device=q.device))
        m = s.amax(dim=-1)  # -inf for empty rows
        empty = torch.isinf(m) & (m < 0)
        m_safe = torch.where(empty, torch.zeros_like(m), m)
        p = torch.exp(s - m_safe.unsqueeze(-1))  # exp(-inf) = 0 for masked keys
        denom = p.sum(dim=-1)
        l_row = torch.where(empty, torch.full_like(m, math.inf), m_safe + torch.log(denom))
        o = (torch.einsum("thk,tkd->thd", p, k[..., :d_v])
             / torch.where(empty, torch.ones_like(denom), denom).unsqueeze(-1))
        out[a:b] = o * sink_gate(l_row, attn_sink).unsqueeze(-1)
        lse[a:b] = l_row
        max_logits[a:b] = m
    return out, lse, max_logits


def _scatter_add_rows(dst: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, deterministic: bool):
    """``dst[rows] += vals`` with duplicates summed; with ``deterministic`` the sum order is fixed (sorted)."""
    if not deterministic:
        dst.index_add_(0, rows, vals)
        return
    prev, prev_warn = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        dst.index_put_((rows,), vals, accumulate=True)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def sparse_mla_bwd_reference(q, kv, indices, out, lse, dout, *, sm_scale: float, d_v: int,
                             attn_sink: Optional[torch.Tensor] = None,
                             topk_length: Optional[torch.Tensor] = None,
                             dlse: Optional[torch.Tensor] = None, deterministic: bool = False,
                             bf16_operands: bool = False):
    """Reference backward on the flat form (analytic, see module docstring).

    Args:
        q, kv, indices, attn_sink, topk_length: as for the forward; out `[T, H, d_v]` and lse `[T, H]` from the
        forward (out including the sink factor); dout `[T, H, d_v]`; dlse `[T, H]` or None, the gradient reaching
        lse (adds ``exp(s_j - lse) * dlse`` to dS_j); deterministic: accumulate dkv with PyTorch's
        deterministic (sorted) scatter-add, bitwise reproducible on CUDA too (CPU is deterministic either way);
        bf16_operands: round P and ``sm_scale * dS`` to bfloat16 before the products that use them, as the
        kernel's wgmmas do (an emulation of its rounding, no races: the error a kernel check should allow where
        dkv is small; kernel_bwd.py's numerics note); the rest runs in the compute dtype, so pass float64 inputs
        for an emulation that rounds only there.

    Returns:
        dq `[T, H, Dqk]`, dkv `[Tkv, Dqk]`, d_sink `[H]` (None without sink), all in the compute dtype.
    """
    cd = _compute_dtype(q)
    T, H, dqk = q.shape
    topk = indices.shape[-1]
    dq = torch.zeros(T, H, dqk, dtype=cd, device=q.device)
    dkv = torch.zeros(kv.shape[0], dqk, dtype=cd, device=q.device)
    d_sink = torch.zeros(H, dtype=cd, device=q.device) if attn_sink is not None else None
    step = _chunk_rows(topk, dqk, H)
    for a in range(0, T, step):
        b = min(T, a + step)
        tl = topk_length[a:b] if topk_length is not None else None
        valid = valid_mask(indices[a:b], kv.shape[0], tl)
        k = _gather(kv, indices[a:b], valid, cd)
        qc, do, oc, lc = q[a:b].to(cd), dout[a:b].to(cd), out[a:b].to(cd), lse[a:b].to(cd)
        s = torch.einsum("thd,tkd->thk", qc, k) * sm_scale
        g = sink_gate(lc, attn_sink)
        finite = torch.isfinite(lc)
        lse_safe = torch.where(finite, lc, torch.zeros_like(lc))
        p_raw = torch.exp(s - lse_safe.unsqueeze(-1))
        p_raw = torch.where(valid.unsqueeze(1) & finite.unsqueeze(-1), p_raw,
                            torch.zeros((), dtype=cd, device=q.device))
        p = p_raw * g.unsqueeze(-1)
        delta = (oc * do).sum(-1)  # [t, h]
        dp = torch.einsum("thd,tkd->thk", do, k[..., :d_v])
        ds = p * (dp - delta.unsqueeze(-1))
        if dlse is not None:
            ds = ds + p_raw * dlse[a:b].to(cd).unsqueeze(-1)
        if bf16_operands:  # the wgmma operands: sm_scale * dS and P in bf16
            ds_s = (ds * sm_scale).to(torch.bfloat16).to(cd)
            dq[a:b] = torch.einsum("thk,tkd->thd", ds_s, k)
            dk = torch.einsum("thk,thd->tkd", ds_s, qc)
            dk[..., :d_v] += torch.einsum("thk,thd->tkd", p.to(torch.bfloat16).to(cd), do)
        else:
            dq[a:b] = sm_scale * torch.einsum("thk,tkd->thd", ds, k)
            dk = sm_scale * torch.einsum("thk,thd->tkd", ds, qc)
            dk[..., :d_v] += torch.einsum("thk,thd->tkd", p, do)
        flat_valid = valid.reshape(-1)
        rows = indices[a:b].reshape(-1)[flat_valid].long()
        _scatter_add_rows(dkv, rows, dk.reshape(-1, dqk)[flat_valid], deterministic)
        if d_sink is not None:
            d_sink -= ((1 - g) * delta * finite).sum(0)
    return dq, dkv, d_sink
