"""Pieces shared by the radix top-k kernels (``kernel_radix``, ``kernel_radix_persist``, ``kernel_radix_multi``).

Device side: the key map (``to_key_expr``), the digit schedule (``_SHIFTS``, ``_DMASKS``) and, from
``radix_macros(threads)``, the ``T.macro``s for the block suffix scan / digit choice, the per-CTA publish of a
level's histogram, and the ordered write (per-warp counts, block exclusive scan, ballot/popc sweep).  A macro is
inlined when the prim_func is traced; these were cut out of the three kernels so that the CUDA TileLang generates
stays byte-identical (checked by lowering every shipped config before and after), so each macro keeps the exact
statement order and the variable names of the code it replaced.

How arguments reach a macro (TileLang's eager builder; a different spelling changes the CUDA):
  * a ``T.alloc_var`` scalar the macro reads or assigns is a ``T.Ref`` parameter (the macro then stores into the
    caller's variable; any variable of the right dtype may be passed);
  * shared / global buffers and Python values (ints, None, flags) pass unchanged;
  * a TIR ``Var`` (``tx``, ``lane``, ``warp``, ``p``, ``K``, ``G``, ``seg``, ``N``, ``Flags``) is renamed to the
    parameter's name, so every caller passes a variable of that same name;
  * anything else (the block indices ``bx`` / ``by`` / ``gx``, ``lo + cs``, a level that is ``Pass`` in one
    kernel) goes in an ``Ix`` namespace, read as ``ix.name``: a PrimExpr argument would otherwise become a let
    variable, and a block index would be renamed (which shows in the TIR, though not in the CUDA).

Host side: the int32 dummy for absent starts/ends, the SM count, the common start of every ``run_*`` (output
allocation, empty shapes, canonical strides) and the starts/ends/flags arguments.
"""

import types

import torch

from .. import _dispatch

HBINS = 2048  # 11-bit digits; pass 2 uses the low 10 bits
_SHIFTS = (21, 10, 0)
_DMASKS = (0x7FF, 0x7FF, 0x3FF)
_UNROLL = 4


def _pass_configs():
    import tilelang

    return {
        # every __syncthreads is written by hand (the automatic pass would put some under divergent branches)
        tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
        # no aliasing of shared buffers: with hand-written syncs the planner's lifetime view is not safe
        tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
    }


def to_key_expr(x):
    """TileLang expression: float32 ``x`` -> order-preserving uint32 key (0 for NaN, -inf; +-0 tie)."""
    import tilelang.language as T

    return key_from_bits(T.reinterpret(x, "uint32"))


def key_from_bits(b):
    """TileLang expression: the key of ``to_key_expr`` from the float32 bit pattern ``b`` (uint32)."""
    import tilelang.language as T

    a = b & T.uint32(0x7FFFFFFF)
    k = T.if_then_else(
        a == T.uint32(0), T.uint32(0x80000000),
        T.if_then_else(b >= T.uint32(0x80000000), ~b, b | T.uint32(0x80000000)))
    bad = (a > T.uint32(0x7F800000)) | (b == T.uint32(0xFF800000))  # NaN or -inf
    return T.if_then_else(bad, T.uint32(0), k)


def shift_expr(p):
    """uint32 shift of digit ``p`` (a level loop variable or the ``Pass`` argument): 21, 10, 0."""
    import tilelang.language as T

    return T.Cast("uint32", T.if_then_else(p == 0, _SHIFTS[0], T.if_then_else(p == 1, _SHIFTS[1], _SHIFTS[2])))


def dmask_expr(p):
    """uint32 mask of digit ``p`` (after the shift): 0x7FF, 0x7FF, 0x3FF."""
    import tilelang.language as T

    return T.Cast("uint32", T.if_then_else(p == 2, _DMASKS[2], _DMASKS[0]))


def dynamic_dims(*names):
    """One TileLang dynamic symbol per name (M, N, K, ...)."""
    import tilelang.language as T

    return tuple(T.dynamic(nm) for nm in names)


def alloc_vars(dtype, count: int):
    """``count`` scalar ``T.alloc_var(dtype)``s, in order (each is named by the variable it is unpacked into)."""
    import tilelang.language as T

    return tuple(T.alloc_var(dtype) for _ in range(count))


# expressions handed to a ``T.macro`` verbatim (read as attributes), see the module notes
Ix = types.SimpleNamespace


