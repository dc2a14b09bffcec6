"""Independent float64 oracles for the FlashDSA tests.

Written from the contracts in issue #2 with explicit Python loops over rows (and over positions where the
contract is about positions); nothing here imports flashdsa. Each oracle upcasts its inputs to float64 (fp8 and
bf16 -> float64 are exact), so comparing an op against it measures the op's own rounding only.
"""

from __future__ import annotations

import math
import struct

import torch

F64 = torch.float64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _f64(x):
    return None if x is None else x.detach().to(F64)


# ------------------------------------------------------------------------------------------------ indexer
def indexer_logits_oracle(q, k, weights, k_scale=None, k_start=None, k_end=None):
    """`[M, N]` float64: ``k_scale[n] * sum_h w[m, h] * relu(q[m, h] . k[n])`` inside ``[k_start, k_end)``."""
    q, k, w, ks = _f64(q), _f64(k), _f64(weights), _f64(k_scale)
    M, H, _ = q.shape
    N = k.shape[0]
    out = torch.full((M, N), -math.inf, dtype=F64)
    for m in range(M):
        lo = 0 if k_start is None else min(max(int(k_start[m]), 0), N)
        hi = N if k_end is None else min(max(int(k_end[m]), 0), N)
        for n in range(lo, hi):
            v = float((w[m] * torch.relu(q[m] @ k[n])).sum())
            out[m, n] = v * (float(ks[n]) if ks is not None else 1.0)
    return out


def paged_slot(block_table_row, p: int, num_blocks: int, block_size: int):
    """Flat cache slot of logical position p of one sequence, or None (past the table / bad block id)."""
    col = p // block_size
    if col >= len(block_table_row):
        return None
    blk = int(block_table_row[col])
    if not 0 <= blk < num_blocks:
        return None
    return blk * block_size + p % block_size


def indexer_logits_paged_oracle(q, k_cache, weights, context_lens, block_table, k_scale_cache=None,
                                max_context=None):
    """`[B*next_n, max_context]` float64 (see issue #2, op 2)."""
    q, kc, w, ksc = _f64(q), _f64(k_cache), _f64(weights), _f64(k_scale_cache)
    B, next_n, H, D = q.shape
    nb, bs = kc.shape[:2]
    flat_k = kc.reshape(nb * bs, D)
    flat_s = ksc.reshape(nb * bs) if ksc is not None else None
    lens = [int(x) for x in context_lens]
    L = max(lens, default=0) if max_context is None else int(max_context)
    out = torch.full((B * next_n, L), -math.inf, dtype=F64)
    for b in range(B):
        bt = [int(x) for x in block_table[b]]
        for j in range(next_n):
            r = b * next_n + j
            limit = lens[b] - next_n + 1 + j
            for p in range(min(max(limit, 0), L)):
                slot = paged_slot(bt, p, nb, bs)
                if slot is None:
                    continue
                v = float((w[r] * torch.relu(q[b, j] @ flat_k[slot])).sum())
                out[r, p] = v * (float(flat_s[slot]) if flat_s is not None else 1.0)
    return out


# ------------------------------------------------------------------------------------------------ top-k
def topk_oracle(scores, k: int, starts=None, ends=None, order: str = "index"):
    """`[M, k]` int64 via a stable sort of Python lists: largest first, ties to the lower position; -inf/NaN
    never selected; -1 padding. ``order="index"`` sorts the kept positions ascending."""
    rows = scores.detach().to(F64).tolist()
    out = []
    for m, row in enumerate(rows):
        N = len(row)
        lo = 0 if starts is None else int(starts[m])
        hi = N if ends is None else int(ends[m])
        cand = [n for n in range(max(lo, 0), min(hi, N)) if not math.isnan(row[n]) and row[n] != -math.inf]
        cand = sorted(cand, key=lambda n: -row[n])  # Python's sort is stable: equal scores keep position order
        sel = cand[:k]
        if order != "score":
            sel = sorted(sel)
        out.append(sel + [-1] * (k - len(sel)))
    return torch.tensor(out, dtype=torch.long).reshape(len(rows), k)


