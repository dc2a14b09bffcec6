"""Exact per-row top-k by radix select, in TileLang for Hopper (one CTA per row).

Notes
-----
Algorithm (kernel ``topk_radix``; grid ``M``, one CTA of ``threads`` threads per row):
  * Keys.  Each float32 score becomes an order-preserving uint32 key with pure integer ops (safe under fast
    math): positives ``bits | 0x80000000``, negatives ``~bits``, +0.0 and -0.0 both ``0x80000000`` (they tie,
    as in the stable-sort reference).  NaN (either sign), -inf and positions outside ``[starts[m], ends[m])``
    get key 0, which is never selected (every finite score has a key >= 0x00800000).
  * Radix select, 3 histogram passes of 11/11/10 bits over the keys (2048-bin int32 histogram in shared
    memory, shared-memory atomics).  After pass 0 the row's valid count ``total`` is known and
    ``k_eff = min(k, total)``; if ``total <= k`` every valid element is taken (no further pass).  Each pass
    restricts to keys whose already-decided high bits equal ``prefix`` and picks the digit ``d`` where the
    count of larger digits ``g`` satisfies ``g < k_rem <= g + hist[d]`` (a block suffix scan: each thread owns
    2048/threads contiguous bins, warp shuffles + one row of 32 warp totals).  If the whole bucket is taken
    (``hist[d] == k_rem``) the remaining passes are skipped.  The result is a masked threshold
    (``mask``, ``prefix``) and ``need`` = how many keys equal to it (under the mask) to take.
  * Write (deterministic, no atomics): element i is *above* if ``key & mask > prefix`` and *tied* if
    ``key != 0 and key & mask == prefix``; all above are taken and the ``need`` tied ones with the lowest
    positions.  The row is cut into one contiguous segment per warp; sweep A counts above/tied per warp,
    a block exclusive scan of the 32 warp counts gives each warp its base, sweep B re-reads its segment
    (lane-consecutive, coalesced) and ranks with ``__ballot_sync`` + ``popc``.  Output slot of a taken
    element = (#above before it) + min(#tied before it, need): this is ascending position order, so
    ``order="index"`` needs no sort.  Slots ``[k_eff, k)`` get -1.  No candidate buffer exists, so
    all-equal rows, rows of -inf/NaN and heavy ties are exact and in bounds by construction.
  * ``order="score"`` (k <= 4096): sweep B writes ``(key << 32) | ~pos`` (uint64) into a shared buffer of
    ``sort_cap`` in {256, 2048, 4096} slots (padding 0), a block bitonic sort orders it descending (score desc,
    ties ascending position; the composite is unique so the unstable sort is exact), then the positions are
    written out.  k > 4096 with order="score": ``kernel_unsupported`` says so and the dispatcher falls back.
  * Shared-memory key cache: variants with ``cache > 0`` convert the row once into ``cache`` uint32 keys in
    shared memory during pass 0 (fused with the first histogram); later passes and both sweeps read shared
    memory.  ``cache == 0`` re-reads global memory (L2) in every pass: up to 5 reads of the row.
  * starts/ends: clamped to [0, N]; start >= end is an empty row.  Whether each is given is a runtime ``Flags``
    scalar (bit 0 starts, bit 1 ends), so one compile serves every combination.  The row stride is a dynamic
    symbol (``StridedTensor``): strided rows are read in place.  M, N, K and the stride are dynamic.
Passes per row: 1 global read (pass 0) + up to 2 histogram passes + 2 write sweeps (smem, or L2 without the
  cache) + a bitonic sort (score only).  About 9 __syncthreads per row (index), plus log2(cap)^2/2 for score.
Shared memory: hist 8 KiB + keys 4*cache (32 KiB for 8192, 128 KiB for 32768) + sort 8*sort_cap (<= 32 KiB).
Variants (``pick_config``): N <= 8192 -> cache 8192, 256 threads (was 512: 38 regs, 3 CTAs/SM);
  N <= 32768 -> cache 32768, 1024 threads (56 regs); longer -> no cache, 1024 threads (62 regs).  No spills
  (ptxas -v on the lowered source, CUDA 13.0, sm_90a).  Compiles: at most 3 variants x (index + 3 caps) = 12.
Expected time on H200 (estimates, not measured): 64 x 32768 ~ 15-25 us (64 CTAs, HBM read once);
  4096 x 8192 ~ 80-150 us (HBM ~30 us + smem passes per row); 16 x 131072 ~ 40-70 us (only 16 CTAs, L2
  re-reads of 512 KiB x 5 per SM); 1 x 1048576 ~ 150-250 us with one CTA: MISSES the 60 us target.
  Measured (benchmarks/results/2026-11-30_h200_9301580b_topk.json): 50 / 189 / 187 / 1129 us for
  64 x 32768 / 4096 x 8192 / 16 x 131072 / 1 x 1048576.
Routing (``pick_impl``, shapes only; order="score" always stays here): "persist" (``kernel_radix_persist``: G CTAs
  per row in ONE launch with row barriers and the slice cached in shared memory) when its G >= 4 (16 x 131072,
  1 x 1048576); else "multi4" (``kernel_radix_multi``, 4 launches; rows too long for the persistent cache);
  else "regs" (``kernel_radix_regs``, the row's keys in registers) for rows <= 8192 with order "index"/"any"
  (4096 x 8192: 145.7 us in the suite at 9714aac); else this kernel (64 x 32768; order="score").
  ``run_topk_indices(impl=...)`` forces a path.
Pass-0 loads in flight (``pick_u0``): 16 per thread for 512 threads / 8192 keys (the whole row in one round),
  8 for 1024 threads / 32768 keys; ``u0=4`` is the original schedule.
Candidate compaction (``cand=True``, off by default): after pass 0 the threshold bucket's positions (at most
  ``cand_cap_for(cache)``, else the original full passes) are compacted into shared memory; passes 1-2 and the
  per-warp counts then read only them, so the row is swept 3 times instead of 5.  Exact, but measured slower
  (4096 x 8192: 197.7 vs 185.6 us): the full-row sweeps are not what limits this kernel.
Measured after this change (H200, k 2048, ``scripts/bench_topk.py``, median of 30, L2 flushed; kernel call /
  through ``flashdsa.topk_indices`` / torch.topk): 64 x 32768 31.0 / 30.6 / 114 us; 4096 x 8192 186 / 186 /
  742 us at 512 threads, 169 us at 256 (misses 150); 16 x 131072 34.0 / 33.9 / 119 us (persist);
  1 x 1048576 28.4 / 32.5 / 153 us (persist).  ncu on 4096 x 8192 (512 threads): SM throughput 83%, DRAM 18%,
  occupancy 3 CTAs/SM (registers and shared memory): issue-bound, so fewer instructions per element is what is
  left (64-bit index math on shared-memory addresses, per-statement bounds checks, 5 sweeps over the row).
Verified (CPU only; never run on a GPU by the author): every ``lowering_cases()`` variant lowers for sm_90a
  (7-20 s each on a loaded 2-core box, with and without ``_pass_configs()``) and its source compiles with
  nvcc -arch=sm_90a without spills.  A numpy model of exactly this algorithm (same key map, passes, digit
  choice, per-warp segments and ballot ranks, score composite) matched ``topk_indices_reference`` bit for bit
  on 600 cases (N 1..33000, k 1/64/2048, random / ties / all-equal / +-inf and +-NaN / signed zeros and
  subnormals, random ranges incl. empty and clamped, both orders, 512 and 1024 threads).
Risks for the first GPU run:
  * ``TL_DISABLE_THREAD_STORAGE_SYNC`` is set: every __syncthreads is explicit; a missing one shows as
    nondeterministic output (the 5-run determinism test catches it).  ``TL_DISABLE_SHARED_MEMORY_REUSE`` is
    set because the planner otherwise aliased the sort buffer with the warp-total buffer across a race window.
  * ``__ballot_sync`` is emitted inside a loop whose trip count is block-uniform; the bounds guard only wraps
    the key load, so all lanes reach the ballot.
  * Dynamic shared memory > 48 KiB (cache 32768: 136-168 KiB) relies on TileLang setting the attribute.
  * ``Flags`` is a scalar ``T.int32`` kernel parameter: check that ``kernel(s, st, en, out, flags)`` binds it.
  * Histogram atomics on random normal data hit ~40 hot bins in pass 0 (contention, not correctness).
"""

