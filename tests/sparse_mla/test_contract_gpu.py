"""The sparse MLA forward contract (issues #8 and #7) at the points the kernel test matrices miss, through the
public ops (``flashdsa.sparse_mla_fwd`` / ``flashdsa.sparse_attn``):

1. strided kv / indices (padded row strides, rows 16-byte but not 128-byte aligned, batched transposed storage)
   for H 16 / 64 / 128 at Dqk 576 and 512;
2. 70,000+ query rows in one call (grid limits), a row subset checked plus the whole output;
3. 128K keys, indices over the whole range including its last rows;
4. CUDA-graph capture, then replays with different indices and topk_length written into the captured buffers;
5. the FP8 compute form at H 1, S 1, (Tkv, topk) (128, 128) and (1840, 256);
6. the 656-byte FP8 cache at S 1, (128, 128) and (592, 128), H 1 and 64.

Every test runs twice: ``cuda`` (marked gpu) calls ``backend="kernel"`` (a silent fall-back to the reference cannot
pass) and ``cpu`` builds the same inputs (some shapes scaled down) and runs ``backend="reference"``; both are
checked against the float64 oracle of tests/oracles.py, and the cuda variant also with the GPU tests' own checks
(``check_against_reference`` etc., imported where CUDA exists). Tolerances: out abs 8e-4 or rel 3/128 and cosine
distance 7e-6, lse abs 1e-6 or rel 2/65536 (FP8 compute: out abs 2e-3 or rel 4/128, as test_kernel_fp8_gpu).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

import flashdsa
from flashdsa import _dispatch
from devices import backend_for as _backend, on_devices
from oracles import INT32_MAX, INT32_MIN, sparse_mla_oracle

D_V = 512
BF16_TOL = dict(out_abs=8e-4, out_rel=3 / 128, cos=7e-6, lse_abs=1e-6, lse_rel=2 / 65536)
FP8_TOL = dict(out_abs=2e-3, out_rel=4 / 128, cos=1e-4, lse_abs=1e-2, lse_rel=0.0)  # test_kernel_fp8_gpu's _check


@dataclasses.dataclass
class Inputs:
    """Flat inputs: q [T, H, Dqk], kv [batch * Tkv, Dqk] (batch b owns rows [b * Tkv, (b + 1) * Tkv)), idx [T, topk]
    positions within the query's batch, flat_idx its rows of the flat kv (-1 where out of range), valid [T, topk]."""
    q: torch.Tensor
    kv: torch.Tensor
    idx: torch.Tensor
    flat_idx: torch.Tensor
    tl: Optional[torch.Tensor]
    sink: Optional[torch.Tensor]
    valid: torch.Tensor


