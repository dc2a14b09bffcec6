"""Sparse MLA forward with FP8 (e4m3) q and KV: both products on FP8 wgmma, TileLang, Hopper (sm_90a).

Math (per token t, head h; q8, kv8 e4m3, q_scale [T, H], kv_scale [Tkv] float32; V = first d_v dims):
    valid slot j: j < topk_eff and 0 <= indices[t, j] < Tkv (duplicates counted), row = indices[t, j]
    s_j = sm_scale * q_scale[t, h] * kv_scale[row] * (q8[t, h] . kv8[row])              (fp8 wgmma, fp32 acc)
    out = sum_j softmax(s)_j * kv_scale[row] * kv8[row, :d_v]    (bf16), lse (natural log), max_logits,
    i.e. the bf16 forward (kernel_fwd.py) on the dequantized tensors q8 * q_scale, kv8 * kv_scale.
    Empty rows: out 0, lse +inf, max_logits -inf; attn_sink and topk_length as kernel_fwd.

Dispatch (session 10): ``run_sparse_mla_fwd_fp8`` sends H 64 / 128 (with ``p_split``) to ``kernel_fwd_pair_fp8``
(the pair schedule, 0.96x of the bf16 forward where this kernel reaches 0.55x); this kernel serves the other H.

Design (kernel_fwd.py's pipelined structure, fp8 operands):
  * Grid (T, ceil(H / 64)), 256 threads = 2 warpgroups, GemmWarpPolicy.FullRow; heads padded to 64 rows
    (padded rows read zeros, q_scale 0, never written).  T.Pipelined (2 stages) predicated cp.async gather of
    64 fp8 KV rows (576 B each, half of bf16) plus their 64 kv_scale values (invalid rows zero-filled, never
    read).
  * QK: S = Q8 K8^T, m64n32k32 e4m3 wgmma per warpgroup (both operands K-major).  Scores are scaled in fp32:
    acc * q_scale[h] * kv_scale[j] (invalid columns -> -inf), then the exp2 online softmax of kernel_fwd
    (raw max starts at -1e30, sm_scale*log2(e) folded).
  * PV on fp8 wgmma.  SM90 e4m3 wgmma has no transpose bit (TileLang 0.1.15's T.gemm does lower an
    MN-major fp8 B operand, but tl::WgmmaSSImpl only specialises e4m3 for tnspA = tnspB = false, so nvcc
    stops at its static_assert "unsupported configuration"): B must be K-major, i.e. V^T [512, 64 keys].
    ``flashdsa_fp8_vt_transpose`` (CUDA prelude below) transposes the gathered tile in shared memory: each
    thread moves two 8x8 byte blocks with 8-byte loads, __byte_perm 4x4 transposes and 8-byte stores,
    addressing TileLang's swizzled layouts directly (128B swizzle of KV_s [64, 512], 64B swizzle of
    Vt_s [512, 64]; checked against TileLang's layout objects).  Per-thread skews (dims XOR lane%8, rows
    XOR 4*bit3(lane)) make every 64-bit load and store conflict-free (2 wavefronts / warp instruction).
  * P for the PV wgmma: P'[h, j] = P[h, j] * kv_scale[j] * 256 / sigma_h with sigma_h = max_j P*kv_scale in
    this block, so P' in [0, 256] uses the e4m3 range; the accumulator is kept in per-row units
    u_h = sigma_h / 256 (acc_o *= alpha * u_old / u_new each block; out = acc_o * u / l).  e4m3 has 3
    mantissa bits: a single e4m3 P gives ~2.4 % rms relative error per probability and a cosine distance of
    ~6e-4 on N(0, 0.1^2) inputs.  ``p_split=True`` (default) sends P' = hi + lo, hi = e4m3(P'),
    lo = e4m3(P' - hi), through two wgmmas against the same V^T (~7 mantissa bits: error comparable to
    the bf16 kernel's bf16 P, measured in a CPU emulation: cos 1.5e-6 vs 2.0e-6 for bf16 P).  PV costs
    two m64n256k32 fp8 wgmma chains = the tensor time of one bf16 PV; QK is at fp8 rate.
Shared memory (Dqk 576): Q 36 KiB + 2 x (KV 36 KiB + 256 B scales) + V^T 32 KiB + P hi/lo 8 KiB
  + out staging (bf16 64x512, 64 KiB; TileLang may alias it with dead buffers) + reduction scratch.
  Registers: acc_o 128 fp32 per thread as in kernel_fwd.
Why it should beat the bf16 kernel: the bf16 pipelined kernel spends ~7500 cycles per 64-key block, ~3100
  of them MMA; the rest is mostly the gather (72 KiB per block per CTA from L2).  Here the gather is
  36 KiB, QK tensor time halves, PV tensor time is unchanged (p_split) or halves (p_split=False); the
  transpose costs ~16 shared loads/stores per thread per block, on the CUDA cores.
Verified first on the CPU (on the H200 since 67a61c8: tests/sparse_mla/test_kernel_fp8_gpu.py): lowering for
  sm_90a (H 128/64/16, Dqk 576/512, topk 2048/256/128/100, sink, topk_length, p_split on/off); the generated CUDA
  read by hand (cp.async wait counts cover the KV group before the QK gemm and the transpose, the next stage's KV
  loads are issued after the transpose, ks loads after the last ks read); nvcc 13.0 -arch=sm_90a compiles every one,
  PTX has wgmma m64n32k32 / m64n256k32 .f32.e4m3.e4m3 only; ptxas: 255 registers, 132 B spill for the 32-block H 128
  config (0 spill for 2-block configs).  The transpose helper was checked against TileLang's layout objects by a
  Python model (exact V^T, 2 wavefronts per 64-bit warp access = conflict-free).
"""