import functools

import torch

# (HBINS, _SHIFTS, _DMASKS, _UNROLL, _pass_configs, to_key_expr: also re-exported from here, their old home)
from ._tl_radix import _DMASKS, _SHIFTS, _UNROLL, HBINS, Ix, _pass_configs, dmask_expr, dynamic_dims  # noqa: F401
from ._tl_radix import new_output, radix_macros, range_args, shift_expr, to_key_expr

MAX_SCORE_K = 4096  # order="score" sorts k_eff entries in shared memory


def _next_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def _sort_cap(k: int) -> int:
    """Shared-memory sort slots for order="score": few sizes, so few compiles."""
    for cap in (256, 2048, MAX_SCORE_K):
        if k <= cap:
            return cap
    raise ValueError(f"k={k} > {MAX_SCORE_K}")


def pick_config(n: int) -> tuple[int, int]:
    """(threads, cache) for rows of length n.  N <= 8192: 256 threads (measured on 4096 x 8192: 169 / 186 / 334 us
    at 256 / 512 / 1024 threads; the kernel is issue-bound (ncu: SM 83%, DRAM 18%) and 256-thread CTAs fit 5 per
    SM instead of 3, with half the barrier width)."""
    if n <= 8192:
        return 256, 8192
    if n <= 32768:
        return 1024, 32768
    return 1024, 0