def _inputs(device, dqk, heads, tkv, topk, n_tok, *, sink=False, use_tl=False, seed=0, batch=1):
    """q, kv ~ N(0, 0.1^2) bf16 (test_kernel_gpu's distribution); random indices (duplicates) with the last kv rows
    pinned in, ~10 % invalid of every kind, one all-invalid row; kv rows no valid slot selects hold NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(n_tok, heads, dqk, generator=g, device=device) * 0.1).bfloat16()
    kv = (torch.randn(batch * tkv, dqk, generator=g, device=device) * 0.1).bfloat16()
    idx = torch.randint(0, tkv, (n_tok, topk), generator=g, device=device)
    idx[:, :min(topk, 3)] = torch.tensor([tkv - 1, 0, tkv - 2], device=device)[:min(topk, 3)]
    bad_vals = torch.tensor([INT32_MIN, -123456, -1, tkv, 114514, INT32_MAX], device=device)
    bad = bad_vals[torch.randint(0, len(bad_vals), (n_tok, topk), generator=g, device=device)]
    idx = torch.where(torch.rand(n_tok, topk, generator=g, device=device) < 0.1, bad, idx)
    if n_tok > 1:
        idx[n_tok // 2] = bad[n_tok // 2]
    tl = None
    if use_tl:
        tl = torch.randint(0, topk + 1, (n_tok,), generator=g, device=device, dtype=torch.int32)
        tl[:4] = torch.tensor([topk, topk + 7, 0, -5], device=device, dtype=torch.int32)[:n_tok]
    attn_sink = None
    if sink:
        attn_sink = torch.randn(heads, generator=g, device=device) * 2.0 + 3.0
        if heads > 3:  # H <= 3 keeps finite sinks, which change the output
            attn_sink[:3] = torch.tensor([-math.inf, math.inf, 40.0], device=device)
    in_range = (idx >= 0) & (idx < tkv)
    valid = in_range.clone()
    if tl is not None:
        valid &= torch.arange(topk, device=device) < tl.unsqueeze(1).long()
    batch_of = torch.arange(n_tok, device=device) // (n_tok // batch)
    flat_idx = torch.where(in_range, idx + (batch_of * tkv).unsqueeze(1), -1)
    referenced = torch.zeros(batch * tkv, dtype=torch.bool, device=device)
    referenced[flat_idx[valid]] = True
    kv[~referenced] = float("nan")
    return Inputs(q, kv, idx.int(), flat_idx.int(), tl, attn_sink, valid)


def _cos_dist(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (1 - (a @ b) / (a.norm() * b.norm()).clamp_min(1e-300)).item() if b.norm() > 0 else a.norm().item()


def _verify(device, got, x, *, rows=None, tol=BF16_TOL, fp8=None):
    """got = flat (out, lse or None, max_logits or None) for inputs x (fp8: the FP8 compute form's (q8, q_scale,
    kv8, kv_scale); x then holds their dequantization).  Whole output: shapes, finite, empty rows exact; the rows
    ``rows`` (default all): the float64 oracle within ``tol``, and on cuda the GPU tests' checks."""
    out, lse, mx = got
    n_tok, heads = x.q.shape[:2]
    assert out.shape == (n_tok, heads, D_V) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "non-finite output"
    empty = ~x.valid.any(dim=1)
    assert (out[empty] == 0).all()
    for name, s, empty_val in (("lse", lse, math.inf), ("max_logits", mx, -math.inf)):
        if s is not None:
            assert s.shape == (n_tok, heads) and s.dtype == torch.float32, name
            assert not torch.isnan(s).any(), f"{name}: NaN"
            assert (s[empty] == empty_val).all(), f"{name}: empty rows"

    sel = torch.arange(n_tok, device=out.device) if rows is None else rows
    tl = None if x.tl is None else x.tl[sel]
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731  (the oracle builds its empty rows on the CPU)
    exp = sparse_mla_oracle(cpu(x.q[sel]), cpu(x.kv), cpu(x.flat_idx[sel]), d_v=D_V, attn_sink=cpu(x.sink),
                            topk_length=cpu(tl))
    o = out[sel].double().cpu()
    torch.testing.assert_close(o, exp[0], atol=tol["out_abs"], rtol=tol["out_rel"])
    assert _cos_dist(o, exp[0]) <= tol["cos"], f"cosine distance {_cos_dist(o, exp[0]):.3e}"
    for s, e in ((lse, exp[1]), (mx, exp[2])):
        if s is not None:
            torch.testing.assert_close(s[sel].double().cpu(), e, atol=tol["lse_abs"], rtol=tol["lse_rel"])

    if device == "cuda":  # the GPU suites' own checks (their modules skip themselves where CUDA is absent)
        sm_scale = x.q.shape[-1] ** -0.5
        if fp8 is not None:
            from .test_kernel_fp8_gpu import _check

            q8, q_scale, kv8, kv_scale = fp8
            q8 = q8.view(torch.uint8)[sel].view(q8.dtype)  # row selection on bytes (indexing float8 is not universal)
            _check(out[sel], lse[sel], mx[sel], q8, q_scale[sel], kv8, kv_scale, x.flat_idx[sel], sm_scale, tl,
                   x.sink, x.valid[sel])
        elif lse is None:
            from .test_kernel_gpu import _check_close_out

            _check_close_out(out[sel], exp[0].to(out.device), "out")
        else:
            from .test_kernel_gpu import check_against_reference

            check_against_reference(out[sel], lse[sel], mx[sel], x.q[sel], x.kv, x.flat_idx[sel], sm_scale, tl,
                                    x.sink, x.valid[sel])


def _fwd(x, q, kv, idx, tl, device):
    return flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=x.sink, topk_length=tl, return_max_logits=True,
                                   backend=_backend(device))


