"""Exact per-row top-k by radix select over several CTAs per row (long rows, few rows), in TileLang for Hopper.

Notes
-----
Why: ``kernel_radix`` runs one CTA per row, so 16 x 131072 uses 16 of 132 SMs and 1 x 1048576 uses one (measured
187 us and 1129 us on the H200, torch.topk 117 / 150 us).  Here each row is cut into ``G`` contiguous slices, one
CTA per slice (grid ``(G, M)``), and the radix passes of ``kernel_radix`` are run with global histograms.

Algorithm (one prim_func ``topk_radix_multi``, launched 4 times on the same stream with ``Pass`` = 0, 1, 2, 3;
the kernel boundaries are the grid-wide barriers; no host synchronisation, so it is CUDA-graph capturable):
  * Keys, digits (11/11/10 bits), the threshold rule (``g < k_rem <= g + hist[d]``), early stops (``total <= k``
    after pass 0, or the whole bucket taken), the masked threshold (``mask``, ``prefix``, ``need``) and the output
    formula are exactly those of ``kernel_radix`` (same ``to_key``).
  * Slices: row range ``[lo, hi)`` (starts/ends clamped as in ``kernel_radix``), ``n = hi - lo``,
    ``chunk = ceil(ceil(n / G) / 32) * 32``; CTA ``g`` owns row positions ``[g*chunk, (g+1)*chunk) & [0, n)``
    (possibly empty).
  * Workspace: ``Hist [M, 3*2048]`` int32, zeroed by the host (``torch.zeros``, one memset) and
    ``Part [M, G, 3, 2049]`` int32 (no zeroing needed: an entry is read only if the launch that writes it did work).
  * Launch ``Pass = p`` (p = 0, 1, 2): every CTA first re-derives the threshold state after levels ``0..p-1`` from
    ``Hist`` (redundantly, identical in every CTA: copy ``Hist[m, q]`` to shared memory, the block suffix scan of
    ``kernel_radix``).  If the selection is already decided it exits.  Otherwise it sweeps its slice once
    (global / L2 reads, no key cache): keys matching the prefix go to a 2048-bin shared histogram (shared atomics),
    and ``A`` = number of keys already *above* the prefix (``key & mask > prefix``) is counted.  Then the non-zero
    bins are added to ``Hist[m, p]`` (global int32 atomics: integer sums, so deterministic) and the CTA writes its
    own suffix counts ``Part[m, g, p, b] = A + sum_{b' >= b} hist[b']`` (``b = 2048`` gives ``A``).
  * Launch ``Pass = 3`` (write): the state after all levels is derived the same way (final level ``lev`` with
    digit ``dsel``, or ``lev = -1`` when ``total <= k``: everything valid is taken).  For that threshold the
    counts of CTA ``g'`` are  above(g') = ``Part[m, g', lev, dsel + 1]``  and
    tied(g') = ``Part[m, g', lev, dsel] - Part[m, g', lev, dsel + 1]``  (``lev = -1``: above 0, tied
    ``Part[m, g', 0, 0]`` = its valid count).  CTA ``g`` sums them over ``g' < g`` (exclusive scan over CTAs,
    each CTA reading the lower CTAs' entries), then runs ``kernel_radix``'s write unchanged on its slice (per-warp
    segments, sweep A counts, block exclusive scan, sweep B with ballot/popc ranks) with those global bases.
    Output slot = (#above before it in the row) + min(#tied before it in the row, need): ascending position order,
    ties at the threshold to the lowest positions -- the same result as ``kernel_radix`` and the reference.
    Slots ``[k_eff, k)`` get -1 (spread over the row's CTAs).
  * ``order="score"`` is not supported here (``kernel_radix`` or the reference handle it).
Cost per call: 1 memset + 4 launches; the slice is read from global memory 5 times at most (passes 0-2 and the
  write's 2 sweeps; 1 x 1048576 is 4 MiB, L2 resident after pass 0); each CTA scans <= 3 global histograms per
  launch and reads <= 2 Part entries per lower CTA in the write.
Routing (``use_multi``; pure shape rule): G = min(floor(SMs / M), N // 4096) (one wave: the 1024-thread CTA holds
  a whole SM, 64 registers/thread); the multi path is used when G >= 4 (and order != "score").  On 132 SMs:
  1 x 1048576 -> G = 132, 16 x 131072 -> 8, 3 x 40000 -> 9, 64 x 32768 -> 2 (stays on ``kernel_radix``),
  M > 33 or N < 16384 never.
Expected on the H200 (estimates, not measured): each launch ~3-6 us (launch gap + <= 32 KiB slice per CTA):
  1 x 1048576 ~ 20-35 us, 16 x 131072 ~ 20-35 us GPU time; host side 4 TileLang calls + 3 allocations + 1 memset
  (the benchmark's L2-flush fill before each call hides most of it; a CUDA graph removes it).
  ``python -m flashdsa.topk.kernel_radix_multi`` prints one-CTA vs multi vs multi-in-a-graph vs torch.topk.
Registers: 64/thread, no spills (ptxas -v, CUDA 13.0, sm_90a, 1024 threads); shared memory ~8.5 KiB.
Verified on CPU only (never run on a GPU by the author):
  * ``emulate_multi`` (numpy model of these launches, slices, Part entries, bases, warp segments and ballot ranks)
    equals ``topk_indices_reference`` on 968 cases (M 1-16, N 1..1048576, k 1..N+1, G 1..132, ties / all-equal /
    NaN / -inf / signed zeros / values sharing 22 key bits, starts/ends incl. empty and clamped; every final level
    -1, 0, 1, 2 hit).
  * The lowered CUDA source itself, compiled for the CPU with a mock runtime (one OS thread per CUDA thread,
    barriers for __syncthreads / shfl / ballot / warp_reduce_sum, CTAs of each launch in a random order, shared
    memory refilled with garbage per CTA, Part poisoned, strided rows): equal to the reference on 200 random cases
    (256-thread build), 30 (1024-thread build, the shipped one) and 12 benchmark-shape cases (1 x 1048576 with
    G = 132, 16 x 131072 with G = 8, 3 x 40000; full rows and starts/ends).  The same harness catches a seeded
    off-by-one in the CTA bases.
  * ``lowering_cases()`` lowers for sm_90a; the source compiles with nvcc -arch=sm_90a.
Risks for the first GPU run: the 2-D grid ``(G, M)`` with G bound from ``Part.shape[1]``; the scalar ``Pass``
  argument; TileLang picking up torch's current stream under CUDA-graph capture (``test_multi_cuda_graph_capture``).
"""

