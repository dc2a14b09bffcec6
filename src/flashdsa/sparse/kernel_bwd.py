"""Sparse MLA backward (dq, dkv, d_sink) in TileLang for Hopper (sm_90a); dispatched by ``sparse_mla``/``sparse_attn``.

Numerics note: dkv may differ from the float64 reference by ~1e-3 where the exact value is ~1e-2 on tokens with
very few valid keys (P ~ 0.5 on every head): the bf16 rounding of P as a wgmma operand (as in FA2/FA3's dV = P^T dO)
summed over 64 heads.  A CPU emulation with the same roundings reproduces it exactly; the GPU test admits 2x that
emulation's error (a lost atomic still fails).

Notes
-----
Math (reference.sparse_mla_bwd_reference is the source of truth):
  ``P = exp(s - lse) * g`` (g the sink gate), ``delta = out . dout``, ``dP = dout . V``,
  ``dS = P * (dP - delta)`` (+ ``exp(s - lse) * dlse``), ``dq = sm_scale dS K``,
  ``dkv[i] += sm_scale dS^T q`` and ``dkv[i, :d_v] += P^T dout``, ``d_sink = -sum_t (1 - g) delta``.
Design:
  * Preprocess, in the main kernel's prologue (``row_stats``; one launch instead of a row-dot kernel and ~20
    [T, H] torch ops; with the Q / dO tiles by cp.async, session 16: suite V4 3.657 -> 3.502 ms, H 64 11.73 ->
    11.46, H 128 22.91 -> 22.55): per (t, h) ``lse2 = (lse + softplus(sink -
    lse)) * log2(e)`` -- the natural-log lse converted to log2 units with the sink gate folded in (``P =
    exp2(s * sm_scale * log2e - lse2)``; g = 0 or an empty row give lse2 = +inf, so P = 0 exactly) -- and
    ``delta`` (minus dlse when given; 0 on empty rows), from O and dO read once while the Q / dO tiles and block
    0's rows arrive by cp.async.  d_sink = the torch sum over T of the kernel's [T, H] rows -(1 - g) delta.
  * Main kernel, grid ``(T, H / 64)``, 256 threads = 2 warpgroups, one CTA per (token, 64-head group).  Q, Q-tail
    and dO tiles stay in shared memory.  A static-trip-count loop over top-k blocks of BI = 64 slots:
      - block i+1's slot rows (``valid ? indices[t, j] : -1``, valid: j < topk_length, 0 <= idx < Tkv) into
        ``rows_s[(i+1) % 2]`` (``% 3`` with the reducer) and its KV rows by predicated zero-filling cp.async
        (invalid rows are never read; NaN cannot leak) are issued right after block i's ``dq += dS K`` (the last
        reader of the KV tile), so the gather lands during block i's dK/dV products and atomics; block 0 is
        gathered before the loop;
      - S = Q K^T (wgmma, invalid columns start at -inf), P = exp2(S c - lse2);
      - dP = dO V^T (wgmma), dS = sm_scale * P * (dP - delta); P and dS -> bf16 shared;
      - dq += dS K, dq_tail += dS K_tail (wgmma, fp32 register accumulators for the whole loop);
      - dKV in 64-column chunks (keeps registers low): acc = dS^T Q[:, chunk] (+ P^T dO[:, chunk] for chunk < d_v)
        (wgmma with transposed A), then 16-byte fp32 reductions (``red = "oct4"``: the fragment shuffled so that
        each 8-lane group covers one row's 128 contiguous bytes) into a ``[Tkv, Dqk]`` fp32 buffer, skipping
        invalid rows (fast path), or 16-byte stores of the same pattern into a partial buffer keyed by (head
        group, token, slot) (deterministic path).
  * Deterministic mode (``deterministic=True``): tokens are processed in chunks so the partial buffer stays
    <= 2 GiB, whole waves of the main kernel (``_det_chunk``); per chunk the valid slot keys are stably sorted by kv
    row (torch.sort(stable=True)), segment starts come from searchsorted, and a small TileLang kernel (one CTA per kv
    row) adds each row's partials in sorted order into the fp32 accumulator (no atomics; chunks in fixed order).
    Bitwise reproducible by construction (every sum has a fixed order); slower: the partials cost 2 x 4 B x Dqk per
    (slot, head group) of extra HBM traffic (~77 GB at the headline H = 128 shape, ~18 ms) -- likely > 2x the fast
    path.
  * Dqk 512 (K = V, DeepSeek-V4), fast path: a third warpgroup (the reducer, ``reducer=True``) issues the
    atomics.  Each compute warpgroup writes its 32 columns of a 64 x 64 fp32 dKV chunk into its half of a
    16 KiB shared stage (``fdsa_stage_put``, an extern, so TileLang adds no CTA-wide barrier per chunk; XOR
    swizzle, conflict-free) and arrives on that half's ``st_full``; two reducer warps per half read the rows and
    values, arrive on ``st_free`` and send 16-byte ``red.global.add.v4.f32``.  The reductions then overlap the
    tensor work instead of stalling the warps that issue wgmma.  Session 17, V4 main kernel 3.48 -> 3.32 ms,
    H 64 / Dqk 512 / topk 2048 10.61 -> 9.98 (dq bitwise equal to the default build, dkv within 6e-8); without
    the reductions (``red_skip``) 2.78 against 1.82 with no atomics at all: decoupled, the reductions cost 0.54 ms
    instead of 1.66, but the hand-over through shared memory costs 0.96 (a first form with one 64-column stage
    and a CTA-wide barrier per chunk: 3.37 / 2.92; a double-buffered one in 16-column pieces: 3.49 / 2.79).
    setmaxnreg 232 / 232 / 40.  Dqk 576 has no 16 KiB left for the stage.  The slot rows are triple-buffered
    here: the reducer reads block i's rows for its last chunk while the compute warpgroups may already write
    block i+2's (session 57: with two buffers initcheck's timing showed it as wrong dkv in the last chunk).
  * dkv = fp32 accumulator .to(bf16); dq is written once, bf16, through the Q tile (no atomics).
  * T, Tkv and the indices width are dynamic symbols; the trip count ceil(topk / 64) is static (TileLang
    0.1.15 pitfalls, see kernel_fwd.py): kernels are cached per (H, Dqk, n_blocks, sm_scale, topk_length,
    partials).
Shared memory (Dqk = 576): Q 64x512 + dO 64x512 + KV 64x512 bf16 (3 x 64 KiB) + Q/K tails 2 x 8 KiB + P, dS
  2 x 8 KiB + rows (2 x 64) /lse2/delta = 230,656 B as TileLang lays it out (cap 232,448 B).  Dqk = 512: 214,016 B
  (+ the reducer's 16 KiB stage and third 256 B rows buffer).
Registers (per thread, 256 threads): dq 64x512 fp32 = 128, dq_tail 16, S/P 16, dP/dS 16, dKV chunk 64x64 = 16:
  ~192 live floats + addresses; the prologue's out rows (64) are dead before the loop.  ptxas (CUDA 13.0, sm_90a,
  -O3, session 16): 248-254 registers, 0 spill stores/loads for H64/Dqk576, H128/Dqk576/topk_length (+ sink),
  H64/Dqk512/sink, H128/Dqk512/dlse; H64/Dqk576/partials (deterministic): 255 registers, 4 bytes of spill;
  segment_reduce: 32 registers.  The reducer build (384 threads): 168 at launch, no spills, setmaxnreg 232 / 40.
FLOPs: 2 * S * H * topk * (3 * Dqk + 2 * d_v) (QK^T, dS K, dS^T Q over Dqk; dO V^T, P^T dO over d_v).
Verified: GPU tests (tests/sparse_mla/test_kernel_bwd_gpu.py, test_autograd_gpu.py) and compute-sanitizer memcheck
  (scripts/memcheck_small.py sparse_bwd, sparse_bwd_det) on the H200; host logic against the reference on CPU.
Speed (H200, docs/PERFORMANCE.md): ``python -m flashdsa.sparse.kernel_bwd --ablate`` times the main kernel without
  the atomics / without the dK/dV stage, ``--red`` the reduction patterns.  The fp32 reductions into L2 (4.8 G
  floats = 19 GB at H 64) bind, and the L2 takes them by line: scripts/atomic_ceiling.py reaches 2.29 TB/s with
  the fragment's float2 pattern (8 rows x 32 bytes per warp instruction; session 5's lane-pair float4, 16 rows x
  32 bytes, the same), 3.15 with 8 rows x 64 bytes and 3.80 with whole 128-byte lines.  Session 24: ``red =
  "oct4"`` (whole lines) took the main kernel from 10.90 to 9.63 ms at H 64 (5.30 without any reduction) and
  from 21.54 to 18.90 at H 128.  Tried before and slower or equal: float4 reductions staged through shared
  memory (14.2 ms without the prefetch), one ``cp.reduce.async.bulk`` per row (20.7 ms).
Risks:
  * Register pressure: 254/255 registers with no spills under this toolchain; a different nvcc/TileLang
    codegen may spill.  Fix: split dq over d (two 256-column passes) or give dq its own warpgroup.
  * The dKV wgmmas read Q_s / dO_s column slices as MN-major B operands; TileLang picked a 64B-swizzle layout
    for Q_s / dO_s to allow it (descriptor offsets c * 8192 B).
  * dlse together with attn_sink is not supported by this kernel (kernel_unsupported says so).
  * Only H % 64 == 0 (64, 128).
"""

