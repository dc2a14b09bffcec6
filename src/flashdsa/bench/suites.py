"""Benchmark case lists, one suite per op family, each case a workload from its issue's "Speed" table.

Suites: ``indexer`` (issue 4), ``topk`` (issue 5), ``sparse_mla_fwd`` (issue 8), ``sparse_mla_bwd`` (issue 3),
``sparse_mla_fwd_fp8`` (issue 7), ``decode`` (issue 6). Case names identify the workload (same name on every
device). On a CUDA device the shapes are the issue's; elsewhere (CPU, reference only) they shrink (S, N, B, cache
and top-k scaled down, head counts and head dims kept) so the suite finishes in seconds, and the JSON ``note``
says so. ``quick`` on CUDA keeps the cases marked ``quick`` and fewer reps; on CPU it only lowers the reps.

Inputs are random (never zeros): bf16 ``randn``, FP8 from :func:`flashdsa.quantize_fp8` /
:func:`flashdsa.quantize_kv_fp8`, sparse indices unique random in ``[0, S_kv)`` sorted ascending per row (what
``topk_indices(order="index")`` produces), paged caches behind shuffled block tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import flops as F

SUITES = ("indexer", "topk", "sparse_mla_fwd", "sparse_mla_bwd", "sparse_mla_fwd_fp8", "decode")


@dataclass
class Case:
    """One benchmark workload.

    ``build(device, gen) -> inputs`` (a dict of tensors, called once per rotated input set); ``run(inputs,
    backend)`` the timed call; ``reference(inputs)`` the ``backend="reference"`` result for ``--check``;
    ``counts(inputs) -> {"flops", "bytes"}`` from :mod:`flashdsa.bench.flops`; ``requires`` the public names used.
    """

    name: str
    params: dict
    build: Callable[[torch.device, torch.Generator], dict]
    run: Callable[[dict, str], Any]
    counts: Callable[[dict], dict]
    dispatch_op: str
    requires: tuple = ()
    target: str = ""
    tol: float = 1e-2
    reference: Optional[Callable[[dict], Any]] = None
    baseline: Optional[Callable[[dict], Any]] = None
    baseline_name: str = ""
    quick: bool = True
    measure_memory: bool = False
    reps: int = 30
    reps_quick: int = 5
    min_reps: int = 3
    max_seconds: float = 10.0
    seed: int = 0

    def __post_init__(self):
        if self.reference is None:
            self.reference = lambda i: self.run(i, "reference")


def _api():
    import flashdsa

    return flashdsa


# ------------------------------------------------------------------------------------------------ inputs
def randn(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal tensor (``* scale``) of ``dtype`` on ``device``."""
    x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return (x * scale).to(dtype) if scale != 1.0 else x.to(dtype)


