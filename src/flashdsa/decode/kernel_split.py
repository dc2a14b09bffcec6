"""Split-KV for the decode forms that run as one sparse MLA forward: sparse decode over either cache, and dense
decode over the FP8 656-byte cache (through slot lists).

A forward CTA takes one query token and 64 heads, so a decode step with few query tokens leaves most SMs idle:
B = 1 at H 128 runs 2 CTAs on the H200's 132 SMs, each walking its whole slot list (top-k, or for dense decode
over the FP8 cache the whole cache) alone. Where the step's CTAs fill at most half of the SMs, ``split_plan``
cuts every token's slot list into ``n_split`` chunks of ``chunk`` slots (a power-of-two number of 64-slot blocks,
at least ``MIN_SPLIT_BLOCKS``); the forward then runs once over the ``T * n_split`` (token, chunk) rows
(``split_inputs``: each chunk's slots and ``topk_length``; q read once per token; no sink) and one combine kernel
merges each token's chunks (``combine``). With ``lse_k`` the natural-log lse of chunk k (+inf where it saw no key, the
forward's contract for an empty row, i.e. weight 0):

    m = max_k lse_k,  w_k = exp(lse_k - m),  lse = m + log(sum_k w_k),
    out = sum_k w_k out_k / (sum_k w_k + exp(sink - m))    (the sink term only with attn_sink),

and a token no chunk saw a key of gets out 0, lse +inf. The plan depends on shapes only: no host sync, so a split
decode step captures in a CUDA graph. The forward writes each chunk's normalised output in fp32 (``out_f32``: the
pair forms over either cache (H 64 / 128) and the "mma" forms of the 656-byte-cache forward (H <= 16,
``kernel_fwd_fp8cache.writes_f32``); bf16 partials put the output's cosine distance at ~5e-6, the issue's bound,
measured in session 44) and the merge runs in fp32. Other head counts run the split forward on the next pair form
(``forward_heads``: 64 or 128 heads, q padded with zero heads by ``pad_heads``); the combine reads the real heads
only.

``$FLASHDSA_DECODE_SPLIT`` (``SPLIT_ENV``): "0" never splits (for timing); a positive integer is the least number
of 64-slot blocks per chunk instead of ``MIN_SPLIT_BLOCKS``.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools
import os

import torch

# pad_heads: the split forward's q, forward_heads
from .._tilelang import aligned, direct_launcher, pad_heads  # noqa: F401
from ._tl_common import D_V, combine_row_macro

SPLIT_ENV = "FLASHDSA_DECODE_SPLIT"
BLOCK = 64  # slots per forward block: chunks are whole blocks
MIN_SPLIT_BLOCKS = 2  # a chunk holds at least this many blocks (its CTA also loads Q and writes a partial)
_COMBINE_THREADS = 128
EXPECTS_WGMMA = False  # the combine kernel has no matrix product (tests/test_lowering.py)


def split_plan(tokens: int, heads: int, topk: int, num_sms: int, fill: int = 2) -> tuple[int, int]:
    """(n_split, chunk) for a forward over ``tokens`` query rows of ``heads`` heads with ``topk`` slots each:
    (1, topk) where its ``tokens * ceil(heads / 64)`` CTAs fill more than 1 / ``fill`` of the ``num_sms`` SMs, or
    the list is too short to cut; else chunks of ``chunk`` slots (a power of two times 64, at least the minimum)
    such that about one CTA per SM runs.  (A larger ``fill`` where the unsplit form is much cheaper per key than the
    split one, ``split_fill``.)"""
    env = os.environ.get(SPLIT_ENV, "")
    if env == "0":
        return 1, topk
    min_blocks = int(env) if env.isdigit() else MIN_SPLIT_BLOCKS
    units = tokens * -(-heads // 64)
    n_blocks = -(-topk // BLOCK)
    if units == 0 or fill * units > num_sms or n_blocks < 2 * min_blocks:
        return 1, topk
    per_chunk = -(-n_blocks // (num_sms // units))
    blocks = max(min_blocks, 1 << (per_chunk - 1).bit_length())
    n_split = -(-n_blocks // blocks)
    return (n_split, blocks * BLOCK) if n_split > 1 else (1, topk)


def forward_heads(heads: int, fp8: bool) -> int:
    """The head count the split forward runs at for ``heads`` query heads: ``heads`` where a kernel at that H
    writes fp32 partials (the pair forms at 64 / 128 over either cache; the "mma" forms at H <= 16 over the
    656-byte cache, ``kernel_fwd_fp8cache.writes_f32``), else the next pair form (64 up to 64 heads, else 128): the
    padded heads' q rows are zero and their partials are never read.  (At the few tokens that split, a chunk's
    CTA is bound by its rows and its fixed cost, not by the heads' products.)  A few-head form picked through
    ``$FLASHDSA_NARROW_CACHE656`` that writes no fp32 partials (e.g. a timing build) therefore splits on the padded
    64-head pair form: time such forms unsplit (``$FLASHDSA_DECODE_SPLIT=0``)."""
    if fp8:
        from ..sparse import kernel_fwd_fp8cache

        if kernel_fwd_fp8cache.writes_f32(heads):
            return heads
    return 64 if heads <= 64 else 128


def split_fill(heads: int, fp8: bool) -> int:
    """``split_plan``'s ``fill`` for this form: 12 for the bf16 cache at H <= 16 (split up to 11 tokens), else 2.
    There the unsplit forward is the per-warp ``mma.sync`` kernel, cheap per token, while the split runs the padded
    64-head pair form, whose cost grows with the tokens.  Measured (session 46, H100, CUDA-graph replay, topk 2048,
    cache 32768): B 4 split 0.0474 ms against 0.0528 unsplit, B 32 0.0828 against 0.0690; linear in B between
    them, the two tie near B 12.  (Session 45's rule, fill 4, split up to 33 tokens.)"""
    return 12 if not fp8 and heads <= 16 else 2


def split_inputs(slots, topk_length, n_split: int, chunk: int):
    """The forward's index inputs for the (token, chunk) rows, row ``t * n_split + k`` = chunk k of token t (q keeps
    one row per token: the ``out_f32`` forward builds read q row ``t`` for rows ``t * n_split ..``):
    (slots [T * n_split, chunk] (slots[t, k * chunk:(k + 1) * chunk], -1 past the list), topk_length
    [T * n_split] int32 (``topk_length[t] - k * chunk`` clamped to [0, chunk]) or None where ``topk_length`` is
    None).  slots [T, topk] int32, topk_length [T] int32 or None."""
    T_ = slots.shape[0]
    pad = n_split * chunk - slots.shape[1]
    if pad > 0:
        slots = torch.nn.functional.pad(slots, (0, pad), value=-1)
    slots_s = slots.contiguous().view(T_ * n_split, chunk)
    tl_s = None
    if topk_length is not None:
        start = torch.arange(n_split, dtype=torch.int32, device=slots.device) * chunk
        tl_s = (topk_length.view(T_, 1) - start).clamp_(0, chunk).reshape(T_ * n_split)
    return slots_s, tl_s


def split_rows(q, slots, topk_length, n_split: int, chunk: int, heads: int):
    """All the split forward's inputs besides the cache: (q [T, heads, D] (``pad_heads``: ``forward_heads``'s
    count), slots, topk_length of the (token, chunk) rows (``split_inputs``))."""
    slots_s, tl_s = split_inputs(slots, topk_length, n_split, chunk)
    return pad_heads(q, heads), slots_s, tl_s


def build_combine_kernel(*, heads: int, has_sink: bool, threads: int = _COMBINE_THREADS, part_heads: int = 0,
                         with_max: bool = False):
    """Merge the chunks of each (token, head) (module docstring) with the dense decode's merge
    (``_tl_common.combine_row_macro``) in the forward's lse convention (``natural``: natural log, +inf for a chunk
    with no key, a NaN partial kept).

    Signature: (OPart [T * n_split, Hp, 512] f32 (row t * n_split + k: chunk k of token t), LsePart [T * n_split,
    Hp] f32, Sink [n_sink] f32, Out [T, H, 512] bf16, Lse [T, H] f32, n_split int32) with Hp = ``part_heads``
    (0: H; more where the forward ran padded heads, ``forward_heads``: heads H.. of the partials are not read);
    grid (H, T), ``threads`` x 512 / threads columns.  ``with_max`` (the prefill's last round split,
    ``sparse/_tail_split.py``): MaxPart [T * n_split, Hp] f32 after LsePart and MaxLogits [T, H] f32 after Lse,
    the chunks' largest max logit (-inf where none saw a key).
    """
    import tilelang.language as T

    D = D_V
    VPT = D // threads
    f32, bf16 = "float32", "bfloat16"
    nrow, ntok, n_sink = T.dynamic("rows"), T.dynamic("tokens"), T.dynamic("n_sink")
    hp = part_heads or heads
    assert hp >= heads, (part_heads, heads)
    combine_row = combine_row_macro(heads=heads, has_sink=has_sink, vpt=VPT, col=lambda t, v: t * VPT + v,
                                    natural=True)

    @T.macro
    def merge(OPart, LsePart, Sink, Out, Lse, n_split, h, t):
        tx = T.get_thread_binding()
        mx = T.alloc_local([1], f32)
        tot = T.alloc_local([1], f32)
        w = T.alloc_local([1], f32)
        scl = T.alloc_local([1], f32)
        acc = T.alloc_local([VPT], f32)
        combine_row(Sink, OPart, LsePart, Out, Lse, t, h, t * n_split, n_split, tx == 0, tx, (mx, tot, w, scl, acc))

    @T.prim_func
    def mla_decode_split_combine(
        OPart: T.Tensor([nrow, hp, D], f32),
        LsePart: T.Tensor([nrow, hp], f32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([ntok, heads, D], bf16),
        Lse: T.Tensor([ntok, heads], f32),
        n_split: T.int32,
    ):
        with T.Kernel(heads, ntok, threads=threads) as (h, t):
            merge(OPart, LsePart, Sink, Out, Lse, n_split, h, t)

    @T.prim_func
    def mla_split_combine_max(
        OPart: T.Tensor([nrow, hp, D], f32),
        LsePart: T.Tensor([nrow, hp], f32),
        MaxPart: T.Tensor([nrow, hp], f32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([ntok, heads, D], bf16),
        Lse: T.Tensor([ntok, heads], f32),
        MaxLogits: T.Tensor([ntok, heads], f32),
        n_split: T.int32,
    ):
        with T.Kernel(heads, ntok, threads=threads) as (h, t):
            merge(OPart, LsePart, Sink, Out, Lse, n_split, h, t)
            if T.get_thread_binding() == 0:
                ml = T.alloc_local([1], f32)
                ml[0] = -T.infinity(f32)
                for k in T.serial(n_split):
                    ml[0] = T.max(ml[0], MaxPart[t * n_split + k, h])
                MaxLogits[t, h] = ml[0]

    return mla_split_combine_max if with_max else mla_decode_split_combine


@functools.lru_cache(maxsize=32)
def _compiled_combine(heads: int, has_sink: bool, part_heads: int = 0, with_max: bool = False):
    import tilelang

    return direct_launcher(tilelang.compile(build_combine_kernel(heads=heads, has_sink=has_sink,
                                                                 part_heads=part_heads, with_max=with_max),
                                            target="cuda"))


def combine(out_p, lse_p, attn_sink, n_split: int, heads: int | None = None):
    """(out [T, H, 512] bf16, lse [T, H] f32) merged from the forward's outputs over the (token, chunk) rows:
    out_p [T * n_split, Hp, 512] f32, lse_p [T * n_split, Hp] f32 (Hp >= H: ``forward_heads``); attn_sink [H] f32
    or None; H = ``heads`` (None: Hp)."""
    from .._tilelang import dummy

    n, Hp, D = out_p.shape
    H = Hp if heads is None else heads
    T_ = n // n_split
    out = torch.empty((T_, H, D), dtype=torch.bfloat16, device=out_p.device)
    lse = torch.empty((T_, H), dtype=torch.float32, device=out_p.device)
    sink = dummy(torch.float32, out_p.device) if attn_sink is None else aligned(attn_sink.float())
    _compiled_combine(H, attn_sink is not None, 0 if Hp == H else Hp)(out_p, lse_p, sink, out, lse, n_split)
    return out, lse


def launch_and_combine(launch, q_s, kv, slots_s, tl_s, sink_arg, attn_sink, n_split: int, heads: int, d_v: int):
    """A compiled ``out_f32`` forward ``launch`` over the (token, chunk) rows, then ``combine``: q_s [T, Hp, D] (one
    row per token), kv, slots_s [T * n_split, chunk] / tl_s [T * n_split] (``split_inputs``), ``sink_arg`` the
    tensor the launch takes for its (unread) sink, attn_sink [H] or None for the combine -> (out [T, H, d_v] bf16,
    lse [T, H] f32)."""
    n, Hp = q_s.shape[0] * n_split, q_s.shape[1]
    out = torch.empty((n, Hp, d_v), dtype=torch.float32, device=q_s.device)
    lse = torch.empty((n, Hp), dtype=torch.float32, device=q_s.device)
    max_logits = torch.empty((n, Hp), dtype=torch.float32, device=q_s.device)
    launch(q_s, kv, slots_s, tl_s, sink_arg, out, lse, max_logits)
    return combine(out, lse, attn_sink, n_split, heads=heads)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [(f"split_combine_h{h}" + ("_sink" if s else "") + (f"_of{p}" if p else "") + ("_max" if m else ""),
             build_combine_kernel(heads=h, has_sink=s, part_heads=p, with_max=m))
            for h, s, p, m in ((128, True, 0, False), (16, False, 0, False), (32, True, 64, False),
                               (64, True, 0, True))]
