"""Property-based fuzzing of every public op's argument contract (CPU, tiny shapes).

Each case starts from a small valid call (``backend="reference"`` or ``"auto"``) and applies one mutation drawn by
hypothesis. The contract (README API table, docs/conventions.md, tests/test_validation.py for the hand-picked cases):

* bad input raises ``ValueError`` or ``TypeError`` whose message starts with ``<argument>:`` -- never another
  exception type, never a silently accepted input;
* tensor *values* are never checked: out-of-range indices / lengths / block ids, NaN data, strides outside the last
  dim are legal, must run, give the documented output shape, and the same result on both backends.

Every mutation is classed as MUST_RAISE (clearly outside the contract), MUST_PASS (clearly inside) or MAY (e.g. a
size change that another argument may or may not tie down): then a success must have the documented shape.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flashdsa

I32, I64, F32, F64 = torch.int32, torch.int64, torch.float32, torch.float64
BF16, F16, FP8, U8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8
ALL_DTYPES = (F32, F64, BF16, F16, FP8, I32, I64, torch.int16, torch.int8, U8, torch.bool)
FLOATS3 = (BF16, F16, F32)
INT_MIN, INT_MAX = -2**31, 2**31 - 1

MUST_RAISE, MUST_PASS, MAY = "must_raise", "must_pass", "may"

# derandomized: the same examples every run (a CI failure reproduces); HYPOTHESIS_PROFILE=dev raises the count
FUZZ = settings(max_examples=max(80, settings().max_examples), deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------------------------- specs
@dataclass
class Tn:
    """A tensor argument as the rest of the base call constrains it."""

    dtypes: tuple  # dtypes valid given the other arguments of the base call
    ndims: Optional[tuple]  # valid ranks (None: any rank >= 1)
    free: tuple = ()  # dims whose size may change on their own (nothing else ties them)
    optional: bool = False
    contig: bool = True  # last dim must have stride 1
    whole_contig: bool = False  # must be contiguous (written in place)
    values: tuple = ()  # int fill values that are legal (skipped / clamped, never checked)
    nan: bool = False  # NaN / inf data is legal


@dataclass
class Sc:
    """A scalar argument: ``valid(v, args)`` says whether v is inside the contract (then MAY, else MUST_RAISE)."""

    valid: Callable
    extra: tuple = ()


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def posint(minimum=1):
    return Sc(lambda v, a: _is_int(v) and v >= minimum, (minimum, minimum + 1, 64))


def opt_posint(minimum=0):
    return Sc(lambda v, a: v is None or (_is_int(v) and v >= minimum), (minimum, 5, 20))


def scale():
    def ok(v, a):
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    return Sc(ok, (0.5, 2, 1e-3, -0.0))


def boolean():
    return Sc(lambda v, a: isinstance(v, bool), (0, 1))


def d_v(dqk_of, cap=None):
    def ok(v, a):
        dqk = dqk_of(a)
        return _is_int(v) and 0 < v <= (dqk if cap is None else min(cap, dqk))
    return Sc(ok, (512, 576, 513, 64, 1024))


def choice(*vals):
    return Sc(lambda v, a: isinstance(v, str) and v in vals, vals + ("ascending", "INDEX"))


BACKEND = Sc(lambda v, a: v in ("auto", "reference"), ("cuda", "REFERENCE", ""))
SCALAR_POOL = (-1, 0, 1, 3, 1.5, -2.0, float("nan"), float("inf"), -float("inf"), True, False, None, "3", [1])


@dataclass
class Variant:
    name: str
    fn: Callable
    build: Callable[[], dict]
    specs: dict
    shapes: Callable  # args -> list of expected output shapes (None: skip that output)
    backend: bool = True
    call: Optional[Callable] = None  # args -> result (default fn(**args))
    names: set = field(default_factory=set)

    def __post_init__(self):
        if not self.names:
            self.names = set(inspect.signature(self.fn).parameters) | {"FLASHDSA_BACKEND"}

    def run(self, args):
        return self.call(args) if self.call is not None else self.fn(**args)


def _g():
    return torch.Generator().manual_seed(0)


def rn(*shape, dtype=F32):
    x = torch.randn(*shape, generator=_g())
    return x.to(dtype)


def ii(*vals):
    return torch.tensor(vals, dtype=I32)


# --------------------------------------------------------------------------------------------- variants
M, H, D, N = 3, 2, 32, 7
B, NN, NB, BS = 2, 2, 4, 8
T, TKV, TOPK = 3, 9, 4
RANGE_VALUES = (-1, 0, N, N + 5, INT_MIN, INT_MAX)
LEN_VALUES = (-1, -5, 0, 3, 100, INT_MIN, INT_MAX)


def _idx_values(rows):
    return (-1, rows, rows + 1, INT_MIN, INT_MAX, 0)


def _indexer(fp8):
    dt = FP8 if fp8 else BF16

    def build():
        a = dict(q=rn(M, H, D, dtype=dt), k=rn(N, D, dtype=dt), weights=torch.rand(M, H, generator=_g()),
                 k_start=ii(0, 1, 2), k_end=ii(N, 3, N))
        if fp8:
            a["k_scale"] = torch.rand(N, generator=_g()) + 0.5
        return a

    specs = dict(q=Tn((dt,), (3,), nan=True), k=Tn((dt,), (2,), free=() if fp8 else (0,), nan=True),
                 weights=Tn((F32, F64), (2,), nan=True),
                 k_start=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES),
                 k_end=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES))
    if fp8:
        specs["k_scale"] = Tn((F32, F64), (1,), contig=False, nan=True)
    return Variant("indexer_logits" + ("_fp8" if fp8 else ""), flashdsa.indexer_logits, build, specs,
                   lambda a: [(a["q"].shape[0], a["k"].shape[0])])


def _indexer_paged(fp8):
    dt = FP8 if fp8 else BF16

    def build():
        a = dict(q=rn(B, NN, H, D, dtype=dt), k_cache=rn(NB, BS, D, dtype=dt), weights=torch.rand(B * NN, H),
                 context_lens=ii(5, 9), block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), max_context=9)
        if fp8:
            a["k_scale_cache"] = torch.rand(NB, BS) + 0.5
        return a

    def shapes(a):
        mc = a["max_context"]
        if mc is None:
            mc = max(0, int(a["context_lens"].max())) if a["context_lens"].numel() else 0
        return [(a["q"].shape[0] * a["q"].shape[1], mc)]

    specs = dict(q=Tn((dt,), (4,), nan=True), k_cache=Tn((dt,), (3,), free=() if fp8 else (0, 1), nan=True),
                 weights=Tn((F32, F64), (2,), nan=True),
                 context_lens=Tn((I32,), (1,), contig=False, values=LEN_VALUES),
                 block_table=Tn((I32,), (2,), free=(1,), values=_idx_values(NB)),
                 max_context=opt_posint(0))
    if fp8:
        specs["k_scale_cache"] = Tn((F32, F64), (2,), nan=True)
    return Variant("indexer_logits_paged" + ("_fp8" if fp8 else ""), flashdsa.indexer_logits_paged, build, specs,
                   shapes)


def _topk():
    return Variant("topk_indices", flashdsa.topk_indices,
                   lambda: dict(scores=rn(M, N), k=3, starts=ii(0, 1, 2), ends=ii(N, 3, N), order="index"),
                   dict(scores=Tn((F32, F64), (2,), free=(1,), nan=True), k=posint(1),
                        starts=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES),
                        ends=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES),
                        order=choice("index", "score", "any")),
                   lambda a: [(a["scores"].shape[0], a["k"])])


def _dsa_topk(chunked):
    def build():
        a = dict(q=rn(M, H, D, dtype=BF16), k=rn(N, D, dtype=BF16), weights=torch.rand(M, H), topk=3,
                 k_start=ii(0, 1, 2), k_end=ii(N, 3, N))
        if chunked:
            a["max_chunk_bytes"] = 4 * N  # one query row per chunk
        return a

    return Variant("dsa_topk" + ("_chunked" if chunked else ""), flashdsa.dsa_topk, build,
                   dict(q=Tn((BF16,), (3,), nan=True), k=Tn((BF16,), (2,), free=(0,), nan=True),
                        weights=Tn((F32, F64), (2,), nan=True), topk=posint(1),
                        k_start=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES),
                        k_end=Tn((I32,), (1,), optional=True, contig=False, values=RANGE_VALUES),
                        max_chunk_bytes=posint(1)),
                   lambda a: [(a["q"].shape[0], a["topk"])])


def _sparse_shapes(a, dv_default=512):
    q = a["q"]
    dv = a.get("d_v", dv_default)
    lead, heads = tuple(q.shape[:-2]), q.shape[-2]
    out = [lead + (heads, dv), lead + (heads,)]
    return out + [lead + (heads,)] if a.get("return_max_logits") is True else out


def _sink_len(rows, topk=TOPK):
    return (-1, 0, topk, topk + 3, INT_MIN, INT_MAX)


def _sparse_fwd(form):
    """form: "bf16" (flat, Dqk 576), "batched" (Dqk 512), "cache656", "fp8" (e4m3 q/kv + scales)."""
    dqk = 512 if form in ("batched", "fp8") else 576

    def build():
        if form == "batched":
            a = dict(q=rn(B, T, H, dqk, dtype=BF16), kv=rn(B, TKV, dqk, dtype=BF16),
                     indices=torch.randint(-1, TKV, (B, T, TOPK), generator=_g(), dtype=I32),
                     topk_length=torch.full((B, T), TOPK, dtype=I32))
        else:
            qd = FP8 if form == "fp8" else BF16
            kv = rn(TKV, dqk, dtype=BF16)
            kv = flashdsa.quantize_kv_fp8(kv) if form == "cache656" else kv.to(qd)
            a = dict(q=rn(T, H, dqk, dtype=qd), kv=kv,
                     indices=torch.randint(-1, TKV, (T, TOPK), generator=_g(), dtype=I32),
                     topk_length=torch.full((T,), TOPK, dtype=I32))
            if form == "fp8":
                a.update(q_scale=torch.rand(T, H) + 0.5, kv_scale=torch.rand(TKV) + 0.5)
        a.update(attn_sink=torch.zeros(H), sm_scale=0.1, d_v=512 if form != "batched" else 256,
                 return_max_logits=True)
        return a

    batched = form == "batched"
    qd = {"bf16": BF16, "batched": BF16, "cache656": BF16, "fp8": FP8}[form]
    kvd = {"cache656": U8, "fp8": FP8}.get(form, BF16)
    specs = dict(
        q=Tn((qd,), (3, 4), nan=True),
        kv=Tn((kvd,), (3,) if batched else (2, 3), free=(1,) if batched else ((0,) if form != "fp8" else ()),
              nan=True),
        indices=Tn((I32,), (3,) if batched else (2, 3), free=(2,) if batched else (1,), values=_idx_values(TKV)),
        topk_length=Tn((I32,), (2,) if batched else (1,), optional=True, contig=False, values=_sink_len(T)),
        attn_sink=Tn((F32, F64), (1,), optional=True, nan=True),
        sm_scale=scale(), d_v=d_v(lambda a: dqk, 512 if form == "cache656" else None),
        return_max_logits=boolean())
    if form == "fp8":
        specs["q_scale"] = Tn((F32,), (2,), contig=False, nan=True)
        specs["kv_scale"] = Tn((F32,), (1,), contig=False, nan=True)
    return Variant("sparse_mla_fwd_" + form, flashdsa.sparse_mla_fwd, build, specs, _sparse_shapes)


def _sparse_mla():
    return Variant("sparse_mla", flashdsa.sparse_mla,
                   lambda: dict(q=rn(T, H, 512, dtype=BF16), kv=rn(TKV, 512, dtype=BF16),
                                indices=torch.randint(-1, TKV, (T, TOPK), generator=_g(), dtype=I32),
                                attn_sink=torch.zeros(H), topk_length=torch.full((T,), TOPK, dtype=I32),
                                sm_scale=None, d_v=512, deterministic=False),
                   dict(q=Tn((BF16,), (3, 4), nan=True), kv=Tn((BF16,), (2, 3), free=(0,), nan=True),
                        indices=Tn((I32,), (2, 3), free=(1,), values=_idx_values(TKV)),
                        attn_sink=Tn((F32, F64), (1,), optional=True, nan=True),
                        topk_length=Tn((I32,), (1,), optional=True, contig=False, values=_sink_len(T)),
                        sm_scale=scale(), d_v=d_v(lambda a: 512), deterministic=boolean()),
                   lambda a: _sparse_shapes(a)[:1])


def _sparse_attn():
    n = 10
    return Variant("sparse_attn", flashdsa.sparse_attn,
                   lambda: dict(q=rn(1, T, H, 64, dtype=BF16), kv=rn(1, n, 64, dtype=BF16), attn_sink=torch.zeros(H),
                                topk_idxs=torch.randint(-1, n, (1, T, TOPK), generator=_g(), dtype=I32),
                                softmax_scale=None),
                   dict(q=Tn((BF16,), (4,), nan=True), kv=Tn((BF16,), (3,), free=(1,), nan=True),
                        attn_sink=Tn((F32, F64), (1,), optional=True, nan=True),
                        topk_idxs=Tn((I32,), (3,), free=(2,), values=_idx_values(n)), softmax_scale=scale()),
                   lambda a: [tuple(a["q"].shape)])


def _decode_shapes(a, q="q"):
    b, s, h = a[q].shape[:3]
    dv = a.get("d_v", 512)
    return [(b, s, h, dv), (b, s, h)]


def _mla_decode(form):
    """form: "dense" (bf16 cache, s_q 2 causal), "sparse656" (sparse over the FP8 cache), "dense656"."""
    fp8 = form != "dense"
    sparse = form == "sparse656"
    s_q = 1 if form == "dense656" else 2

    def build():
        cache = rn(NB, BS, 576, dtype=BF16)
        a = dict(q=rn(B, s_q, H, 576, dtype=BF16), kv_cache=flashdsa.quantize_kv_fp8(cache) if fp8 else cache,
                 block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), cache_seqlens=ii(5, 16),
                 attn_sink=torch.zeros(H), sm_scale=None, d_v=512, causal=True)
        if sparse:
            a["indices"] = torch.randint(-1, NB * BS, (B, s_q, TOPK), generator=_g(), dtype=I32)
            a["topk_length"] = ii(TOPK, 2)
        return a

    qdt = (BF16, F16, F32, F64) if fp8 else (BF16,)
    specs = dict(q=Tn(qdt, (4,), free=() if sparse else (1,), nan=True),
                 kv_cache=Tn((U8 if fp8 else BF16,), (3, 4), free=(0, 1), nan=not fp8),
                 block_table=Tn((I32,), (2,), free=(1,), optional=sparse, values=_idx_values(NB)),
                 cache_seqlens=Tn((I32,), (1,), optional=sparse, contig=False, values=LEN_VALUES),
                 attn_sink=Tn((F32, F64), (1,), optional=True, nan=True),
                 sm_scale=scale(), d_v=d_v(lambda a: 576), causal=boolean())
    if sparse:
        specs["indices"] = Tn((I32,), (3,), free=(2,), values=_idx_values(NB * BS))
        specs["topk_length"] = Tn((I32,), (1,), optional=True, contig=False, values=_sink_len(B))
    return Variant("mla_decode_" + form, flashdsa.mla_decode, build, specs, _decode_shapes)


_PLAN_STAGE = ["plan"]
_PLAN_NAMES = set(inspect.signature(flashdsa.mla_decode_plan).parameters) | {"FLASHDSA_BACKEND"}
_RUN_NAMES = {"q", "kv_cache", "attn_sink"}


def _plan(fp8):
    def build():
        cache = rn(NB, BS, 576, dtype=BF16)
        cache = flashdsa.quantize_kv_fp8(cache) if fp8 else cache
        return dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), cache_seqlens=ii(5, 16), kv_cache=cache,
                    num_heads=H, s_q=2, q_dtype=BF16, sm_scale=None, d_v=512, causal=True, has_sink=True,
                    run_q=rn(B, 2, H, 576, dtype=BF16), run_kv_cache=cache.clone(), run_attn_sink=torch.zeros(H))

    def call(a):
        plan_args = {k: v for k, v in a.items() if not k.startswith("run_")}
        _PLAN_STAGE[0] = "plan"
        plan = flashdsa.mla_decode_plan(**plan_args)
        _PLAN_STAGE[0] = "run"
        return plan.run(a["run_q"], a["run_kv_cache"], a["run_attn_sink"])

    kvd = U8 if fp8 else BF16
    specs = dict(block_table=Tn((I32,), (2,), free=(1,), values=_idx_values(NB)),
                 cache_seqlens=Tn((I32,), (1,), contig=False, values=LEN_VALUES),
                 kv_cache=Tn((kvd,), (3, 4), free=(0, 1), nan=not fp8),  # run_kv_cache ties it: MAY
                 num_heads=posint(1), s_q=posint(1),
                 q_dtype=Sc(lambda v, a: v in (BF16, F16, F32, F64), (F32, I32, "bfloat16")),
                 sm_scale=scale(), d_v=d_v(lambda a: 576), causal=boolean(), has_sink=boolean(),
                 run_q=Tn((BF16,), (4,), nan=True),
                 run_kv_cache=Tn((kvd,), (3, 4), nan=not fp8),
                 run_attn_sink=Tn((F32, F64), (1,), nan=True))  # float64 too where plan.path is "op" (CPU)
    v = Variant("mla_decode_plan" + ("_fp8" if fp8 else ""), flashdsa.mla_decode_plan, build, specs,
                lambda a: _decode_shapes(a, "run_q"), call=call)
    v.names = None  # stage-dependent, see _names
    return v


def _write_kv(fp8):
    def build():
        cache = torch.zeros(NB, BS, 656, dtype=U8) if fp8 else torch.zeros(NB, BS, 576, dtype=BF16)
        return dict(kv=rn(T, 576, dtype=BF16), kv_cache=cache, slot_mapping=ii(0, 9, -1))

    slot_values = (-1, NB * BS, NB * BS + 1, INT_MIN, INT_MAX, 0)
    return Variant("write_kv_cache" + ("_fp8" if fp8 else ""), flashdsa.write_kv_cache, build,
                   dict(kv=Tn(FLOATS3 if fp8 else (BF16,), (2, 3), contig=False, nan=True),
                        kv_cache=Tn((U8 if fp8 else BF16,), (3, 4), free=(0, 1), whole_contig=True),
                        slot_mapping=Tn((I32, I64), (1,), contig=False, values=slot_values)),
                   lambda a: [tuple(a["kv_cache"].shape)], backend=False)


def _write_indexer():
    def build():
        return dict(k=rn(T, 128), k_cache=torch.zeros(NB, BS, 128, dtype=FP8), k_scale_cache=torch.zeros(NB, BS),
                    slot_mapping=torch.tensor([0, 9, -1]))

    return Variant("write_indexer_cache", flashdsa.write_indexer_cache, build,
                   dict(k=Tn(FLOATS3, (2,), nan=True), k_cache=Tn((FP8,), (3,), whole_contig=True),
                        k_scale_cache=Tn((F32,), (2,), whole_contig=True),
                        slot_mapping=Tn((I32, I64), (1,), contig=False, values=(-1, NB * BS, INT_MIN, INT_MAX))),
                   lambda a: [tuple(a["k_cache"].shape), tuple(a["k_scale_cache"].shape)], backend=False)


def _quant():
    def shapes(a):
        x = a["x"]
        return [tuple(x.shape), tuple(x.shape[:-1]) + (x.shape[-1] // a["block"],)]

    return Variant("quantize_fp8", flashdsa.quantize_fp8, lambda: dict(x=rn(4, 256), block=128, pow2_scale=True),
                   dict(x=Tn(FLOATS3, None, free=(0, 1), contig=False, nan=True), block=posint(1),
                        pow2_scale=boolean()),
                   shapes, backend=False)


def _quant_kv():
    return Variant("quantize_kv_fp8", flashdsa.quantize_kv_fp8, lambda: dict(kv=rn(3, 576, dtype=BF16)),
                   dict(kv=Tn(FLOATS3, None, free=(0,), contig=False, nan=True)),
                   lambda a: [tuple(a["kv"].shape[:-1]) + (656,)], backend=False)


def _dequant_kv():
    return Variant("dequantize_kv_fp8", flashdsa.dequantize_kv_fp8,
                   lambda: dict(x=flashdsa.quantize_kv_fp8(rn(3, 576, dtype=BF16))),
                   dict(x=Tn((U8,), None, free=(0,), contig=False, nan=True)),
                   lambda a: [tuple(a["x"].shape[:-1]) + (576,)], backend=False)


VARIANTS = [_indexer(False), _indexer(True), _indexer_paged(False), _indexer_paged(True), _topk(),
            _dsa_topk(False), _dsa_topk(True), _sparse_fwd("bf16"), _sparse_fwd("batched"), _sparse_fwd("cache656"),
            _sparse_fwd("fp8"), _sparse_mla(), _sparse_attn(), _mla_decode("dense"), _mla_decode("sparse656"),
            _mla_decode("dense656"), _plan(False), _plan(True), _write_kv(False), _write_kv(True),
            _write_indexer(), _quant(), _quant_kv(), _dequant_kv()]


BY_NAME = {v.name: v for v in VARIANTS}

# Sizes shared by several arguments: "arg<dim>" (times a factor after "*"), or a bare scalar argument holding it.
# One "shared" mutation resizes all of them together: degenerate but consistent shapes (0 rows, 0 heads, ...).
_IDX = dict(M="q0 weights0 k_start0 k_end0", H="q1 weights1", D="q2 k1", N="k0 k_scale0")
_PAGED = dict(B=f"q0 weights0*{NN} context_lens0 block_table0", next_n=f"q1 weights0*{B}", H="q2 weights1",
              D="q3 k_cache2", NB="k_cache0 k_scale_cache0", BS="k_cache1 k_scale_cache1", MB="block_table1")
_FLAT = dict(T="q0 indices0 topk_length0 q_scale0", H="q1 attn_sink0 q_scale1", Dqk="q2 kv1", Tkv="kv0 kv_scale0",
             K="indices1")
_DEC = dict(B="q0 block_table0 cache_seqlens0 indices0 topk_length0", s_q="q1 indices1", H="q2 attn_sink0",
            NB="kv_cache0", BS="kv_cache1", MB="block_table1", K="indices2")
_PLAN = dict(B="block_table0 cache_seqlens0 run_q0", s_q="s_q run_q1", H="num_heads run_q2 run_attn_sink0",
             NB="kv_cache0 run_kv_cache0", BS="kv_cache1 run_kv_cache1", MB="block_table1")
SHARED = {
    "indexer_logits": _IDX, "indexer_logits_fp8": _IDX, "dsa_topk": _IDX, "dsa_topk_chunked": _IDX,
    "indexer_logits_paged": _PAGED, "indexer_logits_paged_fp8": _PAGED,
    "topk_indices": dict(M="scores0 starts0 ends0", N="scores1"),
    "sparse_mla_fwd_bf16": _FLAT, "sparse_mla_fwd_fp8": _FLAT, "sparse_mla": _FLAT,
    "sparse_mla_fwd_cache656": {k: v for k, v in _FLAT.items() if k != "Dqk"},
    "sparse_mla_fwd_batched": dict(B="q0 kv0 indices0 topk_length0", S="q1 indices1 topk_length1",
                                   H="q2 attn_sink0", Dqk="q3 kv2", Skv="kv1", K="indices2"),
    "sparse_attn": dict(b="q0 kv0 topk_idxs0", m="q1 topk_idxs1", h="q2 attn_sink0", d="q3 kv2", n="kv1",
                        K="topk_idxs2"),
    "mla_decode_dense": dict(_DEC, Dqk="q3 kv_cache2"), "mla_decode_sparse656": _DEC, "mla_decode_dense656": _DEC,
    "mla_decode_plan": dict(_PLAN, Dqk="kv_cache2 run_kv_cache2 run_q3"), "mla_decode_plan_fp8": _PLAN,
    "write_kv_cache": dict(T="kv0 slot_mapping0", NB="kv_cache0", BS="kv_cache1", D="kv1 kv_cache2"),
    "write_kv_cache_fp8": dict(T="kv0 slot_mapping0", NB="kv_cache0", BS="kv_cache1"),
    "write_indexer_cache": dict(T="k0 slot_mapping0", D="k1 k_cache2", NB="k_cache0 k_scale_cache0",
                                BS="k_cache1 k_scale_cache1"),
    "quantize_fp8": dict(rows="x0", D="x1"), "quantize_kv_fp8": dict(rows="kv0"), "dequantize_kv_fp8": dict(rows="x0"),
}
assert set(SHARED) == set(BY_NAME)


def _shared_mutation(data, name, args):
    """Resize one shared size everywhere it appears; returns the description."""
    where = {}
    for sym, toks in SHARED[name].items():
        for tok in toks.split():
            arg, dim, mult = re.fullmatch(r"([a-z_]+?)(\d*)(?:\*(\d+))?", tok).groups()
            if args.get(arg) is not None:
                where.setdefault(sym, []).append((arg, int(dim) if dim else None, int(mult or 1)))
    sym = data.draw(st.sampled_from(sorted(where)), label="shared size")
    places = where[sym]
    arg, dim, mult = places[0]
    s = args[arg] if dim is None else args[arg].shape[dim] // mult
    n = data.draw(st.sampled_from(sorted({0, 1, s + 1, 2 * s} - {s})), label="new size")
    for arg, dim, mult in places:
        args[arg] = n if dim is None else _resize(args[arg], dim, n * mult)
    return f"shared size {sym} {s} -> {n}"


def _names(v: Variant) -> set:
    if v.names is not None:
        return v.names
    return _PLAN_NAMES if _PLAN_STAGE[0] == "plan" else _RUN_NAMES


# --------------------------------------------------------------------------------------------- mutations
def _as_bytes(x, fn):
    """Apply a layout op to x (via uint8 for fp8, whose CPU kernels are sparse)."""
    if x.dtype == FP8:
        return fn(x.view(U8)).view(FP8)
    return fn(x)


def _resize(x, dim, n):
    s = x.shape[dim]
    if s == 0:
        shape = list(x.shape)
        shape[dim] = n
        return torch.zeros(shape, dtype=x.dtype)
    return _as_bytes(x, lambda y: y.index_select(dim, torch.arange(n) % s))


def _strided(x, dim):
    """x's values with stride doubled in ``dim``."""
    def f(y):
        shape = list(y.shape)
        shape[dim] *= 2
        buf = torch.zeros(shape, dtype=y.dtype)
        out = buf.narrow(dim, 0, y.shape[dim] * 2)[(slice(None),) * (dim % y.dim()) + (slice(None, None, 2),)]
        out.copy_(y)
        return out
    return _as_bytes(x, f)