# ------------------------------------------------------------------------------------------------ sparse MLA
def sparse_mla_oracle(q, kv, indices, *, sm_scale=None, d_v=512, attn_sink=None, topk_length=None):
    """Flat-form sparse MLA forward in float64, differentiable by autograd w.r.t. q, kv, attn_sink when those are
    float64 tensors that require grad (other dtypes are upcast, detached).

    q `[T, H, Dqk]`, kv `[Tkv, Dqk]`, indices `[T, topk]` (any ints), attn_sink `[H]`, topk_length `[T]`.
    Returns (out `[T, H, d_v]`, lse `[T, H]`, max_logits `[T, H]`): empty rows give out 0, lse +inf, max -inf.
    """
    q = q if q.dtype == F64 else _f64(q)
    kv = kv if kv.dtype == F64 else _f64(kv)
    sink = None if attn_sink is None else (attn_sink if attn_sink.dtype == F64 else _f64(attn_sink))
    T, H, dqk = q.shape
    Tkv = kv.shape[0]
    scale = dqk ** -0.5 if sm_scale is None else sm_scale
    idx = indices.tolist()
    outs, lses, maxs = [], [], []
    for t in range(T):
        n = len(idx[t]) if topk_length is None else min(max(int(topk_length[t]), 0), len(idx[t]))
        sel = [i for i in idx[t][:n] if 0 <= i < Tkv]  # duplicates kept: separate keys
        if not sel:
            outs.append(torch.zeros(H, d_v, dtype=F64))
            lses.append(torch.full((H,), math.inf, dtype=F64))
            maxs.append(torch.full((H,), -math.inf, dtype=F64))
            continue
        K = kv[sel]  # [n, Dqk]
        s = scale * (q[t] @ K.T)  # [H, n]
        lse = torch.logsumexp(s, dim=-1)
        o = torch.exp(s - lse.unsqueeze(-1)) @ K[:, :d_v]
        if sink is not None:
            o = o * torch.sigmoid(lse - sink).unsqueeze(-1)  # 1 / (1 + exp(sink - lse)); +inf -> 0, -inf -> 1
        outs.append(o)
        lses.append(lse)
        maxs.append(s.max(dim=-1).values)
    return torch.stack(outs), torch.stack(lses), torch.stack(maxs)


def sparse_mla_oracle_batched(q, kv, indices, **kw):
    """Batched form: q `[B, S, H, Dqk]`, kv `[B, S_kv, Dqk]`, indices `[B, S, topk]` -> leading `[B, S]`."""
    res = [sparse_mla_oracle(q[b], kv[b], indices[b], **{**kw, "topk_length": None if kw.get("topk_length") is None
                                                          else kw["topk_length"][b]})
           for b in range(q.shape[0])]
    return tuple(torch.stack(list(x)) for x in zip(*res))