# ------------------------------------------------------------------------------------------------ 1. strides
def _restride(x, kind, fill):
    """A copy of 2-D ``x`` in another storage: "rowpad" (row stride padded by 40 elements), "off16" (contiguous,
    starting 16 bytes into its buffer) or "off16pad" (starting 16 bytes in, row stride padded by 16 bytes)."""
    rows, cols = x.shape
    e = 16 // x.element_size()
    if kind == "rowpad":
        base = torch.full((rows, cols + 40), fill, dtype=x.dtype, device=x.device)
        return base[:, :cols].copy_(x)
    pad = 0 if kind == "off16" else e
    buf = torch.full((e + rows * (cols + pad),), fill, dtype=x.dtype, device=x.device)
    view = buf.as_strided((rows, cols), (cols + pad, 1), e).copy_(x)
    assert view.data_ptr() % 16 == 0 and view.data_ptr() % 128 != 0
    return view


STRIDE_CASES = [(kind, dqk, heads) for kind in ("rowpad", "off16", "off16pad", "batched_t")
                for dqk in (576, 512) for heads in (16, 64, 128)]


@on_devices
@pytest.mark.parametrize("kind,dqk,heads", STRIDE_CASES, ids=[f"{k}-d{d}-h{h}" for k, d, h in STRIDE_CASES])
def test_strided_kv_and_indices(device, kind, dqk, heads):
    """kv and indices in padded / offset / transposed storage (last dim contiguous): the reference's result."""
    tkv, topk, n_tok, batch = 592, 100, 62, (2 if kind == "batched_t" else 1)
    x = _inputs(device, dqk, heads, tkv, topk, n_tok, sink=True, use_tl=True, seed=dqk + heads, batch=batch)
    if kind == "batched_t":  # [S, B, ...] storage viewed as [B, S, ...]
        s = n_tok // batch
        q = x.q.view(batch, s, heads, dqk).transpose(0, 1).contiguous().transpose(0, 1)
        kv = x.kv.view(batch, tkv, dqk).transpose(0, 1).contiguous().transpose(0, 1)
        idx = x.idx.view(batch, s, topk).transpose(0, 1).contiguous().transpose(0, 1)
        tl = x.tl.view(batch, s).t().contiguous().t()
        assert not (q.is_contiguous() or kv.is_contiguous() or idx.is_contiguous() or tl.is_contiguous())
        out, lse, mx = _fwd(x, q, kv, idx, tl, device)
        _verify(device, (out.flatten(0, 1), lse.flatten(0, 1), mx.flatten(0, 1)), x)
        return
    kv = _restride(x.kv, kind, float("nan"))  # NaN padding: a read past the row shows up
    idx = _restride(x.idx, kind, 0)  # padding holds a valid index: a read past topk changes the result
    q = _restride(x.q.flatten(1), "off16", float("nan")).view(x.q.shape) if kind == "off16" else x.q
    assert kv.stride(-1) == 1 and idx.stride(-1) == 1 and (kind == "off16") == kv.is_contiguous()
    got = _fwd(x, q, kv, idx, x.tl, device)
    _verify(device, got, x)
    again = _fwd(x, q, kv, idx, x.tl, device)  # a repeated call: the eager plan on cuda where one is stored
    assert all(torch.equal(a, b) for a, b in zip(got, again))