import functools

import torch

from ._tl_radix import _DMASKS, _SHIFTS, _UNROLL, HBINS, Ix, _pass_configs, alloc_vars, dmask_expr  # noqa: F401
from ._tl_radix import dynamic_dims, new_output, radix_macros, range_args, shift_expr, sm_count, to_key_expr

MIN_PER_CTA = 4096  # elements per CTA at least
MIN_GROUPS = 4  # use the multi-CTA path only when a row gets at least this many CTAs
PSTRIDE = HBINS + 1  # Part row: suffix counts of 2048 bins, then A
THREADS = 1024


_sm_count = sm_count


def pick_groups(M: int, N: int, sms: int = 132) -> int:
    """CTAs per row: at most one wave (1024-thread CTAs, 1 per SM: M * G <= SMs), >= MIN_PER_CTA elements each."""
    return max(1, min(sms // max(1, M), N // MIN_PER_CTA))


def use_multi(M: int, N: int, order: str = "index", sms: int = 132) -> bool:
    """The routing rule (shapes only): multi-CTA iff order != "score" and pick_groups(M, N) >= MIN_GROUPS."""
    return order != "score" and M >= 1 and pick_groups(M, N, sms) >= MIN_GROUPS


def _build_topk_radix_multi(*, threads: int = THREADS):
    """Scores [M, N] f32 (row stride SM), Starts [NS], Ends [NE], Hist [M, 3*2048], Part [M, G, 3, 2049], Out [M, K],
    Flags (bit 0 starts given, bit 1 ends given), Pass (0, 1, 2: histogram passes; 3: write)."""
    import tilelang.language as T

    NT = threads
    assert NT % 32 == 0 and HBINS % NT == 0 and NT <= 1024
    W = NT // 32
    BPT = HBINS // NT
    U = _UNROLL

    M, N, K, G, NS, NE, SM = dynamic_dims("M", "N", "K", "G", "NS", "NE", "SM")
    u32, i32 = "uint32", "int32"
    to_key = to_key_expr
    R = radix_macros(NT)

    @T.prim_func
    def topk_radix_multi(
        Scores: T.StridedTensor((M, N), (SM, 1), "float32"),
        Starts: T.Tensor((NS,), i32),
        Ends: T.Tensor((NE,), i32),
        Hist: T.Tensor((M, 3 * HBINS), i32),
        Part: T.Tensor((M, G, 3, PSTRIDE), i32),
        Out: T.Tensor((M, K), i32),
        Flags: T.int32,
        Pass: T.int32,
    ):
        with T.Kernel(G, M, threads=NT) as (gx, by):
            tx = T.get_thread_binding()
            hist = T.alloc_shared((HBINS,), i32)
            wred = T.alloc_shared((2, W), i32)
            sel = T.alloc_shared((4,), i32)

            lane = tx % 32
            warp = tx // 32
            lo, hi, n, cs, ln, chunk, total, kef, krem, need, done, lev, dsel = alloc_vars(i32, 13)
            prefix, mask = alloc_vars(u32, 2)
            x, s, g, a = alloc_vars(i32, 4)
            kk = T.alloc_var(u32)
            cgt, ceq = alloc_vars(i32, 2)
            fv = T.alloc_local((U,), "float32")
            shift, dmask = alloc_vars(u32, 2)
            pos, h1 = alloc_vars(i32, 2)
            f1 = T.alloc_var("float32")

            R.row_range(lo, hi, n, Starts, Ends, Flags, N, Ix(row=by))
            R.cta_slice(G, n, chunk, cs, ln, None, Ix(gx=gx))

            # ---- threshold state after the levels decided by earlier launches (same in every CTA) ----
            R.init_threshold(K, prefix, mask, done, krem, kef, need, lev, dsel)
            for p in T.unroll(3):
                if done == 0 and p < Pass:
                    shift = shift_expr(p)
                    dmask = dmask_expr(p)
                    for b in T.serial(BPT):
                        hist[tx * BPT + b] = Hist[by, p * HBINS + tx * BPT + b]
                    T.sync_threads()
                    R.choose_digit(p, K, tx, lane, warp, hist, wred, sel, s, x, g, total, kef, krem, need, done, prefix,
                                   mask, shift, dmask, lev, dsel, True)
                    T.sync_threads()

            if Pass < 3:
                if done == 0:
                    # ---- histogram pass `Pass` over this CTA's slice ----
                    shift = shift_expr(Pass)
                    dmask = dmask_expr(Pass)
                    for b in T.serial(BPT):
                        hist[tx * BPT + b] = 0
                    T.sync_threads()
                    a = 0
                    for j in T.serial(T.ceildiv(ln, NT * U)):
                        for u in T.unroll(U):
                            fv[u] = T.float32(0)
                            if (j * U + u) * NT + tx < ln:
                                fv[u] = Scores[by, lo + cs + (j * U + u) * NT + tx]
                        for u in T.unroll(U):
                            if (j * U + u) * NT + tx < ln:
                                kk = to_key(fv[u])
                                if (kk & mask) > prefix:
                                    a = a + 1
                                elif kk != T.uint32(0) and (kk & mask) == prefix:
                                    T.atomic_add(hist[T.Cast(i32, (kk >> shift) & dmask)], 1)
                    T.sync_threads()
                    # publish: global histogram (atomics) and this CTA's suffix counts
                    R.publish(tx, lane, warp, hist, wred, Hist, Part, s, x, g, a, Ix(row=by, gx=gx, lvl=Pass))
            else:
                # ---- write: bases from the lower CTAs of the row, then kernel_radix's write on the slice ----
                cgt = 0
                ceq = 0
                for j in T.serial(T.ceildiv(gx, NT)):
                    if j * NT + tx < gx:
                        if lev < 0:
                            ceq = ceq + Part[by, j * NT + tx, 0, 0]
                        else:
                            h1 = Part[by, j * NT + tx, lev, dsel + 1]
                            cgt = cgt + h1
                            ceq = ceq + Part[by, j * NT + tx, lev, dsel] - h1
                R.warp_totals(cgt, ceq, wred, lane, warp)
                a = 0  # above in lower CTAs
                h1 = 0  # tied in lower CTAs
                for w2 in T.serial(W):
                    a = a + wred[0, w2]
                    h1 = h1 + wred[1, w2]
                T.sync_threads()

                seg = T.ceildiv(T.ceildiv(ln, W), 32) * 32
                R.count_sweep(seg, lane, warp, ln, kk, f1, pos, cgt, ceq, mask, prefix, wred, None, Scores,
                              Ix(row=by, base=lo + cs, cnt0=a, tie0=h1))
                T.sync_threads()
                R.write_sweep(seg, lane, warp, ln, kk, f1, pos, cgt, ceq, mask, prefix, x, s, need, None, Scores, Out,
                              None, Ix(row=by, base=lo + cs))
                R.fill_tail(K, G, tx, kef, Out, Ix(row=by, gx=gx))

    return topk_radix_multi


@functools.lru_cache(maxsize=4)
def _compiled(threads: int):
    import tilelang

    func = _build_topk_radix_multi(threads=threads)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def run_topk_indices_multi(scores, k, starts=None, ends=None, groups=None) -> torch.Tensor:
    """order="index" top-k with ``groups`` CTAs per row (default ``pick_groups``).  Arguments as validated by
    ``kernel_radix.kernel_unsupported`` (call that first); no host synchronisation."""
    M, N = scores.shape
    dev = scores.device
    out, scores = new_output(scores, k)
    if scores is None:  # M == 0 or N == 0
        return out
    G = int(groups) if groups is not None else pick_groups(M, N, _sm_count(dev.index or 0))
    if not 1 <= G <= 2**16 - 1 or M > 2**16 - 1:
        raise ValueError(f"multi-CTA top-k: grid (groups={G}, M={M}) must fit in [1, 65535] x [1, 65535]")
    st, en, flags = range_args(starts, ends, dev, fresh_dummy=True)
    hist = torch.zeros((M, 3 * HBINS), dtype=torch.int32, device=dev)
    part = torch.empty((M, G, 3, PSTRIDE), dtype=torch.int32, device=dev)
    kernel = _compiled(THREADS)
    for p in range(4):
        kernel(scores, st, en, hist, part, out, flags, p)
    return out


EXPECTS_WGMMA = False


def lowering_cases():
    """One prim_func serves every shape, flag and pass."""
    return [(f"t{THREADS}_index", _build_topk_radix_multi(threads=THREADS))]


# ------------------------------------------------------------------------------------------------------------------
# CPU model of exactly the launches above (for checking the schedule without a GPU)


def _keys_np(x):
    import numpy as np

    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    a = b & np.uint32(0x7FFFFFFF)
    k = np.where(a == 0, np.uint32(0x80000000), np.where(b >= np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)))
    bad = (a > np.uint32(0x7F800000)) | (b == np.uint32(0xFF800000))
    return np.where(bad, np.uint32(0), k).astype(np.uint32)


def _state_np(H, levels, K):
    """Threshold state after ``levels`` histogram levels (the per-CTA scan of the kernel)."""
    import numpy as np

    prefix = mask = 0
    done, krem, kef, need, lev, dsel = 0, K, K, 0, -1, 0
    for p in range(3):
        if done or p >= levels:
            continue
        h = H[p].astype(np.int64)
        total = int(h.sum())
        if p == 0:
            kef = min(K, total)
            krem = kef
        if p == 0 and total <= K:
            done, need = 1, total
            continue
        suf = np.concatenate([np.cumsum(h[::-1])[::-1][1:], [0]])  # count of larger digits
        hits = np.nonzero((suf < krem) & (krem <= suf + h))[0]
        assert len(hits) == 1
        d = int(hits[0])
        krem -= int(suf[d])
        prefix |= d << _SHIFTS[p]
        mask |= _DMASKS[p] << _SHIFTS[p]
        need, lev, dsel = krem, p, d
        if int(h[d]) == krem or p == 2:
            done = 1
    return prefix, mask, done, kef, need, lev, dsel


def emulate_multi(scores, k, starts=None, ends=None, groups=4, threads=THREADS):
    """numpy model of ``run_topk_indices_multi`` (same slices, launches, Part entries, bases, warp segments and
    ballot ranks); returns [M, k] int32 numpy."""
    import numpy as np

    x = np.asarray(scores, dtype=np.float32)
    M, N = x.shape
    G, W = groups, threads // 32
    out = np.full((M, k), 0x5A5A5A5A, dtype=np.int64)
    for m in range(M):
        lo, hi = 0, N
        if starts is not None:
            lo = max(min(int(starts[m]), N), 0)
        if ends is not None:
            hi = max(min(int(ends[m]), N), 0)
        n = max(hi - lo, 0)
        keys = _keys_np(x[m, lo:lo + n]) if n > 0 else np.zeros(0, np.uint32)
        chunk = -(-(-(-n // G)) // 32) * 32
        sl = []
        for g in range(G):
            cs = min(g * chunk, n)
            sl.append((cs, min(cs + chunk, n)))
        H = np.zeros((3, HBINS), np.int64)
        Part = np.full((G, 3, PSTRIDE), -(10**9), np.int64)  # poison: unwritten entries must never be read
        for P in range(3):
            prefix, mask, done, *_ = _state_np(H, P, k)
            if done:
                continue
            newH = np.zeros(HBINS, np.int64)
            for g in range(G):
                sub = keys[sl[g][0]:sl[g][1]].astype(np.int64)
                above = (sub & mask) > prefix
                match = (sub != 0) & ((sub & mask) == prefix) & ~above
                A = int(above.sum())
                h = np.bincount((sub[match] >> _SHIFTS[P]) & _DMASKS[P], minlength=HBINS)
                newH += h
                Part[g, P, :HBINS] = A + np.cumsum(h[::-1])[::-1]
                Part[g, P, HBINS] = A
            H[P] = newH  # all atomics of the launch land before the next launch
        prefix, mask, done, kef, need, lev, dsel = _state_np(H, 3, k)
        assert done
        for g in range(G):
            cs, ce = sl[g]
            ln = ce - cs
            if lev < 0:
                ab, tb = 0, int(sum(Part[g2, 0, 0] for g2 in range(g)))
            else:
                ab = int(sum(Part[g2, lev, dsel + 1] for g2 in range(g)))
                tb = int(sum(Part[g2, lev, dsel] - Part[g2, lev, dsel + 1] for g2 in range(g)))
            assert ab >= 0 and tb >= 0
            sub = keys[cs:ce].astype(np.int64)
            seg = -(-(-(-ln // W)) // 32) * 32
            isg = (sub & mask) > prefix
            ise = (sub != 0) & ((sub & mask) == prefix) & ~isg
            wg = [int(isg[w * seg:(w + 1) * seg].sum()) for w in range(W)]
            we = [int(ise[w * seg:(w + 1) * seg].sum()) for w in range(W)]
            for w in range(W):
                # sweep B of warp w: ballot/popc ranks over consecutive 32-element chunks == exclusive prefix counts
                a0, a1 = min(w * seg, ln), min((w + 1) * seg, ln)
                bg, be = isg[a0:a1], ise[a0:a1]
                rg = ab + sum(wg[:w]) + np.cumsum(bg) - bg
                re_ = tb + sum(we[:w]) + np.cumsum(be) - be
                take = bg | (be & (re_ < need))
                slot = rg + np.minimum(re_, need)
                assert ((slot[take] >= 0) & (slot[take] < kef)).all()
                out[m, slot[take]] = lo + cs + a0 + np.nonzero(take)[0]
        # leftover slots: idx = (j*G + g)*threads + t over j, g, t enumerates [0, ceil(k / (G*threads))*G*threads) once
        out[m, kef:] = -1
    assert not (out == 0x5A5A5A5A).any(), "a slot was never written"
    return out.astype(np.int32)


def _bench_main():  # pragma: no cover - GPU only
    """``python -m flashdsa.topk.kernel_radix_multi``: one-CTA vs multi-CTA vs torch.topk on the benchmark shapes
    (k=2048, order="index"; L2 flushed before each call; median of 20 calls, us), plus the multi path replayed
    from a CUDA graph (no host launch overhead), and a check that both kernels agree."""
    from . import kernel_radix

    dev = torch.device("cuda")
    sms = _sm_count(0)
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device=dev)

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        ts = []
        for i in range(reps):
            flush.fill_(i)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return sorted(ts)[len(ts) // 2]

    print(f"SMs {sms}; rule: multi iff min(SMs // M, N // {MIN_PER_CTA}) >= {MIN_GROUPS}")
    for M, N in [(64, 32768), (4096, 8192), (16, 131072), (1, 1048576), (3, 40000), (32, 65536)]:
        x = torch.randn(M, N, device=dev)
        k = 2048
        G = pick_groups(M, N, sms)
        row = {"routed": "multi" if use_multi(M, N, "index", sms) else "single", "G": G}
        one = kernel_radix.run_topk_indices(x, k, multi=False)
        row["single_us"] = round(timed(lambda: kernel_radix.run_topk_indices(x, k, multi=False)), 1)
        if G >= 2:
            mul = run_topk_indices_multi(x, k)
            row["multi_equal"] = bool(torch.equal(one, mul))
            row["multi_us"] = round(timed(lambda: run_topk_indices_multi(x, k)), 1)
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run_topk_indices_multi(x, k)
                row["multi_graph_us"] = round(timed(g.replay), 1)
            except Exception as e:  # noqa: BLE001 - report and go on
                row["multi_graph_us"] = f"capture failed: {type(e).__name__}: {e}"[:200]
        row["torch_topk_us"] = round(timed(lambda: torch.topk(x, k, dim=-1)), 1)
        print(f"{M} x {N}:", row, flush=True)


if __name__ == "__main__":  # pragma: no cover
    _bench_main()