def _fill(x, value, everywhere, pos):
    y = x.clone()
    if y.numel() == 0:
        return y
    flat = y.view(-1)
    if everywhere:
        flat.fill_(value)
    else:
        flat[pos % flat.numel()] = value
    return y


@st.composite
def tensor_mutation(draw, x: torch.Tensor, spec: Tn):
    """(new value, category, description)."""
    kinds = ["dtype", "extra_dim", "non_tensor", "zero_d"]
    if x.dim() >= 1:
        kinds += ["drop_dim", "resize", "strided_last"]
    if x.dim() >= 2:
        kinds += ["strided_inner", "broadcast"]
    if spec.values:
        kinds += ["values", "values"]
    if spec.nan and x.is_floating_point():
        kinds.append("nan")
    if spec.nan and x.dtype == U8:
        kinds.append("bytes")
    kind = draw(st.sampled_from(kinds))
    nd_ok = (lambda n: n >= 1) if spec.ndims is None else (lambda n: n in spec.ndims)
    if kind == "dtype":
        dt = draw(st.sampled_from([d for d in ALL_DTYPES if d != x.dtype]))
        return x.to(dt), (MAY if dt in spec.dtypes else MUST_RAISE), f"dtype {dt}"
    if kind == "extra_dim":
        pos = draw(st.integers(0, x.dim()))
        two = draw(st.booleans())
        y = _as_bytes(x, lambda t: torch.stack([t, t], pos)) if two else x.unsqueeze(pos)
        return y, (MAY if nd_ok(y.dim()) else MUST_RAISE), f"extra dim at {pos} of size {2 if two else 1}"
    if kind == "drop_dim":
        pos = draw(st.integers(0, x.dim() - 1))
        if x.shape[pos] == 0:
            return x, MUST_PASS, "unchanged"
        y = x.select(pos, 0)
        return y, (MAY if nd_ok(y.dim()) else MUST_RAISE), f"dim {pos} dropped"
    if kind == "resize":
        dim = draw(st.integers(0, x.dim() - 1))
        s = x.shape[dim]
        n = draw(st.sampled_from(sorted({0, 1, max(s - 1, 0), s + 1, 2 * s, 3} - {s})))
        free = dim in spec.free or dim - x.dim() in spec.free or (spec.ndims is None and dim == x.dim() - 1)
        return _resize(x, dim, n), (MAY if free else MUST_RAISE), f"dim {dim} resized {s} -> {n}"
    if kind == "non_tensor":
        v = draw(st.sampled_from([None, "list", 1.0, 3, "x"]))
        if v == "list":
            v = x.detach().float().tolist() if x.numel() <= 64 else [1.0, 2.0]
        cat = MUST_PASS if (v is None and spec.optional) else MUST_RAISE
        return v, cat, f"non-tensor {type(v).__name__}"
    if kind == "zero_d":
        return torch.zeros((), dtype=x.dtype), (MAY if nd_ok(0) else MUST_RAISE), "0-d tensor"
    if kind == "strided_last":
        y = _strided(x, -1)
        if spec.whole_contig or (spec.contig and x.shape[-1] > 1):
            return y, MUST_RAISE, "last dim strided"
        return y, MUST_PASS, "last dim strided"
    if kind in ("strided_inner", "broadcast"):  # any layout but the last dim's is legal (docs: Validation)
        dim = draw(st.integers(0, x.dim() - 2))
        if kind == "broadcast" and x.shape[dim] > 1:
            y = x.narrow(dim, 0, 1).expand(x.shape)  # stride 0
        else:
            y = _strided(x, dim)
        return y, (MUST_RAISE if spec.whole_contig else MUST_PASS), f"dim {dim} {kind}"
    if kind == "values":
        v = draw(st.sampled_from(spec.values))
        if x.dtype == I32 and not INT_MIN <= v <= INT_MAX:
            v = INT_MAX
        every = draw(st.booleans())
        return _fill(x, v, every, draw(st.integers(0, 63))), MUST_PASS, f"value {v} ({'all' if every else 'one'})"
    if kind == "nan":
        v = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        return _fill(x, v, False, draw(st.integers(0, 63))), MUST_PASS, f"float value {v}"
    if kind == "bytes":
        v = draw(st.integers(0, 255))
        return _fill(x, v, draw(st.booleans()), draw(st.integers(0, 10**6))), MUST_PASS, f"byte {v}"
    raise AssertionError(kind)


