"""Exact per-row top-k over several CTAs per row in ONE launch (row barriers), in TileLang for Hopper.

Notes
-----
Why: ``kernel_radix_multi`` splits a long row over G CTAs but needs 4 launches + a memset per call (measured
155-165 us for 16 x 131072 and 1 x 1048576, mostly launch gaps and host time), and ``kernel_radix`` leaves SMs
idle when M < SMs (64 x 32768: 64 of 132 SMs, 50 us).  This kernel runs the same algorithm as
``kernel_radix_multi`` (same keys, digits, threshold rule, ``Part`` suffix counts, ordered write) in a single
launch: the launch boundaries become a per-row barrier, and each CTA keeps its slice of keys in shared memory, so
the row is read from global memory once.

Algorithm (grid ``(G, M)``, 1024 threads, one CTA per SM):
  * Slices as in ``kernel_radix_multi``: ``chunk = ceil(ceil(n / G) / 32) * 32`` row positions per CTA; the host
    picks ``G`` with ``ceil(N / G) <= CACHE`` so every slice fits the shared key cache (a device guard never
    writes past it).
  * Level ``P`` = 0, 1, 2 (skipped once the threshold is decided; ``done`` is derived from the same global
    histogram in every CTA of the row, so all of them run the same number of barriers): local 2048-bin histogram
    of digit ``P`` among keys matching the decided prefix (level 0 reads global memory and fills the key cache,
    later levels read the cache), ``A`` = keys already above; non-zero bins are added to ``Ws[m, P]`` (global
    int32 atomics: exact integer sums, order-independent) and the CTA's suffix counts go to ``Part[m, g, P, :]``;
    then the row barrier; then every CTA reads ``Ws[m, P]`` and runs ``kernel_radix``'s block scan / digit choice.
  * Write: bases from the lower CTAs' ``Part`` entries at the final level (as ``kernel_radix_multi``), then
    ``kernel_radix``'s per-warp sweep A / sweep B (ballot + popc ranks) over the cached slice.  Output slot =
    (#above before it in the row) + min(#tied before it in the row, need): ascending positions, ties to the lowest
    positions, exactly the reference.  Slots ``[k_eff, k)`` get -1.
  * Row barrier (``fdsa_row_barrier``, the sense-flip counter used by cooperative groups' grid sync): thread 0 of
    each CTA fences, adds 1 (the CTA with ``g == 0`` adds ``2**31 - (G - 1)``) to the row's counter and spins on an
    acquire load until bit 31 flips; ``__syncthreads`` before and after.  The counter starts at 0 (``Ws`` is zeroed
    per call by one memset, with the histograms) and its low 31 bits return to 0 after every barrier.  Global
    ``Ws`` / ``Part`` entries written by other CTAs are read with ``ld.relaxed.gpu`` (never a stale L1 line).
  * Co-residency (a barrier needs every CTA of the row running): the host launches ``G * M <= SMs`` CTAs of 1024
    threads (occupancy 1 CTA/SM), so on an otherwise idle GPU every CTA is resident at once; CTAs of other
    kernels on other streams only delay, never block, because they finish on their own.
Cost per call: 1 memset (``Ws``) + 1 launch; global reads: the row once (+ <= 3 x 8 KiB histograms per CTA and
  2 ints per lower CTA); up to 3 row barriers.  Shared memory 128 KiB cache + 8 KiB histogram.
Workspace: ``Ws`` is cached per (device, stream, M, G) and handed back zeroed by the kernel itself (the last CTA of
  each row to finish clears the row's histograms and exit counter, ``fdsa_row_exit``), so a call is 1 launch and
  no memset; under CUDA-graph capture a fresh zeroed workspace is made (its memset is captured).
Routing (``pick_groups``): G = min(SMs // M, ceil(N / 8192)) (more if a slice would not fit the cache), used when
  G >= MIN_GROUPS = 4 and G * M <= SMs: 16 x 131072 -> G 8; 1 x 1048576 -> 128; 64 x 32768 -> 2 (stays on
  ``kernel_radix``: 31.9 us there vs 34.9 us here).
Measured (H200, k 2048, ``scripts/bench_topk.py``; kernel / through ``flashdsa.topk_indices`` / torch.topk):
  16 x 131072 34.0 / 33.9 / 119 us (multi4: 53); 1 x 1048576 28.4 / 32.5 / 153 us (multi4: 42); exact against
  the reference on randn, heavy ties and random ranges; ``tests/topk/test_kernel_gpu.py`` 64 passed (the
  shapes with 4 <= G route here: 3 x 33000, 1-16 x 131072, 1 x 1048576, ...).
Registers: 64/thread (cap of 1024 threads), 8 bytes of spill (ptxas -v, CUDA 13.0).
"""

