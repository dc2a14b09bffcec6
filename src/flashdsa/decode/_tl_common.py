"""Pieces shared by the dense decode partial kernels ("pipelined" in ``kernel_dense.py``, "ws" in
``kernel_dense_ws.py``): the MLA shape constants and the one prim_func signature both kernels have.

Each builder writes its kernel body as a ``T.macro`` over the ten tensors and hands it to ``partial_prim_func``,
which wraps it in the shared signature and names the kernel; the generated CUDA is the same as with the signature
written out in each module (the macro is inlined when the prim_func is parsed).

TileLang is imported lazily (``kernel_dense`` must import without it, for the dispatcher's checks).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

DQK = 576  # q / cache row: 512 latent dims (also V) + 64 rope dims
D_V = 512
D_ROPE = DQK - D_V


def partial_sizes():
    """The symbolic sizes of the partial kernels' signature: (batch, num_blocks, max_blocks, max_items, n_sink)."""
    import tilelang.language as T

    return (T.dynamic("batch"), T.dynamic("num_blocks"), T.dynamic("max_blocks"), T.dynamic("max_items"),
            T.dynamic("n_sink"))


def partial_prim_func(name: str, body, *, M: int, block_size: int, sizes):
    """prim_func ``name`` with the split-KV partial signature whose body is the macro ``body`` (called with the
    ten tensors in signature order):

    (Q [B, M, 576] bf16, KV [num_blocks, block_size, 576] bf16, BlockTable [B, max_blocks] i32, SeqLens [B] i32,
    Plan [4, max_items] i32 (b or -1, start, end, nsplit_b), Sink [n_sink] f32, Out [B, M, 512] bf16,
    Lse [B, M] f32, OPart [max_items, M, 512] f32, LsePart [max_items, M] f32), with ``sizes`` from
    ``partial_sizes()`` (the same Vars the body uses).
    """
    import tilelang.language as T

    nbat, nblk, maxb, nitem, n_sink = sizes
    bs, D = int(block_size), D_V
    bf16, f32, i32 = "bfloat16", "float32", "int32"

    @T.prim_func
    def mla_decode_dense_partial(
        Q: T.Tensor([nbat, M, DQK], bf16),
        KV: T.Tensor([nblk, bs, DQK], bf16),
        BlockTable: T.Tensor([nbat, maxb], i32),
        SeqLens: T.Tensor([nbat], i32),
        Plan: T.Tensor([4, nitem], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([nbat, M, D], bf16),
        Lse: T.Tensor([nbat, M], f32),
        OPart: T.Tensor([nitem, M, D], f32),
        LsePart: T.Tensor([nitem, M], f32),
    ):
        body(Q, KV, BlockTable, SeqLens, Plan, Sink, Out, Lse, OPart, LsePart)

    return mla_decode_dense_partial.with_attr("global_symbol", name)


def item_macros(*, M: int, s_q: int, causal: bool, BH: int, BI: int, heads: int = 0, has_sink: bool = False,
                c_log2: float = 0.0, bar_wg0: int = 8):
    """(load_item, start_item, wg0_finish): the work-item header and WG0's epilogue of the warp-specialised partial
    kernel ("ws", ``kernel_dense_ws``).

    * ``load_item(Plan, info, item)``: ``info[0:4]`` = (b or -1, start, end, nsplit) of work item ``item``.
    * ``start_item(Q, SeqLens, Q_l, Q_r, Q_t, info, b, m0, tx)`` (inside ``info[0] >= 0``): ``info[4]`` = the causal
      offset (row m sees p < seqlen - s_q + 1 + m // heads; 0 without causal), ``info[5]`` = tiles of ``BI`` keys
      in the split; the 256 consumer threads load rows ``m0 .. m0 + BH`` of Q (zeros past M; 16-byte vectors, 384
      threads would give scalar copies), fence for the async proxy, then one ``__syncthreads``.
    * ``wg0_finish(...)``: WG0's epilogue -- the normaliser (sink folded only for a sequence written directly,
      ``info[3] == 1``) to ``Fin_s`` + arrive ``fin``, then either the bf16 output (staged through the dead Q_l) and
      the natural-log lse, or the fp32 partial output and its base-2 lse for the combine kernel.
    """
    import tilelang.language as T

    DH, D, DT = D_V // 2, D_V, D_ROPE
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def load_item(Plan, info, item):
        info[0] = Plan[0, item]  # b (-1: idle item)
        info[1] = Plan[1, item]  # start (multiple of the tile)
        info[2] = Plan[2, item]  # end
        info[3] = Plan[3, item]  # nsplit of this sequence

    @T.macro
    def start_item(Q, SeqLens, Q_l, Q_r, Q_t, info, b, m0, tx):
        # causal: row m (query i = m // heads) sees p < seqlen - s_q + 1 + i
        info[4] = SeqLens[b] - s_q + 1 if causal else 0
        info[5] = T.ceildiv(info[2] - info[1], BI)  # tiles of this split
        if tx < 256:
            for h, d in T.Parallel(BH, DH):
                Q_l[h, d] = T.if_then_else(m0 + h < M, Q[b, T.min(m0 + h, M - 1), d], T.cast(0, bf16))
            for h, d in T.Parallel(BH, DH):
                Q_r[h, d] = T.if_then_else(m0 + h < M, Q[b, T.min(m0 + h, M - 1), DH + d], T.cast(0, bf16))
            for h, d in T.Parallel(BH, DT):
                Q_t[h, d] = T.if_then_else(m0 + h < M, Q[b, T.min(m0 + h, M - 1), D + d], T.cast(0, bf16))
            T.fence_proxy_async()
        T.sync_threads()

    @T.macro
    def wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, Out, LsePart, OPart, Q_l, info, b, item, m0):
        for h in T.Parallel(BH):
            if has_sink:
                inv[h] = T.if_then_else(
                    l_i[h] > 0,
                    T.if_then_else(
                        info[3] == 1,
                        1.0 / (l_i[h] + T.exp2(Sink[(m0 + h) % heads] * T.float32(LOG2E)
                                               - m_i[h] * c_log2)),
                        1.0 / l_i[h]),
                    T.float32(0))
            else:
                inv[h] = T.if_then_else(l_i[h] > 0, 1.0 / l_i[h], T.float32(0))
        T.copy(inv, Fin_s)
        T.barrier_arrive(fin)
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * inv[h]
        if info[3] == 1:
            for h in T.Parallel(BH):
                if m0 + h < M:
                    Lse[b, m0 + h] = T.if_then_else(
                        l_i[h] > 0, (T.log2(l_i[h]) + m_i[h] * c_log2) * T.float32(LN2), T.infinity(f32))
            T.sync_threads(bar_wg0, 128)  # all WG0 warps past their last QK (reads Q_l)
            T.copy(acc_o, Q_l)  # Q_l is dead: stage the bf16 output through it
            T.sync_threads(bar_wg0, 128)
            for h, d in T.Parallel(BH, DH):
                if m0 + h < M:
                    Out[b, m0 + h, d] = Q_l[h, d]
        else:
            for h in T.Parallel(BH):
                if m0 + h < M:
                    LsePart[item, m0 + h] = T.if_then_else(
                        l_i[h] > 0, T.log2(l_i[h]) + m_i[h] * c_log2, -T.infinity(f32))
            for h, d in T.Parallel(BH, DH):
                if m0 + h < M:
                    OPart[item, m0 + h, d] = acc_o[h, d]

    return load_item, start_item, wg0_finish