# ------------------------------------------------------------------------------------------------ 2. many rows
@on_devices
@pytest.mark.parametrize("dqk,heads", [(576, 1), (512, 16), (576, 64)])
def test_many_query_rows(device, dqk, heads):
    """70,001 query rows in one call (past 65,535, the CUDA grid's y / z limit); cpu: 701 rows."""
    n_tok, tkv, topk = (70001, 4096, 64) if device == "cuda" else (701, 512, 64)
    x = _inputs(device, dqk, heads, tkv, topk, n_tok, sink=True, use_tl=True, seed=heads)
    got = _fwd(x, x.q, x.kv, x.idx, x.tl, device)
    g = torch.Generator(device=device).manual_seed(3)
    edges = torch.tensor([0, 1, 65534, 65535, 65536, n_tok // 2, n_tok - 2, n_tok - 1], device=device)
    n_check = 512 if device == "cuda" else 96
    rows = torch.cat([torch.randperm(n_tok, generator=g, device=device)[:n_check], edges[edges < n_tok]]).unique()
    _verify(device, got, x, rows=rows)


# ------------------------------------------------------------------------------------------------ 3. 128K keys
@on_devices
@pytest.mark.parametrize("dqk,heads", [(576, 128), (512, 64), (576, 64)])
def test_128k_keys(device, dqk, heads):
    """Tkv = 131,072, topk 2048 over the whole range (the builder pins rows Tkv - 1 and Tkv - 2 into every row)."""
    tkv, topk, n_tok = 131072, 2048, (64 if device == "cuda" else 6)
    x = _inputs(device, dqk, heads, tkv, topk, n_tok, sink=heads == 128, use_tl=True, seed=7)
    assert (x.flat_idx[x.valid] >= tkv - 64).any() and (x.flat_idx[x.valid] < 64).any()
    _verify(device, _fwd(x, x.q, x.kv, x.idx, x.tl, device), x)


# ------------------------------------------------------------------------------------------------ 4. CUDA graphs
GRAPH_CASES = [  # (op, dqk, heads, tkv, topk, n_tok, sink, topk_length, batch)
    ("sparse_mla_fwd", 576, 128, 1840, 256, 62, True, True, 1),
    ("sparse_mla_fwd", 512, 128, 1840, 256, 62, False, True, 1),
    ("sparse_mla_fwd", 512, 64, 592, 100, 213, True, True, 1),
    ("sparse_attn", 512, 64, 1840, 256, 62, True, False, 2),  # DeepSeek-V4 form: batched, no topk_length
    ("sparse_attn", 512, 64, 1840, 1024, 62, True, False, 2),  # 16 blocks: one CTA per item, Q by TMA
    # 132 SMs + 4 items: the last round as split-KV chunks (sparse/_tail_split.py; sparse_attn: the batched build)
    ("sparse_mla_fwd", 512, 64, 1840, 640, 136, True, True, 1),
    ("sparse_attn", 512, 64, 1840, 640, 136, True, False, 2),
]


def _graph_call(op, x, batch, device):
    if op == "sparse_mla_fwd":
        return _fwd(x, x.q, x.kv, x.idx, x.tl, device)
    n_tok, heads, d = x.q.shape
    out = flashdsa.sparse_attn(x.q.view(batch, n_tok // batch, heads, d), x.kv.view(batch, -1, d), x.sink,
                               x.idx.view(batch, n_tok // batch, -1), backend=_backend(device))
    return out.flatten(0, 1), None, None


@on_devices
@pytest.mark.parametrize("case", GRAPH_CASES, ids=[f"{c[0]}-d{c[1]}-h{c[2]}-kv{c[3]}-k{c[4]}-t{c[5]}"
                                                    for c in GRAPH_CASES])
def test_cuda_graph_replay_new_indices(device, case, monkeypatch):
    """Captured once; new q / kv / indices / topk_length written into the captured buffers; the replay gives the
    reference's result on the new inputs and equals an eager call (cpu: the same inputs, no capture).  The last
    round split on (``$FLASHDSA_PAIR_TAIL``; the t136 cases split it)."""
    monkeypatch.setenv("FLASHDSA_PAIR_TAIL", "1")
    op, dqk, heads, tkv, topk, n_tok, sink, use_tl, batch = case
    if device == "cuda" and n_tok == 136 and _dispatch.sm_count(0) == 132:
        from flashdsa.sparse import _tail_split

        assert _tail_split.tail_plan(n_tok, heads, topk, 132) is not None  # these cases split on 132 SMs
    kw = dict(sink=sink, use_tl=use_tl, batch=batch)
    x = _inputs(device, dqk, heads, tkv, topk, n_tok, seed=1, **kw)
    eager = _graph_call(op, x, batch, device)  # compiles (and stores the eager plan) outside the capture
    _verify(device, eager, x)
    if device == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _graph_call(op, x, batch, device)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = _graph_call(op, x, batch, device)
        graph.replay()
        torch.cuda.synchronize()
        assert all(a is None or torch.equal(a, b) for a, b in zip(eager, graphed))
    for seed in ((2, 3) if device == "cuda" else (2,)):  # cpu: one round (no replay to repeat)
        new = _inputs(device, dqk, heads, tkv, topk, n_tok, seed=seed, **kw)
        assert not torch.equal(new.valid, x.valid)
        for name in ("q", "kv", "idx", "tl", "sink"):
            if getattr(x, name) is not None:
                getattr(x, name).copy_(getattr(new, name))
        if device == "cuda":
            for t in graphed:
                if t is not None:
                    t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            got = graphed
        else:
            got = _graph_call(op, x, batch, device)
        _verify(device, got, new)
        eager = _graph_call(op, x, batch, device)
        assert all(a is None or torch.equal(a, b) for a, b in zip(eager, got))


# ------------------------------------------------------------------------------------------------ 5. FP8 compute
FP8_CASES = [  # (heads, tkv, topk, n_tok, sink, topk_length); Dqk 576
    (1, 128, 128, 1, True, True),
    (1, 1840, 256, 213, False, False),
    (64, 128, 128, 1, False, False),
    (64, 128, 128, 62, True, False),
    (128, 1840, 256, 1, False, True),
    (128, 128, 128, 213, False, False),
    (16, 1840, 256, 1, True, True),
    (1, 1840, 256, 1, False, True),
]


@on_devices
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}"
                                                 f"{'-tl' if c[5] else ''}" for c in FP8_CASES])
def test_fp8_compute(device, case):
    """e4m3 q / kv with per-(token, head) and per-row scales (``quantize_fp8(x, block=576)``); kv rows nobody
    selects hold NaN bytes and a NaN scale.  Reference: the oracle on the dequantized tensors."""
    heads, tkv, topk, n_tok, sink, use_tl = case
    x = _inputs(device, 576, heads, tkv, topk, n_tok, sink=sink, use_tl=use_tl, seed=heads + n_tok)
    referenced = ~torch.isnan(x.kv).any(dim=1)
    kv = torch.where(referenced.unsqueeze(1), x.kv, torch.zeros((), dtype=x.kv.dtype, device=device))
    q8, q_scale = flashdsa.quantize_fp8(x.q, block=576)
    kv8, kv_scale = flashdsa.quantize_fp8(kv, block=576)
    q_scale, kv_scale = q_scale[..., 0].contiguous(), kv_scale[..., 0].contiguous()
    kv8.view(torch.uint8)[~referenced] = 0x7F
    kv_scale[~referenced] = float("nan")
    got = flashdsa.sparse_mla_fwd(q8, kv8, x.idx, q_scale=q_scale, kv_scale=kv_scale, attn_sink=x.sink,
                                  topk_length=x.tl, return_max_logits=True, backend=_backend(device))
    deq = dataclasses.replace(x, q=q8.float() * q_scale.unsqueeze(-1), kv=kv8.float() * kv_scale.unsqueeze(-1))
    _verify(device, got, deq, tol=FP8_TOL, fp8=(q8, q_scale, kv8, kv_scale))


# ------------------------------------------------------------------------------------------------ 6. 656-byte cache
CACHE_CASES = [  # (heads, tkv, topk, n_tok, sink, topk_length, kv row stride in bytes)
    (1, 128, 128, 1, True, True, 656),
    (64, 128, 128, 1, False, False, 672),
    (1, 592, 128, 1, False, False, 656),
    (64, 592, 128, 1, True, True, 656),
    (1, 592, 128, 213, False, True, 672),
    (64, 128, 128, 62, True, False, 704),
]


@on_devices
@pytest.mark.parametrize("case", CACHE_CASES, ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}"
                                                   f"{'-tl' if c[5] else ''}-rs{c[6]}" for c in CACHE_CASES])