def radix_macros(threads: int, lean_ranks: bool = False):
    """The shared macros for CTAs of ``threads`` threads (thread ``tx`` owns histogram bins
    ``[tx*BPT, tx*BPT + BPT)``, ``BPT = 2048 / threads``; ``W = threads / 32`` warps).  Returns a namespace:

    * ``choose_digit(p, K, tx, lane, warp, hist, wred, sel, s, x, g, total, kef, krem, need, done, prefix, mask,
      shift, dmask, rec0, rec1, record_level)``: block suffix scan of ``hist`` (the level-``p`` histogram of keys
      matching ``prefix``), ``total``; at level 0 ``kef = min(K, total)`` and everything is taken when
      ``total <= K``; else the digit ``d`` with ``g < krem <= g + hist[d]`` extends ``prefix`` / ``mask``,
      ``need = krem``; ``done`` once the bucket is taken whole or after level 2.  ``record_level``: ``rec0 = p``,
      ``rec1 = d`` (the level / digit of the final threshold); else ``rec0 = hist[d]`` at level 0 (bucket size).
    * ``publish(tx, lane, warp, hist, wred, Dst, Part, s, x, g, a, ix)``: add this CTA's non-zero bins
      to ``Dst[ix.row, ix.lvl*2048 + bin]`` (global atomics) and write its suffix counts
      ``Part[ix.row, ix.gx, ix.lvl, b] = a_total + sum_{b' >= b} hist[b']`` (``b = 2048``: ``a_total``, the keys
      above the prefix summed over the CTA from each thread's ``a``).
    * ``warp_totals(cgt, ceq, wred, lane, warp)``: warp sums of ``cgt`` / ``ceq`` to ``wred[0/1, warp]``, sync.
    * ``warp_bases(cgt, ceq, buf, warp, ix)``: ``cgt = ix.cnt0 + sum_{w < warp} buf[0, w]`` (``ceq``: ``ix.tie0``,
      ``buf[1, w]``), the warp's exclusive base.
    * ``count_sweep(...)`` / ``write_sweep(...)``: sweep A (per-warp above / tied counts over the warp's segment
      ``[warp*seg, warp*seg + seg) & [0, n)``, then ``warp_totals`` and ``warp_bases``) and sweep B (ballot/popc
      ranks; a taken element goes to slot ``x + min(s, need)``: ``Out[ix.row, slot] = ix.base + pos``, or the
      ``(key << 32) | ~pos`` composite into ``sbuf`` when ``sbuf`` is given).  Keys come from ``skeys[pos]`` when
      ``skeys`` is given, else ``to_key(Scores[ix.row, ix.base + pos])`` through the float scratch ``f1``
      (kernels that always have ``skeys`` pass ``kk`` there; it is never touched).
    * ``fill_tail(K, G, tx, kef, Out, ix)``: slots ``[kef, K)`` of row ``ix.row`` get -1, spread over G CTAs.
    * ``first_hist(U0, n, kk, fv, tx, hist, skeys, Scores, ix)``: level-0 histogram of ``n`` scores from
      ``Scores[ix.row, ix.base + i]`` (``U0`` loads in flight per thread), filling ``skeys`` when given.
    * ``cta_slice(G, n, chunk, cs, ln, cap, ix)``: CTA ``ix.gx``'s slice ``[cs, cs + ln)`` of a row cut in ``G``.
    * ``init_threshold(K, prefix, mask, done, krem, kef, need, lev, dsel)``: the state before level 0 (multi-CTA).
    * ``row_range(lo, hi, n, Starts, Ends, Flags, N, ix)``: the row's clamped ``[lo, hi)`` and ``n = hi - lo``.
    """
    import tilelang.language as T

    NT = threads
    W = NT // 32
    BPT = HBINS // NT
    u32, i32, u64 = "uint32", "int32", "uint64"
    to_key = to_key_expr

    @T.macro
    def warp_suffix_sum(x: T.Ref, g: T.Ref, lane):
        # x = sum of x over lanes >= lane (shuffle down)
        for o in T.unroll(5):
            g = T.shfl_down(x, 1 << o)
            if lane + (1 << o) < 32:
                x = x + g

    @T.macro
    def choose_digit(p, K, tx, lane, warp, hist, wred, sel, s: T.Ref, x: T.Ref, g: T.Ref, total: T.Ref, kef: T.Ref,
                     krem: T.Ref, need: T.Ref, done: T.Ref, prefix: T.Ref, mask: T.Ref, shift: T.Ref, dmask: T.Ref,
                     rec0: T.Ref, rec1: T.Ref, record_level):
        # block suffix scan of the histogram: thread tx owns bins [tx*BPT, tx*BPT + BPT)
        s = 0
        for b in T.serial(BPT):
            s = s + hist[tx * BPT + b]
        x = s
        warp_suffix_sum(x, g, lane)
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
            if record_level:
                rec0 = p
                rec1 = sel[0]
            else:
                if p == 0:
                    rec0 = sel[2]
            if sel[2] == krem or p == 2:
                done = 1

    @T.macro
    def publish(tx, lane, warp, hist, wred, Dst, Part, s: T.Ref, x: T.Ref, g: T.Ref, a: T.Ref, ix):
        s = 0
        for b in T.serial(BPT):
            s = s + hist[tx * BPT + b]
            if hist[tx * BPT + b] != 0:
                T.atomic_add(Dst[ix.row, ix.lvl * HBINS + tx * BPT + b], hist[tx * BPT + b])
        x = s
        warp_suffix_sum(x, g, lane)
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
            Part[ix.row, ix.gx, ix.lvl, tx * BPT + BPT - 1 - b] = a + g
        if tx == 0:
            Part[ix.row, ix.gx, ix.lvl, HBINS] = a

    @T.macro
    def warp_totals(cgt: T.Ref, ceq: T.Ref, wred, lane, warp):
        cgt = T.warp_reduce_sum(cgt)
        ceq = T.warp_reduce_sum(ceq)
        if lane == 0:
            wred[0, warp] = cgt
            wred[1, warp] = ceq
        T.sync_threads()

    @T.macro
    def warp_bases(cgt: T.Ref, ceq: T.Ref, buf, warp, ix):
        cgt = ix.cnt0
        ceq = ix.tie0
        for w2 in T.serial(W):
            if w2 < warp:
                cgt = cgt + buf[0, w2]
                ceq = ceq + buf[1, w2]

    @T.macro
    def load_key(kk: T.Ref, f1: T.Ref, pos: T.Ref, skeys, Scores, ix):
        if skeys is not None:
            kk = skeys[pos]
        else:
            f1 = Scores[ix.row, ix.base + pos]
            kk = to_key(f1)

    @T.macro
    def count_sweep(seg, lane, warp, n: T.Ref, kk: T.Ref, f1: T.Ref, pos: T.Ref, cgt: T.Ref, ceq: T.Ref,
                    mask: T.Ref, prefix: T.Ref, wred, skeys, Scores, ix):
        cgt = 0
        ceq = 0
        for j in T.serial(seg // 32):
            pos = warp * seg + j * 32 + lane
            if pos < n:
                load_key(kk, f1, pos, skeys, Scores, ix)
                if (kk & mask) > prefix:
                    cgt = cgt + 1
                elif kk != T.uint32(0) and (kk & mask) == prefix:
                    ceq = ceq + 1
        warp_totals(cgt, ceq, wred, lane, warp)
        warp_bases(cgt, ceq, wred, warp, ix)

    @T.macro
    def write_sweep(seg, lane, warp, n: T.Ref, kk: T.Ref, f1: T.Ref, pos: T.Ref, cgt: T.Ref, ceq: T.Ref,
                    mask: T.Ref, prefix: T.Ref, x: T.Ref, s: T.Ref, need: T.Ref, skeys, Scores, Out, sbuf, ix):
        for j in T.serial(seg // 32):
            kk = T.uint32(0)
            pos = warp * seg + j * 32 + lane
            if pos < n:
                load_key(kk, f1, pos, skeys, Scores, ix)
            if lean_ranks:
                # 32-bit ballots and lane mask (the 64-bit forms cost extra integer instructions per element)
                bg = T.Cast(u32, T.ballot_sync((kk & mask) > prefix))
                be = T.Cast(u32, T.ballot_sync(kk != T.uint32(0) and (kk & mask) == prefix))
                lt = (T.uint32(1) << T.Cast(u32, lane)) - T.uint32(1)
            else:
                bg = T.ballot_sync((kk & mask) > prefix)
                be = T.ballot_sync(kk != T.uint32(0) and (kk & mask) == prefix)
                lt = (T.uint64(1) << T.Cast(u64, lane)) - T.uint64(1)
            x = cgt + T.Cast(i32, T.popcount(bg & lt))
            s = ceq + T.Cast(i32, T.popcount(be & lt))
            if (kk & mask) > prefix or (kk != T.uint32(0) and (kk & mask) == prefix and s < need):
                if sbuf is not None:
                    sbuf[x + T.min(s, need)] = (T.Cast(u64, kk) << T.uint64(32)) | T.Cast(
                        u64, T.uint32(0xFFFFFFFF) - T.Cast(u32, pos))
                else:
                    Out[ix.row, x + T.min(s, need)] = ix.base + pos
            cgt = cgt + T.Cast(i32, T.popcount(bg))
            ceq = ceq + T.Cast(i32, T.popcount(be))

    @T.macro
    def fill_tail(K, G, tx, kef: T.Ref, Out, ix):
        # leftover slots [kef, K), spread over the row's CTAs
        for j in T.serial(T.ceildiv(K, G * NT)):
            if (j * G + ix.gx) * NT + tx < K and (j * G + ix.gx) * NT + tx >= kef:
                Out[ix.row, (j * G + ix.gx) * NT + tx] = -1

    @T.macro
    def first_hist(U0, n: T.Ref, kk: T.Ref, fv, tx, hist, skeys, Scores, ix):
        # level-0 histogram (top 11 bits) of the keys of Scores[ix.row, ix.base : ix.base + n], U0 loads in flight
        # per thread; with skeys the keys are also cached in shared memory
        for j in T.serial(T.ceildiv(n, NT * U0)):
            for u in T.unroll(U0):
                fv[u] = T.float32(0)
                if (j * U0 + u) * NT + tx < n:
                    fv[u] = Scores[ix.row, ix.base + (j * U0 + u) * NT + tx]
            for u in T.unroll(U0):
                if (j * U0 + u) * NT + tx < n:
                    kk = to_key(fv[u])
                    if skeys is not None:
                        skeys[(j * U0 + u) * NT + tx] = kk
                    if kk != T.uint32(0):
                        T.atomic_add(hist[T.Cast(i32, kk >> T.uint32(_SHIFTS[0]))], 1)

    @T.macro
    def cta_slice(G, n: T.Ref, chunk: T.Ref, cs: T.Ref, ln: T.Ref, cap, ix):
        # CTA gx of the row's G owns positions [cs, cs + ln) (32-aligned chunks; ln <= cap when cap is given)
        chunk = T.ceildiv(T.ceildiv(n, G), 32) * 32
        cs = T.min(ix.gx * chunk, n)
        if cap is not None:
            ln = T.min(T.min(cs + chunk, n) - cs, cap)  # the min never binds (host rule); it keeps smem in bounds
        else:
            ln = T.min(cs + chunk, n) - cs

    @T.macro
    def init_threshold(K, prefix: T.Ref, mask: T.Ref, done: T.Ref, krem: T.Ref, kef: T.Ref, need: T.Ref, lev: T.Ref,
                       dsel: T.Ref):
        # nothing decided yet (lev = -1: no level chosen, i.e. every valid element is taken)
        prefix = T.uint32(0)
        mask = T.uint32(0)
        done = 0
        krem = K
        kef = K
        need = 0
        lev = -1
        dsel = 0

    @T.macro
    def row_range(lo: T.Ref, hi: T.Ref, n: T.Ref, Starts, Ends, Flags, N, ix):
        lo = 0
        hi = N
        if (Flags & 1) != 0:
            lo = T.max(T.min(Starts[ix.row], N), 0)
        if (Flags & 2) != 0:
            hi = T.max(T.min(Ends[ix.row], N), 0)
        n = T.max(hi - lo, 0)

    return Ix(choose_digit=choose_digit, publish=publish, warp_totals=warp_totals, warp_bases=warp_bases,
              count_sweep=count_sweep, write_sweep=write_sweep, fill_tail=fill_tail, first_hist=first_hist,
              cta_slice=cta_slice, init_threshold=init_threshold, row_range=row_range)


# ---- host side ----------------------------------------------------------------------------------------------------

_DUMMY: dict = {}


def cached_dummy(dev):
    """A cached 1-element int32 tensor for the starts/ends arguments that are not given (never read)."""
    t = _DUMMY.get(dev)
    if t is None:
        t = _DUMMY[dev] = torch.zeros((1,), dtype=torch.int32, device=dev)
    return t


sm_count = _dispatch.sm_count


def new_output(scores, k):
    """``(out, scores)``: ``out`` = a fresh ``[M, k]`` int32 tensor; ``scores`` is None when ``out`` is already the
    answer (M == 0, or N == 0: all -1), else ``scores`` with the canonical strides of its size-1 dims (torch lets
    them carry any stride; same storage)."""
    M, N = scores.shape
    out = torch.empty((M, k), dtype=torch.int32, device=scores.device)
    if M == 0:
        return out, None
    if N == 0:
        return out.fill_(-1), None
    if (N == 1 and scores.stride(1) != 1) or (M == 1 and scores.stride(0) != N):
        scores = scores.as_strided((M, N), (N if M == 1 else scores.stride(0), 1))
    return out, scores


def range_args(starts, ends, dev, fresh_dummy: bool = False):
    """``(st, en, flags)`` kernel arguments: the given int32 starts / ends (contiguous) or a dummy (cached, or a
    fresh ``torch.empty`` with ``fresh_dummy``) and ``flags`` bit 0 = starts given, bit 1 = ends given."""
    dummy = None
    if starts is None or ends is None:
        dummy = torch.empty((1,), dtype=torch.int32, device=dev) if fresh_dummy else cached_dummy(dev)
    st = starts.contiguous() if starts is not None else dummy
    en = ends.contiguous() if ends is not None else dummy
    flags = (1 if starts is not None else 0) | (2 if ends is not None else 0)
    return st, en, flags