def _build_topk_radix(*, threads: int = 1024, cache: int = 0, sort_cap: int = 0, cand_cap: int = 0, u0: int = 0,
                      min_ctas: int = 0, lean: bool = False):
    """TileLang prim_func: Scores [M, N] f32 (row stride SM), Starts [NS] i32, Ends [NE] i32, Out [M, K] i32, Flags.

    ``Flags`` bit 0: Starts is given, bit 1: Ends is given (else the dummy tensor is never read).
    ``sort_cap`` 0 means order="index"; otherwise order="score" with K <= sort_cap (a power of two).
    ``cand_cap`` > 0 (needs ``cache``): candidate compaction after pass 0 when the threshold bucket holds at most
    ``cand_cap`` keys (see the module notes); 0 is the original schedule.
    ``u0``: loads in flight per thread in pass 0 (the only global read with a cache); 0 = ``_UNROLL``.
    ``min_ctas`` > 0: ``__launch_bounds__`` minimum CTAs per SM (caps the registers).  ``lean``: histogram zeroing
    in a bank-conflict-free order and 32-bit ballot ranks in the write sweep (fewer instructions per element).
    """
    import tilelang.language as T

    NT = threads
    assert NT % 32 == 0 and HBINS % NT == 0 and NT <= 1024
    W = NT // 32
    BPT = HBINS // NT
    score = sort_cap > 0
    assert cand_cap == 0 or cache > 0
    if score:
        assert sort_cap & (sort_cap - 1) == 0 and sort_cap >= 2
        LOG_CAP = sort_cap.bit_length() - 1
        HALF = sort_cap // 2
    U = _UNROLL
    U0 = u0 if u0 > 0 else U

    M, N, K, NS, NE, SM = dynamic_dims("M", "N", "K", "NS", "NE", "SM")
    u32, i32, u64 = "uint32", "int32", "uint64"

    to_key = to_key_expr
    R = radix_macros(NT, lean_ranks=lean)
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    @T.prim_func
    def topk_radix(
        Scores: T.StridedTensor((M, N), (SM, 1), "float32"),
        Starts: T.Tensor((NS,), i32),
        Ends: T.Tensor((NE,), i32),
        Out: T.Tensor((M, K), i32),
        Flags: T.int32,
    ):
        with T.Kernel(M, threads=NT) as bx:
            tx = T.get_thread_binding()
            if min_ctas > 0:
                annotate_min_blocks_per_sm(min_ctas)
            hist = T.alloc_shared((HBINS,), i32)
            wred = T.alloc_shared((2, W), i32)
            sel = T.alloc_shared((4,), i32)
            if cache > 0:
                skeys = T.alloc_shared((cache,), u32)
            if score:
                sbuf = T.alloc_shared((sort_cap,), u64)
            if cand_cap > 0:
                cand = T.alloc_shared((cand_cap,), i32)  # row positions of the pass-0 threshold bucket
                wcnt = T.alloc_shared((2, W), i32)  # per-warp above / tied counts of the candidate schedule

            lane = tx % 32
            warp = tx // 32
            lo = T.alloc_var(i32)
            hi = T.alloc_var(i32)
            n = T.alloc_var(i32)
            total = T.alloc_var(i32)
            kef = T.alloc_var(i32)
            krem = T.alloc_var(i32)
            need = T.alloc_var(i32)
            done = T.alloc_var(i32)
            prefix = T.alloc_var(u32)
            mask = T.alloc_var(u32)
            x = T.alloc_var(i32)
            s = T.alloc_var(i32)
            g = T.alloc_var(i32)
            kk = T.alloc_var(u32)
            cgt = T.alloc_var(i32)
            ceq = T.alloc_var(i32)
            vals = T.alloc_local((U,), u32)
            fv = T.alloc_local((max(U, U0),), "float32")
            shift = T.alloc_var(u32)
            dmask = T.alloc_var(u32)
            pos = T.alloc_var(i32)
            f1 = T.alloc_var("float32")
            # candidate schedule taken (block-uniform); a Python 0 when compiled out, so its branches vanish
            usecand = T.alloc_var(i32) if cand_cap > 0 else 0
            ncand = T.alloc_var(i32)
            slot = T.alloc_var(i32)
            w1 = T.alloc_var(i32)
            segv = T.alloc_var(i32)

            R.row_range(lo, hi, n, Starts, Ends, Flags, N, Ix(row=bx))
            # one contiguous segment of positions per warp (the write sweeps and the candidate compaction)
            segv = T.ceildiv(T.ceildiv(n, W), 32) * 32
            if cand_cap > 0:
                usecand = 0
            ncand = 0

            # ---- pass 0: histogram of the top 11 bits (and the shared-memory key cache) ----
            for b in T.serial(BPT):
                hist[b * NT + tx if lean else tx * BPT + b] = 0
            if cand_cap > 0:
                if tx == 0:
                    sel[3] = 0  # candidate counter
            T.sync_threads()
            R.first_hist(U0, n, kk, fv, tx, hist, skeys if cache > 0 else None, Scores, Ix(row=bx, base=lo))
            T.sync_threads()

            prefix = T.uint32(0)
            mask = T.uint32(0)
            done = 0
            krem = K
            for p in T.unroll(3):
                if done == 0:
                    shift = shift_expr(p)
                    dmask = dmask_expr(p)
                    if p > 0:
                        # histogram of the next digit among keys matching the decided prefix
                        for b in T.serial(BPT):
                            hist[b * NT + tx if lean else tx * BPT + b] = 0
                        T.sync_threads()
                        if usecand == 1:
                            # only the candidates can match the prefix (they all have key != 0)
                            for j in T.serial(T.ceildiv(ncand, NT)):
                                if j * NT + tx < ncand:
                                    kk = skeys[cand[j * NT + tx]]
                                    if (kk & mask) == prefix:
                                        T.atomic_add(hist[T.Cast(i32, (kk >> shift) & dmask)], 1)
                        else:
                            for j in T.serial(T.ceildiv(n, NT * U)):
                                for u in T.unroll(U):
                                    vals[u] = T.uint32(0)
                                    if (j * U + u) * NT + tx < n:
                                        if cache > 0:
                                            vals[u] = skeys[(j * U + u) * NT + tx]
                                        else:
                                            fv[u] = Scores[bx, lo + (j * U + u) * NT + tx]
                                if cache == 0:
                                    for u in T.unroll(U):
                                        if (j * U + u) * NT + tx < n:
                                            vals[u] = to_key(fv[u])
                                for u in T.unroll(U):
                                    if vals[u] != T.uint32(0) and (vals[u] & mask) == prefix:
                                        T.atomic_add(hist[T.Cast(i32, (vals[u] >> shift) & dmask)], 1)
                        T.sync_threads()
                    # threshold digit of level p (records the level-0 bucket size in ncand)
                    R.choose_digit(p, K, tx, lane, warp, hist, wred, sel, s, x, g, total, kef, krem, need, done, prefix,
                                   mask, shift, dmask, ncand, ncand, False)
                    if cand_cap > 0:
                        if p == 0 and done == 0 and ncand <= cand_cap:
                            # ---- candidate compaction: the threshold bucket's positions; per-warp "above" ----
                            usecand = 1
                            cgt = 0
                            for j in T.serial(segv // 32):
                                pos = warp * segv + j * 32 + lane
                                if pos < n:
                                    kk = skeys[pos]
                                    if (kk & mask) > prefix:
                                        cgt = cgt + 1
                                    elif kk != T.uint32(0) and (kk & mask) == prefix:
                                        slot = T.atomic_add(sel[3], 1, return_prev=True)
                                        if slot < cand_cap:  # always: exactly ncand keys match
                                            cand[slot] = pos
                            cgt = T.warp_reduce_sum(cgt)
                            if lane == 0:
                                wcnt[0, warp] = cgt
                                wcnt[1, warp] = 0
                    T.sync_threads()

            # ---- write: one contiguous segment per warp, ranks by ballot/popc in position order ----
            seg = segv
            if usecand == 1:
                # per-warp counts: "above" outside the bucket (compaction) + the candidates by final threshold
                for j in T.serial(T.ceildiv(ncand, NT)):
                    if j * NT + tx < ncand:
                        pos = cand[j * NT + tx]
                        kk = skeys[pos]
                        w1 = pos // seg
                        if (kk & mask) > prefix:
                            T.atomic_add(wcnt[0, w1], 1)
                        elif (kk & mask) == prefix:
                            T.atomic_add(wcnt[1, w1], 1)
                T.sync_threads()
                R.warp_bases(cgt, ceq, wcnt, warp, Ix(cnt0=0, tie0=0))
            else:
                R.count_sweep(seg, lane, warp, n, kk, f1, pos, cgt, ceq, mask, prefix, wred,
                              skeys if cache > 0 else None, Scores, Ix(row=bx, base=lo, cnt0=0, tie0=0))
            T.sync_threads()
            R.write_sweep(seg, lane, warp, n, kk, f1, pos, cgt, ceq, mask, prefix, x, s, need,
                          skeys if cache > 0 else None, Scores, Out, sbuf if score else None, Ix(row=bx, base=lo))

            if score:
                for j in T.serial(T.ceildiv(sort_cap, NT)):
                    if j * NT + tx < sort_cap and j * NT + tx >= kef:
                        sbuf[j * NT + tx] = T.uint64(0)
                T.sync_threads()
                for a in T.serial(LOG_CAP):
                    for c in T.serial(a + 1):
                        for j in T.serial(T.ceildiv(HALF, NT)):
                            if j * NT + tx < HALF:
                                # pair (i, i + 2^(a-c)); blocks of 2^(a+1) alternate direction
                                sel_i = (((j * NT + tx) >> (a - c)) << (a - c + 1)) | (
                                    (j * NT + tx) & ((1 << (a - c)) - 1))
                                va = sbuf[sel_i]
                                vb = sbuf[sel_i + (1 << (a - c))]
                                if ((sel_i & (2 << a)) == 0) == (va < vb):
                                    sbuf[sel_i] = vb
                                    sbuf[sel_i + (1 << (a - c))] = va
                        T.sync_threads()
                for j in T.serial(T.ceildiv(K, NT)):
                    if j * NT + tx < K:
                        if j * NT + tx < kef:
                            Out[bx, j * NT + tx] = lo + T.Cast(
                                i32, T.uint32(0xFFFFFFFF) - T.Cast(u32, sbuf[j * NT + tx] & T.uint64(0xFFFFFFFF)))
                        else:
                            Out[bx, j * NT + tx] = -1
            else:
                for j in T.serial(T.ceildiv(K, NT)):
                    if j * NT + tx < K and j * NT + tx >= kef:
                        Out[bx, j * NT + tx] = -1

    return topk_radix


def pick_u0(threads: int, cache: int) -> int:
    """Pass-0 loads in flight per thread: the whole cached row in one round for the 512-thread / 8192-key variant
    (HBM latency is paid once per row, not 4 times), 8 for 1024 threads (64-register cap), else the original 4."""
    if cache > 0 and threads <= 512:
        return min(16, cache // threads)
    if cache > 0:
        return 8
    return _UNROLL


# (threads, cache) -> (u0, min_ctas, lean); see pick_tune.  (256, 8192): __launch_bounds__(256, 5) takes ptxas from 57
# to 38 registers (no spills), so 5 CTAs fit an SM instead of 4 (ncu at 57 registers: limited by registers and by
# the shared-memory carveout the driver picked for 4)
TUNED = {(256, 8192): (16, 5, True), (1024, 32768): (8, 0, True)}


def pick_tune(threads: int, cache: int) -> tuple[int, int, bool]:
    """(u0, min_ctas, lean) of the one-CTA kernel: ``TUNED`` entries, else (``pick_u0``, 0, False)."""
    return TUNED.get((threads, cache), (pick_u0(threads, cache), 0, False))


def cand_cap_for(cache: int) -> int:
    """Candidate slots of the compaction schedule (0 = off): 2048 for the 8192-key cache, 4096 for 32768."""
    return 0 if cache == 0 else max(2048, cache // 8)


@functools.lru_cache(maxsize=64)
def _compiled(threads: int, cache: int, sort_cap: int, cand_cap: int = 0, u0: int = 0, min_ctas: int = 0,
              lean: bool = False):
    import tilelang

    func = _build_topk_radix(threads=threads, cache=cache, sort_cap=sort_cap, cand_cap=cand_cap, u0=u0,
                             min_ctas=min_ctas, lean=lean)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(scores, k, starts=None, ends=None, order="index") -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes/devices only, no values)."""
    if not isinstance(scores, torch.Tensor) or not scores.is_cuda:
        return "scores must be a CUDA tensor"
    if scores.dtype != torch.float32:
        return f"scores must be float32 (got {scores.dtype})"
    if scores.dim() != 2:
        return "scores must be [M, N]"
    M, N = scores.shape
    if not isinstance(k, int) or k < 1:
        return "k must be an int >= 1"
    if order not in ("index", "score", "any"):
        return f"order {order!r} not in ('index', 'score', 'any')"
    if order == "score" and k > MAX_SCORE_K:
        return f"order='score' sorts in shared memory: k={k} > {MAX_SCORE_K}"
    if N >= 2**31 - 2**13 or k >= 2**31 or M >= 2**31:
        return "sizes exceed int32 indexing"
    if N > 1 and scores.stride(1) != 1:
        return "scores: last dim must be contiguous"
    if M > 1 and not 0 <= scores.stride(0) < 2**31 - 2**13:
        return "scores: row stride must be in [0, 2**31)"
    for name, t in (("starts", starts), ("ends", ends)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.device != scores.device:
            return f"{name} must be a CUDA tensor on the scores device"
        if t.dtype != torch.int32 or t.shape != (M,):
            return f"{name} must be int32 [M]"
    return None


IMPLS = ("single", "multi4", "persist", "regs")


def pick_impl(M: int, N: int, order: str, sms: int) -> str:
    """Routing rule (shapes only): "persist" (G CTAs per row, one launch, ``kernel_radix_persist.use_persist``),
    else "multi4" (G CTAs per row, 4 launches, ``kernel_radix_multi.use_multi``), else "regs" (keys in registers,
    ``kernel_radix_regs``) when the row fits and the order needs no sort, else "single" (this kernel)."""
    from . import kernel_radix_multi as _multi
    from . import kernel_radix_persist as _persist
    from . import kernel_radix_regs as _regs

    if _persist.use_persist(M, N, order, sms):
        return "persist"
    if _multi.use_multi(M, N, order, sms):
        return "multi4"
    if _regs.supports(N, order):
        return "regs"
    return "single"


def run_topk_indices(scores, k, starts=None, ends=None, order="index", *, multi=None, impl=None,
                     cand=False, u0=None, threads=None, tune=None, regs=None) -> torch.Tensor:
    """Exact top-k positions per row; `[M, k]` int32 in ``order`` ("any" = "index").  No host synchronisation.

    ``impl``: None routes by ``pick_impl`` (shapes only); "single" (one CTA per row, this module), "multi4"
    (``kernel_radix_multi``, 4 launches) or "persist" (``kernel_radix_persist``, one launch) force a path
    ("multi4" / "persist" with order="score" raise ValueError).  ``multi`` (older switch): True = "multi4",
    False = "single".  ``cand``: the one-CTA kernel uses the candidate compaction schedule (measured slower on
    4096 x 8192: 202 vs 189.5 us; kept for experiments).  ``u0``: pass-0 loads in flight per thread (None:
    ``pick_u0``; 4 is the original).  ``threads``: CTA size of the one-CTA kernel (None: ``pick_config``).
    ``tune``: (u0, min_ctas, lean) of the one-CTA kernel, overriding ``pick_tune`` (and ``u0``).
    ``regs``: (threads, keys per thread, min_ctas[, unsafe_loads]) of the "regs" path (None: its defaults,
    ``kernel_radix_regs.TUNED``).
    """
    reason = kernel_unsupported(scores, k, starts, ends, order)
    if reason is not None:
        raise ValueError(f"topk radix kernel: {reason}")
    M, N = scores.shape
    dev = scores.device
    if impl is None and multi is not None:
        impl = "multi4" if multi else "single"
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"topk radix kernel: impl {impl!r} not in {IMPLS}")
    if impl in ("multi4", "persist", "regs") and order == "score":
        raise ValueError(f"topk radix kernel: the {impl!r} path has no order='score'")
    if impl is None:
        from . import kernel_radix_multi as _multi

        impl = pick_impl(M, N, order, _multi._sm_count(dev.index if dev.index is not None else 0))
    if impl == "persist":
        from . import kernel_radix_persist as _persist

        # rows that leave SMs idle: several CTAs per row, one launch with row barriers
        return _persist.run_topk_indices_persist(scores, k, starts, ends)
    if impl == "regs":
        from . import kernel_radix_regs as _regs

        t, kpt, mc, *unsafe = regs if regs is not None else (_regs.THREADS, 0, -1)
        return _regs.run_topk_indices_regs(scores, k, starts, ends, threads=t, kpt=kpt, min_ctas=mc,
                                           unsafe_loads=unsafe[0] if unsafe else True)
    if impl == "multi4":
        from . import kernel_radix_multi as _multi

        # few very long rows: several CTAs per row (see kernel_radix_multi's notes for the rule)
        return _multi.run_topk_indices_multi(scores, k, starts, ends)
    out, scores = new_output(scores, k)
    if scores is None:  # M == 0 or N == 0
        return out
    threads0, cache = pick_config(N)
    threads = threads0 if threads is None else int(threads)
    sort_cap = _sort_cap(k) if order == "score" else 0
    st, en, flags = range_args(starts, ends, dev)
    tu0, min_ctas, lean = pick_tune(threads, cache) if tune is None else tune
    if u0 is not None and tune is None:
        tu0 = int(u0)
    kernel = _compiled(threads, cache, sort_cap, cand_cap_for(cache) if cand else 0, tu0, min_ctas, lean)
    kernel(scores, st, en, out, flags)
    return out


EXPECTS_WGMMA = False  # a radix select: no matrix products


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test (one per shipped variant)."""
    cases = []
    # lowering is slow on CPU: the smem-cached index path and the L2 re-read score path
    # (the first with candidate compaction, which also holds the original schedule as its fallback branch)
    for threads, cache, sort_cap in [(256, 8192, 0), (1024, 0, 4096)]:
        cc, (u0, min_ctas, lean) = cand_cap_for(cache), pick_tune(threads, cache)
        name = f"t{threads}_cache{cache}_cand{cc}_u{u0}_m{min_ctas}_l{int(lean)}_" + (
            f"score{sort_cap}" if sort_cap else "index")
        cases.append((name, _build_topk_radix(threads=threads, cache=cache, sort_cap=sort_cap, cand_cap=cc, u0=u0,
                                              min_ctas=min_ctas, lean=lean)))
    return cases
