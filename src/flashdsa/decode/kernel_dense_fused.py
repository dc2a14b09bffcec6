"""Dense MLA decode, narrow kernel in ONE launch (what the default variant "auto" runs where the narrow kernel fits;
also variant "narrow_fused"): each CTA derives its own work item from ``cache_seqlens`` and the last split of a
sequence merges the partials, so neither the split-plan kernel nor the combine kernel runs.

Notes
-----
Same contract, limits and per-item attention as the narrow partial kernel (``kernel_dense_narrow``, ``s_q * H <=
32``; its ``item_parts`` macros are reused as they are), same partial buffers (``kernel_dense._workspace``) and
the combine kernel's merge (``_tl_common.combine_row_macro``).

Why: the memory-bound decode (B 64, H 16, s_q 1, cache 8192) ran at 0.165 ms end to end (3.67 TB/s) while the
partial kernel alone took 0.145 ms (4.17 TB/s): the plan and combine launches and their gaps cost ~20 us.

Work item of CTA ``bx`` (grid = the static ``max_items(B, 1, num_sms * ctas_per_sm)``, as for the narrow kernel):
every CTA reads all B ``cache_seqlens`` and repeats ``kernel_dense._plan``'s integer arithmetic (``cta_item`` is
the specification, checked against ``_plan`` on CPU): ``lens = clamp(cache_seqlens, 0, max_blocks *
block_size)``, ``tiles = ceil(lens / 64)``, ``chunk = max(ceil((sum tiles + B * ovh) / num_sms), min_chunk)``
(``n_mt = 1``), ``nsplit = max(ceil(tiles / chunk), 1)``, ``first`` = the exclusive prefix sum of nsplit; CTA bx
belongs to the b with ``first_b <= bx < first_b + nsplit_b`` (``k = bx - first_b``: positions ``[k chunk 64,
min((k + 1) chunk 64, lens_b))``); past the last item it is idle.  In the kernel: per-thread tile sums (int64) + a
shared-memory tree reduction, then rounds of ``threads`` sequences with a Hillis-Steele scan of nsplit; the one
thread whose sequence owns ``bx`` publishes the item through shared memory.

Merge (``nsplit_b > 1``): every split writes its normalised fp32 ``OPart[bx]`` / base-2 ``LsePart[bx]`` as in the
narrow kernel, every thread fences (``__threadfence``: its stores are visible at GPU scope before the count), a
``__syncthreads``, then thread 0 adds 1 to ``Count[b]`` (int32, acq_rel, device scope) and broadcasts the previous
value through shared memory.  The CTA that saw ``nsplit_b - 1`` is the last: it fences again (acquire for all its
threads: the other splits' stores are observed, no stale L1 line is read), merges the ``nsplit_b`` partials of b
row by row exactly as the combine kernel does (8 threads per row, 64 columns each, column ``v * 8 + t`` so that
a warp's loads are 32-byte segments), writes the bf16 out and natural-log lse, and stores ``Count[b] = 0``.
Sequences with ``nsplit_b == 1`` write the final output directly and never touch the counter.

Counters: ``Count`` ([B] int32, ``seq_counters``) must be zero on entry and is zero again on exit (each counted
sequence is reset by its last split).  Eager calls use persistent counters per (device, current stream), allocated
zeroed on a stream's first call (regrown for a larger batch): calls on one stream run in order, calls on two
streams never share counters.  During a CUDA-graph capture every call allocates fresh counters with ``torch.zeros``
on the capturing stream, so the zero fill is a node of the graph and every replay, on whatever stream, starts from
zero.  A call aborted mid-kernel leaves its stream's counters dirty.

Verified: GPU (H200) tests at ``f1bb6f6``, when the counters were one buffer per device; the per-stream / capture
counters: CPU only so far.
"""

import functools

import torch
import tilelang
import tilelang.language as T

from . import kernel_dense as _kd
from . import kernel_dense_narrow as _kn
from ._tl_common import D_V, DQK, combine_row_macro, partial_sizes
from .._tilelang import aligned, direct_launcher, dummy