def _outputs(res):
    if isinstance(res, torch.Tensor):
        return [res]
    return list(res)


def _check_shapes(v: Variant, args, res, desc):
    want = v.shapes(args)
    got = _outputs(res)
    assert len(got) == len(want), f"{v.name} [{desc}]: {len(got)} outputs, documented {len(want)}"
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor), f"{v.name} [{desc}]: output {type(g).__name__}"
        assert tuple(g.shape) == tuple(w), f"{v.name} [{desc}]: output shape {tuple(g.shape)}, documented {w}"
    if v.fn is flashdsa.write_kv_cache:
        assert res is args["kv_cache"]
    if v.fn is flashdsa.write_indexer_cache:
        assert res[0] is args["k_cache"] and res[1] is args["k_scale_cache"]


def _same(a, b, desc):
    for x, y in zip(_outputs(a), _outputs(b)):
        if x.is_floating_point():
            torch.testing.assert_close(x.double(), y.double(), equal_nan=True, atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"auto vs reference differ [{desc}]: {m}")
        else:
            assert torch.equal(x, y), f"auto vs reference differ [{desc}]"


@pytest.mark.parametrize("v", VARIANTS, ids=[v.name for v in VARIANTS])
def test_base_call_is_valid(v):
    for backend in (("reference", "auto") if v.backend else (None,)):
        args = v.build()
        if backend:
            args["backend"] = backend
        _check_shapes(v, args, v.run(args), "base")


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
@FUZZ
@given(data=st.data())
def test_one_mutation(name, data):
    v = BY_NAME[name]
    args = v.build()
    if v.backend:
        args["backend"] = data.draw(st.sampled_from(["reference", "auto"]), label="backend")
    specs = dict(v.specs)
    if v.backend:
        specs["backend"] = BACKEND
    name = data.draw(st.sampled_from(sorted(specs) + ["<shared size>"] * 3), label="arg")
    spec = specs.get(name)
    if spec is None:
        new, cat, desc = None, MAY, _shared_mutation(data, v.name, args)
    elif isinstance(spec, Tn):
        new, cat, desc = data.draw(tensor_mutation(args[name], spec), label="mutation")
    else:
        new = data.draw(st.sampled_from(SCALAR_POOL + spec.extra), label="value")
        cat, desc = (MAY if spec.valid(new, args) else MUST_RAISE), f"value {new!r}"
    if spec is not None:
        args[name] = new
    desc = f"{name}: {desc}"
    try:
        res = v.run(args)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert cat != MUST_PASS, f"{v.name} [{desc}]: legal input rejected: {type(e).__name__}: {msg}"
        assert msg.split(":")[0] in _names(v), f"{v.name} [{desc}]: message does not name an argument: {msg}"
        return
    assert cat != MUST_RAISE, f"{v.name} [{desc}]: invalid input accepted"
    _check_shapes(v, args, res, desc)
    if cat == MUST_PASS and v.backend:
        other = "auto" if args["backend"] == "reference" else "reference"
        _same(res, v.run({**args, "backend": other}), desc)