import collections
import functools

import torch

from ._tl_radix import _UNROLL, HBINS, Ix, _pass_configs, alloc_vars, cached_dummy, dmask_expr  # noqa: F401
from ._tl_radix import dynamic_dims, new_output, radix_macros, range_args, shift_expr, sm_count

THREADS = 1024
CACHE = 32768  # keys per CTA in shared memory (128 KiB)
PER_CTA = 8192  # preferred elements per CTA
PSTRIDE = HBINS + 1
CTR = 3 * HBINS  # Ws column of the row barrier counter
EXIT = 3 * HBINS + 16  # Ws column of the row exit counter (own 64-byte sector)
WSTRIDE = 3 * HBINS + 32

PRELUDE = r"""
// base[off] read at L2 (GPU scope): other CTAs' atomics / stores, never a stale L1 line
__device__ __forceinline__ int fdsa_ld_relaxed(const int* base, long long off) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(base + off) : "memory");
  return v;
}
// All CTAs of a row meet here (sense-flip counter, as cooperative groups' grid sync); nb CTAs, one leader.
__device__ __forceinline__ void fdsa_row_barrier(int* base, long long off, int nb, int leader) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* c = reinterpret_cast<unsigned int*>(base + off);
    unsigned int inc = leader ? (0x80000000u - (unsigned int)(nb - 1)) : 1u;
    __threadfence();
    unsigned int old = atomicAdd(c, inc);
    unsigned int cur;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(c) : "memory");
    } while (((old ^ cur) & 0x80000000u) == 0u);
    __threadfence();
  }
  __syncthreads();
}
// Leave the row's workspace as it was found (all zero): the last CTA of the row to get here (all others have done
// their last read of Ws) clears the histograms and the exit counter.  The barrier counter's low 31 bits are already 0.
__device__ __forceinline__ void fdsa_row_exit(int* base, long long off, int nb, int nclear, int exit_col) {
  __shared__ int fdsa_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    int prev = atomicAdd(base + off + exit_col, 1);
    __threadfence();
    fdsa_last = (prev == nb - 1);
  }
  __syncthreads();
  if (fdsa_last) {
    for (int i = threadIdx.x; i < nclear; i += blockDim.x) base[off + i] = 0;
    if (threadIdx.x == 0) base[off + exit_col] = 0;
  }
}
"""


_sm_count = sm_count