def combine_row_macro(*, heads: int, has_sink: bool, vpt: int, col, unroll: bool = False, natural: bool = False):
    """``combine_row(Sink, OPart, LsePart, Out, Lse, b, m, first, nsp, lead, t, scratch)``: the split-KV merge of
    query row ``m`` of sequence ``b`` from its ``nsp`` partials ``OPart[first + k, m]`` / ``LsePart[first + k, m]``
    (k < nsp), used by the combine kernel (``kernel_dense.build_combine_kernel``), the single-launch decode
    (``kernel_dense_fused``) and the combine of the decode forms that run as one sparse forward
    (``kernel_split``), so all merge with the same arithmetic.

    Math (base 2, ``lse2_k = -inf`` for a split that saw no key): ``mx = max_k lse2_k``; ``w_k = 2^(lse2_k - mx)``,
    ``tot = sum_k w_k``; ``out = sum_k w_k o_k / tot`` (``/ (tot + 2^(sink log2e - mx))`` with a sink, which is
    ``1 / (1 + exp(sink - lse))`` of the unsunk output), ``lse = (mx + log2 tot) ln 2``.  ``mx = -inf`` (no split
    saw a key): out = 0, lse = +inf.  The calling thread handles the ``vpt`` columns ``col(t, v)``, v < vpt
    (``col`` is a Python function of the thread's index ``t`` among the row's threads and ``v``); ``lead`` (a
    condition) picks the one thread of the row that writes ``Lse``.  ``scratch`` = (mx, tot, w, scl [1] f32,
    acc [vpt] f32) local buffers.  ``unroll``: unrolled column loops (keeps ``acc`` in registers for large vpt).

    ``natural``: the partials' lse in the sparse forward's convention (natural log, +inf for a partial that saw no
    key), taken to base 2 as they are read; and a NaN lse makes the row's out and lse NaN even where no other
    partial saw a key (``max`` drops NaN, so a flag raises ``mx`` to at least 0 and the NaN weight reaches every
    sum).  The kernels' partials never carry a NaN lse: a forward writes lse +inf wherever its l is not > 0, NaN
    included, with out NaN (NaN * 0).  So a NaN row attended by one chunk (outside the contract, which puts NaN
    only in rows no index selects) gives out NaN when another chunk of the token saw a key (finite lse), but out 0
    and lse +inf when none did, where the unsplit forward gives out NaN and lse +inf.
    """
    import tilelang.language as T

    f32, bf16 = "float32", "bfloat16"
    vloop = T.unroll if unroll else T.serial

    def lse2(x):  # a partial's lse in base 2, -inf for one that saw no key
        if not natural:
            return x
        return T.if_then_else(x == T.infinity(f32), -T.infinity(f32), x * T.float32(LOG2E))

    @T.macro
    def combine_row(Sink, OPart, LsePart, Out, Lse, b, m, first, nsp, lead, t, scratch):
        mx, tot, w, scl, acc = scratch
        mx[0] = -T.infinity(f32)
        if natural:
            nan = T.alloc_local([1], "int32")
            nan[0] = 0
            for k in T.serial(nsp):
                w[0] = LsePart[first + k, m]
                # T.isnan: the simplifier folds x != x to false (session 44's split combine lost its NaN flag so)
                nan[0] = T.if_then_else(T.isnan(w[0]), 1, nan[0])
                mx[0] = T.max(mx[0], lse2(w[0]))
            if nan[0] != 0:
                mx[0] = T.max(mx[0], T.float32(0))
        else:
            for k in T.serial(nsp):
                mx[0] = T.max(mx[0], LsePart[first + k, m])
        tot[0] = 0
        for v in vloop(vpt):
            acc[v] = 0
        if mx[0] > -T.infinity(f32):
            for k in T.serial(nsp):
                if natural:
                    w[0] = LsePart[first + k, m]
                    w[0] = T.exp2(lse2(w[0]) - mx[0])
                else:
                    w[0] = T.exp2(LsePart[first + k, m] - mx[0])
                tot[0] += w[0]
                for v in vloop(vpt):
                    acc[v] += w[0] * OPart[first + k, m, col(t, v)]
            # lse2 = mx + log2(tot); scale = 1 / tot (times the sink factor)
            if has_sink:
                scl[0] = 1.0 / (tot[0] + T.exp2(Sink[m % heads] * T.float32(LOG2E) - mx[0]))
            else:
                scl[0] = 1.0 / tot[0]
            for v in vloop(vpt):
                Out[b, m, col(t, v)] = T.cast(acc[v] * scl[0], bf16)
            if lead:
                Lse[b, m] = (T.log2(tot[0]) + mx[0]) * T.float32(LN2)
        else:
            for v in vloop(vpt):
                Out[b, m, col(t, v)] = T.cast(0, bf16)
            if lead:
                Lse[b, m] = T.infinity(f32)

    return combine_row