EXPECTS_WGMMA = True
MAX_ROWS = _kn.MAX_ROWS  # s_q * H handled here (kernel_dense runs "ws" above)
ROW_THREADS = 8  # threads per query row in the merge (64 of the 512 columns each)
_COUNTER_MIN = 1024  # persistent counters allocated per (device, stream) at least (grown, never shrunk)
_COUNTERS: dict = {}  # (device, stream handle) -> int32 counters, zero between calls


def cta_item(lens, item: int, *, cap: int, num_sms: int, tile: int = _kn.BLOCK_N,
             overhead: int = _kn._OVERHEAD_TILES, min_chunk: int = _kn._MIN_CHUNK_TILES, n_mt: int = 1):
    """Specification (plain Python ints) of what CTA ``item`` derives: ``(b, start, end, nsplit_b, first_b)``, or
    ``(-1, 0, 0, 0, 0)`` past the last item; equal to column ``item`` of ``kernel_dense._plan`` (``plan [4,
    max_items]`` rows b, start, end, nsplit) with the same ``cap = max_blocks * block_size``, ``num_sms``, tile,
    overhead, min_chunk, n_mt.  The kernel's ``derive_item`` does the same integer steps in parallel."""
    clamped = [min(max(int(x), 0), cap) for x in lens]
    tiles = [-(-x // tile) for x in clamped]
    work = (sum(tiles) + len(clamped) * overhead) * n_mt
    chunk = max(-(-work // num_sms), min_chunk)
    first = 0
    for b, (ln, t) in enumerate(zip(clamped, tiles)):
        ns = max(-(-t // chunk), 1)
        if first <= item < first + ns:
            k = item - first
            return b, k * chunk * tile, min((k + 1) * chunk * tile, ln), ns, first
        first += ns
    return -1, 0, 0, 0, 0


def item_macro(*, threads: int, num_sms: int, nbat, tile: int = _kn.BLOCK_N, overhead: int = _kn._OVERHEAD_TILES,
               min_chunk: int = _kn._MIN_CHUNK_TILES):
    """``derive_item(Lens, cap, Red_s, Scan_s, Item_s, wide, loc, bx, tx)``: ``Item_s[0:5]`` (shared int32) = what
    ``cta_item`` gives for work item ``bx`` (b, start, end, nsplit_b, first_b; -1, 0, 0, 0, 0 for an idle item),
    computed by all ``threads`` threads (``n_mt = 1``); ends with a ``__syncthreads``.  Buffers:
    ``Red_s [threads]`` int64 and ``Scan_s [2, threads]`` int32 shared scratch, ``wide [1]`` int64 and ``loc [3]``
    int32 local scratch; ``Lens [nbat]`` int32, ``cap`` = max_blocks * block_size."""
    NT = threads
    LOG = NT.bit_length() - 1
    assert 1 << LOG == NT
    ovh = overhead
    i32, i64 = "int32", "int64"

    @T.macro
    def derive_item(Lens, cap, Red_s, Scan_s, Item_s, wide, loc, bx, tx):
        # Item_s <- (b or -1, start, end, nsplit_b, first_b) of work item bx; cta_item is the specification.
        # wide[0]: int64 tile sum, then the chunk; loc: int32 (nsplit of this thread's sequence, scan value, carry)
        if tx < 5:  # idle (-1, 0, 0, 0, 0) unless a sequence claims bx below (after at least one barrier)
            Item_s[tx] = T.if_then_else(tx == 0, -1, 0)
        wide[0] = T.int64(0)
        for r in T.serial(T.ceildiv(nbat, NT)):
            if r * NT + tx < nbat:
                wide[0] = wide[0] + T.ceildiv(T.Cast(i64, T.clamp(Lens[r * NT + tx], 0, cap)), tile)
        Red_s[tx] = wide[0]
        T.sync_threads()
        for s in T.unroll(LOG):
            if tx < (NT >> (s + 1)):
                Red_s[tx] = Red_s[tx] + Red_s[tx + (NT >> (s + 1))]
            T.sync_threads()
        wide[0] = T.max(T.ceildiv(Red_s[0] + T.Cast(i64, nbat) * ovh, num_sms), T.int64(min_chunk))  # n_mt = 1
        loc[2] = 0
        for r in T.serial(T.ceildiv(nbat, NT)):
            b = r * NT + tx
            ln = T.Cast(i64, T.clamp(Lens[T.min(b, nbat - 1)], 0, cap))
            loc[0] = T.if_then_else(b < nbat, T.Cast(i32, T.max(T.ceildiv(T.ceildiv(ln, tile), wide[0]),
                                                                T.int64(1))), 0)
            Scan_s[0, tx] = loc[0]
            T.sync_threads()
            for s in T.unroll(LOG):  # inclusive scan, ping-pong between Scan_s[0] and Scan_s[1]
                loc[1] = Scan_s[s % 2, tx]
                if tx >= (1 << s):
                    loc[1] = loc[1] + Scan_s[s % 2, tx - (1 << s)]
                Scan_s[(s + 1) % 2, tx] = loc[1]
                T.sync_threads()
            # first_b = carry + inclusive - nsplit_b; exactly one thread of one round owns bx (if any does)
            loc[1] = loc[2] + Scan_s[LOG % 2, tx] - loc[0]
            if (b < nbat) and (bx >= loc[1]) and (bx < loc[1] + loc[0]):
                Item_s[0] = b
                Item_s[1] = T.Cast(i32, T.Cast(i64, bx - loc[1]) * wide[0] * tile)
                Item_s[2] = T.Cast(i32, T.min(T.Cast(i64, bx - loc[1] + 1) * wide[0] * tile, ln))
                Item_s[3] = loc[0]
                Item_s[4] = loc[1]
            loc[2] = loc[2] + Scan_s[LOG % 2, NT - 1]
            T.sync_threads()  # the scan buffers are rewritten by the next round; Item_s is read after the loop

    return derive_item


def _item_scratch(NT: int):
    # derive_item's buffers: Red_s, Scan_s, Item_s (b, start, end, nsplit, first + the fused kernel's previous
    # count), wide, loc
    return (T.alloc_shared([NT], "int64"), T.alloc_shared([2, NT], "int32"), T.alloc_shared([6], "int32"),
            T.alloc_local([1], "int64"), T.alloc_local([3], "int32"))


def build_item_probe_kernel(*, num_sms: int, threads: int | None = None):
    """Test kernel ``(Lens [B] i32, Items [5, n_items] i32, Cap i32)``, grid n_items: column bx = what
    ``derive_item`` gives CTA bx (b, start, end, nsplit_b, first_b; -1, 0, 0, 0, 0 when idle), to compare the
    kernel's derivation with ``kernel_dense._plan`` on the GPU (``cta_item`` is checked against it on CPU)."""
    NT = _kn.THREADS if threads is None else threads
    nbat, ni = T.dynamic("batch"), T.dynamic("n_items")
    derive_item = item_macro(threads=NT, num_sms=num_sms, nbat=nbat)

    i32 = "int32"

    @T.prim_func
    def decode_item_probe(Lens: T.Tensor([nbat], i32), Items: T.Tensor([5, ni], i32), Cap: T.int32):
        with T.Kernel(ni, threads=NT) as bx:
            tx = T.get_thread_binding()
            Red_s, Scan_s, Item_s, wide, loc = _item_scratch(NT)
            derive_item(Lens, Cap, Red_s, Scan_s, Item_s, wide, loc, bx, tx)
            if tx < 5:
                Items[tx, bx] = Item_s[tx]

    return decode_item_probe


@functools.lru_cache(maxsize=8)
def compiled_item_probe(num_sms: int):
    return tilelang.compile(build_item_probe_kernel(num_sms=num_sms), target="cuda")


def build_fused_kernel(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float, has_sink: bool,
                       num_sms: int, threads: int | None = None, stages: int | None = None,
                       loader: str | None = None):
    """Single-launch narrow decode.  ``num_sms``: the plan's work-item budget (SMs x ``_kn.ctas_per_sm``); the
    other build options are ``kernel_dense_narrow.build_partial_kernel``'s.

    Signature: (Q [B, M, 576] bf16, KV [num_blocks, block_size, 576] bf16, BlockTable [B, max_blocks] i32,
    SeqLens [B] i32, Sink [n_sink] f32, Out [B, M, 512] bf16, Lse [B, M] f32, OPart [max_items, M, 512] f32,
    LsePart [max_items, M] f32, Count [B] i32 (zero on entry, zero on exit)), M = s_q * heads; grid max_items.
    """
    M = s_q * heads
    bs = int(block_size)
    sizes = partial_sizes()
    nbat, nblk, maxb, nitem, n_sink = sizes
    threads, alloc_item, run_item = _kn.item_parts(heads=heads, s_q=s_q, block_size=bs, causal=causal,
                                                   sm_scale=sm_scale, has_sink=has_sink, threads=threads,
                                                   stages=stages, loader=loader, sizes=sizes)
    NT = threads
    derive_item = item_macro(threads=NT, num_sms=num_sms, nbat=nbat)
    TPR = ROW_THREADS
    RPP = NT // TPR  # rows merged per pass
    VPT = D_V // TPR
    D = D_V
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    combine_row = combine_row_macro(heads=heads, has_sink=has_sink, vpt=VPT, col=lambda t, v: v * TPR + t,
                                    unroll=True)

    @T.prim_func
    def mla_decode_dense_fused(
        Q: T.Tensor([nbat, M, DQK], bf16),
        KV: T.Tensor([nblk, bs, DQK], bf16),
        BlockTable: T.Tensor([nbat, maxb], i32),
        SeqLens: T.Tensor([nbat], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([nbat, M, D], bf16),
        Lse: T.Tensor([nbat, M], f32),
        OPart: T.Tensor([nitem, M, D], f32),
        LsePart: T.Tensor([nitem, M], f32),
        Count: T.Tensor([nbat], i32),
    ):
        with T.Kernel(nitem, threads=threads) as bx:
            bufs = alloc_item()
            tx = T.get_thread_binding()
            Red_s, Scan_s, Item_s, wide, loc = _item_scratch(NT)
            scratch = (T.alloc_local([1], f32), T.alloc_local([1], f32), T.alloc_local([1], f32),
                       T.alloc_local([1], f32), T.alloc_local([VPT], f32))
            info = bufs[-2]

            derive_item(SeqLens, maxb * bs, Red_s, Scan_s, Item_s, wide, loc, bx, tx)
            for j in T.serial(4):
                info[j] = Item_s[j]
            loc[0] = Item_s[4]  # first item of the sequence
            run_item(Q, KV, BlockTable, SeqLens, Sink, Out, Lse, OPart, LsePart, bufs, bx, tx)

            if info[0] >= 0:
                if info[3] > 1:
                    # release: every thread's OPart / LsePart stores reach GPU scope before thread 0 counts the CTA
                    T.call_extern("handle", "__threadfence")
                    T.sync_threads()
                    if tx == 0:
                        Item_s[5] = T.atomic_add(Count[info[0]], 1, memory_order="acq_rel", return_prev=True)
                    T.sync_threads()
                    if Item_s[5] == info[3] - 1:
                        # last split of b: acquire for every thread before reading the other splits' partials
                        T.call_extern("handle", "__threadfence")
                        for ps in T.serial(T.ceildiv(M, RPP)):
                            if ps * RPP + tx // TPR < M:
                                combine_row(Sink, OPart, LsePart, Out, Lse, info[0], ps * RPP + tx // TPR, loc[0],
                                            info[3], tx % TPR == 0, tx % TPR, scratch)
                        if tx == 0:
                            Count[info[0]] = 0  # all nsplit_b CTAs have counted: clean for the next call

    return mla_decode_dense_fused.with_attr("global_symbol", "mla_decode_dense_fused")


def _pass_configs():
    return _kn._pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads, s_q, block_size, causal, sm_scale, has_sink, num_sms, threads, stages, loader):
    func = build_fused_kernel(heads=heads, s_q=s_q, block_size=block_size, causal=causal, sm_scale=sm_scale,
                              has_sink=has_sink, num_sms=num_sms, threads=threads, stages=stages, loader=loader)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def _capturing(dev: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph (False off CUDA)."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream_key(dev: torch.device) -> int:
    """The handle of ``dev``'s current stream (0 off CUDA): the persistent counters' key with ``dev``."""
    return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0


def seq_counters(batch: int, device) -> torch.Tensor:
    """The merge counters (int32, zero) for a call of ``batch`` sequences on ``device``'s current stream.  Eager:
    the first ``batch`` entries of that (device, stream)'s persistent counters, allocated zeroed on first use
    (regrown for a larger batch), which every call leaves zero.  During a CUDA-graph capture: a fresh
    ``torch.zeros(batch)`` on the capturing stream, whose zero fill every replay runs before the kernel."""
    dev = torch.device(device)
    if _capturing(dev):
        # Not the stream's persistent counters: a graph may be replayed on any stream, concurrently with eager calls.
        # No reference is kept: allocations during a capture come from the graph's private memory pool, which stays
        # reserved for the graph while it or any tensor allocated in the capture lives (PyTorch CUDA notes, "Graph
        # memory management"), so the address recorded in the graph stays valid for every replay.  Once this tensor
        # is dropped, only later work of the same capture (after this kernel in stream order, as in eager reuse) or
        # of a capture sharing the pool (replayed in capture order) can reuse the block, and the recorded zero fill
        # runs again before the kernel in the next replay.
        return torch.zeros(batch, dtype=torch.int32, device=dev)
    key = (dev, _stream_key(dev))
    t = _COUNTERS.get(key)
    if t is None or t.numel() < batch:
        t = _COUNTERS[key] = torch.zeros(max(batch, _COUNTER_MIN), dtype=torch.int32, device=dev)
    return t[:batch]


def make_workspace(B: int, M: int, num_sms: int, dev):
    """The partial buffers of a call of ``B`` sequences and ``M = s_q * H`` rows (``kernel_dense._workspace``'s
    four views; the fused kernel reads and writes ``o_part`` / ``lse_part`` only, in stream order)."""
    return _kd._workspace(B, M, _kd.max_items(B, 1, num_sms * _kn.ctas_per_sm(M)), dev)


def run_fused(qf, kv_cache, block_table, cache_seqlens, attn_sink, out, lse, *, heads: int, s_q: int, causal: bool,
              sm_scale: float, num_sms: int, workspace=None):
    """One launch of the fused kernel into ``out [B, M, 512]`` bf16 / ``lse [B, M]`` f32 (``kernel_dense`` has
    checked the arguments and handled B = 0 and empty tables).  ``qf [B, M, 576]``, ``kv_cache [num_blocks,
    block_size, 576]``, ``block_table``, ``cache_seqlens`` contiguous; ``num_sms``: the device's SM count;
    ``workspace``: ``make_workspace(B, M, num_sms, device)`` (allocated here when None)."""
    B, M, _ = qf.shape
    dev = qf.device
    bs = kv_cache.shape[1]
    plan_sms = num_sms * _kn.ctas_per_sm(M)
    _, _, o_part, lse_part = workspace if workspace is not None else make_workspace(B, M, num_sms, dev)
    has_sink = attn_sink is not None
    sink = aligned(attn_sink) if has_sink else dummy(torch.float32, dev)
    kern = _compiled(heads, s_q, bs, bool(causal), float(sm_scale), has_sink, plan_sms, _kn.THREADS, _kn.STAGES,
                     _kn.LOADER)
    direct_launcher(kern)(qf, kv_cache, block_table, cache_seqlens, sink, out, lse, o_part, lse_part,
                          seq_counters(B, dev))


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test (TMA at bs 64, cp.async + causal
    + sink at bs 16 with 27 rows: two merge passes)."""
    cases = []
    for heads, s_q, bs, causal, sink in [(16, 1, 64, True, False), (9, 3, 16, True, True)]:
        name = f"fused_h{heads}_sq{s_q}_bs{bs}" + ("_causal" if causal else "") + ("_sink" if sink else "")
        cases.append((name, build_fused_kernel(heads=heads, s_q=s_q, block_size=bs, causal=causal,
                                               sm_scale=DQK ** -0.5, has_sink=sink, num_sms=132)))
    return cases


def combine_lowering_cases():
    """The item probe (no matrix product, so kept out of ``lowering_cases``, whose test asserts wgmma)."""
    return [("item_probe", build_item_probe_kernel(num_sms=264))]