import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import aligned, plain_pass_configs
from . import _tl_common as tc
from ._tl_common import LOG2E, BLOCK_H, BLOCK_I, D_V

_SUPPORTED_DQK = tc.SUPPORTED_DQK
P_RANGE = 256.0  # P' = P * kv_scale / u with u = row max / P_RANGE: P' in [0, 256] (e4m3 max 448)

# Vt[d][r] = KV[r][d] for r < 64 keys, d < 512 dims, fp8 bytes, 256 threads. Layouts (byte offsets, TileLang's
# make_full_bank_swizzled_layout of [64, 512] and make_half_bank_swizzled_layout of [512, 64]):
#   KV: (d >> 7) * 8192 + r * 128 + ((((d >> 4) & 7) ^ (r & 7)) << 4) + (d & 15)
#   Vt: d * 64 + ((((r >> 4) & 3) ^ ((d >> 1) & 3)) << 4) + (r & 15)
# Thread (warp w, lane = 16 hw + 8 rbit + j) moves the 8x8 blocks (rows r0 = 8 (2 (hw + 2 pass) + rbit),
# dims d0 = 8 (8 w + j)), pass = 0, 1. It loads row r0 + (k ^ 4 rbit) at step k and byte-permutes it by
# dim ^ j, so that store step i writes dim d0 + (i ^ j); the row skew is undone by swapping the output halves.
_TRANSPOSE_SRC = r"""
__device__ __forceinline__ void flashdsa_tr4(unsigned w0, unsigned w1, unsigned w2, unsigned w3,
                                             unsigned &u0, unsigned &u1, unsigned &u2, unsigned &u3) {
  // 4x4 byte transpose: u_i byte k = w_k byte i
  const unsigned t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
  const unsigned t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
  u0 = __byte_perm(t0, t2, 0x5410); u1 = __byte_perm(t0, t2, 0x7632);
  u2 = __byte_perm(t1, t3, 0x5410); u3 = __byte_perm(t1, t3, 0x7632);
}

__device__ __forceinline__ void flashdsa_fp8_vt_transpose(const void *kv_, void *vt_, int tid) {
  const unsigned char *kv = reinterpret_cast<const unsigned char *>(kv_);
  unsigned char *vt = reinterpret_cast<unsigned char *>(vt_);
  const int lane = tid & 31, warp = (tid >> 5) & 7;
  const int j = lane & 7, rbit = (lane >> 3) & 1, hw = lane >> 4;
  const int d0 = (warp * 8 + j) * 8;
  unsigned sel_lo = 0, sel_hi = 0;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    sel_lo |= (unsigned)(p ^ j) << (4 * p);
    sel_hi |= (unsigned)((4 + p) ^ j) << (4 * p);
  }
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r0 = (2 * (hw + 2 * pass) + rbit) * 8;
    unsigned lo[8], hi[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int r = r0 + (k ^ (rbit << 2));
      const int off = (d0 >> 7) * 8192 + r * 128 + ((((d0 >> 4) & 7) ^ (r & 7)) << 4) + (d0 & 8);
      const uint2 v = *reinterpret_cast<const uint2 *>(kv + off);
      lo[k] = __byte_perm(v.x, v.y, sel_lo);
      hi[k] = __byte_perm(v.x, v.y, sel_hi);
    }
    unsigned olo[8], ohi[8];
    flashdsa_tr4(lo[0], lo[1], lo[2], lo[3], olo[0], olo[1], olo[2], olo[3]);
    flashdsa_tr4(hi[0], hi[1], hi[2], hi[3], olo[4], olo[5], olo[6], olo[7]);
    flashdsa_tr4(lo[4], lo[5], lo[6], lo[7], ohi[0], ohi[1], ohi[2], ohi[3]);
    flashdsa_tr4(hi[4], hi[5], hi[6], hi[7], ohi[4], ohi[5], ohi[6], ohi[7]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = d0 + (i ^ j);
      const int off = d * 64 + ((((r0 >> 4) & 3) ^ ((d >> 1) & 3)) << 4) + (r0 & 8);
      uint2 w;
      w.x = rbit ? ohi[i] : olo[i];
      w.y = rbit ? olo[i] : ohi[i];
      *reinterpret_cast<uint2 *>(vt + off) = w;
    }
  }
}

// The transpose, then wgmma.wait_group 0 (the QK wgmmas issued before it have retired).  One call so
// that TileLang's pipeline, which puts the next loads into this stage after the stage's last reader, cannot place
// them between the transpose and the wait; kt_ is that reader's handle on the rope tile (not accessed here).
__device__ __forceinline__ void flashdsa_fp8_vt_transpose_wait(const void *kv_, void *vt_, int tid, const void *kt_) {
  (void)kt_;
  flashdsa_fp8_vt_transpose(kv_, vt_, tid);
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
"""