def test_fp8_cache656(device, case):
    """kv as the uint8 [Tkv, 656] cache (row stride ``rs`` bytes, padding 0xFF); rows nobody selects hold 0xFF or
    0x7F bytes (NaN e4m3 / NaN or huge scale and rope).  Reference: the oracle on ``dequantize_kv_fp8`` (exact)."""
    heads, tkv, topk, n_tok, sink, use_tl, row_stride = case
    x = _inputs(device, 576, heads, tkv, topk, n_tok, sink=sink, use_tl=use_tl, seed=heads + tkv)
    unref = torch.isnan(x.kv).any(dim=1)
    packed = flashdsa.quantize_kv_fp8(torch.where(unref.unsqueeze(1), torch.zeros_like(x.kv), x.kv))
    g = torch.Generator(device=device).manual_seed(7)
    poison = torch.where(torch.rand(tkv, generator=g, device=device) < 0.5, 0xFF, 0x7F).to(torch.uint8)
    packed[unref] = poison[unref].unsqueeze(1).expand(-1, packed.shape[1])
    kv8 = torch.full((tkv, row_stride), 0xFF, dtype=torch.uint8, device=device)[:, :656].copy_(packed)
    assert kv8.stride(0) == row_stride
    got = flashdsa.sparse_mla_fwd(x.q, kv8, x.idx, attn_sink=x.sink, topk_length=x.tl, return_max_logits=True,
                                  backend=_backend(device))
    _verify(device, got, dataclasses.replace(x, kv=flashdsa.dequantize_kv_fp8(kv8)))