def pick_groups(M: int, N: int, sms: int = 132) -> int:
    """CTAs per row (1 = this kernel is not used): one wave of 1-CTA-per-SM blocks, every slice in the cache."""
    if M < 1 or N < 1:
        return 1
    g = max(1, min(sms // M, -(-N // PER_CTA)))
    if -(-N // g) > CACHE:
        g = -(-N // CACHE)  # fewest CTAs whose slices fit the cache
        if g * M > sms:
            return 1
    return g


MIN_GROUPS = 4  # measured: 64 x 32768 (G = 2) is faster on kernel_radix (31.9 vs 34.9 us kernel time)


def use_persist(M: int, N: int, order: str = "index", sms: int = 132) -> bool:
    """Routing rule (shapes only): order != "score" and pick_groups(M, N) >= MIN_GROUPS."""
    return order != "score" and pick_groups(M, N, sms) >= MIN_GROUPS


def _build_topk_radix_persist(*, threads: int = THREADS, cache: int = CACHE):
    """Scores [M, N] f32 (row stride SM), Starts [NS], Ends [NE], Ws [M, WSTRIDE] (zeroed), Part [M, G, 3, 2049],
    Out [M, K], Flags (bit 0 starts given, bit 1 ends given)."""
    import tilelang.language as T

    NT = threads
    assert NT % 32 == 0 and HBINS % NT == 0 and NT <= 1024 and cache % 32 == 0
    W = NT // 32
    BPT = HBINS // NT
    U = _UNROLL

    M, N, K, G, NS, NE, SM = dynamic_dims("M", "N", "K", "G", "NS", "NE", "SM")
    u32, i32, i64 = "uint32", "int32", "int64"
    R = radix_macros(NT)

    @T.prim_func
    def topk_radix_persist(
        Scores: T.StridedTensor((M, N), (SM, 1), "float32"),
        Starts: T.Tensor((NS,), i32),
        Ends: T.Tensor((NE,), i32),
        Ws: T.Tensor((M, WSTRIDE), i32),
        Part: T.Tensor((M, G, 3, PSTRIDE), i32),
        Out: T.Tensor((M, K), i32),
        Flags: T.int32,
    ):
        with T.Kernel(G, M, threads=NT, prelude=PRELUDE) as (gx, by):
            tx = T.get_thread_binding()
            skeys = T.alloc_shared((cache,), u32)
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
            h2 = T.alloc_var(i32)

            R.row_range(lo, hi, n, Starts, Ends, Flags, N, Ix(row=by))
            R.cta_slice(G, n, chunk, cs, ln, cache, Ix(gx=gx))

            R.init_threshold(K, prefix, mask, done, krem, kef, need, lev, dsel)
            for p in T.unroll(3):
                if done == 0:
                    shift = shift_expr(p)
                    dmask = dmask_expr(p)
                    # ---- local histogram of digit p over this CTA's slice ----
                    for b in T.serial(BPT):
                        hist[tx * BPT + b] = 0
                    T.sync_threads()
                    a = 0
                    if p == 0:
                        R.first_hist(U, ln, kk, fv, tx, hist, skeys, Scores, Ix(row=by, base=lo + cs))
                    else:
                        for j in T.serial(T.ceildiv(ln, NT)):
                            if j * NT + tx < ln:
                                kk = skeys[j * NT + tx]
                                if (kk & mask) > prefix:
                                    a = a + 1
                                elif kk != T.uint32(0) and (kk & mask) == prefix:
                                    T.atomic_add(hist[T.Cast(i32, (kk >> shift) & dmask)], 1)
                    T.sync_threads()
                    # ---- publish: row histogram (global atomics) and this CTA's suffix counts ----
                    R.publish(tx, lane, warp, hist, wred, Ws, Part, s, x, g, a, Ix(row=by, gx=gx, lvl=p))
                    # ---- every CTA of the row has published level p ----
                    T.call_extern("handle", "fdsa_row_barrier", Ws.data, T.Cast(i64, by) * WSTRIDE + CTR, G,
                                  T.Cast(i32, gx == 0))
                    # ---- digit choice on the row histogram (kernel_radix's block suffix scan) ----
                    for b in T.serial(BPT):
                        h2 = T.call_extern(i32, "fdsa_ld_relaxed", Ws.data,
                                           T.Cast(i64, by) * WSTRIDE + p * HBINS + tx * BPT + b)
                        hist[tx * BPT + b] = h2
                    T.sync_threads()
                    R.choose_digit(p, K, tx, lane, warp, hist, wred, sel, s, x, g, total, kef, krem, need, done, prefix,
                                   mask, shift, dmask, lev, dsel, True)
                    T.sync_threads()

            # ---- write: bases from the lower CTAs of the row, then kernel_radix's write on the cached slice ----
            cgt = 0
            ceq = 0
            for j in T.serial(T.ceildiv(gx, NT)):
                if j * NT + tx < gx:
                    if lev < 0:
                        h2 = T.call_extern(i32, "fdsa_ld_relaxed", Part.data,
                                           ((T.Cast(i64, by) * G + j * NT + tx) * 3) * PSTRIDE)
                        ceq = ceq + h2
                    else:
                        # Part[by, g', lev, dsel + 1] and Part[by, g', lev, dsel] (contiguous [M, G, 3, PSTRIDE])
                        h1 = T.call_extern(i32, "fdsa_ld_relaxed", Part.data,
                                           ((T.Cast(i64, by) * G + j * NT + tx) * 3 + lev) * PSTRIDE + dsel + 1)
                        h2 = T.call_extern(i32, "fdsa_ld_relaxed", Part.data,
                                           ((T.Cast(i64, by) * G + j * NT + tx) * 3 + lev) * PSTRIDE + dsel)
                        cgt = cgt + h1
                        ceq = ceq + h2 - h1
            R.warp_totals(cgt, ceq, wred, lane, warp)
            a = 0  # above in lower CTAs
            h1 = 0  # tied in lower CTAs
            for w2 in T.serial(W):
                a = a + wred[0, w2]
                h1 = h1 + wred[1, w2]
            T.sync_threads()

            seg = T.ceildiv(T.ceildiv(ln, W), 32) * 32
            # (kk doubles as the unused float scratch: the keys always come from the cache)
            R.count_sweep(seg, lane, warp, ln, kk, kk, pos, cgt, ceq, mask, prefix, wred, skeys, Scores,
                          Ix(row=by, cnt0=a, tie0=h1))
            T.sync_threads()
            R.write_sweep(seg, lane, warp, ln, kk, kk, pos, cgt, ceq, mask, prefix, x, s, need, skeys, Scores, Out,
                          None, Ix(row=by, base=lo + cs))
            R.fill_tail(K, G, tx, kef, Out, Ix(row=by, gx=gx))
            # hand the workspace back zeroed (the next call on this stream reuses it without a memset)
            T.call_extern("handle", "fdsa_row_exit", Ws.data, T.Cast(i64, by) * WSTRIDE, G, 3 * HBINS, EXIT)

    return topk_radix_persist


@functools.lru_cache(maxsize=4)
def _compiled(threads: int, cache: int):
    import tilelang

    func = _build_topk_radix_persist(threads=threads, cache=cache)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def run_topk_indices_persist(scores, k, starts=None, ends=None, groups=None) -> torch.Tensor:
    """order="index" top-k, ``groups`` CTAs per row (default ``pick_groups``) in one launch.  Arguments as validated
    by ``kernel_radix.kernel_unsupported``; no host synchronisation (CUDA-graph capturable)."""
    M, N = scores.shape
    dev = scores.device
    out, scores = new_output(scores, k)
    if scores is None:  # M == 0 or N == 0
        return out
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    G = int(groups) if groups is not None else pick_groups(M, N, sms)
    if G < 1 or G * M > sms or -(-N // G) > CACHE:
        # a row barrier needs all G CTAs of the row resident at once, and every slice must fit the cache
        raise ValueError(f"persistent top-k: groups={G} x M={M} must be <= {sms} SMs and ceil(N / groups) <= {CACHE}")
    st, en, flags = range_args(starts, ends, dev)
    ws, part = _workspace(dev, M, G)
    _compiled(THREADS, CACHE)(scores, st, en, ws, part, out, flags)
    return out


_WS: "collections.OrderedDict" = collections.OrderedDict()
_WS_MAX = 16


_dummy = cached_dummy


def _workspace(dev, M: int, G: int):
    """(Ws [M, WSTRIDE] all zero, Part [M, G, 3, PSTRIDE]) for one call.

    Outside CUDA-graph capture they are cached per (device, stream, M, G): the kernel leaves Ws zeroed on exit
    (``fdsa_row_exit``), and calls on one stream run in order, so no memset is needed.  Under capture a fresh
    zeroed pair is made (its memset is part of the graph), so a graph never shares a workspace with eager calls.
    """
    if torch.cuda.is_current_stream_capturing():
        return (torch.zeros((M, WSTRIDE), dtype=torch.int32, device=dev),
                torch.empty((M, G, 3, PSTRIDE), dtype=torch.int32, device=dev))
    key = (dev, torch.cuda.current_stream(dev).cuda_stream, M, G)
    hit = _WS.get(key)
    if hit is None:
        hit = (torch.zeros((M, WSTRIDE), dtype=torch.int32, device=dev),
               torch.empty((M, G, 3, PSTRIDE), dtype=torch.int32, device=dev))
        _WS[key] = hit
        while len(_WS) > _WS_MAX:
            _WS.popitem(last=False)
    else:
        _WS.move_to_end(key)
    return hit


EXPECTS_WGMMA = False


def lowering_cases():
    """One prim_func serves every shape and flag."""
    return [(f"t{THREADS}_cache{CACHE}_index", _build_topk_radix_persist(threads=THREADS, cache=CACHE))]
