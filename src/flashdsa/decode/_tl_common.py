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
