"""The dense decode's split plan as ONE TileLang kernel (one CTA), replacing ~20 small torch launches.

Notes
-----
Computes exactly what ``kernel_dense._plan`` computes with torch ops (see its docstring; integers only, so the
two are bit-identical): with ``lens = clamp(cache_seqlens, 0, cap)``, ``tiles = ceil(lens / tile)``,
``chunk = max(ceil((sum tiles + B * overhead) * n_mt / num_sms), min_chunk)`` and ``nsplit = max(ceil(tiles /
chunk), 1)``, sequence b owns the work items ``first_b .. first_b + nsplit_b - 1`` (``first`` = exclusive prefix sum
of ``nsplit``); item ``first_b + k`` covers positions ``[k*chunk*tile, min((k+1)*chunk*tile, lens_b))``.
Outputs ``Plan [4, n_items]`` (b or -1, start, end, nsplit_b; idle items -1, 0, 0, 0) and ``SeqPlan [2, B]``
(first_b, nsplit_b).

Why: on the H200 the torch version costs ~20 launches per decode call: at B 64, H 16, cache 8192 the eager call
took 0.70 ms against 0.44 ms replayed from a CUDA graph and 0.365 ms for the two decode kernels alone
(``scripts/bench_decode.py``, session 4).

One CTA of ``THREADS`` threads: (1) each thread sums the tiles of its sequences (int64), a shared-memory tree
reduction gives the total and thread 0 the chunk; (2) sequences in rounds of ``THREADS``: a Hillis-Steele scan of
nsplit in shared memory (with the running carry) gives first_b, then each thread writes its sequence's items;
(3) items past the total are written idle.  Sums and positions are int64 (B x tiles can pass 2^31).
"""

import functools

import tilelang
import tilelang.language as T

THREADS = 256


def build_plan_kernel(*, tile: int, n_mt: int, num_sms: int, overhead: int, min_chunk: int, threads: int = THREADS):
    """prim_func ``(Lens [B] i32, Plan [4, n_items] i32, SeqPlan [2, B] i32, Cap i32)``; B, n_items dynamic;
    ``Cap`` = max_blocks * block_size (positions past the block table are never attended)."""
    NT = threads
    LOG = NT.bit_length() - 1
    assert 1 << LOG == NT
    B, NI = T.dynamic("B"), T.dynamic("n_items")
    i32, i64 = "int32", "int64"

    @T.prim_func
    def decode_plan(Lens: T.Tensor([B], i32), Plan: T.Tensor([4, NI], i32), SeqPlan: T.Tensor([2, B], i32),
                    Cap: T.int32):
        with T.Kernel(1, threads=NT) as _:
            tx = T.get_thread_binding()
            red = T.alloc_shared([NT], i64)
            scan = T.alloc_shared([2, NT], i64)  # ping-pong buffers of the scan
            sh = T.alloc_shared([2], i64)  # chunk, running carry (items so far)
            acc = T.alloc_var(i64)
            v = T.alloc_var(i64)
            # (1) total tiles -> chunk
            acc = T.int64(0)
            for r in T.serial(T.ceildiv(B, NT)):
                if r * NT + tx < B:
                    acc = acc + T.ceildiv(T.Cast(i64, T.clamp(Lens[r * NT + tx], 0, Cap)), tile)
            red[tx] = acc
            T.sync_threads()
            for s in T.unroll(LOG):
                if tx < (NT >> (s + 1)):
                    red[tx] = red[tx] + red[tx + (NT >> (s + 1))]
                T.sync_threads()
            if tx == 0:
                sh[0] = T.max(T.ceildiv((red[0] + T.Cast(i64, B) * overhead) * n_mt, num_sms), T.int64(min_chunk))
                sh[1] = T.int64(0)
            T.sync_threads()
            # (2) per round of NT sequences: inclusive scan of nsplit, then the items of each sequence
            for r in T.serial(T.ceildiv(B, NT)):
                b = r * NT + tx
                ln = T.Cast(i64, T.clamp(Lens[T.min(b, B - 1)], 0, Cap))
                ns = T.if_then_else(b < B, T.max(T.ceildiv(T.ceildiv(ln, tile), sh[0]), T.int64(1)), T.int64(0))
                scan[0, tx] = ns
                T.sync_threads()
                for s in T.unroll(LOG):
                    v = scan[s % 2, tx]
                    if tx >= (1 << s):
                        v = v + scan[s % 2, tx - (1 << s)]
                    scan[(s + 1) % 2, tx] = v
                    T.sync_threads()
                first = sh[1] + scan[LOG % 2, tx] - ns
                if b < B:
                    SeqPlan[0, b] = T.Cast(i32, first)
                    SeqPlan[1, b] = T.Cast(i32, ns)
                    for k in T.serial(T.Cast(i32, ns)):
                        k64 = T.Cast(i64, k)
                        if first + k64 < NI:
                            Plan[0, first + k64] = b
                            Plan[1, first + k64] = T.Cast(i32, k64 * sh[0] * tile)
                            Plan[2, first + k64] = T.Cast(i32, T.min((k64 + 1) * sh[0] * tile, ln))
                            Plan[3, first + k64] = T.Cast(i32, ns)
                T.sync_threads()  # every thread read sh[1] and the scan
                if tx == NT - 1:
                    sh[1] = sh[1] + scan[LOG % 2, NT - 1]
                T.sync_threads()
            # (3) idle items
            for r in T.serial(T.ceildiv(NI, NT)):
                it = r * NT + tx
                if it < NI and it >= sh[1]:
                    Plan[0, it] = -1
                    Plan[1, it] = 0
                    Plan[2, it] = 0
                    Plan[3, it] = 0

    return decode_plan


def _pass_configs():
    # every barrier above is explicit; the automatic pass would add more around the scan's ping-pong buffers
    return {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


@functools.lru_cache(maxsize=32)
def compiled_plan(tile: int, n_mt: int, num_sms: int, overhead: int, min_chunk: int):
    func = build_plan_kernel(tile=tile, n_mt=n_mt, num_sms=num_sms, overhead=overhead, min_chunk=min_chunk)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())