def sparse_mla_oracle_grads(q, kv, indices, dout, *, attn_sink=None, dlse=None, **kw):
    """(dq, dkv, d_sink) of ``sum(out * dout) [+ sum(lse * dlse) over finite lse]`` through the oracle forward."""
    qd = _f64(q).requires_grad_(True)
    kvd = _f64(kv).requires_grad_(True)
    sd = None if attn_sink is None else _f64(attn_sink).requires_grad_(True)
    out, lse, _ = sparse_mla_oracle(qd, kvd, indices, attn_sink=sd, **kw)
    loss = (out * _f64(dout)).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(_f64(dlse)).sum()
    wrt = [qd, kvd] + ([sd] if sd is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
    return grads[0], grads[1], (grads[2] if sd is not None else None)


# ------------------------------------------------------------------------------------------------ decode
def decode_slots(block_table, cache_seqlens, num_blocks, block_size, s_q, causal):
    """Per (b, i): the list of flat cache slots a dense decode query attends."""
    out = []
    for b in range(len(cache_seqlens)):
        bt = [int(x) for x in block_table[b]]
        row = []
        for i in range(s_q):
            limit = int(cache_seqlens[b]) - s_q + 1 + i if causal else int(cache_seqlens[b])
            slots = [paged_slot(bt, p, num_blocks, block_size) for p in range(max(limit, 0))]
            row.append([s for s in slots if s is not None])
        out.append(row)
    return out


def mla_decode_oracle(q, kv_rows, slot_lists, *, sm_scale=None, d_v=512, attn_sink=None):
    """q `[B, s_q, H, Dqk]`; kv_rows `[num_slots, Dqk]` (already dequantized); slot_lists[b][i] = attended slots
    (entries outside [0, num_slots) are skipped). Returns out `[B, s_q, H, d_v]`, lse `[B, s_q, H]`."""
    B, s_q, H, dqk = q.shape
    width = max([1] + [len(s) for r in slot_lists for s in r])
    idx = torch.full((B * s_q, width), -1, dtype=torch.long)
    for b in range(B):
        for i in range(s_q):
            for j, s in enumerate(slot_lists[b][i]):
                idx[b * s_q + i, j] = s
    out, lse, _ = sparse_mla_oracle(q.reshape(B * s_q, H, dqk), kv_rows, idx, sm_scale=sm_scale, d_v=d_v,
                                    attn_sink=attn_sink)
    return out.reshape(B, s_q, H, d_v), lse.reshape(B, s_q, H)


# ------------------------------------------------------------------------------------------------ FP8
def e4m3_value(code: int) -> float:
    """The float value of one float8_e4m3fn byte (bias 7, no inf, 0x7F/0xFF NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, mnt = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and mnt == 0x7:
        return math.nan
    if e == 0:
        return sign * mnt / 8 * 2.0**-6
    return sign * (1 + mnt / 8) * 2.0 ** (e - 7)


E4M3_TABLE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=F64)
_POS_CODES = torch.arange(0x7F)  # finite non-negative codes 0x00..0x7E, ascending in value


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values (|x| <= 448) to the nearest e4m3 code, ties to an even mantissa: uint8 codes."""
    x = x.to(F64).flatten()
    mag = x.abs()
    vals = E4M3_TABLE[:0x7F]
    d = (mag.unsqueeze(-1) - vals.unsqueeze(0)).abs()
    best = d.min(dim=-1, keepdim=True).values
    tie = d == best
    even = tie & (_POS_CODES.unsqueeze(0) % 2 == 0)
    pick = torch.where(even.any(-1), even.float().argmax(-1), tie.float().argmax(-1))
    code = pick + torch.where(torch.signbit(x), 0x80, 0)  # IEEE: the sign survives rounding to 0
    return code.to(torch.uint8)


def kv_fp8_pack_oracle(row: torch.Tensor) -> bytes:
    """One 576-dim bf16 row -> the 656-byte FP8 KV record, built field by field."""
    r = row.detach().to(F64)
    buf = bytearray()
    scales = []
    for tile in range(4):
        x = r[tile * 128:(tile + 1) * 128]
        amax = float(x.abs().max())
        scale = 2.0 ** math.ceil(math.log2(max(amax / 448.0, 1e-4)))
        scales.append(scale)
        buf += bytes(e4m3_encode(x / scale).tolist())
    for s in scales:
        buf += struct.pack("<f", s)
    for v in row[512:].to(torch.bfloat16).float().tolist():
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        buf += struct.pack("<H", bits >> 16)
    assert len(buf) == 656
    return bytes(buf)


def kv_fp8_unpack_oracle(rec: bytes) -> torch.Tensor:
    """One 656-byte record -> float64 `[576]` values."""
    scales = struct.unpack("<4f", rec[512:528])
    lat = [E4M3_TABLE[rec[i]].item() * scales[i // 128] for i in range(512)]
    rope = []
    for i in range(64):
        (h,) = struct.unpack("<H", rec[528 + 2 * i:530 + 2 * i])
        rope.append(struct.unpack("<f", struct.pack("<I", h << 16))[0])
    return torch.tensor(lat + rope, dtype=F64)
