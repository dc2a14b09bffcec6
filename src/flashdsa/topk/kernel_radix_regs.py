"""Exact per-row top-k by radix select with the row's keys held in registers (TileLang, sm_90a; rows <= 8192).

Notes
-----
Same algorithm, key map, digit choice and output as ``kernel_radix`` (read its notes first); what changes is where
the keys live.  ``kernel_radix`` caches the row's keys in shared memory and re-reads them in every histogram pass
and both write sweeps; ncu on 4096 x 8192 showed that kernel issue-bound (~130 thread instructions per element:
shared-memory address math, loads and per-statement bounds checks, five sweeps).  Here thread ``(warp, lane)`` owns
the fixed positions ``warp*seg + j*32 + lane`` for ``j < KPT`` (``seg`` = the warp's 32-aligned segment, as in the
write sweeps), so the pass-0 read, every histogram pass, the count sweep and the ballot write sweep all visit the
same positions in the same registers: each later pass is a few integer instructions per key, with no loads and no
bounds checks (positions outside the row hold key 0, which never matches: after level 0 the prefix's top digit is
>= 4 because every finite key is >= 0x00800000).

  * Capacity: ``threads * KPT`` keys per row (256 x 32 = 8192); longer rows go to the other kernels (the router).
  * Pass-0 loads: all KPT loads of a thread are issued before the first use (KPT in flight; one HBM latency per
    row); a position outside ``[0, n)`` or outside the warp's segment loads nothing and gets the -inf bit pattern,
    whose key is 0.
  * Only ``order`` "index" / "any" (slots in ascending position order, like ``kernel_radix``); "score" stays there.
  * Registers: KPT for the keys + ~25; ``__launch_bounds__(threads, min_ctas)`` caps them (see ``TUNED``).
"""

import functools

import torch

from ._tl_radix import _pass_configs as _radix_pass_configs
from ._tl_radix import HBINS, Ix, alloc_vars, dmask_expr, dynamic_dims, key_from_bits, new_output, radix_macros
from ._tl_radix import range_args, shift_expr

# threads -> (keys per thread, __launch_bounds__ minimum CTAs per SM); capacity threads * KPT = 8192
TUNED = {256: (32, 4), 512: (16, 2), 1024: (8, 1)}
THREADS = 256
MAX_N = 8192