def build_sparse_mla_fwd_fp8(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
    p_split: bool = True,
    num_stages: int = 2,
):
    """Return the TileLang prim_func.

    Signature: (Q[T,H,Dqk] e4m3, QScale[T,H] f32, KV[Tkv,Dqk] e4m3, KVScale[Tkv] f32, Indices[T,topk] i32,
    TopkLen[n_tl] i32, Sink[n_sink] f32, Out[T,H,d_v] bf16, Lse[T,H] f32, MaxLogits[T,H] f32). Specialised
    on ceil(topk / 64) like kernel_fwd (the indices width is dynamic); TopkLen / Sink are dummies unless
    has_topk_length / has_sink.
    """
    assert dqk in _SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    assert 1 <= heads <= 2 * BLOCK_H
    D = d_v
    D_tail = dqk - d_v
    BH, BI = BLOCK_H, BLOCK_I
    threads = 256  # the transpose helper assumes 256 threads and a 64 x 512 tile
    assert BI == 64 and D == 512
    n_hblk = (heads + BH - 1) // BH

    fp8, bf16, f32, i32 = "float8_e4m3", "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    NI = (int(topk) + BI - 1) // BI
    assert sm_scale is not None and sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    neg_big = tc.NEG_BIG
    sig_min = 1.0e-30  # below this a block's P * kv_scale row max is treated as 0 (keeps 1/u finite)
    _row = tc.make_slot_row(topk_dim)
    load_q, _, store_out, store_lse = tc.padded_head_macros(
        BH=BH, D=D, D_tail=D_tail, dqk=dqk, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=fp8
    )

    @T.prim_func
    def sparse_mla_fwd_fp8(
        Q: T.Tensor([n_tok, heads, dqk], fp8),
        QScale: T.Tensor([n_tok, heads], f32),
        KV: T.Tensor([n_kv, dqk], fp8),
        KVScale: T.Tensor([n_kv], f32),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, n_hblk, threads=threads, prelude=_TRANSPOSE_SRC) as (bx, by):
            Q_s = T.alloc_shared([BH, D], fp8)
            KV_s = T.alloc_shared([BI, D], fp8)
            ks_s = T.alloc_shared([BI], f32)
            Vt_s = T.alloc_shared([D, BI], fp8)
            Phi_s = T.alloc_shared([BH, BI], fp8)
            if p_split:
                Plo_s = T.alloc_shared([BH, BI], fp8)
            O_s = T.alloc_shared([BH, D], bf16)
            if D_tail > 0:
                Qt_s = T.alloc_shared([BH, D_tail], fp8)
                Kt_s = T.alloc_shared([BI, D_tail], fp8)
            else:
                Qt_s = None

            acc_o = T.alloc_fragment([BH, D], f32)
            acc_s = T.alloc_fragment([BH, BI], f32)
            qs = T.alloc_fragment([BH], f32)
            m_i = T.alloc_fragment([BH], f32)
            m_prev = T.alloc_fragment([BH], f32)
            alpha = T.alloc_fragment([BH], f32)
            l_i = T.alloc_fragment([BH], f32)
            l_blk = T.alloc_fragment([BH], f32)
            sig = T.alloc_fragment([BH], f32)
            u_i = T.alloc_fragment([BH], f32)
            u_new = T.alloc_fragment([BH], f32)
            inv = T.alloc_fragment([BH], f32)
            lim = T.alloc_local([1], i32)

            tx = T.get_thread_binding()
            h0 = by * BH
            if has_topk_length:
                lim[0] = T.min(TopkLen[bx], topk_dim)
            else:
                lim[0] = topk_dim

            # ---- Q tile and per-head scales (padded heads -> 0) ----
            load_q(Q, Q_s, Qt_s, bx, h0)
            for h in T.Parallel(BH):
                qs[h] = T.if_then_else(h0 + h < heads, QScale[bx, T.min(h0 + h, heads - 1)], T.float32(0))

            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, neg_big)
            T.fill(u_i, 1)

            for it in T.Pipelined(NI, num_stages=num_stages):
                # ---- gather KV rows and their scales (row -1 past topk_eff: predicated, zero fill) ----
                for r, d in T.Parallel(BI, D):
                    KV_s[r, d] = KV[_row(Indices, bx, lim[0], it * BI + r), d]
                if D_tail > 0:
                    for r, d in T.Parallel(BI, D_tail):
                        Kt_s[r, d] = KV[_row(Indices, bx, lim[0], it * BI + r), D + d]
                for r in T.Parallel(BI):
                    ks_s[r] = KVScale[_row(Indices, bx, lim[0], it * BI + r)]

                # ---- S = Q8 K8^T (fp8 wgmma) ----
                # issued without a wait: they run while the CUDA cores transpose V below
                T.wgmma_gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if D_tail > 0:
                    T.wgmma_gemm(Qt_s, Kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                # ---- V^T for the K-major B operand of the PV wgmma ----
                # After the QK gemm on purpose: TileLang's pipeline derives its cp.async wait from tile-op
                # reads, and the QK gemm is the stage's first reader (wait for the KV group + barrier there;
                # with the transpose first, the generated wait count did not cover the KV group). The
                # access_ptr read mask makes it issue the next loads into this stage after the transpose.
                # The barrier orders the previous block's PV wgmma reads of Vt_s (both warpgroups) before
                # these writes; the fence makes the generic-proxy stores visible to the wgmma (async proxy),
                # the barrier TileLang puts before the PV gemm makes them visible to the other threads.
                T.sync_threads()
                # the QK wgmmas run during the transpose; the wait is inside the call (see the prelude)
                T.call_extern("handle", "flashdsa_fp8_vt_transpose_wait", T.access_ptr(KV_s[0, 0], "r", BI, D),
                              T.access_ptr(Vt_s[0, 0], "w", D, BI), tx,
                              T.access_ptr(Kt_s[0, 0], "r", BI, D_tail) if D_tail > 0 else 0)
                T.warpgroup_fence_operand(acc_s, 0, BH * BI // threads)  # no acc_s read above the wait
                T.fence_proxy_async()

                # ---- scale scores, invalid columns -> -inf ----
                for h, r in T.Parallel(BH, BI):
                    row = _row(Indices, bx, lim[0], it * BI + r)
                    acc_s[h, r] = T.if_then_else(
                        (row >= 0) & (row < n_kv), acc_s[h, r] * qs[h] * ks_s[r], -T.infinity(f32)
                    )

                # ---- online softmax (dequantized-score max, exp2 with folded sm_scale) ----
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for h in T.Parallel(BH):
                    alpha[h] = T.exp2((m_prev[h] - m_i[h]) * c_log2)
                for h, r in T.Parallel(BH, BI):
                    acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_i[h] * c_log2)
                T.reduce_sum(acc_s, l_blk, dim=1)
                # ---- P * kv_scale in per-row units u = row max / P_RANGE ----
                for h, r in T.Parallel(BH, BI):
                    acc_s[h, r] = acc_s[h, r] * ks_s[r]
                T.reduce_max(acc_s, sig, dim=1)
                for h in T.Parallel(BH):
                    u_new[h] = T.if_then_else(sig[h] > sig_min, sig[h] * T.float32(1.0 / P_RANGE), u_i[h])
                    l_i[h] = l_i[h] * alpha[h] + l_blk[h]
                    alpha[h] = alpha[h] * (u_i[h] / u_new[h])  # old accumulator units -> new ones
                    u_i[h] = u_new[h]
                    inv[h] = 1.0 / u_new[h]
                if p_split:
                    for h, r in T.Parallel(BH, BI):
                        Phi_s[h, r] = T.cast(acc_s[h, r] * inv[h], fp8)
                        Plo_s[h, r] = T.cast(acc_s[h, r] * inv[h] - T.cast(T.cast(acc_s[h, r] * inv[h], fp8), f32),
                                             fp8)
                else:
                    for h, r in T.Parallel(BH, BI):
                        Phi_s[h, r] = T.cast(acc_s[h, r] * inv[h], fp8)
                for h, d in T.Parallel(BH, D):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.gemm(Phi_s, Vt_s, acc_o, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if p_split:
                    T.gemm(Plo_s, Vt_s, acc_o, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

            # ---- epilogue: out = acc_o * u / l (sink folded into the normaliser as in kernel_fwd) ----
            for h in T.Parallel(BH):
                if has_sink:
                    inv[h] = T.if_then_else(
                        l_i[h] > 0,
                        u_i[h] / (l_i[h] + T.exp2(tc.sink_exponent(Sink[T.min(h0 + h, heads - 1)], m_i[h], c_log2))),
                        T.float32(0),
                    )
                else:
                    inv[h] = T.if_then_else(l_i[h] > 0, u_i[h] / l_i[h], T.float32(0))
            store_out(acc_o, inv, O_s, Out, bx, h0)
            store_lse(l_i, m_i, Lse, MaxLogits, bx, h0)

    return sparse_mla_fwd_fp8


def _pass_configs():
    return plain_pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads, dqk, d_v, n_blocks, sm_scale, has_sink, has_topk_length, p_split=True):
    func = build_sparse_mla_fwd_fp8(
        heads=heads, dqk=dqk, d_v=d_v, topk=n_blocks * BLOCK_I, sm_scale=sm_scale, has_sink=has_sink,
        has_topk_length=has_topk_length, p_split=p_split,
    )
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, q_scale, kv_scale, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only)."""
    tensors = (q, kv, indices, q_scale, kv_scale)
    if any(x is None for x in tensors):
        return "q_scale and kv_scale are required"
    if not all(x.is_cuda for x in tensors):
        return "tensors must be on CUDA"
    if q.dtype != torch.float8_e4m3fn or kv.dtype != torch.float8_e4m3fn:
        return "q and kv must be float8_e4m3fn"
    if q_scale.dtype != torch.float32 or kv_scale.dtype != torch.float32:
        return "q_scale and kv_scale must be float32"
    if indices.dtype != torch.int32:
        return "indices must be int32"
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        return "expected q [T,H,Dqk], kv [Tkv,Dqk], indices [T,topk]"
    n_tok, heads, _ = q.shape
    if q_scale.shape != (n_tok, heads) or kv_scale.shape != (kv.shape[0],):
        return "expected q_scale [T,H] and kv_scale [Tkv]"
    return tc.check_fwd_shapes(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)


def run_sparse_mla_fwd_fp8(q, kv, indices, *, q_scale, kv_scale, sm_scale: float, d_v: int, topk_length=None,
                           attn_sink=None, p_split: bool = True, pair: bool | None = None):
    """Returns (out [T,H,d_v] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32) of the forward on
    q * q_scale[..., None], kv * kv_scale[:, None]. ``p_split=False``: one e4m3 P (faster, ~3 % rms error).
    ``pair`` (None: whenever H is 64 or 128 and ``p_split``): run ``kernel_fwd_pair_fp8`` (the pair schedule)."""
    from . import kernel_fwd_pair_fp8

    reason = kernel_unsupported(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=d_v,
                                topk_length=topk_length, attn_sink=attn_sink)
    if reason is not None:
        raise ValueError(f"sparse_mla fp8 fwd kernel: {reason}")
    if pair is None:
        pair = q.shape[1] in kernel_fwd_pair_fp8.SUPPORTED_H and p_split
    if pair:  # checked above; the pair kernel's own rule adds only the head count
        return kernel_fwd_pair_fp8.run_sparse_mla_fwd_fp8(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale,
                                                          sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                                                          attn_sink=attn_sink,
                                                          checked=q.shape[1] in kernel_fwd_pair_fp8.SUPPORTED_H)
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v)
    if done:
        return out, lse, max_logits
    _, heads, dqk = q.shape
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    kernel = _compiled(heads, dqk, d_v, n_blocks, float(sm_scale), has_sink, has_tl, bool(p_split))
    kernel(aligned(q), aligned(q_scale), aligned(kv), aligned(kv_scale), aligned(indices),
           tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """One representative configuration for the CPU lowering test (Dqk 576, H 128, sink, topk_length)."""
    return [(
        "h128_d576_topk2048_sink_tl",
        build_sparse_mla_fwd_fp8(heads=128, dqk=576, d_v=D_V, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                 has_topk_length=True),
    )]
