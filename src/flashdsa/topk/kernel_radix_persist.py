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

from .kernel_radix import _DMASKS, _SHIFTS, _UNROLL, HBINS, _pass_configs, to_key_expr

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


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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

    M = T.dynamic("M")
    N = T.dynamic("N")
    K = T.dynamic("K")
    G = T.dynamic("G")
    NS = T.dynamic("NS")
    NE = T.dynamic("NE")
    SM = T.dynamic("SM")
    u32, i32, u64, i64 = "uint32", "int32", "uint64", "int64"
    to_key = to_key_expr

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
            lo = T.alloc_var(i32)
            hi = T.alloc_var(i32)
            n = T.alloc_var(i32)
            cs = T.alloc_var(i32)
            ln = T.alloc_var(i32)
            chunk = T.alloc_var(i32)
            total = T.alloc_var(i32)
            kef = T.alloc_var(i32)
            krem = T.alloc_var(i32)
            need = T.alloc_var(i32)
            done = T.alloc_var(i32)
            lev = T.alloc_var(i32)
            dsel = T.alloc_var(i32)
            prefix = T.alloc_var(u32)
            mask = T.alloc_var(u32)
            x = T.alloc_var(i32)
            s = T.alloc_var(i32)
            g = T.alloc_var(i32)
            a = T.alloc_var(i32)
            kk = T.alloc_var(u32)
            cgt = T.alloc_var(i32)
            ceq = T.alloc_var(i32)
            fv = T.alloc_local((U,), "float32")
            shift = T.alloc_var(u32)
            dmask = T.alloc_var(u32)
            pos = T.alloc_var(i32)
            h1 = T.alloc_var(i32)
            h2 = T.alloc_var(i32)

            lo = 0
            hi = N
            if (Flags & 1) != 0:
                lo = T.max(T.min(Starts[by], N), 0)
            if (Flags & 2) != 0:
                hi = T.max(T.min(Ends[by], N), 0)
            n = T.max(hi - lo, 0)
            chunk = T.ceildiv(T.ceildiv(n, G), 32) * 32
            cs = T.min(gx * chunk, n)
            ln = T.min(T.min(cs + chunk, n) - cs, cache)  # the min never binds (host rule); it keeps smem in bounds

            prefix = T.uint32(0)
            mask = T.uint32(0)
            done = 0
            krem = K
            kef = K
            need = 0
            lev = -1
            dsel = 0
            for p in T.unroll(3):
                if done == 0:
                    shift = T.Cast(
                        u32, T.if_then_else(p == 0, _SHIFTS[0], T.if_then_else(p == 1, _SHIFTS[1], _SHIFTS[2])))
                    dmask = T.Cast(u32, T.if_then_else(p == 2, _DMASKS[2], _DMASKS[0]))
                    # ---- local histogram of digit p over this CTA's slice ----
                    for b in T.serial(BPT):
                        hist[tx * BPT + b] = 0
                    T.sync_threads()
                    a = 0
                    if p == 0:
                        for j in T.serial(T.ceildiv(ln, NT * U)):
                            for u in T.unroll(U):
                                fv[u] = T.float32(0)
                                if (j * U + u) * NT + tx < ln:
                                    fv[u] = Scores[by, lo + cs + (j * U + u) * NT + tx]
                            for u in T.unroll(U):
                                if (j * U + u) * NT + tx < ln:
                                    kk = to_key(fv[u])
                                    skeys[(j * U + u) * NT + tx] = kk
                                    if kk != T.uint32(0):
                                        T.atomic_add(hist[T.Cast(i32, kk >> T.uint32(_SHIFTS[0]))], 1)
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
                    s = 0
                    for b in T.serial(BPT):
                        s = s + hist[tx * BPT + b]
                        if hist[tx * BPT + b] != 0:
                            T.atomic_add(Ws[by, p * HBINS + tx * BPT + b], hist[tx * BPT + b])
                    x = s
                    for o in T.unroll(5):
                        g = T.shfl_down(x, 1 << o)
                        if lane + (1 << o) < 32:
                            x = x + g
                    a = T.warp_reduce_sum(a)
                    if lane == 0:
                        wred[0, warp] = x
                        wred[1, warp] = a
                    T.sync_threads()
                    g = x - s
                    a = 0
                    for w2 in T.serial(W):
                        a = a + wred[1, w2]
                        if w2 > warp:
                            g = g + wred[0, w2]
                    for b in T.serial(BPT):
                        g = g + hist[tx * BPT + BPT - 1 - b]
                        Part[by, gx, p, tx * BPT + BPT - 1 - b] = a + g
                    if tx == 0:
                        Part[by, gx, p, HBINS] = a
                    # ---- every CTA of the row has published level p ----
                    T.call_extern("handle", "fdsa_row_barrier", Ws.data, T.Cast(i64, by) * WSTRIDE + CTR, G,
                                  T.Cast(i32, gx == 0))
                    # ---- digit choice on the row histogram (kernel_radix's block suffix scan) ----
                    for b in T.serial(BPT):
                        h2 = T.call_extern(i32, "fdsa_ld_relaxed", Ws.data,
                                           T.Cast(i64, by) * WSTRIDE + p * HBINS + tx * BPT + b)
                        hist[tx * BPT + b] = h2
                    T.sync_threads()
                    s = 0
                    for b in T.serial(BPT):
                        s = s + hist[tx * BPT + b]
                    x = s
                    for o in T.unroll(5):
                        g = T.shfl_down(x, 1 << o)
                        if lane + (1 << o) < 32:
                            x = x + g
                    if lane == 0:
                        wred[0, warp] = x
                    T.sync_threads()
                    g = x - s
                    total = 0
                    for w2 in T.serial(W):
                        total = total + wred[0, w2]
                        if w2 > warp:
                            g = g + wred[0, w2]
                    if p == 0:
                        kef = T.min(K, total)
                        krem = kef
                    if p == 0 and total <= K:
                        # take every valid element
                        done = 1
                        need = total
                    else:
                        for b in T.serial(BPT):
                            if g < krem and krem <= g + hist[tx * BPT + BPT - 1 - b]:
                                sel[0] = tx * BPT + BPT - 1 - b
                                sel[1] = g
                                sel[2] = hist[tx * BPT + BPT - 1 - b]
                            g = g + hist[tx * BPT + BPT - 1 - b]
                        T.sync_threads()
                        krem = krem - sel[1]
                        prefix = prefix | (T.Cast(u32, sel[0]) << shift)
                        mask = mask | (dmask << shift)
                        need = krem
                        lev = p
                        dsel = sel[0]
                        if sel[2] == krem or p == 2:
                            done = 1
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
            cgt = T.warp_reduce_sum(cgt)
            ceq = T.warp_reduce_sum(ceq)
            if lane == 0:
                wred[0, warp] = cgt
                wred[1, warp] = ceq
            T.sync_threads()
            a = 0  # above in lower CTAs
            h1 = 0  # tied in lower CTAs
            for w2 in T.serial(W):
                a = a + wred[0, w2]
                h1 = h1 + wred[1, w2]
            T.sync_threads()

            seg = T.ceildiv(T.ceildiv(ln, W), 32) * 32
            cgt = 0
            ceq = 0
            for j in T.serial(seg // 32):
                pos = warp * seg + j * 32 + lane
                if pos < ln:
                    kk = skeys[pos]
                    if (kk & mask) > prefix:
                        cgt = cgt + 1
                    elif kk != T.uint32(0) and (kk & mask) == prefix:
                        ceq = ceq + 1
            cgt = T.warp_reduce_sum(cgt)
            ceq = T.warp_reduce_sum(ceq)
            if lane == 0:
                wred[0, warp] = cgt
                wred[1, warp] = ceq
            T.sync_threads()
            cgt = a
            ceq = h1
            for w2 in T.serial(W):
                if w2 < warp:
                    cgt = cgt + wred[0, w2]
                    ceq = ceq + wred[1, w2]
            T.sync_threads()
            for j in T.serial(seg // 32):
                kk = T.uint32(0)
                pos = warp * seg + j * 32 + lane
                if pos < ln:
                    kk = skeys[pos]
                bg = T.ballot_sync((kk & mask) > prefix)
                be = T.ballot_sync(kk != T.uint32(0) and (kk & mask) == prefix)
                lt = (T.uint64(1) << T.Cast(u64, lane)) - T.uint64(1)
                x = cgt + T.Cast(i32, T.popcount(bg & lt))
                s = ceq + T.Cast(i32, T.popcount(be & lt))
                if (kk & mask) > prefix or (kk != T.uint32(0) and (kk & mask) == prefix and s < need):
                    Out[by, x + T.min(s, need)] = lo + cs + pos
                cgt = cgt + T.Cast(i32, T.popcount(bg))
                ceq = ceq + T.Cast(i32, T.popcount(be))
            # leftover slots [kef, K), spread over the row's CTAs
            for j in T.serial(T.ceildiv(K, G * NT)):
                if (j * G + gx) * NT + tx < K and (j * G + gx) * NT + tx >= kef:
                    Out[by, (j * G + gx) * NT + tx] = -1
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
    out = torch.empty((M, k), dtype=torch.int32, device=dev)
    if M == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    if (N == 1 and scores.stride(1) != 1) or (M == 1 and scores.stride(0) != N):
        scores = scores.as_strided((M, N), (N if M == 1 else scores.stride(0), 1))
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    G = int(groups) if groups is not None else pick_groups(M, N, sms)
    if G < 1 or G * M > sms or -(-N // G) > CACHE:
        # a row barrier needs all G CTAs of the row resident at once, and every slice must fit the cache
        raise ValueError(f"persistent top-k: groups={G} x M={M} must be <= {sms} SMs and ceil(N / groups) <= {CACHE}")
    dummy = None
    if starts is None or ends is None:
        dummy = _dummy(dev)
    st = starts.contiguous() if starts is not None else dummy
    en = ends.contiguous() if ends is not None else dummy
    flags = (1 if starts is not None else 0) | (2 if ends is not None else 0)
    ws, part = _workspace(dev, M, G)
    _compiled(THREADS, CACHE)(scores, st, en, ws, part, out, flags)
    return out


_DUMMY: dict = {}
_WS: "collections.OrderedDict" = collections.OrderedDict()
_WS_MAX = 16


def _dummy(dev):
    t = _DUMMY.get(dev)
    if t is None:
        t = _DUMMY[dev] = torch.zeros((1,), dtype=torch.int32, device=dev)
    return t


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