def unique_indices(rows: int, n: int, k: int, device, gen, sort: bool = True) -> torch.Tensor:
    """`[rows, k]` int32: per row ``k`` distinct random positions in ``[0, n)`` (k <= n), ascending if ``sort``."""
    assert k <= n, (k, n)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    step = max(1, (1 << 25) // n)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        r = torch.rand(b - a, n, generator=gen, device=device)
        sel = r.topk(k, dim=-1).indices
        out[a:b] = (sel.sort(dim=-1).values if sort else sel).int()
    return out


def paged_layout(lens: torch.Tensor | list[int], block_size: int, device, gen):
    """Shuffled block table for per-request lengths ``lens`` `[B]`: (block_table `[B, max_blocks]` int32,
    number of physical blocks). Padding entries point at block 0 and are never read. Lengths known on the host
    come as a list: the layout then reads no device value (``scripts/precompile.py``'s fake tensors read 1)."""
    nblk = [max(1, math.ceil(int(x) / block_size)) for x in (lens.tolist() if torch.is_tensor(lens) else lens)]
    total, mb = sum(nblk), max(nblk)
    perm = torch.randperm(total, generator=gen, device=device).int()
    table = torch.zeros(len(nblk), mb, dtype=torch.int32, device=device)
    off = 0
    for b, c in enumerate(nblk):
        table[b, :c] = perm[off:off + c]
        off += c
    return table, total


def positions_to_slots(pos: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token positions `[B, s_q, k]` (-1 kept) -> cache slots ``block_table[b, p // P] * P + p % P``."""
    B = pos.shape[0]
    p = pos.clamp_min(0).long()
    blk = torch.gather(block_table.long(), 1, (p // block_size).reshape(B, -1)).reshape(p.shape)
    return torch.where(pos >= 0, blk * block_size + p % block_size, -1).int()


def fp8_kv_cache(rows: int, device, gen) -> torch.Tensor:
    """`[rows, 656]` uint8 FP8 cache of random bf16 KV rows (quantized in chunks to bound temporaries)."""
    from ..quant import quantize_kv_fp8

    out = torch.empty(rows, F.KV_FP8_ROW_BYTES, dtype=torch.uint8, device=device)
    step = 1 << 18
    for a in range(0, rows, step):
        b = min(rows, a + step)
        out[a:b] = quantize_kv_fp8(randn((b - a, 576), torch.bfloat16, device, gen))
    return out


# ------------------------------------------------------------------------------------------------ indexer
def _causal_fp8_indexer_inputs(M, N, H, D, device, gen) -> dict:
    """fp8 q/k with per-row scales, head weights, causal ranges ending at m + N - M + 1."""
    q8, qs = _api().quantize_fp8(randn((M, H, D), torch.bfloat16, device, gen), block=D)
    k8, ks = _api().quantize_fp8(randn((N, D), torch.bfloat16, device, gen), block=D)
    w = randn((M, H), torch.float32, device, gen) * qs[..., 0] * (H * D) ** -0.5
    k_end = (torch.arange(M, device=device) + (N - M) + 1).int()
    return dict(q=q8, k=k8, weights=w, k_scale=ks[:, 0].contiguous(), k_start=torch.zeros_like(k_end), k_end=k_end)


def _indexer_prefill(name, M, N, H, D, target, quick=True) -> Case:
    p = dict(M=M, N=N, H=H, D=D, dtype="float8_e4m3fn", ranges="causal: k_end = m + N - M + 1")

    def build(device, gen):
        return _causal_fp8_indexer_inputs(M, N, H, D, device, gen)

    def run(i, b):
        return _api().indexer_logits(i["q"], i["k"], i["weights"], k_scale=i["k_scale"], k_start=i["k_start"],
                                     k_end=i["k_end"], backend=b)

    def counts(i):
        return {"flops": F.indexer_flops(H, D, i["k_start"], i["k_end"], M, N), "bytes": None}

    return Case(name, p, build, run, counts, "indexer_logits", ("indexer_logits",), target, tol=1e-3, quick=quick)


def _indexer_paged(name, B, next_n, ctx, H, D, bs, target, quick=True) -> Case:
    p = dict(B=B, next_n=next_n, context=ctx, H=H, D=D, block_size=bs, dtype="float8_e4m3fn")

    def build(device, gen):
        lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        table, nblocks = paged_layout([ctx] * B, bs, device, gen)
        k8, ks = _api().quantize_fp8(randn((nblocks * bs, D), torch.bfloat16, device, gen), block=D)
        q8, qs = _api().quantize_fp8(randn((B, next_n, H, D), torch.bfloat16, device, gen), block=D)
        w = randn((B * next_n, H), torch.float32, device, gen) * qs[..., 0].reshape(B * next_n, H) * (H * D) ** -0.5
        return dict(q=q8, k_cache=k8.view(nblocks, bs, D), k_scale_cache=ks.view(nblocks, bs), weights=w,
                    context_lens=lens, block_table=table)

    def run(i, b):
        return _api().indexer_logits_paged(i["q"], i["k_cache"], i["weights"], i["context_lens"], i["block_table"],
                                           k_scale_cache=i["k_scale_cache"], max_context=ctx, backend=b)

    def counts(i):
        return {"flops": F.indexer_paged_flops(H, D, i["context_lens"], next_n),
                "bytes": F.indexer_paged_bytes(i["context_lens"], D)}

    return Case(name, p, build, run, counts, "indexer_logits_paged", ("indexer_logits_paged",), target, tol=1e-3,
                quick=quick)


def indexer_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    return [
        _indexer_prefill("prefill_causal_M4096_N8192_H64_D128_fp8", s(4096, 256), s(8192, 512), 64, 128,
                         ">= 750 TFLOP/s"),
        _indexer_prefill("prefill_causal_M4096_N32768_H64_D128_fp8", s(4096, 256), s(32768, 2048), 64, 128,
                         ">= 750 TFLOP/s", quick=False),
        _indexer_prefill("prefill_causal_M4096_N8192_H32_D64_fp8", s(4096, 256), s(8192, 512), 32, 64,
                         ">= 450 TFLOP/s", quick=False),
        _indexer_paged("paged_decode_B128_nextn1_ctx32768_H64_D128_blk64", s(128, 4), 1, s(32768, 1024), 64, 128,
                       64, ">= 3.4 TB/s (keys x 132)"),
        _indexer_paged("paged_decode_B128_nextn2_ctx32768_H64_D128_blk64", s(128, 4), 2, s(32768, 1024), 64, 128,
                       64, ">= 3.2 TB/s (keys x 132)", quick=False),
    ]


# ------------------------------------------------------------------------------------------------ top-k
def _topk(name, M, N, k, target, quick=True) -> Case:
    p = dict(M=M, N=N, k=k, order="index", dtype="float32")

    def build(device, gen):
        return dict(scores=randn((M, N), torch.float32, device, gen))

    def run(i, b):
        return _api().topk_indices(i["scores"], k, order="index", backend=b)

    def counts(i):
        return {"flops": None, "bytes": F.topk_bytes(M, N)}

    return Case(name, p, build, run, counts, "topk_indices", ("topk_indices",), target, tol=1e-3, quick=quick,
                baseline=lambda i: torch.topk(i["scores"], k, dim=-1), baseline_name="torch.topk")


def _dsa_topk(name, M, N, H, D, k, target, quick=False) -> Case:
    p = dict(M=M, N=N, H=H, D=D, k=k, dtype="float8_e4m3fn", ranges="causal: k_end = m + N - M + 1")

    def build(device, gen):
        return _causal_fp8_indexer_inputs(M, N, H, D, device, gen)

    def run(i, b):
        return _api().dsa_topk(i["q"], i["k"], i["weights"], k, k_scale=i["k_scale"], k_start=i["k_start"],
                               k_end=i["k_end"], backend=b)

    def counts(i):
        return {"flops": F.indexer_flops(H, D, i["k_start"], i["k_end"], M, N), "bytes": None}

    return Case(name, p, build, run, counts, "topk_indices", ("dsa_topk",), target, tol=1e-3, quick=quick,
                measure_memory=True, reps=3, reps_quick=1, min_reps=1, max_seconds=60.0)


def topk_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    k = s(2048, 256)
    t = ", >= 2x torch.topk"
    return [
        _topk("rows64_N32768_k2048", s(64, 8), s(32768, 4096), k, "<= 40 us" + t),
        _topk("rows4096_N8192_k2048", s(4096, 64), s(8192, 1024), k, "<= 150 us" + t),
        _topk("rows16_N131072_k2048", s(16, 4), s(131072, 16384), k, "<= 50 us" + t),
        _topk("rows1_N1048576_k2048", 1, s(1048576, 131072), k, "<= 60 us" + t),
        _dsa_topk("dsa_topk_causal_131072x131072_H64_D128_k2048", s(131072, 1024), s(131072, 1024), 64, 128, k,
                  "report; < 8 GiB temporaries"),
    ]


# ------------------------------------------------------------------------------------------------ sparse MLA
def _mla_inputs(S, SKV, H, topk, device, gen, dqk=576, batch=None):
    lead = (S,) if batch is None else (batch, S)
    kv_lead = (SKV,) if batch is None else (batch, SKV)
    q = randn((*lead, H, dqk), torch.bfloat16, device, gen)
    kv = randn((*kv_lead, dqk), torch.bfloat16, device, gen)
    rows = S if batch is None else batch * S
    idx = unique_indices(rows, SKV, topk, device, gen).reshape(*lead, topk)
    return q, kv, idx


def _sparse_counts(H, dqk, d_v, SKV, row_bytes=None, batch=1, bwd=False, q_bytes=2):
    def counts(i):
        idx = i["indices"]
        nv = F.valid_count(idx, SKV)
        if bwd:
            return {"flops": F.sparse_bwd_flops(H, nv, dqk, d_v), "bytes": None}
        S = idx.numel() // idx.shape[-1]
        flat = idx.reshape(batch, -1).long() + torch.arange(batch, device=idx.device).unsqueeze(1) * SKV
        touched = int(torch.unique(flat).numel())
        return {"flops": F.sparse_fwd_flops(H, nv, dqk, d_v),
                "bytes": F.sparse_fwd_bytes(S, H, dqk, d_v, idx.shape[-1], touched, row_bytes or 2 * dqk, q_bytes)}

    return counts


def _mla_fwd(name, S, SKV, H, topk, target, quick=True, **kw) -> Case:
    p = dict(B=1, S=S, SKV=SKV, H=H, Dqk=576, d_v=512, topk=topk, indices="unique random, sorted")

    def build(device, gen):
        q, kv, idx = _mla_inputs(S, SKV, H, topk, device, gen)
        return dict(q=q, kv=kv, indices=idx)

    def run(i, b):
        return _api().sparse_mla_fwd(i["q"], i["kv"], i["indices"], backend=b)

    return Case(name, p, build, run, _sparse_counts(H, 576, 512, SKV), "sparse_mla_fwd", ("sparse_mla_fwd",),
                target, quick=quick, **kw)


def _v4_fwd(name, b_, m, n, h, topk, target, quick=True) -> Case:
    p = dict(b=b_, m=m, n=n, h=h, d=512, topk=topk, sink=True, indices="unique random, sorted")

    def build(device, gen):
        q, kv, idx = _mla_inputs(m, n, h, topk, device, gen, dqk=512, batch=b_)
        return dict(q=q, kv=kv, indices=idx, sink=randn((h,), torch.float32, device, gen))

    def run(i, b):
        return _api().sparse_attn(i["q"], i["kv"], i["sink"], i["indices"], backend=b)

    return Case(name, p, build, run, _sparse_counts(h, 512, 512, n, batch=b_), "sparse_mla_fwd",
                ("sparse_attn",), target, quick=quick)


def sparse_mla_fwd_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    S, SKV, K = s(4096, 64), s(8192, 1024), s(2048, 128)
    return [
        _mla_fwd("V32_S4096_SKV8192_H128_topk2048", S, SKV, 128, K, ">= 700 TFLOP/s"),
        _mla_fwd("V32_S4096_SKV8192_H64_topk2048", S, SKV, 64, K, ">= 690 TFLOP/s"),
        _mla_fwd("V32_S4096_SKV8192_H16_topk2048", S, SKV, 16, K, ">= 250 TFLOP/s"),
        _mla_fwd("V32_S4096_SKV131072_H128_topk2048", S, s(131072, 4096), 128, K, ">= 620 TFLOP/s", quick=False),
        _v4_fwd("V4_sparse_attn_b1_m4096_n8192_h64_d512_topk640_sink", 1, S, SKV, 64, s(640, 64), ">= 600 TFLOP/s"),
        _v4_fwd("V4_sparse_attn_decode_b128_m1_n8192_h64_d512_topk640_sink", s(128, 8), 1, SKV, 64, s(640, 64),
                "<= 40 us"),
    ]


def _grad_run(forward: Callable[[dict, str], torch.Tensor], leaves: tuple):
    """Timed region = the backward only: the forward runs once per (input set, backend) and its graph is kept."""

    def run(i, b):
        key = ("graph", b)
        if key not in i:
            i[key] = forward(i, b)
        return torch.autograd.grad(i[key], [i[n] for n in leaves], i["dout"], retain_graph=True)

    return run


def _mla_bwd(name, S, SKV, H, topk, target, deterministic=False, quick=True) -> Case:
    p = dict(B=1, S=S, SKV=SKV, H=H, Dqk=576, d_v=512, topk=topk, deterministic=deterministic)

    def build(device, gen):
        q, kv, idx = _mla_inputs(S, SKV, H, topk, device, gen)
        return dict(q=q.requires_grad_(), kv=kv.requires_grad_(), indices=idx,
                    dout=randn((S, H, 512), torch.bfloat16, device, gen))

    def fwd(i, b):
        return _api().sparse_mla(i["q"], i["kv"], i["indices"], deterministic=deterministic, backend=b)

    return Case(name, p, build, _grad_run(fwd, ("q", "kv")), _sparse_counts(H, 576, 512, SKV, bwd=True),
                "sparse_mla_bwd", ("sparse_mla",), target, tol=2e-2, quick=quick, reps=20)


def _v4_bwd(name, b_, m, n, h, topk, target, quick=True) -> Case:
    p = dict(b=b_, m=m, n=n, h=h, d=512, topk=topk, sink=True)

    def build(device, gen):
        q, kv, idx = _mla_inputs(m, n, h, topk, device, gen, dqk=512, batch=b_)
        return dict(q=q.requires_grad_(), kv=kv.requires_grad_(), indices=idx,
                    sink=randn((h,), torch.float32, device, gen).requires_grad_(),
                    dout=randn((b_, m, h, 512), torch.bfloat16, device, gen))

    def fwd(i, b):
        return _api().sparse_attn(i["q"], i["kv"], i["sink"], i["indices"], backend=b)

    return Case(name, p, build, _grad_run(fwd, ("q", "kv", "sink")), _sparse_counts(h, 512, 512, n, bwd=True),
                "sparse_mla_bwd", ("sparse_attn",), target, tol=2e-2, quick=quick, reps=20)


def sparse_mla_bwd_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    S, SKV, K = s(4096, 32), s(8192, 512), s(2048, 64)
    return [
        _mla_bwd("V32_bwd_S4096_SKV8192_H64_topk2048", S, SKV, 64, K, ">= 300 TFLOP/s"),
        _mla_bwd("V32_bwd_S4096_SKV8192_H128_topk2048", S, SKV, 128, K, ">= 300 TFLOP/s"),
        _mla_bwd("V32_bwd_S4096_SKV8192_H128_topk2048_deterministic", S, SKV, 128, K, ">= 0.5x the fast path",
                 deterministic=True, quick=False),
        _v4_bwd("V4_sparse_attn_bwd_b1_m4096_n8192_h64_d512_topk640_sink", 1, S, SKV, 64, s(640, 64),
                ">= 250 TFLOP/s"),
    ]


# ------------------------------------------------------------------------------------------------ FP8 prefill
def _fp8_fwd(name, S, SKV, H, topk, mode, target, quick=True) -> Case:
    """mode: "bf16" (the comparison point), "fp8_compute" (e4m3 q/kv + scales), "cache656" (uint8 FP8 cache)."""
    p = dict(B=1, S=S, SKV=SKV, H=H, Dqk=576, d_v=512, topk=topk, mode=mode)
    api = _api

    def build(device, gen):
        q, kv, idx = _mla_inputs(S, SKV, H, topk, device, gen)
        i = dict(q=q, indices=idx)
        if mode == "bf16":
            i["kv"] = kv
        elif mode == "cache656":
            i["kv"] = api().quantize_kv_fp8(kv)
        else:
            q8, qs = api().quantize_fp8(q, block=576)
            k8, ks = api().quantize_fp8(kv, block=576)
            i.update(q=q8, q_scale=qs[..., 0].contiguous(), kv=k8, kv_scale=ks[..., 0].contiguous())
        return i

    def run(i, b):
        if mode == "fp8_compute":
            return api().sparse_mla_fwd(i["q"], i["kv"], i["indices"], q_scale=i["q_scale"], kv_scale=i["kv_scale"],
                                        backend=b)
        return api().sparse_mla_fwd(i["q"], i["kv"], i["indices"], backend=b)

    def reference(i):  # on dequantized inputs, so quantization error is excluded
        q, kv = i["q"], i["kv"]
        if mode == "cache656":
            kv = api().dequantize_kv_fp8(kv)
        elif mode == "fp8_compute":
            q = (q.float() * i["q_scale"].unsqueeze(-1)).bfloat16()
            kv = (kv.float() * i["kv_scale"].unsqueeze(-1)).bfloat16()
        return api().sparse_mla_fwd(q, kv, i["indices"], backend="reference")

    row_bytes = {"bf16": F.KV_BF16_ROW_BYTES, "cache656": F.KV_FP8_ROW_BYTES, "fp8_compute": 576 + 4}[mode]
    counts = _sparse_counts(H, 576, 512, SKV, row_bytes=row_bytes, q_bytes=1 if mode == "fp8_compute" else 2)
    return Case(name, p, build, run, counts, "sparse_mla_fwd", ("sparse_mla_fwd",), target,
                tol=2e-2 if mode == "fp8_compute" else 1e-2, reference=reference, quick=quick)


def sparse_mla_fwd_fp8_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    S, SKV, SKV_L, K = s(4096, 64), s(8192, 1024), s(131072, 4096), s(2048, 128)
    return [
        _fp8_fwd("bf16_S4096_SKV8192_H128_topk2048", S, SKV, 128, K, "bf16", "comparison point"),
        _fp8_fwd("fp8_compute_S4096_SKV8192_H128_topk2048", S, SKV, 128, K, "fp8_compute",
                 "faster than bf16 (or within 5%, with measurements)"),
        _fp8_fwd("cache656_S4096_SKV8192_H128_topk2048", S, SKV, 128, K, "cache656", ">= 0.9x bf16"),
        _fp8_fwd("bf16_S4096_SKV131072_H128_topk2048", S, SKV_L, 128, K, "bf16", "comparison point", quick=False),
        _fp8_fwd("cache656_S4096_SKV131072_H128_topk2048", S, SKV_L, 128, K, "cache656", ">= 0.9x bf16 at SKV=131072",
                 quick=False),
    ]


# ------------------------------------------------------------------------------------------------ decode
def _decode(name, B, H, s_q, cache, target, *, sparse=False, fp8=False, topk=0, causal=True, mixed=False,
            bs=64, quick=True) -> Case:
    p = dict(B=B, H=H, s_q=s_q, cache=f"1..{cache}" if mixed else cache, block_size=bs,
             kind=("sparse" if sparse else "dense") + ("_fp8" if fp8 else "_bf16"), Dqk=576, d_v=512)
    if sparse:
        p["topk"] = topk
    else:
        p["causal"] = causal

    def build(device, gen):
        if mixed:
            lens = torch.randint(1, cache + 1, (B,), generator=gen, device=device, dtype=torch.int32)
        else:
            lens = torch.full((B,), cache, dtype=torch.int32, device=device)
        table, nblocks = paged_layout(lens if mixed else [cache] * B, bs, device, gen)
        if fp8:
            kv_cache = fp8_kv_cache(nblocks * bs, device, gen).view(nblocks, bs, F.KV_FP8_ROW_BYTES)
        else:
            kv_cache = randn((nblocks, bs, 576), torch.bfloat16, device, gen)
        i = dict(q=randn((B, s_q, H, 576), torch.bfloat16, device, gen), kv_cache=kv_cache, block_table=table,
                 cache_seqlens=lens)
        if sparse:
            pos = unique_indices(B * s_q, cache, topk, device, gen).view(B, s_q, topk)  # uniform lens: all valid
            i["indices"] = positions_to_slots(pos, table, bs)
        return i

    def run(i, b):
        if sparse:
            return _api().mla_decode(i["q"], i["kv_cache"], None, None, indices=i["indices"], backend=b)
        return _api().mla_decode(i["q"], i["kv_cache"], i["block_table"], i["cache_seqlens"], causal=causal,
                                 backend=b)

    row_bytes = F.KV_FP8_ROW_BYTES if fp8 else F.KV_BF16_ROW_BYTES

    def counts(i):
        if sparse:
            idx = i["indices"]
            attended = F.valid_count(idx, i["kv_cache"].shape[0] * bs)
            rows = int(torch.unique(idx[idx >= 0]).numel())
        else:
            attended = F.causal_decode_keys(i["cache_seqlens"], s_q, causal)
            rows = int(i["cache_seqlens"].long().sum())
        return {"flops": F.decode_flops(H, attended), "bytes": F.decode_bytes(rows, row_bytes, B, s_q, H)}

    return Case(name, p, build, run, counts, "mla_decode", ("mla_decode",), target, quick=quick)


def decode_cases(full: bool) -> list[Case]:
    s = (lambda a, b: a) if full else (lambda a, b: b)
    K = s(2048, 128)
    return [
        _decode("dense_bf16_B64_H16_sq1_cache8192", s(64, 2), 16, 1, s(8192, 512), ">= 3.8 TB/s"),
        _decode("dense_bf16_B128_H128_sq1_cache8192", s(128, 4), 128, 1, s(8192, 512), ">= 690 TFLOP/s"),
        _decode("dense_bf16_B128_H128_sq2_cache32768_causal", s(128, 4), 128, 2, s(32768, 1024), ">= 780 TFLOP/s",
                quick=False),
        _decode("sparse_fp8_B128_H128_sq2_topk2048_cache32768", s(128, 4), 128, 2, s(32768, 1024), ">= 440 TFLOP/s",
                sparse=True, fp8=True, topk=K),
        _decode("sparse_fp8_B128_H64_sq1_topk2048_cache32768", s(128, 4), 64, 1, s(32768, 1024), ">= 340 TFLOP/s",
                sparse=True, fp8=True, topk=K, quick=False),
        _decode("sparse_fp8_B128_H16_sq1_topk2048_cache32768", s(128, 4), 16, 1, s(32768, 1024),
                ">= 3.0 TB/s of cache bytes touched", sparse=True, fp8=True, topk=K, quick=False),
        _decode("mixed_dense_bf16_B128_H128_sq1_cache1-65536", s(128, 4), 128, 1, s(65536, 2048),
                ">= 85% of the uniform-length TFLOP/s", mixed=True, quick=False),
    ] + [  # few query tokens: split-KV over the sparse forward (decode.kernel_split); latency, no issue target
        _decode(f"{kind}_{'fp8' if fp8 else 'bf16'}_B{B}_H{H}_sq1" + (f"_topk{K}" if kind == "sparse" else "")
                + f"_cache{cache}", B, H, 1, cache, "none (small batch, split-KV)", sparse=kind == "sparse", fp8=fp8,
                topk=K, quick=False)
        for kind, fp8, B, H, cache in (("sparse", True, 1, 128, 32768), ("sparse", True, 8, 64, 32768),
                                       ("sparse", True, 4, 16, 32768), ("dense", True, 1, 128, 32768),
                                       ("dense", True, 2, 16, 65536), ("sparse", True, 4, 32, 32768),
                                       ("sparse", False, 1, 128, 32768), ("sparse", False, 4, 16, 32768),
                                       ("sparse", False, 32, 16, 32768)) if full
    ]


_BUILDERS = {
    "indexer": indexer_cases, "topk": topk_cases, "sparse_mla_fwd": sparse_mla_fwd_cases,
    "sparse_mla_bwd": sparse_mla_bwd_cases, "sparse_mla_fwd_fp8": sparse_mla_fwd_fp8_cases, "decode": decode_cases,
}


def get_cases(suite: str, device: torch.device, quick: bool = False) -> tuple[list[Case], str]:
    """(cases, note) of ``suite`` for ``device``. Full issue shapes on CUDA; shrunk shapes elsewhere."""
    if suite not in _BUILDERS:
        raise ValueError(f"suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    full = device.type == "cuda"
    cases = _BUILDERS[suite](full)
    notes = []
    if full and quick:
        cases = [c for c in cases if c.quick]
        notes.append("quick: reduced case list and reps")
    elif quick:
        notes.append("quick: fewer reps")
    if not full:
        notes.append(f"{device.type}: shapes shrunk from the issue workloads (S/N/B/cache/top-k scaled down, heads "
                     "and head dims kept; see each case's params); case names keep the full workload; "
                     "not performance figures")
    return cases, "; ".join(notes)