def build_topk_radix_regs(*, threads: int = THREADS, kpt: int = 0, min_ctas: int = -1):
    """prim_func ``(Scores [M, N] f32 (row stride SM), Starts [NS] i32, Ends [NE] i32, Out [M, K] i32, Flags)``,
    the signature of ``kernel_radix._build_topk_radix``; rows of up to ``threads * kpt`` keys (after the range)."""
    import tilelang.language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    NT = threads
    KPT, MC = TUNED.get(NT, (MAX_N // NT, 0))
    KPT = kpt or KPT
    MC = MC if min_ctas < 0 else min_ctas
    assert NT % 32 == 0 and HBINS % NT == 0 and NT <= 1024
    W = NT // 32
    BPT = HBINS // NT
    M, N, K, NS, NE, SM = dynamic_dims("M", "N", "K", "NS", "NE", "SM")
    u32, i32 = "uint32", "int32"
    R = radix_macros(NT)

    @T.prim_func
    def topk_radix_regs(
        Scores: T.StridedTensor((M, N), (SM, 1), "float32"),
        Starts: T.Tensor((NS,), i32),
        Ends: T.Tensor((NE,), i32),
        Out: T.Tensor((M, K), i32),
        Flags: T.int32,
    ):
        with T.Kernel(M, threads=NT) as bx:
            tx = T.get_thread_binding()
            if MC > 0:
                annotate_min_blocks_per_sm(MC)
            hist = T.alloc_shared((HBINS,), i32)
            wred = T.alloc_shared((2, W), i32)
            sel = T.alloc_shared((4,), i32)
            keys = T.alloc_local((KPT,), u32)
            lane = tx % 32
            warp = tx // 32
            lo, hi, n, total, kef, krem, need, done, x, s, g, cgt, ceq, base = alloc_vars(i32, 14)
            prefix, mask, shift, dmask, km, lt = alloc_vars(u32, 6)

            R.row_range(lo, hi, n, Starts, Ends, Flags, N, Ix(row=bx))
            seg = T.ceildiv(T.ceildiv(n, W), 32) * 32  # <= 32 * KPT for n <= NT * KPT
            base = warp * seg + lane  # this thread's position j is base + 32*j
            for b in T.serial(BPT):
                hist[b * NT + tx] = 0
            # pass 0: the whole slice in flight, then keys and the top-digit histogram
            for j in T.unroll(KPT):
                keys[j] = T.uint32(0xFF800000)  # -inf: key 0
                if j * 32 < seg and base + j * 32 < n:
                    keys[j] = T.reinterpret(Scores[bx, lo + base + j * 32], u32)
            T.sync_threads()  # histogram zeroed
            for j in T.unroll(KPT):
                keys[j] = key_from_bits(keys[j])
                if keys[j] != T.uint32(0):
                    T.atomic_add(hist[T.Cast(i32, keys[j] >> T.uint32(21))], 1)
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
                        for b in T.serial(BPT):
                            hist[b * NT + tx] = 0
                        T.sync_threads()
                        # key 0 cannot match: the prefix's top digit is >= 4 (see the notes)
                        for j in T.unroll(KPT):
                            if (keys[j] & mask) == prefix:
                                T.atomic_add(hist[T.Cast(i32, (keys[j] >> shift) & dmask)], 1)
                        T.sync_threads()
                    R.choose_digit(p, K, tx, lane, warp, hist, wred, sel, s, x, g, total, kef, krem, need, done,
                                   prefix, mask, shift, dmask, s, s, False)
                    T.sync_threads()

            # count sweep: per-warp "above" / "tied" counts, warp bases
            cgt = 0
            ceq = 0
            for j in T.unroll(KPT):
                km = keys[j] & mask
                if km > prefix:
                    cgt = cgt + 1
                elif keys[j] != T.uint32(0) and km == prefix:
                    ceq = ceq + 1
            R.warp_totals(cgt, ceq, wred, lane, warp)
            R.warp_bases(cgt, ceq, wred, warp, Ix(cnt0=0, tie0=0))
            # write sweep: ranks by ballot/popc in position order (slot = #above before + min(#tied before, need))
            lt = (T.uint32(1) << T.Cast(u32, lane)) - T.uint32(1)
            for j in T.unroll(KPT):
                km = keys[j] & mask
                bg = T.Cast(u32, T.ballot_sync(km > prefix))
                x = cgt + T.Cast(i32, T.popcount(bg & lt))
                be = T.Cast(u32, T.ballot_sync(keys[j] != T.uint32(0) and km == prefix))
                s = ceq + T.Cast(i32, T.popcount(be & lt))
                if km > prefix or (keys[j] != T.uint32(0) and km == prefix and s < need):
                    Out[bx, x + T.min(s, need)] = lo + base + j * 32
                ceq = ceq + T.Cast(i32, T.popcount(be))
                cgt = cgt + T.Cast(i32, T.popcount(bg))
            for j in T.serial(T.ceildiv(K, NT)):
                if j * NT + tx < K and j * NT + tx >= kef:
                    Out[bx, j * NT + tx] = -1

    return topk_radix_regs


def supports(N: int, order: str, threads: int = THREADS) -> bool:
    """Shape rule of the router: rows fit the registers and the order needs no sort."""
    kpt = TUNED.get(threads, (MAX_N // threads, 0))[0]
    return order in ("index", "any") and N <= threads * kpt


def _pass_configs(unsafe_loads: bool = True) -> dict:
    """The radix kernels' pass configs plus, with ``unsafe_loads``, no automatic bounds check on the score loads
    (each load is already guarded by the position test)."""
    import tilelang

    pc = dict(_radix_pass_configs())
    if unsafe_loads:
        pc[tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
    return pc


@functools.lru_cache(maxsize=16)
def _compiled(threads: int, kpt: int = 0, min_ctas: int = -1, unsafe_loads: bool = True):
    import tilelang

    func = build_topk_radix_regs(threads=threads, kpt=kpt, min_ctas=min_ctas)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs(unsafe_loads))


def run_topk_indices_regs(scores, k, starts=None, ends=None, *, threads: int = THREADS, kpt: int = 0,
                          min_ctas: int = -1, unsafe_loads: bool = True) -> torch.Tensor:
    """``[M, k]`` int32 positions in ascending order (arguments validated by ``kernel_radix.run_topk_indices``);
    N <= threads * KPT.  No host synchronisation."""
    M, N = scores.shape
    kp = kpt or TUNED.get(threads, (MAX_N // threads, 0))[0]
    if N > threads * kp:
        raise ValueError(f"topk registers kernel: N={N} > {threads * kp} keys per row")
    out, scores = new_output(scores, k)
    if scores is None:
        return out
    st, en, flags = range_args(starts, ends, scores.device)
    _compiled(threads, kpt, min_ctas, unsafe_loads)(scores, st, en, out, flags)
    return out


EXPECTS_WGMMA = False


def lowering_cases():
    return [(f"regs_t{THREADS}", build_topk_radix_regs())]