import functools
import math

import torch

import tilelang
import tilelang.language as T

from .. import _dispatch
from .._tilelang import aligned, plain_pass_configs
from . import _tl_common as tc
from . import kernel_fwd
from ._bwd_parts import RED_V4_PRELUDE, build_segment_reduce
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LOG2E

DC = 64  # dKV column chunk
BAR_COMPUTE = 8  # named barrier of the compute warpgroups when the reducer warpgroup is present (0: __syncthreads)
REGS_COMPUTE, REGS_REDUCER = 232, 40  # setmaxnreg with the reducer: 2 x 128 x 232 + 128 x 40 <= 65536
_SUPPORTED_DQK = tc.SUPPORTED_DQK
# deterministic mode: partial buffer <= 2 GiB fp32 (session 24, H 128 suite shape with whole-wave chunks: 40.3 ms at
# 1 GiB = 66 tokens per chunk, 35.6 at 1.5 GiB = 132, 34.0 at 2 GiB = 198; the per-chunk host work and sort
# weigh less with fewer chunks)
_PARTIAL_ELEMS = 1 << 29


def build_sparse_mla_bwd(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_topk_length: bool = False,
    partials: bool = False,
    block_i: int = BLOCK_I,
    threads: int = 256,
    ablate: str = "",
    has_sink: bool = False,
    has_dlse: bool = False,
    reducer: bool = False,
    row_gather: bool = False,
    red: str = "frag2",
):
    """Return the main backward prim_func.

    ``red`` (not with the reducer): how the fp32 dKV chunks leave the accumulator: ``"frag2"`` (TileLang's float2
    atomics / stores straight from the wgmma fragment: 8 rows x 32 bytes per warp instruction), ``"oct4"`` (the
    dispatched ``RED``; the prelude's ``fdsa_red_acc64``: shuffled into 16-byte reductions / stores covering
    4 rows x 128 bytes per instruction; session 24's 8 rows x 64 bytes form, 10.26 ms at H 64 against 9.63, was
    removed).  Fast path: the same sums in another order (dkv equal to rounding); deterministic path: the same
    partials, bitwise.

    ``reducer`` (Dqk 512, fast path): a third warpgroup issues the dK/dV atomics (module notes): each compute
    warpgroup hands its 32 columns of every 64 x 64 fp32 dKV chunk over through its half of a shared stage
    (mbarriers ``st_full`` / ``st_free`` per half) and goes on with the next product.

    ``ablate`` (timing only, wrong results): ``"no_atomics"`` drops the dKV stores/atomics (the dKV wgmmas
    stay; with the reducer: ``"red_skip"``, the hand-over stays), ``"no_dkv"`` drops the dKV wgmmas and stores,
    ``"half_atomics"`` keeps head group 0's atomics only.
    Differences of the times locate the bottleneck.

    Signature: (Q[T,H,Dqk], KV[Tkv,Dqk], dO[T,H,d_v], O[T,H,d_v] bf16, Indices[T,topk], TopkLen[n_tl],
    Lse[T,H] f32 (natural log, +inf on empty rows), Sink[n_sink] f32 (``has_sink``: [H]), DLse[n_dl,H] f32
    (``has_dlse``: [T,H]), dQ[T,H,Dqk] bf16, dKV[n_out,Dqk] f32, DSink[n_ds,H] f32 (``has_sink``: [T,H], written
    -(1 - g) delta, summed over T by the caller)).  ``partials=False``: dKV is the [Tkv, Dqk] accumulator (fp32
    atomics).  ``partials=True``: dKV is [H/64 * T * topk, Dqk], row ``(head_group * T + t) * topk + j`` (valid
    slots only are written).
    """
    assert dqk in _SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    assert heads % BLOCK_H == 0 and 1 <= heads // BLOCK_H <= 2, heads
    D = d_v
    D_tail = dqk - d_v
    assert D_tail in (0, DC), D_tail  # the rope tail is one dKV chunk
    BH = BLOCK_H
    BI = block_i
    n_hblk = heads // BH
    NI = (int(topk) + BI - 1) // BI
    assert sm_scale is not None and sm_scale > 0
    assert ablate in ("", "no_atomics", "no_dkv", "half_atomics", "red_skip"), ablate
    # row_gather (dispatched since session 19: main kernel H 64 11.44 -> 10.91 ms, H 128 22.52 -> 21.49, V4 reducer
    # 3.26 -> 3.14): the block gather by rows (``_tl_common``'s fdsa_gather_bwd: 2 row lookups per thread instead of
    # one Indices load and check per 16-byte copy; same tiles, so the same results bitwise)
    assert not row_gather or threads == 256, "row_gather maps 256 compute threads"
    assert red in ("frag2", "oct4"), red
    assert red == "frag2" or (not reducer and threads == 256 and BI == 64), "red: not with the reducer"
    prelude = ((RED_V4_PRELUDE if reducer or red != "frag2" else "") + (tc.ROW_GATHER_PRELUDE if row_gather else "")
               ) or None
    assert not reducer or (D_tail == 0 and not partials and ablate in ("", "red_skip")), "reducer: Dqk 512 fast path"
    assert reducer or ablate != "red_skip", "red_skip: a reducer build"
    NCH = dqk // DC  # dKV chunks per block
    NRB = 3 if reducer else 2  # slot-row buffers (rows_s)

    def next_rb(it, rb):  # block it+1's rows buffer, an inline expression (the 2-buffer builds' TIR as before)
        return (it + 1) % NRB if reducer else 1 - rb
    c_log2 = float(sm_scale) * LOG2E

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_out, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_out", "topk")
    n_sink, n_dl, n_ds = tc.dynamic_dims("n_sink", "n_dl", "n_ds")
    _row = tc.make_slot_row(topk_dim)  # as in kernel_fwd: -1 past topk_eff, the Indices read kept in bounds
    _row_ok = tc.make_row_ok(n_kv)

    @T.macro
    def sync_compute():
        # the compute warpgroups only: with the reducer the CTA has a third warpgroup that never joins
        if reducer:
            T.sync_threads(BAR_COMPUTE, threads)
        else:
            T.sync_threads()

    @T.macro
    def store_dkv(dKV, acc_kv, rows_s, rb, bx, by, it, col0, Stage, st_full, st_free):
        if reducer:  # each compute warpgroup hands its 32 columns over once the reducer took its previous ones
            wg = T.get_thread_binding() // 128
            T.barrier_wait(st_free[wg], ((it * NCH + col0 // DC) % 2) ^ 1)
            for r, d in T.Parallel(BI, DC):  # through an extern: TileLang adds no CTA-wide barrier for it
                T.call_extern("handle", "fdsa_stage_put", T.address_of(Stage[0]), r, d, acc_kv[r, d])
            T.barrier_arrive(st_full[wg])
        elif ablate == "no_atomics":
            pass
        elif partials:  # row (head group, token, slot) of the partial buffer; valid slots only
            if red == "frag2":
                for r, d in T.Parallel(BI, DC):
                    if rows_s[rb, r] >= 0:
                        dKV[(by * n_tok + bx) * topk_dim + it * BI + r, col0 + d] = acc_kv[r, d]
            else:
                T.call_extern("handle", "fdsa_red_acc64<1>", acc_kv.data,
                              T.address_of(rows_s[rb, 0]), dKV.data, T.int64(dqk), col0,
                              T.cast((by * n_tok + bx) * topk_dim + it * BI, "int64"))
        # fp32 atomics into the [Tkv, Dqk] accumulator, invalid rows skipped ("half_atomics": head group 0 only,
        # the bound of a 2-CTA cluster pre-reduction at H 128; a Python True otherwise)
        elif ablate != "half_atomics" or by == 0:
            if red == "frag2":
                for r, d in T.Parallel(BI, DC):
                    if rows_s[rb, r] >= 0:
                        T.atomic_add(dKV[rows_s[rb, r], col0 + d], acc_kv[r, d])
            else:
                T.call_extern("handle", "fdsa_red_acc64<0>", acc_kv.data,
                              T.address_of(rows_s[rb, 0]), dKV.data, T.int64(dqk), col0, T.int64(0))

    @T.macro
    def gather_parallel(Indices, KV, KV_s, Kt_s, tok, lim, blk):
        for r, d in T.Parallel(BI, D, annotations=tc.ASYNC_GATHER):
            rr = _row(Indices, tok, lim, blk * BI + r)
            ok = _row_ok(rr)
            KV_s[r, d] = T.if_then_else(ok, KV[T.if_then_else(ok, rr, 0), d], T.cast(0, bf16))
        if D_tail > 0:
            for r, d in T.Parallel(BI, D_tail, annotations=tc.ASYNC_GATHER):
                rr = _row(Indices, tok, lim, blk * BI + r)
                ok = _row_ok(rr)
                Kt_s[r, d] = T.if_then_else(ok, KV[T.if_then_else(ok, rr, 0), D + d], T.cast(0, bf16))

    @T.macro
    def gather(Indices, KV, KV_s, Kt_s, rows_s, rb, tok, lim, blk):
        # slot rows (-1 = invalid) of block blk into rows_s[rb], and the predicated cp.async gather of its KV rows
        # (src-size 0 for invalid slots: zero fill, nothing read); one commit per block
        for r in T.Parallel(BI):
            rr = _row(Indices, tok, lim, blk * BI + r)
            rows_s[rb, r] = T.if_then_else(_row_ok(rr), rr, -1)
        if row_gather:
            t = T.get_thread_binding()
            r0 = _row(Indices, tok, lim, blk * BI + t // 8)
            r1 = _row(Indices, tok, lim, blk * BI + t // 8 + 32)
            T.call_extern("handle", "fdsa_gather_bwd", T.address_of(KV_s[0, 0]), T.address_of(Kt_s[0, 0]),
                          1 if D_tail > 0 else 0, T.address_of(KV[0, 0]), dqk, T.if_then_else(_row_ok(r0), r0, -1),
                          T.if_then_else(_row_ok(r1), r1, -1), t)
        else:
            gather_parallel(Indices, KV, KV_s, Kt_s, tok, lim, blk)
        T.ptx_commit_group()

    @T.macro
    def load_out_rows(O, o_reg, bx, h0):
        # this thread's part of the CTA's out tile into registers (head row tx / 4, 16-byte pieces c * 32 + (tx % 4)
        # * 8): issued with the prologue's cp.async, so their latencies overlap; 64 registers, dead before the loop
        tx = T.get_thread_binding()
        for c in T.unroll(D // 32):
            for v in T.vectorized(8):
                o_reg[c * 8 + v] = O[bx, h0 + tx // 4, c * 32 + (tx % 4) * 8 + v]

    @T.macro
    def row_stats(o_reg, dO_s, Lse, Sink, DLse, DSink, lse_s, delta_s, bx, h0):
        # The preprocess, per head row h = tx / 4 (4 threads a row; a fixed summation order, so bitwise
        # repeatable), once dO_s has landed:  delta = out . dout (- dlse), 0 unless lse is finite;  lse2 = (lse +
        # softplus(sink - lse)) log2(e) (the sink gate folded in; +inf on empty rows, so P = 0);  DSink = -(1 - g)
        # delta, g = sigmoid(lse - sink).
        tx = T.get_thread_binding()
        h = tx // 4
        g8 = T.alloc_local([8], bf16)
        dot = T.alloc_local([1], f32)
        dot[0] = 0
        for c in T.unroll(D // 32):
            for v in T.vectorized(8):
                g8[v] = dO_s[h, c * 32 + (tx % 4) * 8 + v]
            for v in T.unroll(8):
                dot[0] = dot[0] + T.cast(o_reg[c * 8 + v], f32) * T.cast(g8[v], f32)
        dot[0] = dot[0] + T.shfl_xor(dot[0], 1)
        dot[0] = dot[0] + T.shfl_xor(dot[0], 2)
        if tx % 4 == 0:
            lse = Lse[bx, h0 + h]
            empty = lse == T.infinity(f32)
            finite = (lse < T.infinity(f32)) & (lse > -T.infinity(f32))  # NaN: neither
            if has_dlse:
                dot[0] = dot[0] - DLse[bx, h0 + h]
            dot[0] = T.if_then_else(finite, dot[0], T.float32(0))
            delta_s[h] = dot[0]
            if has_sink:
                diff = Sink[h0 + h] - lse
                softplus = T.max(diff, T.float32(0)) + T.log1p(T.exp(-T.abs(diff)))
                lse_s[h] = T.if_then_else(empty, T.infinity(f32), (lse + softplus) * T.float32(LOG2E))
                gate = T.if_then_else(empty, T.float32(1), T.sigmoid(-diff))
                DSink[bx, h0 + h] = -(T.float32(1) - gate) * dot[0]
            else:
                lse_s[h] = T.if_then_else(empty, T.infinity(f32), lse * T.float32(LOG2E))

    @T.prim_func
    def sparse_mla_bwd(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        dO: T.Tensor([n_tok, heads, D], bf16),
        O: T.Tensor([n_tok, heads, D], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Lse: T.Tensor([n_tok, heads], f32),
        Sink: T.Tensor([n_sink], f32),
        DLse: T.Tensor([n_dl, heads], f32),
        dQ: T.Tensor([n_tok, heads, dqk], bf16),
        dKV: T.Tensor([n_out, dqk], f32),
        DSink: T.Tensor([n_ds, heads], f32),
    ):
        with T.Kernel(n_tok, n_hblk, threads=threads + (128 if reducer else 0),
                      prelude=prelude) as (bx, by):
            Q_s = T.alloc_shared([BH, D], bf16)
            dO_s = T.alloc_shared([BH, D], bf16)
            KV_s = T.alloc_shared([BI, D], bf16)
            P_s = T.alloc_shared([BH, BI], bf16)
            dS_s = T.alloc_shared([BH, BI], bf16)
            if D_tail > 0:
                Qt_s = T.alloc_shared([BH, D_tail], bf16)
                Kt_s = T.alloc_shared([BI, D_tail], bf16)
            # [block % NRB]: block i+1's rows land during block i.  The reducer build keeps a third buffer: its
            # reducer may still read block i's rows (last chunk) while block i+1 gathers block i+2's rows, and
            # nothing orders those two (the compute warpgroups wait on st_free only at block i+1's first chunk)
            rows_s = T.alloc_shared([NRB, BI], i32)
            lse_s = T.alloc_shared([BH], f32)
            delta_s = T.alloc_shared([BH], f32)

            acc_dq = T.alloc_fragment([BH, D], f32)
            if D_tail > 0:
                acc_dqt = T.alloc_fragment([BH, D_tail], f32)
            acc_s = T.alloc_fragment([BH, BI], f32)
            acc_dp = T.alloc_fragment([BH, BI], f32)
            acc_kv = T.alloc_fragment([BI, DC], f32)
            lim = T.alloc_local([1], i32)
            o_reg = T.alloc_local([D // 4], bf16)  # row_stats: this thread's quarter of one out row
            if reducer:  # the stage (layout: the prelude's fdsa_stage_put) and one full / free barrier per half
                Stage = T.alloc_shared([BI * DC], f32)
                st_full = T.alloc_barrier([128, 128])
                st_free = T.alloc_barrier([64, 64])
            else:
                Stage = st_full = st_free = None

            tx = T.get_thread_binding()
            if tx < threads:  # the compute warpgroups (every thread without the reducer)
                if reducer:
                    T.set_max_nreg(REGS_COMPUTE, 1)
                h0 = by * BH
                if has_topk_length:
                    lim[0] = T.min(TopkLen[bx], topk_dim)
                else:
                    lim[0] = topk_dim

                # Q / dO tiles by cp.async, committed with block 0's gather below, and the out rows into registers:
                # their latencies overlap (at topk 640 the prologue is a larger share of a CTA's time)
                for h, d in T.Parallel(BH, D, annotations=tc.ASYNC_GATHER):
                    Q_s[h, d] = Q[bx, h0 + h, d]
                if D_tail > 0:
                    for h, d in T.Parallel(BH, D_tail, annotations=tc.ASYNC_GATHER):
                        Qt_s[h, d] = Q[bx, h0 + h, D + d]
                for h, d in T.Parallel(BH, D, annotations=tc.ASYNC_GATHER):
                    dO_s[h, d] = dO[bx, h0 + h, d]
                if D_tail > 0:
                    gather(Indices, KV, KV_s, Kt_s, rows_s, 0, bx, lim[0], 0)
                else:
                    gather(Indices, KV, KV_s, KV_s, rows_s, 0, bx, lim[0], 0)
                load_out_rows(O, o_reg, bx, h0)
                T.ptx_wait_group(0)
                sync_compute()  # dO_s complete
                row_stats(o_reg, dO_s, Lse, Sink, DLse, DSink, lse_s, delta_s, bx, h0)
                T.fill(acc_dq, 0)
                if D_tail > 0:
                    T.fill(acc_dqt, 0)

                for it in T.serial(NI):
                    rb = it % NRB
                    T.ptx_wait_group(0)  # block it landed (this thread's copies; the barrier: everyone's)
                    sync_compute()

                    # ---- P = exp2(S c - lse2) (invalid columns -inf -> 0) ----
                    for h, r in T.Parallel(BH, BI):
                        acc_s[h, r] = T.if_then_else(rows_s[rb, r] >= 0, T.float32(0), -T.infinity(f32))
                    T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if D_tail > 0:
                        T.gemm(Qt_s, Kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    for h, r in T.Parallel(BH, BI):
                        acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - lse_s[h])

                    # ---- dP = dO V^T, dS = sm_scale * P * (dP - delta) ----
                    T.gemm(dO_s, KV_s, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for h, r in T.Parallel(BH, BI):
                        acc_dp[h, r] = acc_s[h, r] * (acc_dp[h, r] - delta_s[h]) * T.float32(sm_scale)
                    T.copy(acc_s, P_s)
                    T.copy(acc_dp, dS_s)

                    # ---- dq += dS K ----
                    T.gemm(dS_s, KV_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                    if D_tail > 0:
                        T.gemm(dS_s, Kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullRow)

                    # ---- every warp is past the wgmmas reading KV_s / Kt_s: gather block it+1 into them, so that
                    #      it lands during this block's dK/dV products and atomics (which read neither) ----
                    sync_compute()
                    if it + 1 < NI:
                        if D_tail > 0:
                            gather(Indices, KV, KV_s, Kt_s, rows_s, next_rb(it, rb), bx, lim[0], it + 1)
                        else:
                            gather(Indices, KV, KV_s, KV_s, rows_s, next_rb(it, rb), bx, lim[0], it + 1)

                    # ---- dKV rows of this block, 64 columns at a time ----
                    if ablate != "no_dkv":
                        for c in T.unroll(D // DC):
                            T.gemm(dS_s, Q_s[:, c * DC : c * DC + DC], acc_kv, transpose_A=True, clear_accum=True,
                                   policy=T.GemmWarpPolicy.FullRow)
                            T.gemm(P_s, dO_s[:, c * DC : c * DC + DC], acc_kv, transpose_A=True,
                                   policy=T.GemmWarpPolicy.FullRow)
                            store_dkv(dKV, acc_kv, rows_s, rb, bx, by, it, c * DC, Stage, st_full, st_free)
                        if D_tail > 0:
                            T.gemm(dS_s, Qt_s, acc_kv, transpose_A=True, clear_accum=True,
                                   policy=T.GemmWarpPolicy.FullRow)
                            store_dkv(dKV, acc_kv, rows_s, rb, bx, by, it, D, Stage, st_full, st_free)

                # ---- epilogue: dq (already scaled) through the Q tile ----
                T.copy(acc_dq, Q_s)
                T.copy(Q_s, dQ[bx, h0 : h0 + BH, 0:D], disable_tma=True)
                if D_tail > 0:
                    T.copy(acc_dqt, Qt_s)
                    T.copy(Qt_s, dQ[bx, h0 : h0 + BH, D:dqk], disable_tma=True)
            else:  # the reducer warpgroup: the dKV chunks of every block, in the compute order
                if reducer:  # 64 threads per stage half
                    T.set_max_nreg(REGS_REDUCER, 0)
                    u = tx - threads
                    for it in T.serial(NI):
                        for c in T.serial(NCH):
                            T.barrier_wait(st_full[u // 64], (it * NCH + c) % 2)
                            T.call_extern("handle", "fdsa_reduce_half", T.address_of(Stage[(u // 64) * BI * 32]),
                                          T.address_of(rows_s[it % NRB, 0]), T.address_of(dKV[0, 0]), dqk,
                                          c * DC + (u // 64) * 32, u % 64, T.address_of(st_free[u // 64]),
                                          0 if ablate == "red_skip" else 1)

    return sparse_mla_bwd


def _pass_configs():
    return plain_pass_configs()


RED = "oct4"  # the dKV pattern of every build without the reducer (``build_sparse_mla_bwd``'s ``red``)


@functools.lru_cache(maxsize=32)
def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_topk_length: bool,
              partials: bool, has_sink: bool = False, has_dlse: bool = False, ablate: str = "",
              reducer: bool = False, row_gather: bool = False, red: str = "frag2"):
    func = build_sparse_mla_bwd(heads=heads, dqk=dqk, d_v=d_v, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                has_topk_length=has_topk_length, partials=partials, ablate=ablate,
                                has_sink=has_sink, has_dlse=has_dlse, reducer=reducer, row_gather=row_gather,
                                red=red)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


@functools.lru_cache(maxsize=4)
def _compiled_reduce(dqk: int):
    return tilelang.compile(build_segment_reduce(dqk=dqk), target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, out, lse, dout, *, d_v, topk_length=None, attn_sink=None,
                       dlse=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only): the forward kernel's
    rules for q, kv, indices, topk_length and attn_sink, then the backward's own."""
    reason = kernel_fwd.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is not None:
        return reason
    n_tok, heads = q.shape[:2]
    if not all(x.is_cuda for x in (out, lse, dout)):
        return "out, lse and dout must be on CUDA"
    if out.dtype != torch.bfloat16 or dout.dtype != torch.bfloat16:
        return "out and dout must be bfloat16"
    if lse.dtype != torch.float32:
        return "lse must be float32"
    if heads % BLOCK_H != 0:
        return f"H={heads} not in (64, 128)"
    if out.shape != (n_tok, heads, d_v) or dout.shape != (n_tok, heads, d_v) or lse.shape != (n_tok, heads):
        return "out/dout must be [T,H,d_v] and lse [T,H]"
    if dlse is not None:
        if attn_sink is not None:
            return "dlse together with attn_sink is not supported"
        if dlse.shape != (n_tok, heads) or not dlse.is_cuda:
            return "dlse must be [T,H] on CUDA"
    return None


def _det_chunk(n_tok: int, n_hblk: int, topk: int, dqk: int, n_sm: int) -> int:
    """Tokens per chunk of the deterministic path: the partial buffer holds <= ``_PARTIAL_ELEMS`` floats and, where
    that is at least one wave of the main kernel (``n_hblk`` CTAs per token, one CTA per SM), the chunk's grid is a
    whole number of waves: H 128 / topk 2048 at 2 GiB fits 227 tokens = 3.4 waves, so 198 tokens (3 full waves)
    instead of a fourth wave with most SMs idle.  (The chunking sets the order in which chunks add into the
    accumulator: bitwise reproducible on one GPU model, not across SM counts.)"""
    cap = max(1, _PARTIAL_ELEMS // (n_hblk * topk * dqk))
    if n_tok <= cap:
        return n_tok
    waves = n_hblk * cap // n_sm
    return waves * n_sm // n_hblk if waves >= 1 and n_sm % n_hblk == 0 else cap


def run_sparse_mla_bwd(q, kv, indices, out, lse, dout, *, sm_scale: float, d_v: int, topk_length=None,
                       attn_sink=None, deterministic: bool = False, dlse=None, row_gather: bool = True,
                       red: str | None = None):
    """Returns (dq [T,H,Dqk] bf16, dkv [Tkv,Dqk] bf16, d_sink [H] f32 or None).  ``row_gather``: the block gather
    by rows (the dispatched build; False: the ``T.Parallel`` gather, same outputs).  ``red``: the dKV reduction
    pattern of the fast path without the reducer (``build_sparse_mla_bwd``; None: ``RED``)."""
    reason = kernel_unsupported(q, kv, indices, out, lse, dout, d_v=d_v, topk_length=topk_length,
                                attn_sink=attn_sink, dlse=dlse)
    if reason is not None:
        raise ValueError(f"sparse_mla bwd kernel: {reason}")
    if not (sm_scale > 0 and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite float > 0, got {sm_scale}")
    n_tok, heads, dqk = q.shape
    n_kv = kv.shape[0]
    dev = q.device
    has_sink, has_dlse, has_tl = attn_sink is not None, dlse is not None, topk_length is not None
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    acc = torch.zeros((n_kv, dqk), dtype=torch.float32, device=dev)
    dsink_rows = torch.empty((n_tok, heads) if has_sink else (1, heads), dtype=torch.float32, device=dev)
    if n_tok == 0 or n_kv == 0:
        dq.zero_()
        return dq, acc.to(kv.dtype), (dsink_rows.new_zeros(heads) if has_sink else None)
    q, kv, dout, out, indices, lse = (aligned(x) for x in (q, kv, dout, out, indices, lse))
    _, _, tl_arg, sink, n_blocks = tc.optional_args(indices, topk_length,
                                                    attn_sink.float() if has_sink else None, dev)
    dl = aligned(dlse.float()) if has_dlse else lse.new_empty((1, heads))
    topk = indices.shape[1]
    reducer = dqk == d_v and not deterministic
    red = (RED if red is None else red) if not reducer else "frag2"
    kernel = _compiled(heads, dqk, d_v, n_blocks, float(sm_scale), has_tl, deterministic, has_sink, has_dlse,
                       reducer=reducer, row_gather=row_gather, red=red)
    if not deterministic:
        kernel(q, kv, dout, out, indices, tl_arg, lse, sink, dl, dq, acc, dsink_rows)
    else:
        reduce = _compiled_reduce(dqk)
        n_hblk = heads // BLOCK_H
        n_sm = _dispatch.sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
        chunk = _det_chunk(n_tok, n_hblk, topk, dqk, n_sm)
        pos = torch.arange(topk, device=dev)
        rows = torch.arange(n_kv + 1, device=dev)
        part = torch.empty((n_hblk * chunk * topk, dqk), dtype=torch.float32, device=dev)
        for a in range(0, n_tok, chunk):
            b = min(n_tok, a + chunk)
            n_c = b - a
            idx = indices[a:b]
            valid = (idx >= 0) & (idx < n_kv)
            if has_tl:
                valid &= pos.unsqueeze(0) < topk_length[a:b].unsqueeze(1)
            keys = torch.where(valid, idx.long(), torch.full_like(idx, n_kv, dtype=torch.long))
            keys = keys.reshape(-1).repeat(n_hblk)  # slot id (g * n_c + t) * topk + j
            skeys, order = torch.sort(keys, stable=True)
            start = torch.searchsorted(skeys, rows).to(torch.int32)
            pc = part[: n_hblk * n_c * topk]
            # (a chunk's rows of indices / topk_length start off 16 bytes where topk or a is not a multiple of 4)
            tl_c = aligned(tl_arg[a:b]) if has_tl else tl_arg
            kernel(q[a:b], kv, dout[a:b], out[a:b], aligned(idx), tl_c, lse[a:b], sink, dl[a:b] if has_dlse else dl,
                   dq[a:b], pc, dsink_rows[a:b] if has_sink else dsink_rows)
            reduce(pc, order.to(torch.int32), start, acc)
    return dq, acc.to(kv.dtype), (dsink_rows.sum(0) if has_sink else None)


def lowering_cases():
    """The CPU lowering test's cases (lowering is slow): H 128, Dqk 576, topk_length; the Dqk 512 reducer build."""
    fn = build_sparse_mla_bwd(heads=128, dqk=576, d_v=D_V, topk=2048, sm_scale=576**-0.5, has_topk_length=True)
    red = build_sparse_mla_bwd(heads=64, dqk=512, d_v=D_V, topk=640, sm_scale=512**-0.5, has_sink=True, reducer=True)
    rows = build_sparse_mla_bwd(heads=64, dqk=576, d_v=D_V, topk=256, sm_scale=576**-0.5, has_topk_length=True,
                                row_gather=True)
    cases = [("h128_d576_topk2048_tl", fn), ("h64_d512_topk640_sink_reducer", red), ("h64_d576_topk256_tl_rows", rows)]
    cases.append(("h64_d576_topk256_rows_oct4", build_sparse_mla_bwd(
        heads=64, dqk=576, d_v=D_V, topk=256, sm_scale=576**-0.5, row_gather=True, red="oct4")))
    cases.append(("h64_d576_topk256_partials_oct4", build_sparse_mla_bwd(
        heads=64, dqk=576, d_v=D_V, topk=256, sm_scale=576**-0.5, partials=True, row_gather=True, red="oct4")))
    return cases


def combine_lowering_cases():
    """Helper kernels without matrix products."""
    return [("segment_reduce_d576", build_segment_reduce(dqk=576))]


if __name__ == "__main__":  # the timing tools: python -m flashdsa.sparse.kernel_bwd [--ablate | --topk | --reducer]
    from ._bwd_timing import main

    main()
